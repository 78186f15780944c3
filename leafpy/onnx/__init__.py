"""ONNX in and out: ``load`` turns an ONNX model into a leafpy network (a Sequential of LayerConfigs with named
wiring, its weights set), ``export`` writes a leafpy network as an ONNX model, ``backend`` is an ONNX test backend.

Needs the onnx package (``pip install 'leafpy-dl[onnx]'``), imported on first use: ``import leafpy`` does not import
it. What leafpy cannot compute is a ConfigError naming the node, the operator, the attribute and what is supported;
a malformed model (one that breaks ONNX's schema of an operator) a SerializationError naming the file and the node.
See docs/onnx.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..backends import backend as get_backend
from ..backends.base import Backend
from ..errors import ConfigError, LeafpyError
from ..layers import Layer
from ..layers.network import Network, outermost

DEFAULT_BATCH = 1
"""The batch size declared for a graph whose inputs leave the batch open (any batch size runs)."""


def load(path_or_model: Any, backend: str | Backend = "native", *, batch_size: int | None = None,
         name: str | None = None) -> Layer:
    """The network of an ONNX model (a path, bytes or an onnx.ModelProto) as a leafpy ``Layer`` on ``backend``,
    with the model's weights, in inference mode (BatchNormalization by its running statistics, Dropout the identity,
    as ONNX computes them): ``set_training(True)`` before training it by hand (a Solver switches it itself).
    ``batch_size``: the batch declared where the graph leaves it open (default 1; any batch runs)."""
    from ._proto import read_model
    from .importer import convert

    model = read_model(path_or_model)
    be = get_backend(backend) if isinstance(backend, str) else backend
    if name is None:
        name = model.graph.name or "onnx"
        if isinstance(path_or_model, (str, os.PathLike)):
            name = os.path.splitext(os.path.basename(os.fspath(path_or_model)))[0] or name
    with _naming(path_or_model):  # (building it too: a shape no layer can take, weights of another shape)
        config, weights = convert(model, batch_size=batch_size or DEFAULT_BATCH, name=name)
        net = Layer.from_config(be, config)
        net.load_weights(weights)
    net.preparation = _preparation(model, path_or_model)
    net.set_training(False)  # the model's function: a first forward neither drops nor moves the running statistics
    return net


def read_weights(path_or_model: Any) -> dict[str, np.ndarray]:
    """The weights of an ONNX model by the names :func:`load` gives them ("conv1/weight"), without building the
    network: what ``leafpy train --weights model.onnx`` and ``load_weights`` read."""
    from ._proto import read_model
    from .importer import convert

    model = read_model(path_or_model)
    with _naming(path_or_model):
        return convert(model, batch_size=DEFAULT_BATCH)[1]


def _preparation(model: Any, path_or_model: Any) -> Any:
    """How the model reads data, as a leafpy export recorded it in the model's metadata (None: not recorded)."""
    from ..sources import prepare
    from .exporter import PREPARATION_KEY

    texts = [p.value for p in model.metadata_props if p.key == PREPARATION_KEY]
    where = os.fspath(path_or_model) if isinstance(path_or_model, (str, os.PathLike)) else "the ONNX model"
    return prepare.from_text(texts[-1], f"{where}: metadata {PREPARATION_KEY}") if texts else None


@contextlib.contextmanager
def _naming(path_or_model: Any) -> Iterator[None]:
    """A LeafpyError raised inside (a SerializationError: a malformed model; a ConfigError: what leafpy cannot
    compute; a ShapeError or a size past memory found building its network) names the file it was read from."""
    try:
        yield
    except LeafpyError as e:
        if not isinstance(path_or_model, (str, os.PathLike)) or str(e).startswith(os.fspath(path_or_model)):
            raise
        try:
            named = type(e)(f"{os.fspath(path_or_model)}: {e}")
        except TypeError:  # (an error type of other arguments)
            named = LeafpyError(f"{os.fspath(path_or_model)}: {e}")
        raise named from None


def to_model(layer: Layer | Network[Layer], opset: int = 17) -> Any:
    """``layer`` (or a Network's layer) as an onnx.ModelProto at ``opset`` (13 or later)."""
    from .exporter import to_model as build

    layer = outermost(layer)
    guard = getattr(layer, "exclusive", None)
    with guard("lp.onnx.export") if guard is not None else contextlib.nullcontext():  # (no step half applied)
        return build(layer, opset)


def export(layer: Layer | Network[Layer], path: str | os.PathLike, opset: int = 17) -> None:
    """Write ``layer`` (a network or one layer; a Network such as ``solver.network`` writes its layer) as an ONNX
    model to ``path`` (atomically)."""
    from ..serialization.atomic import atomic_write

    layer = outermost(layer)
    if not isinstance(layer, Layer):
        raise ConfigError(f"lp.onnx.export: expected a leafpy Layer, got {type(layer).__name__}")
    atomic_write(path, to_model(layer, opset).SerializeToString(), example="model.onnx")


__all__ = ["load", "export", "to_model", "read_weights", "DEFAULT_BATCH"]
