"""The cuda backend: CuPy arrays on an NVIDIA GPU.

GEMM goes to cuBLAS through CuPy; elementwise work runs in fused kernels; convolution runs through cuDNN graphs
(NVIDIA's ``nvidia-cudnn-frontend``), built once per shape and cached, with the shared im2col + GEMM path when
the frontend cannot be imported (or with ``use_cudnn=False``); pooling runs in one kernel per pass.

Importing this module does not import CuPy; constructing the backend does.
"""

from __future__ import annotations

import atexit
import functools
from typing import Any

import numpy as np

from ..errors import BackendError, BackendUnavailable
from . import pointwise
from .array import ArrayBackend
from .recorder import StepRecorder

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


_BN_SOURCE = r"""
// Batch normalisation's per-channel reductions over [N, C, S]: one block per channel, each thread summing a strided
// share of the channel's N * S values, then a tree in shared memory (BLOCK threads).
#define BLOCK 512
__device__ float block_sum(float v, float* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int w = BLOCK / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
        __syncthreads();
    }
    float total = red[0];
    __syncthreads();
    return total;
}
// mean and biased variance, in two passes (no cancellation when |mean| >> std)
extern "C" __global__ void bn_stats(const float* x, float* mean, float* var, int n, int c, int s) {
    __shared__ float red[BLOCK];
    const int ch = blockIdx.x, count = n * s;
    float acc = 0.f;
    for (int i = threadIdx.x; i < count; i += BLOCK) {
        int b = i / s;
        acc += x[((long long)b * c + ch) * s + (i - b * s)];
    }
    const float m = block_sum(acc, red) / (float)count;
    acc = 0.f;
    for (int i = threadIdx.x; i < count; i += BLOCK) {
        int b = i / s;
        float d = x[((long long)b * c + ch) * s + (i - b * s)] - m;
        acc += d * d;
    }
    const float v = block_sum(acc, red) / (float)count;
    if (threadIdx.x == 0) { mean[ch] = m; var[ch] = v; }
}
// sum dy and sum dy * (x - mean) / sqrt(var + eps), in one pass
extern "C" __global__ void bn_grad_sums(const float* x, const float* dy, const float* mean, const float* var,
        float* sum_dy, float* sum_dy_xhat, int n, int c, int s, float eps) {
    __shared__ float red[BLOCK];
    const int ch = blockIdx.x, count = n * s;
    const float m = mean[ch];
    float a = 0.f, b2 = 0.f;
    for (int i = threadIdx.x; i < count; i += BLOCK) {
        int b = i / s;
        long long k = ((long long)b * c + ch) * s + (i - b * s);
        float g = dy[k];
        a += g;
        b2 += g * (x[k] - m);
    }
    const float total_dy = block_sum(a, red);
    const float total_dy_x = block_sum(b2, red);
    if (threadIdx.x == 0) { sum_dy[ch] = total_dy; sum_dy_xhat[ch] = total_dy_x / sqrtf(var[ch] + eps); }
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
        self._bn_module = cupy.RawModule(code=_BN_SOURCE)
        self._cudnn = None
        self.graphs = graphs
        self.recorder = StepRecorder(self, self.MAX_RECORDED_STEPS)
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
            "clip_to_norm": ek("raw T sumsq, T threshold", "T x",
                               "T n = sqrt(sumsq[0]); if (n > threshold) x *= threshold / n", "leafpy_clip_to_norm"),
            # solver updates: the step's rate is read on the device (rate[0]), so a recorded step replays under
            # any learning-rate schedule
            "momentum": ek("T g, raw T rate, T mult, T m", "T w, T h",
                           "h = m * h + rate[0] * mult * g; w -= h", "leafpy_momentum"),
            "nesterov": ek("T g, raw T rate, T mult, T m", "T w, T h, T prev",
                           "prev = h; h = m * h + rate[0] * mult * g; w -= ((T)1 + m) * h - m * prev",
                           "leafpy_nesterov"),
            "adam": ek("T g, raw T rate, T mult, T b1, T b2, T eps", "T w, T m, T v",
                       "m = b1 * m + ((T)1 - b1) * g; v = b2 * v + ((T)1 - b2) * g * g;"
                       " w -= rate[0] * mult * m / (sqrt(v) + eps)", "leafpy_adam"),
            "rmsprop": ek("T g, raw T rate, T mult, T d, T eps", "T w, T h",
                          "h = d * h + ((T)1 - d) * g * g; w -= rate[0] * mult * g / (sqrt(h) + eps)",
                          "leafpy_rmsprop"),
            "adagrad": ek("T g, raw T rate, T mult, T eps", "T w, T h",
                          "h += g * g; w -= rate[0] * mult * g / (sqrt(h) + eps)", "leafpy_adagrad"),
            "adadelta": ek("T g, raw T rate, T mult, T d, T eps", "T w, T h, T u",
                           "h = d * h + ((T)1 - d) * g * g; T step = g * sqrt((u + eps) / (h + eps));"
                           " u = d * u + ((T)1 - d) * step * step; w -= rate[0] * mult * step", "leafpy_adadelta"),
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
            "dropout": ek("raw uint32 seed, uint32 mult, uint32 threshold, T scale", "T mask",
                          "unsigned int h = (unsigned int)i + seed[0] * mult;"
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

    # --- recorded training steps (CUDA graphs; the bookkeeping is recorder.StepRecorder's) --------------------
    MAX_RECORDED_STEPS = 4

    def run_step(self, key, step):
        if not self.graphs:
            return step()
        self._release_idle_pools()
        self.recorder.run(key, step)

    @property
    def record_error(self) -> str | None:
        """Why the last step that could not be recorded as a CUDA graph could not (None: every one could)."""
        return self.recorder.error

    def _release_idle_pools(self) -> None:
        live = {id(p) for p in self.recorder.live_extras()}
        self._pools = [p for p in self._pools if id(p) in live or p.used_bytes()]

    def first_run(self, entry, step) -> None:
        # run eagerly from the step's own pool, so the recording finds every block it needs; addresses baked into
        # a graph stay the step's own (no other step or eager code is handed them while the graph may write them)
        cp = self.xp
        entry.extra = cp.cuda.MemoryPool()
        self._pools.append(entry.extra)
        with cp.cuda.using_allocator(self._pool_malloc(entry.extra)):
            step()

    def _pool_malloc(self, pool: Any) -> Any:
        def allocate(size: int) -> Any:
            mem = pool.malloc(size)
            self._note_usage()
            return mem

        return allocate

    def capture(self, entry, step) -> tuple[Any, bool]:
        cp = self.xp
        stream = self._step_stream
        if self._capture_blas is None:
            self._capture_blas = _CaptureBlas(cp, self.tf32)
        self._capture_blas.prepare(stream)
        self._capturing = True
        try:
            with cp.cuda.using_allocator(self._pool_malloc(entry.extra)), stream:
                stream.begin_capture()
                try:
                    step()
                finally:
                    graph = stream.end_capture()
        finally:
            self._capturing = False
        return graph, False  # capturing only records: the recorder launches the graph for this call

    def launch(self, recording) -> None:
        recording.launch(self._step_stream)

    @staticmethod
    def handle(buffer) -> int:
        return buffer.data.ptr

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

    def clip_to_norm(self, x, sumsq, threshold):
        self._kernels["clip_to_norm"](sumsq, self._scalar(threshold), x)

    def momentum_update(self, w, g, h, rate, lr_mult, momentum):
        s = self._scalar
        self._kernels["momentum"](g, rate, s(lr_mult), s(momentum), w, h)

    def nesterov_update(self, w, g, h, prev, rate, lr_mult, momentum):
        s = self._scalar
        self._kernels["nesterov"](g, rate, s(lr_mult), s(momentum), w, h, prev)

    def adam_update(self, w, g, m, v, rate, lr_mult, beta1, beta2, eps):
        s = self._scalar
        self._kernels["adam"](g, rate, s(lr_mult), s(beta1), s(beta2), s(eps), w, m, v)

    def rmsprop_update(self, w, g, h, rate, lr_mult, decay, eps):
        s = self._scalar
        self._kernels["rmsprop"](g, rate, s(lr_mult), s(decay), s(eps), w, h)

    # --- batch normalisation: the per-channel sums one reduction kernel each, each per-element pass one kernel ---
    @staticmethod
    def _bn_geometry(x) -> tuple[np.int32, np.int32]:
        c = x.shape[1]
        return np.int32(c), np.int32(x.size // (x.shape[0] * c))

    def batch_norm_stats(self, x, mean, var):
        if self.dtype != np.float32:
            return super().batch_norm_stats(x, mean, var)
        c, inner = self._bn_geometry(x)
        self._bn_module.get_function("bn_stats")((int(c),), (512,), (x, mean, var, np.int32(x.shape[0]), c, inner))

    def batch_norm_grad_sums(self, x, dy, mean, var, sum_dy, sum_dy_xhat, eps):
        if self.dtype != np.float32:
            return super().batch_norm_grad_sums(x, dy, mean, var, sum_dy, sum_dy_xhat, eps)
        c, inner = self._bn_geometry(x)
        self._bn_module.get_function("bn_grad_sums")((int(c),), (512,), (x, dy, mean, var, sum_dy, sum_dy_xhat,
                                                                          np.int32(x.shape[0]), c, inner,
                                                                          np.float32(eps)))

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

    def adagrad_update(self, w, g, h, rate, lr_mult, eps):
        s = self._scalar
        self._kernels["adagrad"](g, rate, s(lr_mult), s(eps), w, h)

    def adadelta_update(self, w, g, h, u, rate, lr_mult, decay, eps):
        s = self._scalar
        self._kernels["adadelta"](g, rate, s(lr_mult), s(decay), s(eps), w, h, u)

    def dropout_mask(self, mask, ratio, seed):
        from .array import DROPOUT_KEY_MULTIPLIER, dropout_threshold

        self._kernels["dropout"](seed, np.uint32(DROPOUT_KEY_MULTIPLIER), np.uint32(dropout_threshold(ratio)),
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

    # --- local response normalisation: one thread per element sums its window of channels ----------------------
    _LRN = ("raw T x, int32 c, int32 inner, int32 size, T a_over_n, T beta, T k", "T scale, T y",
            "int ch = (int)((i / inner) % c); long long base = i - (long long)ch * inner; int pre = (size - 1) / 2;"
            " int lo = max(ch - pre, 0), hi = min(ch - pre + size - 1, c - 1); T total = 0;"
            " for (int j = lo; j <= hi; ++j) { T v = x[base + (long long)j * inner]; total += v * v; }"
            " T s = k + a_over_n * total; scale = s; y = x[i] * pow(s, -beta)", "leafpy_lrn")
    _LRN_GRAD = ("raw T x, raw T y, raw T scale, raw T dy, int32 c, int32 inner, int32 size, T coef, T beta", "T dx",
                 "int ch = (int)((i / inner) % c); long long base = i - (long long)ch * inner;"
                 " int pre = (size - 1) / 2; int lo = max(ch - (size - 1 - pre), 0), hi = min(ch + pre, c - 1);"
                 " T total = 0;"
                 " for (int j = lo; j <= hi; ++j) { long long q = base + (long long)j * inner;"
                 " total += dy[q] * y[q] / scale[q]; }"
                 " dx = dy[i] * pow(scale[i], -beta) - coef * x[i] * total", "leafpy_lrn_grad")

    def _lrn_kernel(self, which: str) -> Any:
        kernel = self._kernels.get(which)
        if kernel is None:
            kernel = self._kernels[which] = self.xp.ElementwiseKernel(*getattr(self, "_" + which.upper()))
        return kernel

    @staticmethod
    def _lrn_geometry(x: Any) -> tuple[int, int]:
        c = x.shape[1]
        return c, x.size // max(x.shape[0] * c, 1)

    def lrn(self, x, scale, out, size, alpha, beta, k):
        c, inner = self._lrn_geometry(x)
        s = self._scalar
        self._lrn_kernel("lrn")(x, c, inner, size, s(alpha / size), s(beta), s(k), scale, out)

    def lrn_grad(self, x, y, scale, dy, dx, size, alpha, beta):
        c, inner = self._lrn_geometry(x)
        s = self._scalar
        self._lrn_kernel("lrn_grad")(x, y, scale, dy, c, inner, size, s(2.0 * alpha * beta / size), s(beta), dx)

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

    # --- sequences: embeddings and recurrent cells, each one fused kernel ------------------------------------
    @functools.cached_property
    def _seq_kernels(self) -> dict:
        ek = self.xp.ElementwiseKernel
        row = "T f = ids[i / d]; int r = f >= (T)(v - 1) ? v - 1 : (f > (T)0 ? (int)f : 0);"  # NaN: row 0
        emit = (" h[i] = hv; if (t == 0) hprev[s0] = (T)0; if (t + 1 < steps) hprev[s0 + hs] = hv;"
                " if (seq) y[s0] = hv; else if (t + 1 == steps) y[i] = hv;")
        head = "int n = i / hs, j = i % hs; long long s0 = ((long long)n * steps + t) * hs + j;"
        dh = " T dh = dh_in[i]; if (seq) dh += dy[s0]; else if (t + 1 == steps) dh += dy[i];"
        return {
            "embedding": ek("raw T ids, raw T table, int32 d, int32 v", "T out",
                            row + " out = table[(long long)r * d + i % d]", "leafpy_embedding"),
            "embedding_grad": ek("raw T ids, T dy, int32 d, int32 v", "raw T dt",
                                 row + " atomicAdd(&dt[(long long)r * d + i % d], dy)", "leafpy_embedding_grad"),
            "lstm_cell": ek(
                "raw T hw, raw T bias, int32 steps, int32 hs, int32 t, int32 seq", "raw T a, raw T c, raw T h, "
                "raw T hprev, raw T y",
                head + " long long g = ((long long)n * steps + t) * 4 * hs + j;"
                " long long w = (long long)n * 4 * hs + j;"
                " T gi = (T)1 / ((T)1 + exp(-(a[g] + hw[w] + bias[j])));"
                " T gf = (T)1 / ((T)1 + exp(-(a[g + hs] + hw[w + hs] + bias[j + hs])));"
                " T gg = tanh(a[g + 2 * hs] + hw[w + 2 * hs] + bias[j + 2 * hs]);"
                " T go = (T)1 / ((T)1 + exp(-(a[g + 3 * hs] + hw[w + 3 * hs] + bias[j + 3 * hs])));"
                " a[g] = gi; a[g + hs] = gf; a[g + 2 * hs] = gg; a[g + 3 * hs] = go;"
                " T cn = gi * gg; if (t > 0) cn += gf * c[s0 - hs]; c[s0] = cn; T hv = go * tanh(cn);" + emit,
                "leafpy_lstm_cell"),
            "lstm_cell_grad": ek(
                "raw T a, raw T c, raw T dh_in, raw T dy, int32 steps, int32 hs, int32 t, int32 seq",
                "raw T dc, raw T dg, raw T dgt",
                head + dh + " long long g = ((long long)n * steps + t) * 4 * hs + j;"
                " long long w = (long long)n * 4 * hs + j;"
                " T gi = a[g], gf = a[g + hs], gg = a[g + 2 * hs], go = a[g + 3 * hs]; T tc = tanh(c[s0]);"
                " T dct = dc[i] + dh * go * ((T)1 - tc * tc);"
                " T df = t > 0 ? dct * c[s0 - hs] * gf * ((T)1 - gf) : (T)0;"
                " T di = dct * gg * gi * ((T)1 - gi); T dgg = dct * gi * ((T)1 - gg * gg);"
                " T dgo = dh * tc * go * ((T)1 - go); dc[i] = dct * gf;"
                " dg[g] = dgt[w] = di; dg[g + hs] = dgt[w + hs] = df; dg[g + 2 * hs] = dgt[w + 2 * hs] = dgg;"
                " dg[g + 3 * hs] = dgt[w + 3 * hs] = dgo;", "leafpy_lstm_cell_grad"),
            "gru_cell": ek(
                "raw T hw, raw T bi, raw T bh, int32 steps, int32 hs, int32 t, int32 seq",
                "raw T a, raw T hn, raw T h, raw T hprev, raw T y",
                head + " long long g = ((long long)n * steps + t) * 3 * hs + j;"
                " long long w = (long long)n * 3 * hs + j;"
                " T r = (T)1 / ((T)1 + exp(-(a[g] + bi[j] + hw[w] + bh[j])));"
                " T z = (T)1 / ((T)1 + exp(-(a[g + hs] + bi[j + hs] + hw[w + hs] + bh[j + hs])));"
                " T bn = hw[w + 2 * hs] + bh[j + 2 * hs]; T nv = tanh(a[g + 2 * hs] + bi[j + 2 * hs] + r * bn);"
                " a[g] = r; a[g + hs] = z; a[g + 2 * hs] = nv; hn[s0] = bn;"
                " T hp = t > 0 ? hprev[s0] : (T)0; T hv = ((T)1 - z) * nv + z * hp;" + emit, "leafpy_gru_cell"),
            "gru_cell_grad": ek(
                "raw T a, raw T hn, raw T hprev, raw T dy, int32 steps, int32 hs, int32 t, int32 seq",
                "raw T dh_in, raw T dp, raw T dph, raw T dpht",
                head + dh + " long long g = ((long long)n * steps + t) * 3 * hs + j;"
                " long long w = (long long)n * 3 * hs + j; T r = a[g], z = a[g + hs], nv = a[g + 2 * hs];"
                " T dn = dh * ((T)1 - z) * ((T)1 - nv * nv); T dz = dh * (hprev[s0] - nv) * z * ((T)1 - z);"
                " T dr = dn * hn[s0] * r * ((T)1 - r); dh_in[i] = dh * z;"
                " dp[g] = dph[g] = dpht[w] = dr; dp[g + hs] = dph[g + hs] = dpht[w + hs] = dz;"
                " dp[g + 2 * hs] = dn; dph[g + 2 * hs] = dpht[w + 2 * hs] = dn * r;", "leafpy_gru_cell_grad"),
            "rnn_cell": ek(
                "raw T hw, raw T bias, int32 steps, int32 hs, int32 t, int32 seq", "raw T a, raw T h, raw T hprev, "
                "raw T y", head + " T hv = tanh(a[s0] + hw[i] + bias[j]); a[s0] = hv;" + emit, "leafpy_rnn_cell"),
            "rnn_cell_grad": ek(
                "raw T a, raw T dh_in, raw T dy, int32 steps, int32 hs, int32 t, int32 seq", "raw T dp, raw T dpt",
                head + dh + " T hv = a[s0]; T d = dh * ((T)1 - hv * hv); dp[s0] = d; dpt[i] = d;",
                "leafpy_rnn_cell_grad"),
        }

    def embedding(self, ids, table, out):
        v, d = table.shape
        self._seq_kernels["embedding"](ids, table, np.int32(d), np.int32(v), out)

    def embedding_grad(self, ids, dy, dtable, beta=0.0):
        if beta == 0.0:
            dtable.fill(0)
        elif beta != 1.0:
            dtable *= self._scalar(beta)
        v, d = dtable.shape
        self._seq_kernels["embedding_grad"](ids, dy, np.int32(d), np.int32(v), dtable)

    def _step_args(self, c, t, sequence) -> tuple:
        n, steps, hs = c.shape
        return (np.int32(steps), np.int32(hs), np.int32(t), np.int32(bool(sequence))), n * hs

    def lstm_cell(self, gates, hw, bias, c, h, hprev, y, t, sequence):
        args, size = self._step_args(c, t, sequence)
        self._seq_kernels["lstm_cell"](hw, bias, *args, gates, c, h, hprev, y, size=size)

    def lstm_cell_grad(self, gates, c, dh, dy, dc, dgates, dgates_t, t, sequence):
        args, size = self._step_args(c, t, sequence)
        self._seq_kernels["lstm_cell_grad"](gates, c, dh, dy, *args, dc, dgates, dgates_t, size=size)

    def gru_cell(self, pre, hw, bias_ih, bias_hh, hn, h, hprev, y, t, sequence):
        args, size = self._step_args(hn, t, sequence)
        self._seq_kernels["gru_cell"](hw, bias_ih, bias_hh, *args, pre, hn, h, hprev, y, size=size)

    def gru_cell_grad(self, pre, hn, hprev, dh, dy, dpre, dpre_h, dpre_h_t, t, sequence):
        args, size = self._step_args(hn, t, sequence)
        self._seq_kernels["gru_cell_grad"](pre, hn, hprev, dy, *args, dh, dpre, dpre_h, dpre_h_t, size=size)

    def rnn_cell(self, pre, hw, bias, h, hprev, y, t, sequence):
        args, size = self._step_args(pre, t, sequence)
        self._seq_kernels["rnn_cell"](hw, bias, *args, pre, h, hprev, y, size=size)

    def rnn_cell_grad(self, pre, dh, dy, dpre, dpre_t, t, sequence):
        args, size = self._step_args(pre, t, sequence)
        self._seq_kernels["rnn_cell_grad"](pre, dh, dy, *args, dpre, dpre_t, size=size)


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
