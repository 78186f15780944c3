"""Network: the one object that runs a network, and the only one a Solver or Trainer talks to.

Three roles, one owner each:

- a :class:`~leafpy.layers.layer.Layer` computes: a config, a worker, the tensors it writes; its container connects it
  to the tensors it reads;
- a container (:class:`~leafpy.layers.container.sequential.Sequential`) holds layers and wires them, and is itself
  a layer, so containers nest;
- a :class:`Network` runs the outermost layer (usually a Sequential), which has no container: it owns the tensors
  that layer reads from outside (and their gradients), stages arrays into them, connects an input to a tensor
  another network writes (the objective reading the model's output, with no copy), rebinds the layer when a shape
  changes, runs forward and backward, and gathers the parameter set once per binding. It is what ``network``
  means everywhere in leafpy: ``layer.network``, ``solver.network`` and ``solver.objective`` are Networks.

    net = lp.Layer.from_config(be, cfg).network
    net.feed([x])            # arrays or SharedTensors, one per input: copied in (rebinding on a new batch size)
    net.run_forward(); net.outputs[0]
    net.parameters()         # weights, gradients, names, configs (what an update reads)

This module knows the layer it runs only through :class:`Outermost`, the part of a layer's interface a Network
calls; ``layer.py`` builds a layer's Network, so the arrow between the two modules runs one way.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar

import numpy as np

from .._checks import layout_hint, same_layout
from .._exclusive import OneCaller
from ..backends.base import Backend
from ..errors import ShapeError
from ..layer_config import WeightConfig
from ..tensor import SharedTensor, as_numbers

Shape = tuple[int, ...]


class Parameters(NamedTuple):
    """A network's learnable weights, in network order, each once (shared weights are listed where first met)."""

    data: list[SharedTensor]
    gradients: list[SharedTensor]
    names: list[str]
    configs: list[WeightConfig]


class Outermost(Protocol):
    """What a :class:`Network` asks of the layer it runs (a Layer or a container has all of it)."""

    name: str
    backend: Backend
    config: Any
    training: bool
    preparation: Any
    ran_forward: bool

    @property
    def num_inputs(self) -> int: ...
    @property
    def outputs(self) -> list[SharedTensor]: ...
    @property
    def output_grads(self) -> list[SharedTensor]: ...
    def declared_input_shapes(self) -> list[Shape]: ...
    def input_dtype(self, k: int) -> np.dtype: ...
    def accept_input(self, i: int, x: Any) -> Any: ...
    def input_names_for_errors(self) -> str: ...
    def default_input_gradients(self, n: int) -> list[bool]: ...
    def input_takes_gradient(self, k: int) -> bool: ...
    def bind(self, inputs: list[SharedTensor], input_grads: list[SharedTensor | None]) -> None: ...
    def run_forward(self) -> None: ...
    def run_backward(self) -> None: ...
    def validate(self, fed: Sequence[SharedTensor] | None = None) -> None: ...
    def unique_weight_entries(self) -> tuple[list[SharedTensor], list[SharedTensor], list[str],
                                             list[WeightConfig]]: ...
    def workers(self) -> list[Any]: ...
    def set_training(self, training: bool = True) -> None: ...
    @property
    def exclusive(self) -> OneCaller: ...
    def named_weights(self) -> dict[str, np.ndarray]: ...
    def load_weights(self, weights: Mapping[str, Any], *, strict: bool = True) -> Any: ...
    def save(self, path: str, format: str = "leafpy", *, allow_non_finite: bool = False) -> None: ...


L = TypeVar("L", bound=Outermost)


def outermost(given: L | Network[L]) -> L:
    """The layer ``given`` runs where it is a Network (``solver.network``), else ``given`` itself: what a function
    written for a Layer (``lp.onnx.export``, ``lp.web.export``) reads."""
    return given.layer if isinstance(given, Network) else given


