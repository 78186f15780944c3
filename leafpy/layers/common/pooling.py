"""2-D max or average pooling over NCHW input. stride defaults to the filter shape; average pooling counts the
zero padding in each window's divisor."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ... import _checks
from ..layer import Worker, register_layer
from .convolution import spatial_output

POOLING_MODES = ("max", "average")


@dataclass(frozen=True, kw_only=True)
class PoolingConfig:
    mode: str = "max"
    filter_shape: tuple[int, ...] = (2,)
    stride: tuple[int, ...] | None = None
    padding: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "mode", _checks.choice("PoolingConfig.mode", self.mode, POOLING_MODES))
        s(self, "filter_shape", _checks.spatial("PoolingConfig.filter_shape", self.filter_shape))
        s(self, "stride", self.filter_shape if self.stride is None
          else _checks.spatial("PoolingConfig.stride", self.stride))
        s(self, "padding", _checks.spatial("PoolingConfig.padding", self.padding, minimum=0))
        for d, (p, k) in enumerate(zip(self.padding, self.filter_shape)):
            if p >= k:
                raise _checks.ConfigError(f"PoolingConfig.padding[{d}]: padding must be smaller than the filter "
                                          f"({k}), got {p}")


@register_layer("Pooling", PoolingConfig)
class Pooling(Worker):
    def __init__(self, config: PoolingConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        self.mask = None

    def output_shapes(self, input_shapes):
        c = self.config
        oh, ow = spatial_output(self.where, input_shapes[0], c.filter_shape, c.stride, c.padding)
        n, ch = input_shapes[0][:2]
        return [(n, ch, oh, ow)]

    def setup(self, backend, input_shapes):
        if self.config.mode == "max":
            shape = self.output_shapes(input_shapes)[0]
            if self.mask is None or self.mask.shape != shape:
                self.mask = backend.view(backend.allocate(math.prod(shape), np.int32), shape)

    def forward(self, backend, x, w, y):
        c = self.config
        backend.pool2d(x[0], y[0], self.mask, c.mode, c.filter_shape, c.stride, c.padding)

    def backward_input(self, backend, x, y, dy, w, dx):
        c = self.config
        backend.pool2d_grad(dy[0], dx[0], self.mask, c.mode, c.filter_shape, c.stride, c.padding)
