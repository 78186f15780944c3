"""Datasets and batching: scikit-learn's bundled digits, MNIST and Fashion-MNIST from IDX files, a user's own
arrays from a NumPy ``.npz`` file, and deterministic shuffled batches (the last partial batch is kept)."""

from __future__ import annotations

import contextlib
import gzip
import math
import os
import tokenize
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _checks
from ._memory import available_memory
from .errors import ConfigError, LeafpyError, SerializationError, ShapeError
from .sources import csv_table, mapped
from .sources import image_folder as _images
from .sources.mapped import open_npz
from .sources.parts import Parts
from .sources.prepare import Preparation  # noqa: F401  (re-exported: lp.data.Preparation)


@dataclass
class Dataset:
    """Train and held-out splits: samples [N, ...] float32 (images [N, C, H, W] in [0, 1]) and targets: class
    indices [N] int64 with ``num_classes`` > 0, or values [N, ...] float32 with ``num_classes`` 0 (regression)."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    class_names: tuple[str, ...] = ()
    """The classes' names, class k the k-th (empty: classes are numbered, or a regression)."""
    skipped: tuple[str, ...] = ()
    """Files left out because they could not be read (image folders with ``skip_unreadable``)."""
    feature_names: tuple[str, ...] = ()
    """The columns the samples were read from (CSV tables)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse splits whose samples and targets differ in number (sample i is paired with target i: one too
        many would pair the rest with the wrong targets), or that are not arrays of numbers [N, ...]; a list (or
        anything NumPy converts) becomes an array. The Trainer checks its dataset again, as it may have changed."""
        for key in ("x_train", "y_train", "x_test", "y_test"):
            a = given = getattr(self, key)
            if not isinstance(a, (np.ndarray, mapped.Mapped)):
                try:
                    a = np.asarray(a)
                except (TypeError, ValueError) as e:  # (a ragged list)
                    raise ShapeError(f"Dataset {self.name!r}: {key}: expected an array [N, ...] (a NumPy array, or "
                                     f"a list of samples of one shape), got {type(given).__name__}: {e}") from None
                setattr(self, key, a)
            if a.ndim == 0 or a.dtype.kind not in "biuf":
                raise ShapeError(f"Dataset {self.name!r}: {key}: expected an array of numbers [N, ...], one entry "
                                 f"per sample, got {type(given).__name__} of shape {a.shape} and dtype {a.dtype}")
        for x_key, y_key in (("x_train", "y_train"), ("x_test", "y_test")):
            n, m = len(getattr(self, x_key)), len(getattr(self, y_key))
            if n != m:
                raise ShapeError(f"Dataset {self.name!r}: {x_key} holds {n} samples and {y_key} {m} targets; give "
                                 f"one target per sample ({y_key}[i] is the target of {x_key}[i])")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def target_shape(self) -> tuple[int, ...]:
        return tuple(self.y_train.shape[1:])

    def digest(self) -> str:
        """A fingerprint of the samples and targets of both splits (their order, shapes, types and values): a
        checkpoint keeps it, so a resumed run can tell that its data changed."""
        import hashlib

        h = hashlib.blake2b(digest_size=16)
        for a in (self.x_train, self.y_train, self.x_test, self.y_test):
            hash_array(h, a)
        return h.hexdigest()

    def earlier_digests(self) -> list[str]:
        """The fingerprints leafpy gave the same data before image folders kept their images as bytes: samples
        held as float32 in [0, 1] (as given, and normalised where the run normalises), so that a checkpoint of
        that time still resumes. Empty where no sample array is kept as bytes (every fingerprint is current)."""
        import hashlib

        if not any(isinstance(a, mapped.Mapped) and a.source.dtype == np.uint8 for a in (self.x_train, self.x_test)):
            return []
        found = []
        for normalised in (False, True):
            h = hashlib.blake2b(digest_size=16)
            for a in (self.x_train, self.y_train, self.x_test, self.y_test):
                if not isinstance(a, mapped.Mapped):
                    hash_array(h, a)
                    continue
                plain = mapped.Mapped(a.source, a.rows, a.prep if normalised else None, a.pages)
                h.update(f"{np.dtype(np.float32).str}{a.shape};".encode())  # as one float32 array, chunk by chunk
                for chunk in plain.chunks():
                    h.update(np.ascontiguousarray(chunk, np.float32).data.cast("B"))
            found.append(h.hexdigest())
        return found

    def fingerprinted_by(self, digest: str, current: str | None = None) -> bool:
        """Whether a checkpoint's ``digest`` fingerprints this data: its fingerprint now (``current``, where the
        caller has it already) or one an earlier leafpy gave it."""
        return digest == (self.digest() if current is None else current) or digest in self.earlier_digests()


