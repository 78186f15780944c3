"""Atomic files: a temporary file in the target's directory, flushed and fsynced, then renamed over the target,
so that a failed save never destroys the last good file; and the removal of the temporaries a killed process left.
Model files, checkpoints, run files, ONNX exports and a run directory's records are written so."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from collections.abc import Callable, Sequence
from typing import BinaryIO

from ..errors import SerializationError

_TEMPORARY = re.compile(r"\.(?P<target>.+)\.leafpy-[a-z0-9_]{8}\.tmp\Z")
"""The name of atomic_write's temporary file for a target NAME: ``.NAME.leafpy-`` and tempfile's 8 random characters
(the mark keeps a user's ``.model.leaf.backup01.tmp`` from being taken for one)."""


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


def _umask() -> int:
    """The process's umask, read without changing it where the system tells it (Linux's /proc/self/status): setting
    it to read it, as os.umask does, is process-wide, and a file another thread created meanwhile would get 0o666."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)  # (elsewhere: read by setting it, to the most private mask meanwhile)
    os.umask(umask)
    return umask


def atomic_write(path: str | os.PathLike, data: bytes | Sequence[bytes | memoryview] | Callable[[BinaryIO], None],
                 example: str | None = "model.leaf") -> None:
    """Write ``data`` (bytes, a sequence of buffers written one after the other, or a function that writes into the
    open file) to ``path`` so that a failure at
    any point leaves the previous file intact: a temporary file beside the target, synced, then renamed over it.
    A symbolic link is written through (its target is replaced, the link stays); a target that exists but is not a
    regular file (a device, a FIFO) is refused; the file keeps the existing file's permissions, or gets those the
    umask gives a new file; the temporary file never stays. ``example``: the file name a message suggests where
    ``path`` is a directory (None: a file of a fixed name, which a directory there keeps from being written)."""
    path = os.fspath(path)
    if os.path.islink(path):
        path = os.path.realpath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        if example is None:
            raise SerializationError(f"{path}: cannot write: a directory is there; move it away (this file is "
                                     "written under that name)")
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
        mode = 0o666 & ~_umask()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.leafpy-", suffix=".tmp",  # _TEMPORARY
                                   dir=directory)
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
