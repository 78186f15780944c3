"""Hostile-input corpus: corrupted and crafted files (models, checkpoints, Cap'n Proto messages, run files, IDX and
npz data) opened in a memory- and time-limited child process, each outcome classified.

Run ``python -m tests.hostile.corpus --table`` from the repository root to print outcome counts per class.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MEMORY_LIMIT = 1 << 30
TIMEOUT_S = 20.0

CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
import leafpy as lp
from leafpy.errors import LeafpyError
backend = lp.backend("native")

def open_case(loader, path):
    if loader == "model":
        lp.Layer.load(backend, path)
    elif loader == "checkpoint":
        lp.Solver.load_checkpoint(backend, backend, path)
    elif loader == "run file":
        run = lp.config.load(path)
        lp.Layer.from_config(backend, run.network)
    elif loader == "idx":
        lp.data.read_idx(path)
    elif loader == "npz":
        lp.data.npz(path, test_fraction=0.5)
    elif loader == "onnx":
        lp.onnx.load(path)

out = {}
loader = sys.argv[2]
for path in json.loads(sys.argv[1]):
    try:
        open_case(loader, path)
        out[path] = "silently accepted"
    except LeafpyError:
        out[path] = "clear error"
    except MemoryError:
        out[path] = "memory"
    except Exception as e:  # classified, not hidden: the class name is reported
        out[path] = "raw exception:" + type(e).__name__
print("RESULT " + json.dumps(out))
""".replace("MEMORY_LIMIT", str(MEMORY_LIMIT))


def make_model(path: Path) -> None:
    """Save a small real model through the public API."""
    import leafpy as lp
    backend = lp.backend("native")
    layer = lp.Layer.from_config(backend, lp.LayerConfig("fc", lp.LinearConfig(output_size=3)), seed=0)
    layer.forward([np.ones((2, 4), np.float32)])
    layer.save(path)


LOADER = {"model truncation": "model", "model byte flip": "model", "checkpoint truncation": "checkpoint",
          "checkpoint byte flip": "checkpoint", "crafted message": "model", "run file": "run file",
          "IDX file": "idx", "npz file": "npz", "crafted model weights": "model",
          "crafted checkpoint state": "checkpoint", "npz oddity": "npz", "ONNX truncation": "onnx",
          "ONNX crafted": "onnx", "Leaf model damage": "model", "crafted segment table": "model"}
"""How each class's cases are opened in the child."""


def make_checkpoint(path: Path, dropout: bool = False) -> None:
    """A small solver's checkpoint after one step (with a Dropout layer, whose draws it records, if asked)."""
    import leafpy as lp
    be = lp.backend("native")
    net = lp.SequentialConfig(inputs=[("data", [2, 4])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    if dropout:
        net.add_layer(lp.LayerConfig("drop", lp.DropoutConfig(ratio=0.5)))
    obj = lp.SequentialConfig(inputs=[("out", [2, 3]), ("label", [2, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=3)))
    solver = lp.Solver.from_config(be, be, lp.SolverConfig(network=lp.LayerConfig("n", net),
                                                           objective=lp.LayerConfig("o", obj), solver="adam"))
    solver.train_minibatch(np.ones((2, 4), np.float32), np.array([0, 2]))
    solver.save_checkpoint(str(path))


def _damaged(work: Path, data: bytes, stem: str, rng: np.random.Generator, n: int) -> tuple[list[Path], list[Path]]:
    cuts, flips = [], []
    for k, off in enumerate(sorted(set(rng.integers(0, len(data), n).tolist()))):
        p = work / f"{stem}-trunc{k}.leaf"
        p.write_bytes(data[:off])
        cuts.append(p)
    for k, off in enumerate(rng.integers(0, len(data), n).tolist()):
        b = bytearray(data)
        b[off] ^= 1 << int(rng.integers(0, 8))
        p = work / f"{stem}-flip{k}.leaf"
        p.write_bytes(bytes(b))
        flips.append(p)
    return cuts, flips


def crafted_messages(work: Path) -> list[Path]:
    """Well-formed leafpy files (a valid header and checksum: a hostile writer computes them too) whose contents
    declare absurd sizes, depths and shapes."""
    import leafpy as lp
    from leafpy import serialization as ser

    out = []

    def write(name: str, msg) -> None:
        p = work / f"crafted-{name}.leaf"
        p.write_bytes(ser.encode(msg, "Layer"))
        out.append(p)

    def base(shape, raw=b"", data=None):
        layer = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
        layer.forward([np.ones((1, 4), np.float32)])
        m = ser.model_message(layer.config, layer.named_weights())
        t = m.weightsData[0].tensor
        t.shape = shape
        t.raw = raw
        if data is not None:
            t.data = data
        return m

    write("huge-shape", base([2**31, 2**31], b"\0" * 48))
    write("shape-overflow", base([2**63, 2**63, 4], b"\0" * 48))
    write("shape-disagrees", base([3, 4], b"\0" * 8))
    write("list-shorter", base([3, 4], data=[0.0] * 5))
    m = base([3, 4], b"\0" * 48)
    m.init("weightsData", 200_000)  # 200,000 empty weights
    write("many-weights", m)
    deep = lp.LayerConfig("fc", lp.LinearConfig(output_size=2))
    for d in range(300):
        seq = lp.SequentialConfig(inputs=[("x", [1, 2])])
        seq.add_layer(deep)
        deep = lp.LayerConfig(f"l{d}", seq)
    m = ser.schema().Layer.new_message()
    m.name = "deep"
    ser.write_layer_config(m.init("config"), deep)
    write("deep-nesting", m)
    return out


def make_leaf_model(path: Path) -> None:
    """A small real model in Leaf 0.2.1's format: a bare packed message of two segments, with no checksum."""
    import leafpy as lp
    net = lp.SequentialConfig(inputs=[("data", [2, 64])])
    net.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=64, bias=False)))
    net.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=3, bias=False)))
    layer = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("leaf", net), seed=0)
    layer.forward([np.ones((2, 64), np.float32)])
    layer.save(str(path), format="leaf")


