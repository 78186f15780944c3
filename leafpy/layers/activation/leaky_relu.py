"""LeakyReLU: x where x > 0, negative_slope * x elsewhere (Caffe's ReLU with negative_slope)."""

from __future__ import annotations

from dataclasses import dataclass

from ... import _checks
from ..layer import register_layer
from .elementwise import ElementwiseActivation


@dataclass(frozen=True, kw_only=True)
class LeakyReLUConfig:
    negative_slope: float = 0.01
    """At least 0: the gradient is read from the output, whose sign is then the input's (as Keras requires)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "negative_slope", _checks.number("LeakyReLUConfig.negative_slope",
                                                                  self.negative_slope, minimum=0.0))


@register_layer("LeakyReLU", LeakyReLUConfig)
class LeakyReLU(ElementwiseActivation):
    formula = "leaky_relu"
