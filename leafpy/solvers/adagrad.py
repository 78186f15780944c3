"""AdaGrad (Caffe's form): ``h += g²; w -= lr·g / (sqrt(h) + epsilon)``; the squares add up over all steps."""

from __future__ import annotations

from . import register_rule
from .solver import UpdateRule


@register_rule
class AdaGrad(UpdateRule):
    name = "adagrad"
    state_names = ("history",)
    skips_on_device = True

    def update(self, backend, w, g, state, rate, lr_mult):
        (h,) = state
        backend.adagrad_update(w, g, h, rate, lr_mult, self.config.epsilon)
