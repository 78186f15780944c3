"""The Cap'n Proto codec: configs (LayerConfig, SolverConfig) and named arrays to and from ``capnp/leaf.capnp``,
and the files that hold them (models and solver checkpoints).

It knows nothing of running layers or solvers: ``Layer.save``/``Layer.load`` and ``Solver.save_checkpoint``/
``Solver.load_checkpoint`` hand it configs, ``Layer.named_weights()`` and ``Solver.snapshot()``, and take back
what it read. Config dataclasses map onto schema structs field by field (snake_case to camelCase), so a new layer
type needs only its schema entry.

Files use the packed encoding, as Leaf 0.2.1's did, and Leaf's files load: its weight names ``"{layer}-{i}"`` are
understood, and its convolution filters, stored flipped, are turned back (``from_leaf``, ``to_leaf``). leafpy's own
files (format 2) keep the message small: the weights follow it in a raw section, written straight from the arrays'
buffers and read back as views of the one buffer the file is read into (format 1 files, the weights inside the
message, still load).

Saving is atomic: a temporary file in the target's directory, flushed and fsynced, then renamed over the target.
Loading never trusts the file: its size is capped, the reader has a traversal and a nesting limit, and every
problem is reported as SerializationError naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import stat
import struct
import tempfile
import threading
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple, Protocol

import numpy as np

from . import _checks
from .errors import ConfigError, LeafpyError, SerializationError, ShapeError
from .layers.layer_config import FillerConfig, LayerConfig, WeightConfig, WeightSpec, layer_types, lookup

MAX_FILE_BYTES = 4 * 1024**3
"""Files larger than this are refused before they are parsed."""
MAX_WORDS = 2**34
"""The most 8-byte words a message may unpack to (128 GB): the traversal limit a file's own size does not lower."""
NESTING_LIMIT = 1024
"""How deep a message's pointers may nest (each nested Sequential takes four levels)."""

_SCHEMA: Any = None


def schema() -> Any:
    """The parsed leaf.capnp schema (loaded once)."""
    global _SCHEMA
    if _SCHEMA is None:
        import capnp

        here = Path(__file__).resolve().parent
        for candidate in (here / "leaf.capnp", here.parent / "capnp" / "leaf.capnp"):
            if candidate.exists():
                _SCHEMA = capnp.load(str(candidate))  # type: ignore[attr-defined]  # pycapnp has no stubs
                break
        else:
            raise SerializationError(f"leaf.capnp schema not found next to {here}")
    return _SCHEMA


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


UNION_MEMBERS: dict[str, str] = {}
"""Layer type -> its member of LayerConfig's union, for a type whose member is not its name matched without case
(``LeakyReLU`` is stored as ``leakyRelu`` with no entry here)."""
FIELD_NAMES: dict[str, dict[str, str]] = {}
"""Layer type -> {config field: schema field}, for fields not stored under their lowerCamelCase name."""


def _union_member(type_name: str) -> str:
    if type_name in UNION_MEMBERS:
        return UNION_MEMBERS[type_name]
    members = schema().LayerConfig.LayerType.schema.union_fields
    for m in members:
        if m.lower() == type_name.lower():
            return m
    raise SerializationError(f"layer type {type_name!r} has no entry in leaf.capnp's LayerConfig union")


def _void_default(member: str, config: LayerConfig) -> bool:
    """Whether ``config`` is stored as the Void member ``member``: a type stored so (as Leaf had it) whose settings,
    kept in its member ``{member}Config``, are all their defaults (old readers and Leaf then read it as before)."""
    union = schema().LayerConfig.LayerType.schema.union_fields
    return member + "Config" in union and config.config == type(config.config)()


def _layer_type_of(member: str) -> str | None:
    """The layer type stored as union member ``member`` (the inverse of _union_member)."""
    if member.endswith("Config") and member[:-len("Config")] in schema().LayerConfig.LayerType.schema.union_fields:
        member = member[:-len("Config")]  # the settings of a type otherwise stored as Void
    for type_name, m in UNION_MEMBERS.items():
        if m == member:
            return type_name
    return next((t for t in layer_types() if t.lower() == member.lower()), None)


