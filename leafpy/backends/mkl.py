"""Intel MKL's GEMMs for the native backend, where Intel's ``mkl`` package is installed (``pip install mkl``, the
``mkl`` extra): :func:`load` opens its runtime library, and :class:`Mkl` runs float32 and float64 products through
``cblas_?gemm`` and ``cblas_?gemm_batch_strided`` with the operands' strides as they are (a transposed view is a
transpose flag, a view of every other row a leading dimension, a batch of matrices one call).

On Intel CPUs MKL's small and medium products are faster than the OpenBLAS that NumPy's wheels bundle (an Intel
Xeon with AVX-512, 2 threads, MLP-128's products: 1.2-1.3x); on AMD CPUs MKL takes slower code paths, which is why
the native backend's ``blas="auto"`` uses it on Intel CPUs only. Products it cannot take (other dtypes, strides
that are no matrix layout, an output overlapping an operand, empty matrices) go to NumPy."""

from __future__ import annotations

import ctypes
import os
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
"""CBLAS's enumerators."""
INT_LIMIT = 1 << 31
"""MKL's LP64 interface (libmkl_rt's default, chosen by :func:`load`) takes sizes, leading dimensions and strides as
32-bit ints."""
INTERFACE_LP64, INTERFACE_ILP64 = 0, 1
"""mkl_set_interface_layer's values (MKL_INTERFACE_LP64, MKL_INTERFACE_ILP64)."""

MIN_WORK = 1 << 18
"""Products of fewer multiply-adds (m * n * k over a batch) than this go to NumPy: choosing MKL's entry point and
reading the layouts costs about 5-10 us of Python, more than a product of 64 x 64 x 64 takes in NumPy (gradient
checks and batch-1 inference run thousands of such products)."""

MIN_UPDATE = 1 << 14
"""Smaller weights' updates stay with NumPy (two calls' Python and the threads' start cost more there)."""

_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so", "libmkl_rt.2.dylib", "mkl_rt.2.dll")


