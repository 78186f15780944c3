"""Sequential: a container layer that runs its layers in order, and nests.

Wiring follows Leaf. The first layer reads the container's declared inputs; each later layer reads the previous
layer's outputs, then any declared inputs not read yet, up to its arity (so an objective ``[LogSoftmax, NLL]`` over
inputs ``(network_out, label)`` wires itself). A layer may name its ``inputs``/``outputs`` instead (Caffe's
bottom/top), so branches and skip connections are written by name; a blob read by several layers receives the sum
of their gradients. Unnamed intermediate blobs are ``SEQUENTIAL_{i}``, the last layer's ``SEQUENTIAL_OUTPUT_{i}``.

In place: a layer that can run in place (ReLU, Sigmoid, TanH, Reshape, Flatten, Dropout) writes into its input's
storage when that input comes from an earlier layer, nothing else reads it, and overwriting it cannot spoil the
earlier layer's backward pass (a layer whose backward reads its own output keeps it).

Backward pruning: a blob needs a gradient if it comes from a layer with weights that train (``lr_mult`` not 0) or
from a blob that needs one; the container's inputs need one only with ``force_backward`` (or when an enclosing
container asks). ``propagate_down: [false]`` stops the gradient into that input. A layer runs backward only if it
trains a weight or has an input that needs a gradient, and some gradient reaches its outputs; a layer whose weights
are all frozen computes no weight gradient (they stay zero), so a frozen backbone before a trained head runs no
backward pass at all, as in Caffe.

Gradient memory: a blob's gradient lives from its consumer's backward pass to its producer's, so layers whose
gradients never live at the same time share one storage (a chain needs two). After a backward pass, only the
container's input and output gradients and the weight gradients keep their values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import _checks
from ...backends.base import Backend
from ...errors import ConfigError, LeafpyError, ShapeError
from ...tensor import SharedTensor
from ..layer import Layer, LayerConfig, layout_hint, register_layer, same_layout, weight_name_part
from .wiring import Step, Traits, plan_gradients, traits_of, wire


@_checks.strict_init
@dataclass(eq=True)
class SequentialConfig:
    """Layers in order, the container's named inputs with their shapes (the first dimension is the batch and
    may vary), and force_backward (compute gradients for the inputs too)."""

    layers: list[LayerConfig] = field(default_factory=list)
    inputs: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    force_backward: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.inputs, (dict, str)):
            raise ConfigError(f"SequentialConfig.inputs: expected a list of (name, shape) pairs such as "
                              f"[('data', [64, 1, 28, 28])], got {self.inputs!r}"[:300])
        inputs = list(self.inputs)
        self.inputs = []
        for item in inputs:
            if isinstance(item, dict):
                name, shape = item.get("name"), item.get("shape")
            elif isinstance(item, (tuple, list)) and len(item) == 2:
                name, shape = item
            else:
                raise ConfigError(f"SequentialConfig.inputs: expected a (name, shape) pair such as "
                                  f"('data', [64, 1, 28, 28]), got {item!r}"[:300])
            self.add_input(name, shape)
        layers = list(self.layers)
        self.layers = []
        self._names: set[str] = set()  # the layers' names, for a constant-time duplicate check
        for layer in layers:
            self.add_layer(layer)
        if not isinstance(self.force_backward, bool):
            raise ConfigError(f"SequentialConfig.force_backward: expected true or false, got {self.force_backward!r}")

    def add_input(self, name: str, shape: Sequence[int | None]) -> None:
        """Declare a named input and its shape (the first dimension is the batch, which may vary; None declares a
        batch of one, which is what the batch of a network built before it is fed is)."""
        if isinstance(shape, (list, tuple)) and shape and shape[0] is None:
            shape = (1, *shape[1:])
        if not isinstance(name, str) or not name:
            raise ConfigError(f"SequentialConfig.inputs: expected a non-empty input name, got {name!r}")
        if any(n == name for n, _ in self.inputs):
            raise ConfigError(f"SequentialConfig.inputs: input {name!r} is declared twice")
        self.inputs.append((name, _checks.shape(f"SequentialConfig.inputs[{name!r}].shape", shape)))

    def add_layer(self, layer: LayerConfig) -> None:
        """Append a layer; it reads the previous layer's outputs unless its ``inputs`` name other blobs."""
        if not isinstance(layer, LayerConfig):
            raise ConfigError(f"SequentialConfig.add_layer: expected a LayerConfig, got {type(layer).__name__}")
        names = self.__dict__.get("_names")
        if names is None or len(names) != len(self.layers):  # the list was changed directly: index it again
            names = self._names = {existing.name for existing in self.layers}
        if layer.name in names:
            raise ConfigError(f"SequentialConfig.layers: two layers are named {layer.name!r}; names must be unique")
        self.layers.append(layer)
        names.add(layer.name)