def crafted_segment_tables(work: Path) -> list[Path]:
    """Packed messages whose segment tables promise more than the bytes hold (Cap'n Proto's packed reader trusts
    the table and, freed after an early end, ended the process), bare and inside a leafpy header whose checksum is
    right."""
    import struct
    import zlib
    cases = {"second-segment-missing": bytes.fromhex("11010601044004110d1200020178"),  # 2 segments, 1 present
             "table-cut-short": bytes.fromhex("110205"),  # 3 segments, the table's second word absent
             "600-segments": bytes.fromhex("3357020100"),
             "first-segment-short": bytes.fromhex("10ff0107"),  # 255 words declared, 1 present
             "run-past-the-end": bytes.fromhex("11010101010005")}  # 2 one-word segments, a zero run of 6 words
    out = []
    for name, packed in cases.items():
        bare = work / f"segments-{name}.leaf"
        bare.write_bytes(packed)
        header = struct.pack("<8sIIQQ", b"\x89LEAFPY\n", 2, 1, 16, len(packed))
        crc = zlib.crc32(packed, zlib.crc32(header)) & 0xFFFFFFFF
        sealed = work / f"segments-{name}-sealed.leaf"
        sealed.write_bytes(header + struct.pack("<I", crc) + packed)
        out += [bare, sealed]
    return out


def write_weights(path: Path, config, weights: list, struct: str = "Layer", into=None) -> None:
    """A leafpy file (valid header and checksum) whose Layer (or ``into``, a builder's Layer inside a
    ``struct`` message) holds these (name, array) weights as given: names may repeat, values be anything."""
    from leafpy import serialization as ser

    msg = into if into is not None else ser.model_message(config, {})
    layer = msg if struct == "Layer" else msg.network
    entries = layer.init("weightsData", len(weights))
    for entry, (name, arr) in zip(entries, weights):
        entry.name = name
        t = entry.init("tensor")
        t.shape = list(np.shape(arr))
        t.raw = np.ascontiguousarray(arr, dtype="<f4").tobytes()
    path.write_bytes(ser.encode(msg, struct))


def edited_checkpoint(good: Path, path: Path, trainer_state: dict | None = None, **fields) -> Path:
    """A copy of the checkpoint ``good`` with its trainer state (JSON, merged over the saved one) and message
    fields (``rngCalls=[...]``...) replaced, written with a valid header and checksum: what a hostile writer or a
    damaged program could leave."""
    from leafpy import serialization as ser

    msg = ser.editable_message(good, "SolverCheckpoint")
    if trainer_state is not None:
        saved = json.loads(str(msg.trainerState) or "{}")
        msg.trainerState = json.dumps({**saved, **trainer_state})
    for name, value in fields.items():
        setattr(msg, name, value)
    path.write_bytes(ser.encode(msg, "SolverCheckpoint"))
    return path