def _schema_field(type_name: str, field: str) -> str:
    return FIELD_NAMES.get(type_name, {}).get(field) or _camel(field)


# --------------------------------------------------------------------------------------------------------------
# config -> capnp
# --------------------------------------------------------------------------------------------------------------
def _write_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [max(int(v), 0) if isinstance(v, int) else v for v in value]
    return value


def _fill_struct(builder: Any, type_name: str, config: Any) -> None:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value is None:
            continue
        field = _schema_field(type_name, f.name)
        if isinstance(value, int) and builder.schema.fields[field].proto.slot.type.which() == "list":
            setattr(builder, field, [value])  # an optional integer (any sign), stored as a list of at most one
            continue
        setattr(builder, field, _write_value(value))


def write_layer_config(builder: Any, config: LayerConfig) -> None:
    """Fill a capnp LayerConfig builder from ``config`` (containers recursively)."""
    builder.name = config.name
    member = _union_member(config.type)
    ltype = builder.layerType
    if config.type == "Sequential":
        seq = config.config
        sb = ltype.init("sequential")
        layers = sb.init("layers", len(seq.layers))
        for i, lc in enumerate(seq.layers):
            write_layer_config(layers[i], lc)
        ins = sb.init("inputs", len(seq.inputs))
        for i, (n, shape) in enumerate(seq.inputs):
            ins[i].name = n
            ins[i].shape = list(shape)
        sb.forceBackward = seq.force_backward
    elif config.config is None or _void_default(member, config):
        setattr(ltype, member, None)
    elif member + "Config" in schema().LayerConfig.LayerType.schema.union_fields:
        _fill_struct(ltype.init(member + "Config"), config.type, config.config)
    else:
        _fill_struct(ltype.init(member), config.type, config.config)
    builder.outputs = list(config.outputs)
    builder.inputs = list(config.inputs)
    params = builder.init("params", len(config.params))
    for i, p in enumerate(config.params):
        params[i].name = p.name or ""
        params[i].lrMult = p.lr_mult
        params[i].decayMult = p.decay_mult
        if p.filler is not None:
            fb = params[i].init("filler")
            fb.type = _camel(p.filler.type)
            fb.value = p.filler.value
            fb.std = p.filler.std
    builder.propagateDown = list(config.propagate_down)


# --------------------------------------------------------------------------------------------------------------
# capnp -> config
# --------------------------------------------------------------------------------------------------------------
def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


def _read_value(value: Any) -> Any:
    if hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
        return tuple(_read_value(v) for v in value)
    if hasattr(value, "raw") or type(value).__name__ == "_DynamicEnum":
        return str(value)
    return value


def read_layer_config(reader: Any, where: str = "config") -> LayerConfig:
    """The LayerConfig a capnp LayerConfig reader holds (``where`` names it in errors)."""
    name = reader.name
    which = reader.layerType.which()
    type_name = _layer_type_of(which)
    if type_name is None:
        raise SerializationError(f"{where}: unknown layer type {which!r}")
    entry = lookup(type_name)
    if type_name == "Sequential":
        sr = reader.layerType.sequential
        config: Any = entry.config_class(  # type: ignore[misc]
            layers=[read_layer_config(lc, f"{where}.layers[{i}]") for i, lc in enumerate(sr.layers)],
            inputs=[(i.name, tuple(i.shape)) for i in sr.inputs],
            force_backward=bool(sr.forceBackward))
    elif entry.config_class is None or getattr(reader.layerType, which) is None:
        config = type_name  # a type without settings, or stored as Void: its defaults
    else:
        sub = getattr(reader.layerType, which)
        kwargs = {}
        for f in dataclasses.fields(entry.config_class):
            stored = _schema_field(type_name, f.name)
            if stored in sub.schema.fieldnames:
                value = _read_value(getattr(sub, stored))
                if value == () and f.default is not dataclasses.MISSING:
                    continue  # an empty list (or one a file written before the field existed lacks): the default
                kwargs[f.name] = value
        config = entry.config_class(**kwargs)
    params = []
    for p in reader.params:
        filler = None
        if p._has("filler"):
            filler = FillerConfig(type=_snake(str(p.filler.type)), value=p.filler.value, std=p.filler.std)
        params.append(WeightConfig(name=p.name or None, lr_mult=p.lrMult, decay_mult=p.decayMult, filler=filler))
    return LayerConfig(name, config, inputs=list(reader.inputs), outputs=list(reader.outputs), params=params,
                       propagate_down=[bool(b) for b in reader.propagateDown])


