"""leafpy's file format: the header (marker, format version, kind, sizes, CRC-32), the packed message and the raw
section of weights after it; named arrays in and out of messages; the checks every file read passes (its size
capped, the parser's traversal and nesting limits, the checksum, finite weights) and the errors that name the file.

Format 2 keeps the message small: the weights follow it in a raw section, written straight from the arrays'
buffers (the checksum computed beside the writing, the header written last) and read back as views of the file's
private mapping (the checksum computed beside the reading, verified before the reader's work is kept). Format 1
files (the weights inside the message) and Leaf's bare packed messages still load.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np

from .. import _checks
from .._memory import available_memory
from ..errors import ConfigError, LeafpyError, SerializationError, ShapeError
from .codec import schema

MAX_WORDS = 2**34
"""The most 8-byte words a message may unpack to (128 GB): the traversal limit a file's own size does not lower."""
NESTING_LIMIT = 1024
"""How deep a message's pointers may nest (each nested Sequential takes four levels)."""

MAGIC = b"\x89LEAFPY\n"
"""The first bytes of every file leafpy writes (Leaf's files, bare packed messages, have none)."""
FORMAT_VERSION = 2
"""1: the weights inside the message (``Tensor.raw``); 2: in the raw section after it (``Tensor.offset``)."""
RAW_ALIGN = 64
"""Format 2: the raw section, and each array in it, starts at a multiple of this many bytes from the file's start."""
_PAD = bytes(RAW_ALIGN)
_KINDS = {"Layer": 1, "SolverCheckpoint": 2}
_HEADER = struct.Struct("<8sIIQQI")
"""magic, format version, kind (1 model, 2 checkpoint), the message's unpacked size in words, the packed
payload's length in bytes, and a CRC-32 of the header's other fields and everything after the header (format 2:
the packed message, zeros up to the next multiple of RAW_ALIGN, and the raw section, which runs to the end)."""


try:  # ISA-L's CRC-32 (python-isal, a dependency): zlib's values at several times its speed; zlib where isal is
    # missing (a platform without its wheel)
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32


def _checksum(header_fields: bytes | memoryview, chunks: Iterable[bytes | memoryview]) -> int:
    crc = crc32(header_fields)
    for chunk in chunks:
        crc = crc32(chunk, crc)
    return crc & 0xFFFFFFFF


def _raw_start(length: int) -> int:
    """Where a format-2 file's raw section starts, after a packed message of ``length`` bytes."""
    end = _HEADER.size + length
    return end + (-end % RAW_ALIGN)


class _RawSection:
    """The arrays a format-2 file holds after its message, each starting RAW_ALIGN-aligned: kept as views of the
    arrays themselves, so that writing them copies nothing."""

    def __init__(self) -> None:
        self.chunks: list[bytes | memoryview] = []
        self.size = 0

    def add(self, flat: np.ndarray) -> int:
        """Append a contiguous little-endian float32 array; returns its offset in the section."""
        offset = self.size
        pad = -flat.nbytes % RAW_ALIGN
        self.chunks += [flat.data.cast("B"), _PAD[:pad]]
        self.size += flat.nbytes + pad
        return offset


def _encode_parts(msg: Any, struct_name: str, section: _RawSection | None = None) -> list[bytes | memoryview]:
    """A leafpy file as buffers to write one after the other: the header (marker, version, kind, sizes, checksum),
    the packed message and, when ``section`` holds arrays, padding and the raw section."""
    fields, rest = _unsealed(msg, struct_name, section)
    return [fields + struct.pack("<I", _checksum(fields, rest)), *rest]