def _shape_text(x: Any) -> str:
    """An input's shape for a message: ragged nested lists have none (NumPy refuses to make an array of them)."""
    if _is_tensor(x):
        return str(tuple(x.shape))
    try:
        return str(np.shape(x))
    except (ValueError, TypeError):
        return f"a ragged {type(x).__name__}"


def _is_tensor(x: Any) -> bool:
    return isinstance(x, SharedTensor)


class Network(Generic[L]):
    """The outermost layer of a network and the tensors it reads: see the module docstring."""

    __slots__ = ("layer", "backend", "exclusive", "inputs", "input_grads", "generation", "_own", "_own_grads",
                 "_connected", "_wants_grad", "_bound", "_params", "_declared")

    def __init__(self, layer: L) -> None:
        self.layer: L = layer
        """The outermost layer this network runs (usually a Sequential)."""
        self.backend = layer.backend
        self.exclusive = layer.exclusive
        """``with network.exclusive("train_minibatch"):`` one thread at a time in this network (a second thread gets
        a LeafpyError naming both calls; the thread inside may enter again): its layer's guard."""
        self.inputs: list[SharedTensor] = []
        """The tensors the layer reads: this network's own, or those given to :meth:`connect`."""
        self.input_grads: list[SharedTensor | None] = []
        """Where the layer writes the gradients of its inputs (None where none is computed)."""
        self.generation = 0
        """Counts bindings: what was built for one binding (a recorded step, a parameter list) is stale after it."""
        self._own: list[SharedTensor | None] = []
        self._own_grads: list[SharedTensor | None] = []
        self._connected: dict[int, tuple[SharedTensor, SharedTensor | None]] = {}
        self._wants_grad: list[bool] | None = None
        self._bound: list[tuple[int, tuple[int, ...]]] | None = None
        self._params: Parameters | None = None
        shapes = layer.declared_input_shapes()
        self._declared = bool(shapes)
        """Whether the layer declares its inputs (a Sequential): their count and batch sizes are checked here."""
        if shapes:  # a network with declared inputs is built (weights created) for them now
            self._own = [self._input_tensor(s, layer.input_dtype(k)) for k, s in enumerate(shapes)]
            self._bind([t for t in self._own if t is not None])

    @property
    def name(self) -> str:
        """The outermost layer's name."""
        return self.layer.name

    @property
    def config(self) -> Any:
        """The outermost layer's LayerConfig (what ``SolverConfig.network`` and a run file's ``network`` give)."""
        return self.layer.config

    @property
    def outputs(self) -> list[SharedTensor]:
        """The layer's output tensors (written by ``run_forward``)."""
        return self.layer.outputs

    @property
    def output_grads(self) -> list[SharedTensor]:
        """The gradients of the outputs (read by ``run_backward``; another network may write them, see ``connect``)."""
        return self.layer.output_grads

    @property
    def num_inputs(self) -> int:
        """How many inputs the layer reads."""
        return self.layer.num_inputs

    @property
    def training(self) -> bool:
        """Training mode (dropout active, BatchNorm on the batch's statistics) or inference mode."""
        return self.layer.training

    @property
    def preparation(self) -> Any:
        """How the model reads data, as training recorded it in the model file (see ``Layer.preparation``)."""
        return self.layer.preparation

    @preparation.setter
    def preparation(self, value: Any) -> None:
        self.layer.preparation = value

    # --- inputs ---------------------------------------------------------------------------------------------
    def connect(self, index: int, tensor: SharedTensor, grad: SharedTensor | None = None) -> None:
        """Let input ``index`` read ``tensor`` itself (no copy) and write its gradient into ``grad`` (None: no
        gradient). Takes effect at the next :meth:`feed`, which then passes None for that input."""
        if not 0 <= index < self.num_inputs:
            raise ShapeError(f"{self._where}: connect: input {index} does not exist (the layer has "
                             f"{self.num_inputs} input{'s' * (self.num_inputs != 1)})")
        self._connected[index] = (tensor, grad)

    def require_input_gradients(self, flags: Sequence[bool]) -> None:
        """Which inputs get a gradient (default: a Sequential's ``force_backward``; a single layer's differentiable
        inputs)."""
        if len(flags) != self.num_inputs:
            raise ShapeError(f"{self._where}: expected {self.num_inputs} flags, got {len(flags)}")
        self._wants_grad = [bool(f) for f in flags]
        if self._bound is not None:
            self._bind(self.inputs)

    def input_dtype(self, k: int) -> np.dtype:
        """The dtype input ``k`` is staged in (the compute dtype for data, the master dtype for ids and labels)."""
        return self.layer.input_dtype(k)

    def validate(self, fed: Sequence[SharedTensor] | None = None) -> None:
        """Check the staged input values that the layers can check cheaply on the host (labels and ids in range);
        ``fed``: only where a layer reads these tensors (see :meth:`Layer.validate`)."""
        self.layer.validate(fed)

    def feed(self, inputs: Sequence[Any]) -> bool:
        """Copy the inputs (arrays or SharedTensors, one per input; None for a connected one) into this network's
        input tensors and upload them, rebinding the layer when a shape or a connection changed (then True)."""
        if not isinstance(inputs, (list, tuple)):
            raise ShapeError(f"layer '{self.name}': forward takes a list of inputs (one per input, e.g. [x]), got "
                             f"{type(inputs).__name__}")
        declared = self._declared
        n = self.num_inputs if declared else len(inputs)  # a single layer's worker checks the count when bound
        if len(inputs) != n:
            shapes = ", ".join(_shape_text(x) for x in inputs)
            names = self.layer.input_names_for_errors()
            raise ShapeError(f"layer '{self.name}' ({self.layer.config.type}): expected {n} input{'s' * (n != 1)}"
                             f"{names}, got {len(inputs)} (shapes {shapes or 'none'})")
        if len(self._own) != n:
            self._own = [None] * n
        be = self.backend
        tensors: list[SharedTensor] = []
        resized: list[tuple[SharedTensor, tuple[int, ...]]] = []  # (own input, its shape before this call)
        try:
            self._stage_inputs(inputs, tensors, resized)
            if self._bound != [(id(t), t.shape) for t in tensors]:
                self._bind(tensors)
                rebound = True
            else:
                rebound = False
        except BaseException:  # a refused batch leaves the network as it was: its inputs' shapes and binding
            self._restore(resized)
            raise
        for t in tensors:  # uploads happen here, before any step (a recorded step cannot upload)
            t.read(be)
        return rebound

    def _restore(self, resized: list[tuple[SharedTensor, tuple[int, ...]]]) -> None:
        for own, shape in resized:
            own.resize(shape)
        if not resized or self._bound is None:
            return
        try:  # (the layers may have been bound part way to the refused shapes)
            self._bind(list(self.inputs))
        except Exception:  # noqa: BLE001 - bound again at the next call
            self._bound = None

    def _stage_inputs(self, inputs: Sequence[Any], tensors: list[SharedTensor],
                      resized: list[tuple[SharedTensor, tuple[int, ...]]]) -> None:
        layer, be = self.layer, self.backend
        for i, x in enumerate(inputs):
            if i in self._connected:
                tensors.append(self._connected[i][0])
                continue
            if not _is_tensor(x):
                x = as_numbers(x, f"{self._where_inputs}: input {i}")
            x = layer.accept_input(i, x)
            shape = tuple(x.shape) if _is_tensor(x) else tuple(np.shape(x))
            own = self._own[i]
            if own is None:  # data in the compute dtype; ids and labels in the master dtype
                own = self._own[i] = self._input_tensor(shape, layer.input_dtype(i))
            elif own.shape != shape:
                resized.append((own, own.shape))
                own.resize(shape)
            if _is_tensor(x):
                be.cast(x.read(be), own.write(be))
            else:
                own.set(x)
            tensors.append(own)
        if self._declared:
            batch = {t.shape[0] for t in tensors}
            if len(batch) > 1:
                raise ShapeError(f"{self._where}: inputs have different batch sizes {[t.shape for t in tensors]}")

    @staticmethod
    def _input_tensor(shape: Sequence[int], dtype: Any) -> SharedTensor:
        """One of this network's own input tensors: a new batch every step (SharedTensor.streamed)."""
        t = SharedTensor(shape, dtype)
        t.streamed = True
        return t

    def _bind(self, tensors: list[SharedTensor]) -> None:
        layer = self.layer
        wants = self._wants_grad if self._wants_grad is not None else layer.default_input_gradients(len(tensors))
        if len(self._own_grads) != len(tensors):
            self._own_grads = [None] * len(tensors)
        grads: list[SharedTensor | None] = []
        for k, t in enumerate(tensors):
            if k in self._connected:
                grads.append(self._connected[k][1])
                continue
            own = self._own_grads[k]
            if not (wants[k] and layer.input_takes_gradient(k)):
                own = None
            elif own is None:
                own = SharedTensor(t.shape, self.backend.compute_dtype)
            elif own.shape != t.shape:
                own.resize(t.shape)
            self._own_grads[k] = own
            grads.append(own)
        layer.bind(list(tensors), grads)
        self.inputs = list(tensors)
        self.input_grads = grads
        self._bound = [(id(t), t.shape) for t in tensors]
        self.generation += 1
        self._params = None

    # --- running --------------------------------------------------------------------------------------------
    def run_forward(self) -> None:
        """The forward pass over the tensors already fed or connected (``forward`` feeds arrays, then runs it)."""
        self.layer.run_forward()

    def run_backward(self) -> None:
        """The backward pass from ``output_grads`` (weight gradients, and input gradients where needed)."""
        self.layer.run_backward()

    def forward(self, inputs: Sequence[Any]) -> list[SharedTensor]:
        """Feed the inputs and run forward; returns the output tensors (the network's own buffers, valid until its
        next call; one thread at a time, as ``Layer.forward``)."""
        with self.exclusive("forward"):
            self.feed(inputs)
            self.run_forward()
            return list(self.outputs)

    def backward(self, output_grads: Sequence[Any]) -> list[SharedTensor | None]:
        """Backpropagate gradients of the outputs (arrays or SharedTensors); returns the inputs' gradients (None
        where not computed). Weight gradients land in :meth:`parameters`' gradients."""
        with self.exclusive("backward"):
            self._set_output_grads(output_grads)
            self.run_backward()
            return list(self.input_grads)

    def _set_output_grads(self, output_grads: Sequence[Any]) -> None:
        be = self.backend
        if not isinstance(output_grads, (list, tuple)):
            raise ShapeError(f"{self._where}: backward takes a list of output gradients (one per output, e.g. [dy]), "
                             f"got {type(output_grads).__name__}")
        if not self.layer.ran_forward:
            raise ShapeError(f"{self._where}: call forward before backward (backward differentiates the last "
                             "forward's inputs)")
        targets = self.output_grads
        if len(output_grads) != len(targets):
            raise ShapeError(f"{self._where}: backward expected {len(targets)} output gradients, got "
                             f"{len(output_grads)}")
        for i, (g, t) in enumerate(zip(output_grads, targets)):
            if not _is_tensor(g):  # (what forward takes: a torch tensor, a list, a big-endian array...)
                g = as_numbers(g, f"{self._where}: output gradient {i}")
            shape = tuple(g.shape)
            if shape != t.shape and not (math.prod(shape) == t.size and same_layout(shape, t.shape)):
                raise ShapeError(f"{self._where}: output gradient {i} must have shape {t.shape}, "
                                 f"got {shape}{layout_hint(shape, t.shape, 'g')}")
            if _is_tensor(g):
                be.cast(g.read(be), t.write(be))
            else:
                t.set(np.reshape(g, t.shape))

    def set_training(self, training: bool = True) -> None:
        """Training mode (dropout active, BatchNorm on the batch's statistics) or inference mode, for every layer."""
        self.layer.set_training(training)

    def workers(self) -> list[Any]:
        """The workers of every layer, in network order."""
        return self.layer.workers()

    # --- parameters -----------------------------------------------------------------------------------------
    def parameters(self) -> Parameters:
        """The learnable weights, their gradients, names and configs, gathered once per binding."""
        if self._params is None:
            self._params = Parameters(*self.layer.unique_weight_entries())
        return self._params

    def learnable_weights_data(self) -> list[SharedTensor]:
        """The weights, in network order, a weight shared by name once (as ``Layer.learnable_weights_data``)."""
        return list(self.parameters().data)

    def learnable_weights_gradients(self) -> list[SharedTensor]:
        """The weights' gradients, in the order of :meth:`learnable_weights_data`."""
        return list(self.parameters().gradients)

    def learnable_weights_names(self) -> list[str]:
        """The weights' names, e.g. ``["conv1/weight", "conv1/bias", ...]``."""
        return list(self.parameters().names)

    def learnable_weights_configs(self) -> list[WeightConfig]:
        """Each weight's WeightConfig (lr_mult, decay_mult, filler), in the order of :meth:`learnable_weights_data`."""
        return list(self.parameters().configs)

    def num_parameters(self) -> int:
        """The number of weight values (a shared weight counted once)."""
        return sum(w.size for w in self.parameters().data)

    def named_weights(self) -> dict[str, np.ndarray]:
        """Every weight as a host copy, by name, in network order (``Layer.named_weights``)."""
        return self.layer.named_weights()

    def load_weights(self, weights: Mapping[str, Any], *, strict: bool = True) -> Any:
        """Set weights by name (``Layer.load_weights``; returns what was left alone)."""
        return self.layer.load_weights(weights, strict=strict)

    def save(self, path: str, format: str = "leafpy", *, allow_non_finite: bool = False) -> None:
        """Write the outermost layer's config and weights to ``path`` (``Layer.save``; ``Layer.load`` reads it)."""
        self.layer.save(path, format, allow_non_finite=allow_non_finite)

    @property
    def _where(self) -> str:
        return f"layer '{self.layer.name}'"

    @property
    def _where_inputs(self) -> str:
        """A network's declared inputs are named with its type (the container's), a single layer's by name."""
        return f"layer '{self.layer.name}' ({self.layer.config.type})" if self._declared else self._where

    if not TYPE_CHECKING:  # (type checkers see only the Network's own names)
        def __getattr__(self, name: str) -> Any:
            """The outermost layer's other attributes, for code written when ``solver.network`` was the layer:
            deprecated (a DeprecationWarning naming ``network.layer``)."""
            if name.startswith("__") or name in Network.__slots__:
                raise AttributeError(name)
            value = getattr(self.layer, name)
            warnings.warn(f"Network.{name}: a network ({self.name!r}, e.g. solver.network) is a Network now, which "
                          f"runs its outermost layer; use network.layer.{name}", DeprecationWarning, stacklevel=2)
            return value

        def __setattr__(self, name: str, value: Any) -> None:
            """A Network's own attributes only; the layer's (``backward_hook``, ...) are set on ``network.layer``."""
            if name in Network.__slots__ or isinstance(getattr(Network, name, None), property):
                object.__setattr__(self, name, value)
                return
            raise AttributeError(f"Network.{name}: a network ({self.name!r}, e.g. solver.network) is a Network now, "
                                 f"which runs its outermost layer; set network.layer.{name}")

    def __repr__(self) -> str:
        return f"<Network {self.layer.name!r} on {self.backend.name}>"