CRAFTED_TRAINER_STATES = {
    "epoch-null": {"epoch": None}, "epoch-text": {"epoch": "x"}, "epoch-nan": {"epoch": float("nan")},
    "epoch-negative": {"epoch": -3}, "loss-sum-text": {"loss_sum": "abc"},
    "more-correct-than-scored": {"correct": 8944665, "scored": 10000}, "sample-negative": {"sample": -1},
}
"""Trainer states a checkpoint must not be resumed from (each merged over a real one)."""


def crafted_checkpoints(work: Path) -> list[Path]:
    """Checkpoints with a valid checksum whose trainer state, random-layer state or weights are impossible."""
    good = work / "good-dropout-ckpt.leaf"
    make_checkpoint(good, dropout=True)
    out = [edited_checkpoint(good, work / f"ckpt-state-{name}.leaf", state)
           for name, state in CRAFTED_TRAINER_STATES.items()]
    out.append(edited_checkpoint(good, work / "ckpt-rng-calls-max.leaf", rngCalls=[2**64 - 1]))
    out.append(edited_checkpoint(good, work / "ckpt-rng-empty.leaf", rngCalls=[], rngSeeds=[]))
    from leafpy import serialization as ser

    msg = ser.editable_message(good, "SolverCheckpoint")
    weights = list(ser.read_weights(good)[0].items())
    write_weights(work / "ckpt-nan-weight.leaf", None, [(weights[0][0], weights[0][1] * np.nan)] + weights[1:],
                  "SolverCheckpoint", msg)
    out.append(work / "ckpt-nan-weight.leaf")
    return out


def crafted_model_weights(work: Path) -> list[Path]:
    """Model files with a valid checksum whose weights hold NaN or infinities, or name one weight twice."""
    import leafpy as lp

    layer = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("fc", lp.LinearConfig(output_size=3)), seed=0)
    layer.forward([np.ones((1, 4), np.float32)])
    w, b = layer.named_weights().values()
    cases = {"nan": [("fc/weight", np.where(np.eye(3, 4) > 0, np.nan, w)), ("fc/bias", b)],
             "inf": [("fc/weight", w), ("fc/bias", np.array([np.inf, 0, 0]))],
             "minus-inf": [("fc/weight", w * -np.inf), ("fc/bias", b)],
             "duplicate-name": [("fc/weight", w), ("fc/bias", b), ("fc/bias", b + 1)]}
    out = []
    for name, weights in cases.items():
        write_weights(work / f"model-{name}.leaf", layer.config, weights)
        out.append(work / f"model-{name}.leaf")
    return out


def npz_oddities(work: Path) -> list[Path]:
    """npz files of numbers leafpy cannot train on (times, dates, complex numbers, text, float64 values that float32
    turns to 0) or holding two datasets at once."""
    n = 6
    y = np.arange(n) % 2
    samples = {"timedelta": np.arange(n * 3).astype("timedelta64[s]").reshape(n, 3),
               "datetime": np.arange(n * 3).astype("datetime64[D]").reshape(n, 3),
               "complex": np.ones((n, 3), np.complex64), "text": np.array([["a", "b", "c"]] * n),
               "underflow": np.full((n, 3), 1e-320)}
    out = []
    for name, x in samples.items():
        p = work / f"npz-{name}.npz"
        np.savez(p, x=x, y=y)
        out.append(p)
    p = work / "npz-two-layouts.npz"
    x = np.ones((n, 3), np.float32)
    np.savez(p, x=x, y=y, x_train=x[:4], y_train=y[:4], x_test=x[4:], y_test=y[4:])
    out.append(p)
    return out


RUN_FILES = {
    "billion-laughs": "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi")),
    "deep-nesting": "network: " + "[" * 5000 + "]" * 5000 + "\n",
    "python-tag": "name: !!python/object/apply:os.system ['echo owned']\n",
    "huge-layer": None,  # filled from the shipped MLP
    "infinite-rate": None,
    "not-utf8": None,
    "digits-num-classes": None,  # settings the bundled digits dataset would ignore
    "digits-path": None,
}


