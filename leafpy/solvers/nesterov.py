"""Nesterov momentum (Caffe's form): ``h' = m·h + lr·g; w -= (1 + m)·h' - m·h``."""

from __future__ import annotations

from . import register_rule
from .solver import UpdateRule


@register_rule
class Nesterov(UpdateRule):
    name = "nesterov"
    state_names = ("history", "previous")

    def update(self, backend, w, g, state, lr, iteration):
        h, prev = state
        m = self.config.momentum
        backend.copy(h, prev)
        backend.axpby(lr, g, m, h)
        backend.axpby(-(1.0 + m), h, 1.0, w)
        backend.axpby(m, prev, 1.0, w)