def hash_array(h: Any, a: np.ndarray) -> None:
    """Add an array's dtype, shape and bytes to the hashlib object ``h`` (the bytes read once, not copied unless
    the array is not contiguous; a memory-mapped one's a chunk at a time, with the rows it takes)."""
    if isinstance(a, mapped.Mapped):
        h.update(f"mapped{a.source.dtype.str}{a.shape};".encode())
        for chunk in a.raw_chunks():
            hash_array(h, chunk)
        return
    a = np.ascontiguousarray(a)
    h.update(f"{a.dtype.str}{a.shape};".encode())
    if a.size:  # (an empty array has no bytes, and a memoryview of it cannot be cast)
        h.update(a.data.cast("B"))


def split(name: str, x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int, num_classes: int) -> Dataset:
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"data.test_fraction: expected a number in (0, 1), got {test_fraction!r}")
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = max(1, int(round(len(x) * test_fraction)))
    if n_test >= len(x):
        raise ConfigError(f"data.test_fraction: {name} has {len(x)} sample{'s' * (len(x) != 1)}, and a held-out "
                          f"fraction of {test_fraction:g} leaves none to train on; use more samples or a smaller "
                          "test_fraction")
    test, train = order[:n_test], order[n_test:]
    return Dataset(name, mapped.take(x, train), y[train], mapped.take(x, test), y[test], num_classes)


def digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images), scaled to [0, 1], shaped [N, 1, 8, 8]."""
    images, labels = _digits_file()
    if images is None:
        try:
            from sklearn.datasets import load_digits
        except ImportError as e:
            raise LeafpyError("the digits dataset needs scikit-learn: pip install scikit-learn") from e
        d = load_digits()
        images, labels = d.images, d.target
    x = (images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    return split("digits", x, labels.astype(np.int64), test_fraction, seed, 10)


DIGITS_FILE = ("datasets", "data", "digits.csv.gz")
"""Where in scikit-learn's package its digits are: one line per image, 64 pixel values (0-16) and the label."""


def _digits_file() -> tuple[Any, Any]:
    """(images [N, 8, 8] in 0-16, labels) read from scikit-learn's file as its ``load_digits`` reads it, without
    importing scikit-learn (about 1 s of imports, a fifth of ``make demo``); (None, None) where the file is not
    there or not as expected (``load_digits`` then reads it)."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("sklearn")  # (finds the package without importing it)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        path = next((p for p in (os.path.join(f, *DIGITS_FILE) for f in folders) if os.path.isfile(p)), None)
        if path is None or os.path.getsize(path) > 1 << 20:
            return None, None
        with gzip.open(path, "rb") as f:
            text = f.read(8 << 20)
        table = np.loadtxt(text.decode("ascii").splitlines(), delimiter=",", ndmin=2)
    except (OSError, ValueError, ImportError, EOFError, zlib.error, UnicodeDecodeError):
        return None, None
    if table.ndim != 2 or table.shape[1] != 65 or not len(table):
        return None, None
    pixels, labels = table[:, :64], table[:, 64]  # whole numbers in 0-16 and 0-9 (NaN and infinities refused)
    if _checks.first_non_index(pixels, 17) is not None or _checks.first_non_index(labels, 10) is not None:
        return None, None
    return pixels.reshape(-1, 8, 8), labels.astype(np.int64)


MEMORY_SHARE = 0.9
"""The share of the memory available that a dataset may take as it loads (the rest: the network, its batches)."""


def _bytes(n: float) -> str:
    return f"{int(n):,} bytes ({n / 2**30:.2f} GiB)"


def check_memory(path: str, declared: str, need: int) -> None:
    """Refuse, before anything is allocated, a dataset whose loading needs more than :data:`MEMORY_SHARE` of
    :func:`available_memory`: ``need`` is what its arrays will take, as read and as converted (float32 samples,
    int64 labels), from the shapes its headers declare (``declared`` says which)."""
    available = available_memory()
    if available is None or need <= MEMORY_SHARE * available:
        return
    raise LeafpyError(f"{path}: {declared}: loading it needs about {_bytes(need)} of memory, and this process has "
                      f"{_bytes(available)} available; use a smaller subset of the data or a memory-mapped dataset")


_IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}


GZIP_MAX_RATIO = 1032
"""Deflate (gzip) expands data at most this much: a gzipped IDX file declaring more data is damaged."""


@contextlib.contextmanager
def _idx_file(path: str) -> Iterator[tuple[Any, tuple[int, ...]]]:
    """An IDX file of unsigned bytes opened (gunzipped if .gz) at its data, with the shape its header declares; a
    header declaring more than an uncompressed file holds is refused here, before anything is read."""
    path = _checks.path("read_idx: path", path)
    try:
        with _checks.open_regular(path, "an IDX file") as raw, \
                (gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else contextlib.nullcontext(raw)) as f:
            magic = _read_exactly(f, 4)
            if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] != 0x08:
                raise SerializationError(f"{path}: not an IDX file of unsigned bytes (bad magic number); give the "
                                         "MNIST files as published (train-images-idx3-ubyte...)")
            ndim = magic[3]
            head = _read_exactly(f, 4 * ndim)
            if len(head) < 4 * ndim:
                raise SerializationError(f"{path}: the IDX header is cut short ({ndim} dimensions declared); the file "
                                         "is truncated: download it again")
            dims = tuple(int.from_bytes(head[4 * i:4 * i + 4], "big") for i in range(ndim))
            size = os.fstat(raw.fileno()).st_size
            held = size - 4 - 4 * ndim if f is raw else size * GZIP_MAX_RATIO
            if math.prod(dims) > held:
                raise SerializationError(f"{path}: the IDX header declares shape {dims} ({math.prod(dims)} data "
                                         f"bytes), but the file {'holds' if f is raw else 'can hold at most'} {held}; "
                                         "the file is truncated or damaged: download it again")
            yield f, dims
    except (OSError, EOFError, zlib.error) as e:
        if isinstance(e, LeafpyError):
            raise
        raise SerializationError(f"{path}: cannot read the IDX file ({getattr(e, 'strerror', None) or e}); the file "
                                 "is damaged or not gzip data: download it again") from e


def idx_shape(path: str) -> tuple[int, ...]:
    """The shape an IDX file's header declares (its data is not read)."""
    with _idx_file(path) as (_, dims):
        return dims


