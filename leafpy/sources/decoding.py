"""An image folder decoded as it is read: :class:`Decoder` stands for the uint8 images [N, C, H, W] of a list of
files and decodes a row the first time it is asked for, so the first epoch trains while the folder is decoded
(the trainer's ``data.workers`` threads take the next batches, and a request of many rows is shared by that many
decoding threads where they measure faster than one: Pillow releases the GIL while it decodes a large image).
Rows are written into one buffer, in memory or a temporary file in the cache directory; once every row is decoded
the buffer becomes the image cache, as a folder decoded whole would have written it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from queue import SimpleQueue
from typing import Any

import numpy as np

from ..errors import ConfigError, LeafpyError

SHARED_ROWS = 512
"""A request of at least this many rows (a whole split, not a training batch, which the trainer's ``data.workers``
threads already prepare side by side) is shared by the decoder's threads, where they measure faster than one."""


class Decoder:
    """The images of ``files`` as uint8 [N, channels, H, W], decoded by ``decode(path)`` when first indexed
    (``decoder[rows]`` gives a copy of those rows, decoded first where they are not yet); ``workers`` > 1 threads
    share the rows of a large request (:data:`SHARED_ROWS`) where they measure faster (:func:`threads_pay`).
    ``buffer`` receives the rows; ``finish(buffer)`` runs once, when the last row is decoded (it writes the
    cache). A file that cannot be decoded raises ``decode``'s error, naming it: that of the first such file of the
    request, in file order, whatever the number of threads."""

    dtype = np.dtype(np.uint8)

    def __init__(self, files: Sequence[str], decode: Callable[[str], np.ndarray], buffer: np.ndarray,
                 workers: int = 0, finish: Callable[[np.ndarray], None] | None = None,
                 processes: Callable[[], Processes] | None = None, mode: str = "auto") -> None:
        self.files, self.decode, self.buffer, self.finish = list(files), decode, buffer, finish
        self.decoded = np.zeros(len(files), bool)
        self.left = len(files)
        self.lock = threading.Lock()
        self.workers = workers
        self.threads: bool | None = None  # whether the pool's threads decode faster than one (measured once)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="leafpy-decode") if workers > 1 else None
        if self.pool is not None:  # (its idle threads end when the decoder is dropped)
            weakref.finalize(self, self.pool.shutdown, wait=False, cancel_futures=True)
        self.mode = check_mode(mode)
        wanted = workers > 1 and mode != "threads" or workers == 1 and mode == "processes"  # (one: off the GIL)
        self.start_processes = processes if wanted else None
        self.processes: Processes | None = None  # started (and kept where they measure faster) on first use
        self.trying = threading.Lock()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.buffer.shape)

    @property
    def ndim(self) -> int:
        return self.buffer.ndim

    def __len__(self) -> int:
        return len(self.buffer)

    @property
    def complete(self) -> bool:
        return self.left == 0

    def __getitem__(self, idx: Any) -> np.ndarray:
        rows = np.arange(*idx.indices(len(self))) if isinstance(idx, slice) else np.asarray(idx)
        if self.left:
            flat = np.atleast_1d(rows)
            self._decode(np.unique(flat[~self.decoded[flat]]))
        got = self.buffer[rows]
        return got if rows.ndim else np.array(got)

    def _decode(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        processes, rows = self._processes(rows)
        if processes is not None:
            self._store(rows, processes.map([self.files[i] for i in rows]))
        elif self.pool is None or len(rows) < SHARED_ROWS:  # a batch: the trainer's own threads take the next ones
            self._decode_rows(rows)
        else:  # (map's results are taken in order: the first failure raised is that of the lowest rows)
            if self.threads is None:
                trial = rows[:2 * TRIAL_FILES * self.workers]
                chunks = np.array_split(trial, 2 * self.workers)  # shared out as the rest would be
                self.threads = threads_pay(self._decode_rows, chunks, self.pool, [])
                rows = rows[len(trial):]
            if not self.threads:
                self._decode_rows(rows)
            elif len(rows):
                for _ in self.pool.map(self._decode_rows, np.array_split(rows, min(self.workers, len(rows)))):
                    pass
        if self.left == 0:
            self._finish()

    def _processes(self, rows: np.ndarray) -> tuple[Processes | None, np.ndarray]:
        """The decoding processes for a request (None: this thread, or the decoder's threads) and the rows left
        to decode: ``processes`` starts them on the first request; ``auto``, on the first with at least
        :data:`PROCESS_MIN_FILES` files left, measures them against this thread on its first rows (requests that
        come meanwhile decode here) and keeps them only where they are faster."""
        if self.start_processes is None or (self.mode == "auto" and self.left < PROCESS_MIN_FILES):
            return self.processes, rows
        if self.processes is None and self.trying.acquire(blocking=False):
            try:
                if self.processes is None and self.start_processes is not None:
                    processes = self.start_processes()
                    if self.mode == "processes":
                        self.processes = processes
                        return processes, rows
                    trial = rows[:2 * PROCESS_TRIAL_FILES * self.workers]
                    tried: list[np.ndarray | Exception] = []
                    self.start_processes = None
                    try:
                        pay = processes_pay(self._decode_files, [self.files[i] for i in trial], processes, tried)
                    except BaseException:
                        processes.close()
                        raise
                    if pay:
                        self.processes = processes
                    else:
                        processes.close()
                    self._store(trial, tried)
                    rows = rows[len(trial):]
            finally:
                self.trying.release()
        return self.processes, rows

    def _decode_files(self, files: Sequence[str]) -> list[np.ndarray]:
        """The images of files in this thread (the measure :func:`processes_pay` takes of one thread's rate)."""
        return [self.decode(f) for f in files]

    def _store(self, rows: np.ndarray, images: Sequence[np.ndarray | Exception]) -> None:
        """Rows decoded elsewhere, in order up to the first that could not be (its error raised)."""
        for i, image in zip(rows, images):
            if isinstance(image, Exception):
                raise image
            self._keep(i, image)

    def _decode_rows(self, rows: np.ndarray) -> None:
        for i in rows:
            self._keep(i, self.decode(self.files[i]))

    def _keep(self, i: int, image: np.ndarray) -> None:
        with self.lock:
            if not self.decoded[i]:
                self.buffer[i] = image
                self.decoded[i] = True
                self.left -= 1

    def _finish(self) -> None:
        if self.processes is not None:
            self.processes.close()
        with self.lock:
            finish, self.finish = self.finish, None
        if finish is not None:  # (the pool stays: a request that found rows missing may still be sharing them out)
            finish(self.buffer)


TRIAL_FILES = 8
"""Files per thread that :func:`threads_pay` decodes each way."""

THREADS_PAY = 1.2
"""How much faster decoding threads must be than one thread for :func:`threads_pay` to choose them."""


def threads_pay(decode: Callable[[Any], Any], files: Any, pool: ThreadPoolExecutor, results: list) -> bool:
    """Whether ``pool``'s threads decode faster than one thread, measured on ``files`` (:func:`_faster`). Pillow
    releases the GIL while it decodes, so threads pay for large images; for small ones the work is Python's own and
    threads taking turns on the GIL are slower than one (32x32 PNGs, 2 threads: 0.55x)."""
    return _faster(lambda some: list(map(decode, some)), lambda some: list(pool.map(decode, some)), files, results)


def _faster(here: Callable[[Any], list], there: Callable[[Any], list], files: Any, results: list) -> bool:
    """Whether ``there`` decodes faster than ``here`` by :data:`THREADS_PAY`, measured on ``files``: the first half
    decoded ``here``, the second half ``there``, their results appended to ``results`` in file order."""
    half = len(files) // 2
    if half < 2:
        results.extend(here(files))
        return False
    start = time.perf_counter()
    results.extend(here(files[:half]))
    alone = time.perf_counter() - start
    start = time.perf_counter()
    results.extend(there(files[half:]))
    shared = (time.perf_counter() - start) * half / (len(files) - half)
    return shared * THREADS_PAY < alone


MODES = ("auto", "threads", "processes")
"""How ``data.workers`` decode an image folder (``data.decoding``): ``threads`` (the workers themselves, and
threads sharing a whole split where they measure faster than one), ``processes`` (as many decoding processes, for
every request), ``auto`` (processes where at least :data:`PROCESS_MIN_FILES` files are left to decode and they
measure faster than the threads, else threads)."""

PROCESS_MIN_FILES = 2048
"""Files left to decode for which ``auto`` tries decoding processes: their start (about 0.3 s, importing NumPy,
Pillow and leafpy) is repaid many times over."""

PROCESS_TRIAL_FILES = 64
"""Files per worker that :func:`processes_pay` decodes each way (more than :data:`TRIAL_FILES`: a request to a
process costs a round trip through its pipes, and the measure must see past it)."""

PROCESS_CHUNK = 32
"""Files per request to one decoding process: a batch is shared out among the processes in such pieces."""

PROCESS_PIECE_BYTES = 1 << 25
"""The most bytes of images one request to a decoding process asks for (fewer files than :data:`PROCESS_CHUNK`
where images are large: a process holds a request's images until it answers, and this process reads them whole)."""


WORKER = ("import sys; home = sys.argv[1]; home in sys.path or sys.path.insert(0, home); "
          "from leafpy.sources.decode_worker import main; main(sys.argv[2:])")
"""A decoding process's program: :func:`leafpy.sources.decode_worker.main` of the leafpy that started it (its
folder first on the path unless that is there already: an installed leafpy's site-packages keeps its place)."""


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ConfigError(f"data.decoding: expected one of {', '.join(MODES)}, got {mode!r}"[:300])
    return mode


class Processes:
    """``count`` decoding processes (:mod:`leafpy.sources.decode_worker`) for images decoded to ``image_size`` and
    ``channels``: :meth:`map` decodes a list of files as ``decode`` would in this process, its pieces in parallel,
    in processes that hold no GIL in common (small images are mostly Python's work: two threads taking turns on
    the GIL decode 32x32 PNGs at 0.55x one thread's rate, two processes at 1.6x). The processes end at
    :meth:`close`, or when this process ends (their input closes). Should one fail, ``decode`` takes over here,
    with a warning."""

    def __init__(self, count: int, image_size: Sequence[int], channels: int,
                 decode: Callable[[str], np.ndarray | Exception]) -> None:
        self.shape = (channels, int(image_size[0]), int(image_size[1]))
        self.decode = decode
        self.idle: SimpleQueue = SimpleQueue()
        self.failed = False
        home = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this leafpy's
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        utf8 = ["-X", "utf8"] if sys.flags.utf8_mode else []  # (file names read as this process reads them)
        command = [sys.executable, *utf8, "-c", WORKER, home, *map(str, self.shape[1:]), str(channels)]
        self.processes = []
        try:
            for _ in range(count):
                self.processes.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                       env=env))
        except (OSError, ValueError) as e:
            warnings.warn(f"leafpy: cannot start a decoding process ({e}); decoding in this process", stacklevel=3)
            self.failed = True
        self.unready = list(self.processes)  # (those yet to say they are ready, in turn)
        self.starting = threading.Lock()
        threads: set[int] = set()  # (the pool's, which must not wait for themselves when the last piece drops self)
        self.pool = ThreadPoolExecutor(count, thread_name_prefix="leafpy-decode-processes",
                                       initializer=lambda: threads.add(threading.get_ident()))
        self._closer = weakref.finalize(self, _close, self.processes, self.pool, threads)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._closer()

    def wait_ready(self) -> None:
        """Wait until every process can decode (each has imported what it needs; what was printed before it
        could keep its output to itself, by a ``sitecustomize`` say, is passed over)."""
        with self.starting:
            while self.unready:  # (a wait interrupted, by Ctrl-C say, goes on from the process it was waiting for)
                p = self.unready[0]
                line = self._line(p)
                while line and not line.endswith(b"ready\n"):
                    line = self._line(p)
                del self.unready[0]
                if line:
                    self.idle.put(p)
                else:
                    self._fail(p)

    def map(self, files: Sequence[str]) -> list[np.ndarray | Exception]:
        """Each file's image, or the LeafpyError naming it, in order (or, where decoding raised something else,
        what it raised: whoever takes the images raises the first failure in file order, as a thread would)."""
        if not len(files):
            return []
        if not self.processes:
            return [self._here(f) for f in files]
        self.wait_ready()
        step = max(1, min(PROCESS_CHUNK, PROCESS_PIECE_BYTES // math.prod(self.shape),
                          -(-len(files) // len(self.processes))))
        try:
            pieces = [self.pool.submit(self._piece, files[i:i + step]) for i in range(0, len(files), step)]
        except RuntimeError:  # closed (the last rows were decoded meanwhile), or Python ending: decoded here
            return [self._here(f) for f in files]
        return [image for piece in pieces for image in piece.result()]

    def _here(self, file: str) -> np.ndarray | Exception:
        try:
            return self.decode(file)
        except Exception as e:  # (a reader's own failure, given back in its file's place)
            return e

    def _piece(self, files: Sequence[str]) -> list[np.ndarray | Exception]:
        p = None if self.failed else self.idle.get()
        if p is None:
            return [self._here(f) for f in files]
        answer = None
        try:
            with contextlib.suppress(OSError, ValueError, AttributeError, EOFError):
                answer = self._ask(p, files)
        finally:  # (a process is given back, or given up: never lost to the threads waiting for one)
            if answer is None:
                self._fail(p)
            else:
                self.idle.put(p)
        if answer is None:
            return [self._here(f) for f in files]
        errors, data = answer
        images = iter(np.frombuffer(data, np.uint8).reshape(-1, *self.shape))
        return [(self._here(f) if errors[i] is None else LeafpyError(errors[i])) if i in errors
                else next(images) for i, f in enumerate(files)]

    def _ask(self, p: subprocess.Popen, files: Sequence[str]) -> tuple[dict[int, str | None], bytearray]:
        """Process ``p``'s answer to ``files``: the messages of those it could not decode (None: decoded here,
        see :mod:`.decode_worker`), by position, and the others' images' bytes."""
        p.stdin.write(json.dumps(list(files)).encode() + b"\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        errors = {int(k): v if v is None else str(v) for k, v in json.loads(self._line(p) or b"null").items()}
        data = bytearray(math.prod(self.shape) * (len(files) - len(errors)))  # (the images are views of it)
        if p.stdout.readinto(data) != len(data):  # type: ignore[union-attr]
            raise EOFError
        return errors, data

    @staticmethod
    def _line(p: subprocess.Popen) -> bytes:
        try:
            return p.stdout.readline()  # type: ignore[union-attr]
        except (OSError, ValueError):  # (ValueError: closed, the folder decoded meanwhile)
            return b""

    def _fail(self, p: subprocess.Popen) -> None:
        if not self.failed and self._closer.alive:  # (not once closed: the processes end as they were told to)
            warnings.warn(f"leafpy: a decoding process ended (exit code {p.poll()}); decoding goes on in this "
                          "process", stacklevel=2)
        self.failed = True
        while not self.idle.empty():
            self.idle.get()
        for _ in self.processes:
            self.idle.put(None)  # (a thread waiting for a process decodes its piece itself)


def _close(processes: list[subprocess.Popen], pool: ThreadPoolExecutor, threads: set[int]) -> None:
    """End the processes once the pieces under way are done; from one of ``pool``'s ``threads`` (where the last
    piece let the Processes go), a new thread does it, as that one cannot wait for itself."""
    if threading.get_ident() not in threads:
        pool.shutdown(wait=True)
    else:
        try:
            threading.Thread(target=_close, args=(processes, pool, set()), name="leafpy-decode-close").start()
            return
        except RuntimeError:  # (Python ending starts no threads: the pieces under way are not waited for)
            pool.shutdown(wait=False)
    for p in processes:
        with contextlib.suppress(OSError):
            p.stdin.close()  # type: ignore[union-attr]
    for p in processes:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        p.stdout.close()  # type: ignore[union-attr]


def processes_pay(decode: Callable[[Sequence[str]], list], files: Sequence[str], processes: Processes,
                  results: list) -> bool:
    """Whether ``processes`` decode faster than ``decode`` (one thread, or threads), measured on ``files`` as
    :func:`threads_pay` measures (once the processes are ready), the results appended to ``results``."""
    processes.wait_ready()
    return _faster(decode, processes.map, files, results) and not processes.failed


TEMPORARY = ".tmp-cache-"
"""How the image cache's temporary files begin: then the host and the process writing them (see
:func:`temporary_prefix`), so a later run can tell one whose writer was killed (SIGKILL, out of memory: no clean-up
ran) from one being written."""


def temporary_prefix() -> str:
    from .._run_lock import _host

    return f"{TEMPORARY}{_host()}-{os.getpid()}-"


def remove_dead_temporaries(directory: str) -> list[str]:
    """Remove the cache's temporary files in ``directory`` that a process of this host wrote and ended without
    removing (a killed decode leaves one as large as its folder's images); the names removed. Those of another
    host, or of a process still running, are left."""
    from .._run_lock import _alive, _host

    removed: list[str] = []
    mine = f"{TEMPORARY}{_host()}"
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        # (read from the right: a host named like this one and "-1234" is another host, not this one's pid 1234)
        writer, pid, rest = name.rsplit("-", 2) if name.count("-") >= 4 else ("", "", "")
        if writer == mine and rest and pid.isdecimal() and pid.isascii() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
                removed.append(name)
    return removed


def temporary_map(directory: str, shape: tuple[int, ...]) -> tuple[np.ndarray, str]:
    """A uint8 array of ``shape`` mapped from a new temporary ``.npy`` file in ``directory`` (OSError where it
    cannot be made), and its path."""
    import tempfile

    fd, path = tempfile.mkstemp(dir=directory, prefix=temporary_prefix())
    os.close(fd)
    try:
        return np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=shape), path
    except BaseException:
        remove(path)
        raise


def remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
