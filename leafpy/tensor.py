"""SharedTensor: one logical tensor with a copy per backend that touched it.

A tensor tracks which copies are fresh. Reading on a backend syncs that backend's copy only when it is stale;
writing makes that copy the only fresh one. Device copies sync through the host copy, and every host<->device
copy is counted, so tests can prove that a GPU training step does not move data back and forth.

Several SharedTensors may share one storage with different shapes (``alias``): that is how layers run in place
(an in-place ReLU's output is its input's storage; a Reshape's output is the same storage seen with a new shape).
A tensor may also use only the first elements of a larger storage (``prefix_view``): a container shares one
gradient buffer between layers whose backward passes do not overlap.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ConfigError, ShapeError

if TYPE_CHECKING:
    from .backends.base import Backend

HOST = "host"

_ACCESSES: ContextVar[list | None] = ContextVar("leafpy_tensor_accesses", default=None)


_VERSIONS = itertools.count(1)
"""Where every storage's version numbers come from: no two states of any storages share one."""


@contextmanager
def recording_accesses() -> Iterator[list]:
    """Within the block, every read/write/read_write of any SharedTensor (on this thread) appends
    ``(tensor, writes)`` to the yielded list: how a backend learns which tensors a recorded step touches."""
    accesses: list = []
    token = _ACCESSES.set(accesses)
    try:
        yield accesses
    finally:
        _ACCESSES.reset(token)


def recording() -> bool:
    """Whether a backend is recording a step on this thread (inside :func:`recording_accesses`): work skipped while
    recording would be missing from every replay of the step."""
    return _ACCESSES.get() is not None


_ARENAS: dict[int, weakref.ref] = {}
"""The host buffers :func:`host_arena` made, by id: storages in them may be laid out again."""


def _in_arena(buf: np.ndarray) -> bool:
    ref = _ARENAS.get(id(buf.base))
    return ref is not None and ref() is buf.base


def host_arena(tensors: Sequence[SharedTensor]) -> bool:
    """Lay the host copies of ``tensors`` (distinct storages of one dtype) out one after another in one new buffer,
    in the given order, their values kept: an elementwise pass over all of them is then one pass over one buffer.
    False (nothing moved) where a storage appears twice or its host copy is memory leafpy did not allocate (an
    array given to :meth:`SharedTensor.from_dlpack`, which must stay shared with its owner)."""
    storages = [t._st for t in tensors]
    if not storages or len({id(st) for st in storages}) != len(storages):
        return False
    dtype = storages[0].dtype
    if any(st.dtype != dtype for st in storages):
        return False
    for st in storages:
        entry = st.copies.get(HOST)
        if entry is not None and entry[1].base is not None and not _in_arena(entry[1]):
            return False
    arena = np.empty(sum(st.size for st in storages), dtype)
    offset = 0
    for st in storages:
        piece = arena[offset:offset + st.size]
        entry = st.copies.get(HOST)
        if entry is None:  # no host copy yet: zeros, as a new one would be (its freshness says where the values are)
            piece.fill(0)
        else:
            piece[...] = entry[1]
        st.copies[HOST] = (None, piece)
        offset += st.size
    key = id(arena)

    def forget(_: weakref.ref, key: int = key) -> None:
        _ARENAS.pop(key, None)
    _ARENAS[key] = weakref.ref(arena, forget)
    return True


def _plain_tensor(obj: Any) -> Any:
    """A PyTorch-like tensor's values as a tensor NumPy can take (detached from autograd, on the host, bfloat16 as
    float32, which holds each of its values exactly), or None for other objects or where that fails."""
    if not (hasattr(obj, "detach") and hasattr(obj, "float")):
        return None
    try:
        t = obj.detach()
        t = t.cpu() if hasattr(t, "cpu") else t
        return t.float() if "bfloat16" in str(getattr(t, "dtype", "")) else t
    except Exception:  # another library's object with these names: not ours to guess at
        return None