def library_path() -> str | None:
    """Where MKL's single dynamic library is: beside this interpreter's environment (the ``mkl`` wheel puts it in
    ``<prefix>/lib``), else wherever the dynamic loader finds it; None where it is not installed."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        for folder in ("lib", "Library/bin"):
            for name in _NAMES:
                path = Path(prefix, folder, name)
                if path.is_file():
                    return str(path)
    import ctypes.util
    return ctypes.util.find_library("mkl_rt")


def intel_cpu() -> bool:
    """Whether this machine's CPU is Intel's (Linux: /proc/cpuinfo's vendor_id)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return "GenuineIntel" in line
    except OSError:
        pass
    return False


def threads() -> int:
    """The thread count MKL is given: MKL_NUM_THREADS or OMP_NUM_THREADS where set (a positive integer), else the
    CPUs this process may run on, as NumPy's OpenBLAS does (MKL's own default, the physical cores, would leave a
    2-vCPU machine's second hyperthread idle)."""
    for var in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        text = os.environ.get(var, "").split(",")[0].strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_loaded: dict[str, Mkl] = {}


def load(path: str | None = None) -> Mkl | None:
    """MKL, opened once per process, or None where it is not installed or will not load."""
    path = path or library_path()
    if path is None:
        return None
    if path not in _loaded:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            return None
        # the 32-bit interface the products' argument types are: chosen before any other call, which fixes it for
        # the process (else MKL_INTERFACE_LAYER=ILP64 in the environment would have MKL read 64-bit sizes)
        if lib.MKL_Set_Interface_Layer(ctypes.c_int(INTERFACE_LP64)) & INTERFACE_ILP64:
            return None  # (MKL was already running its 64-bit interface in this process)
        _loaded[path] = Mkl(lib)
    return _loaded[path]


class Mkl:
    """The GEMMs of one opened MKL library (``gemm``; ``gemm_call``, one worked out for a recorded step to replay), a
    NumPy namespace whose ``matmul`` uses them (``numpy``), and the level-1 products of an update (``axpby``,
    ``momentum``)."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        f, d, i, p = ctypes.c_float, ctypes.c_double, ctypes.c_int, ctypes.c_void_p
        self._gemm = {}
        self._batched = {}
        for dtype, letter, real in ((np.dtype(np.float32), "s", f), (np.dtype(np.float64), "d", d)):
            fn = getattr(lib, f"cblas_{letter}gemm")
            fn.argtypes = [i, i, i, i, i, i, real, p, i, p, i, real, p, i]
            fn.restype = None
            self._gemm[dtype] = fn
            batched = getattr(lib, f"cblas_{letter}gemm_batch_strided", None)
            if batched is not None:
                batched.argtypes = [i, i, i, i, i, i, real, p, i, i, p, i, i, real, p, i, i, i]
                batched.restype = None
                self._batched[dtype] = batched
        self._axpby, self._axpy = {}, {}
        for dtype, letter, real in ((np.dtype(np.float32), "s", f), (np.dtype(np.float64), "d", d)):
            axpby, axpy = getattr(lib, f"cblas_{letter}axpby", None), getattr(lib, f"cblas_{letter}axpy")
            axpy.argtypes = [i, real, p, i, p, i]
            axpy.restype = None
            self._axpy[dtype] = axpy
            if axpby is not None:
                axpby.argtypes = [i, real, p, i, real, p, i]
                axpby.restype = None
                self._axpby[dtype] = axpby
        lib.MKL_Set_Num_Threads(ctypes.c_int(threads()))
        self.min_work = MIN_WORK
        """Products of fewer multiply-adds go to NumPy (see :data:`MIN_WORK`)."""
        self.numpy = types.ModuleType("numpy_mkl", "NumPy, with matmul running MKL's GEMMs where it can")
        """NumPy's namespace with ``matmul`` replaced (the native backend's ``xp`` when it runs MKL)."""
        namespace = vars(self.numpy)
        namespace.update({k: v for k, v in vars(np).items() if not k.startswith("__")})
        namespace["__getattr__"] = lambda name: getattr(np, name)  # NumPy's lazily loaded submodules
        namespace["matmul"] = self.matmul

    def matmul(self, a: Any, b: Any, out: Any = None) -> Any:
        """``np.matmul(a, b, out=out)`` for arrays of up to 3 dimensions: MKL where it can, else NumPy."""
        if out is None and isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
                and a.dtype in self._gemm and 2 <= a.ndim <= 3 and 2 <= b.ndim <= 3 and a.shape[-1] == b.shape[-2]:
            shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
            new = np.empty(shape, a.dtype)
            if self.gemm(a, b, new):
                return new
        elif out is not None and self.gemm(a, b, out):
            return out
        return np.matmul(a, b, out=out)

    def gemm(self, a: Any, b: Any, out: Any, alpha: float = 1.0, beta: float = 0.0) -> bool:
        """out = alpha * a @ b + beta * out through MKL, for float32 or float64 ndarrays of one dtype, 2-D or 3-D
        (a batch, a 2-D operand broadcast over it), each matrix in a layout BLAS reads (rows or columns
        contiguous, the other stride at least a row or column), ``out`` in neither operand's memory; False, with
        nothing written, where not (the caller computes it otherwise). A beta of 0 ignores out's values (NaN
        included), as BLAS does."""
        call = self.gemm_call(a, b, out, alpha, beta)
        if call is None:
            return False
        call()
        return True

    def gemm_call(self, a: Any, b: Any, out: Any, alpha: float = 1.0, beta: float = 0.0) -> Any:
        """:meth:`gemm`'s product as a call of no arguments that runs it (MKL's function with the operands'
        addresses and layouts worked out once, the operands kept alive), or None where :meth:`gemm` would return
        False. A recorded step replays it: 8-15 us of Python less per product there."""
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and isinstance(out, np.ndarray)):
            return None
        dtype = out.dtype
        if a.dtype != dtype or b.dtype != dtype or dtype not in self._gemm or not out.flags.writeable:
            return None
        if out.ndim == 2 and a.ndim == 2 and b.ndim == 2:
            batch = 0
        elif out.ndim == 3 and 2 <= a.ndim <= 3 and 2 <= b.ndim <= 3 and max(a.ndim, b.ndim) == 3 \
                and dtype in self._batched:  # (two matrices into a batch: NumPy refuses it)
            batch = out.shape[0]
            if batch == 0 or any(x.ndim == 3 and x.shape[0] != batch for x in (a, b)):  # (0: no product to run)
                return None
            if batch == 1:  # one product (a batch-1 convolution): its matrices
                a, b, out = (x[0] if x.ndim == 3 else x for x in (a, b, out))
                batch = 0
        else:
            return None
        m, n = out.shape[-2:]
        k = a.shape[-1]
        if a.shape[-2] != m or b.shape[-2] != k or b.shape[-1] != n or min(m, n, k) == 0:
            return None
        if m * n * k * max(batch, 1) < self.min_work:
            return None
        if np.may_share_memory(out, a) or np.may_share_memory(out, b):
            return None
        size = dtype.itemsize
        c_layout = _layout(out, size)
        if c_layout is None:
            return None
        if c_layout[0]:  # out is column-major: out^T = b^T @ a^T, row-major
            a, b = _transposed(b), _transposed(a)
            out = _transposed(out)
            m, n = n, m
            c_layout = _layout(out, size)
            if c_layout is None or c_layout[0]:
                return None
        la, lb = _layout(a, size), _layout(b, size)
        if la is None or lb is None:
            return None
        ldc = c_layout[1]
        ta, lda = la
        tb, ldb = lb
        if max(m, n, k, lda, ldb, ldc, batch) >= INT_LIMIT:
            return None
        flags = (ROW_MAJOR, TRANS if ta else NO_TRANS, TRANS if tb else NO_TRANS, m, n, k, alpha)
        args: tuple
        if not batch:
            fn, args = self._gemm[dtype], (*flags, a.ctypes.data, lda, b.ctypes.data, ldb, beta, out.ctypes.data, ldc)
        else:
            stride_a, stride_b, stride_c = (_batch_stride(x, size) for x in (a, b, out))
            if stride_a is None or stride_b is None or stride_c is None or stride_c < m * ldc \
                    or max(stride_a, stride_b, stride_c) >= INT_LIMIT:
                return None
            fn, args = self._batched[dtype], (*flags, a.ctypes.data, lda, stride_a, b.ctypes.data, ldb, stride_b,
                                              beta, out.ctypes.data, ldc, stride_c, batch)

        def call(fn: Any = fn, args: tuple = args, operands: tuple = (a, b, out)) -> None:
            fn(*args)  # (operands is never read: held, it keeps the memory at args' addresses alive)
        return call

    def _vectors(self, out: Any, *ins: Any) -> bool:
        """Whether level-1 products may take ``out`` (written) and ``ins``: float32 or float64 C-contiguous arrays
        of one dtype and size, at least :data:`MIN_UPDATE` and under 2**31 elements, none overlapping another."""
        arrays = (out, *ins)
        if not all(isinstance(x, np.ndarray) and x.dtype == out.dtype and x.size == out.size and x.flags.c_contiguous
                   for x in arrays) or out.dtype not in self._axpby or not MIN_UPDATE <= out.size < INT_LIMIT:
            return False
        return out.flags.writeable and not any(np.may_share_memory(a, b)
                                               for i, a in enumerate(arrays) for b in arrays[i + 1:])

    def axpby(self, alpha: float, x: Any, beta: float, y: Any) -> bool:
        """``y = alpha * x + beta * y`` in one pass on MKL's threads (``?axpby``), where :meth:`_vectors` allows
        (``beta`` 0 stays with NumPy: BLAS may read y there, NaN included); False, with nothing written, otherwise."""
        if beta == 0.0 or not self._vectors(y, x):
            return False
        self._axpby[y.dtype](y.size, alpha, x.ctypes.data, 1, beta, y.ctypes.data, 1)
        return True

    def momentum(self, w: Any, g: Any, h: Any, lr: float, momentum: float) -> bool:
        """The momentum rule's update, ``h = momentum * h + lr * g; w -= h``, as two level-1 products (``?axpby``,
        ``?axpy``) on MKL's threads: one pass less than NumPy's four, g left as it is, and both cores (the update is
        bound by memory bandwidth, which one core does not exhaust). Where :meth:`_vectors` allows (w, h written);
        False, with nothing written, otherwise."""
        if not (self._vectors(w, g, h) and h.flags.writeable):
            return False
        self._axpby[w.dtype](w.size, lr, g.ctypes.data, 1, momentum, h.ctypes.data, 1)
        self._axpy[w.dtype](w.size, -1.0, h.ctypes.data, 1, w.ctypes.data, 1)
        return True


def _layout(x: np.ndarray, size: int) -> tuple[bool, int] | None:
    """(transposed, leading dimension) of the last two axes of ``x`` as BLAS reads a row-major matrix: rows
    contiguous -> (False, row stride); columns contiguous -> (True, column stride); None for any other layout
    (negative, zero or misaligned strides)."""
    rows, cols = x.shape[-2:]
    s0, s1 = x.strides[-2:]
    if s0 % size or s1 % size or not x.flags.aligned:
        return None
    s0, s1 = s0 // size, s1 // size
    if (cols == 1 or s1 == 1) and (rows == 1 or s0 >= cols):
        return False, max(s0 if rows > 1 else cols, cols, 1)
    if (rows == 1 or s0 == 1) and (cols == 1 or s1 >= rows):
        return True, max(s1 if cols > 1 else rows, rows, 1)
    return None


def _transposed(x: np.ndarray) -> np.ndarray:
    return x.swapaxes(-1, -2)


def _batch_stride(x: np.ndarray, size: int) -> int | None:
    """Elements between the matrices of a 3-D batch (0: a 2-D operand, the same matrix for every item)."""
    if x.ndim == 2 or x.shape[0] == 1:
        return 0
    stride = x.strides[0]
    if stride <= 0 or stride % size:
        return None
    return stride // size
