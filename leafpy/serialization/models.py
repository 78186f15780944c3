"""Model files and solver checkpoints: what ``Layer.save``/``Layer.load`` and ``Solver.save_checkpoint``/
``Solver.load_checkpoint`` hand over (configs, ``Layer.named_weights()``, ``Solver.snapshot()``) written as leafpy's
(or Leaf's) files and read back, with the checks a trainer state from a file passes."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from .. import _checks
from ..errors import ConfigError, SerializationError
from .atomic import atomic_write
from .codec import read_layer_config, read_solver_config, schema, write_layer_config, write_solver_config
from .fileformat import (
    CHECKPOINT_FIX,
    LOAD_FIX,
    SAVE_FIX,
    _file_writer,
    _guard,
    _opened_parts,
    _RawSection,
    _read_message,
    _read_parts,
    _read_weights,
    _write_weights,
    check_finite,
    reading,
)
from .leaf import check_leaf_representable, from_leaf, is_leaf_file, to_leaf

if TYPE_CHECKING:
    from ..layer_config import LayerConfig, WeightSpec


FORMATS = ("leafpy", "leaf")


class SavedModel(NamedTuple):
    """What a model file holds: the layer's config, its weights by name, and whether Leaf wrote it (then the
    weights carry Leaf's names and flipped convolution filters: see :func:`from_leaf`)."""

    config: LayerConfig
    weights: dict[str, np.ndarray]
    leaf: bool
    preparation: str = ""
    """How the model reads data (JSON: class names, normalisation; see leafpy.sources.prepare); "": none."""


def model_message(config: LayerConfig, weights: Mapping[str, np.ndarray], leaf: bool = False) -> Any:
    """A capnp Layer message: the config and the named weights (raw little-endian float32; Leaf's List(Float32)
    with ``leaf``)."""
    msg = schema().Layer.new_message()
    _fill_layer(msg, config, weights, leaf)
    return msg


def _fill_layer(builder: Any, config: LayerConfig, weights: Mapping[str, np.ndarray], leaf: bool = False,
                section: _RawSection | None = None) -> None:
    builder.name = config.name
    write_layer_config(builder.init("config"), config)
    _write_weights(builder.init("weightsData", len(weights)), list(weights.items()), leaf=leaf, section=section)


def save_model(path: str | os.PathLike, config: LayerConfig, weights: Mapping[str, np.ndarray], *,
               format: str = "leafpy", specs: Sequence[WeightSpec] = (), allow_non_finite: bool = False,
               preparation: str = "") -> None:
    """Write a layer's config and named weights to ``path`` atomically: leafpy's file (with its header and
    checksum), or with ``format="leaf"`` a file Leaf 0.2.1 reads (what Leaf cannot represent is a ConfigError;
    ``specs``, the network's ``Layer.weight_specs()``, give Leaf's weight names and the filters to flip). Weights
    holding NaN or infinite values (or values too large for float32) are refused unless ``allow_non_finite``."""
    if format not in FORMATS:
        raise ConfigError(f"Layer.save: format must be one of {', '.join(FORMATS)}, onnx, got {format!r}")
    check_finite(weights, f"{os.fspath(path)}", SAVE_FIX, allow_non_finite)
    if format == "leaf":
        check_leaf_representable(config, "Layer.save(format='leaf')")
        atomic_write(path, model_message(config, to_leaf(weights, specs), leaf=True).to_bytes_packed())
        return
    msg, section = schema().Layer.new_message(), _RawSection()
    _fill_layer(msg, config, weights, section=section)
    msg.preparation = preparation
    atomic_write(path, _file_writer(msg, "Layer", section))


def read_model(path: str | os.PathLike, *, allow_non_finite: bool = False) -> SavedModel:
    """Read a model file written by :func:`save_model` or by Leaf 0.2.1 (non-finite weights: see
    :func:`check_finite`). The weights are views of the file's private mapping (see ``_checks.map_whole``)."""
    with opened_model(path, allow_non_finite=allow_non_finite) as saved:
        return saved