def batch_free(config: LayerConfig) -> LayerConfig:
    """``config`` with the batch (first) entry of every declared input shape, its own and its nested Sequentials',
    set to 1: what one network's configs have in common whatever batch size each was declared or trained with
    (a run file's ``null`` batch follows data.batch_size)."""
    if not isinstance(config, LayerConfig) or not isinstance(config.config, SequentialConfig):
        return config
    seq = config.config
    free = SequentialConfig(layers=[batch_free(lc) for lc in seq.layers], force_backward=seq.force_backward,
                            inputs=[(n, (1, *s[1:])) for n, s in seq.inputs])
    return LayerConfig(config.name, free, inputs=config.inputs, outputs=config.outputs, params=config.params,
                       propagate_down=config.propagate_down)


@register_layer("Sequential", SequentialConfig)
class Sequential(Layer):
    """A container: layers run in order, wired by blob name; its outputs are its last layer's (set when it binds).
    The outermost one is run by its :class:`~leafpy.layers.network.Network`."""

    def __init__(self, backend: Backend, config: LayerConfig, *, seed: int | None = None,
                 weight_registry: dict | None = None) -> None:
        super().__init__(backend, config, seed=seed, weight_registry=weight_registry)
        cfg: SequentialConfig = config.config
        self.seq_config = cfg
        if not cfg.layers:
            raise ConfigError(f"layer '{self.name}' (Sequential): a Sequential needs at least one layer")
        if not cfg.inputs:
            raise ConfigError(f"layer '{self.name}' (Sequential): declare its inputs, e.g. "
                              "inputs=[('data', [64, 1, 28, 28])]")
        self.input_names = [n for n, _ in cfg.inputs]
        self.input_shapes = [tuple(s) for _, s in cfg.inputs]
        self.layers: list[Layer] = [
            Layer.from_config(backend, c, seed=int(self._rng.integers(2**63)), weight_registry=self._registry)
            for c in cfg.layers
        ]
        for layer in self.layers:
            layer.container = self.name  # (it runs as this container binds it, never as a network's outermost)
            _share_guard(layer, self.exclusive)
        self._plan = self._wire()
        self._grad_pool: list[SharedTensor] = []
        self._fan_scratch: dict[tuple[int, int], SharedTensor] = {}  # (layer, input) -> its own gradient
        self._fan_in: dict[int, list[tuple[SharedTensor, list[SharedTensor]]]] = {}
        self._zero_grads: dict[int, list[int]] = {}  # layer -> its outputs whose gradient no running reader writes
        self._idle_grads: list[SharedTensor] = []  # weight gradients no running layer writes (the outermost's)
        self._written_inputs: set[int] = set()  # (ids of) inputs whose gradient a running layer writes
        self._outermost = weight_registry is None
        if weight_registry is None:  # the outermost container: build everything for the declared shapes now
            self.network  # noqa: B018

    backward_hook: Callable[[int], None] | None = None
    """Called with a layer's index as soon as its backward pass has run (data-parallel training starts summing
    the gradients that are complete then, while the rest of the backward pass runs). A training step the backend
    replays (from a solver's third step on; ``backend.replay``) runs no layer's Python, so it calls no hook either:
    what a hook launches is part of the recording (set ``backend.replay = False`` for a hook that must run)."""

    # --- wiring ---------------------------------------------------------------------------------------------
    def _wire(self) -> list[Step]:
        self._traits = [Traits(layer.num_inputs, is_container=True) if layer.worker is None
                        else traits_of(layer.worker) for layer in self.layers]
        self.wiring = wire(self.seq_config, self._traits)
        return self.wiring.steps

    # --- properties -------------------------------------------------------------------------------------
    @property
    def has_weights(self) -> bool:
        return any(layer.has_weights for layer in self.layers)

    @property
    def trains_weights(self) -> bool:
        return any(layer.trains_weights for layer in self.layers)

    @property
    def num_inputs(self) -> int:
        return len(self.input_names)

    @property
    def backward_reads_output(self) -> bool:
        return True

    def workers(self):
        return [w for layer in self.layers for w in layer.workers()]

    def weight_copy_slots(self):
        return [slot for layer in self.layers for slot in layer.weight_copy_slots()]

    def validate(self, fed: Sequence[SharedTensor] | None = None) -> None:
        for layer in self.layers:
            layer.validate(fed)

    def checks_computed(self, fed: Sequence[SharedTensor]) -> bool:
        return any(layer.checks_computed(fed) for layer in self.layers)

    def _set_mode(self, training: bool) -> None:
        super()._set_mode(training)
        for layer in self.layers:
            layer._set_mode(training)

    def _weight_slots(self):
        slots = []
        for child in self.layers:  # its layers' weights, named as in _weight_entries
            for spec, cfg in child._weight_slots():
                if isinstance(child, Sequential) and cfg.name is None:
                    spec = spec._replace(name=f"{weight_name_part(child.name)}/{spec.name}")
                slots.append((spec, cfg))
        return slots

    def _weight_entries(self):
        entries = []
        for layer in self.layers:
            for d, g, n, c in layer._weight_entries():
                prefix = isinstance(layer, Sequential) and c.name is None
                entries.append((d, g, f"{weight_name_part(layer.name)}/{n}" if prefix else n, c))
        return entries

    def require_input_gradients(self, flags: Sequence[bool]) -> None:
        """Which declared inputs get a gradient when this container is the outermost (default: all if
        force_backward, none otherwise); see :meth:`Network.require_input_gradients`."""
        self.network.require_input_gradients(flags)

    def declared_input_shapes(self) -> list[tuple[int, ...]]:
        return list(self.input_shapes)

    def default_input_gradients(self, n: int) -> list[bool]:
        return [self.seq_config.force_backward] * n

    def input_names_for_errors(self) -> str:
        return f" ({', '.join(self.input_names)})"

    # --- binding ------------------------------------------------------------------------------------------
    def bind(self, inputs: list[SharedTensor], input_grads: list[SharedTensor | None], *,
             in_place: bool = False) -> None:
        if len(inputs) != len(self.input_names):
            shapes = ", ".join(str(t.shape) for t in inputs) or "none"
            raise ShapeError(f"layer '{self.name}' (Sequential): expected {len(self.input_names)} input(s) "
                             f"({', '.join(self.input_names)}), got {len(inputs)} (shapes {shapes})")
        self._check_declared([t.shape for t in inputs])
        self.inputs = list(inputs)
        self.input_grads = list(input_grads)
        blobs: dict[str, tuple[SharedTensor, SharedTensor | None, int]] = {
            n: (t, g, -1) for n, t, g in zip(self.input_names, inputs, input_grads)}
        receives: list[list[SharedTensor | None]] = []
        sources: list[list[tuple[int, int]]] = []  # each input's producer (-1: the container) and its output's tensor
        for i, (layer, plan) in enumerate(zip(self.layers, self._plan)):
            entries = [blobs[n] for n in plan.inputs]
            sources.append([(p, id(t)) for t, _, p in entries])
            pd = self.seq_config.layers[i].propagate_down
            grads = [g if (not pd or pd[j]) and g is not None and _differentiable(layer, j) else None
                     for j, (_, g, _) in enumerate(entries)]
            grads = [self._fan_out_grad(i, j, n, g) for j, (n, g) in enumerate(zip(plan.inputs, grads))]
            try:
                layer.bind([t for t, _, _ in entries], grads, in_place=plan.in_place)
            except ShapeError as e:
                raise ShapeError(self._explain(e, plan, blobs, layer)) from None
            needs = layer.trains_weights or any(g is not None for g in grads)
            for n, t, g in zip(plan.outputs, layer.outputs, layer.output_grads):
                blobs[n] = (t, g if needs else None, i)
            receives.append(grads)
        # a layer runs backward if a gradient reaches one of its outputs: the container's last layer, and a layer
        # whose output a layer that runs backward was given a gradient for (from the last layer back: a reader that
        # was given one but is cut off from the outputs, by propagate_down after it, writes nothing)
        final = len(self.layers) - 1
        writes: dict[int, set[int]] = {}  # producer -> its outputs (tensor ids) a running reader writes a gradient of
        self._zero_grads = {}
        for i in range(final, -1, -1):
            layer = self.layers[i]
            reached = i == final or bool(writes.get(i))
            layer.runs_backward = reached and (layer.trains_weights or any(g is not None for g in layer.input_grads))
            if layer.runs_backward:
                for j, ((producer, out), given) in enumerate(zip(sources[i], receives[i])):
                    if given is not None and layer.writes_input_gradient(j):
                        writes.setdefault(producer, set()).add(out)
                unwritten = [k for k, (t, g) in enumerate(zip(layer.outputs, layer.output_grads))
                             if g is not None and id(t) not in writes.get(i, ())]
                if unwritten and i != final:  # outputs no running reader writes the gradient of: zero, not old
                    self._zero_grads[i] = unwritten  # values
        self._written_inputs = writes.get(-1, set())  # this container's inputs a layer that runs writes a gradient of
        self._plan_fan_in(blobs)
        self._share_gradients()
        last = self.layers[-1]  # the container's outputs and their gradients are its last layer's
        self.outputs, self.output_grads = last.outputs, last.output_grads
        # shared weights: the first layer to run backward writes the gradient, the others add to it; layers in
        # nested containers count too (this binding comes after theirs, so the outermost one decides for all)
        seen: set[int] = set()
        for layer in self._backward_leaves():
            if not layer.computes_weight_gradients:
                continue
            for k, g in enumerate(layer.weight_grads):
                layer.weight_beta[k] = 1.0 if id(g) in seen else 0.0
                seen.add(id(g))
        # the gradients of weights no running layer writes (layers cut off from the output, frozen weights): those
        # of weights that move are zeroed each backward pass, as Caffe clears every gradient, so that weight decay
        # added into one meets no earlier step's values; a frozen weight's (lr_mult 0) is zeroed here, once: nothing
        # adds into it (the outermost container decides: it sees every layer that runs)
        idle: dict[int, SharedTensor] = {}
        moving: set[int] = set()
        for leaf in self._leaf_layers():
            for g, cfg in zip(leaf.weight_grads, leaf._weight_configs):
                if id(g) not in seen:
                    idle[id(g)] = g
                    if cfg.lr_mult != 0.0:
                        moving.add(id(g))
        self._idle_grads = [g for k, g in idle.items() if k in moving] if self._outermost else []
        if self._outermost:
            be = self.backend
            for k, g in idle.items():
                if k not in moving:
                    be.fill(0.0, g.write(be))

    def writes_input_gradient(self, k: int) -> bool:
        return id(self.inputs[k]) in self._written_inputs

    def _leaf_layers(self) -> list[Layer]:
        return [leaf for layer in self.layers for leaf in layer._leaf_layers()]

    def _backward_leaves(self) -> Iterator[Layer]:
        """The layers that run backward, nested containers' layers included, in the order they run."""
        for layer in reversed(self.layers):
            if not layer.runs_backward:
                continue
            if isinstance(layer, Sequential):
                yield from layer._backward_leaves()
            else:
                yield layer

    def _fan_out_grad(self, i: int, j: int, blob: str, grad: SharedTensor | None) -> SharedTensor | None:
        """A blob read by several layers: each reader writes its gradient into a tensor of its own, summed into
        the blob's gradient before its producer's backward pass (see _plan_fan_in)."""
        if grad is None or len(self.wiring.consumers[blob]) < 2:
            self._fan_scratch.pop((i, j), None)
            return grad
        own = self._fan_scratch.get((i, j))
        if own is None:
            own = self._fan_scratch[(i, j)] = SharedTensor(grad.shape, grad.dtype)
        elif own.shape != grad.shape:
            own.resize(grad.shape)
        return own

    def _plan_fan_in(self, blobs: dict) -> None:
        """For each blob read by several layers: the gradient tensor to fill and the readers' own gradients that
        sum into it, keyed by the index of the layer whose backward pass reads it (-1: the container's inputs)."""
        self._fan_in = {}
        for blob, users in self.wiring.consumers.items():
            _, target, producer = blobs[blob]
            if len(users) < 2 or target is None:
                continue
            parts = []
            for i in sorted(set(users)):
                for j, n in enumerate(self._plan[i].inputs):
                    own = self._fan_scratch.get((i, j))
                    if n == blob and own is not None and self.layers[i].input_grads[j] is own \
                            and self.layers[i].runs_backward and self.layers[i].writes_input_gradient(j):
                        parts.append(own)
            self._fan_in.setdefault(producer, []).append((target, parts))

    def _sum_fan_in(self, index: int) -> None:
        be = self.backend
        for target, parts in self._fan_in.get(index, ()):
            if not parts:
                be.fill(0.0, target.write(be))
                continue
            be.copy(parts[0].read(be), target.write(be))
            for part in parts[1:]:
                be.axpby(1.0, part.read(be), 1.0, target.read_write(be))

    def _share_gradients(self) -> None:
        """Give output gradients whose lifetimes never overlap one storage (wiring.plan_gradients)."""
        layers = self.layers
        takes = [[g is not None for g in layer.input_grads] for layer in layers]
        pool = iter(self._grad_pool)
        used: list[SharedTensor] = []
        for slot in plan_gradients(self.wiring, self._traits, takes):
            storage = next(pool, None) or SharedTensor((1,), self.backend.compute_dtype)
            used.append(storage)
            for g in slot:
                for m in g.members:
                    layer = layers[m]
                    layer.output_grads = [storage.prefix_view(layer.outputs[0].shape, grow=True, scratch=True)]
                    if m != g.root:
                        layer.input_grads = [storage.prefix_view(layer.inputs[0].shape, grow=True, scratch=True)]
                c = layers[g.consumer]
                c.input_grads[g.k] = storage.prefix_view(c.inputs[g.k].shape, grow=True, scratch=True)
        self._grad_pool = used

    def _explain(self, e: ShapeError, plan: Step, blobs: dict, layer: Layer) -> str:
        """The error with where the failing layer's inputs come from; a container's, which names a layer inside it
        (names are unique within a container only), said to be inside it."""
        parts = []
        container = isinstance(layer, Sequential)
        own = "its " if container else ""
        for n in plan.inputs:
            t, _, src = blobs[n]
            origin = f"layer '{self.layers[src].name}' ({self.layers[src].config.type})" if src >= 0 else \
                f"input of '{self.name}'"
            parts.append(f"{own}input {n!r} comes from {origin} with shape {t.shape}")
        inside = f"in layer '{layer.name}' ({layer.config.type}): " if container else ""
        return f"{inside}{e}; " + "; ".join(parts)

    def _check_declared(self, shapes: list[tuple[int, ...]]) -> None:
        for i, got in enumerate(shapes):
            self._check_input(i, got)

    def _check_input(self, i: int, got: tuple[int, ...]) -> None:
        if i < len(self.input_shapes):
            name, declared = self.input_names[i], self.input_shapes[i]
            if len(got) != len(declared) or tuple(got[1:]) != tuple(declared[1:]):
                want = "[N, " + ", ".join(map(str, declared[1:])) + "]" if len(declared) > 1 else "[N]"
                hint = layout_hint(got, (got[0], *declared[1:]) if got else declared, first=1)
                raise ShapeError(f"layer '{self.name}' (Sequential): input {name!r} must have shape {want} "
                                 f"(declared {list(declared)}), got {tuple(got)}{hint}")
            if got[0] == 0:
                raise ShapeError(f"layer '{self.name}' (Sequential): input {name!r} is an empty batch (shape "
                                 f"{tuple(got)}); give at least one sample")

    def _conform(self, i: int, x: Any) -> Any:
        """Give an input the declared per-sample shape when it differs only by trailing axes of length 1 (labels
        [N] for [N, 1]); any other difference, even of the same size, is another layout that _check_input reports."""
        declared = self.input_shapes[i]
        shape = tuple(x.shape) if isinstance(x, SharedTensor) else np.shape(x)
        if not shape or tuple(shape[1:]) == tuple(declared[1:]):
            return x
        if not same_layout(shape[1:], declared[1:]):
            return x  # _check_input reports it
        want = (shape[0], *declared[1:])
        return x.alias(want) if isinstance(x, SharedTensor) else np.reshape(x, want)

    def accept_input(self, i: int, x: Any) -> Any:
        """Input ``i`` (an array or SharedTensor) as this network takes it: given the declared per-sample shape where
        it differs only by trailing axes of length 1 (labels [N] for [N, 1]); anything else that does not fit the
        declaration is a ShapeError naming the input. What a :class:`Network` does to each input it is fed."""
        x = self._conform(i, x)
        self._check_input(i, tuple(x.shape) if isinstance(x, SharedTensor) else tuple(np.shape(x)))
        return x

    def input_takes_gradient(self, k: int) -> bool:
        """Whether a layer reading declared input k can pass a gradient into it (an Embedding's ids cannot)."""
        name = self.input_names[k]
        for i, (layer, plan) in enumerate(zip(self.layers, self._plan)):
            pd = self.seq_config.layers[i].propagate_down
            if any(n == name and (not pd or pd[j]) and _differentiable(layer, j) for j, n in enumerate(plan.inputs)):
                return True
        return False

    # --- compute --------------------------------------------------------------------------------------------
    def run_forward(self) -> None:
        for layer in self.layers:
            try:
                layer.run_forward()
            except LeafpyError as e:  # the innermost layer that raised it, for a caller whose message needs it
                if getattr(e, "layer", None) is None:
                    e.layer = layer  # type: ignore[attr-defined]
                raise
        self.ran_forward = True

    def run_backward(self) -> None:
        fan_in, zero = self._fan_in, self._zero_grads
        be = self.backend
        for g in self._idle_grads:
            be.fill(0.0, g.write(be))
        for i in range(len(self.layers) - 1, -1, -1):
            if i in fan_in:
                self._sum_fan_in(i)
            layer = self.layers[i]
            for k in zero.get(i, ()):
                be.fill(0.0, layer.output_grads[k].write(be))
            if layer.runs_backward:
                layer.run_backward()
                if self.backward_hook is not None:
                    self.backward_hook(i)
        if -1 in fan_in:
            self._sum_fan_in(-1)

    def __repr__(self) -> str:
        return f"<Sequential {self.name!r}: {len(self.layers)} layers on {self.backend.name}>"


def _differentiable(layer: Layer, j: int) -> bool:
    return layer.input_takes_gradient(j)


def _share_guard(layer: Layer, guard: Any) -> None:
    """A layer inside a container takes the container's one-thread guard, its layers too: a call on it (save,
    load_weights, set_training) from another thread while the network runs is refused as a call on the network is
    (each layer's own guard let another thread write a torn file or change a layer mid-step)."""
    layer.exclusive = guard
    for inner in getattr(layer, "layers", ()):
        _share_guard(inner, guard)
