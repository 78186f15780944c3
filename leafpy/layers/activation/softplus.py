"""Softplus: log(1 + exp(beta * x)) / beta, and x itself where beta * x > threshold (PyTorch's definition)."""

from __future__ import annotations

from dataclasses import dataclass

from ... import _checks
from ..layer import register_layer
from .elementwise import ElementwiseActivation


@dataclass(frozen=True, kw_only=True)
class SoftplusConfig:
    beta: float = 1.0
    threshold: float = 20.0

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "beta", _checks.number("SoftplusConfig.beta", self.beta, minimum=0.0, min_open=True))
        s(self, "threshold", _checks.number("SoftplusConfig.threshold", self.threshold))


@register_layer("Softplus", SoftplusConfig)
class Softplus(ElementwiseActivation):
    """The gradient, sigmoid(beta * x), is read from the input: from the output it would be 1 - exp(-beta * y), which
    differs from the exact value by up to exp(-threshold) just below the threshold."""

    formula = "softplus"