def read_idx(path: str) -> np.ndarray:
    """Read one IDX file of unsigned bytes (gzipped or not). Its header's dimensions decide how much is read, so a
    damaged or hostile header is refused (see :func:`check_memory`) before anything large is allocated."""
    with _idx_file(path) as (f, dims):
        size = math.prod(dims)
        check_memory(path, f"the IDX header declares shape {dims}", 2 * size)  # read in chunks, then joined
        data = _read_exactly(f, size + 1)
    if len(data) != size:
        got = "more than that" if len(data) > size else f"{len(data)}"
        raise SerializationError(f"{path}: the IDX header says shape {dims} ({size} data bytes), but the file has "
                                 f"{got}; the file is truncated or damaged: download it again")
    return np.frombuffer(data, dtype=np.uint8).reshape(dims)


def _read_exactly(f: Any, n: int) -> bytes:
    """Up to ``n`` bytes, fewer only at the end of the file."""
    parts, left = [], n
    while left > 0:
        chunk = f.read(min(left, 1 << 24))
        if not chunk:
            break
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def mnist(directory: str, *, test_fraction: float | None = None, seed: int = 0, name: str = "mnist",
          input_shape: Sequence[int] | None = None) -> Dataset:
    """MNIST (or Fashion-MNIST, same files) from the four standard IDX files in ``directory``, gzipped or not.

    The standard train/test split is used unless ``test_fraction`` asks for a random split of everything. Images are
    [N, 1, H, W] with H and W from the files; ``input_shape`` (the network's per-sample input, e.g. [1, 28, 28])
    must match them.
    """
    directory = _checks.path(f"{name}: directory", directory)
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
    shapes = {k: idx_shape(p) for k, p in paths.items()}
    read = sum(math.prod(d) for d in shapes.values())
    loaded = sum(math.prod(d) * (4 if k.endswith("_x") else 8) for k, d in shapes.items())  # float32, int64
    check_memory(directory, "its IDX headers declare " + ", ".join(
        f"{os.path.basename(paths[k])} {list(d)}" for k, d in shapes.items()),
        read + loaded * (1 if test_fraction is None else 3))  # a random split: joined, then split
    arrays = {k: read_idx(p) for k, p in paths.items()}
    xs, ys = {}, {}
    for part in ("train", "test"):
        x_path, y_path = paths[f"{part}_x"], paths[f"{part}_y"]
        images, labels = arrays[f"{part}_x"], arrays[f"{part}_y"]
        if images.ndim != 3 or images.shape[0] == 0:
            raise SerializationError(f"{x_path}: expected images [N, height, width] with N >= 1, got shape "
                                     f"{images.shape}; give an IDX image file (idx3-ubyte)")
        if labels.ndim != 1 or len(labels) != len(images):
            raise SerializationError(f"{y_path}: expected one label per image of {x_path} ({len(images)}), got shape "
                                     f"{labels.shape}; give the label file that belongs to those images")
        if labels.max() > 9:
            raise SerializationError(f"{y_path}: label {int(labels.max())} is outside MNIST's classes 0-9")
        x = images.astype(np.float32)
        x /= 255.0
        xs[part] = x[:, None]
        ys[part] = labels.astype(np.int64)
    if xs["train"].shape[1:] != xs["test"].shape[1:]:
        raise SerializationError(f"{paths['test_x']}: images are {xs['test'].shape[2]}x{xs['test'].shape[3]}, but "
                                 f"those of {paths['train_x']} are {xs['train'].shape[2]}x{xs['train'].shape[3]}; "
                                 "give files of one dataset")
    got = xs["train"].shape[1:]
    if input_shape is not None and tuple(input_shape) != got:
        raise ConfigError(f"{paths['train_x']}: images are {got[1]}x{got[2]} ({list(got)} per sample), but the "
                          f"network's input is declared {list(input_shape)} per sample; declare "
                          f"[N, {', '.join(map(str, got))}] in network.inputs or give {name} files of that size")
    if test_fraction is not None:
        x = np.concatenate([xs["train"], xs["test"]])
        y = np.concatenate([ys["train"], ys["test"]])
        return split(name, x, y, test_fraction, seed, 10)
    return Dataset(name, xs["train"], ys["train"], xs["test"], ys["test"], 10)


