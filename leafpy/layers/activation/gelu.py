"""GELU: x * Phi(x), Phi the standard normal distribution function (Hendrycks and Gimpel, 2016); with
approximate="tanh" the tanh approximation 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as PyTorch."""

from __future__ import annotations

from dataclasses import dataclass

from ... import _checks
from ..layer import register_layer
from .elementwise import ElementwiseActivation

GELU_FORMS = {"none": "gelu", "tanh": "gelu_tanh"}


@dataclass(frozen=True, kw_only=True)
class GELUConfig:
    approximate: str = "none"

    def __post_init__(self) -> None:
        _checks.choice("GELUConfig.approximate", self.approximate, GELU_FORMS)


@register_layer("GELU", GELUConfig)
class GELU(ElementwiseActivation):
    formula = "gelu"  # both forms' gradients read the input

    def line(self) -> str:
        return GELU_FORMS[self.config.approximate]
