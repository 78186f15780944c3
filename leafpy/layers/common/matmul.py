"""MatMul: the product ``y = a @ b`` over stacks of matrices (ONNX's MatMul, NumPy's ``matmul``): a [..., M, K] by
b [..., K, P] gives [..., M, P], the leading axes broadcast as NumPy broadcasts them (aligned at the last). Both
operands have two axes or more (an importer reshapes ONNX's 1-D operands). Gradients: ``da = dy @ bᵀ`` and
``db = aᵀ @ dy``, each summed over the axes its operand was broadcast along.

``b`` is the second input, or, with ``weight_shape`` given, the layer's weight ``weight`` of that shape (a
constant right-hand side of an imported graph, [K, P] or batched [..., K, P]; a plain [K, P] product is also a
Linear layer without bias)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import _checks
from ...errors import ConfigError, ShapeError
from ..layer import Worker, register_layer


def broadcast_shape(where: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """NumPy's broadcast of ``shapes`` (aligned at the last axis), a ShapeError naming ``where`` if they clash."""
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        sizes = {s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0} - {1}
        if len(sizes) > 1:
            raise ShapeError(f"{where}: shapes {', '.join(str(s) for s in shapes)} do not broadcast (axis {k} of "
                             f"the result has sizes {sorted(sizes)}); sizes must agree or be 1, shapes aligned at "
                             "their last axes")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class MatMulConfig:
    weight_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        shape = self.weight_shape
        if not _checks.listed(shape) or len(shape) == 1:
            raise ConfigError(f"MatMulConfig.weight_shape: expected [] (b is the second input) or the shape of b, "
                              f"[K, P] or [..., K, P], got {shape!r}")
        object.__setattr__(self, "weight_shape", tuple(_checks.positive_int(f"MatMulConfig.weight_shape[{i}]", d)
                                                      for i, d in enumerate(shape)))


@register_layer("MatMul", MatMulConfig)
class MatMul(Worker):
    def __init__(self, config: MatMulConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        self.num_inputs = 1 if config.weight_shape else 2
        self.weight_names = ("weight",) if config.weight_shape else ()
        self.scratch: dict = {}
        self._b = None

    def _operands(self, input_shapes):
        return [tuple(s) for s in input_shapes] + ([self.config.weight_shape] if self.config.weight_shape else [])

    def weight_shapes(self, input_shapes):
        return [self.config.weight_shape] if self.config.weight_shape else []

    def check_inputs(self, input_shapes):
        super().check_inputs(input_shapes)
        a, b = self._operands(input_shapes)
        if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
            raise ShapeError(f"{self.where}: expected a [..., M, K] and b [..., K, P] (two axes or more, K shared), "
                             f"got {a} and {b}")
        self.output_shapes(input_shapes)

    def output_shapes(self, input_shapes):
        a, b = self._operands(input_shapes)
        lead = broadcast_shape(self.where, [a[:-2], b[:-2]]) if len(a) > 2 or len(b) > 2 else ()
        return [(*lead, a[-2], b[-1])]

    def forward(self, backend, x, w, y):
        self._b = (x + w)[1]  # the gradient of a reads the b this pass used
        backend.matmul(x[0], False, self._b, False, y[0])

    def _grad(self, backend, k: int, a, b, dy, out) -> None:
        """The gradient of operand ``k`` (0: a, 1: b) into ``out``, summed over the axes it was broadcast along."""
        first, t1, second, t2 = (dy, False, b, True) if k == 0 else (a, True, dy, False)
        shape = (*dy.shape[:-2], *(a if k == 0 else b).shape[-2:])
        if shape == tuple(out.shape):
            backend.matmul(first, t1, second, t2, out)
            return
        full = self.scratch.get(k)
        if full is None or full.shape != shape:
            full = self.scratch[k] = backend.view(backend.allocate(math.prod(shape), backend.dtype), shape)
        backend.matmul(first, t1, second, t2, full)
        backend.reduce_to(full, out)

    def backward_input(self, backend, x, y, dy, w, dx):
        b = (x + w)[1]
        for k, d in enumerate(dx):
            if d is not None:
                self._grad(backend, k, x[0], b, dy[0], d)

    def backward_parameters(self, backend, x, y, dy, dw, beta):
        if not dw:
            return
        shape = tuple(dw[0].shape)
        acc = self.scratch.get("dw")
        if acc is None or acc.shape != shape:
            acc = self.scratch["dw"] = backend.view(backend.allocate(math.prod(shape), backend.dtype), shape)
        self._grad(backend, 1, x[0], self._b, dy[0], acc)
        backend.axpby(1.0, acc, beta[0], dw[0])
