"""The native backend: NumPy on the CPU, float32 by default (float64 for gradient checks)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..tensor import HOST
from .array import ArrayBackend


class NativeBackend(ArrayBackend):
    """NumPy arrays in host memory; the host copy of a SharedTensor is this backend's copy."""

    name = "native"
    key = HOST
    xp = np

    def allocate(self, size: int, dtype: Any) -> np.ndarray:
        return np.empty(size, dtype)

    def upload(self, host: np.ndarray, out: np.ndarray) -> None:
        np.copyto(out, host)

    def download(self, buf: np.ndarray, host: np.ndarray) -> None:
        np.copyto(host, buf)

    def synchronize(self) -> None:
        pass

    TRANSPOSE_BLOCK = 64
    """Rows of the source per block when moving a batch-innermost layout back to NCHW: a plain transposed copy
    reads the source with a stride of N for every element (4.2 ms for LeNet-64's first convolution output on a
    2-core machine); in blocks the rows being read stay in cache (0.44 ms)."""

    def _to_batch_first(self, dst: np.ndarray, src: np.ndarray) -> None:
        b = self.TRANSPOSE_BLOCK
        for s in range(0, src.shape[0], b):
            dst[:, s:s + b] = src[s:s + b].T
