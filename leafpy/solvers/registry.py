"""The update-rule registry: each rule module registers its UpdateRule with ``register_rule``; ``update_rules``
imports every module of this package on first use, so nothing lists the rules by hand. A rule's update is by
default its line of leafpy.backends.updates.TABLE (see UpdateRule): a new rule is that line, its UpdateRule (name,
state names, the config fields of its hyper-parameters) and a test."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

_RULES: dict[str, type] = {}
_NOT_RULES = {"__init__", "solver", "registry"}
_loaded: list[bool] = []  # whether this package's rule modules have been imported


def register_rule(cls: type) -> type:
    """Class decorator registering an UpdateRule under its ``name``."""
    _RULES[cls.name] = cls  # type: ignore[attr-defined]
    return cls


def update_rules() -> dict[str, type]:
    """Registered update rules by name (every module in this package registers itself on first use)."""
    if not _loaded:  # a rule registered from elsewhere first leaves these still to import
        package = __name__.rpartition(".")[0]
        for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
            if info.name not in _NOT_RULES:
                importlib.import_module(f"{package}.{info.name}")
        _loaded.append(True)
    return dict(_RULES)
