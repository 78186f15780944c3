"""A Sequential's wiring and its gradient-memory plan, as functions of the configs.

:func:`wire` names every blob of a :class:`SequentialConfig` and decides which layers run in place;
:func:`plan_gradients` decides which output gradients share one storage. Both read only configs and what each layer
declares about itself (:class:`Traits`: arity, in-place ability, whether backward reads the output), never tensors
or a backend, so a network's plan can be computed, printed and tested without building it (``wire(config)`` takes
each layer's traits from its config). The rules are Sequential's (see its module docstring).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError, LeafpyError
from ...layer_config import LayerConfig, Shape, lookup

if TYPE_CHECKING:
    from .sequential import SequentialConfig


@dataclass(frozen=True)
class Traits:
    """What the wiring needs to know of a layer, as its worker declares it."""

    num_inputs: int
    num_outputs: int = 1
    in_place: bool = False
    """The output may share the input's storage."""
    modifies_data: bool = True
    """False where the output is the input seen with another shape (Reshape, Flatten)."""
    backward_reads_output: bool = True
    is_container: bool = False


def traits_of(worker: Any) -> Traits:
    """A worker's declared traits."""
    return Traits(worker.num_inputs, worker.num_outputs, worker.in_place, worker.modifies_data,
                  worker.backward_reads_output)


def config_traits(config: LayerConfig) -> Traits:
    """A layer's traits from its config alone (the worker is built, which allocates nothing)."""
    entry = lookup(config.type, f"layer '{config.name}'")
    if entry.is_container:
        return Traits(len(config.config.inputs), is_container=True)
    return traits_of(entry.impl(config.config, config.name))


@dataclass
class Step:
    """One layer's place in the wiring: the blobs it reads and writes, and whether it runs in place."""

    inputs: list[str]
    outputs: list[str]
    in_place: bool = False


@dataclass
class Wiring:
    steps: list[Step]
    """Per layer, in order."""
    producer: dict[str, int]
    """Blob -> the index of the layer that writes it (-1: one of the container's inputs)."""
    consumers: dict[str, list[int]] = field(default_factory=dict)
    """Blob -> the indices of the layers that read it (a layer reading it twice is listed twice)."""

    def __str__(self) -> str:
        return "\n".join(f"{i}: {', '.join(s.inputs)} -> {', '.join(s.outputs)}{' (in place)' * s.in_place}"
                         for i, s in enumerate(self.steps))


def wire(config: SequentialConfig, traits: Sequence[Traits] | None = None) -> Wiring:
    """Name the blobs of ``config``'s layers and decide which run in place (``traits``: one per layer, by default
    :func:`config_traits` of each). Raises ConfigError naming the layer for a blob that does not exist, an output
    written twice or a ``propagate_down`` of the wrong length."""
    layers: list[LayerConfig] = config.layers
    if traits is None:
        traits = [config_traits(lc) for lc in layers]
    input_names = [n for n, _ in config.inputs]
    steps: list[Step] = []
    producer: dict[str, int] = {n: -1 for n in input_names}
    consumers: dict[str, list[int]] = {}
    unread = list(input_names)
    prev_outputs: list[str] = []
    renamed: dict[str, str] = {}  # a blob name taken over by a later layer's output (Leaf's in-place request)
    last = len(layers) - 1
    for i, (lc, tr) in enumerate(zip(layers, traits)):
        if lc.inputs:
            names = list(lc.inputs)
        else:
            names = list(prev_outputs) if i > 0 else []
            for n in list(unread):
                if len(names) >= tr.num_inputs:
                    break
                if n not in names:
                    names.append(n)
        names = [renamed.get(n, n) for n in names]
        for n in names:
            if n not in producer:
                later = next((c.name for c in layers[i:] if n in (c.outputs or ())), None)
                if later is not None:
                    raise ConfigError(f"layer '{lc.name}' ({lc.type}): input blob {n!r} is written by layer "
                                      f"'{later}', {'which is this layer' if later == lc.name else 'which comes later'}"
                                      f": a layer reads blobs written before it; move '{lc.name}' after the layer "
                                      f"that writes {n!r}, or read another blob")
                raise ConfigError(f"layer '{lc.name}' ({lc.type}): input blob {n!r} does not exist; available "
                                  f"blobs: {', '.join(producer) or 'none'}")
            if n in unread:
                unread.remove(n)
            consumers.setdefault(n, []).append(i)
        if lc.propagate_down and len(lc.propagate_down) != len(names):
            raise ConfigError(f"layer '{lc.name}' ({lc.type}).propagate_down: expected {len(names)} values "
                              f"(one per input), got {len(lc.propagate_down)}")
        if lc.outputs:
            outs = list(lc.outputs)
            if len(outs) != tr.num_outputs:
                raise ConfigError(f"layer '{lc.name}' ({lc.type}).outputs: expected {tr.num_outputs} name(s), "
                                  f"got {outs}")
        else:
            stem = "SEQUENTIAL_OUTPUT" if i == last else "SEQUENTIAL"
            outs = [f"{stem}_{i}"] if tr.num_outputs == 1 else [f"{stem}_{i}_{k}" for k in range(tr.num_outputs)]
        for k, o in enumerate(outs):
            if (o in renamed and renamed[o] in names) or (o in producer and o in names and lc.inputs):
                # Leaf's (and Caffe's) in-place request: an output named as the layer's input takes that name
                # over for the layers after it; whether it really runs in place is decided below
                internal = f"{o}@{lc.name}"
                if internal in producer:
                    raise ConfigError(f"layer '{lc.name}' ({lc.type}): output blob {o!r} is written twice")
                renamed[o] = internal
                outs[k] = o = internal
            if o in producer:
                current = renamed.get(o, o)  # (the last in-place writer of a name taken over)
                writer = "an input" if producer[current] < 0 else repr(layers[producer[current]].name)
                raise ConfigError(f"layer '{lc.name}' ({lc.type}): output blob {o!r} is already written by "
                                  f"{writer}; blob names must be unique")
            producer[o] = i
        steps.append(Step(names, outs))
        prev_outputs = outs
    # in place: 'keeps' tracks whether a storage's current contents are needed by a backward pass
    storage_of: dict[str, str] = {}
    keeps: dict[str, bool] = {}
    for tr, step in zip(traits, steps):
        reads_out = tr.backward_reads_output or tr.is_container
        if (tr.in_place and not tr.is_container and len(step.inputs) == 1 and len(step.outputs) == 1
                and producer[step.inputs[0]] >= 0 and len(consumers[step.inputs[0]]) == 1):
            st = storage_of[step.inputs[0]]
            if not tr.modifies_data or not keeps[st]:
                step.in_place = True
                storage_of[step.outputs[0]] = st
                if tr.modifies_data:
                    keeps[st] = reads_out
                continue
        for o in step.outputs:
            storage_of[o] = o
            keeps[o] = reads_out
    return Wiring(steps, producer, consumers)


