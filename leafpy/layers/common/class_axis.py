"""The class axis shared by Softmax and LogSoftmax: ``axis`` (1 by default, the channels; negative counts from the
end), the input seen as [outer, classes, inner] so that the backends' softmax primitives (over axis 1) serve every
axis."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import _checks
from ...errors import ShapeError
from ..layer import Worker


def axis_setting(where: str, value: object) -> int:
    """A config's ``axis``: an integer (negative counts from the end)."""
    axis = _checks._integer(value)
    if axis is None:
        raise _checks.ConfigError(f"{where}: expected an integer axis (1: the channels; negative counts from the end), "
                                  f"got {value!r}")
    return axis


def resolve_axis(where: str, axis: int, shape: tuple[int, ...], end: int = 0) -> int:
    """``axis`` of an input of ``shape`` as a non-negative axis (up to ``len(shape) - 1 + end``), or a ShapeError."""
    rank = len(shape)
    if not -rank <= axis < rank + end:
        raise ShapeError(f"{where}: axis {axis} is outside an input of shape {tuple(shape)} ({rank} axes); choose an "
                         f"axis from {-rank} to {rank - 1 + end}")
    return axis % (rank + end) if axis >= 0 else axis + rank


@dataclass(frozen=True, kw_only=True)
class SoftmaxConfig:
    """Softmax over ``axis`` (1 by default: the class axis of [N, C, ...])."""

    axis: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", axis_setting(f"{type(self).__name__}.axis", self.axis))


@dataclass(frozen=True, kw_only=True)
class LogSoftmaxConfig(SoftmaxConfig):
    """LogSoftmax over ``axis`` (1 by default)."""


class ClassAxisWorker(Worker):
    backward_reads_output = True
    master_precision_outputs = True

    def output_shapes(self, input_shapes):
        shape = tuple(input_shapes[0])
        if len(shape) < 2:
            raise ShapeError(f"{self.where}: expected an input [N, C, ...] with a class axis, got shape {shape}")
        resolve_axis(self.where, self.config.axis, shape)
        return [shape]

    def views(self, backend, *buffers):
        """The buffers seen as [outer, classes, inner] around the configured axis (themselves for axis 1)."""
        shape = tuple(buffers[0].shape)
        axis = resolve_axis(self.where, self.config.axis, shape)
        if axis == 1:
            return buffers
        if backend.memory_order(shape) is not None:
            raise ShapeError(f"{self.where}: a class axis other than 1 ({axis}) on a {len(shape)}-D input is not "
                             f"supported where the backend stores {len(shape)}-D tensors channels-last; use the "
                             "row-major layout (channels_last=False)")
        grouped = (math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:]))
        return tuple(backend.view(b, grouped) for b in buffers)
