"""Network: a layer (usually a whole Sequential) made runnable.

A :class:`~leafpy.layers.layer.Layer` is what a network holds: a config, a worker, the tensors it writes; its
container connects it to the tensors it reads. The outermost layer has no container, so a :class:`Network` does that
part: it owns the tensors the layer reads from outside (and their gradients), feeds arrays into them, connects an
input to a tensor another network writes (the objective reading the model's output, with no copy), rebinds the
layer when a shape changes, and gathers the parameter set once per binding. ``layer.runner`` is the layer's network;
``Layer.forward`` and ``Layer.backward`` go through it.

    net = lp.Layer.from_config(be, cfg).runner
    net.feed([x])            # arrays or SharedTensors, one per input: copied in (rebinding on a new batch size)
    net.run_forward(); net.outputs[0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .._checks import layout_hint, same_layout
from ..errors import ShapeError
from ..tensor import SharedTensor, as_numbers

if TYPE_CHECKING:
    from .layer import Layer
    from .layer_config import WeightConfig


class Parameters(NamedTuple):
    """A network's learnable weights, in network order, each once (shared weights are listed where first met)."""

    data: list[SharedTensor]
    gradients: list[SharedTensor]
    names: list[str]
    configs: list[WeightConfig]


def _is_tensor(x: Any) -> bool:
    return isinstance(x, SharedTensor)


class Network:
    """The outermost layer of a network and the tensors it reads: see the module docstring."""

    def __init__(self, layer: Layer) -> None:
        self.layer = layer
        self.backend = layer.backend
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
            self._own = [SharedTensor(s, layer.input_dtype(k)) for k, s in enumerate(shapes)]
            self._bind([t for t in self._own if t is not None])

    @property
    def name(self) -> str:
        """The outermost layer's name."""
        return self.layer.name

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

    def feed(self, inputs: Sequence[Any]) -> bool:
        """Copy the inputs (arrays or SharedTensors, one per input; None for a connected one) into this network's
        input tensors and upload them, rebinding the layer when a shape or a connection changed (then True)."""
        if not isinstance(inputs, (list, tuple)):
            raise ShapeError(f"layer '{self.name}': forward takes a list of inputs (one per input, e.g. [x]), got "
                             f"{type(inputs).__name__}")
        declared = self._declared
        n = self.num_inputs if declared else len(inputs)  # a single layer's worker checks the count when bound
        if len(inputs) != n:
            shapes = ", ".join(str(x.shape if _is_tensor(x) else np.shape(x)) for x in inputs)
            names = self.layer.input_names_for_errors()
            raise ShapeError(f"layer '{self.name}' ({self.layer.config.type}): expected {n} input{'s' * (n != 1)}"
                             f"{names}, got {len(inputs)} (shapes {shapes or 'none'})")
        layer, be = self.layer, self.backend
        if len(self._own) != n:
            self._own = [None] * n
        tensors: list[SharedTensor] = []
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
                own = self._own[i] = SharedTensor(shape, layer.input_dtype(i))
            elif own.shape != shape:
                own.resize(shape)
            if _is_tensor(x):
                be.cast(x.read(be), own.write(be))
            else:
                own.set(x)
            tensors.append(own)
        if declared:
            batch = {t.shape[0] for t in tensors}
            if len(batch) > 1:
                raise ShapeError(f"{self._where}: inputs have different batch sizes {[t.shape for t in tensors]}")
        if self._bound != [(id(t), t.shape) for t in tensors]:
            self._bind(tensors)
            rebound = True
        else:
            rebound = False
        for t in tensors:  # uploads happen here, before any step (a recorded step cannot upload)
            t.read(be)
        return rebound

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
        """Feed the inputs and run forward; returns the output tensors."""
        self.feed(inputs)
        self.run_forward()
        return list(self.outputs)

    def backward(self, output_grads: Sequence[Any]) -> list[SharedTensor | None]:
        """Backpropagate gradients of the outputs (arrays or SharedTensors); returns the inputs' gradients (None
        where not computed). Weight gradients land in :meth:`parameters`' gradients."""
        layer, be = self.layer, self.backend
        if not isinstance(output_grads, (list, tuple)):
            raise ShapeError(f"{self._where}: backward takes a list of output gradients (one per output, e.g. [dy]), "
                             f"got {type(output_grads).__name__}")
        if not layer.ran_forward:
            raise ShapeError(f"{self._where}: call forward before backward (backward differentiates the last "
                             "forward's inputs)")
        targets = layer.output_grads
        if len(output_grads) != len(targets):
            raise ShapeError(f"{self._where}: backward expected {len(targets)} output gradients, got "
                             f"{len(output_grads)}")
        for i, (g, t) in enumerate(zip(output_grads, targets)):
            shape = tuple(g.shape if _is_tensor(g) else np.shape(g))
            if shape != t.shape and not (math.prod(shape) == t.size and same_layout(shape, t.shape)):
                raise ShapeError(f"{self._where}: output gradient {i} must have shape {t.shape}, "
                                 f"got {shape}{layout_hint(shape, t.shape, 'g')}")
            if _is_tensor(g):
                be.cast(g.read(be), t.write(be))
            else:
                t.set(np.reshape(g, t.shape))
        self.run_backward()
        return list(self.input_grads)

    def parameters(self) -> Parameters:
        """The learnable weights, their gradients, names and configs, gathered once per binding."""
        if self._params is None:
            self._params = Parameters(*self.layer.unique_weight_entries())
        return self._params

    @property
    def _where(self) -> str:
        return f"layer '{self.layer.name}'"

    @property
    def _where_inputs(self) -> str:
        """A network's declared inputs are named with its type (the container's), a single layer's by name."""
        return f"layer '{self.layer.name}' ({self.layer.config.type})" if self._declared else self._where

    def __repr__(self) -> str:
        return f"<Network {self.layer.name!r} on {self.backend.name}>"
