"""Datasets and batching: digits, MNIST-format IDX files (gzipped or not), deterministic batches."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

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


def _digits_as_scikit_learn_gives_them(test_fraction=0.2, seed=0):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    return x[order[n_test:]], d.target[order[n_test:]], x[order[:n_test]], d.target[order[:n_test]]


def test_digits_are_scikit_learns_read_without_importing_it_and_through_it_where_its_file_is_not_as_expected(
        tmp_path, monkeypatch):
    import subprocess
    import sys

    from conftest import child_env
    probe = ("import sys, leafpy as lp; ds = lp.data.digits(); print(len(ds.x_train), len(ds.x_test), "
             "'sklearn' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=child_env(), timeout=120)
    assert done.stdout.split() == ["1438", "359", "False"], done.stderr[-2000:]
    want = _digits_as_scikit_learn_gives_them()
    got = lp.data.digits()
    for a, b in zip((got.x_train, got.y_train, got.x_test, got.y_test), want):
        np.testing.assert_array_equal(a, b)
    # a file that is missing, damaged or not digits: scikit-learn's own loader reads the data
    import sklearn

    good = gzip.open(Path(sklearn.__path__[0]).joinpath(*lp.data.DIGITS_FILE)).read()
    lines = good.decode().splitlines()
    for name, content in [("missing", None), ("bytes", b"\x1f\x8b not gzip"),
                          ("columns", "\n".join(",".join(line.split(",")[:64]) for line in lines).encode()),
                          ("label", "\n".join(lines[:-1] + [lines[-1].rsplit(",", 1)[0] + ",12"]).encode()),
                          ("pixel", "\n".join(["17" + lines[0][lines[0].index(","):]] + lines[1:]).encode())]:
        folder = tmp_path / name / "sklearn"
        (folder / "datasets" / "data").mkdir(parents=True)
        if content is not None:
            path = folder.joinpath(*lp.data.DIGITS_FILE)
            path.write_bytes(content if name == "bytes" else gzip.compress(content))
        spec = type("Spec", (), {"submodule_search_locations": [str(folder)]})()
        monkeypatch.setattr("importlib.util.find_spec", lambda n, spec=spec: spec)
        assert lp.data._digits_file() == (None, None), name
        got = lp.data.digits()  # (scikit-learn is imported by now: its loader needs no finding)
        monkeypatch.undo()
        np.testing.assert_array_equal(got.x_test, want[2])
        np.testing.assert_array_equal(got.y_train, want[1])


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


def _blobs(n=300, classes=3, seed=0):
    """Well-separated classes of 4x4 samples."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    centers = rng.standard_normal((classes, 16)) * 3
    return (centers[y] + rng.standard_normal((n, 16))).reshape(n, 4, 4).astype(np.float32), y


def test_npz_arrays_split_or_kept(tmp_path):
    x, y = _blobs()
    np.savez(tmp_path / "one.npz", x=x, y=y.reshape(-1, 1).astype(np.float32))
    ds = lp.data.load({"dataset": "npz", "path": str(tmp_path / "one.npz"), "test_fraction": 0.25, "seed": 3})
    assert (len(ds.x_train), len(ds.x_test), ds.num_classes, ds.input_shape) == (225, 75, 3, (4, 4))
    assert ds.y_train.dtype == np.int64 and ds.x_train.dtype == np.float32
    order = np.random.default_rng(3).permutation(300)
    np.testing.assert_array_equal(ds.x_test, x[order[:75]])
    np.testing.assert_array_equal(ds.y_train, y[order[75:]])
    assert len(lp.data.npz(str(tmp_path / "one.npz")).x_test) == 60  # 0.2 unless given
    images = (x - x.min()) / (x.max() - x.min()) * 255
    np.savez(tmp_path / "two.npz", x_train=images[:200].astype(np.uint8), y_train=y[:200],
             x_test=images[200:].astype(np.uint8), y_test=y[200:])
    ds = lp.data.npz(str(tmp_path / "two.npz"), num_classes=5)
    assert (len(ds.x_train), len(ds.x_test), ds.num_classes) == (200, 100, 5)
    np.testing.assert_allclose(ds.x_test, images[200:].astype(np.uint8) / 255.0)  # bytes scaled to [0, 1]
    np.testing.assert_array_equal(ds.y_test, y[200:])
    assert len(lp.data.npz(str(tmp_path / "two.npz"), test_fraction=0.5).x_test) == 150


