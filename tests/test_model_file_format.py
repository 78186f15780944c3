"""leafpy's model file format 2: the weights in a raw section after the message, written from the arrays' own
buffers and read back as views of the one buffer the file is read into; files of format 1 (the weights inside the
message) still load and mean the same; the memory a save and a load take, measured in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env

import leafpy as lp
from leafpy import serialization as ser

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"


def _mlp(width: int, depth: int) -> lp.LayerConfig:
    cfg = lp.SequentialConfig(inputs=[("data", [1, width])])
    for i in range(depth):
        cfg.add_layer(lp.LayerConfig(f"fc{i}", lp.LinearConfig(output_size=width)))
    return lp.LayerConfig("mlp", cfg)


def test_a_model_file_of_format_1_loads_and_computes_what_it_did():
    """tests/data/v1_model.leaf was written by the leafpy before format 2 (make_v1_model_fixture.py)."""
    expected = np.load(DATA / "v1_model.npz")
    header = ser._HEADER.unpack_from((DATA / "v1_model.leaf").read_bytes())
    assert header[1] == 1  # the fixture is of format 1
    net = lp.Layer.load(lp.backend("native"), str(DATA / "v1_model.leaf"))
    for name, w in net.named_weights().items():
        np.testing.assert_array_equal(w, expected[name.replace("/", "__")])
    np.testing.assert_allclose(net.forward([expected["x"]])[0].to_numpy(), expected["out"], rtol=1e-6, atol=1e-6)


def test_a_saved_model_keeps_its_weights_after_the_message_aligned_and_raw(tmp_path):
    net = lp.Layer.from_config(lp.backend("native"), _mlp(40, 2), seed=1)
    path = tmp_path / "m.leaf"
    net.save(str(path))
    data = path.read_bytes()
    _, version, _, _, length, _ = ser._HEADER.unpack_from(data)
    assert version == ser.FORMAT_VERSION == 2
    start = ser._raw_start(length)
    assert start % ser.RAW_ALIGN == 0
    msg = ser.schema().Layer.from_bytes_packed(data[ser._HEADER.size:ser._HEADER.size + length])
    for w in msg.weightsData:
        assert len(w.tensor.raw) == 0 and len(w.tensor.data) == 0 and w.tensor.offset % ser.RAW_ALIGN == 0
        values = np.frombuffer(data, "<f4", count=int(np.prod(list(w.tensor.shape))), offset=start + w.tensor.offset)
        np.testing.assert_array_equal(values, net.named_weights()[w.name].reshape(-1))
    loaded = lp.Layer.load(lp.backend("native"), str(path))
    for a, b in zip(net.named_weights().values(), loaded.named_weights().values()):
        np.testing.assert_array_equal(a, b)


def _crafted(tmp_path: Path, edit) -> Path:  # noqa: ANN001
    """A saved model whose message ``edit`` changed, written back with its raw section and a valid checksum."""
    net = lp.Layer.from_config(lp.backend("native"), _mlp(8, 1), seed=0)
    good = tmp_path / "good.leaf"
    net.save(str(good))
    msg, _, raw = ser._read_parts(str(good), "Layer")
    builder = msg.as_builder()
    edit(builder)
    section = ser._RawSection()
    section.chunks, section.size = [bytes(raw)], len(raw)
    path = tmp_path / "crafted.leaf"
    path.write_bytes(b"".join(ser._encode_parts(builder, "Layer", section)))
    return path


@pytest.mark.parametrize("offset", [2**62, 128, 2**64 - 1])
def test_a_weight_placed_past_the_raw_section_is_refused(tmp_path, offset):
    def edit(m):  # noqa: ANN001, ANN202
        m.weightsData[0].tensor.offset = offset

    path = _crafted(tmp_path, edit)
    with pytest.raises(lp.SerializationError, match=r"crafted.leaf: weight 'fc0/weight' holds 64 values from byte"):
        lp.Layer.load(lp.backend("native"), str(path))


def test_a_cut_raw_section_is_refused(tmp_path):
    net = lp.Layer.from_config(lp.backend("native"), _mlp(8, 1), seed=0)
    path = tmp_path / "m.leaf"
    net.save(str(path))
    data = path.read_bytes()
    length = ser._HEADER.unpack_from(data)[4]
    for cut in (ser._raw_start(length) - 1, ser._raw_start(length) + 4, len(data) - 4):
        path.write_bytes(data[:cut])
        with pytest.raises(lp.SerializationError, match="truncated|checksum"):
            lp.Layer.load(lp.backend("native"), str(path))


CHILD = """
import json, os, resource, sys
import leafpy as lp
from leafpy import serialization
serialization.schema()
be = lp.backend("native")
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if sys.argv[1] == "save":
    cfg = lp.SequentialConfig(inputs=[("data", [1, 2048])])
    for i in range(2):
        cfg.add_layer(lp.LayerConfig(f"fc{i}", lp.LinearConfig(output_size=2048)))
    net = lp.Layer.from_config(be, lp.LayerConfig("mlp", cfg), seed=0)
    before = peak()
    net.save(sys.argv[2])