def as_numbers(array: Any, where: str) -> np.ndarray:
    """``array`` as a NumPy array of real numbers (bool, integer or float); anything else is a ShapeError naming
    ``where``."""
    try:
        a = np.asarray(array)
    except (ValueError, TypeError, RuntimeError) as e:  # ragged nested lists; a tensor NumPy cannot take as it is
        plain = _plain_tensor(array)  # (a PyTorch tensor that requires grad, or of bfloat16: its values)
        if plain is None:
            raise ShapeError(f"{where}: expected an array of numbers, got {type(array).__name__} ({e})") from None
        a = np.asarray(plain)
    if a.dtype.kind not in "biuf" and a.dtype.name != "bfloat16":  # bfloat16 (ml_dtypes): what bf16 tensors hold
        raise ShapeError(f"{where}: expected real numbers (bool, integer or float), got an array of dtype {a.dtype}")
    return a


def _key(backend: Any, method: str) -> str:
    """The key of ``backend``; anything but a backend is a ConfigError naming the method (the check costs nothing
    when ``backend`` is one)."""
    try:
        return backend.key
    except AttributeError:
        raise ConfigError(f"SharedTensor.{method}: expected a backend (leafpy.backend(name)), got "
                          f"{type(backend).__name__} {backend!r:.60}") from None


MAX_ELEMENTS = 1 << 60
"""The most values a tensor's shape may declare (8-byte values would pass a 64-bit size)."""


def _as_shape(shape: Sequence[int] | int) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
        shape = (int(shape),)
    if isinstance(shape, (str, bytes, Mapping)) or not hasattr(shape, "__iter__") or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) for d in shape):
        raise ShapeError(f"tensor shape: expected a tuple of integer dimensions, got {shape!r}"[:300])
    out = tuple(int(d) for d in shape)
    if any(d < 0 for d in out):
        raise ShapeError(f"tensor shape: expected non-negative dimensions, got {out}")
    if math.prod(out) > MAX_ELEMENTS:
        raise ShapeError(f"tensor shape: {out} declares {math.prod(out)} values, more than any buffer holds "
                         f"({MAX_ELEMENTS})"[:300])
    return out


class _Storage:
    """Flat buffers, one per backend key, and which of them hold the current data."""

    __slots__ = ("size", "dtype", "copies", "fresh", "version", "layouts", "scratch", "streamed")

    def __init__(self, size: int, dtype: np.dtype) -> None:
        self.size = size
        self.dtype = dtype
        # key -> (backend or None for the host, flat buffer)
        self.copies: dict[str, tuple[Any, Any]] = {}
        self.fresh: set[str] = set()
        self.version = next(_VERSIONS)
        # key -> the shape a channels-last backend's copy is laid out for (Backend.memory_order)
        self.layouts: dict[str, tuple[int, ...]] = {}
        # whether a write through a smaller view may drop the values past it (a gradient buffer shared by layers
        # whose backward passes do not overlap: no one reads what an earlier layer left there)
        self.scratch = False
        # whether the data is replaced every step (a network's input batch): uploaded with Backend.upload_batch
        self.streamed = False

    def changed(self) -> None:
        """The data may have changed: a new version."""
        self.version = next(_VERSIONS)


