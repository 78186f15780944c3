"""Validation helpers for config dataclasses: each raises ConfigError naming the field, the value and the rule."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .errors import ConfigError


def positive_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        try:
            as_int = int(value)
        except (TypeError, ValueError):
            as_int = None
        if as_int is None or as_int != value or isinstance(value, bool) or as_int <= 0:
            raise ConfigError(f"{where}: expected a positive integer, got {value!r}")
        value = as_int
    return int(value)


def non_negative_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int,)) or value < 0:
        raise ConfigError(f"{where}: expected a non-negative integer, got {value!r}")
    return int(value)


def number(where: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
           min_open: bool = False, max_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    v = float(value)
    lo_bad = minimum is not None and (v <= minimum if min_open else v < minimum)
    hi_bad = maximum is not None and (v >= maximum if max_open else v > maximum)
    if lo_bad or hi_bad or v != v:
        lo = "" if minimum is None else ("(" if min_open else "[") + f"{minimum:g}"
        hi = "" if maximum is None else f"{maximum:g}" + (")" if max_open else "]")
        rng = f"{lo or '(-inf'}, {hi or 'inf)'}"
        raise ConfigError(f"{where}: expected a number in {rng}, got {value!r}")
    return v


def choice(where: str, value: Any, valid: Iterable[str]) -> str:
    valid = list(valid)
    if value not in valid:
        raise ConfigError(f"{where}: expected one of {', '.join(map(repr, valid))}, got {value!r}")
    return value


def spatial(where: str, value: Any, *, minimum: int = 1, dims: int = 2) -> tuple[int, ...]:
    """One value for every spatial dimension, or one per dimension."""
    if isinstance(value, (int,)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or len(value) not in (1, dims):
        raise ConfigError(f"{where}: expected one value or {dims} values (one per spatial dimension), got {value!r}")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            kind = "positive" if minimum >= 1 else "non-negative"
            raise ConfigError(f"{where}[{i}]: expected a {kind} integer, got {v!r}")
        out.append(int(v))
    if len(out) == 1:
        out = out * dims
    return tuple(out)


def shape(where: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty list of positive integers, got {value!r}")
    return tuple(positive_int(f"{where}[{i}]", v) for i, v in enumerate(value))