def _unsealed(msg: Any, struct_name: str, section: _RawSection | None) -> tuple[bytes, list[bytes | memoryview]]:
    """(the header's fields but its checksum, the buffers after the header) of a leafpy file."""
    payload = msg.to_bytes_packed()
    words = int(msg.total_size.word_count) + 1
    fields = _HEADER.pack(MAGIC, FORMAT_VERSION, _KINDS[struct_name], words, len(payload), 0)[:-4]
    rest: list[bytes | memoryview] = [payload]
    if section is not None and section.size:
        rest += [_PAD[:_raw_start(len(payload)) - _HEADER.size - len(payload)], *section.chunks]
    return fields, rest


def _file_writer(msg: Any, struct_name: str, section: _RawSection) -> Callable[[BinaryIO], None]:
    """What writes a leafpy file into an open file (for :func:`atomic_write`): the buffers after the header while
    the checksum is computed beside them, then the header."""
    fields, rest = _unsealed(msg, struct_name, section)

    def write(f: BinaryIO) -> None:
        check = _Checksum(fields, rest)
        try:
            f.write(bytes(_HEADER.size))
            for chunk in rest:
                f.write(chunk)
        finally:
            crc = check.value()  # (the buffers are the caller's: nothing reads them once this returns)
        f.seek(0)
        f.write(fields + struct.pack("<I", crc))
    return write


def encode(msg: Any, struct_name: str) -> bytes:
    """A leafpy file of ``msg`` alone (its weights, if any, inside it as ``Tensor.raw``): the header and the packed
    message."""
    return b"".join(_encode_parts(msg, struct_name))


def _read_file(path: str) -> memoryview:
    # a missing file, no permission, a FIFO, a device, a directory: refused without waiting; the file mapped, not
    # read: the weights are views of its pages
    limit = sys.modules[__package__].MAX_FILE_BYTES  # the package's setting, whenever it was changed
    return _checks.map_whole(path, "a .leaf file", limit, f"the limit of {limit} (leafpy.serialization.MAX_FILE_BYTES)",
                             SerializationError)


def file_kind(path: str | os.PathLike) -> str:
    """What a file's header says it holds: "model" or "checkpoint" (a leafpy file), else "bare" (Leaf's files and
    leafpy's before the header, which hold models; and anything else, which reading then refuses)."""
    try:  # (a FIFO or a device is refused without blocking on it)
        with _checks.open_regular(os.fspath(path), "a .leaf file", SerializationError) as f:
            head = f.read(_HEADER.size)
    except (OSError, SerializationError):
        return "bare"  # (reading it reports why)
    if len(head) < _HEADER.size or head[:len(MAGIC)] != MAGIC:
        return "bare"
    return {1: "model", 2: "checkpoint"}.get(_HEADER.unpack_from(head)[2], "bare")


def _read_message(path: str | os.PathLike, struct_name: str) -> Any:
    """The message of a leafpy file (its header checked) or of a Leaf file (a bare packed message), parsed from
    memory with limits that a hostile file cannot push past its own size."""
    message, _ = read_message(os.fspath(path), struct_name)
    return message


def read_message(path: str, struct_name: str) -> tuple[Any, str]:
    """(message, origin): origin "leafpy" for a file with leafpy's header, "bare" for a bare packed message
    (Leaf 0.2.1's files, and leafpy's before the header)."""
    msg, origin, _ = _read_parts(path, struct_name)
    return msg, origin


def _read_parts(path: str, struct_name: str) -> tuple[Any, str, memoryview | None]:
    """(message, origin, raw section): what :func:`read_message` gives, and the raw section of a format-2 file
    (a view of the file's mapping; None for other files), its checksum verified."""
    with _opened_parts(path, struct_name) as parts:
        return parts


THREADED_CHECKSUM = 1 << 22
"""A file of at least this many bytes has its checksum computed in a thread, while it is being read."""