# --------------------------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------------------------
_TEMPORARY = re.compile(r"\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp\Z")
"""The name of atomic_write's temporary file for a target NAME: ``.NAME.`` and tempfile's 8 random characters."""


def remove_temporaries(directory: str, targets: Callable[[str], bool]) -> list[str]:
    """Remove the temporary files that :func:`atomic_write` left in ``directory`` when its process was killed
    midway through a write, for the target names ``targets`` accepts; returns the names removed. Only for a
    directory no other process is writing into (a run directory whose lock is held): another writer's temporary
    is live until renamed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        m = _TEMPORARY.match(name)
        if m is None or not targets(m["target"]):
            continue
        path = os.path.join(directory, name)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
                removed.append(name)
        except OSError:  # gone already, or not ours to remove: left alone
            pass
    return removed


def atomic_write(path: str | os.PathLike, data: bytes | Sequence[bytes | memoryview] | Callable[[BinaryIO], None],
                 example: str = "model.leaf") -> None:
    """Write ``data`` (bytes, a sequence of buffers written one after the other, or a function that writes into the
    open file) to ``path`` so that a failure at
    any point leaves the previous file intact: a temporary file beside the target, synced, then renamed over it.
    A symbolic link is written through (its target is replaced, the link stays); a target that exists but is not a
    regular file (a device, a FIFO) is refused; the file keeps the existing file's permissions, or gets those the
    umask gives a new file; the temporary file never stays. ``example``: the file name a message suggests where
    ``path`` is a directory."""
    path = os.fspath(path)
    if os.path.islink(path):
        path = os.path.realpath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SerializationError(f"{path}: cannot write: it is a directory; give a file name such as "
                                 f"{os.path.join(path, example)}")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise SerializationError(f"{path}: cannot write: {e.strerror or e}") from e
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise SerializationError(f"{path}: cannot write: not a regular file (a device, FIFO or socket); give the "
                                 "path of a file")
    if not os.path.isdir(directory):
        raise SerializationError(f"{path}: cannot write: the directory {directory} does not exist")
    if st is not None:
        mode = stat.S_IMODE(st.st_mode)
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)  # _TEMPORARY
    except OSError as e:
        raise SerializationError(f"{path}: cannot write: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            if callable(data):
                data(f)
            else:
                for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                    f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise SerializationError(f"{path}: cannot write: {e.strerror or e}") from e
        raise
    try:
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


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


def _checksum(header_fields: bytes | memoryview, chunks: Iterable[bytes | memoryview]) -> int:
    crc = zlib.crc32(header_fields)
    for chunk in chunks:
        crc = zlib.crc32(chunk, crc)
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
    return _checks.map_whole(path, "a .leaf file", MAX_FILE_BYTES,
                             f"the limit of {MAX_FILE_BYTES} (leafpy.serialization.MAX_FILE_BYTES)",
                             SerializationError)


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
    reads or writes the file (in a thread for a large file: zlib releases the GIL)."""

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
    try:
        msg = getattr(schema(), struct_name).from_bytes_packed(bytes(payload), traversal_limit_in_words=limit,
                                                               nesting_limit=NESTING_LIMIT)
    except Exception as e:  # capnp reports malformed input as KjException
        raise SerializationError(f"{path}: not a valid leafpy/Leaf {struct_name} file (truncated, corrupted or "
                                 f"another format): {_short(e)}") from None
    return msg, origin, raw


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
            data = np.asarray(values, dtype=np.float32)
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