def output_shapes(config: SequentialConfig, input_shapes: Sequence[Shape] | None = None) -> list[Shape]:
    """The shapes of a Sequential's outputs (its last layer's) for inputs of ``input_shapes`` (default: the
    declared ones), from the configs alone: each layer's worker, built from its config (which allocates nothing),
    computes its outputs' shapes as ``bind`` does, and a ShapeError names the first layer they do not fit."""
    given = [s for _, s in config.inputs] if input_shapes is None else input_shapes
    shapes: dict[str, Shape] = {n: tuple(s) for (n, _), s in zip(config.inputs, given)}
    steps = wire(config).steps
    for lc, step in zip(config.layers, steps):
        inputs = [shapes[n] for n in step.inputs]
        entry = lookup(lc.type, f"layer '{lc.name}'")
        if entry.is_container:  # (names are unique within a container only: an error inside says where)
            try:
                outputs = output_shapes(lc.config, inputs)
            except LeafpyError as e:
                raise type(e)(f"in layer '{lc.name}' ({lc.type}): {e}") from None
        else:
            worker = entry.impl(lc.config, lc.name)
            worker.check_inputs(inputs)
            outputs = worker.output_shapes(inputs)
        shapes.update(zip(step.outputs, (tuple(s) for s in outputs)))
    return [shapes[n] for n in steps[-1].outputs] if steps else []


@dataclass
class GradientGroup:
    """Layers whose output gradient is one tensor: a layer and the in-place layers after it (``members``, the
    first is ``root``), whose gradient is written by input ``k`` of layer ``consumer``."""

    root: int
    members: list[int]
    consumer: int
    k: int


def plan_gradients(wiring: Wiring, traits: Sequence[Traits], takes_gradient: Sequence[Sequence[bool]]
                   ) -> list[list[GradientGroup]]:
    """Which output gradients share one storage: a list of storages, each the groups it serves.

    Backward runs from the last layer to the first; a blob's gradient is written by its consumer and read by its
    producer (and by the in-place layers between them, which work on the same storage), so gradients whose
    lifetimes never overlap can share, and a chain needs two storages. ``takes_gradient[i][j]``: whether input j of
    layer i receives a gradient. Left out (each keeps its own tensor): outputs of containers and of layers with
    several outputs, blobs read by several layers (their summed gradient), the container's output (its gradient
    comes from outside) and blobs whose consumer writes no gradient into them.
    """
    steps = wiring.steps
    consumer = {n: i for i, step in enumerate(steps) for n in step.inputs}
    groups: list[dict] = []
    group_of: dict[str, dict] = {}
    for i, (tr, step) in enumerate(zip(traits, steps)):
        if tr.is_container or len(step.outputs) != 1:
            continue
        if step.in_place:
            g = group_of.get(step.inputs[0])
            if g is None:
                continue
            g["members"].append(i)
        else:
            g = {"root": i, "members": [i]}
            groups.append(g)
        g["blob"] = step.outputs[0]
        group_of[step.outputs[0]] = g
    usable: list[GradientGroup] = []
    for g in groups:
        if len(wiring.consumers.get(g["blob"], ())) > 1:
            continue  # read by several layers: the summed gradient keeps its own storage
        c = consumer.get(g["blob"])  # None: the container's output, whose gradient comes from outside
        if c is None or traits[c].is_container:
            continue
        k = steps[c].inputs.index(g["blob"])
        if not takes_gradient[c][k]:
            continue
        usable.append(GradientGroup(g["root"], g["members"], c, k))
    slots: list[list[GradientGroup]] = []
    last_reader: list[int] = []  # per storage: the index of the layer that last reads it
    for group in sorted(usable, key=lambda u: -u.consumer):
        for s, reader in enumerate(last_reader):
            if group.consumer < reader:  # the occupant's gradient is consumed before this one is written
                last_reader[s] = group.root
                slots[s].append(group)
                break
        else:
            slots.append([group])
            last_reader.append(group.root)
    return slots
