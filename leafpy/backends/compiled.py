"""Compiled kernels for the native backend, where numba is installed (``pip install numba``, the ``numba`` extra).

NumPy runs max pooling as one pass per window position (compare, maximum, mask), each over the whole input, so a
2x2 pooling reads its input and mask four times: LeNet-64's two poolings took 7 of its 27 ms a training step on a
2-core Intel Xeon. The kernels here make one pass over each input: forward 2x2 pooling 6x faster there, its
gradient 2x. They are serial (no thread pool of their own beside the BLAS's) and compiled once per dtype into
numba's cache; numba is imported only when a pooling at least :data:`MIN_ELEMENTS` large runs, so small models
(``make demo``) start as fast as without it.

What they take: max pooling without padding whose windows lie inside the input, on C-contiguous float32/float64
NCHW arrays and an int32 mask. They give the values of NumPy's passes: the first of equal maxima, NaN propagated
to the output (the mask then keeps the last position that was larger before it), and a gradient that is
``dy * (mask == position)``, so a NaN in ``dy`` reaches every position of its window as it does through NumPy."""

from __future__ import annotations

import importlib
import os
from typing import Any

MIN_ELEMENTS = 1 << 16
"""Smaller pooling inputs stay with NumPy (there a call costs microseconds either way, and numba's import, about
0.4 s, would not pay)."""

_KERNELS: list[Any] = []


def kernels() -> Any | None:
    """The kernel module (leafpy.backends._kernels, compiled on first call), or None where numba is missing or
    LEAFPY_COMPILED=0."""
    if not _KERNELS:
        module: Any = None
        if os.environ.get("LEAFPY_COMPILED", "1") != "0":
            try:
                module = importlib.import_module("leafpy.backends._kernels")
            except ImportError:
                module = None
        _KERNELS.append(module)
    return _KERNELS[0]


def max_pool_case(x: Any, out: Any, mask: Any, kernel: tuple, stride: tuple, padding: tuple) -> str | None:
    """Which kernel takes this max pooling ("2x2": windows 2x2 at stride 2; "windows": any other windows), or None
    (NumPy's passes take it). Either takes unpadded windows inside the input only."""
    if x.size < MIN_ELEMENTS or x.ndim != 4 or tuple(padding) != (0, 0) or mask is None:
        return None
    if x.dtype != out.dtype or x.dtype.kind != "f" or x.dtype.itemsize not in (4, 8) or mask.dtype.name != "int32":
        return None
    if not (x.flags.c_contiguous and out.flags.c_contiguous and mask.flags.c_contiguous):
        return None
    (kh, kw), (sh, sw) = kernel, stride
    n, c, h, w = x.shape
    oh, ow = out.shape[2], out.shape[3]
    if out.shape[:2] != (n, c) or mask.shape != out.shape or oh < 1 or ow < 1:
        return None
    if (oh - 1) * sh + kh > h or (ow - 1) * sw + kw > w:
        return None
    if (kh, kw, sh, sw) == (2, 2, 2, 2):
        return "2x2"
    return "windows"


def max_pool(case: str, x: Any, out: Any, mask: Any, kernel: tuple, stride: tuple) -> None:
    k: Any = kernels()
    if case == "2x2":
        k.max_pool_2x2(x, out, mask)
    else:
        k.max_pool(x, out, mask, kernel[0], kernel[1], stride[0], stride[1])


def max_pool_grad(case: str, dy: Any, dx: Any, mask: Any, kernel: tuple, stride: tuple) -> None:
    k: Any = kernels()
    if case == "2x2":
        k.max_pool_2x2_grad(dy, dx, mask)
    else:
        k.max_pool_grad(dy, dx, mask, kernel[0], kernel[1], stride[0], stride[1])
