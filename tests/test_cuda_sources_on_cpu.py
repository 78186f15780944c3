"""The cuda backend's pooling kernels, its channels-last batch-normalisation reductions and its solver updates
(generated from leafpy/backends/updates.py's table), run on the CPU: their CUDA source (leafpy/backends/cuda/kernels.py
and the updates' ElementwiseKernel operations, the text CuPy compiles on the GPU) is compiled by the host's C++
compiler behind a few definitions that stand in for CUDA's (one thread at a time, atomicAdd as an addition, an
ElementwiseKernel as a loop over its elements), and run over every thread of their grids, row-major and
channels-last, float32 and bfloat16 storage, against float64 NumPy (the updates: against the native backend). Their
index arithmetic is then tested where CI runs, without a GPU; the GPU machine runs the same kernels through the cuda
backend (test_backends.py). Kernels that cooperate within a block (shared memory, warp shuffles)
are only compiled here, not run, except the batch-normalisation combinations and the gradients' sum of squares, run
with one thread per block (their block-wide sum then adds nothing)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from test_update_rules import LION, UPDATE_PARAMS

from leafpy.backends import updates
from leafpy.backends.cuda.kernels import (
    _BN_SOURCE,
    _POOL_SOURCE,
    COMBINE_THREADS,
    PAD_CHANNELS_SOURCE,
    SUM_SQUARES_CHUNK,
    sum_squares_chunks,
    sum_squares_source,
)
from leafpy.backends.cuda.lowp import CONVERT
from leafpy.backends.native import NativeBackend

SHIMS = r"""
#include <algorithm>
#include <cmath>
#include <cstring>
using std::min;
using std::max;
struct Index { int x, y; };
static Index blockDim = {1, 1}, blockIdx = {0, 0}, threadIdx = {0, 0}, gridDim = {1, 1};
struct float4 { float x, y, z, w; };
struct uint4 { unsigned int x, y, z, w; };
struct int4 { int x, y, z, w; };
static inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }
static inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
struct ushort4 { unsigned short x, y, z, w; };
static inline ushort4 make_ushort4(unsigned short x, unsigned short y, unsigned short z, unsigned short w) {
    return {x, y, z, w};
}
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline void __syncthreads() {}
static inline float __shfl_down_sync(unsigned int, float v, int) { return v; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float atomicAdd(float* p, float v) { float old = *p; *p = old + v; return old; }
"""

RUNNER = r"""
#define POOL_ARGS int total, int C, int H, int W, int OH, int OW, int kh, int kw, int sh, int sw, int ph, int pw, \
    int is_max, int lh, int lw, int hh, int hw
#define POOL_VALUES total, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, is_max, lh, lw, hh, hw
extern "C" void run_fwd(const S* x, S* y, int* mask, POOL_ARGS) {
    for (int t = 0; t < total; ++t) { blockIdx.x = t; pool_fwd(x, y, mask, POOL_VALUES); }
}
extern "C" void run_bwd(const S* dy, float* dx, const int* mask, POOL_ARGS) {
    for (int t = 0; t < total; ++t) { blockIdx.x = t; pool_bwd(dy, dx, mask, POOL_VALUES); }
}
#if defined(CHANNELS_LAST) && defined(LOWP)
extern "C" void run_fwd8(const uint4* x, uint4* y, int4* mask, POOL_ARGS) {
    for (int t = 0; t < total; ++t) { blockIdx.x = t; pool_fwd8(x, y, mask, POOL_VALUES); }
}
extern "C" void run_bwd8(const uint4* dy, uint4* dx, const int4* mask, POOL_ARGS) {
    for (int t = 0; t < total; ++t) { blockIdx.x = t; pool_bwd8(dy, dx, mask, POOL_VALUES); }
}
#endif
"""

CASES = [  # (N, C, H, W), kernel, stride, padding
    ((2, 3, 7, 6), (3, 3), (2, 2), (1, 1)),  # overlapping windows, padding: the gradient adds up
    ((3, 5, 8, 8), (2, 2), (2, 2), (0, 0)),  # windows that tile the input
    ((1, 4, 5, 9), (2, 3), (1, 2), (0, 1)),  # rectangular windows and strides
]
EXTRA_CASES = [  # the same, then padding after, ceil_mode and count_include_pad, checked against the native backend
    ((2, 2, 6, 7), (3, 3), (2, 2), (1, 1), (1, 1), True, True),  # ceil mode: windows past the padding
    ((1, 3, 6, 6), (3, 3), (2, 2), (1, 1), (1, 1), True, False),  # and divisors of the input's positions only
    ((1, 2, 5, 6), (3, 2), (1, 2), (0, 1), (2, 0), False, True),  # asymmetric padding
]


def _converters() -> str:
    """lowp.CONVERT's float32 and bfloat16 conversions (float16's use PTX instructions a CPU has not)."""
    head = CONVERT[:CONVERT.index("__device__ __forceinline__ float ld_f16")]
    assert "ld_bf16" in head and "st_bf16" in head
    return head


BN_RUNNER = r"""
static void grid(int blocks_x, int blocks_y, int threads, void (*body)()) {
    gridDim.x = blocks_x; gridDim.y = blocks_y; blockDim.x = threads;
    for (int by = 0; by < blocks_y; ++by) for (int bx = 0; bx < blocks_x; ++bx) for (int t = 0; t < threads; ++t) {
        blockIdx.x = bx; blockIdx.y = by; threadIdx.x = t; body();
    }
}
static const S *X, *DY; static float *PART, *MEAN, *VAR, *SUM_DY, *SUM_DY_XHAT; static int M, C, ROWS, RUNS;
extern "C" void run_rows_stats(const S* x, float* part, float* mean, float* var, int m, int c, int rows) {
    X = x; PART = part; MEAN = mean; VAR = var; M = m; C = c; ROWS = rows; RUNS = (m + rows - 1) / rows;
    grid((c + 127) / 128, RUNS, 128, [] { bn_rows_stats_part(X, PART, M, C, ROWS); });
    grid(c, 1, 1, [] { bn_stats_combine(PART, MEAN, VAR, M, C, 1, ROWS, RUNS); });  // a block per channel
}
extern "C" void run_rows_grad(const S* x, const S* dy, const float* mean, const float* var, float* part,
        float* sum_dy, float* sum_dy_xhat, int m, int c, int rows, float eps) {
    X = x; DY = dy; MEAN = (float*)mean; VAR = (float*)var; PART = part; SUM_DY = sum_dy;
    SUM_DY_XHAT = sum_dy_xhat; M = m; C = c; ROWS = rows; RUNS = (m + rows - 1) / rows;
    static float EPS; EPS = eps;
    grid((c + 127) / 128, RUNS, 128, [] { bn_rows_grad_part(X, DY, MEAN, PART, M, C, ROWS); });
    grid(c, 1, 1, [] { bn_grad_combine(PART, VAR, SUM_DY, SUM_DY_XHAT, C, RUNS, EPS); });
}
static S *Y; static const float *GAMMA, *BETA; static long long N8; static float EPS8, INV_M; static int FLAGS;
extern "C" void run_rows_apply8(const S* x, S* y, const float* mean, const float* var, const float* gamma,
        const float* beta, int c, long long n8, float eps, int flags) {
    X = x; Y = y; MEAN = (float*)mean; VAR = (float*)var; GAMMA = gamma; BETA = beta; C = c; N8 = n8; EPS8 = eps;
    FLAGS = flags;
    grid((int)n8, 1, 1, [] { bn_rows_apply8(X, Y, MEAN, VAR, GAMMA, BETA, C, N8, EPS8, FLAGS); });
}
extern "C" void run_rows_backward8(const S* x, const S* dy, S* dx, const float* mean, const float* var,
        const float* gamma, const float* sum_dy, const float* sum_dy_xhat, int c, long long n8, float eps,
        float inv_m, int flags) {
    X = x; DY = dy; Y = dx; MEAN = (float*)mean; VAR = (float*)var; GAMMA = gamma; SUM_DY = (float*)sum_dy;
    SUM_DY_XHAT = (float*)sum_dy_xhat; C = c; N8 = n8; EPS8 = eps; INV_M = inv_m; FLAGS = flags;
    grid((int)n8, 1, 1, [] { bn_rows_backward8(X, DY, Y, MEAN, VAR, GAMMA, SUM_DY, SUM_DY_XHAT, C, N8, EPS8, INV_M,
                                               FLAGS); });
}
extern "C" void run_rows_sum(const S* x, float* part, int m, int c, int rows) {
    X = x; PART = part; M = m; C = c; ROWS = rows; RUNS = (m + rows - 1) / rows;
    grid((c + 127) / 128, RUNS, 128, [] { rows_sum_part(X, PART, M, C, ROWS); });
}
static float BETA_TOTAL;
extern "C" void run_bias_total(const float* part, float* db, int c, int runs, int threads, float beta) {
    PART = (float*)part; MEAN = db; RUNS = runs; BETA_TOTAL = beta;
    grid(c, 1, threads, [] { bias_total(PART, MEAN, RUNS, BETA_TOTAL); });
}
"""


def _build(tmp_path_factory, tag: str, source: str) -> ctypes.CDLL:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler (g++) on this machine to build the kernels for the CPU")
    d = tmp_path_factory.mktemp(tag)
    (d / "k.cpp").write_text(source)
    out = subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(d / "k.so"),
                          str(d / "k.cpp")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return ctypes.CDLL(str(d / "k.so"))


def _prelude(fmt: str, channels_last: bool = False) -> str:
    stored = "float" if fmt == "f32" else "unsigned short"
    return (SHIMS + _converters() + f"typedef {stored} S;\n#define LD(v) ld_{fmt}(v)\n#define ST(v) st_{fmt}(v)\n"
            + ("#define LOWP 1\n" if fmt != "f32" else "") + ("#define CHANNELS_LAST 1\n" if channels_last else "")
            + f"#define COMBINE_THREADS {COMBINE_THREADS}\n")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return {(fmt, cl): _build(tmp_path_factory, f"pool_{fmt}_{int(cl)}", _prelude(fmt, cl) + _POOL_SOURCE + RUNNER)
            for fmt in ("f32", "bf16") for cl in (False, True)}


@pytest.fixture(scope="module")
def compiled_bn(tmp_path_factory):
    return {fmt: _build(tmp_path_factory, f"bn_{fmt}", _prelude(fmt) + _BN_SOURCE + BN_RUNNER)
            for fmt in ("f32", "bf16")}


def _reference(x, kernel, stride, padding, is_max):
    """float64 pooling and, for the gradient, which input each output read (max) or all of its window."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    padded = np.full((n, c, h + 2 * ph, w + 2 * pw), -np.inf if is_max else 0.0)
    padded[:, :, ph:ph + h, pw:pw + w] = x
    y = np.empty((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            win = padded[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw]
            y[:, :, i, j] = win.max(axis=(2, 3)) if is_max else win.mean(axis=(2, 3))
    return y


def _reference_grad(x, dy, kernel, stride, padding, is_max):
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    padded = np.full((n, c, h + 2 * ph, w + 2 * pw), -np.inf if is_max else 0.0)
    padded[:, :, ph:ph + h, pw:pw + w] = x
    dxp = np.zeros_like(padded)
    for i in range(dy.shape[2]):
        for j in range(dy.shape[3]):
            win = padded[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw]
            if is_max:  # the first position of the window's maximum, as the kernels keep ties
                flat = win.reshape(n, c, -1).argmax(axis=2)
                a, b = np.divmod(flat, kw)
                for nn in range(n):
                    for cc in range(c):
                        dxp[nn, cc, i * sh + a[nn, cc], j * sw + b[nn, cc]] += dy[nn, cc, i, j]
            else:
                dxp[:, :, i * sh:i * sh + kh, j * sw:j * sw + kw] += dy[:, :, i, j, None, None] / (kh * kw)
    return dxp[:, :, ph:ph + h, pw:pw + w]


def _native_pooling(x, mode, kernel, stride, padding, pad_end, ceil_mode, count_pad):
    """The float64 native Pooling layer's output, and its input gradient as a function of dy (the layer's own checks:
    tests/test_gradients.py and test_reference_layers.py)."""
    import leafpy as lp

    cfg = lp.PoolingConfig(mode=mode, filter_shape=list(kernel), stride=list(stride), padding=list(padding),
                           pad_end=list(pad_end), ceil_mode=ceil_mode, count_include_pad=count_pad)
    layer = lp.Layer.from_config(lp.backend("native", dtype="float64"), lp.LayerConfig("pool", cfg))
    y = layer.forward([x])[0].to_numpy()
    return y, lambda dy: layer.backward([dy])[0].to_numpy()


def _memory(a, channels_last):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1) if channels_last else a)


