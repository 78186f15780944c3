"""Every file leafpy writes goes through one atomic writer: through symbolic links to their target, never over a
device or FIFO, keeping permissions, leaving nothing behind on failure."""

from __future__ import annotations

import os
import stat

import pytest

from leafpy.errors import SerializationError
from leafpy.serialization import atomic_write


def test_a_link_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "real.leaf"
    target.write_bytes(b"old")
    link = tmp_path / "model.leaf"
    link.symlink_to(target)
    atomic_write(link, b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"


def test_permissions_are_kept_or_follow_the_umask(tmp_path):
    f = tmp_path / "history.json"
    f.write_bytes(b"[]")
    os.chmod(f, 0o640)
    atomic_write(f, b"[1]")
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o640
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "new.leaf", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new.leaf").st_mode) == 0o644


def test_special_files_are_refused_and_left_alone(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(SerializationError, match="not a regular file"):
        atomic_write(fifo, b"x")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(SerializationError, match="not a regular file"):
        atomic_write("/dev/null", b"x")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    f = tmp_path / "checkpoint.leaf"
    f.write_bytes(b"good")

    def boom(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(SerializationError, match="No space left"):
        atomic_write(f, b"new contents")
    assert f.read_bytes() == b"good"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.leaf"]
