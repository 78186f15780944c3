"""Layer, the Worker base class and ``register_layer`` (configs and the registry's data: layer_config.py).

A layer is a config dataclass plus a worker. The worker declares its arity and whether it can run in place,
computes output and weight shapes from input shapes, and implements ``forward``, ``backward_input`` and
``backward_parameters`` with backend primitives. The :class:`Layer` wrapper owns the SharedTensors (outputs and
their gradients, weights and weight gradients), is connected to its inputs by its container, and runs the worker.

Lifecycle: construct (config checked) -> ``bind`` (shapes checked, weights created, outputs sized; again when the
batch size changes) -> ``run_forward`` / ``run_backward``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from .. import _checks
from .._checks import layout_hint, same_layout  # noqa: F401  (re-exported for the layer modules)
from .._exclusive import OneCaller
from ..backends.base import Backend, Buffer
from ..errors import ConfigError, LeafpyError, SerializationError, ShapeError
from ..layer_config import (  # noqa: F401  (re-exported: layer modules import them from here)
    FILLER_TYPES,
    FillerConfig,
    LayerConfig,
    LayerType,
    Shape,
    WeightConfig,
    WeightSpec,
    add_layer_type,
    layer_types,
    lookup,
    type_of_config,
)
from ..sources.prepare import Preparation
from ..tensor import SharedTensor, as_numbers, recording
from .network import Network

WRITTEN_ELSEWHERE = {"onnx": ("leafpy.onnx", "export")}
"""Save formats written by a module of their own, named rather than imported (that module builds on the layers),
and imported on first use: format -> (module, function(layer, path))."""


def register_layer(name: str, config_class: type | None = None) -> Callable[[type], type]:
    """Class decorator registering a Worker (or container Layer) under a type name and its config class."""

    def deco(cls: type) -> type:
        add_layer_type(LayerType(name, config_class, cls, is_container=issubclass(cls, Layer)))
        cls.type_name = name  # type: ignore[attr-defined]
        return cls

    return deco


TRAINED_SHARED = object()
"""The key, in a network's weight registry, of the names of its shared weights that a layer trains."""


class LoadedWeights(NamedTuple):
    """What :meth:`Layer.load_weights` left alone (with ``strict=False``)."""

    missing: list[str]
    """The network's weights that were not given (they keep their values)."""
    unexpected: list[str]
    """Given names that match no weight of the network (ignored)."""


