"""Sigmoid: 1 / (1 + exp(-x)), computed from e = exp(-|x|) as 1 / (1 + e) for x > 0 and e / (1 + e) below: no
overflow for any x, and the small values of the negative tail keep their relative precision (the pointwise
table's formula, one for every backend)."""

from __future__ import annotations

from ..layer import register_layer
from .elementwise import ElementwiseActivation


@register_layer("Sigmoid")
class Sigmoid(ElementwiseActivation):
    formula = "sigmoid"
