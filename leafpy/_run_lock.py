"""The run directory's lock: ``DIR/.lock`` holds the id of the process training into ``DIR``.

Taken atomically: the process id is written to a temporary file of its own first, which is then hard-linked to
``.lock``. ``os.link`` fails when ``.lock`` exists, so of processes starting at once exactly one gets it, and no
process ever sees a ``.lock`` without its id in it (the old way, create-then-write, let a competitor read an empty
file, judge it stale and remove a live lock). A full disk fails while the temporary is written, before ``.lock``
appears.

The lock holds the process id and the host name (a run in another container or on another machine sharing the
directory has an id of its own: whether it lives cannot be told from here, so its lock is never taken over; the
message says to remove the file if no run is using the directory). A lock is stale when its process, on this
host, is gone or a zombie, or (a file from elsewhere) when it holds no readable id and is older than
``EMPTY_STALE_S``; a ``.lock`` that is no regular file (a FIFO, a directory) is refused, naming it.
A stale lock is replaced, not removed: ``os.replace`` of this process's temporary over it,
so ``.lock`` never disappears and nobody's ``os.link`` can slip in between. Two processes could still both judge
the same stale lock and replace it one after the other, the second removing the first's fresh lock; so judging and
replacing happen under an exclusive ``flock`` of the directory itself, taken only for a takeover: the second
process judges again under it, finds the first's live lock and is refused. The kernel drops a ``flock`` when its
process dies, so that guard can never go stale itself. (Where flock is missing, on Windows, or refused, on some
network file systems, the takeover goes on without it: the race then needs two processes taking over one dead
run's lock within microseconds.)
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from ._checks import open_regular
from .errors import LeafpyError

LOCK_NAME = ".lock"
EMPTY_STALE_S = 5.0
"""A lock holding no readable process id is taken for a live run's until it is this old (seconds)."""
ATTEMPTS = 20


class _Holder(NamedTuple):
    pid: int  # 0: no readable id
    age: float  # seconds since the lock was written
    host: str | None = None  # the host it was written on (None: a lock of an earlier leafpy, which wrote none)


def _host() -> str:
    """This host's name as a lock records it (no spaces: the lock's text is "PID HOST")."""
    return "".join(socket.gethostname().split()) or "?"


