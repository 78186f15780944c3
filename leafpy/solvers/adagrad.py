"""AdaGrad (Caffe's form): ``h += g²; w -= lr·g / (sqrt(h) + epsilon)``; the squares add up over all steps."""

from __future__ import annotations

from . import register_rule
from .solver import UpdateRule


@register_rule
class AdaGrad(UpdateRule):
    name = "adagrad"
    state_names = ("history",)
    hyper = ("epsilon",)
    skips_on_device = True
