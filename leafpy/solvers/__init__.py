"""Solvers: the Solver, its config and learning-rate policies (solver.py), one module per update rule, and the
rule registry (registry.py)."""

from __future__ import annotations

from .registry import register_rule, update_rules
from .solver import LR_POLICIES, Solver, SolverConfig, UpdateRule

__all__ = ["LR_POLICIES", "Solver", "SolverConfig", "UpdateRule", "register_rule", "update_rules"]
