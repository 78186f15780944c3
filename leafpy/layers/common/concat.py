"""Concat and Slice along an axis, as Caffe's layers of those names.

Concat joins its inputs along ``axis`` (1, the channels, by default; negative counts from the end); every other
dimension must agree. Slice cuts its input along ``axis`` at ``slice_points`` (increasing, inside the axis) into
``len(slice_points) + 1`` outputs. Each is the other's gradient: both run on the backend primitive ``copy_block``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import _checks
from ...errors import ConfigError, ShapeError
from ..layer import Worker, register_layer


def _axis(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: expected an integer axis (1: channels; negative counts from the end), "
                          f"got {value!r}")
    return value


def _resolve(worker: Worker, axis: int, shape: tuple[int, ...]) -> int:
    if not -len(shape) <= axis < len(shape):
        raise ShapeError(f"{worker.where}: axis {axis} is outside an input of shape {shape} "
                         f"({len(shape)} axes); choose an axis from {-len(shape)} to {len(shape) - 1}")
    return axis % len(shape)


@dataclass(frozen=True, kw_only=True)
class ConcatConfig:
    axis: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _axis("ConcatConfig.axis", self.axis))


@register_layer("Concat", ConcatConfig)
class Concat(Worker):
    num_inputs = 2  # the arity for automatic wiring; named inputs may be more

    def check_inputs(self, input_shapes):
        shapes = ", ".join(str(tuple(s)) for s in input_shapes) or "none"
        if not input_shapes:
            raise ShapeError(f"{self.where}: expected one or more inputs, got none")
        first = tuple(input_shapes[0])
        axis = _resolve(self, self.config.axis, first)
        for i, s in enumerate(input_shapes):
            s = tuple(s)
            if len(s) != len(first) or s[:axis] != first[:axis] or s[axis + 1:] != first[axis + 1:]:
                raise ShapeError(f"{self.where}: inputs must agree on every axis but axis {axis}; input {i} has "
                                 f"shape {s}, input 0 {first} (all shapes: {shapes})")

    def output_shapes(self, input_shapes):
        first = tuple(input_shapes[0])
        axis = self.config.axis % len(first)
        return [first[:axis] + (sum(s[axis] for s in input_shapes),) + first[axis + 1:]]

    def _inners(self, shapes):
        axis = self.config.axis % len(shapes[0])
        return [math.prod(s[axis:]) for s in shapes]

    def forward(self, backend, x, w, y):
        inners = self._inners([t.shape for t in x])
        whole, offset = sum(inners), 0
        for xi, inner in zip(x, inners):
            backend.copy_block(xi, y[0], inner, whole, offset, True)
            offset += inner

    def backward_input(self, backend, x, y, dy, w, dx):
        inners = self._inners([t.shape for t in x])
        whole, offset = sum(inners), 0
        for d, inner in zip(dx, inners):
            if d is not None:
                backend.copy_block(d, dy[0], inner, whole, offset, False)
            offset += inner


@dataclass(frozen=True, kw_only=True)
class SliceConfig:
    axis: int = 1
    slice_points: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", _axis("SliceConfig.axis", self.axis))
        points = self.slice_points
        if not _checks.listed(points):
            raise ConfigError(f"SliceConfig.slice_points: expected a list of indices along the axis, got {points!r}")
        points = tuple(_checks.positive_int(f"SliceConfig.slice_points[{i}]", p) for i, p in enumerate(points))
        if not points:
            raise ConfigError("SliceConfig.slice_points: give at least one index to cut at, e.g. slice_points: [2] "
                              "for two outputs")
        if any(b <= a for a, b in zip(points, points[1:])):
            raise ConfigError(f"SliceConfig.slice_points: expected strictly increasing indices, got {list(points)}")
        object.__setattr__(self, "slice_points", points)


@register_layer("Slice", SliceConfig)
class Slice(Worker):
    def __init__(self, config: SliceConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        self.num_outputs = len(config.slice_points) + 1

    def check_inputs(self, input_shapes):
        super().check_inputs(input_shapes)
        shape = tuple(input_shapes[0])
        axis = _resolve(self, self.config.axis, shape)
        if self.config.slice_points[-1] >= shape[axis]:
            raise ShapeError(f"{self.where}: slice_points {list(self.config.slice_points)} must lie inside axis "
                             f"{axis} of length {shape[axis]} (input shape {shape}); the last must be below "
                             f"{shape[axis]}")

    def output_shapes(self, input_shapes):
        shape = tuple(input_shapes[0])
        axis = self.config.axis % len(shape)
        bounds = (0, *self.config.slice_points, shape[axis])
        return [shape[:axis] + (b - a,) + shape[axis + 1:] for a, b in zip(bounds, bounds[1:])]

    def _blocks(self, shape):
        axis = self.config.axis % len(shape)
        rest = math.prod(shape[axis + 1:])
        bounds = (0, *self.config.slice_points, shape[axis])
        return math.prod(shape[axis:]), [((b - a) * rest, a * rest) for a, b in zip(bounds, bounds[1:])]

    def forward(self, backend, x, w, y):
        whole, blocks = self._blocks(x[0].shape)
        for yk, (inner, offset) in zip(y, blocks):
            backend.copy_block(yk, x[0], inner, whole, offset, False)

    def backward_input(self, backend, x, y, dy, w, dx):
        if dx[0] is None:
            return
        whole, blocks = self._blocks(x[0].shape)
        for dyk, (inner, offset) in zip(dy, blocks):
            backend.copy_block(dyk, dx[0], inner, whole, offset, True)
