"""2-D max or average pooling over NCHW input, with Caffe's settings. stride defaults to the filter shape;
``padding`` pads before each spatial dimension and, unless ``pad_end`` is given, after it too (ONNX's pads
[begin..., end...] are ``padding`` and ``pad_end``). ``ceil_mode`` rounds the output size up (Caffe's pooling; a
window that would start in the end padding is dropped); ``count_include_pad`` (default true, as before these
settings existed) counts the padding in an average window's divisor, else only the input positions it covers;
``global_pooling`` pools each channel's whole plane into one value (filter, stride and padding ignored)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ... import _checks
from ...errors import ShapeError
from ..layer import Worker, register_layer
from .convolution import pad_end, spatial_output

POOLING_MODES = ("max", "average")


@dataclass(frozen=True, kw_only=True)
class PoolingConfig:
    mode: str = "max"
    filter_shape: tuple[int, ...] = (2,)
    stride: tuple[int, ...] | None = None
    padding: tuple[int, ...] = (0,)
    pad_end: tuple[int, ...] | None = None
    ceil_mode: bool = False
    count_include_pad: bool = True
    global_pooling: bool = False

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "mode", _checks.choice("PoolingConfig.mode", self.mode, POOLING_MODES))
        s(self, "filter_shape", _checks.spatial("PoolingConfig.filter_shape", self.filter_shape))
        s(self, "stride", self.filter_shape if self.stride is None
          else _checks.spatial("PoolingConfig.stride", self.stride))
        s(self, "padding", _checks.spatial("PoolingConfig.padding", self.padding, minimum=0))
        s(self, "pad_end", pad_end("PoolingConfig", self.padding, self.pad_end))
        for name in ("ceil_mode", "count_include_pad", "global_pooling"):
            if not isinstance(getattr(self, name), bool):
                raise _checks.ConfigError(f"PoolingConfig.{name}: expected true or false, got {getattr(self, name)!r}")
        for what, pads in (("padding", self.padding), ("pad_end", self.pad_end or ())):
            for d, (p, k) in enumerate(zip(pads, self.filter_shape)):
                if p >= k:
                    raise _checks.ConfigError(f"PoolingConfig.{what}[{d}]: padding must be smaller than the filter "
                                              f"({k}), got {p}")


@register_layer("Pooling", PoolingConfig)
class Pooling(Worker):
    def __init__(self, config: PoolingConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        self.mask = None

    def window(self, input_shape) -> tuple:
        """(filter, stride, padding, pad_end) for an input of this shape: the whole plane under global pooling."""
        c = self.config
        if c.global_pooling:
            if len(input_shape) != 4:
                raise ShapeError(f"{self.where}: expected a 4-D input [N, C, H, W], got shape {tuple(input_shape)}")
            return tuple(input_shape[2:]), (1, 1), (0, 0), None
        return c.filter_shape, c.stride, c.padding, c.pad_end

    def output_shapes(self, input_shapes):
        kernel, stride, padding, end = self.window(input_shapes[0])
        oh, ow = spatial_output(self.where, input_shapes[0], kernel, stride, padding, end,
                                ceil_mode=self.config.ceil_mode)
        n, ch = input_shapes[0][:2]
        return [(n, ch, oh, ow)]

    def work_shapes(self, input_shapes):
        """The padded input a backend may pool from: the padding before, the input, and as far after as the windows
        reach (a padding near a huge window makes it large where the output is small)."""
        kernel, stride, padding, _ = self.window(input_shapes[0])
        out = self.output_shapes(input_shapes)[0]
        extent = [max(size + p, (o - 1) * s + k) for size, o, k, s, p in
                  zip(input_shapes[0][2:], out[2:], kernel, stride, padding)]
        return [(*input_shapes[0][:2], *extent)] if list(extent) != list(input_shapes[0][2:]) else []

    def setup(self, backend, input_shapes):
        if self.config.mode == "max":
            shape = self.output_shapes(input_shapes)[0]
            if self.mask is None or self.mask.shape != shape:
                self.mask = backend.view(backend.allocate(math.prod(shape), np.int32), shape)

    def forward(self, backend, x, w, y):
        c = self.config
        kernel, stride, padding, end = self.window(x[0].shape)
        backend.pool2d(x[0], y[0], self.mask, c.mode, kernel, stride, padding, end, c.count_include_pad)

    def backward_input(self, backend, x, y, dy, w, dx):
        c = self.config
        kernel, stride, padding, end = self.window(x[0].shape)
        backend.pool2d_grad(dy[0], dx[0], self.mask, c.mode, kernel, stride, padding, end, c.count_include_pad)
