"""Datasets and batching: scikit-learn's bundled digits, MNIST and Fashion-MNIST from IDX files, and
deterministic shuffled batches (the last partial batch is kept)."""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, LeafpyError, SerializationError


@dataclass
class Dataset:
    """Train and held-out splits: images [N, C, H, W] float32 in [0, 1], labels [N] int64."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def split(name: str, x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int, num_classes: int) -> Dataset:
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"data.test_fraction: expected a number in (0, 1), got {test_fraction!r}")
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = max(1, int(round(len(x) * test_fraction)))
    test, train = order[:n_test], order[n_test:]
    return Dataset(name, x[train], y[train], x[test], y[test], num_classes)


def digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images), scaled to [0, 1], shaped [N, 1, 8, 8]."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise LeafpyError("the digits dataset needs scikit-learn: pip install 'leafpy[data]'") from e
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    return split("digits", x, d.target.astype(np.int64), test_fraction, seed, 10)


_IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (gzipped or not)."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise SerializationError(f"{path}: cannot read IDX file: {e}") from e
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise SerializationError(f"{path}: not an IDX file of unsigned bytes (bad magic number)")
    ndim = data[3]
    header = 4 + 4 * ndim
    dims = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    if len(data) != header + int(np.prod(dims)):
        raise SerializationError(f"{path}: IDX header says shape {dims}, but the file has "
                                 f"{len(data) - header} data bytes")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def mnist(directory: str, *, test_fraction: float | None = None, seed: int = 0, name: str = "mnist") -> Dataset:
    """MNIST (or Fashion-MNIST, same files) from the four standard IDX files in ``directory``, gzipped or not.

    The standard train/test split is used unless ``test_fraction`` asks for a random split of everything.
    """
    paths = {}
    missing = []
    for key, stem in _IDX_FILES.items():
        for candidate in (stem, stem + ".gz"):
            p = os.path.join(directory, candidate)
            if os.path.exists(p):
                paths[key] = p
                break
        else:
            missing.append(stem)
    if missing:
        raise LeafpyError(f"{name}: missing files in {directory!r}: {', '.join(missing)} (each may be gzipped, "
                          f"with .gz). Put the four IDX files {', '.join(_IDX_FILES.values())} there.")
    arrays = {k: read_idx(p) for k, p in paths.items()}
    xs = {k: (arrays[k].astype(np.float32) / 255.0).reshape(-1, 1, 28, 28) for k in ("train_x", "test_x")}
    ys = {k: arrays[k].astype(np.int64) for k in ("train_y", "test_y")}
    if test_fraction is not None:
        x = np.concatenate([xs["train_x"], xs["test_x"]])
        y = np.concatenate([ys["train_y"], ys["test_y"]])
        return split(name, x, y, test_fraction, seed, 10)
    return Dataset(name, xs["train_x"], ys["train_y"], xs["test_x"], ys["test_y"], 10)


def batches(x: np.ndarray, y: np.ndarray, batch_size: int, *, seed: int | None = 0, epoch: int = 0
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Batches of (x, y), shuffled reproducibly from (seed, epoch) unless seed is None; the last partial
    batch is yielded too."""
    if batch_size <= 0:
        raise ConfigError(f"data.batch_size: expected a positive integer, got {batch_size!r}")
    n = len(x)
    order = np.arange(n) if seed is None else np.random.default_rng([seed, epoch]).permutation(n)
    for start in range(0, n, batch_size):
        idx = order[start:start + batch_size]
        yield x[idx], y[idx]


def load(spec: dict) -> Dataset:
    """A dataset from a run file's ``data`` section: dataset digits | mnist | fashion_mnist."""
    kind = spec.get("dataset", "digits")
    seed = int(spec.get("seed", 0))
    if kind == "digits":
        return digits(float(spec.get("test_fraction", 0.2)), seed)
    if kind in ("mnist", "fashion_mnist"):
        directory = spec.get("path")
        if not directory:
            raise ConfigError(f"data.path: the {kind} dataset needs the directory holding its IDX files")
        tf = spec.get("test_fraction")
        return mnist(directory, test_fraction=None if tf is None else float(tf), seed=seed, name=kind)
    raise ConfigError(f"data.dataset: expected one of 'digits', 'mnist', 'fashion_mnist', got {kind!r}")
