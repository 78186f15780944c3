"""MeanSquaredError: mean over all elements of (prediction - target)²; the target has the prediction's shape
(or the same number of elements per sample)."""

from __future__ import annotations

import math

from ...errors import ShapeError
from ..layer import Worker, register_layer


@register_layer("MeanSquaredError")
class MeanSquaredError(Worker):
    num_inputs = 2
    differentiable = (True, False)

    def __init__(self, config, layer_name):
        super().__init__(config, layer_name)
        self.diff = None

    def output_shapes(self, input_shapes):
        pred, target = (tuple(s) for s in input_shapes)
        if not pred or not target or target[0] != pred[0] or math.prod(target) != math.prod(pred):
            raise ShapeError(f"{self.where}: expected a target of the prediction's shape {pred}, got {target}")
        return [(1,)]

    def setup(self, backend, input_shapes):
        shape = tuple(input_shapes[0])
        if self.diff is None or self.diff.shape != shape:
            self.diff = backend.view(backend.allocate(math.prod(shape), backend.dtype), shape)

    def forward(self, backend, x, w, y):
        backend.mse(x[0], x[1], self.diff, y[0])

    def backward_input(self, backend, x, y, dy, w, dx):
        if dx[0] is not None:
            backend.mse_grad(self.diff, dy[0], dx[0])
