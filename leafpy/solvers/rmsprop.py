"""RMSprop (Caffe's form): ``h = rms_decay·h + (1 - rms_decay)·g²; w -= lr·g / (sqrt(h) + epsilon)``."""

from __future__ import annotations

from . import register_rule
from .solver import UpdateRule


@register_rule
class RMSprop(UpdateRule):
    name = "rmsprop"
    state_names = ("history",)
    hyper = ("rms_decay", "epsilon")
    skips_on_device = True
