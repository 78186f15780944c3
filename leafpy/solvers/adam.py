"""Adam (Caffe's form): moment estimates m and v, with the bias correction folded into the step size:
``lr_t = lr·sqrt(1 - beta2^t) / (1 - beta1^t)``, ``w -= lr_t·m / (sqrt(v) + epsilon)``, t = iteration + 1."""

from __future__ import annotations

import math

from . import register_rule
from .solver import UpdateRule


@register_rule
class Adam(UpdateRule):
    name = "adam"
    state_names = ("m", "v")
    skips_on_device = True
    def step_rate(self, lr, iteration):
        c = self.config
        t = iteration + 1
        return lr * math.sqrt(1.0 - c.beta2 ** t) / (1.0 - c.beta1 ** t)

    def update(self, backend, w, g, state, rate, lr_mult, decay=0.0):
        m, v = state
        c = self.config
        backend.adam_update(w, g, m, v, rate, lr_mult, c.beta1, c.beta2, c.epsilon, decay)
