"""Sigmoid: 1 / (1 + exp(-x)), computed as 0.5 * (1 + tanh(x / 2)) (as Caffe does): no overflow for any x, and
an absolute error within the precision's rounding; far in the negative tail (x below about -10 in float32) the
relative error grows and the result reaches 0 near x = -17."""

from __future__ import annotations

from ..layer import register_layer
from .elementwise import ElementwiseActivation


@register_layer("Sigmoid")
class Sigmoid(ElementwiseActivation):
    formula = "sigmoid"
