"""Flatten: [N, ...] -> [N, prod(...)], the same data seen with another shape."""

from __future__ import annotations

import math

from ..layer import register_layer
from .reshape import ViewWorker


@register_layer("Flatten")
class Flatten(ViewWorker):
    def output_shapes(self, input_shapes):
        shape = tuple(input_shapes[0])
        return [(shape[0], math.prod(shape[1:]))]
