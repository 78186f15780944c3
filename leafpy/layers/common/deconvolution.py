"""Transposed convolution (Caffe's Deconvolution, ONNX's ConvTranspose, PyTorch's ConvTranspose2d) over NCHW input
with weight [C, num_output / group, kh, kw] and a bias per output channel: the gradient of a Convolution with the
same settings, run forward. Output size per spatial dimension: (size - 1) * stride - padding - pad_end +
(kernel - 1) * dilation + 1 + output_padding; the output_padding rows and columns at the end are read by no
window (they hold the bias only)."""

from __future__ import annotations

from dataclasses import dataclass

from ... import _checks
from ...errors import ShapeError
from ..layer import Worker, register_layer
from .convolution import pad_end


@dataclass(frozen=True, kw_only=True)
class DeconvolutionConfig:
    num_output: int
    filter_shape: tuple[int, ...]
    stride: tuple[int, ...] = (1,)
    padding: tuple[int, ...] = (0,)
    pad_end: tuple[int, ...] | None = None
    output_padding: tuple[int, ...] = (0,)
    dilation: tuple[int, ...] = (1,)
    group: int = 1
    bias: bool = True

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "num_output", _checks.positive_int("DeconvolutionConfig.num_output", self.num_output))
        s(self, "filter_shape", _checks.spatial("DeconvolutionConfig.filter_shape", self.filter_shape))
        s(self, "stride", _checks.spatial("DeconvolutionConfig.stride", self.stride))
        s(self, "padding", _checks.spatial("DeconvolutionConfig.padding", self.padding, minimum=0))
        s(self, "pad_end", pad_end("DeconvolutionConfig", self.padding, self.pad_end))
        s(self, "output_padding", _checks.spatial("DeconvolutionConfig.output_padding", self.output_padding,
                                                  minimum=0))
        s(self, "dilation", _checks.spatial("DeconvolutionConfig.dilation", self.dilation))
        s(self, "group", _checks.positive_int("DeconvolutionConfig.group", self.group))
        if not isinstance(self.bias, bool):
            raise _checks.ConfigError(f"DeconvolutionConfig.bias: expected true or false, got {self.bias!r}")
        if self.num_output % self.group:
            raise _checks.ConfigError(f"DeconvolutionConfig.group: num_output ({self.num_output}) must be a multiple "
                                      f"of group, got group {self.group}; choose a group that divides num_output")
        for d, (op, st, di) in enumerate(zip(self.output_padding, self.stride, self.dilation)):
            if op >= max(st, di):
                raise _checks.ConfigError(f"DeconvolutionConfig.output_padding[{d}]: must be smaller than the stride "
                                          f"or the dilation ({max(st, di)}), got {op}")


@register_layer("Deconvolution", DeconvolutionConfig)
class Deconvolution(Worker):
    weight_names: tuple[str, ...] = ("weight", "bias")

    def __init__(self, config: DeconvolutionConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        if not config.bias:
            self.weight_names = ("weight",)
        # the three passes run different convolution primitives: each keeps its own scratch
        self.ws_data: dict = {}
        self.ws_filter: dict = {}

    def output_shapes(self, input_shapes):
        c = self.config
        shape = tuple(input_shapes[0])
        if len(shape) != 4:
            raise ShapeError(f"{self.where}: expected a 4-D input [N, C, H, W], got shape {shape}")
        if shape[1] % c.group:
            raise ShapeError(f"{self.where}: the input's {shape[1]} channels do not split into group {c.group}; "
                             f"input shape {shape}")
        out = []
        for d, (size, k, st, p, e, di, op) in enumerate(zip(shape[2:], c.filter_shape, c.stride, c.padding,
                                                            c.pad_end or c.padding, c.dilation, c.output_padding)):
            o = (size - 1) * st - p - e + (k - 1) * di + 1 + op
            if o < 1:
                raise ShapeError(f"{self.where}: padding {p} and {e} leave no output along {'HW'[d]} for input "
                                 f"{'HW'[d]}={size}; input shape {shape}")
            out.append(o)
        return [(shape[0], c.num_output, *out)]

    def weight_shapes(self, input_shapes):
        c = self.config
        shapes = [(input_shapes[0][1], c.num_output // c.group, *c.filter_shape)]
        if c.bias:
            shapes.append((c.num_output,))
        return shapes

    def forward(self, backend, x, w, y):
        c = self.config
        backend.conv2d_grad_data(x[0], w[0], y[0], c.stride, c.padding, self.ws, c.dilation, c.group)
        if c.bias:
            backend.bias_add(y[0], w[1])

    def backward_input(self, backend, x, y, dy, w, dx):
        c = self.config
        if dx[0] is not None:
            backend.conv2d(dy[0], w[0], dx[0], c.stride, c.padding, self.ws_data, None, c.dilation, c.group)

    def backward_parameters(self, backend, x, y, dy, dw, beta):
        c = self.config
        backend.conv2d_grad_filter(dy[0], x[0], dw[0], c.stride, c.padding, self.ws_filter, beta[0], c.dilation,
                                   c.group)
        if c.bias:
            backend.bias_grad(dy[0], dw[1], beta[1])