NPZ_KEYS = (("x", "y"), ("x_train", "y_train", "x_test", "y_test"))


def npz(path: str, *, test_fraction: float | None = None, seed: int = 0, num_classes: int | None = None,
        targets: str = "classes", memory_map: bool = False, ignore_index: int | None = None) -> Dataset:
    """A user's arrays from a NumPy ``.npz`` file (``np.savez``): ``x`` and ``y``, split at random by
    ``test_fraction`` (0.2 unless given), or ``x_train``, ``y_train``, ``x_test`` and ``y_test``, kept as they are
    unless ``test_fraction`` asks for a random split of everything.

    Samples are ``x[i]`` of any shape (unsigned bytes are scaled to [0, 1], other numbers become float32 as they
    are). With ``targets="classes"`` the labels ``y`` are class indices, shape [N] or [N, 1], and ``num_classes``
    defaults to the largest label + 1; with ``targets="values"`` (regression) ``y[i]`` are real numbers of any
    shape. The file is read without pickle: arrays of Python objects are refused.

    ``memory_map``: the samples are read through a memory map (the file written by np.savez, not compressed) and
    a batch is converted as it is taken (see :class:`leafpy.sources.mapped.Mapped`), so a file larger than memory
    trains with bounded memory; the labels are read into memory.

    ``ignore_index``: a label that marks a sample the objective does not count (its ``ignore_index``), allowed
    among the labels whatever its value and left out of ``num_classes``."""
    path = _checks.path("npz: path", path)
    if targets not in ("classes", "values"):
        raise ConfigError(f"npz: targets must be 'classes' or 'values', got {targets!r}")
    wanted = "x and y, or x_train, y_train, x_test and y_test (np.savez(path, x=..., y=...))"
    if memory_map:
        arrays = mapped.npz(path, lambda names: _layout(path, names, NPZ_KEYS, wanted))
    else:
        arrays = _read_npz(path, NPZ_KEYS, wanted, copies=lambda keys: 1 if test_fraction is None and len(keys) == 4
                           else 1 + len(keys) // 2)  # a random split: the arrays joined (two pairs), then split
    return _from_arrays(path, arrays, test_fraction, seed, num_classes, targets, memory_map, ignore_index)


def npy(paths: dict[str, str], *, test_fraction: float | None = None, seed: int = 0, num_classes: int | None = None,
        targets: str = "classes", ignore_index: int | None = None) -> Dataset:
    """A user's arrays as ``.npy`` files (np.save): ``{"x": X.npy, "y": Y.npy}``, or ``x_train``, ``y_train``,
    ``x_test`` and ``y_test``, read as :func:`npz` reads them with ``memory_map``: the samples through a memory
    map, a batch at a time, so files larger than memory train with bounded memory."""
    if not isinstance(paths, dict) or not all(isinstance(p, str) and p for p in paths.values()):
        raise ConfigError(f"data.path: the npy dataset needs {{x: X.npy, y: Y.npy}} (or x_train, y_train, x_test, "
                          f"y_test), got {paths!r}"[:300])
    layout = _layout("data.path", list(paths), NPZ_KEYS, "x and y, or x_train, y_train, x_test and y_test")
    extra = sorted(set(paths) - set(layout))
    if extra:
        raise ConfigError(f"data.path: unknown key{'s' * (len(extra) > 1)} {', '.join(extra)}; give "
                          f"{', '.join(layout)}")
    arrays = {k: mapped.npy(_checks.path(f"data.path.{k}", paths[k]), k) for k in layout}
    return _from_arrays({k: paths[k] for k in layout}, arrays, test_fraction, seed, num_classes, targets, True,
                        ignore_index)


def _layout(path: str, names: Sequence[str], layouts: Sequence[Sequence[str]], wanted: str) -> Sequence[str]:
    """The one of ``layouts`` (tuples of array names) that ``names`` holds."""
    found = [k for k in layouts if set(names) >= set(k)]
    if not found:
        raise SerializationError(f"{path}: expected arrays named {wanted}; the file has "
                                 f"{', '.join(sorted(names)) or 'none'}")
    if len(found) > 1:
        raise SerializationError(f"{path}: holds both {' and '.join(', '.join(k) for k in found)}: which "
                                 "is the data is ambiguous; save only one of them")
    return found[0]


def _from_arrays(path: str | dict[str, str], arrays: dict[str, np.ndarray], test_fraction: float | None, seed: int,
                 num_classes: int | None, targets: str, memory_map: bool, ignore_index: int | None = None
                 ) -> Dataset:
    """A Dataset of the arrays :func:`npz` (or :func:`npy`) read, checked; mapped samples stay mapped. ``path``:
    the file all arrays came from, or each array's file by its key (messages name the file at fault)."""
    layout = next(k for k in NPZ_KEYS if set(k) <= set(arrays))
    at: Callable[[str], str] = path.__getitem__ if isinstance(path, dict) else (lambda key: path)
    if memory_map:
        if len(layout) == 4 and test_fraction is not None:
            raise ConfigError(f"data.test_fraction: {at(layout[0])} gives its own split (x_train, x_test), which a "
                              "memory map keeps as it is; remove test_fraction")
        counts = [arrays[k].shape[0] if arrays[k].ndim else 0 for k in layout[::2]]  # (0-d: refused below)
        check_memory(at(layout[0]), f"its labels and the order of its {counts[0]} samples", 16 * sum(counts))
    pairs = [(arrays[x_key], arrays[y_key], x_key, y_key) for x_key, y_key in zip(layout[::2], layout[1::2])]
    xs: list[Any] = []  # (arrays, or mapped samples)
    ys: list[np.ndarray] = []
    for x, y, x_key, y_key in pairs:
        xs.append(_mapped_samples(at(x_key), x_key, x) if memory_map else _samples(at(x_key), x_key, x))
        y = np.asarray(y)  # (labels: read into memory)
        if targets == "values":
            if y.ndim == 0 or len(y) != len(x):
                raise SerializationError(f"{at(y_key)}: {y_key} must hold one target per sample of {x_key} "
                                         f"({len(x)}), got shape {y.shape}")
            ys.append(_samples(at(y_key), y_key, y if y.ndim > 1 else y.reshape(-1, 1), scale_bytes=False))
        else:
            ys.append(_labels(at(y_key), y_key, y, len(x), x_key, ignore_index))
    keys = list(zip(layout[::2], layout[1::2]))
    for i in range(1, len(pairs)):  # a fixed split's halves must have one shape per sample (and per target)
        for key, first_key, a, first in ((keys[i][0], keys[0][0], xs[i], xs[0]),
                                         (keys[i][1], keys[0][1], ys[i], ys[0])):
            if a.shape[1:] != first.shape[1:]:
                raise SerializationError(f"{at(key)}: {key} holds samples of shape {list(a.shape[1:])}, but "
                                         f"{first_key} holds {list(first.shape[1:])}; the training and held-out "
                                         "arrays must have one shape per sample")
    if targets == "values":
        num_classes = 0
        top = 0
    else:
        top = max(int(y.max(initial=-1, where=y != ignore_index) if ignore_index is not None else y.max(initial=-1))
                  for y in ys) + 1
    if num_classes is None:
        num_classes = top
    elif top > num_classes:
        raise ConfigError(f"data.num_classes: {', '.join(dict.fromkeys(at(k) for k in layout[1::2]))} has label "
                          f"{top - 1}, so num_classes must be at least {top}, got {num_classes}")
    name = os.path.basename(at(layout[0]))
    if len(pairs) == 1 or test_fraction is not None:
        x, y = (a[0] if len(a) == 1 else np.concatenate(a) for a in (xs, ys))
        return split(name, x, y, 0.2 if test_fraction is None else test_fraction, seed, num_classes)
    return Dataset(name, xs[0], ys[0], xs[1], ys[1], num_classes)


def npz_samples(path: str) -> np.ndarray:
    """The samples ``x`` (or ``x_test``) of a NumPy ``.npz`` file, as :func:`npz` reads them (labels, if any, are
    not read): inputs for a trained network."""
    path = _checks.path("npz_samples: path", path)
    arrays = _read_npz(path, (("x",), ("x_test",)), "x (np.savez(path, x=...))")
    key = "x" if "x" in arrays else "x_test"
    return _samples(path, key, arrays[key])


def _read_npz(path: str, layouts: Sequence[Sequence[str]], wanted: str,
              copies: Callable[[Sequence[str]], int] = lambda keys: 1) -> dict[str, np.ndarray]:
    """The arrays of the first of ``layouts`` (tuples of names) that the file has, read without pickle. Each array's
    header is checked against the size the archive declares for it, and all of them against the memory available
    (as read, then converted ``copies(layout)`` times: float32 samples, int64 labels), before any array is read."""
    try:
        with open_npz(path) as (fh, z, infos):
            layout = _layout(path, list(infos), layouts, wanted)
            declared = {}
            for key in layout:
                with z.open(key + ".npy") as member:
                    declared[key] = _check_npy_header(path, key, member, infos[key].file_size)
            _check_npz_memory(path, declared, copies(layout))
            fh.seek(0)
            with np.load(fh, allow_pickle=False) as f:
                return {k: f[k] for k in layout}
    except (OSError, EOFError) as e:
        if isinstance(e, LeafpyError):
            raise
        raise LeafpyError(f"{path}: cannot read the dataset: {getattr(e, 'strerror', None) or e}") from e
    except (ValueError, SyntaxError, tokenize.TokenError, zipfile.BadZipFile, zlib.error, NotImplementedError) as e:
        if isinstance(e, LeafpyError):
            raise
        why = ("it holds arrays of Python objects; save plain arrays of numbers" if "allow_pickle" in str(e)
               else f"not a readable NumPy .npz file ({type(e).__name__}: {e}); write it again with np.savez")
        raise SerializationError(f"{path}: {why}") from e


def _check_npz_memory(path: str, declared: dict[str, tuple[tuple[int, ...], np.dtype]], copies: int) -> None:
    read = sum(math.prod(shape) * dtype.itemsize for shape, dtype in declared.values())
    loaded = sum(math.prod(shape) * (8 if key.startswith("y") else 4) for key, (shape, _) in declared.items())
    check_memory(path, "it declares " + ", ".join(f"{key} {list(shape)} of {dtype}" for key, (shape, dtype) in
                                                  declared.items()), read + copies * loaded)


def _check_npy_header(path: str, key: str, member: Any, size: int) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of an array's .npy header, refused where it declares more data than the archive holds
    for it."""
    shape, _, dtype = mapped.read_header(member, path, key)
    _real(path, key, dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > size:
        raise SerializationError(f"{path}: {key} declares shape {tuple(shape)} of {dtype} ({nbytes} bytes), but "
                                 f"the file holds {size} bytes for it; the file is damaged: write it again")
    return tuple(shape), dtype


KINDS = {"m": "time spans (timedelta64)", "M": "dates (datetime64)", "c": "complex numbers", "U": "text",
         "S": "bytes", "O": "Python objects", "V": "records (structured or raw bytes)"}


def _real(path: str, key: str, dtype: np.dtype) -> None:
    """Refuse an array that does not hold real numbers (bool, integer or float), naming what it holds."""
    if dtype.kind not in "biuf":
        raise SerializationError(f"{path}: {key} holds {KINDS.get(dtype.kind, 'values')} of dtype {dtype}; leafpy "
                                 "needs real numbers: convert them (e.g. x.astype(np.float32)) and save again")


def _samples(path: str, key: str, x: np.ndarray, scale_bytes: bool = True) -> np.ndarray:
    if x.ndim < 2 or len(x) == 0:
        raise SerializationError(f"{path}: {key} must hold samples as [N, ...] with N >= 1, got shape {x.shape}")
    if x.dtype == np.uint8 and scale_bytes:
        scaled = x.astype(np.float32)
        scaled /= 255.0
        return scaled
    _real(path, key, x.dtype)
    with np.errstate(over="ignore", under="ignore"):  # values beyond float32's range: reported below
        x32 = x.astype(np.float32)
    bad = int(np.count_nonzero(~np.isfinite(x32)))
    if bad:
        raise SerializationError(f"{path}: {key} has {bad} NaN or infinite values (or values past float32's "
                                 "largest, about 3.4e38)")
    if x.dtype.kind == "f" and x.dtype.itemsize > 4:
        lost = np.flatnonzero((x32 == 0) & (x != 0))
        if len(lost):
            raise SerializationError(f"{path}: {key} has {len(lost)} nonzero values that become 0 in float32 (the "
                                     f"first: {x.reshape(-1)[lost[0]]!r}; float32's smallest is about 1.4e-45): "
                                     "the data is mis-scaled; rescale it (e.g. to [0, 1]) and save again")
    return x32


def _mapped_samples(path: str, key: str, x: np.ndarray) -> mapped.Mapped:
    """Memory-mapped samples, checked as :func:`_samples` checks them a chunk at a time (nothing is kept)."""
    if x.ndim < 2 or len(x) == 0:
        raise SerializationError(f"{path}: {key} must hold samples as [N, ...] with N >= 1, got shape {x.shape}")
    _real(path, key, x.dtype)
    m = mapped.Mapped(x)
    if x.dtype != np.uint8:
        for chunk in m.raw_chunks():
            _samples(path, key, chunk)
    return m


def _labels(path: str, key: str, y: np.ndarray, n: int, x_key: str, ignore_index: int | None = None) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim == 0 or y.shape[0] != n or 0 in y.shape:
        raise SerializationError(f"{path}: {key} must be class indices of shape [{n}] or [{n}, 1] (one per sample "
                                 f"of {x_key}), or [{n}, d1, ...] (one per position, for an objective that scores "
                                 f"a class at every position), got shape {y.shape}")
    _real(path, key, y.dtype)
    with np.errstate(invalid="ignore"):  # NaN or huge labels: reported below, not warned about
        labels = y.astype(np.int64)
        wrong = np.flatnonzero((labels != y) | ((labels < 0) & (labels != ignore_index)))
    if len(wrong):
        ignored = "" if ignore_index is None else f" (or the objective's ignore_index {ignore_index})"
        raise SerializationError(f"{path}: {key}[{wrong[0]}] is {y[wrong[0]]}; labels must be class indices 0, 1, "
                                 f"2, ...{ignored}")
    return labels


def batches(x: np.ndarray, y: np.ndarray, batch_size: int, *, seed: int | None = 0, epoch: int = 0
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Batches of (x, y), shuffled reproducibly from (seed, epoch) unless seed is None; the last partial
    batch is yielded too."""
    batch_size = _checks.positive_int("data.batch_size", batch_size)
    x, y = x if isinstance(x, mapped.Mapped) else np.asarray(x), np.asarray(y)
    if x.ndim == 0 or y.ndim == 0 or len(x) != len(y):
        raise ConfigError(f"batches: x and y must hold one entry per sample, got x of shape {x.shape} and y of "
                          f"shape {y.shape}")
    n = len(x)
    order = np.arange(n) if seed is None else np.random.default_rng([seed, epoch]).permutation(n)
    for start in range(0, n, batch_size):
        idx = order[start:start + batch_size]
        yield x[idx], y[idx]


def from_parts(parts: Parts, test_fraction: float | None, seed: int) -> Dataset:
    """A Dataset of what a source read: its own split, else split at random (``test_fraction``, 0.2 unless
    given)."""
    if parts.test is None:
        tf = 0.2 if test_fraction is None else test_fraction
        ds = split(parts.name, parts.x, parts.y, tf, seed, parts.num_classes)
    else:
        ds = Dataset(parts.name, parts.x, parts.y, *parts.test, parts.num_classes)
    ds.class_names, ds.skipped, ds.feature_names = parts.class_names, parts.skipped, parts.feature_names
    return ds


def image_folder(path: str | dict[str, str], *, image_size: Sequence[int] | None = None, channels: int = 3,
                 test_fraction: float | None = None, seed: int = 0, skip_unreadable: bool = False,
                 cache_dir: str | None = "default", memory_map: bool = False, workers: int = 0,
                 decoding: str = "auto") -> Dataset:
    """A folder with one subfolder of images per class (their names, sorted, are the class names: class k is the
    k-th), split at random by ``test_fraction`` (0.2 unless given), or ``{"train": DIR, "test": DIR}``, two such
    folders (a given split, kept). Images become float32 [N, channels, H, W] in [0, 1], resized to ``image_size``
    [H, W] (default: the first image's size); ``channels`` 1 (grayscale) or 3 (RGB). A file that cannot be decoded
    is an error naming it (when its sample is first read), or with ``skip_unreadable`` left out and listed in
    ``Dataset.skipped``. The samples are :class:`leafpy.sources.mapped.Mapped`: uint8 images converted a batch
    at a time as they are taken. Decoded images are kept in ``cache_dir`` ("default": ``$LEAFPY_CACHE``, else
    ~/.cache/leafpy/images; None: no cache); without a cache yet they are decoded as they are first read (by
    ``workers`` threads where a read asks for several; all at once with ``skip_unreadable``), and the cache is
    written once all are; ``decoding``: how the ``workers`` decode, "threads", "processes" (as many decoding
    processes: no GIL between them) or "auto" (processes where many files are left and they measure faster);
    ``memory_map``: the images are read from the cache file through a memory map (a folder larger than memory),
    instead of held in memory."""
    return from_parts(_images.read(path, image_size=image_size, channels=channels, skip_unreadable=skip_unreadable,
                                   cache_dir=cache_dir, memory_map=memory_map, workers=workers,
                                   decoding_in=decoding), test_fraction, seed)


def csv(path: str, target: str, *, features: Sequence[str] | None = None, delimiter: str = ",",
        test_fraction: float | None = None, seed: int = 0, targets: str = "classes") -> Dataset:
    """A CSV table with a header row: ``target`` names the label column (``targets`` "classes": its distinct
    values, sorted, are the class names; "values": numbers to regress on, [N, 1]), ``features`` the columns read
    as samples [N, F] float32 (default: every other column), split at random by ``test_fraction`` (0.2 unless
    given). A missing or non-numeric feature is an error naming its line and column."""
    return from_parts(csv_table.read(path, target, features=features, delimiter=delimiter, targets=targets),
                      test_fraction, seed)


def load(spec: dict, targets: str = "classes", input_shape: Sequence[int] | None = None,
         ignore_index: int | None = None) -> Dataset:
    """A dataset from a run file's ``data`` section: dataset digits | mnist | fashion_mnist | npz | image_folder |
    csv. ``targets``
    "values" reads an npz file's ``y`` as regression targets (the others hold classes only). ``input_shape``, the
    network's per-sample input, is what MNIST's images must be (their size is in the files). ``ignore_index``: the
    objective's, a label allowed among an npz or npy file's labels (see :func:`npz`)."""
    kind = spec.get("dataset", "digits")
    seed = int(spec.get("seed", 0))
    tf = spec.get("test_fraction")
    if kind in ("image_folder", "csv"):
        from . import sources

        return from_parts(sources.load(kind, spec, targets, input_shape), None if tf is None else float(tf), seed)
    if targets == "values" and kind not in ("npz", "npy"):
        raise ConfigError(f"data.dataset: {kind} has class labels, and this objective needs values to regress "
                          "on: give them in an npz file (dataset: npz) or a CSV table (dataset: csv)")
    if kind == "digits":
        return digits(float(0.2 if tf is None else tf), seed)
    if kind == "npy":
        return npy(spec.get("path") or {}, test_fraction=None if tf is None else float(tf), seed=seed,
                   num_classes=_num_classes(spec), targets=targets, ignore_index=ignore_index)
    if kind in ("mnist", "fashion_mnist", "npz"):
        path = spec.get("path")
        if not path:
            what = "the .npz file" if kind == "npz" else "the directory holding its IDX files"
            raise ConfigError(f"data.path: the {kind} dataset needs {what}")
        if kind == "npz":
            memory_map = spec.get("memory_map", False)
            if not isinstance(memory_map, bool):
                raise ConfigError(f"data.memory_map: expected true or false, got {memory_map!r}")
            return npz(path, test_fraction=None if tf is None else float(tf), seed=seed,
                       num_classes=_num_classes(spec), targets=targets, memory_map=memory_map,
                       ignore_index=ignore_index)
        return mnist(path, test_fraction=None if tf is None else float(tf), seed=seed, name=kind,
                     input_shape=input_shape)
    raise ConfigError(f"data.dataset: expected one of 'digits', 'mnist', 'fashion_mnist', 'npz', 'npy', "
                      f"'image_folder', 'csv', got {kind!r}")


def _num_classes(spec: dict) -> int | None:
    classes = spec.get("num_classes")
    if classes is not None and (isinstance(classes, bool) or not isinstance(classes, int) or classes < 1):
        raise ConfigError(f"data.num_classes: expected a positive integer, got {classes!r}")
    return classes
