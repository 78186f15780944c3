"""Momentum SGD as in Leaf and Caffe: ``h = momentum·h + lr·g; w -= h`` (history starts at zero)."""

from __future__ import annotations

from . import register_rule
from .solver import UpdateRule


@register_rule
class Momentum(UpdateRule):
    name = "momentum"
    state_names = ("history",)
    hyper = ("momentum",)
    skips_on_device = True