@contextlib.contextmanager
def opened_model(path: str | os.PathLike, *, allow_non_finite: bool = False) -> Iterator[SavedModel]:
    """:func:`read_model` whose checksum is verified when the block ends, not before it begins: the block (that
    copies the weights into a network) runs while the checksum is computed. What the block made of the weights must
    be thrown away when it raises: SerializationError for a damaged file, whatever the block raised otherwise."""
    path = os.fspath(path)
    with _opened_parts(path, "Layer") as (msg, origin, raw):
        with reading(path, "Layer"):
            config = read_layer_config(msg.config)
            saved = _read_weights(msg.weightsData, path, raw)
            preparation = str(msg.preparation)  # (text that is no UTF-8 raises here)
        check_finite(saved, path, LOAD_FIX, allow_non_finite)
        yield SavedModel(config, saved, is_leaf_file(origin, saved), preparation)


def read_weights(path: str | os.PathLike, *, allow_non_finite: bool = False) -> tuple[dict[str, np.ndarray], bool]:
    """The named weights of a model file or of the network in a solver checkpoint, and whether Leaf wrote them."""
    path = os.fspath(path)
    errors = []
    readers = (("Layer", lambda m: m.weightsData), ("SolverCheckpoint", lambda m: m.network.weightsData))
    for struct_name, weights_of in readers:
        try:
            msg, origin, raw = _read_parts(path, struct_name)
            saved = _guard(path, lambda: _read_weights(weights_of(msg), path, raw))
        except SerializationError as e:
            errors.append(e)
            continue
        check_finite(saved, path, LOAD_FIX, allow_non_finite)
        return saved, is_leaf_file(origin, saved)
    raise errors[0]


class _HoldsWeights(Protocol):
    def weight_specs(self) -> list[WeightSpec]: ...
    def load_weights(self, weights: Mapping[str, Any], *, strict: bool = True) -> Any: ...


def load_weights(layer: _HoldsWeights, path: str | os.PathLike, *, strict: bool = True,
                 allow_non_finite: bool = False) -> Any:
    """Set a network's weights (through its public ``load_weights``, with its ``strict``) from a model file or from
    the network in a solver checkpoint, by name; errors name the file. Returns what ``load_weights`` returns (the
    weights left alone). Non-finite weights are refused unless ``allow_non_finite`` (see :func:`check_finite`)."""
    path = os.fspath(path)
    saved, leaf = read_weights(path, allow_non_finite=allow_non_finite)
    with reading(path):
        return layer.load_weights(from_leaf(saved, layer.weight_specs()) if leaf else saved, strict=strict)


def saved_network_config(path: str | os.PathLike) -> LayerConfig:
    """The network config a model file (or a solver checkpoint's network) records."""
    path = os.fspath(path)
    errors = []
    readers = (("Layer", lambda m: m.config), ("SolverCheckpoint", lambda m: m.config.network))
    for struct_name, config_of in readers:
        try:
            msg = _read_message(path, struct_name)
            return _guard(path, lambda: read_layer_config(config_of(msg)))
        except SerializationError as e:
            errors.append(e)
    raise errors[0]



class SavedCheckpoint(NamedTuple):
    """What a solver checkpoint holds: the solver's config, the network's weights by name, and the rest of the
    solver's state as ``Solver.snapshot()`` gives it."""

    config: Any
    weights: dict[str, np.ndarray]
    state: dict[str, Any]


STATE_SEPARATOR = "#"
"""Update-rule history is stored as Weights named "{weight}#{state}" (a state's name has no '#')."""


