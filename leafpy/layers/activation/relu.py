"""ReLU: max(x, 0)."""

from __future__ import annotations

from ..layer import register_layer
from .elementwise import ElementwiseActivation


@register_layer("ReLU")
class ReLU(ElementwiseActivation):
    formula = "relu"