# --------------------------------------------------------------------------------------------------------------
# Worker
# --------------------------------------------------------------------------------------------------------------
class Worker:
    """What a layer computes. Subclasses declare arity and capabilities as class attributes."""

    type_name: ClassVar[str] = ""
    num_inputs: int = 1  # a class attribute; a worker whose arity follows its config sets its own
    num_outputs: int = 1
    in_place: ClassVar[bool] = False
    """The output may share the input's storage."""
    modifies_data: ClassVar[bool] = True
    """False for layers whose output is their input seen with another shape."""
    backward_reads_output: ClassVar[bool] = False
    """The backward pass reads the layer's output (so a later layer must not overwrite it in place); without it the
    backward methods get None for each output in ``y``."""
    differentiable: ClassVar[tuple[bool, ...] | None] = None
    """Per input: whether it can take a gradient (None: all)."""
    checked_inputs: ClassVar[tuple[int, ...] | None] = None
    """The inputs the worker's ``validate`` checks on the host (ids, labels), where it has one (None: all)."""
    weight_names: tuple[str, ...] = ()  # a worker without some optional weight (a bias) sets its own
    untrained_weights: ClassVar[tuple[str, ...]] = ()
    """Weights kept with the model but not trained (running statistics): their lr_mult and decay_mult are 0."""
    master_precision_outputs: ClassVar[bool] = False
    """Under bf16 and fp16 the worker's outputs and their gradients are in the master dtype (softmax and
    log-softmax, as autocast keeps them in float32: probabilities and log-probabilities lose no digits)."""
    master_precision_weights: ClassVar[bool] = False
    """Under bf16 and fp16 the worker reads its weights in the master dtype (float32), as BatchNorm's scale, shift
    and running statistics are kept in cuDNN; otherwise it reads low-precision copies of them."""
    running_in_place: bool = False
    """Set by the Layer: the output shares the input's storage in this network."""
    input_gradient_needs_parameter_pass: ClassVar[bool] = False
    """``backward_input`` reads what ``backward_parameters`` computed (BatchNorm's sums): the latter runs before it
    even where the layer's weights are frozen."""

    def __init__(self, config: Any, layer_name: str) -> None:
        self.config = config
        self.layer_name = layer_name
        self.training = True
        self.seed = 0
        self.ws: dict = {}

    @property
    def where(self) -> str:
        return f"layer '{self.layer_name}' ({self.type_name})"

    def check_inputs(self, input_shapes: list[Shape]) -> None:
        if len(input_shapes) != self.num_inputs:
            shapes = ", ".join(str(tuple(s)) for s in input_shapes) or "none"
            raise ShapeError(f"{self.where}: expected {self.num_inputs} input{'s' * (self.num_inputs != 1)}, "
                             f"got {len(input_shapes)} (shapes {shapes})")

    def output_shapes(self, input_shapes: list[Shape]) -> list[Shape]:
        """Output shapes for these input shapes; raises ShapeError naming the layer when they don't fit."""
        return [tuple(input_shapes[0])]

    def weight_shapes(self, input_shapes: list[Shape]) -> list[Shape]:
        return []

    def before_step(self, backend: Backend) -> None:
        """Called by the solver before each training step, outside any recording: write what changes from step to
        step (a random seed) into this worker's device buffers, so a recorded step replays with the new values."""

    def after_step(self, ran: bool) -> None:
        """Called by the solver after each training step (``ran``), or when the batch was refused before the step
        ran (then what :meth:`before_step` drew is taken back). A replayed step runs none of the worker's Python."""

    def default_filler(self, index: int) -> FillerConfig:
        return FillerConfig(type="glorot_uniform") if index == 0 else FillerConfig(type="constant", value=0.0)

    def setup(self, backend: Backend, input_shapes: list[Shape]) -> None:
        """Allocate scratch for these shapes (called on every bind)."""

    def updated_in_forward(self) -> tuple[int, ...]:
        """Indices of the weights that the next forward pass writes (running statistics in training)."""
        return ()

    def work_shapes(self, input_shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Arrays besides its outputs that the worker may allocate whose size its config, not its input, sets (a
        pooling's padded input): declared with its outputs, so a config that asks too much is refused before."""
        return []

    def forward(self, backend: Backend, x: list[Buffer], w: list[Buffer], y: list[Buffer]) -> None:
        raise NotImplementedError

    def backward_input(self, backend: Backend, x: list[Buffer], y: list[Buffer | None], dy: list[Buffer],
                       w: list[Buffer], dx: list[Buffer | None]) -> None:
        """Write the input gradients ``dx`` (None where no gradient is wanted). ``y`` holds the outputs only where
        the worker declares ``backward_reads_output`` (None otherwise)."""
        raise NotImplementedError

    def backward_parameters(self, backend: Backend, x: list[Buffer], y: list[Buffer | None], dy: list[Buffer],
                            dw: list[Buffer], beta: list[float]) -> None:
        """Write weight gradients: ``dw[i] = grad + beta[i] * dw[i]`` (beta 1 accumulates into a shared weight)."""


# --------------------------------------------------------------------------------------------------------------
# Layer
# --------------------------------------------------------------------------------------------------------------
def weight_name_part(layer_name: str) -> str:
    """A layer's name as it appears in weight names ("conv1/weight"), where '/' separates layers and weights:
    '%' and '/' are written %25 and %2F (Leaf's networks name layers like "conv1/relu")."""
    return layer_name.replace("%", "%25").replace("/", "%2F")


_UNFILLED: contextvars.ContextVar[bool] = contextvars.ContextVar("leafpy_unfilled_weights", default=False)
"""True while Layer.load builds a network whose weights the file then sets, every one: no initial values drawn."""


class Layer:
    """A layer instance on a backend: config, worker, and the tensors it owns."""

    container: str | None = None
    """The name of the container whose layer this is (None: an outermost layer, which a Network runs)."""

    def __init__(self, backend: Backend, config: LayerConfig, *, seed: int | None = None,
                 weight_registry: dict | None = None, _worker: Worker | None = None) -> None:
        self.backend = backend
        self.config = config
        self.name = config.name
        self.preparation: Preparation | None = None
        """How the model reads data (class names, normalisation: ``preparation.inputs(x)`` before ``forward``,
        ``preparation.outputs(y)`` after it), as training recorded it in the model file; None: nothing recorded."""
        self._rng = np.random.default_rng(seed)
        self._registry = weight_registry if weight_registry is not None else {}
        self.worker = _worker
        if _worker is not None:
            _worker.seed = int(self._rng.integers(2**31))
            n_w = len(_worker.weight_names)
            if len(config.params) > n_w:
                raise ConfigError(f"layer '{self.name}' ({config.type}): {len(config.params)} params entries given, "
                                  f"but this layer has {n_w} weight{'s' * (n_w != 1)} "
                                  f"({', '.join(_worker.weight_names) or 'none'})")
            # a weight shared by name trains where any layer sharing it trains it (each layer then computes its
            # part of the gradient): the network's layers register the shared names they train
            self._shared_names = [p.name for p in config.params if p.name]
            trained = self._registry.setdefault(TRAINED_SHARED, set())
            trained.update(p.name for p, wname in zip(config.params, _worker.weight_names)
                           if p.name and p.lr_mult != 0.0 and wname not in _worker.untrained_weights)
        elif config.params:
            raise ConfigError(f"layer '{self.name}' ({config.type}): a container has no weights of its own, so its "
                              f"params ({len(config.params)} given) would do nothing; give them to the layers inside "
                              "it")
        self.training = True
        self.weights: list[SharedTensor] = []
        self.weight_grads: list[SharedTensor] = []
        self._weight_names: list[str] = []
        self._weight_configs: list[WeightConfig] = []
        self.weight_beta: list[float] = []
        self.weight_copies: list[SharedTensor | None] = []
        """Under bf16 and fp16: per weight, its copy in the backend's compute dtype that forward and
        backward_input read (cast from the master weight by a forward pass that finds the master changed), or
        None."""
        self._copied_versions: list[int | None] = []  # per copy, the master weight's version it was cast from
        self.updated_copies: set[int] = set()
        """The weights whose copy a solver's update writes with the weight itself (``Backend.solver_update``'s
        ``copy``): a recorded step's forward pass does not cast them (see :meth:`refresh_copy`)."""
        self.inputs: list[SharedTensor] = []
        self.input_grads: list[SharedTensor | None] = []
        self.outputs: list[SharedTensor] = []
        self.output_grads: list[SharedTensor] = []
        self.in_place = False
        self.runs_backward = True
        self.ran_forward = False
        self._declared_bytes = 0  # what bind() declared for this layer's weights and outputs
        self.exclusive = OneCaller(f"layer '{self.name}'")
        """``with layer.exclusive("save"):`` one thread at a time in this layer (see :meth:`forward`)."""

    # --- construction ------------------------------------------------------------------------------------
    @staticmethod
    def from_config(backend: Backend, config: LayerConfig, *, seed: int | None = None,
                    weight_registry: dict | None = None) -> Layer:
        """Build a layer (or a whole network, for a Sequential config) on ``backend``.

        ``seed`` makes weight initialisation and dropout reproducible.
        """
        if not isinstance(config, LayerConfig):
            raise ConfigError(f"Layer.from_config: expected a LayerConfig, got {type(config).__name__}")
        if not isinstance(backend, Backend):
            raise ConfigError(f"Layer.from_config: expected a backend (leafpy.backend(name)), got {backend!r}")
        if seed is not None:
            seed = _checks.non_negative_int("Layer.from_config: seed", seed)
        entry = lookup(config.type, f"layer '{config.name}'")
        if entry.is_container:
            return entry.impl(backend, config, seed=seed, weight_registry=weight_registry)
        return Layer(backend, config, seed=seed, weight_registry=weight_registry,
                     _worker=entry.impl(config.config, config.name))

    @staticmethod
    def load(backend: Backend, path: str, *, allow_non_finite: bool = False) -> Layer:
        """Read a layer (config and weights) saved with :meth:`save`, or by Leaf 0.2.1. A file whose weights hold
        NaN or infinite values is refused (SerializationError naming the weight); ``allow_non_finite=True`` loads
        it with a RuntimeWarning instead, to inspect it."""
        from .. import serialization
        from ..sources import prepare

        _checks.path("Layer.load: path", path)
        if not isinstance(backend, Backend):  # (before the file is read: the file is not what is wrong)
            raise ConfigError(f"Layer.load: expected a backend (leafpy.backend(name)), got {backend!r}")
        path = os.fspath(path)
        allow = _checks.flag("Layer.load: allow_non_finite", allow_non_finite)
        # the weights are copied from the file while its checksum is computed; a damaged file raises on leaving
        with serialization.opened_model(path, allow_non_finite=allow) as saved, serialization.reading(path, "Layer"):
            unfilled = _UNFILLED.set(True)  # strict: the file sets every weight, so the fillers' draws are skipped
            try:
                layer = Layer.from_config(backend, saved.config)
            finally:
                _UNFILLED.reset(unfilled)
            layer._load_saved(saved.weights, True, saved.leaf, path)
        layer.preparation = prepare.from_text(saved.preparation, path)
        return layer

    def save(self, path: str, format: str = "leafpy", *, allow_non_finite: bool = False) -> None:
        """Write this layer's config and weights to ``path`` (Cap'n Proto, atomically): leafpy's file, with a
        header and a checksum, or with ``format="leaf"`` a file Leaf 0.2.1 reads (Leaf's weight names, flipped
        convolution filters; a ConfigError for what Leaf cannot represent, such as biases), or with
        ``format="onnx"`` an ONNX model at opset 17 (``lp.onnx.export``, which takes other opsets). Weights holding
        NaN or infinite values are refused (SerializationError naming the weight, nothing written) unless
        ``allow_non_finite=True``, which writes them with a RuntimeWarning."""
        from .. import serialization

        _checks.path("Layer.save: path", path)
        if format in WRITTEN_ELSEWHERE:
            module, function = WRITTEN_ELSEWHERE[format]
            with self.exclusive("save"):
                getattr(importlib.import_module(module), function)(self, path)
            return
        allow = _checks.flag("Layer.save: allow_non_finite", allow_non_finite)
        with self.exclusive("save"):  # the file is written from the weights' host buffers: no copy, no change meanwhile
            serialization.save_model(path, self.config, self._host_weights(), format=format,
                                     specs=self.weight_specs(), allow_non_finite=allow,
                                     preparation=self.preparation.to_text() if self.preparation is not None else "")

    # --- properties -------------------------------------------------------------------------------------
    @property
    def has_weights(self) -> bool:
        """Whether the layer holds weights (learnable or not, as BatchNorm's running statistics)."""
        return bool(self.worker is not None and self.worker.weight_names)

    @property
    def trains_weights(self) -> bool:
        """Whether a weight of this layer moves in training (its ``lr_mult`` is not 0). Only those get gradients: a
        layer whose weights are all frozen computes none (Caffe's ``param_propagate_down``) and runs backward only to
        pass gradients on to layers before it that need them."""
        trained = self._registry.get(TRAINED_SHARED, ())
        return any(cfg.lr_mult != 0.0 for cfg in self._weight_configs) or any(
            name in trained for name in getattr(self, "_shared_names", ()))

    @property
    def computes_weight_gradients(self) -> bool:
        """Whether its backward pass writes its weights' gradients: it holds weights and trains one of them (or its
        input gradient needs that pass, see ``Worker.input_gradient_needs_parameter_pass``)."""
        worker = self.worker
        return bool(self.weights) and (self.trains_weights or bool(
            worker is not None and worker.input_gradient_needs_parameter_pass))

    @property
    def num_inputs(self) -> int:
        """How many input blobs the layer reads."""
        return self.worker.num_inputs  # type: ignore[union-attr]

    @property
    def backward_reads_output(self) -> bool:
        """Whether the backward pass reads the layer's output (then a later layer may not overwrite it in place)."""
        return self.worker.backward_reads_output  # type: ignore[union-attr]

    def workers(self) -> list[Worker]:
        """The workers of this layer and, for containers, of every layer inside, in network order."""
        return [self.worker] if self.worker is not None else []

    def validate(self, fed: Sequence[SharedTensor] | None = None) -> None:
        """Check input values that a worker can check cheaply on the host (labels and ids in range). ``fed``: check
        only the inputs that are views of these tensors (the values staged from the host for a step that is about to
        be replayed, where no layer's forward runs to check them; the other inputs hold the last step's values)."""
        check = getattr(self.worker, "validate", None)
        if check is not None:
            check([t.peek_host() if fed is None or any(t.shares_storage(f) for f in fed) else None
                   for t in self.inputs])

    def checks_computed(self, fed: Sequence[SharedTensor]) -> bool:
        """Whether a layer here checks on the host (:meth:`validate`) an input that is no view of ``fed`` but
        computed within the step (ids from a Slice): where the host holds it (the native backend), its own pass
        refuses a bad value, and a replayed step, which runs no layer's check, would take it."""
        w = self.worker
        if w is None or getattr(w, "validate", None) is None:
            return False
        checked = range(len(self.inputs)) if w.checked_inputs is None else w.checked_inputs
        return any(not any(self.inputs[i].shares_storage(f) for f in fed) for i in checked)

    def set_training(self, training: bool = True) -> None:
        """Training mode (dropout active, BatchNorm on the batch's statistics) or inference mode; a container passes
        it on to every layer inside."""
        if not isinstance(training, (bool, np.bool_)):
            raise ConfigError(f"layer '{self.name}': set_training expects True or False, got {training!r}"[:300])
        with self.exclusive("set_training"):
            self._set_mode(bool(training))

    def _set_mode(self, training: bool) -> None:
        """set_training's work, once checked (a container passes it on to its layers)."""
        self.training = training
        if self.worker is not None:
            self.worker.training = training

    def learnable_weights_data(self) -> list[SharedTensor]:
        """The weights, in network order, a weight shared by name once (``learnable_weights_names`` names them)."""
        return _unique(self._weight_entries())[0]

    def learnable_weights_gradients(self) -> list[SharedTensor]:
        """The weights' gradients, in the order of ``learnable_weights_data`` (written by ``backward``)."""
        return _unique(self._weight_entries())[1]

    def learnable_weights_names(self) -> list[str]:
        """The weights' names, e.g. ``["conv1/weight", "conv1/bias", ...]`` (a shared weight under its shared name)."""
        return _unique(self._weight_entries())[2]

    def learnable_weights_configs(self) -> list[WeightConfig]:
        """Each weight's WeightConfig (lr_mult, decay_mult, filler), in the order of ``learnable_weights_data``."""
        return _unique(self._weight_entries())[3]

    def _weight_entries(self) -> list[tuple[SharedTensor, SharedTensor, str, WeightConfig]]:
        return list(zip(self.weights, self.weight_grads, self._weight_names, self._weight_configs))

    def check_shared_multipliers(self) -> None:
        """Layers sharing a weight by name must agree on its ``lr_mult`` and ``decay_mult`` (one weight, one update):
        a ConfigError naming both otherwise. A Solver checks its network so; a network that is only run (a model
        file predicting) uses the first layer's settings."""
        first: dict[int, tuple[str, WeightConfig]] = {}
        for layer in self._leaf_layers():
            where = layer.worker.where if layer.worker is not None else f"layer '{layer.name}'"
            for w, name, cfg in zip(layer.weights, layer._weight_names, layer._weight_configs):
                owner, given = first.setdefault(id(w), (where, cfg))
                for field in ("lr_mult", "decay_mult"):
                    if getattr(cfg, field) != getattr(given, field):
                        raise ConfigError(f"{where}: shared weight '{name}' has {field} {getattr(given, field):g} in "
                                          f"{owner}, {getattr(cfg, field):g} here; give every layer sharing it the "
                                          f"same {field}")

    def _leaf_layers(self) -> list[Layer]:
        """The layers holding weights of their own: this one (a container: its layers', nested ones included)."""
        return [self]

    def input_dtype(self, k: int) -> np.dtype:
        """The dtype input k is staged in: the backend's compute dtype for data, the master dtype for ids and labels
        (inputs that take no gradient), which bfloat16 would round (ids above 256)."""
        be = self.backend
        return np.dtype(be.compute_dtype if self.input_takes_gradient(k) else be.dtype)

    def num_parameters(self) -> int:
        """The number of weight values (a shared weight counted once)."""
        return sum(w.size for w in self.learnable_weights_data())

    # --- named weights ------------------------------------------------------------------------------------
    def named_weights(self) -> dict[str, np.ndarray]:
        """Every weight as a host copy, by name, in network order (the names of :meth:`learnable_weights_names`,
        e.g. ``"conv1/weight"``; a weight shared by several layers appears once). What :meth:`save` writes."""
        with self.exclusive("named_weights"):  # (another thread's step would leave some weights a step ahead)
            return {name: t.to_numpy() for name, t in zip(self.learnable_weights_names(),
                                                          self.learnable_weights_data())}

    def _host_weights(self) -> dict[str, np.ndarray]:
        """:meth:`named_weights` without copies where the host holds the current values (views of the buffers:
        read them only while this layer is held)."""
        out = {}
        for name, t in zip(self.learnable_weights_names(), self.learnable_weights_data()):
            host = t.peek_host()
            out[name] = t.to_numpy() if host is None else host
        return out

    def load_weights(self, weights: Mapping[str, Any], *, strict: bool = True) -> LoadedWeights:
        """Set weights by name from ``weights`` (name -> array), as :meth:`named_weights` gives them; Leaf's names
        ``"{layer}-{i}"`` (the layer's i-th weight) are understood too. Every array must have its weight's shape.
        With ``strict`` a name that matches no weight, or a weight missing from ``weights``, is a ConfigError;
        without, those weights keep their values and are listed in the result. Nothing is set unless every given
        weight fits. A standalone layer that has not run yet creates its weights on its first forward pass: the
        values are kept and set then."""
        with self.exclusive("load_weights"):
            return self._load_weights(weights, strict)

    def _load_weights(self, weights: Mapping[str, Any], strict: bool) -> LoadedWeights:
        if not isinstance(weights, Mapping):
            raise ConfigError(f"layer '{self.name}': load_weights takes a mapping of weight names to arrays (as "
                              f"named_weights() returns), got {type(weights).__name__}")
        if not isinstance(strict, bool):
            raise ConfigError(f"layer '{self.name}': load_weights: strict must be true or false, got {strict!r}")
        if not self.weights and self.worker is not None and self.worker.weight_names:
            # set when _create_weights runs: (weights, strict, from a Leaf file, the file)
            self._pending_weights: tuple[dict[str, Any], bool, bool, str | None] = (dict(weights), strict, False, None)
            return LoadedWeights([], [])
        names = self.learnable_weights_names()
        from ..serialization.leaf import leaf_aliases

        unique, ambiguous = leaf_aliases(self.weight_specs())
        aliases = {alias: spec.name for alias, spec in unique.items()}
        by_name: dict[str, np.ndarray] = {}
        unexpected = []
        for key, value in weights.items():
            if isinstance(key, str) and key not in names and key in ambiguous:
                raise ConfigError(f"layer '{self.name}': load_weights: {key!r} is Leaf's name of several weights "
                                  f"here ({', '.join(ambiguous[key])}: layers of the same name in different "
                                  "containers); use the weights' own names")
            target = key if key in names else aliases.get(key) if isinstance(key, str) else None
            if target is None:
                unexpected.append(key)
                continue
            by_name[target] = as_numbers(value, f"layer '{self.name}': load_weights: weight {key!r}")
        missing = [n for n in names if n not in by_name]
        if strict and unexpected:
            raise ConfigError(f"layer '{self.name}': load_weights: weight {unexpected[0]!r} matches no weight of "
                              f"the network (its weights: {', '.join(names) or 'none'}); pass strict=False to "
                              "ignore names it does not have")
        if strict and missing:
            raise ConfigError(f"layer '{self.name}': load_weights: weight {missing[0]!r} is missing from the given "
                              f"weights (given: {', '.join(map(str, weights)) or 'none'}); pass strict=False to "
                              "keep the current values of missing weights")
        tensors = dict(zip(names, self.learnable_weights_data()))
        for name, arr in by_name.items():
            want = tensors[name].shape
            if arr.shape != want:
                raise ShapeError(f"layer '{self.name}': load_weights: weight {name!r} has shape {arr.shape} in the "
                                 f"given weights, the network needs {want}")
        for name, arr in by_name.items():
            tensors[name].set(arr)
        return LoadedWeights(missing, unexpected)

    def weight_specs(self) -> list[WeightSpec]:
        """Where each weight lives: one entry per weight of every layer in network order, with the weight's name
        (as in :meth:`named_weights`), the layer holding it, that layer's type, the weight's name and position
        within the layer, and its shape. A weight shared by several layers has an entry for each."""
        return [spec for spec, _ in self._weight_slots()]

    def _weight_slots(self) -> list[tuple[WeightSpec, WeightConfig]]:
        names = self.worker.weight_names if self.worker is not None else ()
        return [(WeightSpec(name, self.name, self.config.type, local, i, t.shape), cfg)
                for i, (name, local, cfg, t) in enumerate(zip(self._weight_names, names, self._weight_configs,
                                                             self.weights))]

    def _load_saved(self, weights: dict[str, np.ndarray], strict: bool, leaf: bool, source: str | None) -> None:
        """load_weights for weights read from a file (``source``; errors name it); ``leaf``: a file Leaf wrote,
        whose convolution filters are flipped."""
        if not self.weights and self.worker is not None and self.worker.weight_names:
            if weights:
                self._pending_weights = (weights, strict, leaf, source)
            return
        from ..serialization.leaf import from_leaf

        try:
            self.load_weights(from_leaf(weights, self.weight_specs()) if leaf else weights, strict=strict)
        except (ConfigError, ShapeError) as e:
            if source is None:
                raise
            raise SerializationError(f"{source}: {e}") from None

    # --- wiring -------------------------------------------------------------------------------------------
    def _create_weights(self, shapes: list[Shape]) -> None:
        worker = self.worker
        assert worker is not None
        w_shapes = worker.weight_shapes(shapes)
        if self.weights:
            for name, w, s in zip(self._weight_names, self.weights, w_shapes):
                if w.shape != tuple(s):
                    raise ShapeError(f"{worker.where}: weight '{name}' has shape {w.shape}, but inputs of shapes "
                                     f"{[tuple(x) for x in shapes]} need {tuple(s)}")
            return
        dtype = self.backend.dtype
        copies = self.backend.mixed and not worker.master_precision_weights
        for i, (wname, shape) in enumerate(zip(worker.weight_names, w_shapes)):
            cfg = self.config.params[i] if i < len(self.config.params) else WeightConfig()
            if wname in worker.untrained_weights:
                cfg = dataclasses.replace(cfg, lr_mult=0.0, decay_mult=0.0)
            full = cfg.name or f"{weight_name_part(self.name)}/{wname}"
            shared = self._registry.get(full) if cfg.name else None
            if shared is not None:
                data, grad = shared
                if data.shape != tuple(shape):
                    raise ShapeError(f"{worker.where}: shared weight '{full}' has shape {data.shape}, "
                                     f"this layer needs {tuple(shape)}")
            else:
                filler = cfg.filler or worker.default_filler(i)
                data = SharedTensor(shape, dtype)
                if not _UNFILLED.get():
                    data.set(filler.fill(tuple(shape), self._rng))
                grad = SharedTensor(shape, dtype)
                if cfg.name:
                    self._registry[full] = (data, grad)
            self.weights.append(data)
            self.weight_copies.append(SharedTensor(shape, self.backend.compute_dtype) if copies else None)
            self._copied_versions.append(None)
            self.weight_grads.append(grad)
            self._weight_names.append(full)
            self._weight_configs.append(cfg)
            self.weight_beta.append(0.0)
        pending = getattr(self, "_pending_weights", None)
        if pending is not None:
            del self._pending_weights
            self._load_saved(*pending)

    def bind(self, inputs: list[SharedTensor], input_grads: list[SharedTensor | None], *,
             in_place: bool = False) -> None:
        """Connect input tensors (and the gradient tensors to write, None where not needed); size the outputs."""
        worker = self.worker
        assert worker is not None
        shapes = [t.shape for t in inputs]
        worker.check_inputs(shapes)
        out_shapes = [tuple(s) for s in worker.output_shapes(shapes)]
        declared = self._registry.setdefault(_checks.NETWORK_BYTES, [0])  # shared by the network's layers
        declared[0] -= self._declared_bytes
        self._declared_bytes = _checks.allocation(
            worker.where, {"weights": [] if self.weights else worker.weight_shapes(shapes),
                           "outputs": [] if in_place else out_shapes, "work arrays": worker.work_shapes(shapes)},
            np.dtype(self.backend.dtype).itemsize,
            f"reduce the sizes in its config ({self.config.config!r}) or the input's", network=declared)
        declared[0] += self._declared_bytes
        self._create_weights(shapes)
        self.inputs = list(inputs)
        self.input_grads = list(input_grads)
        dtype = self.backend.dtype if worker.master_precision_outputs else self.backend.compute_dtype
        if in_place:
            self.outputs = [inputs[0].alias(out_shapes[0])]
            g = input_grads[0]
            self.output_grads = [g.alias(out_shapes[0]) if g is not None else SharedTensor(out_shapes[0], dtype)]
        else:
            if self.in_place or len(self.outputs) != len(out_shapes) or self.outputs[0].dtype != dtype:
                self.outputs = [SharedTensor(s, dtype) for s in out_shapes]
                self.output_grads = [SharedTensor(s, dtype) for s in out_shapes]
            else:
                for t, g, s in zip(self.outputs, self.output_grads, out_shapes):
                    t.resize(s)
                    g.resize(s)
        self.in_place = in_place
        worker.running_in_place = in_place
        worker.setup(self.backend, shapes)

    # --- compute --------------------------------------------------------------------------------------------
    def _only_a_view(self) -> bool:
        """An in-place layer whose output is its input seen with another shape (Reshape, Flatten): it runs nothing,
        and reads or writes nothing (on a channels-last backend each access would convert the storage)."""
        return self.in_place and self.worker is not None and not self.worker.modifies_data

    def run_forward(self) -> None:
        """Compute the outputs from the bound inputs (its container or its Network calls it; users call
        ``forward``)."""
        be = self.backend
        worker = self.worker
        self.validate()
        if self._only_a_view():
            self.ran_forward = True
            return
        x = [t.read(be) for t in self.inputs]
        written = worker.updated_in_forward()  # type: ignore[union-attr]
        w = [t.read_write(be) if i in written else t.read(be) for i, t in enumerate(self.weights)]
        for i, c in enumerate(self.weight_copies):
            if c is not None and i not in written:  # the low-precision copy, fresh from the master weight
                # a recorded step's replays cast too, unless the step's update writes the copy
                self.refresh_copy(i, always=recording() and i not in self.updated_copies)
                w[i] = c.read(be)
        y = [t.write(be) for t in self.outputs]
        worker.forward(be, x, w, y)  # type: ignore[union-attr]
        self.ran_forward = True

    def refresh_copy(self, i: int, always: bool = False) -> None:
        """Cast weight ``i`` into its low-precision copy where the weight changed since the copy was made (or
        ``always``). A solver whose update writes the copy (:attr:`updated_copies`) calls this before each step, so
        that a weight set between steps (loaded, restored) reaches the copy before a replayed step reads it."""
        weight, copy = self.weights[i], self.weight_copies[i]
        assert copy is not None
        version = weight.version
        if always or version != self._copied_versions[i]:
            self.backend.cast(weight.read(self.backend), copy.write(self.backend))
            self._copied_versions[i] = version

    def copy_updated(self, i: int) -> None:
        """Record that weight ``i``'s copy was written with the weight by an update (it is current)."""
        self._copied_versions[i] = self.weights[i].version

    def weight_copy_slots(self) -> list[tuple[Layer, int]]:
        """(layer, index) of every weight copy (bf16/fp16 compute copies of the master weights), in network order,
        this layer's and, for containers, every layer's inside (a weight shared by name has one per layer)."""
        return [(self, i) for i, c in enumerate(self.weight_copies) if c is not None]

    def run_backward(self) -> None:
        """Compute the weight gradients and the input gradients that are needed from the output gradients."""
        be = self.backend
        worker = self.worker
        assert worker is not None
        want_dx = any(g is not None for g in self.input_grads)
        parameters = self.computes_weight_gradients
        if (not parameters and not want_dx) or self._only_a_view():
            return
        x = [t.read(be) for t in self.inputs]
        # a worker that does not declare that its backward reads y gets None: a layer after it may have
        # overwritten y in place (and on a channels-last backend reading it could cost a relayout)
        y = [t.read(be) for t in self.outputs] if worker.backward_reads_output else [None] * len(self.outputs)
        dy = [t.read(be) for t in self.output_grads]
        if parameters:
            dw = [g.read_write(be) if b else g.write(be) for g, b in zip(self.weight_grads, self.weight_beta)]
            worker.backward_parameters(be, x, y, dy, dw, list(self.weight_beta))
        if want_dx:
            w = [t.read(be) if c is None else c.read(be) for t, c in
                 zip(self.weights, self.weight_copies or [None] * len(self.weights))]
            dx = [g.write(be) if g is not None else None for g in self.input_grads]
            worker.backward_input(be, x, y, dy, w, dx)

    # --- as the outermost layer of a network -------------------------------------------------------------
    @property
    def network(self) -> Network[Layer]:
        """The :class:`~leafpy.layers.network.Network` that runs this layer as the outermost one: it owns the
        tensors this layer reads and stages them (created when first asked for; a Sequential built as the
        outermost layer creates it at once, for its declared inputs)."""
        net = self.__dict__.get("_network")
        if net is None:
            outer = self.__dict__.get("container")
            if outer is not None:  # a network of its own would bind it to tensors of its own, off its container's
                raise LeafpyError(
                    f"layer '{self.name}' is part of layer '{outer}', which feeds it: run it through the network's "
                    f"outermost layer (its forward and backward, or solver.network); for this layer alone, build a "
                    "copy: lp.Layer.from_config(backend, layer.config), then load_weights(layer.named_weights())")
            net = self._network = Network(self)
        return net

    @property
    def runner(self) -> Network[Layer]:
        """Deprecated name of :attr:`network`."""
        warnings.warn("Layer.runner is deprecated: use Layer.network (the same Network)", DeprecationWarning,
                      stacklevel=2)
        return self.network

    def declared_input_shapes(self) -> list[Shape]:
        """The input shapes this layer declares (a Sequential's ``inputs``; none for a single layer, which takes
        the shapes it is given)."""
        return []

    def default_input_gradients(self, n: int) -> list[bool]:
        """Which of ``n`` inputs get a gradient when this layer is the outermost: the differentiable ones."""
        return [True] * n

    def writes_input_gradient(self, k: int) -> bool:
        """Whether this layer's backward pass, when it runs, writes the gradient of input ``k`` it was given (a
        container: where one of its layers that runs reaches that input)."""
        return True

    def input_takes_gradient(self, k: int) -> bool:
        """Whether input ``k`` can take a gradient (an Embedding's ids cannot)."""
        diff = self.worker.differentiable if self.worker is not None else None
        return True if diff is None or k >= len(diff) else diff[k]

    def accept_input(self, i: int, x: Any) -> Any:
        """Input ``i`` (an array or SharedTensor) as this layer takes it; a ShapeError where it cannot fit: a
        layer run alone takes a batch of at least one sample, each with values (a container checks its declared
        shapes, which its layers' inputs then follow)."""
        shape = tuple(x.shape) if isinstance(x, SharedTensor) else tuple(np.shape(x))
        if not shape or 0 in shape:
            where = self.worker.where if self.worker is not None else f"layer '{self.name}'"
            what = "a scalar, with no batch axis" if not shape else "no values"
            raise ShapeError(f"{where}: input {i} has shape {shape}: {what}; give a batch of at least one sample "
                             "([N, ...], every axis at least 1)")
        return x

    def input_names_for_errors(self) -> str:
        """The inputs' names for an error message (" (data, label)"), or nothing."""
        return ""

    def unique_weight_entries(self) -> tuple[list[SharedTensor], list[SharedTensor], list[str], list[WeightConfig]]:
        """The learnable weights, their gradients, names and configs, each weight once, in network order."""
        return _unique(self._weight_entries())

    def forward(self, inputs: Sequence[Any]) -> list[SharedTensor]:
        """Run forward on a list of inputs (numpy arrays or SharedTensors); returns the output tensors.

        The outputs are the layer's own buffers, valid until its next call (``forward``, ``backward``, a solver's
        step): copy them (``.to_numpy()``) to keep them. A network serves one thread at a time: a call from a
        second thread while another is inside (forward, backward, a solver's ``train_minibatch``, ``save``,
        ``load_weights``, ``set_training``) raises a LeafpyError; give each thread its own network
        (``Layer.load``, ``Layer.from_config``) or serialise the calls."""
        return self.network.forward(inputs)

    def backward(self, output_grads: Sequence[Any]) -> list[SharedTensor | None]:
        """Backpropagate gradients of the outputs; returns gradients of the inputs (None where not computed).
        Weight gradients land in :meth:`learnable_weights_gradients`. As with :meth:`forward`, the returned
        tensors are the layer's buffers, valid until its next call, and a second thread is refused."""
        return self.network.backward(output_grads)

    def __repr__(self) -> str:
        return f"<Layer {self.name!r} ({self.config.type}) on {self.backend.name}>"


def _unique(entries: list[tuple[SharedTensor, SharedTensor, str, WeightConfig]]
            ) -> tuple[list[SharedTensor], list[SharedTensor], list[str], list[WeightConfig]]:
    seen: set[int] = set()
    out: tuple[list, list, list, list] = ([], [], [], [])
    for d, g, n, c in entries:
        if id(d) in seen:
            continue
        seen.add(id(d))
        for lst, v in zip(out, (d, g, n, c)):
            lst.append(v)
    return out
