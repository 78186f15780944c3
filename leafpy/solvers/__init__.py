"""Solvers: the Solver, its config and learning-rate policies, one module per update rule."""