class SharedTensor:
    """A tensor whose data lives on one or more backends; see the module docstring."""

    transfers_total: int = 0
    """Host<->device copies made by all tensors since start (or since :meth:`reset_transfer_count`)."""
    __slots__ = ("_st", "_shape", "__weakref__")

    def __init__(self, shape: Sequence[int] | int, dtype: Any = np.float32) -> None:
        self._shape = _as_shape(shape)
        self._st = _Storage(math.prod(self._shape), np.dtype(dtype))

    # --- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_numpy(cls, array: Any, dtype: Any = None) -> SharedTensor:
        """A tensor whose only fresh copy is a host copy of ``array`` (``dtype`` defaults to the array's float type)."""
        a = as_numbers(array, "SharedTensor.from_numpy")
        if dtype is None:
            dtype = a.dtype if a.dtype in (np.float32, np.float64) else np.float32
        t = cls(a.shape, dtype)
        t.set(a)
        return t

    def alias(self, shape: Sequence[int] | None = None) -> SharedTensor:
        """Another tensor over the same storage, seen with ``shape`` (same number of elements)."""
        t = SharedTensor.__new__(SharedTensor)
        t._st = self._st
        t._shape = self._shape
        if shape is not None:
            t.reshape(shape)
        return t

    def shares_storage(self, other: SharedTensor) -> bool:
        """Whether both tensors are views of one storage (as a reshape or an in-place layer's output is)."""
        return self._st is other._st

    # --- shape --------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape."""
        return self._shape

    @property
    def size(self) -> int:
        """The number of values (the product of the shape)."""
        return math.prod(self._shape)

    @property
    def dtype(self) -> np.dtype:
        """The element type of the tensor's storage (float32, or float64 on a float64 native backend)."""
        return self._st.dtype

    @property
    def version(self) -> int:
        """A number that changes whenever the data may have changed through this tensor or another over the same
        storage (write, read_write, set, a replayed step's write, a resize), and that no other state of any tensor
        shares: a copy made from the data while it was at a version is still current while the version is."""
        return self._st.version

    def reshape(self, shape: Sequence[int]) -> None:
        """See the same data with a new shape of the same size; buffers are kept."""
        new = _as_shape(shape)
        if math.prod(new) != self.size:
            raise ShapeError(
                f"SharedTensor.reshape: {self._shape} has {self.size} elements, {new} has {math.prod(new)}; "
                "use resize() to change the size"
            )
        self._shape = new

    def resize(self, shape: Sequence[int]) -> None:
        """Change the shape; when the size changes the data reads as zeros (buffers are reallocated only to grow,
        so a batch that shrinks and grows back keeps its memory). Where no buffer holds the storage yet, it takes
        exactly the new size: a size no buffer was made for (a declared batch larger than any fed, a batch whose
        buffer could not be allocated) is not allocated later for a smaller one (a view that needs more grows the
        storage again when it is resized)."""
        new = _as_shape(shape)
        n = math.prod(new)
        if n != self.size:
            st = self._st
            if n > st.size or not st.copies:
                st.copies.clear()
                st.layouts.clear()
                st.size = n
            st.fresh.clear()
            st.changed()
        self._shape = new

    @property
    def streamed(self) -> bool:
        """Whether this tensor's data is replaced every step (a network's own input tensors are): its uploads then
        go through ``Backend.upload_batch``, which a backend may overlap with the step still running."""
        return self._st.streamed

    @streamed.setter
    def streamed(self, value: bool) -> None:
        self._st.streamed = bool(value)

    def prefix_view(self, shape: Sequence[int], *, grow: bool = False, scratch: bool = False) -> SharedTensor:
        """Another tensor over the first ``prod(shape)`` elements of this tensor's storage. A shape larger than the
        storage is a ShapeError unless ``grow``: then the storage is enlarged and its values are dropped (how a
        container sizes one gradient buffer for several layers). ``scratch`` marks the storage as one whose values
        past a write's own need not be kept (on a channels-last backend, such a write then rearranges nothing)."""
        new = _as_shape(shape)
        st = self._st
        st.scratch = st.scratch or scratch
        if math.prod(new) > st.size and not grow:
            raise ShapeError(f"SharedTensor.prefix_view: shape {new} needs {math.prod(new)} elements, the tensor's "
                             f"storage holds {st.size}; give a shape of at most {st.size} elements (grow=True "
                             "enlarges the storage and drops its values)")
        if math.prod(new) > st.size:
            st.copies.clear()
            st.layouts.clear()
            st.fresh.clear()
            st.size = math.prod(new)
            st.changed()
        t = SharedTensor.__new__(SharedTensor)
        t._st = st
        t._shape = new
        return t

    def _prefix(self, buf: Any) -> Any:
        n = math.prod(self._shape)
        return buf if n == self._st.size else buf[:n]

    # --- access -------------------------------------------------------------------------------------------
    def _buffer(self, backend: Backend | None, key: str, zeroed: bool = True) -> Any:
        st = self._st
        entry = st.copies.get(key)
        if entry is None:
            if backend is None:  # (np.empty for a buffer about to be overwritten: it takes huge pages, zeros not)
                buf: Any = np.zeros(st.size, st.dtype) if zeroed else np.empty(st.size, st.dtype)
            else:
                buf = backend.allocate(st.size, st.dtype)
            st.copies[key] = (backend, buf)
            return buf
        return entry[1]

    def _sync(self, backend: Backend | None, key: str) -> Any:
        st = self._st
        buf = self._buffer(backend, key)
        if key in st.fresh:
            return self._laid_out(backend, key, buf, convert=True)
        if not st.fresh:  # never written: zeros everywhere
            if backend is None:
                buf.fill(0)
            else:
                backend.fill(0.0, buf)
            st.fresh.add(key)
            return self._laid_out(backend, key, buf, convert=False)
        if key == HOST:
            src_key = next(iter(st.fresh))
            src_backend, src_buf = st.copies[src_key]
            laid = st.layouts.get(src_key)
            order = src_backend.memory_order(laid) if laid is not None and src_backend.channels_last else None
            if order is None:
                src_backend.download(src_buf, buf)
            else:  # back from the device's order to row-major
                assert laid is not None
                staged = np.empty_like(buf)
                src_backend.download(src_buf, staged)
                n = math.prod(laid)
                buf[n:] = staged[n:]
                buf[:n].reshape(laid)[...] = staged[:n].reshape([laid[i] for i in order]).transpose(
                    np.argsort(order))
            SharedTensor.transfers_total += 1
        else:
            host = self._sync(None, HOST)
            order = backend.memory_order(self._shape) if backend.channels_last else None  # type: ignore[union-attr]
            if order is not None:  # into the device's order
                host = host.copy()
                n = self.size
                host[:n] = np.ascontiguousarray(host[:n].reshape(self._shape).transpose(order)).reshape(-1)
            if st.streamed:
                backend.upload_batch(host, buf)  # type: ignore[union-attr]
            else:
                backend.upload(host, buf)  # type: ignore[union-attr]
            SharedTensor.transfers_total += 1
            st.layouts[key] = self._shape
        st.fresh.add(key)
        return buf

    def _laid_out(self, backend: Backend | None, key: str, buf: Any, convert: bool) -> Any:
        """``buf`` (the copy on ``backend``) laid out for this tensor's shape, on a backend whose memory order
        depends on the shape (channels-last). A copy is laid out for one shape of its storage at a time (the
        storage's first elements, the rest row-major); seen with another shape (an alias: a Flatten in place; a
        prefix view of another size), it is rewritten on the device: wholly when ``convert`` (the values are
        read), else only the elements past this tensor's (they are kept, unless the storage is scratch; the
        tensor's own are overwritten)."""
        if backend is None or not backend.channels_last:
            return buf
        st, shape = self._st, self._shape
        old = st.layouts.get(key)
        if old == shape:
            return buf
        st.layouts[key] = shape
        if old is None or key not in st.fresh:
            return buf
        n_old, n = math.prod(old), self.size
        old_order, new_order = backend.memory_order(old), backend.memory_order(shape)
        if old_order is None and new_order is None:
            return buf
        if convert and n_old == n:
            backend.relayout(buf[:n], old, shape)
            return buf
        if old_order is not None and (convert or (n_old > n and not st.scratch)):  # back to row-major
            backend.relayout(buf[:n_old], old, (n_old,))
        if convert and new_order is not None:
            backend.relayout(buf[:n], (n,), shape)
        return buf

    def read(self, backend: Backend) -> Any:
        """This tensor's data on ``backend``, synced if stale, for reading only."""
        key = _key(backend, "read")
        buf = self._sync(None if key == HOST else backend, key)
        accesses = _ACCESSES.get()
        if accesses is not None:
            accesses.append((self, False))
        return backend.view(self._prefix(buf), self._shape)

    def write(self, backend: Backend) -> Any:
        """A buffer on ``backend`` to overwrite completely; afterwards that copy is the only fresh one."""
        key = _key(backend, "write")
        buf = self._laid_out(backend, key, self._buffer(None if key == HOST else backend, key), convert=False)
        st = self._st
        st.fresh.clear()
        st.fresh.add(key)
        st.changed()
        accesses = _ACCESSES.get()
        if accesses is not None:
            accesses.append((self, True))
        return backend.view(self._prefix(buf), self._shape)

    def read_write(self, backend: Backend) -> Any:
        """This tensor's data on ``backend``, synced, to modify in place; afterwards that copy is the only fresh one."""
        key = _key(backend, "read_write")
        buf = self._sync(None if key == HOST else backend, key)
        st = self._st
        if len(st.fresh) > 1:
            st.fresh.clear()
            st.fresh.add(key)
        st.changed()
        accesses = _ACCESSES.get()
        if accesses is not None:
            accesses.append((self, True))
        return backend.view(self._prefix(buf), self._shape)

    def buffer_on(self, key: str) -> Any:
        """The flat buffer of the copy on backend ``key`` (None if there is none), without syncing."""
        entry = self._st.copies.get(key)
        return None if entry is None else entry[1]

    @staticmethod
    def touched(accesses: list) -> list:
        """The distinct tensors of a :func:`recording_accesses` list as (tensor, written), in first-access order."""
        seen: dict = {}
        for t, writes in accesses:
            prev = seen.get(id(t))
            seen[id(t)] = (t, writes or (prev is not None and prev[1]))
        return list(seen.values())

    def mark_fresh_only(self, key: str) -> None:
        """Record that the copy on ``key`` was written outside read/write (a replayed step)."""
        self._st.fresh.clear()
        self._st.fresh.add(key)
        self._st.changed()

    def to_numpy(self) -> np.ndarray:
        """A host copy of the data (syncs from a device when the host copy is stale)."""
        return self._prefix(self._sync(None, HOST)).reshape(self._shape).copy()

    def set(self, array: Any) -> None:
        """Copy host data in (cast to this tensor's dtype); every device copy becomes stale."""
        a = as_numbers(array, "SharedTensor.set")
        if a.shape != self._shape:
            if a.size == self.size and a.ndim <= 1 and len(self._shape) <= 1:
                a = a.reshape(self._shape)
            else:
                raise ShapeError(f"SharedTensor.set: expected an array of shape {self._shape}, got {a.shape}")
        buf = self._buffer(None, HOST, zeroed=a.size < self._st.size)
        np.copyto(self._prefix(buf).reshape(self._shape), a, casting="unsafe")
        st = self._st
        st.fresh.clear()
        st.fresh.add(HOST)
        st.changed()

    def peek_host(self) -> np.ndarray | None:
        """The host data without syncing or copying, or None when the host copy is stale (for cheap checks)."""
        if HOST not in self._st.fresh:
            return None
        return self._prefix(self._st.copies[HOST][1]).reshape(self._shape)

    def is_fresh_on(self, key: str) -> bool:
        """Whether the copy on the device ``key`` ("host" or a backend's key) holds the current values."""
        return key in self._st.fresh

    @classmethod
    def reset_transfer_count(cls) -> None:
        """Sets the count of host<->device transfers of all tensors (``transfers_total``) back to zero."""
        cls.transfers_total = 0

    # --- interop: NumPy's array protocol and DLPack ------------------------------------------------------------
    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """``np.asarray(t)``: the data on the host (synced first). Without a copy it is a read-only view of the
        host copy, which changes when a native network next writes this tensor; ``np.array(t)`` copies. A Solver
        made on the native backend lays its network's weights out anew (:func:`host_arena`): a view of a weight
        taken before that keeps the values it had."""
        host = self._prefix(self._sync(None, HOST)).reshape(self._shape)
        if copy is True or (dtype is not None and np.dtype(dtype) != host.dtype):
            if copy is False:
                raise ValueError(f"SharedTensor holds {host.dtype}; a {np.dtype(dtype)} array needs a copy")
            return host.astype(dtype if dtype is not None else host.dtype, copy=True)
        view = host.view()
        view.flags.writeable = False
        return view

    def _fresh_device(self) -> tuple[Any, Any] | None:
        """(backend, flat buffer) of a fresh CUDA copy, which DLPack can hand out without a transfer."""
        for key in self._st.fresh:
            if key.startswith("cuda:"):
                return self._st.copies[key]
        return None

    def __dlpack_device__(self) -> tuple[int, int]:
        """Where :meth:`__dlpack__` hands the data out: a fresh CUDA copy's GPU (2, id), else the host (1, 0)."""
        device = self._fresh_device()
        if device is not None:
            return (2, int(device[0].device.id))
        return (1, 0)

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        """DLPack export without a copy: a fresh CUDA copy as it is on its GPU, otherwise the host copy (synced
        from a webgpu copy first). The consumer sees leafpy's buffer: write into it only through leafpy
        (``set``, ``SharedTensor.from_dlpack``), or the other copies would not know it changed."""
        device = self._fresh_device()
        kwargs: dict[str, Any] = {"stream": stream}
        if max_version is not None:
            kwargs["max_version"] = max_version
        if dl_device is not None:
            kwargs["dl_device"] = dl_device
        if copy is not None:
            kwargs["copy"] = copy
        if device is not None:
            be = device[0]
            array = be.view(self._prefix(self._laid_out(be, be.key, device[1], convert=True)), self._shape)
        else:
            array = self._prefix(self._sync(None, HOST)).reshape(self._shape)
            kwargs.pop("stream")
            if stream is not None and stream != -1:
                raise BufferError("SharedTensor.__dlpack__: the data is on the host; a stream applies to GPU data")
        try:
            return array.__dlpack__(**kwargs)
        except TypeError:  # an array library that predates DLPack 1.0's keywords
            return array.__dlpack__(**({"stream": stream} if device is not None else {}))

    @classmethod
    def from_dlpack(cls, obj: Any) -> SharedTensor:
        """A tensor over ``obj``'s memory (NumPy, CuPy, PyTorch... anything with ``__dlpack__``), without a copy
        when it is contiguous float32 or float64: on the host it becomes the host copy, on an NVIDIA GPU the copy
        of leafpy's cuda backend for that device. Other layouts are copied (float64 staying float64), other dtypes
        copied as float32."""
        if not hasattr(obj, "__dlpack_device__"):
            raise ShapeError(f"SharedTensor.from_dlpack: expected an object with __dlpack__ and __dlpack_device__ "
                             f"(a NumPy, CuPy or PyTorch array), got {type(obj).__name__}")
        if isinstance(obj, np.ndarray) and not obj.dtype.isnative:  # DLPack has no byte order: a copy, as
            obj = obj.astype(obj.dtype.newbyteorder("="))  # other layouts get
        kind, index = (int(v) for v in obj.__dlpack_device__())
        if kind == 1:  # kDLCPU
            try:
                array = np.from_dlpack(obj)
            except (RuntimeError, BufferError, TypeError, ValueError) as e:  # a dtype NumPy lacks, or autograd's
                plain = _plain_tensor(obj)
                if plain is None:
                    raise ShapeError(f"SharedTensor.from_dlpack: cannot take this {type(obj).__name__} ({e}); give "
                                     "float32 or float64 values (a PyTorch tensor: .detach().float())") from None
                values = np.from_dlpack(plain)  # a copy, as for other dtypes (float64 kept, as it is shared)
                return cls.from_numpy(values, None if values.dtype == np.float64 else np.float32)
            if array.dtype not in (np.float32, np.float64) or not array.flags.c_contiguous \
                    or not array.flags.writeable:
                return cls.from_numpy(array, np.float32 if array.dtype != np.float64 else None)
            t = cls(array.shape, array.dtype)
            t._st.copies[HOST] = (None, array.reshape(-1))
            t._st.fresh.add(HOST)
            return t
        if kind == 2:  # kDLCUDA
            from .backends import backend

            be = backend("cuda") if index == 0 else backend("cuda", device=index)
            xp = be.xp  # type: ignore[attr-defined]
            with xp.cuda.Device(index):
                array = xp.from_dlpack(obj)
                if array.dtype not in (np.float32, np.float64) or not array.flags.c_contiguous:
                    array = xp.ascontiguousarray(array, dtype=np.float32 if array.dtype != np.float64 else None)
            t = cls(array.shape, array.dtype)
            t._st.copies[be.key] = (be, array.reshape(-1))
            t._st.fresh.add(be.key)
            return t
        raise ShapeError(f"SharedTensor.from_dlpack: data on DLPack device type {kind} is not supported (host and "
                         "NVIDIA GPUs are)")

    def __repr__(self) -> str:
        return f"SharedTensor(shape={self._shape}, dtype={self._st.dtype}, fresh={sorted(self._st.fresh)})"