class RunLock:
    """``with RunLock(directory):`` holds ``directory/.lock`` for the block (see the module docstring); a
    LeafpyError names the process holding it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self._inode: tuple[int, int] | None = None

    def __enter__(self) -> RunLock:
        tmp = self._write_pid()
        try:
            for _ in range(ATTEMPTS):
                if self._link(tmp) or self._take_over(tmp):
                    return self
            raise LeafpyError(f"{self.path}: cannot take the run directory's lock (it keeps changing); remove the "
                              "file if no run is using the directory")
        finally:
            with contextlib.suppress(OSError):  # (gone already where it replaced a stale lock)
                os.unlink(tmp)

    def __exit__(self, *exc: Any) -> None:
        try:  # only our own lock (a run never has its live lock taken over, but a user may have replaced it)
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)
        except OSError:
            pass

    def _write_pid(self) -> str:
        """A temporary file in the directory holding this process's id (removed again on any failure)."""
        try:
            fd, tmp = tempfile.mkstemp(prefix=f"{LOCK_NAME}.{os.getpid()}.", suffix=".tmp", dir=self.directory)
        except OSError as e:  # a read-only directory or file system, no permission
            raise LeafpyError(f"--out {self.directory}: cannot write into the output directory "
                              f"({e.strerror or e}); train into a directory you can write to") from e
        try:
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()} {_host()}")
            st = os.stat(tmp)
        except OSError as e:  # a full disk
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise LeafpyError(f"--out {self.directory}: cannot write the run directory's lock ({e.strerror or e}); "
                              "free some space or train into another --out") from e
        self._inode = (st.st_dev, st.st_ino)
        return tmp

    def _link(self, tmp: str) -> bool:
        """``.lock`` made the temporary's second name, where no ``.lock`` exists (True)."""
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return False
        except OSError as e:
            raise LeafpyError(f"--out {self.directory}: cannot create the run directory's lock "
                              f"({e.strerror or e}); train into a directory you can write to") from e
        return True

    def _take_over(self, tmp: str) -> bool:
        """Replace a stale ``.lock`` by the temporary (True); False when ``.lock`` went away meanwhile (link
        again); a LeafpyError when a live run holds it."""
        with _directory_flock(self.directory):
            # judged under the flock: between this and the replace no other process takes the lock over, nobody
            # links a new one (.lock exists), and its holder, gone, cannot remove it
            holder = self._holder()
            if holder is None:
                return False
            self._refuse_if_held(holder)
            try:
                os.replace(tmp, self.path)
            except OSError as e:
                raise LeafpyError(f"{self.path}: cannot take over the stale lock of a run that ended "
                                  f"({e.strerror or e}); remove it if no run is using the directory") from e
            return True

    def _holder(self) -> _Holder | None:
        """What ``.lock`` says (None: there is none, or it changed while it was read). A lock read is judged only
        while it is still the one at ``.lock``: its run may have ended, removing it, and another run taken the
        lock since; judging that run's lock by the ended run's id would take a live lock."""
        try:
            with open_regular(self.path, "the run directory's lock", LeafpyError) as f:  # (a FIFO never blocks)
                st = os.fstat(f.fileno())
                text = f.read(300)
                now = os.stat(self.path)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return None
            age = time.time() - st.st_mtime
        except FileNotFoundError:
            return None
        except LeafpyError as e:  # not a regular file
            raise LeafpyError(f"{e}; remove it if no run is using {self.directory}") from None
        except OSError:
            return _Holder(0, 0.0)  # unreadable: a live run's until the user says otherwise
        words = text.split()
        try:
            pid = int(words[0]) if words else 0
        except ValueError:
            pid = 0
        host = words[1].decode("utf-8", "replace") if len(words) > 1 else None
        return _Holder(pid if pid > 0 else 0, age, host)

    def _refuse_if_held(self, holder: _Holder) -> None:
        pid = holder.pid
        if pid == 0 and holder.age < EMPTY_STALE_S:
            raise LeafpyError(f"{self.directory}: another process is taking the run directory's lock ({self.path} "
                              "holds no process id yet, or cannot be read); wait for that run, or train into another "
                              f"--out (if no run is using the directory, remove {self.path})")
        if pid and holder.host is not None and holder.host != _host():
            raise LeafpyError(f"{self.directory}: a leafpy run on host {holder.host!r} (process {pid}: another machine "
                              "or container sharing this directory) holds its lock, and whether it still runs cannot "
                              f"be told from here; wait for it, or train into another --out (if no run is using the "
                              f"directory, remove {self.path})")
        # our own id in it: left by an earlier process of the same id (a restarted container), which is gone
        if pid and pid != os.getpid() and _alive(pid):
            raise LeafpyError(f"{self.directory}: another leafpy run (process {pid}) is writing to this directory; "
                              f"wait for it, or train into another --out (if process {pid} is no leafpy run, its id "
                              f"taken by another program since, remove {self.path})")


def held_by(directory: str) -> str | None:
    """The message of a live run's lock on ``directory`` (None where none holds it): what a message that would
    advise acting on the directory's files says instead."""
    lock = RunLock(directory)
    try:
        holder = lock._holder()
        if holder is not None:
            lock._refuse_if_held(holder)
    except LeafpyError as e:
        return str(e)
    return None


@contextlib.contextmanager
def _directory_flock(directory: str) -> Iterator[None]:
    """An exclusive flock of ``directory`` for the block (waits for another process's), where one can be had."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system that refuses flock on a directory
            pass
        yield
    finally:
        os.close(fd)  # (drops the flock)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs here (a zombie, ended and not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone; an id beyond any process's
        return False
    except PermissionError:  # another user's process
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):  # no /proc (not Linux): what kill said
        return True
