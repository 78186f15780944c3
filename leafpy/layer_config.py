"""LayerConfig, WeightConfig, FillerConfig and the layer-type registry: what a layer is, as plain data.

Kept apart from the layers package (leafpy/layers/) so that code that only reads or writes configs (the Cap'n
Proto codec, YAML, the ONNX importer) depends on what a layer is, not on how layers run: nothing here imports the
layers. Layer modules register themselves with ``register_layer`` (layers/layer.py) when ``leafpy.layers`` is
imported, which ``import leafpy`` does before any other leafpy module can be used.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import _checks
from .errors import ConfigError

Shape = tuple[int, ...]

# --------------------------------------------------------------------------------------------------------------
# Weight configuration
# --------------------------------------------------------------------------------------------------------------
FILLER_TYPES = ("constant", "glorot_uniform", "gaussian", "he")


@_checks.strict_init
@dataclass(frozen=True, kw_only=True)
class FillerConfig:
    """How a weight is initialised: constant ``value``, Glorot/Xavier uniform, Gaussian ``std``, or He (normal)."""

    type: str = "glorot_uniform"
    value: float = 0.0
    std: float = 0.01

    def __post_init__(self) -> None:
        aliases = {"xavier": "glorot_uniform", "xavier_uniform": "glorot_uniform", "kaiming": "he"}
        kind = aliases.get(self.type, self.type)
        object.__setattr__(self, "type", _checks.choice("filler.type", kind, FILLER_TYPES))
        object.__setattr__(self, "value", _checks.number("filler.value", self.value))
        object.__setattr__(self, "std", _checks.number("filler.std", self.std, minimum=0.0))

    def fill(self, shape: Shape, rng: np.random.Generator) -> np.ndarray:
        """Initial values of the given shape (float64), drawn from ``rng``."""
        fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
        fan_out = shape[0] * math.prod(shape[2:]) if len(shape) > 1 else shape[0]
        if self.type == "constant":
            return np.full(shape, self.value)
        if self.type == "glorot_uniform":
            limit = math.sqrt(6.0 / (fan_in + fan_out))
            return rng.uniform(-limit, limit, shape)
        if self.type == "gaussian":
            return rng.normal(0.0, self.std, shape)
        return rng.normal(0.0, math.sqrt(2.0 / fan_in), shape)


@_checks.strict_init
@dataclass(frozen=True, kw_only=True)
class WeightConfig:
    """Per-weight settings: a ``name`` to share the weight between layers, learning-rate and decay multipliers,
    and the filler (None: the layer's default; a FillerConfig, its mapping, or a filler type name such as "he")."""

    name: str | None = None
    lr_mult: float = 1.0
    decay_mult: float = 1.0
    filler: FillerConfig | None = None

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ConfigError(f"params.name: expected a non-empty string, got {self.name!r}")
        object.__setattr__(self, "lr_mult", _checks.number("params.lr_mult", self.lr_mult, minimum=0.0))
        object.__setattr__(self, "decay_mult", _checks.number("params.decay_mult", self.decay_mult, minimum=0.0))
        if isinstance(self.filler, dict):
            object.__setattr__(self, "filler", FillerConfig(**self.filler))
        elif isinstance(self.filler, str):
            object.__setattr__(self, "filler", FillerConfig(type=self.filler))
        elif self.filler is not None and not isinstance(self.filler, FillerConfig):
            raise ConfigError(f"params.filler: expected a FillerConfig or a filler type ({', '.join(FILLER_TYPES)}), "
                              f"got {type(self.filler).__name__} {self.filler!r}"[:300])


class WeightSpec(NamedTuple):
    """One weight of one layer in a network (see ``Layer.weight_specs``)."""

    name: str
    """The weight's name in the network, as :meth:`Layer.named_weights` gives it ("conv1/weight")."""
    layer: str
    """The name of the layer holding it."""
    layer_type: str
    local_name: str
    """The weight's name within its layer ("weight", "bias")."""
    position: int
    """Its position among its layer's weights."""
    shape: Shape


# --------------------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerType:
    name: str
    config_class: type | None
    impl: type  # a Worker subclass, or a Layer subclass for containers
    is_container: bool = False


_REGISTRY: dict[str, LayerType] = {}
_BY_CONFIG: dict[type, str] = {}


def add_layer_type(entry: LayerType) -> None:
    """Record a layer type (``register_layer`` in layer.py is the decorator layer modules use)."""
    if entry.name in _REGISTRY:
        raise ConfigError(f"layer type {entry.name!r} is registered twice")
    _REGISTRY[entry.name] = entry
    if entry.config_class is not None:
        _BY_CONFIG[entry.config_class] = entry.name
        fields = dataclasses.fields(entry.config_class) if dataclasses.is_dataclass(entry.config_class) else ()
        if fields and all(f.kw_only for f in fields if f.init):
            _checks.strict_init(entry.config_class)  # a misspelt field is a ConfigError naming the valid ones


def layer_types() -> list[str]:
    """The registered layer type names."""
    return sorted(_REGISTRY)


def lookup(name: str, where: str = "layer type") -> LayerType:
    if name not in _REGISTRY:
        raise ConfigError(f"{where}: unknown layer type {name!r}; known types: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def type_of_config(config: Any) -> str | None:
    return _BY_CONFIG.get(type(config))


# --------------------------------------------------------------------------------------------------------------
# LayerConfig
# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, init=False)
class LayerConfig:
    """A named layer: its type (a config object, or the type name for types whose config has defaults), the
    blob names it reads and writes (empty: wired by its container), per-weight settings, and ``propagate_down``
    (one bool per input; False stops the gradient into that input)."""

    name: str
    type: str
    config: Any
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[WeightConfig, ...]
    propagate_down: tuple[bool, ...]

    def __init__(self, name: str, layer_type: Any, *, inputs: Sequence[str] = (), outputs: Sequence[str] = (),
                 params: Sequence[WeightConfig | dict] = (), propagate_down: Sequence[bool] = ()) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"layer name: expected a non-empty string, got {name!r}")
        if isinstance(layer_type, str):
            entry = lookup(layer_type, f"layer '{name}'")
            if entry.config_class is None:
                config = None
            else:
                try:
                    config = entry.config_class()
                except TypeError:
                    raise ConfigError(
                        f"layer '{name}' ({layer_type}): this type needs settings; give a "
                        f"{entry.config_class.__name__}(...) instead of the string {layer_type!r}") from None
            type_name = layer_type
        else:
            found = type_of_config(layer_type)
            if found is None:
                raise ConfigError(f"layer '{name}': {type(layer_type).__name__} is not a layer config; known types: "
                                  f"{', '.join(layer_types())}")
            type_name = found
            config = layer_type
        for what, names in (("inputs", inputs), ("outputs", outputs)):
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
                raise ConfigError(f"layer '{name}'.{what}: expected a list of blob names, got {names!r}")
        given = list(params) if isinstance(params, (list, tuple)) else None
        if given is None or not all(isinstance(p, (WeightConfig, dict)) for p in given):
            raise ConfigError(f"layer '{name}'.params: expected a list of WeightConfig (one per weight, e.g. "
                              f"[lp.WeightConfig(name='w')]), got {params!r}"[:300])
        params_t = tuple(p if isinstance(p, WeightConfig) else WeightConfig(**p) for p in given)
        if not isinstance(propagate_down, (list, tuple)) or not all(isinstance(p, bool) for p in propagate_down):
            raise ConfigError(f"layer '{name}'.propagate_down: expected a list of booleans, got {propagate_down!r}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "type", type_name)
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "inputs", tuple(inputs))
        object.__setattr__(self, "outputs", tuple(outputs))
        object.__setattr__(self, "params", params_t)
        object.__setattr__(self, "propagate_down", tuple(propagate_down))

    @property
    def layer_type(self) -> Any:
        """The config object, or the type name for parameterless types."""
        return self.config if self.config is not None else self.type


def _keywords_checked(init: Any) -> Any:
    """LayerConfig's constructor, reporting a misspelt keyword or an extra positional argument as a ConfigError
    naming the valid ones (the plain constructor raises a bare TypeError)."""
    valid = ("inputs", "outputs", "params", "propagate_down")

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > 2:
            raise ConfigError(f"LayerConfig: takes a name and a layer type (a config or a type name) positionally, "
                              f"got {len(args)} positional arguments; give {', '.join(valid)} by keyword")
        unknown = [k for k in kwargs if k not in valid and k not in ("name", "layer_type")]
        if unknown:
            raise ConfigError(f"LayerConfig: unknown field {unknown[0]!r}; valid fields: name, layer_type, "
                              f"{', '.join(valid)}")
        init(self, *args, **kwargs)

    return __init__


LayerConfig.__init__ = _keywords_checked(LayerConfig.__init__)  # type: ignore[method-assign]
