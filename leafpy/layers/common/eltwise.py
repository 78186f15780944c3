"""Eltwise: an elementwise combination of two or more inputs, as Caffe's Eltwise layer, broadcast as NumPy does.

``operation: sum`` computes ``y = sum_i coeff_i * x_i`` (``coeff`` one number per input, all 1 when empty),
``prod`` computes ``y = prod_i x_i`` and ``max`` computes ``y = max_i x_i`` (infinities included, NaN where an
input is NaN); in ``max`` the gradient goes to the first input that holds the maximum, as in Caffe. Inputs of other
shapes than the output are broadcast (NumPy's rules: shapes aligned at their last axes, sizes equal or 1; ONNX's Add
and Mul), their gradients summed over the axes they were repeated along. The layer is built from backend primitives
(copy, axpby, scal, mul, maximum, relu and its gradient; broadcast and reduce_to for broadcast inputs), so it runs
unchanged on every backend.

``weight_shape`` (empty by default: none): the layer holds one more operand as its weight ``weight`` of this shape,
combined after the inputs (broadcast like them; one more ``coeff`` entry for it): a constant of an imported graph
(ONNX's ``Add(x, c)``, ``Mul(x, c)``), or a learnable per-feature shift or scale."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ... import _checks
from ...errors import ConfigError, ShapeError
from ..layer import FillerConfig, Worker, register_layer
from .matmul import broadcast_shape

ELTWISE_OPERATIONS = ("prod", "sum", "max")


@dataclass(frozen=True, kw_only=True)
class EltwiseConfig:
    operation: str = "sum"
    coeff: tuple[float, ...] = ()
    weight_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        s = object.__setattr__
        shape = self.weight_shape
        if not _checks.listed(shape):
            raise ConfigError(f"EltwiseConfig.weight_shape: expected a list of positive integers, got {shape!r}")
        s(self, "weight_shape", tuple(_checks.positive_int(f"EltwiseConfig.weight_shape[{i}]", d)
                                      for i, d in enumerate(shape)))
        s(self, "operation", _checks.choice("EltwiseConfig.operation", self.operation, ELTWISE_OPERATIONS))
        if not _checks.listed(self.coeff):
            raise ConfigError(f"EltwiseConfig.coeff: expected a list of numbers (one per input), got {self.coeff!r}")
        s(self, "coeff", tuple(_checks.number(f"EltwiseConfig.coeff[{i}]", c) for i, c in enumerate(self.coeff)))
        if self.coeff and self.operation != "sum":
            raise ConfigError(f"EltwiseConfig.coeff: coefficients apply to operation 'sum' only, got operation "
                              f"{self.operation!r} with coeff {list(self.coeff)}; remove coeff or use sum")
        if len(self.coeff) == 1:
            raise ConfigError("EltwiseConfig.coeff: expected one coefficient per input (at least two), got 1")


@register_layer("Eltwise", EltwiseConfig)
class Eltwise(Worker):
    def __init__(self, config: EltwiseConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        operand = bool(config.weight_shape)
        self.num_inputs = (len(config.coeff) if config.coeff else 2) - operand  # the arity for automatic wiring
        self.weight_names = ("weight",) if operand else ()
        self.scratch: dict = {}
        self.shape: tuple[int, ...] = ()
        self._w: list = []

    def _operands(self, input_shapes):
        """The shapes combined: the inputs', and the weight's where the layer has one."""
        return [tuple(s) for s in input_shapes] + ([self.config.weight_shape] if self.config.weight_shape else [])

    def weight_shapes(self, input_shapes):
        return [self.config.weight_shape] if self.config.weight_shape else []

    def default_filler(self, index):
        return FillerConfig(type="constant", value=0.0 if self.config.operation == "sum" else 1.0)

    def check_inputs(self, input_shapes):
        input_shapes = self._operands(input_shapes)
        n = len(input_shapes)
        shapes = ", ".join(str(tuple(s)) for s in input_shapes) or "none"
        if n < 2:
            raise ShapeError(f"{self.where}: expected two or more inputs, got {n} (shapes {shapes}); name them in "
                             "the layer's inputs, e.g. inputs: [a, b]")
        if self.config.coeff and len(self.config.coeff) != n:
            raise ShapeError(f"{self.where}: coeff has {len(self.config.coeff)} values but the layer has {n} "
                             f"inputs (shapes {shapes}); give one coefficient per input")
        broadcast_shape(self.where, [tuple(s) for s in input_shapes])

    def output_shapes(self, input_shapes):
        return [broadcast_shape(self.where, self._operands(input_shapes))]

    def setup(self, backend, input_shapes):
        input_shapes = self._operands(input_shapes)
        shape = broadcast_shape(self.where, input_shapes)
        n = len(input_shapes)
        names = {"sum": (), "prod": (), "max": ("ones", "t", "u", "alive", *(f"win{i}" for i in range(1, n)))}
        wide = tuple(f"{kind}{i}" for i, s in enumerate(input_shapes) if tuple(s) != shape for kind in ("in", "g"))
        wanted = names[self.config.operation] + wide + (("gw",) if self.config.weight_shape else ())
        if self.shape != shape or set(self.scratch) != set(wanted):
            size = math.prod(shape)
            self.scratch = {k: backend.view(backend.allocate(size, backend.dtype), shape) for k in wanted}
            if self.config.weight_shape:
                w = self.config.weight_shape
                self.scratch["gw"] = backend.view(backend.allocate(math.prod(w), backend.dtype), w)
            if "ones" in self.scratch:
                backend.fill(1.0, self.scratch["ones"])
        self.shape = shape

    def _wide(self, backend, x):
        """The inputs, those of another shape than the output broadcast to it (into scratch)."""
        out = []
        for i, xi in enumerate(x):
            if tuple(xi.shape) != self.shape:
                backend.broadcast(xi, self.scratch[f"in{i}"])
                xi = self.scratch[f"in{i}"]
            out.append(xi)
        return out

    def forward(self, backend, x, w, y):
        self._w = list(w)  # the weight's gradient (backward_parameters) reads the operands this pass used
        x = self._wide(backend, [*x, *w])
        op, out = self.config.operation, y[0]
        backend.copy(x[0], out)
        if op == "sum":
            coeff = self.config.coeff or (1.0,) * len(x)
            if coeff[0] != 1.0:
                backend.scal(coeff[0], out)
            for c, xi in zip(coeff[1:], x[1:]):
                backend.axpby(c, xi, 1.0, out)
        elif op == "prod":
            for xi in x[1:]:
                backend.mul(out, xi, out)
        else:
            s = self.scratch
            with np.errstate(invalid="ignore"):  # (two equal infinities give NaN on purpose: no win, no warning)
                for i, xi in enumerate(x[1:], 1):
                    win, t = s[f"win{i}"], s["t"]
                    backend.copy(xi, t)
                    backend.axpby(-1.0, out, 1.0, t)  # x_i - max so far (NaN for two equal infinities: no win)
                    backend.relu(t, t)
                    backend.relu_grad(t, s["ones"], win)  # 1 where x_i is strictly larger: its gradient's mask
                    backend.maximum(out, xi, out)

    def backward_input(self, backend, x, y, dy, w, dx):
        self._backward(backend, [*x, *w], dy, [*dx, *[None] * len(w)])

    def backward_parameters(self, backend, x, y, dy, dw, beta):
        if dw:
            self._backward(backend, [*x, *self._w], dy, [None] * len(x) + [self.scratch["gw"]])
            backend.axpby(1.0, self.scratch["gw"], beta[0], dw[0])

    def _backward(self, backend, x, dy, dx):
        """The gradients ``dx`` of the operands ``x`` wanted (not None), summed over the axes each was broadcast."""
        narrow = list(dx)
        dx = [d if d is None or tuple(d.shape) == self.shape else self.scratch[f"g{i}"] for i, d in enumerate(dx)]
        self._backward_wide(backend, self._wide(backend, x), dy, dx)
        for d, full in zip(narrow, dx):
            if d is not None and d is not full:
                backend.reduce_to(full, d)

    def _backward_wide(self, backend, x, dy, dx):
        op, g = self.config.operation, dy[0]
        if op == "sum":
            coeff = self.config.coeff or (1.0,) * len(x)
            for c, d in zip(coeff, dx):
                if d is not None:
                    backend.copy(g, d)
                    if c != 1.0:
                        backend.scal(c, d)
        elif op == "prod":
            for i, d in enumerate(dx):
                if d is None:
                    continue
                backend.copy(g, d)
                for j, xj in enumerate(x):
                    if j != i:
                        backend.mul(d, xj, d)
        else:
            s = self.scratch
            alive, t, u = s["alive"], s["t"], s["u"]
            backend.copy(s["ones"], alive)  # 1 where no later input took the maximum
            for i in range(len(x) - 1, 0, -1):
                win = s[f"win{i}"]
                if dx[i] is not None:
                    backend.mul(win, alive, t)
                    backend.mul(t, g, dx[i])
                backend.copy(s["ones"], u)
                backend.axpby(-1.0, win, 1.0, u)
                backend.mul(alive, u, alive)
            if dx[0] is not None:
                backend.mul(alive, g, dx[0])
