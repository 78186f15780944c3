"""Leaf 0.2.1 compatibility: its weight names (``"{layer}-{i}"``), its convolution filters (stored flipped), and
what of a network a Leaf file can represent."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError, SerializationError

if TYPE_CHECKING:
    from ..layer_config import LayerConfig, WeightSpec


LEAF_TYPES = {"Convolution", "Linear", "Pooling", "LogSoftmax", "Softmax", "ReLU", "Sigmoid",
              "NegativeLogLikelihood", "Reshape", "Sequential"}
"""The layer types Leaf 0.2.1 had."""
LEAF_FIELDS = {"Convolution": ("num_output", "filter_shape", "stride", "padding", "bias"),
               "Pooling": ("mode", "filter_shape", "stride", "padding"), "Softmax": (), "LogSoftmax": (),
               "NegativeLogLikelihood": ("num_classes",), "Linear": ("output_size", "bias"), "Reshape": ("shape",)}
"""Of those types' settings, the ones Leaf had: the others (group, dilation, pad_end, ceil_mode, ...) must keep their
defaults in a Leaf file."""


def check_leaf_representable(config: LayerConfig, where: str) -> None:
    """Raise ConfigError naming the first layer or setting Leaf 0.2.1 could not read or would compute otherwise."""
    def refuse(what: str) -> None:
        raise ConfigError(f"{where}: layer '{config.name}' ({config.type}): {what}; Leaf 0.2.1 cannot represent "
                          "it (save in leafpy's format instead)")

    if config.type not in LEAF_TYPES:
        refuse(f"the type {config.type} did not exist in Leaf")
    c = config.config
    if getattr(c, "bias", False):
        refuse("a bias (Leaf's Linear and Convolution had none: bias=False)")
    if config.type == "Pooling" and c.mode != "max":
        refuse(f"{c.mode} pooling (Leaf pooled by maximum only)")
    if config.type in LEAF_FIELDS:
        leaf_only = type(c)(**{k: getattr(c, k) for k in LEAF_FIELDS[config.type]})
        for f in dataclasses.fields(c):
            if getattr(c, f.name) != getattr(leaf_only, f.name):
                refuse(f"{f.name} {getattr(c, f.name)!r} (Leaf's {config.type} had no {f.name})")
    for wc in config.params:
        if wc.lr_mult != 1.0 or wc.decay_mult != 1.0 or wc.filler is not None:
            refuse("per-weight lr_mult, decay_mult or filler (Leaf's WeightConfig holds a name only)")
    if config.type == "Sequential":
        for child in c.layers:
            check_leaf_representable(child, where)


LEAF_WEIGHT_NAME = re.compile(r".+-\d+")  # a layer's name may hold "/" (Leaf's "conv1/relu", Caffe's "inception/3x3")


def is_leaf_file(origin: str, saved: Mapping[str, np.ndarray]) -> bool:
    """A bare file whose weights all carry Leaf's names ("{layer}-{i}") was written by Leaf: its convolution
    filters are flipped. (leafpy names weights "{layer}/{weight}", and writes a header.)"""
    return origin == "bare" and bool(saved) and all(LEAF_WEIGHT_NAME.fullmatch(k) for k in saved)


def leaf_name(spec: WeightSpec) -> str:
    """Leaf's name for a layer's weight: the layer's name and the weight's position, "{layer}-{i}"."""
    return f"{spec.layer}-{spec.position}"


def leaf_aliases(specs: Sequence[WeightSpec]) -> tuple[dict[str, WeightSpec], dict[str, list[str]]]:
    """Leaf's names of the weights ``specs`` describes: (name -> spec where the name is unique, name -> the weights
    sharing it where layers of the same name in different containers make it ambiguous)."""
    holders: dict[str, list[WeightSpec]] = {}
    for spec in specs:
        holders.setdefault(leaf_name(spec), []).append(spec)
    unique = {name: found[0] for name, found in holders.items() if len({s.name for s in found}) == 1}
    ambiguous = {name: sorted({s.name for s in found}) for name, found in holders.items() if name not in unique}
    return unique, ambiguous


def _is_filter(spec: WeightSpec) -> bool:
    return spec.layer_type == "Convolution" and spec.local_name == "weight"


def _flip(arr: np.ndarray) -> np.ndarray:
    """A filter turned in both spatial axes: Leaf convolved (cuDNN's CUDNN_CONVOLUTION mode), leafpy
    cross-correlates, so the same function needs the filter flipped."""
    return np.ascontiguousarray(arr[..., ::-1, ::-1])


def from_leaf(weights: Mapping[str, np.ndarray], specs: Sequence[WeightSpec]) -> dict[str, np.ndarray]:
    """Weights as a file Leaf wrote holds them (its names, flipped convolution filters) -> leafpy's names and
    orientation, for the network whose weights ``specs`` (``Layer.weight_specs()``) describes. Names that match no
    weight are kept as they are (loading reports them)."""
    by_leaf, ambiguous = leaf_aliases(specs)
    out = {}
    for key, arr in weights.items():
        if key in ambiguous:
            raise SerializationError(f"weight {key!r}: Leaf's name is ambiguous in this network, layers of the same "
                                     f"name hold {', '.join(ambiguous[key])}; give the layers distinct names")
        spec = by_leaf.get(key)
        if spec is None:
            out[key] = arr
        else:
            out[spec.name] = _flip(arr) if _is_filter(spec) else arr
    return out


def to_leaf(weights: Mapping[str, np.ndarray], specs: Sequence[WeightSpec]) -> dict[str, np.ndarray]:
    """leafpy's named weights -> Leaf's names and flipped convolution filters (the inverse of :func:`from_leaf`)."""
    by_name = {s.name: s for s in specs}
    out = {}
    for name, arr in weights.items():
        spec = by_name.get(name)
        if spec is None:
            raise ConfigError(f"to_leaf: weight {name!r} has no entry in the network's weight specs "
                              f"({', '.join(by_name) or 'none'})")
        out[leaf_name(spec)] = _flip(arr) if _is_filter(spec) else arr
    return out
