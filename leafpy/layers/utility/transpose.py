"""Transpose: the input's axes in another order (ONNX's Transpose, NumPy's ``transpose``). ``perm`` names every
axis, the first (the batch) included: ``[1, 0, 2]`` turns a time-major sequence [T, N, H] batch-first. Its gradient
is the inverse permutation of the output's gradient; both run on the backend primitive ``permute``."""

from __future__ import annotations

from dataclasses import dataclass

from ... import _checks
from ...errors import ConfigError, ShapeError
from ..layer import Worker, register_layer


@dataclass(frozen=True, kw_only=True)
class TransposeConfig:
    perm: tuple[int, ...]

    def __post_init__(self) -> None:
        perm = self.perm
        if not _checks.listed(perm) or not hasattr(perm, "__len__") or not all(
                isinstance(p, int) and not isinstance(p, bool) for p in perm) or sorted(perm) != list(range(len(perm))):
            raise ConfigError(f"TransposeConfig.perm: expected every axis 0 .. k-1 once, in the order wanted "
                              f"(e.g. [1, 0, 2]), got {perm!r}")
        object.__setattr__(self, "perm", tuple(int(p) for p in perm))


@register_layer("Transpose", TransposeConfig)
class Transpose(Worker):
    def check_inputs(self, input_shapes):
        super().check_inputs(input_shapes)
        if len(input_shapes[0]) != len(self.config.perm):
            raise ShapeError(f"{self.where}: perm {list(self.config.perm)} orders {len(self.config.perm)} axes; the "
                             f"input has {len(input_shapes[0])} (shape {tuple(input_shapes[0])})")

    def output_shapes(self, input_shapes):
        shape = tuple(input_shapes[0])
        return [tuple(shape[p] for p in self.config.perm)]

    def forward(self, backend, x, w, y):
        backend.permute(x[0], y[0], self.config.perm)

    def backward_input(self, backend, x, y, dy, w, dx):
        if dx[0] is not None:
            inverse = tuple(sorted(range(len(self.config.perm)), key=lambda k: self.config.perm[k]))
            backend.permute(dy[0], dx[0], inverse)
