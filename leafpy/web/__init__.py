"""leafpy in the browser: :func:`export` writes a static folder that runs a trained network in a web page on the
same WGSL kernels as the webgpu backend.

The folder holds ``leafpy.js`` (an ES module, no build step, no dependencies), ``index.html`` (a demo page) and
``model/``: ``plan.json`` (the network's forward pass as dispatches, one plan per batch size, recorded from the
webgpu backend by :mod:`leafpy.web.plan`; class names; input normalisation; checksums), ``weights.bin`` (every
weight as little-endian float32, one after the other) and ``wgsl/`` (the shader modules the plans use); where
float16 plans are recorded too (``precision``), plan.json's ``fp16`` entry holds their plans, modules and weights file
(``weights16.bin``: the float16 copies the backend casts, as its float16 kernels read them). leafpy.js
runs a batch of any size by splitting it over the plans' batch sizes (the largest while it fits, then the smallest
that holds the rest, padded with zeros).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..backends.webgpu.sources import module_source
from ..errors import LeafpyError
from ..layers.layer import Layer
from ..layers.network import Network, outermost
from ..serialization import atomic_write
from .plan import record, sample_shape

__all__ = ["export", "DEFAULT_BATCH_SIZES", "PRECISIONS"]

DEFAULT_BATCH_SIZES = (1, 8, 32)
PRECISIONS = ("auto", "fp32", "fp16", "both")
_WEIGHT_FILES = {"fp32": "weights.bin", "fp16": "weights16.bin"}
MAX_BATCH = 4096
FORMAT = "leafpy-web"
_HERE = Path(__file__).parent
_OUTPUT_KINDS = {"LogSoftmax": "log_probabilities", "Softmax": "probabilities"}


def export(layer: Layer | Network[Layer], directory: str | os.PathLike,
           batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, precision: str = "auto") -> list[str]:
    """Write ``directory``/leafpy.js, index.html and model/ for ``layer`` (a network with one declared input, on
    any backend): its forward pass is recorded on the webgpu backend (without subgroup operations, so any WebGPU
    browser compiles it) once per batch size in ``batch_sizes`` (1 is always added) and per precision:
    ``"fp32"``, ``"fp16"`` (float16, for browsers whose adapter offers shader-f16; needs this machine's adapter to
    offer it too), ``"both"``, or ``"auto"`` (both where this machine's adapter offers shader-f16, else fp32).
    Gives the precisions written. A Network (``solver.network``) exports its layer."""
    layer = outermost(layer)
    if not isinstance(layer, Layer):
        raise LeafpyError(f"lp.web.export: expected a Layer (a network), got {type(layer).__name__}")
    sizes = _batch_sizes(batch_sizes)
    precisions = _precisions(precision)
    sample = sample_shape(layer)
    out = _directory(directory)
    (out / "model" / "wgsl").mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"format": FORMAT, "version": 1, "network": layer.name, "input_shape": list(sample),
                           "output_kind": _OUTPUT_KINDS.get(_last_type(layer.config), "scores"),
                           **_preparation(layer), "precisions": precisions}
    for p in precisions:
        variant = _variant(layer, out / "model", sizes, p)
        if p == "fp32":
            doc.update(variant)  # at the top, where leafpy.js and readers before fp16 plans look
        else:
            doc[p] = variant
    atomic_write(out / "model" / "plan.json", json.dumps(doc, indent=1).encode())
    for p, name in _WEIGHT_FILES.items():  # an earlier export's weights at a precision this one leaves out
        if p not in precisions:
            (out / "model" / name).unlink(missing_ok=True)
    for name in ("leafpy.js", "index.html"):
        atomic_write(out / name, (_HERE / name).read_bytes())
    return precisions


def _variant(layer: Layer, model: Path, sizes: list[int], precision: str) -> dict:
    """Record ``layer``'s plans at ``precision``; write its weights file and shader modules into ``model``; give
    plan.json's entries for them (modules, weights, plans)."""
    be = _recording_backend(precision)
    net = Layer.from_config(be, layer.config)
    net.load_weights(layer.named_weights())
    net.set_training(False)
    constants: list[bytes] = []
    plans: list[dict] = []
    tensors: dict[str, Any] = {}
    for b in sizes:
        plan, tensors = record(net, b, constants)
        plans.append(plan)
    weights, blob = _weights(tensors, be.key, constants)
    wgsl = {}
    for m in sorted({s["module"] for p in plans for s in p["steps"] if "module" in s}):
        code = module_source(m, subgroups=False, browser=True).encode()  # as a browser compiles it
        atomic_write(model / "wgsl" / f"{m}.wgsl", code)
        wgsl[m] = {"file": f"wgsl/{m}.wgsl", "bytes": len(code), "sha256": hashlib.sha256(code).hexdigest()}
    file = _WEIGHT_FILES[precision]
    atomic_write(model / file, blob)
    return {"modules": wgsl, "weights": {"file": file, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                                         **weights}, "plans": plans}


_BACKENDS: dict[str, Any] = {}


def _recording_backend(precision: str) -> Any:
    """The webgpu backend the plans are recorded on (one per precision and process): no subgroup operations."""
    if precision not in _BACKENDS:
        from .. import backend

        _BACKENDS[precision] = backend("webgpu", subgroups=False, precision=precision)
    return _BACKENDS[precision]


def _precisions(precision: Any) -> list[str]:
    """The precisions to record for ``precision`` ("auto": fp16 too where this machine's adapter offers
    shader-f16)."""
    if precision not in PRECISIONS:
        raise LeafpyError(f"lp.web.export: precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}"[:300])
    if precision == "auto":
        offers = "shader-f16" in _recording_backend("fp32").adapter.features
        return ["fp32", "fp16"] if offers else ["fp32"]
    return ["fp32", "fp16"] if precision == "both" else [precision]


def _batch_sizes(batch_sizes: Any) -> list[int]:
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence) or not batch_sizes:
        raise LeafpyError(f"lp.web.export: batch_sizes: expected a list of positive integers, e.g. [1, 8, 32], got "
                          f"{batch_sizes!r}"[:300])
    for b in batch_sizes:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 1 <= b <= MAX_BATCH:
            raise LeafpyError(f"lp.web.export: batch_sizes: expected integers from 1 to {MAX_BATCH}, got {b!r} in "
                              f"{list(batch_sizes)}"[:300])
    return sorted({1, *(int(b) for b in batch_sizes)})


