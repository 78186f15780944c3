"""SiLU (also called Swish): x * sigmoid(x)."""

from __future__ import annotations

from ..layer import register_layer
from .elementwise import ElementwiseActivation


@register_layer("SiLU")
class SiLU(ElementwiseActivation):
    formula = "silu"


@register_layer("Swish")
class Swish(SiLU):
    """SiLU under the name Ramachandran et al. gave it (with beta = 1): the same formula, saved as Swish."""
