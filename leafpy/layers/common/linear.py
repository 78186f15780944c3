"""Linear (fully connected): ``y = x·Wᵀ + b`` with W of shape [output_size, input_size]; the input [N, ...] is
flattened to [N, input_size]."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import _checks
from ...errors import ShapeError
from ..layer import Worker, register_layer


@dataclass(frozen=True, kw_only=True)
class LinearConfig:
    output_size: int
    bias: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_size", _checks.positive_int("LinearConfig.output_size", self.output_size))
        if not isinstance(self.bias, bool):
            raise _checks.ConfigError(f"LinearConfig.bias: expected true or false, got {self.bias!r}")


@register_layer("Linear", LinearConfig)
class Linear(Worker):
    weight_names: tuple[str, ...] = ("weight", "bias")

    def __init__(self, config: LinearConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        if not config.bias:
            self.weight_names = ("weight",)

    def output_shapes(self, input_shapes):
        if not input_shapes[0]:
            raise ShapeError(f"{self.where}: expected an input [N, ...] whose first dimension is the batch, got a "
                             "scalar (shape ()); give an array of shape [N, features]")
        return [(input_shapes[0][0], self.config.output_size)]

    def weight_shapes(self, input_shapes):
        k = math.prod(input_shapes[0][1:])
        shapes = [(self.config.output_size, k)]
        if self.config.bias:
            shapes.append((self.config.output_size,))
        return shapes

    def forward(self, backend, x, w, y):
        x2 = x[0].reshape(x[0].shape[0], -1)
        backend.gemm(x2, False, w[0], True, y[0])
        if self.config.bias:
            backend.bias_add(y[0], w[1])

    def backward_input(self, backend, x, y, dy, w, dx):
        if dx[0] is not None:
            backend.gemm(dy[0], False, w[0], False, dx[0].reshape(dx[0].shape[0], -1))

    def backward_parameters(self, backend, x, y, dy, dw, beta):
        x2 = x[0].reshape(x[0].shape[0], -1)
        backend.gemm(dy[0], True, x2, False, dw[0], 1.0, beta[0])
        if self.config.bias:
            backend.bias_grad(dy[0], dw[1], beta[1])