def _logical(m, shape, channels_last):
    n, c, h, w = shape
    return m.reshape(n, h, w, c).transpose(0, 3, 1, 2) if channels_last else m.reshape(shape)


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("mode", ["max", "average"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("case", CASES + EXTRA_CASES,
                         ids=["3x3s2p1", "2x2s2", "2x3s1x2p0x1", "ceil", "ceil-exclude-pad", "pad-end"])
def test_cuda_pooling_kernels_on_the_cpu(compiled, case, fmt, channels_last, mode):
    shape, kernel, stride, padding, *extra = case
    pad_end, ceil_mode, count_pad = extra or (padding, False, True)
    is_max = mode == "max"
    lib = compiled[(fmt, channels_last)]
    dtype = np.float32 if fmt == "f32" else ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(dtype)  # distinct values: no ties decide a maximum
    if extra:
        y_ref, native_dx = _native_pooling(x.astype(np.float64), mode, kernel, stride, padding, pad_end, ceil_mode,
                                           count_pad)
    else:
        y_ref = _reference(x.astype(np.float64), kernel, stride, padding, is_max)
    n, c, h, w = shape
    oh, ow = y_ref.shape[2:]
    total = n * c * oh * ow
    bounds = (-padding[0], -padding[1], h + pad_end[0], w + pad_end[1]) if count_pad else (0, 0, h, w)
    args = [ctypes.c_int(v) for v in (total, c, h, w, oh, ow, *kernel, *stride, *padding, int(is_max), *bounds)]
    xm = _memory(x, channels_last)
    ym = np.zeros(total, dtype)
    mask = np.zeros(total, np.int32)
    lib.run_fwd(_ptr(xm), _ptr(ym), _ptr(mask), *args)
    y = _logical(ym, y_ref.shape, channels_last).astype(np.float64)
    u = 2.0 ** -8 if fmt == "bf16" else 2.0 ** -24
    np.testing.assert_allclose(y, y_ref, rtol=2 * u, atol=2 * u)
    dy = rng.standard_normal(y_ref.shape).astype(dtype)
    dx = np.zeros(x.size, np.float32)  # float32 for every format, as on the GPU
    lib.run_bwd(_ptr(_memory(dy, channels_last)), _ptr(dx), _ptr(mask), *args)
    if extra:
        dx_ref = native_dx(dy.astype(np.float64))
    else:
        dx_ref = _reference_grad(x.astype(np.float64), dy.astype(np.float64), kernel, stride, padding, is_max)
    np.testing.assert_allclose(_logical(dx, shape, channels_last), dx_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["max", "average"])
@pytest.mark.parametrize("channels", [8, 24])
@pytest.mark.parametrize("case", CASES + EXTRA_CASES,
                         ids=["3x3s2p1", "2x2s2", "2x3s1x2p0x1", "ceil", "ceil-exclude-pad", "pad-end"])
def test_cuda_8_channel_pooling_kernels_on_the_cpu(compiled, case, channels, mode):
    """pool_fwd8 and pool_bwd8 (bfloat16, channels-last, a thread per 8 channels; the gradient gathered over the
    windows and rounded once) against float64: the native backend's layer, or the loops above."""
    (n, _, h, w), kernel, stride, padding, *extra = case
    pad_end, ceil_mode, count_pad = extra or (padding, False, True)
    shape = (n, channels, h, w)
    is_max = mode == "max"
    lib = compiled[("bf16", True)]
    rng = np.random.default_rng(channels)
    x = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    dy_of = None
    if extra or not is_max:
        y_ref, dy_of = _native_pooling(x.astype(np.float64), mode, kernel, stride, padding, pad_end, ceil_mode,
                                       count_pad)
    else:
        y_ref = _reference(x.astype(np.float64), kernel, stride, padding, is_max)
    oh, ow = y_ref.shape[2:]
    total = n * channels * oh * ow
    bounds = (-padding[0], -padding[1], h + pad_end[0], w + pad_end[1]) if count_pad else (0, 0, h, w)
    geometry = (h, w, oh, ow, *kernel, *stride, *padding, int(is_max), *bounds)
    ym = np.zeros(total, ml_dtypes.bfloat16)
    mask = np.full(total, -1, np.int32)
    lib.run_fwd8(_ptr(_memory(x, True)), _ptr(ym), _ptr(mask),
                 *(ctypes.c_int(v) for v in (total // 8, channels // 8, *geometry)))
    u = 2.0 ** -8
    np.testing.assert_allclose(_logical(ym, y_ref.shape, True).astype(np.float64), y_ref, rtol=2 * u, atol=2 * u)
    dy = rng.standard_normal(y_ref.shape).astype(ml_dtypes.bfloat16)
    dx = np.zeros(x.size, ml_dtypes.bfloat16)
    lib.run_bwd8(_ptr(_memory(dy, True)), _ptr(dx), _ptr(mask),
                 *(ctypes.c_int(v) for v in (x.size // 8, channels // 8, *geometry)))
    if dy_of is not None:
        dx_ref = dy_of(dy.astype(np.float64))
    else:
        dx_ref = _reference_grad(x.astype(np.float64), dy.astype(np.float64), kernel, stride, padding, is_max)
    np.testing.assert_allclose(_logical(dx, shape, True).astype(np.float64), dx_ref, rtol=2 * u, atol=2 * u)


def test_the_shims_cover_what_the_pooling_source_calls():
    # every CUDA built-in the pooling kernels call has a CPU stand-in above (a new one would fail to compile here)
    called = set(re.findall(r"\b(__\w+|atomic\w+)\s*\(", _POOL_SOURCE))
    assert called <= {"__int_as_float", "atomicAdd"}, called
    assert set(re.findall(r"\bmake_(\w+)\s*\(", _POOL_SOURCE)) <= {"uint4", "int4"}


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("shape,rows", [((2, 5, 3, 4), 7), ((3, 130, 2, 2), 4), ((1, 3, 1, 1), 256)],
                         ids=["runs-of-7", "two-channel-blocks", "one-row"])
def test_channels_last_batch_norm_reductions_on_the_cpu(compiled_bn, fmt, shape, rows):
    """Per-channel mean, biased variance, sum of dy and of dy * xhat, and a bias gradient's sums, over NHWC memory
    read as rows [N * H * W, C] in runs of ``rows`` rows (a last, shorter run included)."""
    lib = compiled_bn[fmt]
    dtype = np.float32 if fmt == "f32" else ml_dtypes.bfloat16
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 2 + 3).astype(dtype)  # |mean| > std: the two-pass variance matters
    dy = rng.standard_normal(shape).astype(dtype)
    n, c, h, w = shape
    m = n * h * w
    runs = -(-m // rows)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    mean_ref, var_ref = x64.mean(axis=(0, 2, 3)), x64.var(axis=(0, 2, 3))
    part = np.zeros(2 * c * runs, np.float32)
    mean, var = np.zeros(c, np.float32), np.zeros(c, np.float32)
    xm, dym = _memory(x, True), _memory(dy, True)
    ints = [ctypes.c_int(v) for v in (m, c, rows)]
    lib.run_rows_stats(_ptr(xm), _ptr(part), _ptr(mean), _ptr(var), *ints)
    np.testing.assert_allclose(mean, mean_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(var, var_ref, rtol=1e-4, atol=1e-5)
    eps = 1e-5
    sum_dy, sum_dy_xhat = np.zeros(c, np.float32), np.zeros(c, np.float32)
    lib.run_rows_grad(_ptr(xm), _ptr(dym), _ptr(mean), _ptr(var), _ptr(part), _ptr(sum_dy), _ptr(sum_dy_xhat),
                      *ints, ctypes.c_float(eps))
    np.testing.assert_allclose(sum_dy, dy64.sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-4)
    xhat_sum = (dy64 * (x64 - mean.astype(np.float64)[None, :, None, None])).sum(axis=(0, 2, 3))
    np.testing.assert_allclose(sum_dy_xhat, xhat_sum / np.sqrt(var.astype(np.float64) + eps), rtol=1e-4, atol=1e-4)
    sums = np.zeros(c * runs, np.float32)
    lib.run_rows_sum(_ptr(dym), _ptr(sums), *ints)
    np.testing.assert_allclose(sums.reshape(c, runs).sum(axis=1), dy64.sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-4)
    # the bias gradient from those partials (CudaBackend.bias_grad), written and accumulated (beta); one thread a
    # block, as the combinations above (the serial threads here cannot meet at a barrier)
    start = rng.standard_normal(c).astype(np.float32)
    for beta in (0.0, 0.5):
        db = start.copy()
        lib.run_bias_total(_ptr(sums), _ptr(db), ctypes.c_int(c), ctypes.c_int(runs), ctypes.c_int(1),
                           ctypes.c_float(beta))
        np.testing.assert_allclose(db, dy64.sum(axis=(0, 2, 3)) + beta * start, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("flags", [0, 1, 2, 3, 4, 5])
def test_batch_norm_passes_of_eight_values_a_thread_on_the_cpu(compiled_bn, fmt, flags):
    """The per-element batch-norm passes over rows [M, C] (channels-last), eight values of one row a thread (C = 24:
    three groups of eight channels a row), against the formulas in float64: y = (x - mean) / sqrt(var + eps) *
    gamma + beta (flags 1: gamma, 2: beta) and dx = a dy - a (sum_dy + xhat sum_dy_xhat) / M with a = gamma /
    sqrt(var + eps) (flags 4: the batch's statistics, else dx = a dy)."""
    lib = compiled_bn[fmt]
    dtype = np.float32 if fmt == "f32" else ml_dtypes.bfloat16
    rng = np.random.default_rng(4)
    m, c, eps = 10, 24, 1e-5
    x, dy = (rng.standard_normal((m, c)) * 2 + 1).astype(dtype), rng.standard_normal((m, c)).astype(dtype)
    mean, var, gamma, beta, sum_dy, sum_dy_xhat = (rng.standard_normal(c).astype(np.float32) for _ in range(6))
    var = np.abs(var) + 0.5
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    invstd = 1 / np.sqrt(var.astype(np.float64) + eps)
    scale = invstd * (gamma if flags & 1 else 1)
    want = (x64 - mean) * scale + (beta if flags & 2 else 0)
    y = np.full((m, c), np.nan, dtype)
    lib.run_rows_apply8(_ptr(x), _ptr(y), _ptr(mean), _ptr(var), _ptr(gamma), _ptr(beta), ctypes.c_int(c),
                        ctypes.c_longlong(m * c // 8), ctypes.c_float(eps), ctypes.c_int(flags & 3))
    u = 2.0 ** -7 if fmt == "bf16" else 1e-6
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=u, atol=u)
    dx = np.full((m, c), np.nan, dtype)
    inv_m = 1.0 / m
    grad = scale * dy64
    if flags & 4:
        grad = grad - scale * (sum_dy + (x64 - mean) * invstd * sum_dy_xhat) * inv_m
    lib.run_rows_backward8(_ptr(x), _ptr(dy), _ptr(dx), _ptr(mean), _ptr(var), _ptr(gamma), _ptr(sum_dy),
                           _ptr(sum_dy_xhat), ctypes.c_int(c), ctypes.c_longlong(m * c // 8), ctypes.c_float(eps),
                           ctypes.c_float(inv_m), ctypes.c_int(flags & 5))
    np.testing.assert_allclose(dx.astype(np.float64), grad, rtol=u, atol=u)


def _nhwc_view(shape, dtype=np.float32):
    n, c, h, w = shape
    return np.zeros((n, h, w, c), dtype).transpose(0, 3, 1, 2)


def test_the_cuda_backends_layout_decisions_on_host_arrays():
    """The cuda backend's choices between its row-major and channels-last kernels are array logic (shapes,
    strides, flags) that NumPy arrays answer as CuPy's do: which kernels a call gets, the rows [N*H*W, C] its
    NHWC operands are read as, cuDNN's strides, and which arrays may run as flat memory."""
    from leafpy.backends.cuda import CudaBackend
    from leafpy.backends.cuda.cudnn import _strides
    from leafpy.backends.cuda.lowp import one_memory_order

    rows_major, nhwc = np.zeros((2, 3, 4, 5), np.float32), _nhwc_view((2, 3, 4, 5))
    bias, one_channel, one_position = np.zeros(3, np.float32), _nhwc_view((2, 1, 4, 5)), _nhwc_view((2, 3, 1, 1))
    layout = CudaBackend._layout_of
    assert layout(rows_major, rows_major, bias) is False
    assert layout(nhwc, _nhwc_view((2, 3, 2, 2)), bias, "max", (2, 2)) is True
    assert layout(nhwc, one_position) is True  # a [N, C, 1, 1] array is both
    assert layout(one_channel, np.zeros((2, 1, 2, 2), np.float32)) is False  # one channel: both orders agree
    assert layout(nhwc, rows_major) is None  # a mix: run on row-major copies
    assert layout(bias) is False
    rows = CudaBackend._rows(nhwc)
    assert rows.shape == (2 * 4 * 5, 3) and rows.flags.c_contiguous and np.shares_memory(rows, nhwc)
    x = np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5)
    stored = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(CudaBackend._rows(stored)[7], x[0, :, 1, 2])  # row 7: image 0, h 1, w 2
    assert _strides(rows_major) == (60, 20, 5, 1) and _strides(nhwc) == (60, 1, 15, 3)
    assert one_memory_order([nhwc, _nhwc_view((2, 3, 4, 5), np.float16)])  # strides compared in elements
    assert not one_memory_order([nhwc, rows_major])
    assert not one_memory_order([nhwc, _nhwc_view((2, 3, 5, 4))])
    assert not one_memory_order([np.zeros((4, 6), np.float32)[:, :3]])  # not one block of memory


@pytest.mark.parametrize("m,c", [(131072, 64), (392, 512), (1, 3), (1605632, 64), (10**8, 3), (5, 1000)])
def test_channels_last_reduction_grids_cover_every_row_within_the_limits(m, c):
    """Runs of rows for the row reductions: every row in exactly one run, no run empty (bn_stats_combine weighs
    each run by its rows), at most 65535 runs (the grid's y limit), blocks of whole warps across the channels."""
    from types import SimpleNamespace

    from leafpy.backends.cuda import CudaBackend

    host = SimpleNamespace(ROW_THREADS=CudaBackend.ROW_THREADS, ROW_RUN_MAX=CudaBackend.ROW_RUN_MAX, xp=np)
    run, runs, part = CudaBackend._row_runs(host, m, c)
    assert runs <= 65535 and run * runs >= m and (runs - 1) * run < m
    assert part.size == 2 * c * runs
    (gx, gy), (block,) = CudaBackend._row_grid(c, runs)
    assert gy == runs and block % 32 == 0 and block <= 128 and gx * block >= c > (gx - 1) * block


def _elementwise_kernel(in_params: str, out_params: str, operation: str, name: str) -> str:
    """A CuPy ElementwiseKernel's source as a C function over n elements: ``raw`` parameters as pointers, the
    gradient ``g`` read per element, the other inputs scalars (passed by pointer), outputs as references."""
    args, head = ["long n"], []
    for decl in in_params.split(","):
        *raw, _, param = decl.split()
        args.append(f"const T* {param}_")
        if raw:
            head.append(f"const T* {param} = {param}_;")
        else:
            head.append(f"const T {param} = {param}_[{'i' if param == 'g' else '0'}];")
    for decl in out_params.split(","):
        param = decl.split()[-1]
        args.append(f"T* {param}_")
        head.append(f"T& {param} = {param}_[i];")
    return (f"extern \"C\" void {name}({', '.join(args)}) {{\n    for (long i = 0; i < n; ++i) {{\n        "
            + "\n        ".join(head) + f"\n        {operation};\n    }}\n}}\n")


@pytest.fixture(scope="module")
def compiled_updates(tmp_path_factory):
    """Every rule of the table, and one added at run time (Lion: a local, sign, the policy's rate), for float and
    double."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(updates.TABLE, "lion", LION)
        sources = updates.cuda_kernel_sources()
        libs = {ctype: _build(tmp_path_factory, f"updates_{ctype}", SHIMS + f"using std::sqrt;\ntypedef {ctype} T;\n"
                              + "".join(_elementwise_kernel(*source) for source in sources.values()))
                for ctype in ("float", "double")}
        yield libs, sources


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", [*updates.TABLE, "lion"])
def test_cuda_update_kernels_on_the_cpu(compiled_updates, monkeypatch, kind, dtype):
    """Each generated update kernel equals the native backend's generated NumPy code, reads its rate from the
    device-side buffer (rate[0], and rate[2] for decoupled weight decay) and writes nothing where rate[1] is 0."""
    libs, sources = compiled_updates
    monkeypatch.setitem(updates.TABLE, "lion", LION)
    rule = updates.rule(kind)
    lib = libs["float" if dtype == np.float32 else "double"]
    rng = np.random.default_rng(5)
    n = 1000
    w, g = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    state = [np.abs(rng.standard_normal(n)).astype(dtype) for _ in rule.state]
    params = tuple(UPDATE_PARAMS[p] for p in rule.params)
    lr_mult = 2.0

    def kernel(rate):
        out = [w.copy(), *(s.copy() for s in state)]
        scalars = [np.array([v], dtype) for v in (lr_mult, *params)]
        getattr(lib, sources[kind][3])(ctypes.c_long(n), _ptr(g.copy()), _ptr(rate), *map(_ptr, scalars),
                                       *map(_ptr, out))
        return out

    skipped = np.array([0.01, 0.0, 0.02], dtype)
    assert all(np.array_equal(a, b) for a, b in zip(kernel(skipped), [w, *state])), "a skipped step wrote"
    rate = np.array([0.01, 1.0, 0.02], dtype)
    got = kernel(rate)
    want = [w.copy(), *(s.copy() for s in state)]
    NativeBackend(dtype).solver_update(kind, want[0], g.copy(), rate, lr_mult, params, *want[1:])
    assert not np.array_equal(want[0], w)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for name, a, b in zip(("w", *rule.state), got, want):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=f"{kind}: {name}")


def _grid_runner(source: str) -> str:
    """For each kernel ``NAME(...)`` of ``source``, ``run_NAME(blocks, threads, ...)``: the kernel run for every
    thread of a grid of ``blocks`` blocks of ``threads``, one thread after another."""
    out = []
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', source):
        names = ", ".join(p.split()[-1] for p in params.split(","))
        out.append(f'extern "C" void run_{name}(int blocks, int threads, {params}) {{\n'
                   "    gridDim.x = blocks; blockDim.x = threads;\n"
                   "    for (int b = 0; b < blocks; ++b) for (int t = 0; t < threads; ++t) {\n"
                   f"        blockIdx.x = b; threadIdx.x = t; {name}({names});\n    }}\n}}\n")
    return "".join(out)


@pytest.fixture(scope="module")
def compiled_vector_updates(tmp_path_factory):
    """Every rule's float4 kernel (updates.cuda_vector_source; Lion's too), each in a namespace of its own (their
    ``op`` functions may share a signature), with its grid runner; and the sources, by kernel name."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(updates.TABLE, "lion", LION)
        sources = {(kind, copy): updates.cuda_vector_source(kind, copy) for kind in updates.TABLE
                   for copy in ("", "bf16")}
    # the variants that write a bfloat16 copy take lowp.CONVERT's bfloat16 conversions (T is the macro here)
    converters = _converters().replace("typedef float T;\n", "")
    code = "".join(f"namespace rule_{kind}{copy} {{\n{source.replace(CONVERT, converters)}\n"
                   f"{_grid_runner(source)}}}\n" for (kind, copy), (source, _) in sources.items())
    return (_build(tmp_path_factory, "updates_float4", SHIMS + "using std::sqrt;\n" + code),
            {name: source for source, name in sources.values()})


class _HostArray(np.ndarray):
    """A NumPy array that tells its address as a CuPy array does (``a.data.ptr``, which the float4 checks read)."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.ctypes.data)


def _c_value(a):
    if isinstance(a, np.ndarray):
        return _ptr(a)
    return ctypes.c_int(a) if isinstance(a, np.int32) else ctypes.c_float(a)


class _HostCupy:
    """What the cuda backend's solver_update asks of CuPy, answered by the kernels compiled for the CPU: RawModule
    (the float4 kernels, checked to be the source the backend gives) and ElementwiseKernel; launches are logged."""

    def __init__(self, vector, elementwise) -> None:
        (self.vector_lib, self.vector_sources), self.elementwise_lib = vector, elementwise
        self.launches: list[str] = []

    def RawModule(self, code):  # noqa: N802 (CuPy's name)
        def get_function(name):
            assert code == self.vector_sources[name], "the backend compiles another source than the test"
            run = getattr(self.vector_lib, f"run_{name}")

            def launch(grid, block, args):
                self.launches.append(name)
                run(ctypes.c_int(grid[0]), ctypes.c_int(block[0]), *map(_c_value, args))
            return launch
        return SimpleNamespace(get_function=get_function)

    def ElementwiseKernel(self, in_params, out_params, operation, name):  # noqa: N802
        run = getattr(self.elementwise_lib, name)

        def launch(g, *args):
            self.launches.append(name)
            run(ctypes.c_long(g.size), _ptr(g), *(_ptr(np.atleast_1d(a)) for a in args))
        return launch


GUARD = 3.0
"""The values after each array (an update would change them)."""


def _aligned(values, guard=4):
    """``values`` in a 16-byte-aligned host array followed by ``guard`` :data:`GUARD` values of the same buffer:
    (array, guard)."""
    buf = np.empty(values.size + guard + 4, np.float32)
    at = (-buf.ctypes.data % 16) // 4
    buf[at + values.size:] = GUARD
    view = buf[at:at + values.size]
    view[...] = values
    return view.view(_HostArray), buf[at + values.size:at + values.size + guard]


@pytest.mark.parametrize("n", [1200, 1202], ids=["float4", "one-per-thread"])
@pytest.mark.parametrize("kind", [*updates.TABLE, "lion"])
def test_cuda_float4_update_kernels_on_the_cpu(compiled_updates, compiled_vector_updates, monkeypatch, kind, n):
    """The cuda backend's solver_update over host arrays, its kernels compiled for the CPU: float32 arrays of a size
    that is a multiple of 4 go through the rule's float4 kernel (every thread of its grid run: blocks of
    VECTOR_BLOCK threads, the last partly past the end), the rest through its ElementwiseKernel. Either equals the
    native backend, writes nothing after the arrays, and nothing at all where rate[1] is 0."""
    from leafpy.backends.cuda import CudaBackend

    monkeypatch.setitem(updates.TABLE, "lion", LION)
    rule = updates.rule(kind)
    xp = _HostCupy(compiled_vector_updates, compiled_updates[0]["float"])
    be = object.__new__(CudaBackend)  # no GPU: the attributes solver_update reads
    be.xp, be.dtype, be._update_kernels = xp, np.dtype(np.float32), {}
    rng = np.random.default_rng(6)
    w, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    state = [np.abs(rng.standard_normal(n)).astype(np.float32) for _ in rule.state]
    params = tuple(UPDATE_PARAMS[p] for p in rule.params)
    name = updates.cuda_vector_source(kind)[1] if n % 4 == 0 else updates.cuda_kernel_source(kind)[3]

    def update(rate):
        (dw, tail), *held = [_aligned(a) for a in (w, *state)]
        be.solver_update(kind, dw, _aligned(g)[0], rate, 2.0, params, *(a for a, _ in held))
        assert xp.launches.pop() == name and not xp.launches
        assert all((t == GUARD).all() for t in (tail, *(t for _, t in held))), "written after the arrays"
        return [dw, *(a for a, _ in held)]

    body = updates.cuda_vector_source(kind)[0].split("\n")
    skip = next(i for i, line in enumerate(body) if "rate[1]" in line and "return" in line)
    assert skip < min(i for i, line in enumerate(body) if "_4[i]" in line), "a skipped step loads before it returns"
    skipped = update(np.array([0.01, 0.0, 0.02], np.float32))
    assert all(np.array_equal(a, b) for a, b in zip(skipped, [w, *state])), "a skipped step wrote"
    rate = np.array([0.01, 1.0, 0.02], np.float32)
    got = update(rate)
    want = [w.copy(), *(s.copy() for s in state)]
    NativeBackend(np.float32).solver_update(kind, want[0], g.copy(), rate, 2.0, params, *want[1:])
    assert not np.allclose(want[0], w)
    for label, a, b in zip(("w", *rule.state), got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{kind}: {label}")


@pytest.mark.parametrize("kind", [*updates.TABLE, "lion"])
def test_cuda_float4_update_writes_the_bfloat16_copy_on_the_cpu(compiled_vector_updates, monkeypatch, kind):
    """solver_update with ``copy`` (a weight's bfloat16 compute copy), its float4 kernel compiled for the CPU: the
    copy is the updated weight rounded to nearest even (ml_dtypes' rounding of the float32 result, bit for bit), in
    the same launch; a skipped step (rate[1] == 0) writes neither the weight nor the copy; nothing is written after
    the copy's end."""
    from leafpy.backends.cuda import CudaBackend

    monkeypatch.setitem(updates.TABLE, "lion", LION)
    rule = updates.rule(kind)
    xp = _HostCupy(compiled_vector_updates, None)
    be = object.__new__(CudaBackend)
    be.xp, be.dtype, be._update_kernels = xp, np.dtype(np.float32), {}
    rng = np.random.default_rng(16)
    n = 1200
    w, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    state = [np.abs(rng.standard_normal(n)).astype(np.float32) for _ in rule.state]
    params = tuple(UPDATE_PARAMS[p] for p in rule.params)
    before = w.astype(ml_dtypes.bfloat16)

    def update(rate):
        (dw, _), *held = [_aligned(a) for a in (w, *state)]
        buf = np.full(n + 8, 7.0, ml_dtypes.bfloat16)  # 8-byte aligned, 4 guard values after the copy
        at = (-buf.ctypes.data % 8) // 2
        low = buf[at:at + n].view(_HostArray)
        low[...] = before
        be.solver_update(kind, dw, _aligned(g)[0], rate, 2.0, params, *(a for a, _ in held), copy=low)
        assert xp.launches.pop() == updates.cuda_vector_source(kind, "bf16")[1] and not xp.launches
        assert (buf[at + n:at + n + 4].astype(np.float32) == 7.0).all(), "written after the copy"
        return dw, low

    dw, low = update(np.array([0.01, 0.0, 0.02], np.float32))
    assert np.array_equal(dw, w) and np.array_equal(low.view(np.uint16), before.view(np.uint16)), "a skipped step wrote"
    dw, low = update(np.array([0.01, 1.0, 0.02], np.float32))
    assert not np.array_equal(dw, w)
    np.testing.assert_array_equal(np.asarray(low).view(np.uint16),
                                  np.asarray(dw).astype(ml_dtypes.bfloat16).view(np.uint16))


SUMSQ_RUNNER = r"""
extern "C" void run_sumsq(const unsigned long long* ptrs, const long long* sizes, const int* tensor,
        const long long* start, long long chunk, const float* scale, int has_scale, double* part, int blocks,
        float* out) {
    gridDim.x = blocks; blockDim.x = 1; threadIdx.x = 0;
    for (int b = 0; b < blocks; ++b) { blockIdx.x = b; sumsq_part(ptrs, sizes, tensor, start, chunk, scale, has_scale,
                                                                   part); }
    gridDim.x = 1; blockIdx.x = 0;
    sumsq_total(part, blocks, out);
}
"""


@pytest.fixture(scope="module")
def compiled_sumsq(tmp_path_factory):
    return _build(tmp_path_factory, "sumsq", SHIMS + sum_squares_source() + SUMSQ_RUNNER)


def _sum_squares(lib, xs, scale):
    sizes = np.array([x.size for x in xs], np.int64)
    tensor, start = sum_squares_chunks(sizes)
    ptrs = np.array([x.ctypes.data for x in xs], np.uint64)
    part = np.full(tensor.size, np.nan)
    out = np.zeros(1, np.float32)
    s = np.array([scale or 1.0], np.float32)
    lib.run_sumsq(_ptr(ptrs), _ptr(sizes), _ptr(tensor), _ptr(start), ctypes.c_longlong(SUM_SQUARES_CHUNK), _ptr(s),
                  ctypes.c_int(scale is not None), _ptr(part), ctypes.c_int(tensor.size), _ptr(out))
    return float(out[0])


@pytest.mark.parametrize("scale", [None, 1024.0, 3.0])
def test_cuda_sum_of_squares_kernels_on_the_cpu(compiled_sumsq, scale):
    """The gradients' sum of squares in one pass over many tensors (Backend.sum_squares on cuda): tensors of sizes
    around the chunk (one element, a chunk less one, two chunks and one, none at all) each split into chunks that
    cover it once; with a loss scale each tensor is unscaled in place exactly as the unscale kernel does (a product
    by the float32 reciprocal); the sum against float64 NumPy; an inf or a nan anywhere makes it so."""
    rng = np.random.default_rng(7)
    sizes = [1, SUM_SQUARES_CHUNK - 1, 0, 2 * SUM_SQUARES_CHUNK + 1, 37, SUM_SQUARES_CHUNK]
    xs = [(rng.standard_normal(n) * 50).astype(np.float32) for n in sizes]
    want = [x * (np.float32(1) / np.float32(scale)) if scale else x.copy() for x in xs]
    total = _sum_squares(compiled_sumsq, xs, scale)
    for x, w in zip(xs, want):
        assert np.array_equal(x, w)  # unscaled once, every element, bit for bit as the unscale kernel
    ref = sum(float(np.sum(w.astype(np.float64) ** 2)) for w in want)
    assert total == pytest.approx(ref, rel=1e-6)
    tensor, start = sum_squares_chunks(np.array(sizes, np.int64))
    assert tensor.tolist() == [0, 1, 3, 3, 3, 4, 5] and start.tolist() == [0, 0, 0, SUM_SQUARES_CHUNK,
                                                                            2 * SUM_SQUARES_CHUNK, 0, 0]
    for bad in (np.inf, np.nan):
        ys = [x.copy() for x in xs]
        ys[3][SUM_SQUARES_CHUNK + 5] = bad
        got = _sum_squares(compiled_sumsq, ys, scale)
        assert np.isinf(got) if bad == np.inf else np.isnan(got)


@pytest.mark.parametrize("channels", [1, 3, 8, 12])
def test_channel_padding_kernel_on_the_cpu(tmp_path_factory, channels):
    """The cuda backend's pad_channels (16-bit channels-last rows padded with zero channels to a multiple of 8, one
    16-byte store a thread; CudaBackend.PAD_CHANNELS) compiled for the CPU, every thread of its grid run (the last
    block partly past the end): each row's values then zeros, bit for bit, nothing written past the output."""
    lib = _build(tmp_path_factory, "pad_channels", SHIMS + PAD_CHANNELS_SOURCE + _grid_runner(PAD_CHANNELS_SOURCE))
    rows, c8 = 37, -(-channels // 8) * 8
    x = np.random.default_rng(channels).integers(1, 65535, size=(rows, channels), dtype=np.uint16)
    y = np.full(rows * c8 + 8, 0xABCD, np.uint16)
    groups = rows * (c8 // 8)
    lib.run_pad_channels(ctypes.c_int(-(-groups // 256)), ctypes.c_int(256), _ptr(x), _ptr(y),
                         ctypes.c_longlong(groups), ctypes.c_int(channels), ctypes.c_int(c8 // 8))
    want = np.zeros((rows, c8), np.uint16)
    want[:, :channels] = x
    np.testing.assert_array_equal(y[:rows * c8].reshape(rows, c8), want)
    assert (y[rows * c8:] == 0xABCD).all(), "written past the output"