def run_files(work: Path) -> list[Path]:
    mlp = (ROOT / "configs" / "digits_mlp.yaml").read_text()
    texts = dict(RUN_FILES)
    texts["huge-layer"] = mlp.replace("output_size: 128", "output_size: 1000000000000")
    texts["infinite-rate"] = mlp.replace("base_lr: 0.05", "base_lr: .inf")
    texts["digits-num-classes"] = mlp.replace("data: {dataset: digits,", "data: {dataset: digits, num_classes: 12,")
    texts["digits-path"] = mlp.replace("data: {dataset: digits,", "data: {dataset: digits, path: mine.npz,")
    out = []
    for name, text in texts.items():
        p = work / f"run-{name}.yaml"
        if name == "not-utf8":
            p.write_bytes(mlp.encode() + b"\nname: \xff\xfe\n")
        else:
            p.write_text(text)
        out.append(p)
    return out


def idx_files(work: Path) -> list[Path]:
    import gzip
    import struct

    good = struct.pack(">BBBB", 0, 0, 8, 3) + struct.pack(">III", 4, 28, 28) + bytes(4 * 784)
    cases = {"truncated": good[:500], "overflowing-header": struct.pack(">BBBB", 0, 0, 8, 3) +
             struct.pack(">III", 2**31, 2**31, 2**31), "bad-type": struct.pack(">BBBB", 0, 0, 0x42, 3) + good[4:],
             "too-many-dims": struct.pack(">BBBB", 0, 0, 8, 200) + good[4:]}
    out = []
    for name, data in cases.items():
        p = work / f"idx-{name}-idx3-ubyte"
        p.write_bytes(data)
        out.append(p)
    p = work / "idx-corrupt-gz-idx3-ubyte.gz"
    p.write_bytes(gzip.compress(good)[:-20] + b"\x00" * 20)
    out.append(p)
    return out


def npz_files(work: Path) -> list[Path]:
    import io
    import zipfile

    out = []
    p = work / "npz-pickled.npz"
    np.savez(p, x=np.array([{"a": 1}] * 4, dtype=object), y=np.zeros(4))
    out.append(p)
    p = work / "npz-nan-labels.npz"
    np.savez(p, x=np.ones((4, 3), np.float32), y=np.array([0, np.nan, 1, 0]))
    out.append(p)
    p = work / "npz-missing-keys.npz"
    np.savez(p, data=np.ones((4, 3)))
    out.append(p)
    p = work / "npz-broken-header.npz"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("x.npy", b"\x93NUMPY\x01\x00\x20\x00{'descr': '<f4', 'shape': (((((,}     \n")
        z.writestr("y.npy", b"\x93NUMPY\x01\x00")
    p.write_bytes(buf.getvalue())
    out.append(p)
    p = work / "npz-huge-shape.npz"
    buf = io.BytesIO()
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 1000000000), }"
    header += b" " * (63 - len(header) % 64) + b"\n"
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("x.npy", b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
        z.writestr("y.npy", b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header)
    p.write_bytes(buf.getvalue())
    out.append(p)
    return out


BOMB_SAMPLES = 10_000_000
"""The data bombs declare this many samples (and hold them: zeros, compressed or in a sparse file)."""


def _npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}"
    text += " " * (-(len(text) + 11) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode()


def _zeros_deflated(head: bytes, zeros: int, chunk: int = 1 << 24) -> tuple[bytes, int]:
    """A raw deflate stream of ``head`` then ``zeros`` zero bytes, and its CRC-32, made without compressing every
    chunk: after a full flush the compressor's output for the same input is the same."""
    import zlib

    z = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = bytes(chunk)
    first = z.compress(head) + z.flush(zlib.Z_FULL_FLUSH)
    repeat, rest = z.compress(block) + z.flush(zlib.Z_FULL_FLUSH), zeros % chunk
    tail = z.compress(bytes(rest)) + z.flush(zlib.Z_FINISH)
    crc = zlib.crc32(head)
    for _ in range(zeros // chunk):
        crc = zlib.crc32(block, crc)
    return first + repeat * (zeros // chunk) + tail, zlib.crc32(bytes(rest), crc)


def _zip_of_zeros(path: Path, members: dict[str, tuple[bytes, int]]) -> None:
    """A zip archive (as np.savez_compressed writes) of members ``name: (head, zero bytes after it)``."""
    import struct

    local, central = b"", b""
    for name, (head, zeros) in members.items():
        data, crc = _zeros_deflated(head, zeros)
        fields = (20, 0, 8, 0, 0x21, crc, len(data), len(head) + zeros, len(name), 0)
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, *fields, 0, 0, 0, 0, len(local)) + name.encode()
        local += struct.pack("<4s5H3L2H", b"PK\x03\x04", *fields) + name.encode() + data
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), len(local), 0)
    path.write_bytes(local + central + end)


