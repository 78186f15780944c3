"""Reading ONNX models as untrusted input: the onnx package's protobuf parser (no pickle, no code), every tensor's
size checked against the bytes that hold it, external data refused, the file size bounded.

The onnx package is imported here, on first use, so that ``import leafpy`` never imports it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from .. import _checks
from ..errors import LeafpyError, SerializationError

MAX_ONNX_BYTES = 2**31 - 1
"""protobuf's own limit on one message; larger models keep their weights as external data, which is refused."""


def unique_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_2``, ``base_3``, ... : the first not in ``taken``, which then holds it."""
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def require_onnx() -> Any:
    """The onnx module, or a LeafpyError saying how to install it."""
    try:
        import onnx
    except ImportError as e:
        raise LeafpyError("ONNX support needs the onnx package: pip install 'leafpy-dl[onnx]' (or pip install "
                          "onnx)") from e
    return onnx


def read_model(source: Any, where: str = "lp.onnx.load") -> Any:
    """A ModelProto from a path, bytes or a ModelProto, with its tensors checked (see :func:`check_tensors`)."""
    onnx = require_onnx()
    if isinstance(source, onnx.ModelProto):
        model, name = source, "the model"
    elif isinstance(source, (bytes, bytearray, memoryview)):
        model, name = _parse(onnx, bytes(source), "the given bytes"), "the given bytes"
    elif isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        model = _parse(onnx, _read(name), name)
    else:
        raise LeafpyError(f"{where}: expected a path to an .onnx file, its bytes or an onnx.ModelProto, got "
                          f"{type(source).__name__}")
    if not model.HasField("graph"):
        raise SerializationError(f"{name}: no graph in the model (not an ONNX model, or a truncated file)")
    if not any(op.domain in ("", "ai.onnx") for op in model.opset_import):
        raise SerializationError(f"{name}: the model imports no opset of the default ONNX domain (a truncated file, "
                                 "or not an ONNX model)")
    check_tensors(model.graph, name)
    return model


def _read(path: str) -> bytes:
    """The file's bytes: a regular file (a FIFO or a device would block or never end) under protobuf's limit."""
    return bytes(_checks.read_whole(path, "an ONNX model (.onnx)", MAX_ONNX_BYTES,
                                    f"protobuf's limit of {MAX_ONNX_BYTES}; leafpy reads self-contained models only",
                                    SerializationError))


def _parse(onnx: Any, data: bytes, name: str) -> Any:
    from google.protobuf.message import DecodeError

    if len(data) > MAX_ONNX_BYTES:
        raise SerializationError(f"{name}: {len(data)} bytes, over protobuf's limit of {MAX_ONNX_BYTES}")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise SerializationError(f"{name}: not a valid ONNX file (truncated or corrupted): {e}") from None
    return model


def opset_of(model: Any) -> int:
    """The model's version of the default ONNX domain."""
    return max(op.version for op in model.opset_import if op.domain in ("", "ai.onnx"))


def check_tensors(graph: Any, name: str) -> None:
    """Refuse external data and tensors whose declared size does not fit the data the file holds for them,
    in the graph's initializers and Constant nodes (subgraphs are not supported anywhere)."""
    tensors = list(graph.initializer)
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                tensors.append(a.t)
            tensors.extend(a.tensors)
            if a.HasField("g") or len(a.graphs):
                raise SerializationError(f"{name}: node '{node.name}' ({node.op_type}) holds a subgraph; leafpy "
                                         "imports graphs without control flow")
    for t in tensors:
        check_tensor(t, name)


def check_tensor(t: Any, name: str) -> None:
    onnx = require_onnx()
    if t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data):
        raise SerializationError(f"{name}: tensor {t.name!r} keeps its data in an external file; leafpy reads "
                                 "self-contained models only (save it with the weights inside: onnx.save_model(model, "
                                 "path, save_as_external_data=False))")
    if any(d < 0 for d in t.dims):
        raise SerializationError(f"{name}: tensor {t.name!r} has a negative dimension {list(t.dims)}")
    count = math.prod(t.dims)
    try:
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        raise SerializationError(f"{name}: tensor {t.name!r} has an unknown data type {t.data_type}") from None
    if t.raw_data:
        held = len(t.raw_data) // itemsize if itemsize else 0
    else:
        held = max(len(t.float_data), len(t.int32_data), len(t.int64_data), len(t.double_data),
                   len(t.uint64_data), len(t.string_data))
        if t.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128):
            held //= 2
    if held != count:
        raise SerializationError(f"{name}: tensor {t.name!r} declares shape {list(t.dims)} ({count} values) but "
                                 f"holds {held}; the file is corrupted")


def to_array(t: Any, name: str = "the model") -> np.ndarray:
    """A checked TensorProto as a NumPy array."""
    onnx = require_onnx()
    check_tensor(t, name)
    try:
        return np.asarray(onnx.numpy_helper.to_array(t))
    except (ValueError, TypeError) as e:
        raise SerializationError(f"{name}: tensor {t.name!r} cannot be read: {e}") from None
