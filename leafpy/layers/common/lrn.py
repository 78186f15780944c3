"""LRN: local response normalisation across channels, Caffe's formula. Over [N, C, ...], for each channel c,
``scale_c = k + alpha / local_size * sum of x_j**2`` over the ``local_size`` channels j centred on c (zeros past
the first and last channel) and ``y_c = x_c * scale_c ** -beta``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import _checks
from ...errors import ConfigError, ShapeError
from ..layer import Worker, register_layer


@dataclass(frozen=True, kw_only=True)
class LRNConfig:
    local_size: int = 5
    alpha: float = 1.0
    beta: float = 0.75
    k: float = 1.0

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "local_size", _checks.positive_int("LRNConfig.local_size", self.local_size))
        if self.local_size % 2 == 0:
            raise ConfigError(f"LRNConfig.local_size: expected an odd number (the window is centred on each "
                              f"channel), got {self.local_size}")
        s(self, "alpha", _checks.number("LRNConfig.alpha", self.alpha, minimum=0.0))
        s(self, "beta", _checks.number("LRNConfig.beta", self.beta))
        s(self, "k", _checks.number("LRNConfig.k", self.k, minimum=0.0, min_open=True))


@register_layer("LRN", LRNConfig)
class LRN(Worker):
    backward_reads_output = True
    """The gradient reads y (an activation after an LRN must not overwrite it in place)."""

    def __init__(self, config: LRNConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        self.scale = None

    def check_inputs(self, input_shapes):
        super().check_inputs(input_shapes)
        if len(input_shapes[0]) < 2:
            raise ShapeError(f"{self.where}: expected an input [N, C, ...] with a channel axis, got shape "
                             f"{tuple(input_shapes[0])}")

    def setup(self, backend, input_shapes):
        shape = tuple(input_shapes[0])
        if self.scale is None or self.scale.shape != shape:
            self.scale = backend.view(backend.allocate(math.prod(shape), backend.dtype), shape)

    def forward(self, backend, x, w, y):
        c = self.config
        backend.lrn(x[0], self.scale, y[0], c.local_size, c.alpha, c.beta, c.k)

    def backward_input(self, backend, x, y, dy, w, dx):
        c = self.config
        backend.lrn_grad(x[0], y[0], self.scale, dy[0], dx[0], c.local_size, c.alpha, c.beta)
