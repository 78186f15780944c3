"""A forward pass's dispatches written down as data: the webgpu backend tells a :class:`PlanRecorder` (its
``tracer``) of every dispatch it encodes (shader module, entry point, pipeline constants, uniform bytes, workgroup
grid, bound buffers and their ranges) and of every upload, and the recorder names each buffer by what it holds — the
network's input, its output, a weight by name, or an intermediate by number. leafpy.js replays that list on the
same WGSL, so the kernel-selection rules stay in one place: the backend that picked them."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from ..errors import LeafpyError
from ..layers.layer import Layer


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

    def dispatch(self, module: str, entry: str, params: bytes, buffers: list, groups: tuple, ranges: list | None,
                 constants: tuple) -> None:
        bindings = []
        for k, b in enumerate(buffers):
            span = ranges[k] if ranges and ranges[k] is not None else None
            bindings.append([self._ref(b.raw)] + (list(span) if span else []))
        self.steps.append({"module": module, "entry": entry, "constants": {k: v for k, v in constants},
                           "params": base64.b64encode(params).decode(), "grid": [int(g) for g in groups],
                           "bindings": bindings})

    def upload(self, data: bytes, out: Any) -> None:
        self.steps.append({"write": self._ref(out.raw), "data": bytes(data)})

    def download(self, buf: Any) -> None:
        raise LeafpyError("leafpy.web: this network reads data back to the host in the middle of its forward pass "
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


def record(net: Layer, batch: int, constants: list[bytes]) -> tuple[dict, dict[str, Any]]:
    """Run ``net`` (on the webgpu backend, in inference mode) forward on ``batch`` samples twice — the first settles
    its buffers, the second is recorded — and give the plan and the raw weight buffers by weight name."""
    be: Any = net.backend  # the webgpu backend (its tracer, flush)
    shape = sample_shape(net)
    x = np.zeros((batch,) + shape, np.float32)
    net.forward([x])
    be.flush()
    rec = PlanRecorder()
    be.tracer = rec
    try:
        out = net.forward([x])[0]
        be.flush()
    finally:
        be.tracer = None
    names = {id(net.inputs[0].buffer_on(be.key).raw): "input", id(out.buffer_on(be.key).raw): "output"}
    weights = {}
    for name, t in zip(net.learnable_weights_names(), net.learnable_weights_data()):
        raw = t.buffer_on(be.key).raw
        names.setdefault(id(raw), "w:" + name)
        weights[name] = raw
    return rec.plan(batch, names, out.shape, constants), weights


def sample_shape(net: Layer) -> tuple[int, ...]:
    """The shape of one sample of the network's only input."""
    shapes = net.declared_input_shapes()
    if len(shapes) != 1:
        raise LeafpyError(f"leafpy.web: network '{net.name}' declares {len(shapes)} inputs; a web export takes a "
                          "network that declares one input, the samples (a Sequential with inputs: [{name, shape}])")
    return tuple(int(d) for d in shapes[0][1:])
