"""TanH: tanh(x)."""

from __future__ import annotations

from ..layer import register_layer
from .elementwise import ElementwiseActivation


@register_layer("TanH")
class TanH(ElementwiseActivation):
    formula = "tanh"