class _Checksum:
    """The CRC-32 of a leafpy file's header fields and the buffers after the header, computed while the caller
    reads or writes the file (in a thread for a large file: zlib and ISA-L release the GIL)."""

    def __init__(self, header: bytes | memoryview, rest: Sequence[bytes | memoryview]) -> None:
        self.found = -1
        self.thread = threading.Thread(target=self._compute, args=(header, rest), daemon=True)
        if sum(len(chunk) for chunk in rest) < THREADED_CHECKSUM:
            self._compute(header, rest)
        else:
            self.thread.start()

    def _compute(self, header: bytes | memoryview, rest: Sequence[bytes | memoryview]) -> None:
        self.found = _checksum(header, rest)

    def value(self) -> int:
        """The checksum, once computed."""
        if self.thread.ident is not None:
            self.thread.join()
        return self.found


def _verify(pending: list[tuple[str, _Checksum, int]]) -> None:
    for path, check, expected in pending:
        if check.value() != expected:
            raise SerializationError(f"{path}: checksum mismatch: the file is corrupted; use another copy")


@contextlib.contextmanager
def _opened_parts(path: str, struct_name: str) -> Iterator[tuple[Any, str, memoryview | None]]:
    """(message, origin, raw section) of a file, read while its checksum is computed: the checksum is verified on
    leaving, and on any error inside (a damaged file is reported as one, whatever else it made go wrong)."""
    pending: list[tuple[str, _Checksum, int]] = []
    try:
        yield _parse_parts(path, struct_name, _read_file(path), pending)
    except Exception:
        _verify(pending)
        raise
    _verify(pending)


def _parse_parts(path: str, struct_name: str, data: memoryview,
                 pending: list[tuple[str, _Checksum, int]]) -> tuple[Any, str, memoryview | None]:
    """The parts of the file ``data``; a leafpy file's checksum is started and appended to ``pending``."""
    raw = None
    if data[:len(MAGIC)] == MAGIC:
        if len(data) < _HEADER.size:
            raise SerializationError(f"{path}: a leafpy file cut short in its header (truncated)")
        _, version, kind, words, length, crc = _HEADER.unpack_from(data)
        if version > FORMAT_VERSION:
            raise SerializationError(f"{path}: written by a newer leafpy (file format {version}, this leafpy reads "
                                     f"up to {FORMAT_VERSION}); upgrade leafpy")
        rest = data[_HEADER.size:]
        start = _raw_start(length) - _HEADER.size
        if len(rest) != length and (version < 2 or len(rest) < start):
            raise SerializationError(f"{path}: the file holds {len(rest)} bytes of data where its header "
                                     f"declares {length} (truncated or appended to)")
        pending.append((path, _Checksum(data[:_HEADER.size - 4], [rest]), crc))
        wanted = _KINDS[struct_name]
        if kind != wanted:
            other = {v: k for k, v in _KINDS.items()}.get(kind, f"kind {kind}")
            raise SerializationError(f"{path}: holds a {other}, not a {struct_name}"
                                     f"{MALFORMED_HINT.get(struct_name, '')}")
        origin = "leafpy"
        payload = rest[:length]
        if version >= 2:
            raw = rest[start:]
    else:
        payload = data
        words = 128 * len(data)  # a Leaf file carries no size: packing turns at most 256 zero words into 2 bytes
        origin = "bare"
    # reading a field again counts its words again: allow 8 readings of each word, and never more words than
    # the packed bytes can expand to, whatever a (hostile) header declares
    limit = min(8 * min(words, 128 * len(payload)) + 1024, MAX_WORDS)
    packed = bytes(payload)
    missing, unpacked = _packed_shortfall(packed)
    if missing:
        raise SerializationError(f"{path}: not a valid leafpy/Leaf {struct_name} file (truncated, corrupted or "
                                 f"another format): {missing}")
    available, need = available_memory(), 8 * unpacked
    if available is not None and need > available:  # (packing turns 2 KB of zeros into 2 bytes)
        raise SerializationError(f"{path}: its message unpacks to {need:,} bytes ({_checks._bytes(need)}), more than "
                                 f"the {_checks._bytes(available)} of memory this process has available; the file is "
                                 "damaged, or load it where more memory is available")
    try:
        msg = getattr(schema(), struct_name).from_bytes_packed(packed, traversal_limit_in_words=limit,
                                                               nesting_limit=NESTING_LIMIT)
    except Exception as e:  # capnp reports malformed input as KjException
        raise SerializationError(f"{path}: not a valid leafpy/Leaf {struct_name} file (truncated, corrupted or "
                                 f"another format): {_short(e)}") from None
    return msg, origin, raw


