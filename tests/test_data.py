"""Datasets and batching: digits, MNIST-format IDX files (gzipped or not), deterministic batches."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

import leafpy as lp


def write_idx(path, array, gz=False):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def make_mnist(directory, gz):
    rng = np.random.default_rng(0)
    files = {"train-images-idx3-ubyte": rng.integers(0, 256, (12, 28, 28)),
             "train-labels-idx1-ubyte": rng.integers(0, 10, 12),
             "t10k-images-idx3-ubyte": rng.integers(0, 256, (5, 28, 28)),
             "t10k-labels-idx1-ubyte": rng.integers(0, 10, 5)}
    for name, arr in files.items():
        write_idx(directory / name, arr, gz)
    return files


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_files(tmp_path, gz):
    files = make_mnist(tmp_path, gz)
    ds = lp.data.mnist(str(tmp_path))
    assert ds.x_train.shape == (12, 1, 28, 28) and ds.x_test.shape == (5, 1, 28, 28)
    assert ds.x_train.dtype == np.float32 and ds.x_train.max() <= 1.0
    np.testing.assert_allclose(ds.x_train[3, 0], files["train-images-idx3-ubyte"][3] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.y_test, files["t10k-labels-idx1-ubyte"])
    via_spec = lp.data.load({"dataset": "fashion_mnist", "path": str(tmp_path)})
    assert via_spec.name == "fashion_mnist" and len(via_spec.x_train) == 12


def test_missing_mnist_files_say_what_to_put_where(tmp_path):
    make_mnist(tmp_path, False)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(lp.LeafpyError) as e:
        lp.data.mnist(str(tmp_path))
    assert "t10k-labels-idx1-ubyte" in str(e.value) and str(tmp_path) in str(e.value)
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03" + b"\x00" * 10)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x05" + b"\x01" * 5)
    with pytest.raises(lp.SerializationError, match="IDX header"):
        lp.data.mnist(str(tmp_path))


def test_digits_dataset():
    ds = lp.data.digits(test_fraction=0.2, seed=0)
    assert ds.x_train.shape[1:] == (1, 8, 8) and len(ds.x_train) + len(ds.x_test) == 1797
    assert len(ds.x_test) == 359 and 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
    again = lp.data.digits(test_fraction=0.2, seed=0)
    np.testing.assert_array_equal(ds.y_test, again.y_test)
    other = lp.data.digits(test_fraction=0.2, seed=1)
    assert not np.array_equal(ds.y_test, other.y_test)


def test_batches_are_deterministic_and_keep_the_last_partial_batch():
    x = np.arange(10).reshape(10, 1)
    y = np.arange(10)
    b1 = list(lp.data.batches(x, y, 4, seed=3, epoch=0))
    b2 = list(lp.data.batches(x, y, 4, seed=3, epoch=0))
    assert [len(b[0]) for b in b1] == [4, 4, 2]
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(b1, b2))
    assert sorted(np.concatenate([b[1] for b in b1])) == list(range(10))
    b3 = list(lp.data.batches(x, y, 4, seed=3, epoch=1))
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(b1, b3))
    assert [list(b[1]) for b in lp.data.batches(x, y, 6, seed=None)] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    with pytest.raises(lp.ConfigError):
        list(lp.data.batches(x, y, 0))
