"""A forward pass's dispatches written down as data: the webgpu backend tells a :class:`PlanRecorder` (its
``tracer``) of every dispatch it encodes, as the record its kernel families hand the encoder (a
``leafpy.backends.webgpu.encoder.Dispatch``: shader module, entry point, pipeline constants, uniform bytes,
workgroup grid, bound buffers and their ranges), and of every upload, and the recorder names each buffer by what
it holds — the network's input, its output, a weight by name, or an intermediate by number. leafpy.js replays
that list on the same WGSL, so the kernel-selection rules stay in one place: the backend that picked them."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import LeafpyError
from ..layers.layer import Layer
from ..tensor import SharedTensor

if TYPE_CHECKING:
    from ..backends.webgpu.encoder import Dispatch


class HostRead(LeafpyError):
    """A dispatch the plan cannot hold: the backend read a buffer back to the host."""


class PlanRecorder:
    """The dispatches and uploads of one forward pass, with the raw buffers they touch (named by :meth:`plan`)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._raws: list[Any] = []  # every buffer seen, in first-seen order (kept alive while recording)
        self._index: dict[int, int] = {}  # id(raw) -> position in _raws

    def _ref(self, raw: Any) -> int:
        i = self._index.get(id(raw))
        if i is None:
            i = self._index[id(raw)] = len(self._raws)
            self._raws.append(raw)
        return i

    def dispatch(self, d: Dispatch) -> None:
        bindings = []
        for k, b in enumerate(d.buffers):
            span = d.ranges[k] if d.ranges and d.ranges[k] is not None else None
            bindings.append([self._ref(b.raw)] + (list(span) if span else []))
        self.steps.append({"module": d.module, "entry": d.entry, "constants": dict(d.constants),
                           "params": base64.b64encode(d.params).decode(), "grid": [int(g) for g in d.grid],
                           "bindings": bindings})

    def seen(self) -> dict[int, int]:
        """id(raw) -> position, for every buffer the recorded steps touched."""
        return self._index

    def upload(self, data: bytes, out: Any) -> None:
        self.steps.append({"write": self._ref(out.raw), "data": bytes(data)})

    def download(self, buf: Any) -> None:
        raise HostRead("leafpy.web: this network reads data back to the host in the middle of its forward pass "
                       "(a layer option without a WebGPU kernel), so its forward pass cannot be exported as "
                       "dispatches; export a network whose layers all run on the GPU")

    def plan(self, batch: int, names: dict[int, str], output_shape: tuple[int, ...], constants: list[bytes]) -> dict:
        """The plan for ``batch`` samples. ``names``: id(raw) -> "input", "output" or "w:NAME" for the buffers
        the caller knows; the others become intermediates "t0", "t1", ... (``buffers`` gives each one's bytes, and the
        input's and output's). A write into the
        input is the sample upload (dropped: leafpy.js writes the samples); other writes are constants, appended
        to ``constants`` (their index in the weights file's constant blobs)."""
        labels: list[str] = []
        buffers: dict[str, int] = {}
        for raw in self._raws:
            label = names.get(id(raw))
            if label is None:
                label = f"t{len(buffers) - sum(x in buffers for x in ('input', 'output'))}"
            if not label.startswith("w:"):
                buffers[label] = int(raw.size)
            labels.append(label)
        steps = []
        for s in self.steps:
            if "write" in s:
                target = labels[s["write"]]
                if target == "input":
                    continue
                if target.startswith("w:") or target == "output":
                    raise LeafpyError(f"leafpy.web: the forward pass writes host data into {target[2:] or target} "
                                      "midway; it cannot be exported as dispatches")
                constants.append(s["data"])
                steps.append({"write": target, "constant": len(constants) - 1})
            else:
                steps.append(dict(s, bindings=[[labels[b[0]]] + b[1:] for b in s["bindings"]]))
        return {"batch": batch, "output_shape": list(output_shape), "buffers": buffers, "steps": steps}