else:
    before = peak()
    net = lp.Layer.load(be, sys.argv[2])
print(json.dumps({"above": peak() - before, "weights": 4 * net.num_parameters()}))
"""


def _peak_above(phase: str, path: Path) -> dict:
    env = child_env()
    out = subprocess.run([sys.executable, "-c", CHILD, phase, str(path)], capture_output=True, text=True, env=env,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_saving_and_loading_an_8m_weight_model_take_at_most_the_file_and_one_copy(tmp_path):
    """Saving writes the weights from their buffers (no copy of them in memory); loading holds the file once and
    the network's weights once, nothing more (before format 2: the packed file, the unpacked message, each
    weight's bytes and a float64 draw of its initial values besides)."""
    path = tmp_path / "m.leaf"
    save = _peak_above("save", path)
    size = path.stat().st_size
    assert size >= save["weights"] > 32e6
    slack = 8 * 2**20  # the allocator, the message, small arrays
    assert save["above"] <= slack, save
    load = _peak_above("load", path)
    assert load["above"] <= size + load["weights"] + slack, (load, size)


ROUND_TRIP_CHILD = """
import gc, hashlib, json, resource, sys, time, tracemalloc
import leafpy as lp
from leafpy import serialization
serialization.schema()
be = lp.backend("native")
path = sys.argv[2]
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def digest(net):
    h = hashlib.sha256()
    for name, w in net.named_weights().items():
        h.update(name.encode() + str(w.shape).encode() + w.dtype.str.encode())
        h.update(memoryview(w))
    return h.hexdigest()
if sys.argv[1] == "save":
    cfg = lp.SequentialConfig(inputs=[("data", [1, 5000])])
    for i in range(2):
        cfg.add_layer(lp.LayerConfig(f"fc{i}", lp.LinearConfig(output_size=5000)))
    net = lp.Layer.from_config(be, lp.LayerConfig("mlp", cfg), seed=3)
    before = peak()
    tracemalloc.start()
    net.save(path)
else:
    before = peak()
    tracemalloc.start()
    net = lp.Layer.load(be, path)
heap = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
above = peak() - before
gc.collect()
with open("/proc/self/maps") as f:
    still_mapped = path in f.read()
print(json.dumps({"above": above, "heap": heap, "weights": 4 * net.num_parameters(), "digest": digest(net),
                  "still_mapped": still_mapped}))
"""