def data_bombs(work: Path) -> dict[str, list[Path]]:
    """Small files that declare (and hold) more samples than a child limited to 1 GiB can load: an npz of 10
    million 8x8 images (0.6 MB), a gzipped IDX of 5 million 28x28 images (4 MB) and a sparse 3.9 GB IDX. Each must
    be refused before its arrays are allocated, with what they need and what is available."""
    import gzip
    import os
    import struct

    npz = work / "bomb-images.npz"
    _zip_of_zeros(npz, {"x.npy": (_npy_header("|u1", (BOMB_SAMPLES, 1, 8, 8)), BOMB_SAMPLES * 64),
                        "y.npy": (_npy_header("|u1", (BOMB_SAMPLES,)), BOMB_SAMPLES)})
    head = struct.pack(">BBBB", 0, 0, 8, 3) + struct.pack(">III", BOMB_SAMPLES // 2, 28, 28)
    chunk = bytes(16_000_000)  # the image bytes are 245 such chunks
    gz = work / "bomb-idx3-ubyte.gz"
    gz.write_bytes(gzip.compress(head + chunk, 9) + gzip.compress(chunk, 9) * 244)
    sparse = work / "bomb-sparse-idx3-ubyte"
    sparse.write_bytes(head)
    os.truncate(sparse, len(head) + BOMB_SAMPLES // 2 * 784)
    return {"npz data bomb": [npz], "IDX data bomb": [gz, sparse]}


LOADER.update({"npz data bomb": "npz", "IDX data bomb": "idx"})


def _onnx_model(**change):
    """A small valid ONNX model (Conv -> Relu -> Flatten -> Gemm), its parts replaceable by keyword."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    parts = dict(
        inits=[numpy_helper.from_array(rng.normal(size=s).astype(np.float32), n)
               for n, s in (("w", (2, 1, 3, 3)), ("b", (2,)), ("fc", (3, 32)))],
        nodes=[helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[3, 3]),
               helper.make_node("Relu", ["c"], ["r"], name="relu"),
               helper.make_node("Flatten", ["r"], ["f"], name="flat"),
               helper.make_node("Gemm", ["f", "fc"], ["y"], name="fc", transB=1)],
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 6, 6])],
        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        opset=[helper.make_opsetid("", 17)])
    parts.update(change)
    graph = helper.make_graph(parts["nodes"], "g", parts["inputs"], parts["outputs"], parts["inits"])
    return helper.make_model(graph, opset_imports=parts["opset"])


def onnx_files(work: Path, rng: np.random.Generator, n: int) -> dict[str, list[Path]]:
    """ONNX models cut short and crafted (external data, sizes beyond the data, subgraphs, cycles, huge shapes).
    Byte flips are left out: ONNX files carry no checksum, so a flipped weight is another valid model."""
    try:
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:  # the ONNX classes need the onnx package; test_hostile says so
        return {}
    data = _onnx_model().SerializeToString()
    cuts = []
    for k, off in enumerate(sorted(set(rng.integers(0, len(data), n).tolist()))):
        p = work / f"onnx-trunc{k}.onnx"
        p.write_bytes(data[:off])
        cuts.append(p)
    big = _onnx_model()
    big.graph.initializer[2].dims[:] = [10**6, 10**6]
    negative = _onnx_model()
    negative.graph.initializer[1].dims[:] = [-2]
    unknown_type = _onnx_model()
    unknown_type.graph.initializer[1].data_type = 999
    external = _onnx_model()
    t = external.graph.initializer[0]
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value="../../etc/passwd")
    sub = helper.make_graph([helper.make_node("Relu", ["x"], ["z"])], "then", [],
                            [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    branch = _onnx_model(nodes=[helper.make_node("If", ["x"], ["y"], name="if", then_branch=sub, else_branch=sub)])
    cycle = _onnx_model(nodes=[helper.make_node("Relu", ["y"], ["y"], name="self")])
    huge_input = _onnx_model(inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 10**6, 10**6])])
    symbolic = _onnx_model(inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, "H", 6])])
    kernel = _onnx_model()
    kernel.graph.node[0].attribute[0].ints[:] = [1000, 1000]
    huge_reshape = _onnx_model(nodes=[helper.make_node("Reshape", ["x", "s"], ["y"], name="r")],
                               inits=[numpy_helper.from_array(np.array([0, 2**62, 2**62], np.int64), "s")])
    crafted = {"big-tensor": big, "negative-dim": negative, "unknown-type": unknown_type, "external": external,
               "subgraph": branch, "cycle": cycle, "huge-input": huge_input, "symbolic": symbolic,
               "kernel": kernel, "huge-reshape": huge_reshape, "no-opset": _onnx_model(opset=[])}
    out = []
    for name, model in crafted.items():
        p = work / f"onnx-{name}.onnx"
        p.write_bytes(model.SerializeToString())
        out.append(p)
    for name, raw in (("empty", b""), ("noise", rng.bytes(512)), ("text", b"ir_version: 8\ngraph {}")):
        p = work / f"onnx-{name}.onnx"
        p.write_bytes(raw)
        out.append(p)
    return {"ONNX truncation": cuts, "ONNX crafted": out}


def generate(work: Path, seed: int = 0, n: int = 20) -> dict[str, list[Path]]:
    """Seeded cases per class (the damaged-file classes sample n offsets; the crafted ones are fixed)."""
    good = work / "good.leaf"
    make_model(good)
    rng = np.random.default_rng(seed)
    cases: dict[str, list[Path]] = {}
    cases["model truncation"], cases["model byte flip"] = _damaged(work, good.read_bytes(), "model", rng, n)
    ckpt = work / "good-ckpt.leaf"
    make_checkpoint(ckpt)
    cases["checkpoint truncation"], cases["checkpoint byte flip"] = _damaged(work, ckpt.read_bytes(), "ckpt", rng, n)
    cases["crafted message"] = crafted_messages(work)
    leaf = work / "good-leaf.leaf"
    make_leaf_model(leaf)
    cuts, flips = _damaged(work, leaf.read_bytes(), "leaf", rng, n)
    cases["Leaf model damage"] = cuts + flips
    cases["crafted segment table"] = crafted_segment_tables(work)
    cases["run file"] = run_files(work)
    cases["IDX file"] = idx_files(work)
    cases["npz file"] = npz_files(work)
    cases.update(data_bombs(work))
    cases["crafted model weights"] = crafted_model_weights(work)
    cases["crafted checkpoint state"] = crafted_checkpoints(work)
    cases["npz oddity"] = npz_oddities(work)
    cases.update(onnx_files(work, rng, n))
    return cases


def run_batch(paths: list[Path], loader: str = "model") -> dict[str, str]:
    """Open every path in one child; a crash, hang or memory kill marks every path of the batch."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    arg = json.dumps([str(p) for p in paths])
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, arg, loader], capture_output=True, text=True,
                           timeout=TIMEOUT_S, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {str(p): "hang" for p in paths}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    kind = "signal" if r.returncode < 0 else ("memory" if "MemoryError" in r.stderr else "raw exception")
    return {str(p): kind for p in paths}


def run(seed: int = 0, n: int = 20) -> dict[str, Counter]:
    with tempfile.TemporaryDirectory() as d:
        cases = generate(Path(d), seed, n)
        return {cls: Counter(v.split(":")[0] for v in run_batch(paths, LOADER[cls]).values())
                for cls, paths in cases.items()}


def table(result: dict[str, Counter]) -> str:
    kinds = ["clear error", "raw exception", "signal", "hang", "memory", "silently accepted"]
    rows = ["| class | cases | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 2) + "|"]
    for cls, c in result.items():
        rows.append(f"| {cls} | {sum(c.values())} | " + " | ".join(str(c.get(k, 0)) for k in kinds) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--full", action="store_true", help="200 cases per class")
    ap.add_argument("--table", action="store_true")
    a = ap.parse_args()
    print(table(run(a.seed, 200 if a.full else a.n)))
