"""The cuda backend: CuPy arrays on an NVIDIA GPU.

GEMM goes to cuBLAS through CuPy; elementwise work runs in fused kernels; convolution runs through cuDNN graphs
(NVIDIA's ``nvidia-cudnn-frontend``), built once per shape and cached, with the shared im2col + GEMM path when
the frontend cannot be imported (or with ``use_cudnn=False``); pooling runs in one kernel per pass.

Importing this module does not import CuPy; constructing the backend does.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any

import numpy as np

from ..errors import BackendError, BackendUnavailable
from . import pointwise
from .array import ArrayBackend

_INSTALL = ("pip install 'leafpy-dl[cuda]' (CuPy for CUDA 12: cupy-cuda12x; with CUDA 13 drivers install "
            "cupy-cuda13x instead)")

_POOL_SOURCE = r"""
extern "C" __global__ void pool_fwd(const float* x, float* y, int* mask, int total, int C, int H, int W,
        int OH, int OW, int kh, int kw, int sh, int sw, int ph, int pw, int is_max) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= total) return;
    int ow = i % OW, oh = (i / OW) % OH, nc = i / (OW * OH);
    const float* src = x + (long long)nc * H * W;
    int h0 = oh * sh - ph, w0 = ow * sw - pw;
    const float NEG_INF = __int_as_float(0xff800000);
    float best = NEG_INF, sum = 0.f; int arg = 0;
    for (int a = 0; a < kh; ++a) {
        int h = h0 + a;
        for (int b = 0; b < kw; ++b) {
            int w = w0 + b;
            bool inside = h >= 0 && h < H && w >= 0 && w < W;
            float v = inside ? src[h * W + w] : (is_max ? NEG_INF : 0.f);
            if (is_max) { if (v > best) { best = v; arg = a * kw + b; } } else { sum += v; }
        }
    }
    if (is_max) { y[i] = best; mask[i] = arg; } else { y[i] = sum / (float)(kh * kw); }
}
// one thread per output element adds its gradient where the forward pass took its value (measured faster on an
// H200 than one thread per input element gathering over its windows)
extern "C" __global__ void pool_bwd(const float* dy, float* dx, const int* mask, int total, int C, int H, int W,
        int OH, int OW, int kh, int kw, int sh, int sw, int ph, int pw, int is_max) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= total) return;
    int ow = i % OW, oh = (i / OW) % OH, nc = i / (OW * OH);
    float* dst = dx + (long long)nc * H * W;
    int h0 = oh * sh - ph, w0 = ow * sw - pw;
    float g = dy[i];
    if (is_max) {
        int a = mask[i] / kw, b = mask[i] % kw, h = h0 + a, w = w0 + b;
        if (h >= 0 && h < H && w >= 0 && w < W) atomicAdd(dst + h * W + w, g);
    } else {
        float share = g / (float)(kh * kw);
        for (int a = 0; a < kh; ++a) for (int b = 0; b < kw; ++b) {
            int h = h0 + a, w = w0 + b;
            if (h >= 0 && h < H && w >= 0 && w < W) atomicAdd(dst + h * W + w, share);
        }
    }
}
"""


class CudaBackend(ArrayBackend):
    """CuPy on one NVIDIA GPU. ``use_cudnn``: None (use cuDNN graphs when importable), True (require), False
    (im2col + GEMM). ``tf32``: let convolutions (cuDNN) and GEMMs (cuBLAS) use TF32 tensor cores (faster, ~1e-3
    relative error; PyTorch's ``allow_tf32`` switches for both).
    ``graphs``: record training steps with static shapes as CUDA graphs and replay them. ``fuse_bias``: add the
    convolution bias inside the cuDNN forward graph (measured slower than a separate add on an H200 in float32).
    ``exact_fp32`` (default): without TF32, keep only cuDNN plans whose results are fp32-accurate (within 1e-5 of
    the others); False also lets the autotuner pick FFT and Winograd plans (faster filter gradients, up to ~1e-2
    relative error measured on an H200; what PyTorch's cudnn.benchmark may choose)."""

    name = "cuda"

    def __init__(self, dtype: Any = np.float32, device: int = 0, use_cudnn: bool | None = None,
                 tf32: bool = False, graphs: bool = True, fuse_bias: bool = False, exact_fp32: bool = True) -> None:
        super().__init__(dtype)
        try:
            import cupy
        except ImportError as e:
            raise BackendUnavailable(f"backend 'cuda' needs CuPy, which is not installed: {_INSTALL}") from e
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # no driver, no device
            raise BackendUnavailable(f"backend 'cuda': no usable NVIDIA GPU ({e})") from e
        if device >= count:
            raise BackendUnavailable(f"backend 'cuda': device {device} requested, {count} present")
        self.xp = cupy
        self.device = cupy.cuda.Device(device)
        self.device.use()
        self.key = f"cuda:{device}"
        self.tf32 = tf32
        self.fuse_bias = fuse_bias
        self._kernels = self._build_kernels(cupy)
        self._pool_module = cupy.RawModule(code=_POOL_SOURCE)
        self._cudnn = None
        self.graphs = graphs
        self._steps: dict = {}
        self.record_error: str | None = None
        self._capture_blas: _CaptureBlas | None = None
        self._capturing = False
        self._pools: list = []  # each recorded step's private pool: addresses baked into a graph stay its own
        self._peak_used = 0
        self._step_stream = cupy.cuda.Stream()  # blocking: ordered with work on the default stream
        if use_cudnn is not False:
            try:
                self._cudnn = _CudnnConv(cupy, tf32, exact=exact_fp32 and not tf32)
            except Exception as e:  # ImportError, or a frontend/runtime mismatch
                if use_cudnn:
                    raise BackendUnavailable(f"backend 'cuda': cuDNN graphs unavailable ({e}); "
                                             "pip install nvidia-cudnn-frontend nvidia-cudnn-cu12") from e

    @property
    def uses_cudnn(self) -> bool:
        return self._cudnn is not None

    @staticmethod
    def _build_kernels(cp: Any) -> dict:
        ek = cp.ElementwiseKernel
        # the activations and their gradients, generated from their formulas (pointwise.TABLE)
        activations = {name: ek(*source) for name, source in pointwise.cuda_kernel_sources().items()}
        return activations | {
            "axpby": ek("T x, T a, T b", "T y", "y = a * x + b * y", "leafpy_axpby"),
            "momentum": ek("T g, T lr, T m", "T w, T h", "h = m * h + lr * g; w -= h", "leafpy_momentum"),
            "adam": ek("T g, T lr, T b1, T b2, T eps", "T w, T m, T v",
                       "m = b1 * m + ((T)1 - b1) * g; v = b2 * v + ((T)1 - b2) * g * g;"
                       " w -= lr * m / (sqrt(v) + eps)", "leafpy_adam"),
            "rmsprop": ek("T g, T lr, T d, T eps", "T w, T h",
                          "h = d * h + ((T)1 - d) * g * g; w -= lr * g / (sqrt(h) + eps)", "leafpy_rmsprop"),
            "adagrad": ek("T g, T lr, T eps", "T w, T h", "h += g * g; w -= lr * g / (sqrt(h) + eps)",
                          "leafpy_adagrad"),
            "adadelta": ek("T g, T lr, T d, T eps", "T w, T h, T u",
                           "h = d * h + ((T)1 - d) * g * g; T step = g * sqrt((u + eps) / (h + eps));"
                           " u = d * u + ((T)1 - d) * step * step; w -= lr * step", "leafpy_adadelta"),
            "bn_forward": ek("T x, raw T mean, raw T var, raw T gamma, raw T beta, int32 c, int32 inner, T eps, "
                             "int32 flags", "T y",
                             "int ch = (int)((i / inner) % c); T s = (T)1 / sqrt(var[ch] + eps);"
                             " if (flags & 1) s *= gamma[ch];"
                             " y = (x - mean[ch]) * s + ((flags & 2) ? beta[ch] : (T)0)", "leafpy_bn_forward"),
            "bn_grad": ek("T x, T dy, raw T mean, raw T var, raw T gamma, raw T sum_dy, raw T sum_dy_xhat, int32 c, "
                          "int32 inner, T eps, T inv_m, int32 flags", "T dx",
                          "int ch = (int)((i / inner) % c); T invstd = (T)1 / sqrt(var[ch] + eps);"
                          " T a = (flags & 1) ? gamma[ch] * invstd : invstd; T v = a * dy;"
                          " if (flags & 4) { T xhat = (x - mean[ch]) * invstd;"
                          " v -= a * (sum_dy[ch] + xhat * sum_dy_xhat[ch]) * inv_m; }"
                          " dx = v", "leafpy_bn_grad"),
            "dropout": ek("uint32 key, uint32 threshold, T scale", "T mask",
                          "unsigned int h = (unsigned int)i + key;"
                          " h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;"
                          " mask = h >= threshold ? scale : (T)0", "leafpy_dropout"),
        }

    # --- memory contract --------------------------------------------------------------------------------------
    def allocate(self, size: int, dtype: Any) -> Any:
        return self.xp.empty(size, dtype)

    def upload(self, host: np.ndarray, out: Any) -> None:
        out.set(np.ascontiguousarray(host))

    def download(self, buf: Any, host: np.ndarray) -> None:
        buf.get(out=host)

    def synchronize(self) -> None:
        self.device.synchronize()

    def peak_memory(self) -> int:
        """The most bytes in use at once (blocks handed out by CuPy's pools, cached free blocks not counted)
        since :meth:`track_memory`; before that, what the pools hold, free blocks included."""
        if self._peak_used:
            return self._peak_used
        return int(self.xp.get_default_memory_pool().total_bytes() + sum(p.total_bytes() for p in self._pools))

    def track_memory(self) -> None:
        """Record the peak of bytes in use from now on (routes CuPy's default allocator through a counter; a
        second call starts a new peak)."""
        default = self.xp.get_default_memory_pool()

        def tracked(size: int) -> Any:
            mem = default.malloc(size)
            self._note_usage()
            return mem

        self.xp.cuda.set_allocator(tracked)
        self._peak_used = 0
        self._note_usage()

    def _note_usage(self) -> None:
        used = self.xp.get_default_memory_pool().used_bytes() + sum(p.used_bytes() for p in self._pools)
        if used > self._peak_used:
            self._peak_used = int(used)

    def _scalar(self, v: float) -> Any:
        return self.dtype.type(v)

    # --- recorded training steps (CUDA graphs) -----------------------------------------------------------------
    MAX_RECORDED_STEPS = 4

    def run_step(self, key, step):
        if not self.graphs or key is None:
            return step()
        cp = self.xp
        self._drop_dead_steps()
        entry = self._steps.get(key)
        if entry is None:
            # first sight: run eagerly from the step's own pool, so the recording finds every block it needs
            if len(self._steps) >= self.MAX_RECORDED_STEPS:
                self._steps.pop(next(iter(self._steps)))
            entry = self._steps[key] = _RecordedStep(cp.cuda.MemoryPool())
            self._pools.append(entry.pool)
            with cp.cuda.using_allocator(entry.malloc(self)):
                step()
            return
        if entry.eager:
            return step()
        if entry.graph is None:
            if not self._record(entry, step):
                return step()
            # recording only captures: run the recorded step once for this call
        for ref, _, ptr in entry.tensors:
            t = ref()
            buf = t.buffer_on(self.key)
            if buf is None or buf.data.ptr != ptr:  # reallocated since the recording: record again
                entry.graph = None
                return step()
            if not t.is_fresh_on(self.key):
                t.read(self)  # host data changed (weights set, say): upload into the same buffer
        entry.graph.launch(self._step_stream)
        for ref, writes, _ in entry.tensors:
            if writes:
                ref().mark_fresh_only(self.key)

    def _drop_dead_steps(self) -> None:
        """Forget recorded steps whose tensors are gone (their solver was deleted); release idle pools."""
        for key in [k for k, e in self._steps.items() if e.dead()]:
            del self._steps[key]
        live = {id(e.pool) for e in self._steps.values()}
        self._pools = [p for p in self._pools if id(p) in live or p.used_bytes()]

    def _record(self, entry: _RecordedStep, step) -> bool:
        from ..tensor import SharedTensor

        cp = self.xp
        stream = self._step_stream
        accesses: list = []
        try:
            if self._capture_blas is None:
                self._capture_blas = _CaptureBlas(cp, self.tf32)
            self._capture_blas.prepare(stream)
            SharedTensor.recorder = accesses
            self._capturing = True
            with cp.cuda.using_allocator(entry.malloc(self)), stream:
                stream.begin_capture()
                try:
                    step()
                finally:
                    graph = stream.end_capture()
        except Exception as e:
            entry.eager = True  # something in the step cannot be recorded: run it eagerly from now on
            self.record_error = f"{type(e).__name__}: {e}"
            return False
        finally:
            SharedTensor.recorder = None
            self._capturing = False
        entry.tensors = [(weakref.ref(t), w, t.buffer_on(self.key).data.ptr) for t, w in SharedTensor.touched(accesses)]
        entry.graph = graph
        return True

    def gemm(self, a, trans_a, b, trans_b, out, alpha=1.0, beta=0.0):
        if self._capturing:  # CuPy refuses cuBLAS calls while a stream records; cuBLAS itself allows them
            self._capture_blas.gemm(a, trans_a, b, trans_b, out, alpha, beta)
        elif self.tf32:
            from cupy_backends.cuda.libs import cublas

            handle = self.device.cublas_handle  # CuPy's, shared: TF32 only for the duration of this call
            cublas.setMathMode(handle, _CaptureBlas.TF32_TENSOR_OP_MATH)
            try:
                super().gemm(a, trans_a, b, trans_b, out, alpha, beta)
            finally:
                cublas.setMathMode(handle, 0)  # CUBLAS_DEFAULT_MATH
        else:
            super().gemm(a, trans_a, b, trans_b, out, alpha, beta)

    # --- fused elementwise ------------------------------------------------------------------------------------
    def axpby(self, alpha, x, beta, y):
        self._kernels["axpby"](x, self._scalar(alpha), self._scalar(beta), y)

    def activation(self, kind, x, out, params=()):
        pointwise.line(kind)
        self._kernels[kind](x, *map(self._scalar, params), out)

    def activation_grad(self, kind, src, dy, dx, params=()):
        pointwise.line(kind)
        self._kernels[kind + "_grad"](src, dy, *map(self._scalar, params), dx)

    def momentum_update(self, w, g, h, lr, momentum):
        self._kernels["momentum"](g, self._scalar(lr), self._scalar(momentum), w, h)

    def adam_update(self, w, g, m, v, lr, beta1, beta2, eps):
        s = self._scalar
        self._kernels["adam"](g, s(lr), s(beta1), s(beta2), s(eps), w, m, v)

    def rmsprop_update(self, w, g, h, lr, decay, eps):
        s = self._scalar
        self._kernels["rmsprop"](g, s(lr), s(decay), s(eps), w, h)

    # --- batch normalisation: the statistics through CuPy's reductions, each per-element pass one kernel ------
    @staticmethod
    def _bn_geometry(x) -> tuple[np.int32, np.int32]:
        c = x.shape[1]
        return np.int32(c), np.int32(x.size // (x.shape[0] * c))

    def batch_norm(self, x, mean, var, gamma, beta, y, eps):
        c, inner = self._bn_geometry(x)
        flags = np.int32((gamma is not None) | ((beta is not None) << 1))
        self._kernels["bn_forward"](x, mean, var, mean if gamma is None else gamma, mean if beta is None else beta,
                                    c, inner, self._scalar(eps), flags, y)

    def batch_norm_grad(self, x, dy, mean, var, gamma, sum_dy, sum_dy_xhat, dx, eps, batch_stats):
        c, inner = self._bn_geometry(x)
        flags = np.int32((gamma is not None) | (bool(batch_stats) << 2))
        self._kernels["bn_grad"](x, dy, mean, var, mean if gamma is None else gamma, sum_dy, sum_dy_xhat, c, inner,
                                 self._scalar(eps), self._scalar(int(c) / x.size), flags, dx)

    def adagrad_update(self, w, g, h, lr, eps):
        s = self._scalar
        self._kernels["adagrad"](g, s(lr), s(eps), w, h)

    def adadelta_update(self, w, g, h, u, lr, decay, eps):
        s = self._scalar
        self._kernels["adadelta"](g, s(lr), s(decay), s(eps), w, h, u)

    def dropout_mask(self, mask, ratio, seed):
        from .array import dropout_key, dropout_threshold

        self._kernels["dropout"](np.uint32(dropout_key(seed)), np.uint32(dropout_threshold(ratio)),
                                 self._scalar(1.0 / (1.0 - ratio)), mask)

    # --- pooling: one kernel per pass ---------------------------------------------------------------------------
    def _pool_args(self, x_shape, y_shape, kernel, stride, padding, is_max):
        n, c, h, w = x_shape
        oh, ow = y_shape[2], y_shape[3]
        total = n * c * oh * ow
        i32 = np.int32
        return total, (i32(total), i32(c), i32(h), i32(w), i32(oh), i32(ow), i32(kernel[0]), i32(kernel[1]),
                       i32(stride[0]), i32(stride[1]), i32(padding[0]), i32(padding[1]), i32(is_max))

    def pool2d(self, x, out, mask, mode, kernel, stride, padding):
        if self.dtype != np.float32:
            return super().pool2d(x, out, mask, mode, kernel, stride, padding)
        total, args = self._pool_args(x.shape, out.shape, kernel, stride, padding, mode == "max")
        m = mask if mask is not None else out  # unused for average pooling
        self._pool_module.get_function("pool_fwd")(((total + 255) // 256,), (256,), (x, out, m) + args)

    def pool2d_grad(self, dy, dx, mask, mode, kernel, stride, padding):
        if self.dtype != np.float32:
            return super().pool2d_grad(dy, dx, mask, mode, kernel, stride, padding)
        dx.fill(0)
        total, args = self._pool_args(dx.shape, dy.shape, kernel, stride, padding, mode == "max")
        m = mask if mask is not None else dy
        self._pool_module.get_function("pool_bwd")(((total + 255) // 256,), (256,), (dy, dx, m) + args)

    # --- convolution through cuDNN graphs -----------------------------------------------------------------------
    def conv2d(self, x, w, out, stride, padding, ws, bias=None):
        if self._cudnn is None:
            return super().conv2d(x, w, out, stride, padding, ws, bias)
        if bias is not None and self.fuse_bias and self._cudnn.run("fprop_bias", x.shape, w.shape, out.shape, stride,
                                                                   padding, x, w, out, 0.0, bias):
            return
        self._cudnn.run("fprop", x.shape, w.shape, out.shape, stride, padding, x, w, out, 0.0)
        if bias is not None:
            self.bias_add(out, bias)

    def conv2d_grad_data(self, dy, w, dx, stride, padding, ws):
        if self._cudnn is None:
            return super().conv2d_grad_data(dy, w, dx, stride, padding, ws)
        self._cudnn.run("dgrad", dx.shape, w.shape, dy.shape, stride, padding, dx, w, dy, 0.0)

    def conv2d_grad_filter(self, x, dy, dw, stride, padding, ws, beta=0.0):
        if self._cudnn is None:
            return super().conv2d_grad_filter(x, dy, dw, stride, padding, ws, beta)
        if beta:
            tmp = self.xp.empty_like(dw)
            self._cudnn.run("wgrad", x.shape, dw.shape, dy.shape, stride, padding, x, tmp, dy, 0.0)
            dw += tmp
        else:
            self._cudnn.run("wgrad", x.shape, dw.shape, dy.shape, stride, padding, x, dw, dy, 0.0)


class _RecordedStep:
    """One recorded training step: its CUDA graph, the tensors it touches (weakly: a deleted solver's step is
    dropped, not kept alive) with the addresses baked in, and the private pool its scratch memory came from (no
    other step or eager code can be handed those blocks while the graph may still write them)."""

    __slots__ = ("pool", "graph", "tensors", "eager")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.graph: Any = None
        self.tensors: list = []
        self.eager = False

    def malloc(self, backend: CudaBackend) -> Any:
        def allocate(size: int) -> Any:
            mem = self.pool.malloc(size)
            backend._note_usage()
            return mem

        return allocate

    def dead(self) -> bool:
        return any(ref() is None for ref, _, _ in self.tensors)


class _CaptureBlas:
    """cuBLAS called directly (ctypes) on its own handle, with a fixed workspace, for recording CUDA graphs."""

    WORKSPACE = 32 << 20

    TF32_TENSOR_OP_MATH = 3  # cublasMath_t

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

    def prepare(self, stream: Any) -> None:
        ct = self.ct
        self.lib.cublasSetStream_v2(self.handle, ct.c_void_p(stream.ptr))
        self.lib.cublasSetWorkspace_v2(self.handle, ct.c_void_p(self.workspace.data.ptr), ct.c_size_t(self.WORKSPACE))

    def gemm(self, a, trans_a, b, trans_b, out, alpha, beta) -> None:
        ct = self.ct
        for arr in (a, b, out):
            if arr.ndim != 2 or not arr.flags.c_contiguous:
                raise BackendError("recorded GEMM needs contiguous 2-D operands")
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


def _nchw_strides(shape: tuple[int, ...]) -> list[int]:
    n, c, h, w = shape
    return [c * h * w, h * w, w, 1]


class _CudnnConv:
    """cuDNN frontend graphs for the three convolution passes, one graph per (pass, shapes, stride, padding)."""

    MAX_WORKSPACE = 1 << 30
    """Plans that need more scratch memory than this are not considered."""
    PLAN_TOLERANCE = 0.03
    """Among plans at most this fraction slower than the fastest, the one with the smallest workspace is kept."""
    FP32_EXCLUDED_NOTES = ("TENSOR_CORE", "DOWN_CONVERT_INPUTS", "REDUCED_PRECISION_REDUCTION", "FFT", "WINOGRAD",
                           "WINOGRAD_TILE_4x4", "WINOGRAD_TILE_6x6", "WINOGRAD_TILE_13x13")
    """cuDNN's numerical notes of engines that do not compute in full fp32 (TF32 tensor cores, fp16 inputs or
    reductions, FFT and Winograd transforms, which reach ~1e-3 relative error): excluded unless tf32=True."""
    AGREEMENT_SAMPLE = 1 << 16
    """Output elements compared between candidate plans."""
    FP32_AGREEMENT = 1e-5
    """In fp32 mode a plan is kept only if its output agrees with the median of every candidate plan's output to
    this relative error (max |difference| / max |median|): a net under the notes, since an engine's notes are
    its own declaration."""

    def __init__(self, cp: Any, tf32: bool, exact: bool = True) -> None:
        import cudnn

        self.cudnn = cudnn
        self.cp = cp
        self.tf32 = tf32
        self.exact = exact
        self.handle = cudnn.create_handle()
        self.graphs: dict = {}
        self.workspace = cp.empty(0, dtype=cp.uint8)
        self._trials: list[int] = []
        self.timings: dict = {}  # graph key -> [(ms, workspace bytes, plan index)] of every plan that ran
        self.errors: dict = {}  # graph key -> {plan index: relative difference from the plans' median} (fp32)
        atexit.register(self.graphs.clear)  # release the graphs while their library is still loaded

    def _build(self, kind: str, x_shape, w_shape, y_shape, stride, padding) -> tuple:
        cudnn = self.cudnn
        f32 = cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)
        pad, st, dil = list(padding), list(stride), [1, 1]
        if kind in ("fprop", "fprop_bias"):
            X = g.tensor(name="X", dim=list(x_shape), stride=_nchw_strides(x_shape), data_type=f32)
            W = g.tensor(name="W", dim=list(w_shape), stride=_nchw_strides(w_shape), data_type=f32)
            Y = g.conv_fprop(image=X, weight=W, padding=pad, stride=st, dilation=dil, compute_data_type=f32)
            if kind == "fprop_bias":
                o = w_shape[0]
                Bt = g.tensor(name="B", dim=[1, o, 1, 1], stride=[o, 1, 1, 1], data_type=f32)
                Y = g.bias(name="bias", input=Y, bias=Bt)
            Y.set_output(True).set_dim(list(y_shape)).set_stride(_nchw_strides(y_shape)).set_data_type(f32)
            names = (X, W, Y) if kind == "fprop" else (X, W, Y, Bt)
        elif kind == "dgrad":
            DY = g.tensor(name="DY", dim=list(y_shape), stride=_nchw_strides(y_shape), data_type=f32)
            W = g.tensor(name="W", dim=list(w_shape), stride=_nchw_strides(w_shape), data_type=f32)
            DX = g.conv_dgrad(loss=DY, filter=W, padding=pad, stride=st, dilation=dil, compute_data_type=f32)
            DX.set_output(True).set_dim(list(x_shape)).set_stride(_nchw_strides(x_shape)).set_data_type(f32)
            names = (DX, W, DY)
        else:
            X = g.tensor(name="X", dim=list(x_shape), stride=_nchw_strides(x_shape), data_type=f32)
            DY = g.tensor(name="DY", dim=list(y_shape), stride=_nchw_strides(y_shape), data_type=f32)
            DW = g.conv_wgrad(image=X, loss=DY, padding=pad, stride=st, dilation=dil, compute_data_type=f32)
            DW.set_output(True).set_dim(list(w_shape)).set_stride(_nchw_strides(w_shape)).set_data_type(f32)
            names = (X, DW, DY)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
        if not self.tf32:
            excluded = self.FP32_EXCLUDED_NOTES if self.exact else ("TENSOR_CORE",)
            g.deselect_numeric_notes([getattr(cudnn.numerical_note, n) for n in excluded
                                      if hasattr(cudnn.numerical_note, n)])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
        return g, names

    def _autotune(self, g: Any, pack: dict, key: tuple, out: Any) -> int:
        """Time every built plan on the real buffers and keep the fastest (as cudnn.benchmark does), preferring a
        smaller workspace where the difference in time is within :attr:`PLAN_TOLERANCE`; in fp32 mode only among
        plans whose result agrees with the others' (see :attr:`FP32_AGREEMENT`)."""
        cp = self.cp
        timings = self.timings[key] = []
        results: list[Any] = []
        # the agreement check looks at a fixed sample of the output's elements: an inexact transform is off
        # everywhere, and a sample keeps the candidates' copies small
        flat = out.reshape(-1)
        sample = cp.arange(flat.size) if flat.size <= self.AGREEMENT_SAMPLE else cp.asarray(
            np.random.default_rng(0).choice(flat.size, self.AGREEMENT_SAMPLE, replace=False))
        for i in range(g.get_execution_plan_count()):
            try:
                size = g.get_workspace_size_plan_at_index(i)
                if size > self.MAX_WORKSPACE:
                    continue
                # trial workspaces bypass the memory pool, so they are really freed afterwards
                trial = cp.cuda.runtime.malloc(max(size, 1))
                self._trials.append(trial)
                g.execute_plan_at_index(pack, trial, i, handle=self.handle)
                runs = []
                for _ in range(5):  # the fastest of five runs: one slow run must not decide
                    start, stop = cp.cuda.Event(), cp.cuda.Event()
                    start.record()
                    g.execute_plan_at_index(pack, trial, i, handle=self.handle)
                    stop.record()
                    stop.synchronize()
                    runs.append(cp.cuda.get_elapsed_time(start, stop))
                ms = min(runs)
                if self.exact:
                    results.append(flat[sample])
            except Exception:
                continue  # a plan that cannot run here
            timings.append((ms, size, i))
        cp.cuda.runtime.deviceSynchronize()
        for trial in self._trials:
            cp.cuda.runtime.free(trial)
        self._trials.clear()
        if not timings:
            raise BackendError("no cuDNN plan could run")
        if len(results) >= 3:
            median = cp.median(cp.stack(results), axis=0)
            scale = float(cp.abs(median).max()) or 1.0
            errors = [float(cp.abs(r - median).max()) / scale for r in results]
            self.errors[key] = dict(zip((i for _, _, i in timings), errors))
            agreeing = [t for t, e in zip(timings, errors) if e <= self.FP32_AGREEMENT]
            if agreeing:
                timings = agreeing
            del median
        results.clear()
        limit = min(ms for ms, _, _ in timings) * (1.0 + self.PLAN_TOLERANCE)
        size, _, best = min((size, ms, i) for ms, size, i in timings if ms <= limit)
        if size > self.workspace.size:
            self.workspace = cp.empty(size, dtype=cp.uint8)
        return best

    def run(self, kind, x_shape, w_shape, y_shape, stride, padding, x, w, y, beta, bias=None) -> bool:
        """Run one pass; False when cuDNN has no engine for it (only asked of optional fusions)."""
        key = (kind, tuple(x_shape), tuple(w_shape), tuple(y_shape), tuple(stride), tuple(padding))
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = (*self._build(kind, x_shape, w_shape, y_shape, stride, padding), None)
            except Exception as e:
                if kind == "fprop_bias":
                    self.graphs[key] = "unsupported"
                    return False
                raise BackendError(f"cuDNN could not build a {kind} graph for input {tuple(x_shape)}, filter "
                                   f"{tuple(w_shape)}: {e}") from e
            self.graphs[key] = entry
        if entry == "unsupported":
            return False
        self.cudnn.set_stream(handle=self.handle, stream=self.cp.cuda.get_current_stream().ptr)
        g, tensors, plan = entry
        pack = {t: arr.data.ptr for t, arr in zip(tensors, (x, w, y, bias))}
        if plan is None:
            # the first run on real buffers picks the plan (outputs are overwritten, so timing them is harmless)
            out = {"dgrad": x, "wgrad": w}.get(kind, y)
            plan = self._autotune(g, pack, key, out)
            self.graphs[key] = (g, tensors, plan)
        g.execute_plan_at_index(pack, self.workspace.data.ptr, plan, handle=self.handle)
        return True
