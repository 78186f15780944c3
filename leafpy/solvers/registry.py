"""The update-rule registry: each rule module registers its UpdateRule with ``register_rule``; ``update_rules``
imports every module of this package on first use, so nothing lists the rules by hand."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

_RULES: dict[str, type] = {}
_NOT_RULES = {"__init__", "solver", "registry"}


def register_rule(cls: type) -> type:
    """Class decorator registering an UpdateRule under its ``name``."""
    _RULES[cls.name] = cls  # type: ignore[attr-defined]
    return cls


def update_rules() -> dict[str, type]:
    """Registered update rules by name (every module in this package registers itself on first use)."""
    if not _RULES:
        package = __name__.rpartition(".")[0]
        for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
            if info.name not in _NOT_RULES:
                importlib.import_module(f"{package}.{info.name}")
    return dict(_RULES)