# --------------------------------------------------------------------------------------------------------------
# Leaf's weights: its names ("{layer}-{i}") and its convolution filters (stored flipped)
# --------------------------------------------------------------------------------------------------------------
LEAF_TYPES = {"Convolution", "Linear", "Pooling", "LogSoftmax", "Softmax", "ReLU", "Sigmoid",
              "NegativeLogLikelihood", "Reshape", "Sequential"}
"""The layer types Leaf 0.2.1 had."""
LEAF_FIELDS = {"Convolution": ("num_output", "filter_shape", "stride", "padding", "bias"),
               "Pooling": ("mode", "filter_shape", "stride", "padding"), "Softmax": (), "LogSoftmax": (),
               "NegativeLogLikelihood": ("num_classes",)}
"""Of those types' settings, the ones Leaf had: the others (group, dilation, pad_end, ceil_mode, ...) must keep their
defaults in a Leaf file."""


def check_leaf_representable(config: LayerConfig, where: str) -> None:
    """Raise ConfigError naming the first layer or setting Leaf 0.2.1 could not read or would compute otherwise."""
    def refuse(what: str) -> None:
        raise ConfigError(f"{where}: layer '{config.name}' ({config.type}): {what}; Leaf 0.2.1 cannot represent "
                          "it (save in leafpy's format instead)")

    if config.type not in LEAF_TYPES:
        refuse(f"the type {config.type} did not exist in Leaf")
    c = config.config
    if getattr(c, "bias", False):
        refuse("a bias (Leaf's Linear and Convolution had none: bias=False)")
    if config.type == "Pooling" and c.mode != "max":
        refuse(f"{c.mode} pooling (Leaf pooled by maximum only)")
    if config.type in LEAF_FIELDS:
        leaf_only = type(c)(**{k: getattr(c, k) for k in LEAF_FIELDS[config.type]})
        for f in dataclasses.fields(c):
            if getattr(c, f.name) != getattr(leaf_only, f.name):
                refuse(f"{f.name} {getattr(c, f.name)!r} (Leaf's {config.type} had no {f.name})")
    for wc in config.params:
        if wc.lr_mult != 1.0 or wc.decay_mult != 1.0 or wc.filler is not None:
            refuse("per-weight lr_mult, decay_mult or filler (Leaf's WeightConfig holds a name only)")
    if config.type == "Sequential":
        for child in c.layers:
            check_leaf_representable(child, where)


LEAF_WEIGHT_NAME = re.compile(r"[^/]+-\d+")


def is_leaf_file(origin: str, saved: Mapping[str, np.ndarray]) -> bool:
    """A bare file whose weights all carry Leaf's names ("{layer}-{i}") was written by Leaf: its convolution
    filters are flipped. (leafpy names weights "{layer}/{weight}", and writes a header.)"""
    return origin == "bare" and bool(saved) and all(LEAF_WEIGHT_NAME.fullmatch(k) for k in saved)


def leaf_name(spec: WeightSpec) -> str:
    """Leaf's name for a layer's weight: the layer's name and the weight's position, "{layer}-{i}"."""
    return f"{spec.layer}-{spec.position}"


def leaf_aliases(specs: Sequence[WeightSpec]) -> tuple[dict[str, WeightSpec], dict[str, list[str]]]:
    """Leaf's names of the weights ``specs`` describes: (name -> spec where the name is unique, name -> the weights
    sharing it where layers of the same name in different containers make it ambiguous)."""
    holders: dict[str, list[WeightSpec]] = {}
    for spec in specs:
        holders.setdefault(leaf_name(spec), []).append(spec)
    unique = {name: found[0] for name, found in holders.items() if len({s.name for s in found}) == 1}
    ambiguous = {name: sorted({s.name for s in found}) for name, found in holders.items() if name not in unique}
    return unique, ambiguous


def _is_filter(spec: WeightSpec) -> bool:
    return spec.layer_type == "Convolution" and spec.local_name == "weight"


def _flip(arr: np.ndarray) -> np.ndarray:
    """A filter turned in both spatial axes: Leaf convolved (cuDNN's CUDNN_CONVOLUTION mode), leafpy
    cross-correlates, so the same function needs the filter flipped."""
    return np.ascontiguousarray(arr[..., ::-1, ::-1])