def _packed_shortfall(data: bytes) -> tuple[str, int]:
    """What is wrong with the packed message ``data`` ("" where nothing): a segment table cut short, or a packing
    that unpacks to other than the words its segment table declares; and the words it unpacks to (0 where it is
    wrong). Cap'n Proto's packed reader takes the table on trust and reads segments as they are used; one that ends
    early, or a run of words past the last, makes its reader throw as it is freed, which ends the process (C++'s
    terminate). Walks the packing's tags: a run of literal or zero words is one step, so dense weights cost a step
    per 2 KB, words with zero bytes one each."""
    n = len(data)
    head, pos, words = _packed_head(data)
    if len(head) < 8:
        return "its segment table is cut short", 0
    count = int.from_bytes(head[:4], "little") + 1
    if count > MAX_SEGMENTS:
        return f"its segment table declares {count} segments (at most {MAX_SEGMENTS})", 0
    table = count // 2 + 1
    if len(head) < 8 * table:
        head, pos, words = _packed_head(data, table)
        if len(head) < 8 * table:
            return "its segment table is cut short", 0
    declared = table + sum(int.from_bytes(head[4 + 4 * i:8 + 4 * i], "little") for i in range(count))
    steps = _STEPS
    try:
        while words < declared and pos < n:
            tag = data[pos]
            if tag == 0:
                words += 1 + data[pos + 1]
                pos += 2
            elif tag == 0xFF:
                run = data[pos + 9]
                words += 1 + run
                pos += 10 + 8 * run
            else:
                words += 1
                pos += steps[tag]
    except IndexError:
        return "its packing ends inside a run of words", 0
    if pos > n:
        return "its packing ends inside a word", 0
    if words < declared:
        return f"its segments declare {declared} words where its bytes hold {words}", 0
    if words > declared:
        return f"its packing runs {words - declared} words past its segments", 0
    return "", declared


def _packed_head(data: bytes, table: int = 1) -> tuple[bytearray, int, int]:
    """The first words of a packed message unpacked, at least ``table`` of them where the bytes hold them; the
    position after the tag run they end in and the words unpacked to there."""
    n, pos, words = len(data), 0, 0
    head = bytearray()
    while pos < n and len(head) < 8 * table:
        tag = data[pos]
        pos += 1
        word = bytearray(8)
        for bit in range(8):
            if tag >> bit & 1:
                word[bit] = data[pos] if pos < n else 0
                pos += 1
        head += word
        words += 1
        if tag in (0, 0xFF) and pos < n:
            run = data[pos]
            pos += 1
            head += bytes(8 * run) if tag == 0 else data[pos:pos + 8 * run]
            pos += 8 * run if tag == 0xFF else 0
            words += run
        if pos > n:
            return bytearray(), pos, words
    return head, pos, words


_STEPS = bytes(1 + bin(i).count("1") for i in range(256))
"""The bytes a packed word of each tag takes (its tag and its nonzero bytes; 0x00 and 0xFF are walked apart)."""
MAX_SEGMENTS = 512
"""Cap'n Proto's readers refuse messages of more segments."""


