"""Dataset files that are damaged, mismatched or not files at all, written by hand (struct, gzip, zipfile): each
is a LeafpyError naming the file and the fix, raised without reading more than the file declares and without
waiting on a FIFO."""

from __future__ import annotations

import gzip
import io
import os
import struct
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

import leafpy as lp

ROOT = Path(__file__).resolve().parent.parent
NAMES = {"train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte",
         "test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte"}


def idx_bytes(dims, data: bytes) -> bytes:
    return bytes([0, 0, 0x08, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + data


def write_mnist(directory: Path, train=(12, 28, 28), test=(5, 28, 28), train_labels=12, test_labels=5, gz=False):
    rng = np.random.default_rng(0)
    arrays = {"train_x": rng.integers(0, 256, train), "test_x": rng.integers(0, 256, test),
              "train_y": rng.integers(0, 10, train_labels), "test_y": rng.integers(0, 10, test_labels)}
    for key, a in arrays.items():
        data = idx_bytes(a.shape, a.astype(np.uint8).tobytes())
        if gz:
            (directory / (NAMES[key] + ".gz")).write_bytes(gzip.compress(data))
        else:
            (directory / NAMES[key]).write_bytes(data)
    return arrays


def mnist_error(directory, **kw) -> str:
    with pytest.raises(lp.LeafpyError) as info:
        lp.data.load({"dataset": "mnist", "path": str(directory)}, **kw)
    return str(info.value)


@pytest.mark.parametrize("shape", [(12, 14, 56), (12, 20, 20)])
def test_images_of_another_size_than_the_network_input_are_refused(tmp_path, shape):
    write_mnist(tmp_path, train=shape, test=(5,) + shape[1:])
    msg = mnist_error(tmp_path, input_shape=(1, 28, 28))
    assert NAMES["train_x"] in msg and f"{shape[1]}x{shape[2]}" in msg and "[1, 28, 28]" in msg
    ds = lp.data.load({"dataset": "mnist", "path": str(tmp_path)}, input_shape=(1,) + shape[1:])
    assert ds.x_train.shape == (12, 1) + shape[1:]


def test_four_times_as_many_small_images_are_not_read_as_mnist(tmp_path):
    write_mnist(tmp_path, train=(48, 14, 14), test=(20, 14, 14), train_labels=48, test_labels=20)
    assert "14x14" in mnist_error(tmp_path, input_shape=(1, 28, 28))


def test_leafpy_train_names_the_image_file_whose_size_differs(tmp_path):
    write_mnist(tmp_path, train=(12, 14, 56), test=(5, 14, 56))
    run = (ROOT / "configs" / "mnist_lenet.yaml").read_text()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    p = subprocess.run([sys.executable, "-m", "leafpy.cli", "train", str(ROOT / "configs" / "mnist_lenet.yaml"),
                        "--set", f"data.path={tmp_path}", "--out", str(tmp_path / "out"), "--epochs", "1"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert "mnist" in run and p.returncode == 1, p.stderr
    assert NAMES["train_x"] in p.stderr and "14x56" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("labels", [11, 13])
def test_fewer_or_more_labels_than_images_are_refused(tmp_path, labels):
    write_mnist(tmp_path, train_labels=labels)
    msg = mnist_error(tmp_path)
    assert NAMES["train_y"] in msg and "one label per image" in msg and f"({labels},)" in msg


def test_a_header_whose_dimensions_multiply_past_any_memory_is_refused_before_reading(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / NAMES["train_x"]).write_bytes(idx_bytes((2**32 - 1,) * 3, b"\x00" * 64))
    msg = mnist_error(tmp_path)
    assert NAMES["train_x"] in msg and "declares shape" in msg


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_gzip_file_is_a_serialization_error(tmp_path, damage):
    write_mnist(tmp_path, gz=True)
    path = tmp_path / (NAMES["train_x"] + ".gz")
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        for i in range(20, len(blob) - 8, 7):
            blob[i] ^= 0xFF
    else:
        blob = blob[: len(blob) // 2]
    path.write_bytes(bytes(blob))
    with pytest.raises(lp.SerializationError) as info:
        lp.data.load({"dataset": "mnist", "path": str(tmp_path)})
    assert str(path) in str(info.value) and "download it again" in str(info.value)


def npz_with_member(path: Path, name: str, member: bytes, **arrays) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(name, member)
        for key, a in arrays.items():
            buf = io.BytesIO()
            np.save(buf, a)
            z.writestr(key + ".npy", buf.getvalue())


def npy(header: str, data: bytes = b"") -> bytes:
    text = header + " " * (-(len(header) + 11) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1") + data


@pytest.mark.parametrize("header,match", [
    ("{'descr': '''<f8', 'fortran_order': False, 'shape': (3, 2), }", "not a readable NumPy .npz file"),
    ("{'descr': '<f8', 'fortran_order': False, 'shape': (3, 2), ", "not a readable NumPy .npz file"),
    ("{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000000, 1000000), }", r"declares shape"),
])
def test_an_npz_whose_npy_header_is_broken_or_oversized_is_a_serialization_error(tmp_path, header, match):
    path = tmp_path / "d.npz"
    npz_with_member(path, "x.npy", npy(header, b"\x00" * 48), y=np.zeros(3))
    with pytest.raises(lp.SerializationError, match=match) as info:
        lp.data.npz(str(path))
    assert str(path) in str(info.value)


def test_an_empty_training_split_is_refused(tmp_path):
    path = tmp_path / "one.npz"
    np.savez(path, x=np.zeros((1, 4), np.float32), y=np.zeros(1))
    with pytest.raises(lp.ConfigError, match=r"data\.test_fraction: one\.npz has 1 sample.*none to train on"):
        lp.data.load({"dataset": "npz", "path": str(path), "test_fraction": 0.2})
    np.savez(path, x=np.zeros((10, 4), np.float32), y=np.zeros(10))
    assert len(lp.data.npz(str(path), test_fraction=0.2).x_train) == 8


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo (POSIX)")
@pytest.mark.parametrize("dataset", ["npz", "mnist"])
def test_a_fifo_as_dataset_file_is_refused_without_waiting(tmp_path, dataset):
    if dataset == "npz":
        fifo = tmp_path / "data.npz"
        spec = {"dataset": "npz", "path": str(fifo)}
    else:
        write_mnist(tmp_path)
        fifo = tmp_path / NAMES["train_x"]
        fifo.unlink()
        spec = {"dataset": "mnist", "path": str(tmp_path)}
    os.mkfifo(fifo)
    errors: list = []

    def load():
        try:
            lp.data.load(spec)
        except lp.LeafpyError as e:
            errors.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():
        with open(fifo, "wb"):  # let the blocked reader go
            pass
        t.join(5)
        pytest.fail("reading the dataset blocked on a FIFO")
    assert errors and "FIFO" in str(errors[0]) and str(fifo) in str(errors[0])


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_as_dataset_file_is_refused():
    errors: list = []

    def load():
        try:
            lp.data.load({"dataset": "npz", "path": "/dev/zero"})
        except lp.LeafpyError as e:
            errors.append(e)

    t = threading.Thread(target=load, daemon=True)  # reading /dev/zero never ends: the test must not wait on it
    t.start()
    t.join(5)
    assert not t.is_alive(), "reading the dataset did not stop on a device"
    assert errors and "/dev/zero: a device, not a regular file" in str(errors[0])
