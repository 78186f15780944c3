"""Linear (fully connected): ``y = x·Wᵀ + b`` with W of shape [output_size, input_size]; the input [N, ...] is
flattened to [N, input_size].

``axis`` (Caffe's InnerProduct axis, default 1): the axes from ``axis`` on are flattened into the features and
the axes before it are kept, so ``axis: -1`` (or 2) applies the layer at every step of a sequence [N, T, H],
giving [N, T, output_size]."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

from ... import _checks
from ...errors import ShapeError
from ..layer import Worker, register_layer


@dataclass(frozen=True, kw_only=True)
class LinearConfig:
    output_size: int
    bias: bool = True
    axis: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_size", _checks.positive_int("LinearConfig.output_size", self.output_size))
        if not isinstance(self.bias, bool):
            raise _checks.ConfigError(f"LinearConfig.bias: expected true or false, got {self.bias!r}")
        if isinstance(self.axis, bool) or not isinstance(self.axis, int) or self.axis == 0:
            raise _checks.ConfigError(f"LinearConfig.axis: expected the first axis of the features (1: all but the "
                                      f"batch; -1: the last axis, per time step), not 0, got {self.axis!r}")


@register_layer("Linear", LinearConfig)
class Linear(Worker):
    weight_names: tuple[str, ...] = ("weight", "bias")

    def __init__(self, config: LinearConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        if not config.bias:
            self.weight_names = ("weight",)

    def _axis(self, shape) -> int:
        """Where the features start in an input of this shape."""
        axis, n = self.config.axis, len(shape)
        if not -n < axis < n or axis % n == 0:
            raise ShapeError(f"{self.where}: axis {axis} does not leave the batch axis and a feature axis in an input "
                             f"of shape {tuple(shape)}; choose an axis from 1 to {len(shape) - 1} (or -1)")
        return axis % len(shape)

    def output_shapes(self, input_shapes):
        if not input_shapes[0]:
            raise ShapeError(f"{self.where}: expected an input [N, ...] whose first dimension is the batch, got a "
                             "scalar (shape ()); give an array of shape [N, features]")
        if self.config.axis == 1:
            return [(input_shapes[0][0], self.config.output_size)]
        shape = tuple(input_shapes[0])
        return [(*shape[:self._axis(shape)], self.config.output_size)]

    def _rows(self, a, output: bool = False):
        """``a`` as [rows, features]: the kept axes flattened into rows. The axis counts in the input's shape, so
        an output (or its gradient), [kept..., output_size], keeps every axis but its last."""
        if self.config.axis == 1:
            return a.reshape(a.shape[0], -1)
        if output:
            return a.reshape(-1, a.shape[-1])
        return a.reshape(math.prod(a.shape[:self._axis(a.shape)]), -1)

    def weight_shapes(self, input_shapes):
        k = math.prod(input_shapes[0][1 if self.config.axis == 1 else self._axis(input_shapes[0]):])
        shapes = [(self.config.output_size, k)]
        if self.config.bias:
            shapes.append((self.config.output_size,))
        return shapes

    @contextmanager
    def _written_rows(self, backend, a, output: bool):
        """:meth:`_rows` of a buffer written here: a 4-D buffer stored channels-last is not row-major, so its rows
        are a copy, written back afterwards."""
        rows = self._rows(a, output)
        yield rows
        if backend.memory_order(a.shape) is not None and not a.flags.c_contiguous:
            backend.copy(rows, a)

    def forward(self, backend, x, w, y):
        with self._written_rows(backend, y[0], True) as y2:
            backend.gemm(self._rows(x[0]), False, w[0], True, y2)
            if self.config.bias:
                backend.bias_add(y2, w[1])

    def backward_input(self, backend, x, y, dy, w, dx):
        if dx[0] is not None:
            with self._written_rows(backend, dx[0], False) as d:
                backend.gemm(self._rows(dy[0], True), False, w[0], False, d)

    def backward_parameters(self, backend, x, y, dy, dw, beta):
        dy2 = self._rows(dy[0], True)
        backend.gemm(dy2, True, self._rows(x[0]), False, dw[0], 1.0, beta[0])
        if self.config.bias:
            backend.bias_grad(dy2, dw[1], beta[1])