@pytest.mark.parametrize("arrays,message", [
    (dict(a=np.zeros((3, 2))), r"expected arrays named x and y.*the file has a"),
    (dict(x=np.zeros(3), y=np.zeros(3)), r"x must hold samples as \[N, \.\.\.\]"),
    (dict(x=np.zeros((3, 2)), y=np.zeros(4)), r"y must be class indices of shape \[3\] or \[3, 1\]"),
    (dict(x=np.zeros((3, 2)), y=np.array([0, 1.5, 2])), r"y\[1\] is 1\.5; labels must be class indices"),
    (dict(x=np.zeros((3, 2)), y=np.array([0, -1, 2])), r"y\[1\] is -1"),
    (dict(x=np.zeros((3, 2)), y=np.array([0, np.nan, 2])), r"y\[1\] is nan"),
    (dict(x=np.array([[0, np.nan]] * 3), y=np.zeros(3)), r"x has 3 NaN or infinite values"),
    (dict(x=np.array([["a", "b"]] * 3), y=np.zeros(3)), r"x holds text of dtype <U1; leafpy needs real numbers"),
    (dict(x=np.array([[{}, 1]] * 3, dtype=object), y=np.zeros(3)), r"it holds arrays of Python objects"),
])
def test_npz_problems_name_the_file_and_the_fix(tmp_path, arrays, message):
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)
    with pytest.raises(lp.LeafpyError, match=rf"d\.npz: {message}"):
        lp.data.npz(str(path))


def test_npz_files_that_cannot_be_read(tmp_path):
    with pytest.raises(lp.LeafpyError, match=r"missing\.npz: cannot read the dataset: No such file"):
        lp.data.npz(str(tmp_path / "missing.npz"))
    (tmp_path / "text.npz").write_text("x: 1\n")
    with pytest.raises(lp.SerializationError, match=r"text\.npz: not a NumPy \.npz file"):
        lp.data.npz(str(tmp_path / "text.npz"))
    np.savez(tmp_path / "d.npz", x=np.zeros((3, 2)), y=np.array([0, 1, 4]))
    with pytest.raises(lp.ConfigError, match=r"data\.num_classes: .* has label 4, so num_classes must be at least 5"):
        lp.data.npz(str(tmp_path / "d.npz"), num_classes=3)
    with pytest.raises(lp.ConfigError, match=r"data\.path: the npz dataset needs the \.npz file"):
        lp.data.load({"dataset": "npz"})


def test_npz_regression_targets(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((50, 3)), rng.standard_normal((50, 2, 2))
    np.savez(tmp_path / "r.npz", x=x, y=y)
    ds = lp.data.load({"dataset": "npz", "path": str(tmp_path / "r.npz"), "test_fraction": 0.2}, targets="values")
    assert (ds.num_classes, ds.target_shape, ds.y_train.dtype, len(ds.y_test)) == (0, (2, 2), np.float32, 10)
    order = np.random.default_rng(0).permutation(50)
    np.testing.assert_allclose(ds.y_test, y[order[:10]].astype(np.float32))
    np.savez(tmp_path / "flat.npz", x=x, y=np.arange(50, dtype=np.uint8))  # [N] values: one per sample, unscaled
    ds = lp.data.npz(str(tmp_path / "flat.npz"), targets="values", test_fraction=0.5)
    assert ds.target_shape == (1,) and sorted(np.concatenate([ds.y_train, ds.y_test])[:, 0]) == list(range(50))
    np.savez(tmp_path / "bad.npz", x=x, y=np.zeros((49, 2)))
    with pytest.raises(lp.SerializationError, match=r"bad\.npz: y must hold one target per sample of x \(50\)"):
        lp.data.npz(str(tmp_path / "bad.npz"), targets="values")
    np.savez(tmp_path / "scalar.npz", x=x, y=np.float64(1.0))
    with pytest.raises(lp.SerializationError, match=r"scalar\.npz: y must hold one target per sample"):
        lp.data.npz(str(tmp_path / "scalar.npz"), targets="values")
    np.savez(tmp_path / "nan.npz", x=x, y=np.full(50, np.inf))
    with pytest.raises(lp.SerializationError, match=r"nan\.npz: y has 50 NaN or infinite values"):
        lp.data.npz(str(tmp_path / "nan.npz"), targets="values")
    with pytest.raises(lp.ConfigError, match=r"data\.dataset: digits has class labels.*dataset: npz"):
        lp.data.load({"dataset": "digits"}, targets="values")
