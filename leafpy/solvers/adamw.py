"""AdamW (Loshchilov and Hutter's decoupled weight decay, as PyTorch's AdamW): Adam's step (Caffe's form, see
adam.py) with the weight decay applied to the weights instead of added to the gradient:
``w = w·(1 - lr·weight_decay·decay_mult) - lr_t·m / (sqrt(v) + epsilon)``, with lr the policy's rate (times the
weight's lr_mult) and lr_t Adam's bias-corrected one."""

from __future__ import annotations

from . import register_rule
from .adam import Adam


@register_rule
class AdamW(Adam):
    name = "adamw"
    decoupled_weight_decay = True  # the solver hands the update the decay: the line's last hyper-parameter