def from_leaf(weights: Mapping[str, np.ndarray], specs: Sequence[WeightSpec]) -> dict[str, np.ndarray]:
    """Weights as a file Leaf wrote holds them (its names, flipped convolution filters) -> leafpy's names and
    orientation, for the network whose weights ``specs`` (``Layer.weight_specs()``) describes. Names that match no
    weight are kept as they are (loading reports them)."""
    by_leaf, ambiguous = leaf_aliases(specs)
    out = {}
    for key, arr in weights.items():
        if key in ambiguous:
            raise SerializationError(f"weight {key!r}: Leaf's name is ambiguous in this network, layers of the same "
                                     f"name hold {', '.join(ambiguous[key])}; give the layers distinct names")
        spec = by_leaf.get(key)
        if spec is None:
            out[key] = arr
        else:
            out[spec.name] = _flip(arr) if _is_filter(spec) else arr
    return out


def to_leaf(weights: Mapping[str, np.ndarray], specs: Sequence[WeightSpec]) -> dict[str, np.ndarray]:
    """leafpy's named weights -> Leaf's names and flipped convolution filters (the inverse of :func:`from_leaf`)."""
    by_name = {s.name: s for s in specs}
    out = {}
    for name, arr in weights.items():
        spec = by_name.get(name)
        if spec is None:
            raise ConfigError(f"to_leaf: weight {name!r} has no entry in the network's weight specs "
                              f"({', '.join(by_name) or 'none'})")
        out[leaf_name(spec)] = _flip(arr) if _is_filter(spec) else arr
    return out


# --------------------------------------------------------------------------------------------------------------
# model files
# --------------------------------------------------------------------------------------------------------------
FORMATS = ("leafpy", "leaf")


class SavedModel(NamedTuple):
    """What a model file holds: the layer's config, its weights by name, and whether Leaf wrote it (then the
    weights carry Leaf's names and flipped convolution filters: see :func:`from_leaf`)."""

    config: LayerConfig
    weights: dict[str, np.ndarray]
    leaf: bool
    preparation: str = ""
    """How the model reads data (JSON: class names, normalisation; see leafpy.sources.prepare); "": none."""


def model_message(config: LayerConfig, weights: Mapping[str, np.ndarray], leaf: bool = False) -> Any:
    """A capnp Layer message: the config and the named weights (raw little-endian float32; Leaf's List(Float32)
    with ``leaf``)."""
    msg = schema().Layer.new_message()
    _fill_layer(msg, config, weights, leaf)
    return msg


def _fill_layer(builder: Any, config: LayerConfig, weights: Mapping[str, np.ndarray], leaf: bool = False,
                section: _RawSection | None = None) -> None:
    builder.name = config.name
    write_layer_config(builder.init("config"), config)
    _write_weights(builder.init("weightsData", len(weights)), list(weights.items()), leaf=leaf, section=section)


def save_model(path: str | os.PathLike, config: LayerConfig, weights: Mapping[str, np.ndarray], *,
               format: str = "leafpy", specs: Sequence[WeightSpec] = (), allow_non_finite: bool = False,
               preparation: str = "") -> None:
    """Write a layer's config and named weights to ``path`` atomically: leafpy's file (with its header and
    checksum), or with ``format="leaf"`` a file Leaf 0.2.1 reads (what Leaf cannot represent is a ConfigError;
    ``specs``, the network's ``Layer.weight_specs()``, give Leaf's weight names and the filters to flip). Weights
    holding NaN or infinite values (or values too large for float32) are refused unless ``allow_non_finite``."""
    if format not in FORMATS:
        raise ConfigError(f"Layer.save: format must be one of {', '.join(FORMATS)}, onnx, got {format!r}")
    check_finite(weights, f"{os.fspath(path)}", SAVE_FIX, allow_non_finite)
    if format == "leaf":
        check_leaf_representable(config, "Layer.save(format='leaf')")
        atomic_write(path, model_message(config, to_leaf(weights, specs), leaf=True).to_bytes_packed())
        return
    msg, section = schema().Layer.new_message(), _RawSection()
    _fill_layer(msg, config, weights, section=section)
    msg.preparation = preparation
    atomic_write(path, _file_writer(msg, "Layer", section))


