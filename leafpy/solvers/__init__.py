"""Solvers: the Solver, its config and learning-rate policies (solver.py), one module per update rule."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

_RULES: dict[str, type] = {}


def register_rule(cls: type) -> type:
    """Class decorator registering an UpdateRule under its ``name``."""
    _RULES[cls.name] = cls
    return cls


def update_rules() -> dict[str, type]:
    """Registered update rules by name (every module in this package registers itself on first use)."""
    if not _RULES:
        for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
            if info.name != "solver":
                importlib.import_module(f"{__name__}.{info.name}")
    return dict(_RULES)


from .solver import LR_POLICIES, Solver, SolverConfig, UpdateRule  # noqa: E402

__all__ = ["LR_POLICIES", "Solver", "SolverConfig", "UpdateRule", "register_rule", "update_rules"]
