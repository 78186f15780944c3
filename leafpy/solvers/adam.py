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
    hyper = ("beta1", "beta2", "epsilon")
    skips_on_device = True

    def step_rate(self, lr, iteration):
        c = self.config
        t = iteration + 1
        return lr * math.sqrt(1.0 - c.beta2 ** t) / (1.0 - c.beta1 ** t)