def read_model(path: str | os.PathLike, *, allow_non_finite: bool = False) -> SavedModel:
    """Read a model file written by :func:`save_model` or by Leaf 0.2.1 (non-finite weights: see
    :func:`check_finite`). The weights are views of the file's private mapping (see ``_checks.map_whole``)."""
    with opened_model(path, allow_non_finite=allow_non_finite) as saved:
        return saved


@contextlib.contextmanager
def opened_model(path: str | os.PathLike, *, allow_non_finite: bool = False) -> Iterator[SavedModel]:
    """:func:`read_model` whose checksum is verified when the block ends, not before it begins: the block (that
    copies the weights into a network) runs while the checksum is computed. What the block made of the weights must
    be thrown away when it raises: SerializationError for a damaged file, whatever the block raised otherwise."""
    path = os.fspath(path)
    with _opened_parts(path, "Layer") as (msg, origin, raw):
        with reading(path, "Layer"):
            config = read_layer_config(msg.config)
            saved = _read_weights(msg.weightsData, path, raw)
        check_finite(saved, path, LOAD_FIX, allow_non_finite)
        yield SavedModel(config, saved, is_leaf_file(origin, saved), str(msg.preparation))


def read_weights(path: str | os.PathLike, *, allow_non_finite: bool = False) -> tuple[dict[str, np.ndarray], bool]:
    """The named weights of a model file or of the network in a solver checkpoint, and whether Leaf wrote them."""
    path = os.fspath(path)
    errors = []
    readers = (("Layer", lambda m: m.weightsData), ("SolverCheckpoint", lambda m: m.network.weightsData))
    for struct_name, weights_of in readers:
        try:
            msg, origin, raw = _read_parts(path, struct_name)
            saved = _guard(path, lambda: _read_weights(weights_of(msg), path, raw))
        except SerializationError as e:
            errors.append(e)
            continue
        check_finite(saved, path, LOAD_FIX, allow_non_finite)
        return saved, is_leaf_file(origin, saved)
    raise errors[0]


class _HoldsWeights(Protocol):
    def weight_specs(self) -> list[WeightSpec]: ...
    def load_weights(self, weights: Mapping[str, Any], *, strict: bool = True) -> Any: ...


def load_weights(layer: _HoldsWeights, path: str | os.PathLike, *, strict: bool = True,
                 allow_non_finite: bool = False) -> Any:
    """Set a network's weights (through its public ``load_weights``, with its ``strict``) from a model file or from
    the network in a solver checkpoint, by name; errors name the file. Returns what ``load_weights`` returns (the
    weights left alone). Non-finite weights are refused unless ``allow_non_finite`` (see :func:`check_finite`)."""
    path = os.fspath(path)
    saved, leaf = read_weights(path, allow_non_finite=allow_non_finite)
    with reading(path):
        return layer.load_weights(from_leaf(saved, layer.weight_specs()) if leaf else saved, strict=strict)


def saved_network_config(path: str | os.PathLike) -> LayerConfig:
    """The network config a model file (or a solver checkpoint's network) records."""
    path = os.fspath(path)
    errors = []
    readers = (("Layer", lambda m: m.config), ("SolverCheckpoint", lambda m: m.config.network))
    for struct_name, config_of in readers:
        try:
            msg = _read_message(path, struct_name)
            return _guard(path, lambda: read_layer_config(config_of(msg)))
        except SerializationError as e:
            errors.append(e)
    raise errors[0]


# --------------------------------------------------------------------------------------------------------------
# solver checkpoints
# --------------------------------------------------------------------------------------------------------------
_SOLVER_OPTIONAL_ZERO = {"max_iter", "clip_gradients", "weight_decay"}


