"""Dropout: in training mode each element is zeroed with probability ``ratio`` and the rest scaled by
1 / (1 - ratio) (inverted dropout), so inference mode is the identity. ``mask_output``: a second output, 1 where
the value was kept and 0 where it was dropped (ONNX's mask; all 1 in inference); it takes no gradient."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ... import _checks
from ..layer import Worker, register_layer


@dataclass(frozen=True, kw_only=True)
class DropoutConfig:
    ratio: float = 0.5
    mask_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mask_output, bool):
            raise _checks.ConfigError(f"DropoutConfig.mask_output: expected true (a second output, the mask) or "
                                      f"false, got {self.mask_output!r}")
        object.__setattr__(self, "ratio", _checks.number("DropoutConfig.ratio", self.ratio, minimum=0.0,
                                                         maximum=1.0, max_open=True))


@register_layer("Dropout", DropoutConfig)
class Dropout(Worker):
    in_place = True
    draws_random = True
    """A new mask every training forward pass, from a seed the solver writes before the step (so a recorded step
    replays with fresh masks); checkpoints keep ``seed`` and ``calls``, so a resumed run draws the same masks."""

    def __init__(self, config: DropoutConfig, layer_name: str) -> None:
        super().__init__(config, layer_name)
        self.num_outputs = 2 if config.mask_output else 1
        self.mask = None
        self.draw = None  # one uint32: the seed of this step's mask
        self.calls = 0
        self.stream = 0
        """Which sequence of masks this layer draws: data-parallel training gives each rank its own (its rank)."""
        self._drawn = False  # before_step has written this step's seed
        self._step_drawn = False  # ... and its step has not ended (after_step takes the draw back if it failed)

    def setup(self, backend, input_shapes):
        shape = tuple(input_shapes[0])
        if self.mask is None or self.mask.shape != shape:
            self.mask = backend.view(backend.allocate(math.prod(shape), backend.dtype), shape)
        if self.draw is None:
            self.draw = backend.view(backend.allocate(1, np.uint32), (1,))

    def _active(self) -> bool:
        return self.training and self.config.ratio > 0.0

    def before_step(self, backend) -> None:
        if self._active() and self.draw is not None:
            self.calls += 1
            draw = (self.seed * 1_000_003 + self.calls + self.stream * 1_000_000_007) % 2**31
            backend.upload(np.array([draw], np.uint32), self.draw)
            self._drawn = self._step_drawn = True

    def after_step(self, ran: bool) -> None:
        if self._step_drawn and not ran:  # (forward used the draw, but the step did not finish: taken back)
            self.calls -= 1
        self._drawn = self._step_drawn = False

    def forward(self, backend, x, w, y):
        if self._active():
            if not self._drawn:  # a forward pass outside a solver's step draws its own seed
                self.before_step(backend)
            self._drawn = False
            backend.dropout_mask(self.mask, self.config.ratio, self.draw)
            backend.mul(x[0], self.mask, y[0])
            if len(y) > 1:
                backend.copy(self.mask, y[1])
                backend.scal(1.0 - self.config.ratio, y[1])
        else:
            backend.copy(x[0], y[0])
            if len(y) > 1:
                backend.fill(1.0, y[1])

    def output_shapes(self, input_shapes):
        return [tuple(input_shapes[0])] * self.num_outputs

    def backward_input(self, backend, x, y, dy, w, dx):
        if self._active():
            backend.mul(dy[0], self.mask, dx[0])
        else:
            backend.copy(dy[0], dx[0])