def _child(phase: str, path: Path) -> dict:
    env = child_env()
    out = subprocess.run([sys.executable, "-c", ROUND_TRIP_CHILD, phase, str(path)], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings in /proc (Linux)")
def test_a_200_mb_model_loads_from_its_mapped_file_into_one_copy_and_round_trips_exactly(tmp_path):
    """Loading maps the file and copies each weight once, into the network: the process's own memory (what
    tracemalloc sees: NumPy's and Python's allocations) grows by the weights alone, never by a copy of the file
    (before: the file read whole into a buffer, then copied into the network: the file's size more); the resident
    peak stays within the file (its mapped pages) and one copy of the weights; nothing of the file stays mapped
    once the network is built. Saving writes from the weights' buffers (no copy), and the loaded weights are the
    saved ones bit for bit (a digest of names, shapes and bytes: stored float32 values come back exactly)."""
    path = tmp_path / "big.leaf"
    save = _child("save", path)
    size = path.stat().st_size
    assert size >= save["weights"] > 190e6
    slack = 8 * 2**20  # the allocator, the message, small arrays
    assert save["heap"] <= slack and save["above"] <= slack, save
    load = _child("load", path)
    assert load["digest"] == save["digest"]
    assert load["heap"] <= load["weights"] + slack, (load, size)
    assert load["above"] <= size + load["weights"] + slack, (load, size)
    assert not load["still_mapped"]


def _flipped(tmp_path: Path, where: str) -> Path:
    """A saved model of about 8 MB (its checksum computed beside the reading) with one byte changed ``where``:
    in the message or deep in the raw section."""
    net = lp.Layer.from_config(lp.backend("native"), _mlp(1024, 2), seed=0)
    path = tmp_path / f"{where}.leaf"
    net.save(str(path))
    data = bytearray(path.read_bytes())
    assert len(data) > ser.THREADED_CHECKSUM
    length = ser._HEADER.unpack_from(data)[4]
    at = ser._HEADER.size + length // 2 if where == "message" else (ser._raw_start(length) + len(data)) // 2
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("where", ["message", "raw"])
def test_a_large_file_with_one_byte_changed_is_refused_by_its_checksum(tmp_path, where):
    """The checksum of a large file is computed while its weights are copied into the network; a changed byte
    still makes the load fail with the checksum's verdict (not with what the changed message made go wrong), and
    no network comes back."""
    path = _flipped(tmp_path, where)
    with pytest.raises(lp.SerializationError, match=f"{where}.leaf: checksum mismatch: the file is corrupted"):
        lp.Layer.load(lp.backend("native"), str(path))
    with pytest.raises(lp.SerializationError, match="checksum mismatch"):
        ser.read_model(str(path))


def test_a_file_that_cannot_be_mapped_is_read_instead(tmp_path, monkeypatch):
    """Some file systems (network, FUSE) refuse to map files: the model is then read whole, and loads the same."""
    import mmap

    net = lp.Layer.from_config(lp.backend("native"), _mlp(40, 2), seed=1)
    path = tmp_path / "m.leaf"
    net.save(str(path))

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError(19, "No such device")

    monkeypatch.setattr(mmap, "mmap", refuse)
    loaded = lp.Layer.load(lp.backend("native"), str(path))
    for a, b in zip(net.named_weights().values(), loaded.named_weights().values()):
        np.testing.assert_array_equal(a, b)  # stored float32 values come back bit for bit


def test_isal_computes_the_checksum_zlib_does():
    """With ISA-L installed (python-isal, a dependency) files are checked with its CRC-32: the same values as
    zlib's, so files written with one load with the other."""
    import zlib

    isal_zlib = pytest.importorskip("isal.isal_zlib", reason="python-isal (a dependency) is not installed")
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    assert isal_zlib.crc32(data, 7) == zlib.crc32(data, 7)
    assert ser.fileformat._checksum(data[:36], [data[36:]]) == zlib.crc32(data) & 0xFFFFFFFF


_NEWER: list = []


def _newer_schema(tmp_path: Path):
    """leafpy's schema as a newer leafpy might grow it (another file id, so both load side by side): one more layer
    type at the end of the LayerConfig union, one more pooling mode. Loaded once per process (capnp aborts the
    process when a file id it holds is loaded again from another path)."""
    import re

    import capnp

    if _NEWER:
        return _NEWER[0]
    src = (Path(lp.__file__).parent / "leaf.capnp").read_text()
    src = re.sub(r"^@0x[0-9a-f]+;", "@0xd316e0f30c445925;", src, count=1, flags=re.M)
    start = src.index("layerType :union {")
    end = src.index("\n  }", start)
    last = max(int(n) for n in re.findall(r"@(\d+)", src[start:end]))
    src = src[:end] + f"\n    newLayer @{last + 1} :Void;" + src[end:]
    src = src.replace("  average @1;", "  average @1;\n  lp @2;", 1)
    (tmp_path / "newer.capnp").write_text(src)
    _NEWER.append(capnp.load(str(tmp_path / "newer.capnp")))
    return _NEWER[0]


@pytest.mark.parametrize("what,says", [("layer", "config.layers[0] (layer 'x'): a layer type this leafpy does not "
                                                 "know"),
                                       ("enum", "config.layers[0] (layer 'x').mode: a value this leafpy does not "
                                                "know")])
def test_a_file_of_a_newer_schema_is_refused_as_one(tmp_path, what, says):
    """A model from a leafpy whose schema grew (a layer type, a pooling mode this one lacks), in the same file
    format: refused naming the layer and the fix (upgrade), not as a malformed file that might be a checkpoint."""
    newer = _newer_schema(tmp_path)
    msg = newer.Layer.new_message(name="net")
    cfg = msg.init("config")
    cfg.name = "net"
    seq = cfg.layerType.init("sequential")
    inputs = seq.init("inputs", 1)
    inputs[0].name, inputs[0].shape = "data", [1, 1, 4, 4]
    layer = seq.init("layers", 1)[0]
    layer.name = "x"
    if what == "layer":
        layer.layerType.newLayer = None
    else:
        pooling = layer.layerType.init("pooling")
        pooling.mode, pooling.filterShape, pooling.stride = "lp", [2], [2]
    path = tmp_path / f"{what}.leaf"
    path.write_bytes(ser.encode(msg, "Layer"))
    with pytest.raises(lp.SerializationError) as e:
        lp.Layer.load(lp.backend("native"), str(path))
    assert str(e.value).startswith(f"{path}: {says}") and "upgrade leafpy" in str(e.value), str(e.value)
    assert "checkpoint" not in str(e.value)