def save_checkpoint(path: str | os.PathLike, config: Any, weights: Mapping[str, np.ndarray],
                    state: Mapping[str, Any]) -> None:
    """Write a checkpoint atomically: the SolverConfig ``config``, the network's named ``weights`` and ``state``
    (``Solver.snapshot()``: iteration, pending_calls, history, accumulated, random, trainer_state). Non-finite
    weights are refused: a checkpoint must be one to continue from."""
    check_finite(weights, os.fspath(path), CHECKPOINT_FIX)
    history = [(f"{w}{STATE_SEPARATOR}{s}", arr) for w, per_weight in state["history"].items()
               for s, arr in per_weight.items()]
    acc = list(state["accumulated"].items())
    check_finite(dict(history), os.fspath(path), CHECKPOINT_FIX)  # the rule's history too: a state to continue from
    # (accumulated gradients may hold an inf under dynamic loss scaling: the step they make is then skipped)
    trainer_json = trainer_state_json(state["trainer_state"], f"{os.fspath(path)}: the trainer state")
    msg, section = schema().SolverCheckpoint.new_message(), _RawSection()
    write_solver_config(msg.init("config"), config)
    _fill_layer(msg.init("network"), config.network, weights, section=section)
    msg.iteration = int(state["iteration"])
    _write_weights(msg.init("state", len(history)), history, section=section)
    msg.pendingCalls = int(state["pending_calls"])
    _write_weights(msg.init("accumulated", len(acc)), acc, section=section)
    msg.rngSeeds = [int(r["seed"]) for r in state["random"]]
    msg.rngCalls = [int(r["calls"]) for r in state["random"]]
    msg.trainerState = trainer_json
    scaling = state.get("loss_scale")
    if scaling is not None:
        msg.lossScale = float(scaling["scale"])
        msg.lossScaleGoodSteps = int(scaling["good_steps"])
        msg.skippedSteps = int(scaling["skipped_steps"])
    atomic_write(path, _file_writer(msg, "SolverCheckpoint", section))


def read_checkpoint(path: str | os.PathLike, config_class: type) -> SavedCheckpoint:
    """Read a checkpoint written by :func:`save_checkpoint`; its solver config is built as ``config_class``."""
    path = os.fspath(path)
    msg, _, raw = _read_parts(path, "SolverCheckpoint")
    with reading(path, "SolverCheckpoint"):
        config = read_solver_config(msg.config, config_class)
        weights = _read_weights(msg.network.weightsData, path, raw)
        check_finite(weights, path, "load an earlier checkpoint, or start a new run", allow=False)
        history: dict[str, dict[str, np.ndarray]] = {}
        for key, arr in _read_weights(msg.state, path, raw).items():
            weight, sep, name = key.rpartition(STATE_SEPARATOR)
            if not sep:
                raise SerializationError(f"{path}: solver state {key!r} is not named '{{weight}}#{{state}}'; the "
                                         "file is damaged")
            history.setdefault(weight, {})[name] = arr
        accumulated = _read_weights(msg.accumulated, path, raw)
        check_finite({f"{w}{STATE_SEPARATOR}{s}": arr for w, per_weight in history.items()
                      for s, arr in per_weight.items()}, path,
                     "load an earlier checkpoint, or start a new run from its weights (--weights)")
        if len(msg.rngSeeds) != len(msg.rngCalls):
            raise SerializationError(f"{path}: the checkpoint records {len(msg.rngSeeds)} random streams' seeds but "
                                     f"{len(msg.rngCalls)} draw counts; the file is damaged")
        scale = float(msg.lossScale)
        if not (math.isfinite(scale) and scale >= 0):
            raise SerializationError(f"{path}: the checkpoint's loss scale is {scale}, where it is positive (or 0: "
                                     "no loss scaling); the file is damaged")
        state = {
            "iteration": int(msg.iteration),
            "pending_calls": int(msg.pendingCalls),
            "history": history,
            "accumulated": accumulated,
            "random": [{"seed": int(s), "calls": int(c)} for s, c in zip(msg.rngSeeds, msg.rngCalls)],
            "trainer_state": _read_trainer_state(str(msg.trainerState), path),
        }
        if scale > 0:  # 0: a checkpoint without loss scaling
            state["loss_scale"] = {"scale": scale, "good_steps": int(msg.lossScaleGoodSteps),
                                   "skipped_steps": int(msg.skippedSteps)}
    return SavedCheckpoint(config, weights, state)


TRAINER_STATE_LIMIT = 1 << 20
"""The largest trainer state (bytes of JSON) a checkpoint may carry."""