def write_solver_config(builder: Any, cfg: Any) -> None:
    """Fill a capnp SolverConfig builder from a SolverConfig (any dataclass with its fields)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        camel = _camel(f.name)
        if f.name in ("network", "objective"):
            if value is not None:
                write_layer_config(builder.init(camel), value)
        elif f.name == "seed":
            builder.seed = -1 if value is None else int(value)
        elif f.name == "loss_scale":  # text: "" (the precision's default), "dynamic", "none" or a number
            builder.lossScale = "" if value is None else value if isinstance(value, str) else repr(float(value))
        elif value is None:
            continue
        else:
            setattr(builder, camel, list(value) if isinstance(value, tuple) else value)


def read_solver_config(reader: Any, config_class: type) -> Any:
    """A ``config_class`` (SolverConfig) from a capnp SolverConfig reader."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(config_class):
        camel = _camel(f.name)
        if f.name in ("network", "objective"):
            kwargs[f.name] = read_layer_config(getattr(reader, camel), f"solver.{f.name}") \
                if reader._has(camel) else None
        elif f.name == "seed":
            kwargs["seed"] = None if reader.seed < 0 else int(reader.seed)
        elif f.name == "loss_scale":
            kwargs["loss_scale"] = str(reader.lossScale) or None
        else:
            v = _read_value(getattr(reader, camel))
            if f.name in _SOLVER_OPTIONAL_ZERO and not v:
                v = None
            kwargs[f.name] = v
    return config_class(**kwargs)


class SavedCheckpoint(NamedTuple):
    """What a solver checkpoint holds: the solver's config, the network's weights by name, and the rest of the
    solver's state as ``Solver.snapshot()`` gives it."""

    config: Any
    weights: dict[str, np.ndarray]
    state: dict[str, Any]


STATE_SEPARATOR = "#"
"""Update-rule history is stored as Weights named "{weight}#{state}" (a state's name has no '#')."""


def save_checkpoint(path: str | os.PathLike, config: Any, weights: Mapping[str, np.ndarray],
                    state: Mapping[str, Any]) -> None:
    """Write a checkpoint atomically: the SolverConfig ``config``, the network's named ``weights`` and ``state``
    (``Solver.snapshot()``: iteration, pending_calls, history, accumulated, random, trainer_state). Non-finite
    weights are refused: a checkpoint must be one to continue from."""
    check_finite(weights, os.fspath(path), CHECKPOINT_FIX)
    msg, section = schema().SolverCheckpoint.new_message(), _RawSection()
    write_solver_config(msg.init("config"), config)
    _fill_layer(msg.init("network"), config.network, weights, section=section)
    msg.iteration = int(state["iteration"])
    history = [(f"{w}{STATE_SEPARATOR}{s}", arr) for w, per_weight in state["history"].items()
               for s, arr in per_weight.items()]
    _write_weights(msg.init("state", len(history)), history, section=section)
    msg.pendingCalls = int(state["pending_calls"])
    acc = list(state["accumulated"].items())
    _write_weights(msg.init("accumulated", len(acc)), acc, section=section)
    msg.rngSeeds = [int(r["seed"]) for r in state["random"]]
    msg.rngCalls = [int(r["calls"]) for r in state["random"]]
    trainer_state = state["trainer_state"]
    msg.trainerState = json.dumps(trainer_state, sort_keys=True) if trainer_state else ""
    scaling = state.get("loss_scale")
    if scaling is not None:
        msg.lossScale = float(scaling["scale"])
        msg.lossScaleGoodSteps = int(scaling["good_steps"])
        msg.skippedSteps = int(scaling["skipped_steps"])
    atomic_write(path, _file_writer(msg, "SolverCheckpoint", section))


