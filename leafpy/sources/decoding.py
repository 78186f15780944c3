"""An image folder decoded as it is read: :class:`Decoder` stands for the uint8 images [N, C, H, W] of a list of
files and decodes a row the first time it is asked for, so the first epoch trains while the folder is decoded
(the trainer's ``data.workers`` threads take the next batches, and a request of many rows is shared by that many
decoding threads where they measure faster than one: Pillow releases the GIL while it decodes a large image).
Rows are written into one buffer, in memory or a temporary file in the cache directory; once every row is decoded
the buffer becomes the image cache, as a folder decoded whole would have written it."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

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
                 workers: int = 0, finish: Callable[[np.ndarray], None] | None = None) -> None:
        self.files, self.decode, self.buffer, self.finish = list(files), decode, buffer, finish
        self.decoded = np.zeros(len(files), bool)
        self.left = len(files)
        self.lock = threading.Lock()
        self.workers = workers
        self.threads: bool | None = None  # whether the pool's threads decode faster than one (measured once)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="leafpy-decode") if workers > 1 else None
        if self.pool is not None:  # (its idle threads end when the decoder is dropped)
            weakref.finalize(self, self.pool.shutdown, wait=False, cancel_futures=True)

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
        if self.pool is None or len(rows) < SHARED_ROWS:  # a batch: the trainer's own threads take the next ones
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

    def _decode_rows(self, rows: np.ndarray) -> None:
        for i in rows:
            image = self.decode(self.files[i])
            with self.lock:
                if not self.decoded[i]:
                    self.buffer[i] = image
                    self.decoded[i] = True
                    self.left -= 1

    def _finish(self) -> None:
        with self.lock:
            finish, self.finish = self.finish, None
        if finish is not None:  # (the pool stays: a request that found rows missing may still be sharing them out)
            finish(self.buffer)


TRIAL_FILES = 8
"""Files per thread that :func:`threads_pay` decodes each way."""

THREADS_PAY = 1.2
"""How much faster decoding threads must be than one thread for :func:`threads_pay` to choose them."""


def threads_pay(decode: Callable[[Any], Any], files: Any, pool: ThreadPoolExecutor, results: list) -> bool:
    """Whether ``pool``'s threads decode faster than one thread, measured on ``files``: the first half decoded in
    this thread, the second half by the pool (each thread a share), their results appended to ``results`` in file
    order. Pillow releases the GIL while it decodes, so threads pay for large images; for small ones the work is
    Python's own and threads taking turns on the GIL are slower than one (32x32 PNGs, 2 threads: 0.55x)."""
    half = len(files) // 2
    if half < 2:
        results.extend(map(decode, files))
        return False
    start = time.perf_counter()
    results.extend(map(decode, files[:half]))
    alone = time.perf_counter() - start
    start = time.perf_counter()
    results.extend(pool.map(decode, files[half:]))
    shared = (time.perf_counter() - start) * half / (len(files) - half)
    return shared * THREADS_PAY < alone


def temporary_map(directory: str, shape: tuple[int, ...]) -> tuple[np.ndarray, str]:
    """A uint8 array of ``shape`` mapped from a new temporary ``.npy`` file in ``directory`` (OSError where it
    cannot be made), and its path."""
    import tempfile

    fd, path = tempfile.mkstemp(dir=directory, prefix=".tmp-decoding-")
    os.close(fd)
    try:
        return np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=shape), path
    except BaseException:
        remove(path)
        raise


def remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
