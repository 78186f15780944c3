"""Samples read through memory maps: a ``.npy`` file, or an uncompressed (``np.savez``) ``.npz`` member mapped at
its data, so a dataset larger than memory trains with bounded memory. :class:`Mapped` stands for the samples as
float32: indexing it with a batch's rows reads and converts those rows alone (unsigned bytes scaled to [0, 1],
then normalised as the run says)."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
import threading
import tokenize
import zipfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .. import _checks
from ..errors import LeafpyError, SerializationError

CHUNK_BYTES = 1 << 25
"""About how many bytes of the file a pass over the samples (checks, fingerprint, statistics) reads at a time."""

RESIDENT_BYTES = 1 << 27
"""About how many bytes of a mapped file a process keeps mapped into its memory: once reads have touched this
many, the mapping's pages are let go (``madvise(MADV_DONTNEED)``: the file's data stays in the system's page cache,
only the process's resident set shrinks), so an epoch over a file larger than memory runs in bounded memory."""

FAULT_AROUND_BYTES = 1 << 16
"""What one read of a row may map besides the row itself (Linux maps up to 64 KiB of cached file pages around a
fault), counted against :data:`RESIDENT_BYTES` where the process's own count cannot be read (see
:func:`file_resident`)."""


LARGEST_FOLIO_BYTES = 1 << 21
"""The most one read of a row may map: a whole large folio of the page cache (2 MiB, the largest on x86-64 and on
arm64 with 4 KiB pages, is what Linux 6.16+ keeps ext4 files' cached pages in)."""
SCATTERED_READ_BYTES = 1 << 25
"""Scattered rows are read in groups that may map at most about this much (see :meth:`Mapped._read`)."""