def read_checkpoint(path: str | os.PathLike, config_class: type) -> SavedCheckpoint:
    """Read a checkpoint written by :func:`save_checkpoint`; its solver config is built as ``config_class``."""
    path = os.fspath(path)
    msg, _, raw = _read_parts(path, "SolverCheckpoint")
    with reading(path, "SolverCheckpoint"):
        config = read_solver_config(msg.config, config_class)
        weights = _read_weights(msg.network.weightsData, path, raw)
        check_finite(weights, path, "load an earlier checkpoint, or start a new run", allow=False)
        history: dict[str, dict[str, np.ndarray]] = {}
        for key, arr in _read_weights(msg.state, path, raw).items():
            weight, sep, name = key.rpartition(STATE_SEPARATOR)
            if not sep:
                raise SerializationError(f"{path}: solver state {key!r} is not named '{{weight}}#{{state}}'; the "
                                         "file is damaged")
            history.setdefault(weight, {})[name] = arr
        state = {
            "iteration": int(msg.iteration),
            "pending_calls": int(msg.pendingCalls),
            "history": history,
            "accumulated": _read_weights(msg.accumulated, path, raw),
            "random": [{"seed": int(s), "calls": int(c)} for s, c in zip(msg.rngSeeds, msg.rngCalls)],
            "trainer_state": _read_trainer_state(str(msg.trainerState), path),
        }
        if msg.lossScale > 0:  # 0: a checkpoint without loss scaling
            state["loss_scale"] = {"scale": float(msg.lossScale), "good_steps": int(msg.lossScaleGoodSteps),
                                   "skipped_steps": int(msg.skippedSteps)}
    return SavedCheckpoint(config, weights, state)


TRAINER_STATE_LIMIT = 1 << 20
"""The largest trainer state (bytes of JSON) a checkpoint may carry."""


def _read_trainer_state(text: str, path: str) -> dict[str, Any]:
    if not text:
        return {}
    if len(text) > TRAINER_STATE_LIMIT:
        raise SerializationError(f"{path}: the checkpoint's trainer state is {len(text)} bytes, more than "
                                 f"{TRAINER_STATE_LIMIT}; the file is damaged")
    try:
        state = json.loads(text)
    except ValueError as e:
        raise SerializationError(f"{path}: the checkpoint's trainer state is not JSON ({e}); the file is "
                                 "damaged") from e
    if not isinstance(state, dict):
        raise SerializationError(f"{path}: the checkpoint's trainer state is a {type(state).__name__}, not an "
                                 "object; the file is damaged")
    check_trainer_state(state, f"{path}: the checkpoint's trainer state")
    return state


COUNT_LIMIT = 2**53
"""The largest epoch, sample or loss count a trainer state holds (JSON numbers are exact up to 2**53)."""
TRAINER_STATE_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "epoch": ("a count", lambda v: _checks.counter(v, COUNT_LIMIT)),
    "sample": ("a count", lambda v: _checks.counter(v, COUNT_LIMIT)),
    "loss_count": ("a count", lambda v: _checks.counter(v, COUNT_LIMIT)),
    "correct": ("a count", lambda v: _checks.counter(v, COUNT_LIMIT)),
    "scored": ("a count", lambda v: _checks.counter(v, COUNT_LIMIT)),
    "loss_sum": ("a finite number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                 and math.isfinite(v)),
    "data": ("an object (the run's data section)", lambda v: isinstance(v, dict)),
    "data_digest": ("a text", lambda v: isinstance(v, str)),
}
"""What each entry the Trainer records in a checkpoint must be (entries of other names are kept as they are)."""


def check_trainer_state(state: Mapping[str, Any], where: str) -> None:
    """Refuse (SerializationError) a trainer state whose entries have the wrong type or range, or that scores more
    correct predictions than it scored samples."""
    for key, (what, valid) in TRAINER_STATE_FIELDS.items():
        if key in state and not valid(state[key]):
            bound = f" in [0, {COUNT_LIMIT}]" if what == "a count" else ""
            raise SerializationError(f"{where}: {key} is {json.dumps(state[key])[:80]}, expected {what}{bound}; the "
                                     "file is damaged: resume from another checkpoint, or start again with "
                                     "--weights FILE")
    if state.get("correct", 0) > state.get("scored", 0):
        raise SerializationError(f"{where}: {state['correct']} correct predictions of {state.get('scored', 0)} "
                                 "scored samples; the file is damaged: resume from another checkpoint, or start "
                                 "again with --weights FILE")