def editable_message(path: str | os.PathLike, struct_name: str) -> Any:
    """A builder of the message in a leafpy or Leaf file with its weights inside it (``Tensor.raw``, as format 1
    kept them), for tools and tests that change a file: :func:`encode` writes it back."""
    path = os.fspath(path)
    msg, _, raw = _read_parts(path, struct_name)
    builder = msg.as_builder()
    if raw is not None:
        for weights in _weight_lists(builder, struct_name):
            for w in weights:
                if not len(w.tensor.raw) and not len(w.tensor.data):
                    count = math.prod(int(d) for d in w.tensor.shape)
                    w.tensor.raw = _from_section(raw, int(w.tensor.offset), count, w.name, path).tobytes()
                    w.tensor.offset = 0
    return builder


def _weight_lists(msg: Any, struct_name: str) -> list[Any]:
    if struct_name == "Layer":
        return [msg.weightsData]
    return [msg.network.weightsData, msg.state, msg.accumulated]


def _short(e: Exception) -> str:
    """The reason in a capnp exception, without its source location and stack addresses."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip() and not ln.startswith("stack:")]
    if not lines:
        return type(e).__name__
    text = lines[0]
    if "failed:" in text:
        text = text.split("failed:", 1)[1].strip()
    if "; " in text and text.startswith("expected "):
        text = text.split("; ", 1)[1]  # capnp's internal condition, then its explanation
    return text[:200]


MALFORMED_HINT = {
    "Layer": " (if it is a solver checkpoint: Solver.load_checkpoint reads it)",
    "SolverCheckpoint": " (if it is a model file: Layer.load reads it; `leafpy train --resume` needs a checkpoint)",
}


@contextlib.contextmanager
def reading(path: str, struct: str = "") -> Iterator[None]:
    """Around a reading step: anything but a LeafpyError becomes a SerializationError naming the file (and, for a
    ``struct`` of the wrong kind, the reader that takes it); a ConfigError or ShapeError (a config or a weight in
    the file that does not fit) becomes a SerializationError that names the file too."""
    try:
        yield
    except (ConfigError, ShapeError, SerializationError) as e:
        if str(e).startswith(path):
            raise
        raise SerializationError(f"{path}: {e}") from e
    except LeafpyError:
        raise
    except RecursionError:
        raise SerializationError(f"{path}: its layers are nested too deep to read (containers inside containers "
                                 "hundreds of levels down); the file is damaged or was not written by leafpy") from None
    except Exception as e:
        raise SerializationError(f"{path}: malformed contents: {_short(e)}{MALFORMED_HINT.get(struct, '')}") from None


def _guard(path: str, fn: Callable[[], Any], struct: str = "") -> Any:
    with reading(path, struct):
        return fn()


def _write_weights(builder_list: Any, items: list[tuple[str, np.ndarray]], leaf: bool = False,
                   section: _RawSection | None = None) -> None:
    """Named arrays; leafpy stores raw little-endian float32 bytes (in ``section``, the raw section after the
    message, where given), Leaf (``leaf``) a List(Float32)."""
    for i, (name, arr) in enumerate(items):
        builder_list[i].name = name
        t = builder_list[i].init("tensor")
        t.shape = list(arr.shape)
        with np.errstate(over="ignore"):  # values too large for float32 were refused, or allowed, before
            flat = np.ascontiguousarray(arr, dtype="<f4").reshape(-1)
        if leaf:
            t.data = flat.tolist()
        elif section is not None:
            t.offset = section.add(flat)
        else:
            t.raw = flat.tobytes()


def _read_weights(reader_list: Any, where: str, raw_section: memoryview | None = None) -> dict[str, np.ndarray]:
    """Named arrays, each checked against its declared shape before anything is allocated for it; a name given
    twice is refused (one copy would silently win). A format-2 file's arrays are views of its ``raw_section``."""
    out: dict[str, np.ndarray] = {}
    for w in reader_list:
        if w.name in out:
            raise SerializationError(f"{where}: weight {w.name!r} appears twice in the file, and only one copy can "
                                     "be the weight; the file is damaged or was not written by leafpy")
        shape = tuple(int(d) for d in w.tensor.shape)
        count = math.prod(shape)
        raw = w.tensor.raw
        if len(raw):
            if len(raw) != 4 * count:
                raise SerializationError(f"{where}: weight {w.name!r} declares shape {shape} ({count} values) but "
                                         f"holds {len(raw)} bytes")
            data = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        elif raw_section is not None and count and not len(w.tensor.data):
            data = _from_section(raw_section, int(w.tensor.offset), count, w.name, where)
        else:
            values = w.tensor.data
            if len(values) != count:
                raise SerializationError(f"{where}: weight {w.name!r} declares shape {shape} ({count} values) but "
                                         f"holds {len(values)} values")
            available, need = (available_memory() if count else None), 4 * count
            if available is not None and need > available:
                raise SerializationError(f"{where}: weight {w.name!r} declares shape {shape} ({count:,} values, "
                                         f"{_checks._bytes(need)}), more than the {_checks._bytes(available)} of "
                                         "memory this process has available; the file is damaged, or load it where "
                                         "more memory is available")
            data = np.fromiter(values, np.float32, count=count)  # (Leaf's List(Float32); no Python list between)
        out[w.name] = data.reshape(shape)
    return out