def record(net: Layer, batch: int, constants: list[bytes]) -> tuple[dict, dict[str, SharedTensor]]:
    """Run ``net`` (on the webgpu backend, in inference mode) forward on ``batch`` samples twice — the first settles
    its buffers, the second is recorded — and give the plan and, by weight name, the weight tensor its dispatches
    read (the float32 master, or at precision fp16 the float16 copy the backend cast from it)."""
    be: Any = net.backend  # the webgpu backend (its tracer, flush)
    x = np.zeros((batch,) + sample_shape(net), np.float32)
    _forward(net, x)
    be.flush()
    rec = PlanRecorder()
    be.tracer = rec
    try:
        inp, out = _forward(net, x)
        be.flush()
    except HostRead as e:
        layer = getattr(e, "layer", None)
        if layer is None:
            raise
        raise LeafpyError(f"leafpy.web: layer '{layer.name}' ({layer.config.type}) reads data back to the host in "
                          "its forward pass (an option without a WebGPU kernel), so the network cannot be exported "
                          "as dispatches; export a network whose layers all run on the GPU") from None
    finally:
        be.tracer = None
    names = {id(inp.buffer_on(be.key).raw): "input", id(out.buffer_on(be.key).raw): "output"}
    weights = _bound_weights(net, rec, names)
    return rec.plan(batch, names, out.shape, constants), weights


def _forward(net: Layer, x: np.ndarray) -> tuple[SharedTensor, SharedTensor]:
    """``net``'s forward pass on float32 samples ``x``, to a float32 output: the tensors the plan calls its input
    and output. A network that computes in float16 (precision fp16) takes ``x`` as a float32 tensor and casts it in,
    and its float16 output is cast out: the backend's own casts, dispatched (and recorded) with the rest."""
    be = net.backend
    if np.dtype(be.compute_dtype) == np.float32:
        out = net.forward([x])[0]
        return net.inputs[0], out
    x32 = SharedTensor.from_numpy(x)
    out = net.forward([x32])[0]
    if out.dtype == np.float32:
        return x32, out
    out32 = SharedTensor(out.shape, np.float32)
    be.cast(out.read(be), out32.write(be))
    return x32, out32


def _bound_weights(net: Layer, rec: PlanRecorder, names: dict[int, str]) -> dict[str, SharedTensor]:
    """Each weight's tensor as the recorded dispatches bind it (its low-precision copies where they read those),
    named "w:NAME" in ``names``."""
    key = net.backend.key
    copies: dict[int, list[SharedTensor]] = {}
    for master, copy in _weights_and_copies(net):
        if copy is not None and copy.buffer_on(key) is not None:
            copies.setdefault(id(master), []).append(copy)
    out = {}
    for name, t in zip(net.learnable_weights_names(), net.learnable_weights_data()):
        read = [c for c in copies.get(id(t), []) if id(c.buffer_on(key).raw) in rec.seen()]
        if read and id(t.buffer_on(key).raw) in rec.seen():
            raise LeafpyError(f"leafpy.web: the forward pass reads weight {name} both as float32 and as a float16 "
                              "copy; export it with precision='fp32'")
        for c in read or [t]:
            names.setdefault(id(c.buffer_on(key).raw), "w:" + name)
        out[name] = read[0] if read else t
    return out


def _weights_and_copies(layer: Layer) -> list[tuple[SharedTensor, SharedTensor | None]]:
    """Every layer's (weight, low-precision copy or None) pairs, containers' layers included."""
    pairs = list(zip(layer.weights, layer.weight_copies))
    for child in getattr(layer, "layers", []):
        pairs += _weights_and_copies(child)
    return pairs


def sample_shape(net: Layer) -> tuple[int, ...]:
    """The shape of one sample of the network's only input."""
    shapes = net.declared_input_shapes()
    if len(shapes) != 1:
        raise LeafpyError(f"leafpy.web: network '{net.name}' declares {len(shapes)} inputs; a web export takes a "
                          "network that declares one input, the samples (a Sequential with inputs: [{name, shape}])")
    return tuple(int(d) for d in shapes[0][1:])
