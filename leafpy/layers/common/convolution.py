"""2-D convolution (cross-correlation) over NCHW input with weight [num_output, C / group, kh, kw] and a bias per
output channel. filter_shape, stride, padding, pad_end and dilation take one value for both spatial dimensions or
one per dimension (Caffe's names). ``padding`` pads before each dimension and, unless ``pad_end`` is given, after it
too (ONNX's pads [begin..., end...] are ``padding`` and ``pad_end``); ``group``: the channels split into groups
that convolve separately (group == C: depthwise)."""

from __future__ import annotations

from dataclasses import dataclass

from ... import _checks
from ...errors import ShapeError
from ..layer import Worker, register_layer


@dataclass(frozen=True, kw_only=True)
class ConvolutionConfig:
    num_output: int
    filter_shape: tuple[int, ...]
    stride: tuple[int, ...] = (1,)
    padding: tuple[int, ...] = (0,)
    bias: bool = True
    dilation: tuple[int, ...] = (1,)
    group: int = 1
    pad_end: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "num_output", _checks.positive_int("ConvolutionConfig.num_output", self.num_output))
        s(self, "filter_shape", _checks.spatial("ConvolutionConfig.filter_shape", self.filter_shape))
        s(self, "stride", _checks.spatial("ConvolutionConfig.stride", self.stride))
        s(self, "padding", _checks.spatial("ConvolutionConfig.padding", self.padding, minimum=0))
        s(self, "pad_end", pad_end("ConvolutionConfig", self.padding, self.pad_end))
        s(self, "dilation", _checks.spatial("ConvolutionConfig.dilation", self.dilation))
        s(self, "group", _checks.positive_int("ConvolutionConfig.group", self.group))
        if not isinstance(self.bias, bool):
            raise _checks.ConfigError(f"ConvolutionConfig.bias: expected true or false, got {self.bias!r}")
        if self.num_output % self.group:
            raise _checks.ConfigError(f"ConvolutionConfig.group: num_output ({self.num_output}) must be a multiple of "
                                      f"group, got group {self.group}; choose a group that divides num_output")


def pad_end(where: str, padding: tuple[int, ...], value) -> tuple[int, ...] | None:
    """A config's ``pad_end``, checked: None where it is absent or equals ``padding`` (symmetric padding)."""
    if value is None:
        return None
    end = _checks.spatial(f"{where}.pad_end", value, minimum=0)
    return None if end == padding else end


def spatial_output(where: str, shape: tuple[int, ...], kernel, stride, padding, pad_end=None, dilation=(1, 1),
                   ceil_mode: bool = False) -> tuple[int, int]:
    """Output height and width of a 2-D window op (rounded down, or up with ``ceil_mode`` as Caffe's pooling, a last
    window that would start in the end padding dropped); ShapeError when the input is not NCHW or too small."""
    if len(shape) != 4:
        raise ShapeError(f"{where}: expected a 4-D input [N, C, H, W], got shape {tuple(shape)}")
    out = []
    for d, (size, k, st, p, e, di) in enumerate(zip(shape[2:], kernel, stride, padding, pad_end or padding, dilation)):
        span = (k - 1) * di + 1
        o = (size + p + e - span + (st - 1 if ceil_mode else 0)) // st + 1
        if ceil_mode and o > 1 and (o - 1) * st >= size + p:
            o -= 1
        if size + p + e < span:
            raise ShapeError(f"{where}: input {'HW'[d]}={size} with padding {p} and {e} is smaller than the filter "
                             f"{k} (dilation {di}); input shape {tuple(shape)}")
        out.append(o)
    return out[0], out[1]


@register_layer("Convolution", ConvolutionConfig)
class Convolution(Worker):
    weight_names: tuple[str, ...] = ("weight", "bias")

    def __init__(self, config: ConvolutionConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        if not config.bias:
            self.weight_names = ("weight",)

    def output_shapes(self, input_shapes):
        c = self.config
        oh, ow = spatial_output(self.where, input_shapes[0], c.filter_shape, c.stride, c.padding, c.pad_end,
                                c.dilation)
        if input_shapes[0][1] % c.group:
            raise ShapeError(f"{self.where}: the input's {input_shapes[0][1]} channels do not split into group "
                             f"{c.group}; input shape {tuple(input_shapes[0])}")
        return [(input_shapes[0][0], c.num_output, oh, ow)]

    def weight_shapes(self, input_shapes):
        c = self.config
        shapes = [(c.num_output, input_shapes[0][1] // c.group, *c.filter_shape)]
        if c.bias:
            shapes.append((c.num_output,))
        return shapes

    def forward(self, backend, x, w, y):
        c = self.config
        backend.conv2d(x[0], w[0], y[0], c.stride, c.padding, self.ws, w[1] if c.bias else None, c.dilation, c.group)

    def backward_input(self, backend, x, y, dy, w, dx):
        c = self.config
        if dx[0] is not None:
            backend.conv2d_grad_data(dy[0], w[0], dx[0], c.stride, c.padding, self.ws, c.dilation, c.group)

    def backward_parameters(self, backend, x, y, dy, dw, beta):
        c = self.config
        backend.conv2d_grad_filter(x[0], dy[0], dw[0], c.stride, c.padding, self.ws, beta[0], c.dilation, c.group)
        if c.bias:
            backend.bias_grad(dy[0], dw[1], beta[1])
