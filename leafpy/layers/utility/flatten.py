"""Flatten: [d0, ..., dk, ...] -> [d0 * ... * d(axis-1), d(axis) * ...], the same data seen with another shape
(ONNX's Flatten; ``axis`` 1 by default: [N, prod(...)]; 0 gives [1, everything], the rank gives [everything, 1];
negative counts from the end)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..common.class_axis import axis_setting, resolve_axis
from ..layer import register_layer
from .reshape import ViewWorker


@dataclass(frozen=True, kw_only=True)
class FlattenConfig:
    axis: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "axis", axis_setting("FlattenConfig.axis", self.axis))


@register_layer("Flatten", FlattenConfig)
class Flatten(ViewWorker):
    def output_shapes(self, input_shapes):
        shape = tuple(input_shapes[0])
        axis = resolve_axis(self.where, self.config.axis, shape, end=1)
        return [(math.prod(shape[:axis]), math.prod(shape[axis:]))]
