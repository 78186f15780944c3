"""WView, the webgpu backend's array type: a WebGPU buffer seen with a shape and a dtype, and the 4-byte rounding
WebGPU asks of every buffer size, copy and binding. The lowest module of the package: every part uses it and it
uses none of them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...errors import BackendError


class WView:
    """A WebGPU buffer seen with a shape (the webgpu backend's array type); ``size`` is its element count."""

    __slots__ = ("raw", "shape", "dtype", "owner", "size", "__weakref__")

    def __init__(self, raw: Any, shape: tuple[int, ...], dtype: np.dtype, owner: WView | None = None) -> None:
        self.raw = raw
        self.shape = shape = tuple(map(int, shape))
        self.size = math.prod(shape)
        self.dtype = dtype
        self.owner = owner  # the allocation this view was made from: alive while any view of it is

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: slice) -> WView:
        """A prefix of a flat buffer (``buf[:n]``), the only slicing SharedTensor needs."""
        if not isinstance(index, slice) or index.start not in (None, 0) or index.step not in (None, 1):
            raise BackendError("webgpu: a buffer view can only be cut to a prefix")
        return WView(self.raw, (min(index.stop, self.size),), self.dtype, self.owner or self)

    def reshape(self, *shape: Any) -> WView:
        dims = list(shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
        if -1 in dims:
            known = -math.prod(dims)  # the product of the others (one -1 among them)
            dims[dims.index(-1)] = self.size // known if known else 0
        if math.prod(dims) != self.size:
            raise BackendError(f"webgpu: cannot view {self.shape} as {tuple(dims)}")
        return WView(self.raw, tuple(dims), self.dtype, self.owner or self)

    def __repr__(self) -> str:
        return f"WView(shape={self.shape}, dtype={self.dtype})"


def pad4(n: int) -> int:
    """``n`` bytes rounded up to a non-empty multiple of 4 (WebGPU's buffer sizes, copies and bindings)."""
    return max(4, (n + 3) // 4 * 4)
