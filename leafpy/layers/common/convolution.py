"""2-D convolution (cross-correlation) over NCHW input with weight [num_output, C, kh, kw] and a bias per output
channel. filter_shape, stride and padding take one value for both spatial dimensions or one per dimension."""

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

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "num_output", _checks.positive_int("ConvolutionConfig.num_output", self.num_output))
        s(self, "filter_shape", _checks.spatial("ConvolutionConfig.filter_shape", self.filter_shape))
        s(self, "stride", _checks.spatial("ConvolutionConfig.stride", self.stride))
        s(self, "padding", _checks.spatial("ConvolutionConfig.padding", self.padding, minimum=0))
        if not isinstance(self.bias, bool):
            raise _checks.ConfigError(f"ConvolutionConfig.bias: expected true or false, got {self.bias!r}")


def spatial_output(where: str, shape: tuple[int, ...], kernel, stride, padding) -> tuple[int, int]:
    """Output height and width of a 2-D window op; ShapeError when the input is not NCHW or too small."""
    if len(shape) != 4:
        raise ShapeError(f"{where}: expected a 4-D input [N, C, H, W], got shape {tuple(shape)}")
    out = []
    for d, (size, k, st, p) in enumerate(zip(shape[2:], kernel, stride, padding)):
        o = (size + 2 * p - k) // st + 1
        if o < 1:
            raise ShapeError(f"{where}: input {'HW'[d]}={size} with padding {p} is smaller than the filter {k}; "
                             f"input shape {tuple(shape)}")
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
        oh, ow = spatial_output(self.where, input_shapes[0], c.filter_shape, c.stride, c.padding)
        return [(input_shapes[0][0], c.num_output, oh, ow)]

    def weight_shapes(self, input_shapes):
        c = self.config
        shapes = [(c.num_output, input_shapes[0][1], *c.filter_shape)]
        if c.bias:
            shapes.append((c.num_output,))
        return shapes

    def forward(self, backend, x, w, y):
        c = self.config
        backend.conv2d(x[0], w[0], y[0], c.stride, c.padding, self.ws, w[1] if c.bias else None)

    def backward_input(self, backend, x, y, dy, w, dx):
        if dx[0] is not None:
            backend.conv2d_grad_data(dy[0], w[0], dx[0], self.config.stride, self.config.padding, self.ws)

    def backward_parameters(self, backend, x, y, dy, dw, beta):
        c = self.config
        backend.conv2d_grad_filter(x[0], dy[0], dw[0], c.stride, c.padding, self.ws, beta[0])
        if c.bias:
            backend.bias_grad(dy[0], dw[1], beta[1])
