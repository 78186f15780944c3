"""Sigmoid: 1 / (1 + exp(-x))."""

from __future__ import annotations

from ..layer import register_layer
from .elementwise import ElementwiseActivation


@register_layer("Sigmoid")
class Sigmoid(ElementwiseActivation):
    formula = "sigmoid"
