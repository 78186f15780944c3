"""An exported model's plan replayed with wgpu-py (lavapipe here), step by step as leafpy.js replays it: the check
of a plan whose shader modules a browser cannot compile yet, and of the plan data apart from JavaScript."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

import leafpy as lp

CASES = {
    "conv_relu_pool_linear": ([1, 6, 6], [
        {"name": "conv", "type": "Convolution", "num_output": 3, "filter_shape": [3], "stride": [1], "padding": [1]},
        {"name": "relu", "type": "ReLU"},
        {"name": "pool", "type": "Pooling", "mode": "max", "filter_shape": [2], "stride": [2]},
        {"name": "avg", "type": "Pooling", "mode": "average", "filter_shape": [2], "stride": [1]},
        {"name": "flat", "type": "Flatten"},
        {"name": "fc", "type": "Linear", "output_size": 5}]),
    "sigmoid_tanh": ([7], [
        {"name": "fc1", "type": "Linear", "output_size": 6}, {"name": "sig", "type": "Sigmoid"},
        {"name": "fc2", "type": "Linear", "output_size": 4}, {"name": "tanh", "type": "TanH"}]),
    "batchnorm_dropout": ([2, 5, 5], [
        {"name": "conv", "type": "Convolution", "num_output": 4, "filter_shape": [3], "stride": [2], "padding": [1]},
        {"name": "bn", "type": "BatchNorm"}, {"name": "drop", "type": "Dropout", "ratio": 0.5},
        {"name": "flat", "type": "Flatten"}, {"name": "fc", "type": "Linear", "output_size": 3}]),
    "more_activations": ([6], [
        {"name": "fc1", "type": "Linear", "output_size": 8}, {"name": "leaky", "type": "LeakyReLU",
                                                              "negative_slope": 0.1},
        {"name": "fc2", "type": "Linear", "output_size": 8}, {"name": "elu", "type": "ELU"},
        {"name": "fc3", "type": "Linear", "output_size": 8}, {"name": "gelu", "type": "GELU"},
        {"name": "fc4", "type": "Linear", "output_size": 8}, {"name": "softplus", "type": "Softplus"}]),
    "lstm": ([4, 3], [{"name": "lstm", "type": "LSTM", "hidden_size": 5, "return_sequences": False},
                      {"name": "fc", "type": "Linear", "output_size": 2}]),
    "softmax": ([6], [{"name": "fc", "type": "Linear", "output_size": 4}, {"name": "sm", "type": "Softmax"}]),
    "log_softmax": ([6], [{"name": "fc", "type": "Linear", "output_size": 4},
                          {"name": "lsm", "type": "LogSoftmax"}]),
}


def network(name: str, sample: list[int], layers: list[dict], seed: int = 0) -> lp.Layer:
    """A network on the native backend with random weights (BatchNorm's running statistics too)."""
    cfg = lp.config.layer_from_dict({"name": name, "type": "Sequential",
                                     "inputs": [{"name": "data", "shape": [None, *sample]}], "layers": layers})
    net = lp.Layer.from_config(lp.backend("native"), cfg, seed=seed)
    net.forward([np.zeros((1, *sample), np.float32)])
    rng = np.random.default_rng(seed)
    weights = {k: rng.normal(0, 0.5, v.shape).astype(np.float32) for k, v in net.named_weights().items()}
    for k in weights:
        if k.endswith("running_var"):
            weights[k] = np.abs(weights[k]) + 0.5
    net.load_weights(weights)
    net.set_training(False)
    return net


def replay(folder: Path, x: np.ndarray, precision: str = "fp32") -> np.ndarray:
    """The output of the exported model in ``folder`` for samples ``x``, by the plan of exactly len(x) samples (at
    ``precision``: the fp32 plans at plan.json's top, the others under their precision's name)."""
    import wgpu

    model = folder / "model"
    top = json.loads((model / "plan.json").read_text())
    doc = top if precision == "fp32" else top[precision]
    plan = next(p for p in doc["plans"] if p["batch"] == len(x))
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    device = adapter.request_device_sync(required_features=["shader-f16"] if precision == "fp16" else [])
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
    blob = (model / doc["weights"]["file"]).read_bytes()
    buffers = {}
    for name, t in doc["weights"]["tensors"].items():
        buffers["w:" + name] = device.create_buffer(size=max(4, t["buffer_bytes"]), usage=usage)
        device.queue.write_buffer(buffers["w:" + name], 0, blob[t["offset"]:t["offset"] + t["bytes"]])
    for label, size in plan["buffers"].items():
        buffers[label] = device.create_buffer(size=max(4, size), usage=usage)
    device.queue.write_buffer(buffers["input"], 0, np.ascontiguousarray(x, "<f4").tobytes())
    modules = {m: device.create_shader_module(code=(model / e["file"]).read_text()) for m, e in doc["modules"].items()}
    for step in plan["steps"]:
        if "write" in step:
            c = doc["weights"]["constants"][step["constant"]]
            device.queue.write_buffer(buffers[step["write"]], 0, blob[c["offset"]:c["offset"] + c["bytes"]])
            continue
        compute = {"module": modules[step["module"]], "entry_point": step["entry"]}
        if step["constants"]:
            compute["constants"] = step["constants"]
        pipe = device.create_compute_pipeline(layout="auto", compute=compute)
        params = base64.b64decode(step["params"])
        uniform = device.create_buffer_with_data(data=params, usage=wgpu.BufferUsage.UNIFORM)
        entries = [{"binding": 0, "resource": {"buffer": uniform, "offset": 0, "size": len(params)}}]
        for i, (label, *span) in enumerate(step["bindings"]):
            b = buffers[label]
            offset, size = span if span else (0, b.size)
            entries.append({"binding": i + 1, "resource": {"buffer": b, "offset": offset, "size": size}})
        encoder = device.create_command_encoder()
        cpass = encoder.begin_compute_pass()
        cpass.set_pipeline(pipe)
        cpass.set_bind_group(0, device.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries))
        cpass.dispatch_workgroups(*step["grid"])
        cpass.end()
        device.queue.submit([encoder.finish()])
    shape = plan["output_shape"]
    data = device.queue.read_buffer(buffers["output"], 0, 4 * int(np.prod(shape)))
    return np.frombuffer(data, "<f4").reshape(shape).copy()
