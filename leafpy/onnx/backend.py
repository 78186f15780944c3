"""leafpy as an ONNX backend (``onnx.backend.base``), for ONNX's backend tests:
``onnx.backend.test.BackendTest(leafpy.onnx.backend, __name__)``.

Devices: "CPU" runs on the native backend, "CUDA" on the cuda backend; :func:`for_backend` ("webgpu", or any
leafpy backend name) gives a backend class to hand to BackendTest in place of this module. As ONNX's node tests
give weights as run-time inputs, a model is converted on its first run, with those inputs' values at hand (and
again when the input shapes change).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import available_backends
from ..backends import backend as get_backend
from ..errors import LeafpyError
from ._proto import read_model, require_onnx

onnx = require_onnx()
from onnx.backend.base import Backend, BackendRep, namedtupledict  # noqa: E402

DEVICES = {"CPU": "native", "CUDA": "cuda"}


def _output_dtype(vi: Any) -> np.dtype:
    elem = vi.type.tensor_type.elem_type
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem)) if elem else np.dtype(np.float32)


def _declared_shape(vi: Any) -> tuple[int, ...] | None:
    dims = vi.type.tensor_type.shape.dim
    if not vi.type.tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in dims):
        return None
    return tuple(int(d.dim_value) for d in dims)


class LeafpyRep(BackendRep):
    """A prepared model: the leafpy network, built on the first run from the inputs given then."""

    def __init__(self, model: Any, backend_name: str) -> None:
        self.model = model
        self.backend_name = backend_name
        init = {t.name for t in model.graph.initializer}
        self.input_names = [vi.name for vi in model.graph.input if vi.name not in init]
        self._built: tuple[dict[str, Any], Any, list[str]] | None = None

    def _build(self, feeds: dict[str, np.ndarray]) -> tuple[Any, list[str]]:
        from ..layers import Layer
        from .importer import convert

        if self._built is not None and self._fits(feeds):
            return self._built[1], self._built[2]
        first = next(iter(feeds.values()), None)
        batch = int(np.shape(first)[0]) if first is not None and np.ndim(first) else 1
        config, weights = convert(self.model, batch_size=batch, feeds=feeds)
        net = Layer.from_config(get_backend(self.backend_name), config)
        net.load_weights(weights)
        net.set_training(False)
        names = [n for n, _ in config.config.inputs]
        # what the network was built from: every input's shape, and the values of those that became weights
        self._built = ({k: (np.shape(v), None if k in names else np.array(v)) for k, v in feeds.items()}, net, names)
        return net, names

    def _fits(self, feeds: dict[str, np.ndarray]) -> bool:
        """Whether the network built last serves ``feeds``: the same shapes, the same values where they are weights."""
        assert self._built is not None
        built = self._built[0]
        return built.keys() == feeds.keys() and all(
            np.shape(v) == built[k][0] and (built[k][1] is None or np.array_equal(v, built[k][1]))
            for k, v in feeds.items())

    def run(self, inputs: Any, **kwargs: Any) -> Any:
        if isinstance(inputs, dict):
            feeds = {k: np.asarray(v) for k, v in inputs.items()}
        else:
            items = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            feeds = {n: np.asarray(v) for n, v in zip(self.input_names, items)}
        net, names = self._build(feeds)
        outs = net.forward([feeds[n].astype(np.float32) for n in names])
        results = []
        for vi, t in zip(self.model.graph.output, outs):
            a = t.to_numpy().astype(_output_dtype(vi))
            shape = _declared_shape(vi)
            if shape is not None and int(np.prod(shape)) == a.size:
                a = a.reshape(shape)
            results.append(a)
        return namedtupledict("Outputs", [o.name for o in self.model.graph.output])(*results)


class LeafpyBackend(Backend):
    """The ONNX backend; ``leafpy_backend`` overrides the device's leafpy backend (see :func:`for_backend`)."""

    leafpy_backend: str | None = None

    @classmethod
    def _name(cls, device: str) -> str:
        if cls.leafpy_backend is not None:
            return cls.leafpy_backend
        kind = str(device).split(":")[0].upper()
        if kind not in DEVICES:
            raise LeafpyError(f"leafpy.onnx.backend: device {device!r}: expected one of {', '.join(DEVICES)}")
        return DEVICES[kind]

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            return cls._name(device) in available_backends()
        except LeafpyError:
            return False

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> LeafpyRep:
        model = read_model(model, "leafpy.onnx.backend.prepare")
        return LeafpyRep(model, cls._name(device))

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any) -> Any:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: Any, inputs: Any, device: str = "CPU", outputs_info: Any = None, **kwargs: Any) -> Any:
        helper = onnx.helper
        arrays = [np.asarray(x) for x in inputs]
        graph_inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                        for name, a in zip(node.input, arrays)]
        graph_outputs = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in node.output]
        model = helper.make_model(helper.make_graph([node], "node", graph_inputs, graph_outputs))
        return cls.run_model(model, arrays, device, **kwargs)


def for_backend(name: str) -> type[LeafpyBackend]:
    """An ONNX backend class running on the leafpy backend ``name`` ("native", "cuda", "webgpu") whatever the
    device asked."""
    return type(f"LeafpyBackend_{name}", (LeafpyBackend,), {"leafpy_backend": name})


prepare = LeafpyBackend.prepare
run_model = LeafpyBackend.run_model
run_node = LeafpyBackend.run_node
supports_device = LeafpyBackend.supports_device
