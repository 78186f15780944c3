"""Dropout: in training mode each element is zeroed with probability ``ratio`` and the rest scaled by
1 / (1 - ratio) (inverted dropout), so inference mode is the identity."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import _checks
from ..layer import Worker, register_layer


@dataclass(frozen=True, kw_only=True)
class DropoutConfig:
    ratio: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", _checks.number("DropoutConfig.ratio", self.ratio, minimum=0.0,
                                                         maximum=1.0, max_open=True))


@register_layer("Dropout", DropoutConfig)
class Dropout(Worker):
    in_place = True

    @property
    def draws_random(self) -> bool:
        """A new mask every training forward pass (so a recorded step cannot be replayed)."""
        return self.config.ratio > 0.0

    def __init__(self, config: DropoutConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        self.mask = None
        self.calls = 0

    def setup(self, backend, input_shapes):
        shape = tuple(input_shapes[0])
        if self.mask is None or self.mask.shape != shape:
            self.mask = backend.view(backend.allocate(math.prod(shape), backend.dtype), shape)

    def _active(self) -> bool:
        return self.training and self.config.ratio > 0.0

    def forward(self, backend, x, w, y):
        if self._active():
            self.calls += 1
            backend.dropout_mask(self.mask, self.config.ratio, (self.seed * 1_000_003 + self.calls) % 2**31)
            backend.mul(x[0], self.mask, y[0])
        else:
            backend.copy(x[0], y[0])

    def backward_input(self, backend, x, y, dy, w, dx):
        if self._active():
            backend.mul(dy[0], self.mask, dx[0])
        else:
            backend.copy(dy[0], dx[0])
