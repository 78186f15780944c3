"""cuBLAS on a handle of its own, called through ctypes: what a CUDA graph records for a GEMM, and the bfloat16 and
float16 GEMMs (``cublasGemmEx`` with float32 accumulation, on tensor cores)."""

from __future__ import annotations

from typing import Any

from ...errors import BackendError


class _CaptureBlas:
    """cuBLAS called directly (ctypes) on its own handle, with a fixed workspace, for recording CUDA graphs."""

    WORKSPACE = 32 << 20

    TF32_TENSOR_OP_MATH = 3  # cublasMath_t
    COMPUTE_32F = 68  # cublasComputeType_t: float32 accumulation, whatever the operands' type
    GEMM_DEFAULT = -1  # cublasGemmAlgo_t: cuBLAS's heuristic (tensor cores for 16-bit operands)
    DATA_TYPES = {"f32": 0, "f16": 2, "bf16": 14}  # cudaDataType_t: CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF

    def __init__(self, cp: Any, tf32: bool = False) -> None:
        import ctypes
        import ctypes.util

        major = cp.cuda.runtime.runtimeGetVersion() // 1000
        names = [f"libcublas.so.{major}", ctypes.util.find_library("cublas") or "libcublas.so"]
        lib = None
        for name in names:
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            raise BackendError(f"cuBLAS library not found (tried {', '.join(names)})")
        self.ct = ctypes
        self.lib = lib
        self.handle = ctypes.c_void_p()
        if lib.cublasCreate_v2(ctypes.byref(self.handle)) != 0:
            raise BackendError("cublasCreate failed")
        if tf32:
            lib.cublasSetMathMode(self.handle, ctypes.c_int(self.TF32_TENSOR_OP_MATH))
        self.workspace = cp.empty(self.WORKSPACE, dtype=cp.uint8)
        vp, i, f, d = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_double
        for fn, t in (("cublasSgemm_v2", ctypes.POINTER(f)), ("cublasDgemm_v2", ctypes.POINTER(d))):
            getattr(lib, fn).argtypes = [vp, i, i, i, i, i, t, vp, i, vp, i, t, vp, i]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]

    def prepare(self, stream: Any) -> None:
        ct = self.ct
        self.lib.cublasSetStream_v2(self.handle, ct.c_void_p(stream.ptr))
        self.lib.cublasSetWorkspace_v2(self.handle, ct.c_void_p(self.workspace.data.ptr), ct.c_size_t(self.WORKSPACE))
        self.stream_ptr = stream.ptr

    stream_ptr: int | None = None
    """The stream the handle launches on (set by :meth:`prepare`)."""

    def use_stream(self, stream: Any) -> None:
        """Launch on ``stream`` from now on (nothing to do when the handle already does)."""
        if stream.ptr != self.stream_ptr:
            self.prepare(stream)

    @staticmethod
    def _check(a, b, out) -> None:
        for arr in (a, b, out):
            if arr.ndim != 2 or not arr.flags.c_contiguous:
                raise BackendError("recorded GEMM needs contiguous 2-D operands")

    def gemm(self, a, trans_a, b, trans_b, out, alpha, beta) -> None:
        ct = self.ct
        self._check(a, b, out)
        m, n = out.shape
        k = a.shape[0] if trans_a else a.shape[1]
        # row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T
        scalar = ct.c_float if out.dtype.itemsize == 4 else ct.c_double
        fn = self.lib.cublasSgemm_v2 if out.dtype.itemsize == 4 else self.lib.cublasDgemm_v2
        al, be = scalar(alpha), scalar(beta)
        status = fn(self.handle, int(trans_b), int(trans_a), n, m, k, ct.byref(al), ct.c_void_p(b.data.ptr),
                    b.shape[1], ct.c_void_p(a.data.ptr), a.shape[1], ct.byref(be), ct.c_void_p(out.data.ptr), n)
        if status != 0:
            raise BackendError(f"cuBLAS gemm failed with status {status}")

    def gemm_ex(self, a, trans_a, b, trans_b, out, alpha, beta, operands: str, result: str) -> None:
        """``out = alpha op(a) op(b) + beta out`` with ``a`` and ``b`` in format ``operands`` ("bf16" or "f16")
        and ``out`` in ``result`` (the same, or "f32"), accumulated in float32."""
        ct = self.ct
        self._check(a, b, out)
        m, n = out.shape
        k = a.shape[0] if trans_a else a.shape[1]
        al, be = ct.c_float(alpha), ct.c_float(beta)
        t_in, t_out = self.DATA_TYPES[operands], self.DATA_TYPES[result]
        status = self.lib.cublasGemmEx(
            self.handle, int(trans_b), int(trans_a), n, m, k, ct.byref(al), ct.c_void_p(b.data.ptr), t_in,
            b.shape[1], ct.c_void_p(a.data.ptr), t_in, a.shape[1], ct.byref(be), ct.c_void_p(out.data.ptr), t_out, n,
            self.COMPUTE_32F, self.GEMM_DEFAULT)
        if status != 0:
            raise BackendError(f"cuBLAS gemmEx ({operands} operands, {result} result, m={m} n={n} k={k}) failed with "
                               f"status {status}")