def _read_trainer_state(text: str, path: str) -> dict[str, Any]:
    if not text:
        return {}
    if len(text) > TRAINER_STATE_LIMIT:
        raise SerializationError(f"{path}: the checkpoint's trainer state is {len(text)} bytes, more than "
                                 f"{TRAINER_STATE_LIMIT}; the file is damaged")
    try:
        state = json.loads(text)
    except ValueError as e:
        raise SerializationError(f"{path}: the checkpoint's trainer state is not JSON ({e}); the file is "
                                 "damaged") from e
    if not isinstance(state, dict):
        raise SerializationError(f"{path}: the checkpoint's trainer state is a {type(state).__name__}, not an "
                                 "object; the file is damaged")
    check_trainer_state(state, f"{path}: the checkpoint's trainer state")
    return state


COUNT_LIMIT = 2**53
"""The largest epoch, sample or loss count a trainer state holds (JSON numbers are exact up to 2**53)."""
TRAINER_STATE_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "epoch": ("a count", lambda v: _checks.counter(v, COUNT_LIMIT)),
    "sample": ("a count", lambda v: _checks.counter(v, COUNT_LIMIT)),
    "loss_count": ("a count", lambda v: _checks.counter(v, COUNT_LIMIT)),
    "correct": ("a count", lambda v: _checks.counter(v, COUNT_LIMIT)),
    "scored": ("a count", lambda v: _checks.counter(v, COUNT_LIMIT)),
    "loss_sum": ("a finite number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                 and math.isfinite(v)),
    "loss_weight": ("a finite number >= 0", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v) and v >= 0),
    "data": ("an object (the run's data section)", lambda v: isinstance(v, dict)),
    "data_digest": ("a text", lambda v: isinstance(v, str)),
}
"""What each entry the Trainer records in a checkpoint must be (entries of other names are kept as they are)."""


def trainer_state_problem(state: Mapping[str, Any]) -> str | None:
    """What is wrong with a trainer state (an entry of the wrong type or range, more correct predictions than
    scored samples), or None."""
    for key, (what, valid) in TRAINER_STATE_FIELDS.items():
        if key in state and not valid(state[key]):
            bound = f" in [0, {COUNT_LIMIT}]" if what == "a count" else ""
            return f"{key} is {json.dumps(state[key], default=repr)[:80]}, expected {what}{bound}"
    if state.get("correct", 0) > state.get("scored", 0):
        return f"{state['correct']} correct predictions of {state.get('scored', 0)} scored samples"
    return None


def check_trainer_state(state: Mapping[str, Any], where: str) -> None:
    """Refuse (SerializationError) a checkpoint's trainer state that :func:`trainer_state_problem` finds wrong."""
    problem = trainer_state_problem(state)
    if problem is not None:
        raise SerializationError(f"{where}: {problem}; the file is damaged: resume from another checkpoint, or start "
                                 "again with --weights FILE")


def trainer_state_json(state: Mapping[str, Any], where: str) -> str:
    """A trainer state as a checkpoint keeps it (JSON; NumPy numbers as Python's), refused (ConfigError) where a
    checkpoint holding it would not load: values JSON cannot hold (NaN, objects), or what
    :func:`trainer_state_problem` finds."""
    if not state:
        return ""
    def plain(v: Any) -> Any:
        if isinstance(v, (np.generic, np.ndarray)):
            return v.tolist()
        raise TypeError(f"a {type(v).__name__}")
    try:
        text = json.dumps(state, sort_keys=True, allow_nan=False, default=plain)
        problem = trainer_state_problem(json.loads(text))
    except (TypeError, ValueError) as e:
        problem = f"not JSON values ({e})"
    if problem is not None:
        raise ConfigError(f"{where}: {problem}; the training loop's state must be JSON values a checkpoint can "
                          "hold and read back (counts, finite numbers, text)")
    if len(text) > TRAINER_STATE_LIMIT:
        raise ConfigError(f"{where}: {len(text)} bytes of JSON, more than the {TRAINER_STATE_LIMIT} a checkpoint "
                          "holds")
    return text
