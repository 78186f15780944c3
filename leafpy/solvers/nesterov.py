"""Nesterov momentum (Caffe's form): ``h' = m·h + lr·g; w -= (1 + m)·h' - m·h``."""

from __future__ import annotations

from . import register_rule
from .solver import UpdateRule


@register_rule
class Nesterov(UpdateRule):
    name = "nesterov"
    state_names = ("history", "previous")
    hyper = ("momentum",)
    skips_on_device = True
