"""ReLU: max(x, 0)."""

from __future__ import annotations

from ..layer import register_layer
from .elementwise import ElementwiseActivation


@register_layer("ReLU")
class ReLU(ElementwiseActivation):
    fwd, bwd = "relu", "relu_grad"
