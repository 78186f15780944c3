"""Inference in the browser: leafpy.js against TensorFlow.js (WebGPU backend) and onnxruntime-web (WebGPU execution
provider), all three in one headless Chromium session, on the same network, weights and input.

Each network is built on the native backend with random weights (BatchNorm's running statistics too) and written
out three ways: ``lp.web.export`` (leafpy.js), ``lp.onnx.export`` (onnxruntime-web) and a description plus weights
that ``benchmarks/web/peers.mjs`` rebuilds with ``tf.layers`` (NHWC: convolution kernels as HWIO, the first linear
layer after a Flatten with its columns in HWC order). The folder is served on loopback (a secure context, so
WebGPU is exposed) and the page is driven over the DevTools pipe (tests/browser.py). Each framework loads its model,
runs ``--warmup`` predictions untimed, then ``--repeats`` timed: the input uploaded, the forward pass, the output
read back to the CPU (so the GPU has finished). The table gives the median, the ratio to leafpy.js (above 1:
leafpy.js is faster), the largest absolute difference from the native backend's output and from leafpy.js's.

Networks are named as in the other benchmarks, with the batch size last: ``lenet64`` (configs/mnist_lenet.yaml,
batch 64) and ``resnet18-1`` (configs/resnet18_cifar.yaml, ResNet-18 on 3x32x32, batch 1: one prediction takes
seconds on SwiftShader); any batch size works (``lenet1``, ``resnet18-128`` as train_step.py times it). Needs
Chromium (``make browser``) and the npm packages (``make web-peers``; ``make web-bench`` runs this).

    python benchmarks/web_inference.py [--nets lenet64,resnet18-1] [--repeats 10] [--warmup 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "benchmarks" / "web"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from browser import Browser, BrowserError, find_chromium  # noqa: E402
from train_step import from_run_file  # noqa: E402

import leafpy as lp  # noqa: E402
from leafpy.layers.container.wiring import output_shapes, wire  # noqa: E402

FRAMEWORKS = ("leafpy.js", "tfjs-webgpu", "ort-web-webgpu")
RUN_FILES = {"lenet": "mnist_lenet.yaml", "resnet18-": "resnet18_cifar.yaml"}
INSTALL = "make web-peers (or: cd benchmarks/web && npm ci); make web-bench installs them and runs this"


def network_config(name: str) -> lp.LayerConfig:
    """``lenet64``, ``resnet18-1``: a shipped network (Dropout removed) at the batch size its name ends with."""
    match = re.fullmatch(r"(lenet|resnet18-)(\d+)", name)
    if not match or int(match[2]) < 1:
        raise ValueError(f"unknown network {name!r}: lenet<batch> (e.g. lenet64) or resnet18-<batch> (resnet18-1)")
    return from_run_file(RUN_FILES[match[1]], int(match[2]))


def build(cfg: lp.LayerConfig, seed: int = 0) -> lp.Layer:
    """The network on the native backend in inference mode, with He-scaled random weights and running statistics
    away from 0 and 1 (so BatchNorm's arithmetic shows in the outputs)."""
    net = lp.Layer.from_config(lp.backend("native"), cfg, seed=seed)
    rng = np.random.default_rng(seed)
    norms = {lc.name for lc in cfg.config.layers if lc.type == "BatchNorm"}
    weights = {}
    for k, v in net.named_weights().items():
        if k.endswith("running_var") or k.split("/")[0] in norms and k.endswith("/weight"):
            weights[k] = rng.uniform(0.5, 1.5, v.shape)
        elif k.endswith("running_mean") or k.endswith("/bias"):
            weights[k] = rng.normal(0, 0.1, v.shape)
        else:
            weights[k] = rng.normal(0, np.sqrt(2.0 / np.prod(v.shape[1:])), v.shape)
    net.load_weights({k: v.astype(np.float32) for k, v in weights.items()})
    net.set_training(False)
    return net


# --- the tf.layers description -----------------------------------------------------------------------------------
def tfjs_spec(cfg: lp.LayerConfig, net: lp.Layer) -> tuple[dict, bytes]:
    """The network as peers.mjs rebuilds it with tf.layers (NHWC), and its weights in TensorFlow's layouts (a final
    LogSoftmax is applied as tf.logSoftmax after the model)."""
    seq = cfg.config
    steps = wire(seq).steps
    producer = {s.outputs[0]: j for j, s in enumerate(steps)}
    named = net.named_weights()
    layers, parts, table, offset = [], [], {}, 0
    flattened: dict[str, tuple] = {}  # a Flatten's output blob: the (C, H, W) it flattened
    for i, (lc, step) in enumerate(zip(seq.layers, steps)):
        if lc.type == "LogSoftmax" and i == len(steps) - 1:
            break
        layers.append({"name": lc.name, "type": lc.type, "inputs": step.inputs, "output": step.outputs[0],
                       **tf_options(lc)})
        source = step.inputs[0]
        if lc.type == "Flatten":
            shape = output_shape(seq, producer[source]) if source in producer else tuple(seq.inputs[0][1])
            if len(shape) == 4:
                flattened[step.outputs[0]] = shape[1:]
        chw = flattened.get(source) if lc.type == "Linear" else None
        for key, value in tf_weights(lc, named, chw).items():
            data = np.ascontiguousarray(value, "<f4")
            table[key] = {"offset": offset, "size": int(data.size), "shape": list(data.shape)}
            parts.append(data.tobytes())
            offset += data.nbytes
    spec = {"input": seq.inputs[0][0], "input_shape": list(seq.inputs[0][1]), "output": layers[-1]["output"],
            "log_softmax": seq.layers[-1].type == "LogSoftmax", "layers": layers, "weights": table}
    return spec, b"".join(parts)


def output_shape(seq: Any, i: int) -> tuple:
    """The output shape of a Sequential's layer ``i`` (that of the Sequential cut after it)."""
    prefix = lp.SequentialConfig(inputs=list(seq.inputs))
    for lc in seq.layers[:i + 1]:
        prefix.add_layer(lc)
    return tuple(output_shapes(prefix)[0])


def tf_options(lc: lp.LayerConfig) -> dict:
    """The settings peers.mjs passes to tf.layers; ValueError for what it does not rebuild."""
    c = lc.config
    if lc.type == "Convolution":
        if c.group != 1 or any(d != 1 for d in c.dilation) or c.pad_end is not None:
            raise ValueError(f"{lc.name}: only ungrouped, undilated, symmetric convolutions are rebuilt in tf.layers")
        return {"num_output": c.num_output, "filter_shape": list(c.filter_shape), "stride": list(c.stride),
                "padding": list(c.padding), "bias": c.bias}
    if lc.type == "Pooling":
        if any(c.padding) or c.ceil_mode or c.global_pooling or c.mode not in ("max", "average"):
            raise ValueError(f"{lc.name}: only unpadded max and average pooling are rebuilt in tf.layers")
        return {"mode": c.mode, "filter_shape": list(c.filter_shape), "stride": list(c.stride)}
    if lc.type == "BatchNorm":
        return {"eps": c.eps}
    if lc.type == "Linear":
        return {"output_size": c.output_size, "bias": c.bias}
    if lc.type == "Eltwise" and (c.operation != "sum" or any(k != 1 for k in c.coeff)):
        raise ValueError(f"{lc.name}: only plain Eltwise sums are rebuilt in tf.layers")
    if lc.type not in ("ReLU", "Eltwise", "Flatten"):
        raise ValueError(f"{lc.name}: no tf.layers form for {lc.type}")
    return {}


def tf_weights(lc: lp.LayerConfig, named: dict, chw: tuple | None) -> dict:
    """A layer's weights as tf.layers holds them: convolution kernels HWIO, dense kernels (in, out), and where the
    dense layer reads a Flatten of a (C, H, W) map ``chw``, its inputs in (H, W, C) order as an NHWC Flatten gives
    them."""
    mine = {k: v for k, v in named.items() if k.startswith(lc.name + "/")}
    key = lc.name + "/weight"
    if lc.type == "Convolution":
        mine[key] = mine[key].transpose(2, 3, 1, 0)
    if lc.type == "Linear":
        w = mine[key]
        if chw is not None:
            w = w.reshape(w.shape[0], *chw).transpose(0, 2, 3, 1).reshape(w.shape[0], -1)
        mine[key] = w.T
    return mine


# --- the served folder and the page ------------------------------------------------------------------------------
def write_network(name: str, folder: Path, seed: int = 0) -> np.ndarray:
    """``folder``/leafpy/ (export --web), model.onnx, tfjs.json + tfjs.bin and the input (NCHW and NHWC) of one
    network; the native backend's output for that input."""
    cfg = network_config(name)
    net = build(cfg, seed)
    shape = tuple(cfg.config.inputs[0][1])
    x = np.random.default_rng(seed + 1).normal(0, 1, shape).astype(np.float32)
    folder.mkdir(parents=True)
    lp.web.export(net, folder / "leafpy", batch_sizes=[shape[0]], precision="fp32")  # as the peers run
    lp.onnx.export(net, folder / "model.onnx")
    spec, blob = tfjs_spec(cfg, net)
    (folder / "tfjs.json").write_text(json.dumps(spec))
    (folder / "tfjs.bin").write_bytes(blob)
    (folder / "input.bin").write_bytes(x.tobytes())
    (folder / "input_nhwc.bin").write_bytes(np.ascontiguousarray(x.transpose(0, 2, 3, 1)).tobytes())
    return net.forward([x])[0].to_numpy().reshape(shape[0], -1)


def measure(b: Browser, name: str, native: np.ndarray, warmup: int, repeats: int, timeout: float) -> list[dict]:
    """One table row per framework for the network served at /``name``/."""
    rows: list[dict] = []
    outputs = {}
    for fw in FRAMEWORKS:
        r = b.evaluate(f"import('/peers.mjs').then(p => p.run({json.dumps(fw)}, '/{name}/', {warmup}, {repeats}))",
                       timeout=timeout)
        y = np.asarray(r["output"], np.float32).reshape(native.shape)
        outputs[fw] = y
        rows.append({"network": name, "framework": fw, "ms": statistics.median(r["ms"]), "times_ms": r["ms"],
                     "adapter": r["adapter"], "diff_native": float(np.abs(y - native).max()),
                     "diff_leafpy_js": float(np.abs(y - outputs[FRAMEWORKS[0]]).max())})
    for r in rows:
        r["ratio"] = r["ms"] / rows[0]["ms"]
    return rows


def table(rows: list[dict], adapter: dict) -> str:
    fallback = " (fallback adapter)" if adapter["fallback"] else ""
    lines = [f"# one prediction (input upload, forward, output read back), median; adapter: {adapter['name']}"
             f"{fallback}",
             f"{'network':<14}{'framework':<16}{'ms':>10}{'x leafpy.js':>13}{'max|diff| native':>18}"
             f"{'max|diff| leafpy.js':>21}  adapter"]
    for r in rows:
        lines.append(f"{r['network']:<14}{r['framework']:<16}{r['ms']:>10.2f}{r['ratio']:>13.2f}"
                     f"{r['diff_native']:>18.2e}{r['diff_leafpy_js']:>21.2e}  {r['adapter'] or adapter['name']}")
    return "\n".join(lines)


def missing() -> str | None:
    """Why the benchmark cannot run here, None where it can."""
    if find_chromium() is None:
        return "no Chromium: make browser (or apt-get install chromium)"
    for package in ("@tensorflow/tfjs", "@tensorflow/tfjs-backend-webgpu", "onnxruntime-web"):
        if not (WEB / "node_modules" / package / "package.json").exists():
            return f"the npm package {package} is not installed in benchmarks/web: {INSTALL}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", default="lenet64,resnet18-1", help="lenet<batch>, resnet18-<batch>, comma-separated")
    p.add_argument("--repeats", type=int, default=10, help="timed predictions per framework (the median is shown)")
    p.add_argument("--warmup", type=int, default=2, help="untimed predictions first (shader compiles, caches)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one framework may take on one network")
    p.add_argument("--json", type=Path, help="write the rows (with every time) to this file")
    args = p.parse_args(argv)
    nets = [n for n in args.nets.split(",") if n]
    try:
        for n in nets:
            network_config(n)
    except ValueError as e:
        p.error(str(e))
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be at least 1 and --warmup at least 0")
    why = missing()
    if why:
        print(f"web_inference.py: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="leafpy-web-bench-") as tmp:
        root = Path(tmp)
        os.symlink(WEB / "node_modules", root / "node_modules")
        (root / "peers.mjs").write_bytes((WEB / "peers.mjs").read_bytes())
        (root / "blank.html").write_text("<!doctype html><title>leafpy web benchmark</title>")
        try:
            natives = {n: write_network(n, root / n) for n in nets}
        except lp.LeafpyError as e:  # e.g. no webgpu backend to record leafpy.js's plans on
            print(f"web_inference.py: {e}", file=sys.stderr)
            return 2
        rows: list[dict] = []
        with Browser(root, timeout=args.timeout) as b:
            b.goto("blank.html")
            adapter = b.evaluate("import('/peers.mjs').then(p => p.adapter())")
            for n in nets:
                try:
                    rows += measure(b, n, natives[n], args.warmup, args.repeats, args.timeout)
                except BrowserError as e:
                    print(f"web_inference.py: {n}: {e}\n{chr(10).join(b.console()[-10:])}", file=sys.stderr)
                    return 1
    print(table(rows, adapter))
    if args.json:
        args.json.write_text(json.dumps({"adapter": adapter, "warmup": args.warmup, "repeats": args.repeats,
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