def _directory(directory: Any) -> Path:
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise LeafpyError(f"lp.web.export: directory: expected a folder path, got {directory!r}")
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise LeafpyError(f"lp.web.export: {out} exists and is not a folder; give a new or existing folder to write "
                          "leafpy.js, index.html and model/ into")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LeafpyError(f"lp.web.export: cannot create the folder {out} ({e.strerror}); give a writable path") \
            from e
    return out


def _weights(tensors: dict[str, Any], key: str, constants: list[bytes]) -> tuple[dict, bytes]:
    """A weights file's contents (each weight as the plans read it, float32 or float16, little-endian, padded to 4
    bytes; then the constants the plans write) and where each lies in it."""
    parts, entries, offset = [], {}, 0
    for name, t in tensors.items():
        a = t.to_numpy()
        data = _padded(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes())
        entries[name] = {"offset": offset, "bytes": len(data), "shape": list(a.shape), "dtype": a.dtype.name,
                         "buffer_bytes": max(int(t.buffer_on(key).raw.size), len(data))}
        parts.append(data)
        offset += len(data)
    blobs = []
    for c in constants:
        padded = _padded(c)
        blobs.append({"offset": offset, "bytes": len(padded)})
        parts.append(padded)
        offset += len(padded)
    return {"tensors": entries, "constants": blobs}, b"".join(parts)


def _padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 4)  # (queue writes move 4-byte multiples)


def _preparation(layer: Layer) -> dict:
    prep = layer.preparation
    if prep is None:
        return {"classes": [], "normalize": None, "target": None}
    norm = {"mean": list(prep.mean), "std": list(prep.std)} if prep.mean else None
    target = {"mean": list(prep.target_mean), "std": list(prep.target_std)} if prep.target_mean else None
    return {"classes": list(prep.class_names), "normalize": norm, "target": target}


def _last_type(config: Any) -> str:
    """The type of the layer that writes a network's output (the last layer of the innermost last Sequential)."""
    while config.type == "Sequential" and config.config.layers:
        config = config.config.layers[-1]
    return str(config.type)
