"""Reshape: the same data with a new per-sample shape. ``shape`` includes the batch dimension as Leaf's does;
its first entry is replaced by the actual batch size, and one other entry may be -1 (inferred).
``whole_shape: true``: ``shape`` is the whole output shape, its first entry too (ONNX's Reshape where the first
axis is no batch, e.g. [2, 3, 4] to [4, 6]); one entry, the first included, may be -1."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import _checks
from ...errors import ShapeError
from ..layer import Worker, register_layer


@dataclass(frozen=True, kw_only=True)
class ReshapeConfig:
    shape: tuple[int, ...]
    whole_shape: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.whole_shape, bool):
            raise _checks.ConfigError(f"ReshapeConfig.whole_shape: expected true (shape is the whole output shape) "
                                      f"or false (its first entry is the batch, kept), got {self.whole_shape!r}")
        shape = self.shape
        if not _checks.listed(shape) or not hasattr(shape, "__len__") or not shape:
            raise _checks.ConfigError(f"ReshapeConfig.shape: expected a non-empty list of integers, got {shape!r}")
        out = []
        for i, d in enumerate(shape):
            if isinstance(d, bool) or not isinstance(d, int) or d < -1 or d == 0:
                raise _checks.ConfigError(f"ReshapeConfig.shape[{i}]: expected a positive integer or -1 (inferred), "
                                          f"got {d!r}")
            out.append(int(d))
        if out[1:].count(-1) > 1 or (self.whole_shape and out.count(-1) > 1):
            raise _checks.ConfigError(f"ReshapeConfig.shape: at most one -1 after the batch dimension, got {out}")
        object.__setattr__(self, "shape", tuple(out))


class ViewWorker(Worker):
    """A layer whose output is its input seen with another shape: in place it does nothing at all."""

    in_place = True
    modifies_data = False

    def forward(self, backend, x, w, y):
        if not self.running_in_place:
            backend.copy(x[0], y[0])

    def backward_input(self, backend, x, y, dy, w, dx):
        if not self.running_in_place:
            backend.copy(dy[0], dx[0])


@register_layer("Reshape", ReshapeConfig)
class Reshape(ViewWorker):
    def output_shapes(self, input_shapes):
        shape = tuple(input_shapes[0])
        if self.config.whole_shape:
            return [self._whole(shape)]
        n, per_sample = shape[0], math.prod(shape[1:])
        rest = list(self.config.shape[1:])
        known = math.prod(d for d in rest if d != -1)
        if -1 in rest:
            if known == 0 or per_sample % known:
                raise ShapeError(f"{self.where}: cannot reshape {shape} to {self.config.shape}")
            rest[rest.index(-1)] = per_sample // known
        elif known != per_sample:
            raise ShapeError(f"{self.where}: cannot reshape {shape} ({per_sample} values per sample) to "
                             f"{self.config.shape} ({known} values per sample)")
        return [(n, *rest)]

    def _whole(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(self.config.shape)
        known = math.prod(d for d in out if d != -1)
        if -1 in out and known and math.prod(shape) % known == 0:
            out[out.index(-1)] = math.prod(shape) // known
        if math.prod(out) != math.prod(shape) or -1 in out:
            raise ShapeError(f"{self.where}: cannot reshape {shape} ({math.prod(shape)} values) to "
                             f"{self.config.shape}")
        return tuple(out)
