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
from conftest import child_env

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
    env = child_env()
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
    ("{'descr': '''<f8', 'fortran_order': False, 'shape': (3, 2), }", "x is not a readable .npy array"),
    ("{'descr': '<f8', 'fortran_order': False, 'shape': (3, 2), ", "x is not a readable .npy array"),
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


# --- data that does not fit in memory -----------------------------------------------------------------------------
def _limited_address_space() -> None:
    """The child's address space limited to 1 GiB, as `ulimit -v 1048576` does."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="limits the child's address space (RLIMIT_AS)")
def test_training_on_more_data_than_memory_holds_says_what_it_needs_before_allocating(tmp_path):
    """`leafpy train` on a 0.6 MB npz declaring 10 million 8x8 images (2.6 GB as float32), in a shell limited to
    1 GiB: one clear error naming the file, the declared shape, the bytes needed and available and the fix.
    (Before: a MemoryError traceback, after reading 640 MB.)"""
    from tests.hostile import corpus

    bomb = corpus.data_bombs(tmp_path)["npz data bomb"][0]
    env = child_env()
    p = subprocess.run([sys.executable, "-m", "leafpy", "train", "digits_mlp", "--set", "data.dataset=npz", "--set",
                        f"data.path={bomb}", "--out", str(tmp_path / "out")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60, preexec_fn=_limited_address_space)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    for words in (str(bomb), "x [10000000, 1, 8, 8] of uint8", "needs about", "available",
                  "use a smaller subset of the data or a memory-mapped dataset"):
        assert words in p.stderr, (words, p.stderr)


def sparse_idx(path: Path, dims) -> None:
    """An IDX file of zeros declaring ``dims``, sparse on disk (its data is a hole)."""
    with open(path, "wb") as f:
        f.write(idx_bytes(dims, b""))
        f.truncate(4 + 4 * len(dims) + int(np.prod(dims)))


@pytest.mark.parametrize("available,fits", [(16 << 30, True), (3 << 30, True), (1 << 30, False)])
def test_mnist_files_load_as_far_as_the_memory_available_holds(tmp_path, monkeypatch, available, fits):
    """A legitimate 400 MB training image file (510,000 28x28 images: 1.6 GB as float32), the memory available
    given: with 16 or 3 GiB it is read; with 1 GiB it is refused before anything is read, naming the files' shapes,
    the bytes needed (the bytes read plus the float32 images and int64 labels) and those available. (Before, a fixed
    cap of 4 GiB per file decided: files under it failed with a MemoryError when the float32 copy did not fit.)"""
    write_mnist(tmp_path)
    sparse_idx(tmp_path / NAMES["train_x"], (510_000, 28, 28))
    sparse_idx(tmp_path / NAMES["train_y"], (510_000,))
    monkeypatch.setattr(lp.data, "available_memory", lambda: available)
    read: list[str] = []

    class Read(Exception):
        pass

    def read_idx(path):
        read.append(path)
        raise Read  # the files passed the check: reading them is not this test's business

    monkeypatch.setattr(lp.data, "read_idx", read_idx)
    if fits:
        with pytest.raises(Read):
            lp.data.load({"dataset": "mnist", "path": str(tmp_path)})
        return
    msg = mnist_error(tmp_path)
    need = (510_000 + 5) * 785 + 4 * (510_000 + 5) * 784 + 8 * (510_000 + 5)
    assert not read
    for words in (str(tmp_path), "train-images-idx3-ubyte [510000, 28, 28]", f"{need:,} bytes", f"{1 << 30:,} bytes",
                  "memory-mapped dataset"):
        assert words in msg, (words, msg)


def test_an_npz_is_refused_when_its_arrays_would_not_fit_and_read_when_they_would(tmp_path, monkeypatch):
    """The npz reader bounds itself by the memory available too, from the .npy headers alone: 1,000 float64 samples
    of 100 values (0.8 MB as read, 0.4 MB as float32, twice over for a random split) and their labels."""
    path = tmp_path / "d.npz"
    np.savez(path, x=np.ones((1000, 100)), y=np.zeros(1000, np.int64))
    need = 1000 * 100 * 8 + 1000 * 8 + 2 * (1000 * 100 * 4 + 1000 * 8)
    monkeypatch.setattr(lp.data, "available_memory", lambda: need)  # 90% of it may be taken: not enough
    with pytest.raises(lp.LeafpyError, match=f"needs about {need:,} bytes") as info:
        lp.data.npz(str(path))
    assert "x [1000, 100] of float64, y [1000] of int64" in str(info.value)
    monkeypatch.setattr(lp.data, "available_memory", lambda: 2 * need)
    assert lp.data.npz(str(path)).x_train.shape == (800, 100)