def _from_section(raw_section: memoryview, offset: int, count: int, name: str, where: str) -> np.ndarray:
    """The ``count`` float32 values at byte ``offset`` of a raw section, as a view (no copy on little-endian
    machines), once they are known to lie inside it."""
    if offset + 4 * count > len(raw_section):
        raise SerializationError(f"{where}: weight {name!r} holds {count} values from byte {offset} of the file's "
                                 f"raw section, which has {len(raw_section)} bytes; the file is damaged (truncated "
                                 "or not written by leafpy)")
    return np.frombuffer(raw_section, dtype="<f4", count=count, offset=offset).astype(np.float32, copy=False)


def _non_finite(arr: np.ndarray) -> str:
    """What is not finite in ``arr`` once stored as float32 ("3 NaN values, 1 infinite value (1 of them a finite
    value too large for float32)"), or "" when every value is finite."""
    a = np.asarray(arr)
    if a.dtype.kind not in "fc":
        return ""
    if a.dtype == np.float32:
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(np.add.reduce(a, axis=None)):
                return ""  # (a NaN or an infinity makes the sum one: one pass, no temporary array)
    with np.errstate(over="ignore", invalid="ignore"):
        stored = a.astype(np.float32)
    bad = ~np.isfinite(stored)
    if not bad.any():
        return ""
    nan, inf = int(np.isnan(stored).sum()), int(np.isinf(stored).sum())
    overflow = int((np.isfinite(a) & bad).sum())
    parts = [f"{nan} NaN value{'s' * (nan != 1)}"] * bool(nan) + [f"{inf} infinite value{'s' * (inf != 1)}"] * bool(inf)
    return ", ".join(parts) + (f" ({overflow} of them finite values too large for float32)" if overflow else "")


def check_finite(weights: Mapping[str, np.ndarray], where: str, fix: str, allow: bool = False) -> None:
    """Refuse (SerializationError) weights holding NaN or infinite values, or values that overflow float32, naming
    the first such weight; with ``allow`` warn (RuntimeWarning) instead. ``fix``: what the user can do."""
    for name, arr in weights.items():
        found = _non_finite(arr)
        if not found:
            continue
        msg = f"{where}: weight {name!r} holds {found}; the model is unusable"
        if not allow:
            raise SerializationError(f"{msg} — {fix}")
        warnings.warn(f"{msg}; going on because allow_non_finite=True", RuntimeWarning, stacklevel=4)
        return


LOAD_FIX = ("retrain or load an earlier checkpoint (to inspect it anyway: allow_non_finite=True in Python, which "
            "warns)")
SAVE_FIX = ("nothing was written: the training diverged, or the weights were set so; fix them first "
            "(allow_non_finite=True writes it anyway, with a warning)")
CHECKPOINT_FIX = "a checkpoint must be one to continue from; nothing was written"
