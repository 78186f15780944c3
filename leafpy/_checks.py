"""Validation helpers for config dataclasses: each raises ConfigError naming the field, the value and the rule.

NumPy scalars (``np.float32(0.01)``, ``np.int64(3)``) are numbers like Python's; booleans are not. Every number
must be finite, and every integer fit in 64 bits (what arrays and the file format hold).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import mmap
import numbers
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from .errors import ConfigError

INT_LIMIT = 2**63 - 1
"""The largest integer a config holds (NumPy's shapes and the file format's counts are 64-bit)."""



def listed(value: object) -> bool:
    """Whether a setting given as a list is one: a list, tuple or other ordered collection, not text, a mapping (a
    YAML ``{}``) or a set (no order)."""
    return hasattr(value, "__iter__") and not isinstance(value, (str, bytes, Mapping, set, frozenset))


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def _integer(value: Any) -> int | None:
    """``value`` as an int when it is an integer (a Python or NumPy int, or a whole float), else None."""
    if _is_bool(value):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        if math.isfinite(v) and v == int(v):
            return int(v)
    return None


def first_non_index(values: np.ndarray, count: int) -> int | None:
    """The position of the first value that is not an integer index in [0, count) (NaN and infinities included),
    or None: how class labels and embedding ids are checked on the host."""
    flat = values.reshape(-1)
    if not flat.size:
        return None
    lo, hi = flat.min(), flat.max()  # (NaN is the minimum and the maximum where there is one)
    if lo >= 0 and hi < count and (flat.dtype.kind in "iub" or not (flat != np.floor(flat)).any()):
        return None  # (five calls over a batch's labels, checked every step: 4.7 against 8.2 us)
    bad = (flat < 0) | (flat >= count) | (flat != np.floor(flat))
    return int(np.argmax(bad)) if bad.any() else None


def positive_int(where: str, value: Any) -> int:
    as_int = _integer(value)
    if as_int is None or as_int <= 0 or as_int > INT_LIMIT:
        limit = f" up to {INT_LIMIT}" if as_int is not None and as_int > INT_LIMIT else ""
        raise ConfigError(f"{where}: expected a positive integer{limit}, got {value!r}")
    return as_int


def non_negative_int(where: str, value: Any) -> int:
    """As :func:`positive_int` takes them (a whole float such as YAML's ``2.0`` too), 0 included."""
    as_int = _integer(value)
    if as_int is None or not 0 <= as_int <= INT_LIMIT:
        raise ConfigError(f"{where}: expected a non-negative integer up to {INT_LIMIT}, got {value!r}")
    return as_int


def number(where: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
           min_open: bool = False, max_open: bool = False) -> float:
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    try:
        v = float(value)
    except OverflowError:  # an int beyond float's range
        v = math.inf
    if not math.isfinite(v):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    lo_bad = minimum is not None and (v <= minimum if min_open else v < minimum)
    hi_bad = maximum is not None and (v >= maximum if max_open else v > maximum)
    if lo_bad or hi_bad:
        lo = "" if minimum is None else ("(" if min_open else "[") + f"{minimum:g}"
        hi = "" if maximum is None else f"{maximum:g}" + (")" if max_open else "]")
        rng = f"{lo or '(-inf'}, {hi or 'inf)'}"
        raise ConfigError(f"{where}: expected a number in {rng}, got {value!r}")
    return v


def counter(value: Any, maximum: int = INT_LIMIT) -> bool:
    """Whether ``value`` is a count: an integer (not a bool) in [0, ``maximum``]."""
    return bool(isinstance(value, (int, np.integer)) and not _is_bool(value) and 0 <= value <= maximum)


def flag(where: str, value: Any) -> bool:
    """A true-or-false setting (a Python or NumPy bool)."""
    if not _is_bool(value):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return bool(value)


def path(where: str, value: Any) -> str:
    """A file path: a non-empty str or os.PathLike."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(f"{where}: expected a file path (a str or pathlib.Path), got {type(value).__name__} "
                          f"{value!r}")
    return os.fspath(value)


def choice(where: str, value: Any, valid: Iterable[str]) -> str:
    valid = list(valid)
    if value not in valid:
        raise ConfigError(f"{where}: expected one of {', '.join(map(repr, valid))}, got {value!r}")
    return value


def spatial(where: str, value: Any, *, minimum: int = 1, dims: int = 2) -> tuple[int, ...]:
    """One value for every spatial dimension, or one per dimension."""
    if isinstance(value, numbers.Integral) and not _is_bool(value):
        value = [value]
    if not isinstance(value, (list, tuple)) or len(value) not in (1, dims):
        raise ConfigError(f"{where}: expected one value or {dims} values (one per spatial dimension), got {value!r}")
    out = []
    for i, v in enumerate(value):
        if _is_bool(v) or not isinstance(v, numbers.Integral) or not minimum <= int(v) <= INT_LIMIT:
            kind = "positive" if minimum >= 1 else "non-negative"
            raise ConfigError(f"{where}[{i}]: expected a {kind} integer up to {INT_LIMIT}, got {v!r}")
        out.append(int(v))
    if len(out) == 1:
        out = out * dims
    return tuple(out)


def shape(where: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty list of positive integers, got {value!r}")
    return tuple(positive_int(f"{where}[{i}]", v) for i, v in enumerate(value))


def machine_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the system does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _bytes(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB"):
        if n < 1024 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PB"


NETWORK_BYTES = object()
"""The key under which a network's weight registry keeps the bytes its layers have declared so far."""


def allocation(where: str, what: dict[str, Sequence[Sequence[int]]], itemsize: int, fix: str,
               network: list[int] | None = None) -> int:
    """The bytes of a layer's arrays (``what``: a description -> their shapes; each held twice, as data and
    gradient). Refuses them, before anything is allocated, when they (or, with ``network``, a one-element list of
    the bytes its other layers declared, they together with the network's) exceed this machine's memory."""
    parts, need = [], 0
    for desc, shapes in what.items():
        count = sum(math.prod(int(d) for d in s) for s in shapes)
        need += 2 * count * itemsize
        if count:
            parts.append(f"{desc} {', '.join(str(list(s)) for s in shapes)}")
    limit = machine_memory()
    if limit is None:
        return need
    if need > limit:
        raise ConfigError(f"{where}: {'; '.join(parts)} need {_bytes(need)} (data and gradients), more than this "
                          f"machine's {_bytes(limit)} of memory; {fix}")
    if network is not None and network[0] + need > limit:
        raise ConfigError(f"{where}: with this layer ({_bytes(need)}) the network's weights and outputs need "
                          f"{_bytes(network[0] + need)} (data and gradients), more than this machine's "
                          f"{_bytes(limit)} of memory; use a smaller batch, fewer or smaller layers")
    return need


def open_regular(path: str, what: str, error: type[Exception] = ConfigError) -> Any:
    """``path`` opened for reading in binary, refusing what is not a regular file (a FIFO, a device, a directory)
    with ``error`` naming it, without blocking on it: a FIFO would wait forever for a writer, a device never end.
    Every reader of a user's file goes through here. The path is looked at before it is opened (opening a device
    can act on it), and what was opened is looked at again: the path may have been replaced in between, so the
    open itself never waits (O_NONBLOCK, cleared once the file is known to be regular). A missing or unreadable
    file is an OSError."""
    _refuse_special(os.stat(path).st_mode, path, what, error)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        _refuse_special(os.fstat(fd).st_mode, path, what, error)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_whole(path: str, what: str, limit: int, over: str, error: type[Exception] = ConfigError) -> memoryview:
    """The bytes of a regular file (see :func:`open_regular`) that is neither empty nor over ``limit`` bytes
    (``over`` says why that is the limit), read once into one writable buffer that is not zeroed first (arrays may
    be views of it); a file that changes size while it is read is refused."""
    try:
        with open_regular(path, what, error) as f:
            size = _sized(f, path, limit, over, error)
            data = np.empty(size, np.uint8)
            got = f.readinto(data)
            extra = f.read(1)
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from e
    if got != size or extra:
        raise error(f"{path}: the file changed size while it was read; read it again")
    return data.data


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
"""Linux 5.14's madvise that maps a file's cached pages in one call (without copying a private mapping's pages)."""


def map_whole(path: str, what: str, limit: int, over: str, error: type[Exception] = ConfigError) -> memoryview:
    """The bytes of a regular file, as :func:`read_whole` checks them, mapped into memory rather than read: a
    private, copy-on-write mapping (arrays may be views of it, and writing to them never reaches the file) whose
    pages are the page cache's own until written, so the file costs no memory of the process's own. The mapping
    lives as long as a view of it does. (Another process cutting the file short while it is mapped makes reading
    the lost pages fail with SIGBUS: leafpy's own writers replace files whole, by renaming.)"""
    try:
        with open_regular(path, what, error) as f:
            size = _sized(f, path, limit, over, error)
            try:
                mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            except OSError:  # a file system that cannot map files (some network and FUSE ones): read it whole
                return read_whole(path, what, limit, over, error)
            if os.fstat(f.fileno()).st_size != size:
                raise error(f"{path}: the file changed size while it was read; read it again")
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from e
    try:
        mapped.madvise(MADV_POPULATE_READ)  # (one call instead of a page fault per page)
    except (OSError, AttributeError, ValueError):  # an older kernel: the pages come in as they are read
        pass
    return memoryview(mapped)


def _sized(f: Any, path: str, limit: int, over: str, error: type[Exception]) -> int:
    """The size of the open file ``f``, refused when it is empty or over ``limit`` bytes."""
    size = os.fstat(f.fileno()).st_size
    if size == 0:
        raise error(f"{path}: the file is empty")
    if size > limit:
        raise error(f"{path}: the file is {size} bytes, over {over}")
    return int(size)


def regular_file(path: str, what: str, error: type[Exception] = ConfigError) -> None:
    """Refuse, before anything opens it, a path that is missing, a loop of symbolic links or not a regular file
    (see :func:`open_regular`), with ``error`` naming it and ``what`` to give instead."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}; give {what}") from None
    _refuse_special(mode, path, what, error)


def _refuse_special(mode: int, path: str, what: str, error: type[Exception]) -> None:
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket or other special file"
        raise error(f"{path}: {kind}, not a regular file; give the path of {what}")


_Config = TypeVar("_Config")


def strict_init(cls: type[_Config]) -> type[_Config]:
    """A config dataclass whose constructor reports positional arguments and unknown fields as ConfigErrors
    listing the valid fields (the generated ``__init__`` raises a bare TypeError). Fields that are not keyword-only
    may still be given by position, in order."""
    init = cls.__init__
    if getattr(init, "_strict_init", False):
        return cls
    fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    names = [f.name for f in fields]
    positional = sum(1 for f in fields if not f.kw_only)
    where = cls.__name__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > positional:
            allowed = (f"at most {positional} positional ({', '.join(names[:positional])})" if positional
                       else "keyword arguments only")
            raise ConfigError(f"{where}: takes {allowed}, got {len(args)} positional "
                              f"({', '.join(repr(a) for a in args)[:200]}); valid fields: {', '.join(names)}")
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise ConfigError(f"{where}: unknown field {unknown[0]!r}; valid fields: {', '.join(names)}")
        init(self, *args, **kwargs)

    __init__._strict_init = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


def _strip_trailing_ones(shape: Sequence[int]) -> tuple[int, ...]:
    out = tuple(shape)
    while out and out[-1] == 1:
        out = out[:-1]
    return out


def same_layout(got: Sequence[int], want: Sequence[int]) -> bool:
    """Whether an array of shape ``got`` may simply be reshaped to ``want``: they differ only by trailing axes of
    length 1 (labels [N] for [N, 1]), or ``want`` is a flat vector of as many numbers (images into a Linear
    network, flattened in row-major order as Caffe's InnerProduct does). Anything else of the same size
    (channels-last images for channels-first, a transposed gradient) is another layout, not to be guessed."""
    if _strip_trailing_ones(got) == _strip_trailing_ones(want):
        return True
    return len(want) == 1 and math.prod(got) == want[0]


def layout_hint(got: Sequence[int], want: Sequence[int], name: str = "x", first: int = 0) -> str:
    """A sentence for an error about an array of shape ``got`` where ``want`` was expected: the transpose that
    would give ``want`` (axes before ``first`` stay, e.g. the batch), or how to reshape when the sizes agree."""
    got, want = tuple(got), tuple(want)
    if len(got) == len(want) and got[:first] == want[:first]:
        best = None
        for perm in itertools.permutations(range(first, len(got))):
            if tuple(got[a] for a in perm) == want[first:]:
                inversions = sum(1 for i in range(len(perm)) for j in range(i) if perm[j] > perm[i])
                if best is None or inversions < best[0]:
                    best = (inversions, perm)
        if best is not None and best[0] > 0:
            axes = tuple(range(first)) + best[1]
            call = f"{name}.T" if axes == (1, 0) else f"{name}.transpose{axes}"
            return (f"; the same numbers in another layout (channels-last images for a channels-first input, or "
                    f"a transposed array?): {call} has the declared shape")
    if math.prod(got) == math.prod(want):
        shape = ("-1", *map(str, want[1:])) if first else tuple(map(str, want))  # any number of samples
        return (f"; it has as many numbers but another layout: if they are in the declared order, pass "
                f"{name}.reshape({', '.join(shape)})")
    return ""
