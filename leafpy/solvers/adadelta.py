"""AdaDelta (Caffe's form, decay = ``rms_decay``): ``h = decay·h + (1 - decay)·g²;
d = g·sqrt((u + epsilon) / (h + epsilon)); u = decay·u + (1 - decay)·d²; w -= lr·d``. AdaDelta needs no
learning rate of its own: ``base_lr: 1.0`` is the usual choice."""

from __future__ import annotations

from . import register_rule
from .solver import UpdateRule


@register_rule
class AdaDelta(UpdateRule):
    name = "adadelta"
    state_names = ("history", "update_history")
    hyper = ("rms_decay", "epsilon")
    skips_on_device = True