def file_resident() -> int | None:
    """Bytes of files mapped into this process that are resident now (Linux: the third field of /proc/self/statm),
    or None where the system does not say. Read rather than estimated from the bytes read: kernels that keep a
    file's cached pages in large folios (Linux 6.16+ on ext4) map a whole folio, up to 2 MiB, when a 12 KiB row of
    it is read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[2]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return None


def _mapping_of(a: Any) -> mmap.mmap | None:
    """The mmap object under a memory-mapped array (np.memmap or a view of one), or None."""
    while a is not None:
        if isinstance(a, mmap.mmap):
            return a
        m = getattr(a, "_mmap", None)
        if isinstance(m, mmap.mmap):
            return m
        a = getattr(a, "base", None)
    return None


class Pages:
    """How much of one memory-mapped array reads have touched since its pages were last let go (shared by every
    :class:`Mapped` view of that array, and safe to count from several loader threads)."""

    def __init__(self, source: np.ndarray, budget: int | None = None) -> None:
        self.mapping = _mapping_of(source)
        self.budget = RESIDENT_BYTES if budget is None else budget
        self.touched = 0
        self._lock = threading.Lock()
        self.releases = 0
        self._resident = file_resident()  # the process's mapped file pages when they were last let go

    def read(self, nbytes: int) -> None:
        """Count ``nbytes`` read; once that many, or the process's resident file pages (where it can tell), have
        grown by the budget since the pages were last let go, unmap them (they map again from the page cache when
        read)."""
        if self.mapping is None or not hasattr(self.mapping, "madvise"):
            return
        with self._lock:
            self.touched += nbytes
            resident = file_resident()
            grown = 0 if resident is None or self._resident is None else resident - self._resident
            if self.touched < self.budget and grown < self.budget:
                return
            self.touched = 0
            self.releases += 1
            with contextlib.suppress(OSError, ValueError):  # a closed mapping (or a platform without the advice)
                self.mapping.madvise(getattr(mmap, "MADV_DONTNEED", 4))
            self._resident = file_resident()


class Mapped:
    """Samples [N, ...] kept in a memory-mapped array ``source`` (its rows ``rows``, in that order, where given):
    ``m[idx]`` is float32, read and converted for those rows only; ``prep`` (an lp.data.Preparation) normalises."""

    dtype = np.dtype(np.float32)

    def __init__(self, source: np.ndarray, rows: np.ndarray | None = None, prep: Any = None,
                 pages: Pages | None = None) -> None:
        self.source, self.rows, self.prep = source, rows, prep
        self.pages = pages if pages is not None else Pages(source)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.source.shape[1:])

    @property
    def ndim(self) -> int:
        return self.source.ndim

    def __len__(self) -> int:
        return len(self.source) if self.rows is None else len(self.rows)

    def __getitem__(self, idx: Any) -> np.ndarray:
        if isinstance(idx, (int, np.integer)):
            return self[np.array([idx])][0]
        idx = np.arange(len(self))[idx] if isinstance(idx, slice) else np.asarray(idx)
        return self.convert(self._read(idx if self.rows is None else self.rows[idx]))

    def _read(self, rows: Any) -> np.ndarray:
        """The file's rows ``rows`` (indices or a slice), copied out of the mapping and counted against its
        resident budget. Scattered rows are read a group at a time (:data:`SCATTERED_READ_BYTES` of mapping per
        group at most), each group counted before the next is read, so a long list of rows never maps the whole
        file first."""
        row_bytes = math.prod(self.source.shape[1:]) * self.source.dtype.itemsize
        if isinstance(rows, slice):  # one run of the file: a view, copied
            raw = np.array(self.source[rows])
            self.pages.read(len(raw) * row_bytes + FAULT_AROUND_BYTES)
            return raw
        rows = np.asarray(rows)
        if rows.dtype == bool and rows.ndim == 1:  # a mask: the indices of the rows it picks
            rows = np.arange(len(self.source))[rows]
        group = max(1, SCATTERED_READ_BYTES // max(row_bytes, LARGEST_FOLIO_BYTES))
        if rows.ndim != 1 or len(rows) <= group:  # (an index array of another shape reads at once, in its shape)
            raw = np.asarray(self.source[rows])
            self.pages.read(rows.size * (row_bytes + FAULT_AROUND_BYTES))
            return raw
        raw = np.empty((len(rows), *self.source.shape[1:]), self.source.dtype)
        for a in range(0, len(rows), group):
            raw[a:a + group] = self.source[rows[a:a + group]]
            self.pages.read(len(rows[a:a + group]) * (row_bytes + FAULT_AROUND_BYTES))
        return raw

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Every sample in memory (what a memory map is there to avoid: for small sets and checks)."""
        whole = np.concatenate(list(self.chunks())) if len(self) else np.empty(self.shape, np.float32)
        return whole if dtype is None else whole.astype(dtype)

    def convert(self, raw: np.ndarray) -> np.ndarray:
        """Rows of the file as samples: float32, unsigned bytes scaled to [0, 1], normalised by ``prep``."""
        x = np.array(raw, np.float32)
        if self.source.dtype == np.uint8:
            x /= np.float32(255.0)
        return x if self.prep is None else self.prep.inputs(x)

    def take(self, rows: np.ndarray) -> Mapped:
        """These samples (indices into this one), still mapped."""
        return Mapped(self.source, rows if self.rows is None else self.rows[rows], self.prep, self.pages)

    def normalized(self, prep: Any) -> Mapped:
        return Mapped(self.source, self.rows, prep, self.pages)

    def raw_chunks(self) -> Iterator[np.ndarray]:
        """The samples' rows as the file holds them, in order, about :data:`CHUNK_BYTES` at a time."""
        step = max(1, CHUNK_BYTES // max(1, math.prod(self.source.shape[1:]) * self.source.dtype.itemsize))
        for start in range(0, len(self), step):
            part = slice(start, start + step)
            yield self._read(part if self.rows is None else self.rows[part])

    def chunks(self) -> Iterator[np.ndarray]:
        """The samples as float32, in order, a chunk at a time."""
        for raw in self.raw_chunks():
            yield self.convert(raw)


def take(x: Any, rows: np.ndarray) -> Any:
    """``x[rows]``, still mapped where ``x`` is :class:`Mapped`."""
    return x.take(rows) if isinstance(x, Mapped) else x[rows]


def read_header(fh: Any, path: str, key: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, Fortran order, dtype) of the .npy header at ``fh``'s position (a file, or an .npz member), refused
    with a message naming ``path`` and ``key`` where it is damaged, holds Python objects or declares a negative
    dimension (NumPy's header parser takes one)."""
    try:
        version = np.lib.format.read_magic(fh)
        if version not in ((1, 0), (2, 0), (3, 0)):
            raise SerializationError(f"{path}: {key} has .npy format version {version}, which NumPy cannot read; "
                                     "write it again with np.save (or np.savez)")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(fh)
    except (ValueError, SyntaxError, EOFError, tokenize.TokenError) as e:
        if isinstance(e, LeafpyError):
            raise
        raise SerializationError(f"{path}: {key} is not a readable .npy array ({type(e).__name__}: {e}); write it "
                                 "again with np.save (or np.savez)") from e
    if dtype.hasobject:
        raise SerializationError(f"{path}: it holds arrays of Python objects ({key}); save plain arrays of numbers")
    if any(d < 0 for d in shape):
        raise SerializationError(f"{path}: {key} declares shape {tuple(shape)}, with a negative dimension; the file "
                                 "is damaged: write it again with np.save (or np.savez)")
    return tuple(shape), fortran, dtype


def _header(fh: Any, path: str, key: str, size: int) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, offset of the data in the file) of the .npy header at ``fh``'s position, whose array the
    file must hold whole within ``size`` bytes from there."""
    start = fh.tell()
    shape, fortran, dtype = read_header(fh, path, key)
    if fortran and len(shape) > 1:
        raise SerializationError(f"{path}: {key} is stored in Fortran order, which cannot be read a sample at a "
                                 f"time; save np.ascontiguousarray({key}) instead")
    offset = fh.tell()
    nbytes = math.prod(shape) * dtype.itemsize
    if offset - start + nbytes > size:
        raise SerializationError(f"{path}: {key} declares shape {tuple(shape)} of {dtype} ({nbytes} bytes), but the "
                                 f"file holds {size - (offset - start)} bytes for it; the file is truncated or "
                                 "damaged: write it again")
    return tuple(shape), dtype, offset


def _map(path: str, shape: tuple[int, ...], dtype: np.dtype, offset: int) -> np.ndarray:
    if math.prod(shape) == 0:  # (an empty array cannot be mapped; it is refused as a dataset later)
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def npy(path: str, key: str) -> np.ndarray:
    """A ``.npy`` file (np.save) mapped read-only, its header checked first."""
    try:
        with _checks.open_regular(path, "a NumPy .npy file") as fh:
            shape, dtype, offset = _header(fh, path, key, os.fstat(fh.fileno()).st_size)
        return _map(path, shape, dtype, offset)
    except OSError as e:
        if isinstance(e, LeafpyError):
            raise
        raise LeafpyError(f"{path}: cannot read the dataset: {e.strerror or e}") from e


@contextlib.contextmanager
def open_npz(path: str) -> Iterator[tuple[Any, zipfile.ZipFile, dict[str, zipfile.ZipInfo]]]:
    """An ``.npz`` file opened as a regular file (see ``_checks.open_regular``) and as a zip archive, with its
    arrays' entries by name; a file that is not a zip archive is refused."""
    with _checks.open_regular(path, "a NumPy .npz file") as fh:
        if not zipfile.is_zipfile(fh):
            raise SerializationError(f"{path}: not a NumPy .npz file (np.savez(path, x=..., y=...) writes one)")
        fh.seek(0)
        with zipfile.ZipFile(fh) as z:
            yield fh, z, {i.filename[:-4]: i for i in z.infolist() if i.filename.endswith(".npy")}


def npz(path: str, choose: Callable[[Sequence[str]], Sequence[str]]) -> dict[str, np.ndarray]:
    """The members of an uncompressed ``.npz`` file (np.savez) that ``choose`` picks from the names it holds,
    each mapped read-only at its data, after checking that it is stored (not compressed) and that its .npy header
    fits the space the archive gives it."""
    try:
        with open_npz(path) as (fh, _, infos):
            return {key: _member(fh, path, key, infos[key]) for key in choose(list(infos))}
    except (OSError, zipfile.BadZipFile, struct.error) as e:
        if isinstance(e, LeafpyError):
            raise
        raise SerializationError(f"{path}: not a readable NumPy .npz file ({e}); write it again with np.savez") from e


def _member(fh: Any, path: str, key: str, info: zipfile.ZipInfo) -> np.ndarray:
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        raise SerializationError(f"{path}: {key} is compressed (np.savez_compressed), and a memory map reads the "
                                 "data as stored; save the arrays with np.savez, or set data.memory_map: false")
    fh.seek(info.header_offset)
    local = fh.read(30)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise SerializationError(f"{path}: the zip entry of {key} is damaged; write the file again with np.savez")
    names, extra = struct.unpack("<HH", local[26:30])
    fh.seek(info.header_offset + 30 + names + extra)
    shape, dtype, offset = _header(fh, path, key, info.file_size)
    if offset + math.prod(shape) * dtype.itemsize > os.fstat(fh.fileno()).st_size:
        raise SerializationError(f"{path}: {key} runs past the end of the file; the file is truncated")
    return _map(path, shape, dtype, offset)
