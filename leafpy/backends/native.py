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
