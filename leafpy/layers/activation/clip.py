"""Clip: x limited to [lower, upper] (PyTorch's ReLU6 with the defaults 0 and 6, Hardtanh with -1 and 1; ONNX's
Clip). The gradient passes where lower < x < upper, read from the output, so the layer may run in place."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import _checks
from ...errors import ConfigError
from ..layer import register_layer
from .elementwise import ElementwiseActivation

F32_MAX = float(np.finfo(np.float32).max)
"""The bound that leaves a side open (every float32 value lies within it)."""


@dataclass(frozen=True, kw_only=True)
class ClipConfig:
    lower: float = 0.0
    upper: float = 6.0
    """Finite, lower < upper; ``-F32_MAX`` or ``F32_MAX`` leave that side open."""

    def __post_init__(self) -> None:
        lower = _checks.number("ClipConfig.lower", self.lower)
        upper = _checks.number("ClipConfig.upper", self.upper)
        if not lower < upper:
            raise ConfigError(f"ClipConfig: lower ({lower:g}) must be below upper ({upper:g}); give lower < upper "
                              "(ReLU6: lower 0, upper 6)")
        object.__setattr__(self, "lower", lower)
        object.__setattr__(self, "upper", upper)


@register_layer("Clip", ClipConfig)
class Clip(ElementwiseActivation):
    formula = "clip"
