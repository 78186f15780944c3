"""ELU: x where x > 0, alpha * (exp(x) - 1) elsewhere (Clevert et al., 2015)."""

from __future__ import annotations

from dataclasses import dataclass

from ... import _checks
from ..layer import register_layer
from .elementwise import ElementwiseActivation


@dataclass(frozen=True, kw_only=True)
class ELUConfig:
    alpha: float = 1.0
    """At least 0: the gradient is read from the output (y + alpha where y <= 0), whose sign is then the input's."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", _checks.number("ELUConfig.alpha", self.alpha, minimum=0.0))


@register_layer("ELU", ELUConfig)
class ELU(ElementwiseActivation):
    formula = "elu"
