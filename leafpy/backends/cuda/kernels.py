"""CUDA sources of the cuda backend's pooling, batch-normalisation and sum-of-squares kernels (compiled with CuPy's
RawModule), and the generator of its vectorised elementwise kernels.

The pooling and batch-normalisation sources are compiled once per storage format of their activations
(:func:`module_source`): ``S`` is the stored type, ``LD``/``ST`` convert it to and from float (lowp.CONVERT);
arithmetic is in float for every format."""

import numpy as np

from .lowp import CONVERT

COMBINE_THREADS = 256
"""The most threads of a block that combines one channel's batch-norm partials (the kernels' shared memory)."""


def module_source(source: str, fmt: str, channels_last: bool = False) -> str:
    """``source`` for activations stored in ``fmt`` ("f32", "bf16" or "f16"), NHWC where ``channels_last`` (for
    the sources that read CHANNELS_LAST)."""
    stored = "float" if fmt == "f32" else "unsigned short"
    low = "" if fmt == "f32" else "#define LOWP 1\n"
    layout = "#define CHANNELS_LAST 1\n" if channels_last else ""
    return (f"{CONVERT}\ntypedef {stored} S;\n#define LD(v) ld_{fmt}(v)\n#define ST(v) st_{fmt}(v)\n{low}{layout}"
            f"#define COMBINE_THREADS {COMBINE_THREADS}\n" + source)

_POOL_SOURCE = r"""
// Element i of y (and of mask, dy) in memory order: NCHW, or with CHANNELS_LAST defined NHWC, where a window's
// values are C apart and neighbouring threads read neighbouring channels. `src` is the element's image plane,
// ELEMENT(h, w) the offset of (h, w) in it.
#ifdef CHANNELS_LAST
#define POOL_GEOMETRY \
    const int c = i % C, ow = (i / C) % OW, oh = (i / (C * OW)) % OH; \
    const long long plane = (long long)(i / (C * OW * OH)) * H * W * C + c;
#define ELEMENT(h, w) (((h) * W + (w)) * C)
#else
#define POOL_GEOMETRY \
    const int ow = i % OW, oh = (i / OW) % OH; \
    const long long plane = (long long)(i / (OW * OH)) * H * W;
#define ELEMENT(h, w) ((h) * W + (w))
#endif
// average windows divide by their positions inside [lh, hh) x [lw, hw): the input and its padding (Caffe's
// count_include_pad), or the input only
#define POOL_DIVISOR(h0, w0) \
    (float)max((min(h0 + kh, hh) - max(h0, lh)) * (min(w0 + kw, hw) - max(w0, lw)), 1)
// every pooling kernel's geometry parameters, after its arrays
#define POOL_PARAMS int total, int C, int H, int W, int OH, int OW, int kh, int kw, int sh, int sw, int ph, int pw, \
    int is_max, int lh, int lw, int hh, int hw
extern "C" __global__ void pool_fwd(const S* x, S* y, int* mask, POOL_PARAMS) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= total) return;
    POOL_GEOMETRY
    const S* src = x + plane;
    int h0 = oh * sh - ph, w0 = ow * sw - pw;
    const float NEG_INF = __int_as_float(0xff800000);
    // the mask starts at the window's first input position (an all -inf window's gradient reaches the input, not
    // the padding); a NaN becomes the maximum and keeps the mask where it was, as the native backend does
    float best = NEG_INF, sum = 0.f; int arg = max(-h0, 0) * kw + max(-w0, 0);
    for (int a = 0; a < kh; ++a) {
        int h = h0 + a;
        for (int b = 0; b < kw; ++b) {
            int w = w0 + b;
            bool inside = h >= 0 && h < H && w >= 0 && w < W;
            float v = inside ? LD(src[ELEMENT(h, w)]) : (is_max ? NEG_INF : 0.f);
            if (is_max) { if (v > best) { best = v; arg = a * kw + b; } else if (v != v) { best = v; } }
            else { sum += v; }
        }
    }
    if (is_max) { y[i] = ST(best); mask[i] = arg; } else { y[i] = ST(sum / POOL_DIVISOR(h0, w0)); }
}
// one thread per output element adds its gradient where the forward pass took its value (measured faster on an
// H200 than one thread per input element gathering over its windows, and on an H100 for 16-bit AlexNet with the
// clearing and rounding counted); dx is float32 for every format (16-bit activations' gradients are added up
// there and rounded once)
extern "C" __global__ void pool_bwd(const S* dy, float* dx, const int* mask, POOL_PARAMS) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= total) return;
    POOL_GEOMETRY
    float* dst = dx + plane;
    int h0 = oh * sh - ph, w0 = ow * sw - pw;
    float g = LD(dy[i]);
    if (is_max) {
        int a = mask[i] / kw, b = mask[i] % kw, h = h0 + a, w = w0 + b;
        if (h >= 0 && h < H && w >= 0 && w < W) atomicAdd(dst + ELEMENT(h, w), g);
    } else {
        float share = g / POOL_DIVISOR(h0, w0);
        for (int a = 0; a < kh; ++a) for (int b = 0; b < kw; ++b) {
            int h = h0 + a, w = w0 + b;
            if (h >= 0 && h < H && w >= 0 && w < W) atomicAdd(dst + ELEMENT(h, w), share);
        }
    }
}
#if defined(CHANNELS_LAST) && defined(LOWP)
// 16-bit channels-last tensors whose channels are a multiple of 8, 16-byte aligned: a thread takes 8 consecutive
// channels of one position (one 16-byte load or store of activations, two of the mask), so the index arithmetic
// runs once per 8 elements. C is the number of 8-channel groups; `total` counts groups of y (forward) or of x
// (gradient).
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    const unsigned int u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) { f[2 * k] = LD((S)(u[k] & 0xffffu)); f[2 * k + 1] = LD((S)(u[k] >> 16)); }
}
__device__ __forceinline__ uint4 pack8(const float* f) {
    unsigned int u[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) u[k] = (unsigned int)ST(f[2 * k]) | ((unsigned int)ST(f[2 * k + 1]) << 16);
    return make_uint4(u[0], u[1], u[2], u[3]);
}
extern "C" __global__ void pool_fwd8(const uint4* x, uint4* y, int4* mask, POOL_PARAMS) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= total) return;
    POOL_GEOMETRY
    const uint4* src = x + plane;
    int h0 = oh * sh - ph, w0 = ow * sw - pw;
    float best[8], v[8];
    int arg[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {  // (the mask from the window's first input position, as pool_fwd's)
        best[k] = is_max ? __int_as_float(0xff800000) : 0.f;
        arg[k] = max(-h0, 0) * kw + max(-w0, 0);
    }
    for (int a = max(-h0, 0); a < min(kh, H - h0); ++a) {  // the window's positions inside the input; the padding
        for (int b = max(-w0, 0); b < min(kw, W - w0); ++b) {  // neither wins a maximum nor adds to a sum
            unpack8(src[ELEMENT(h0 + a, w0 + b)], v);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                if (is_max) {
                    if (v[k] > best[k]) { best[k] = v[k]; arg[k] = a * kw + b; }
                    else if (v[k] != v[k]) { best[k] = v[k]; }
                } else { best[k] += v[k]; }
            }
        }
    }
    if (is_max) {
        mask[2 * i] = make_int4(arg[0], arg[1], arg[2], arg[3]);
        mask[2 * i + 1] = make_int4(arg[4], arg[5], arg[6], arg[7]);
    } else {
        const float d = POOL_DIVISOR(h0, w0);
#pragma unroll
        for (int k = 0; k < 8; ++k) best[k] /= d;
    }
    y[i] = pack8(best);
}
// the gradient gathered: a thread per 8 channels of one input position adds the gradients of the windows that hold
// the position (those whose maximum it was, for max pooling) in float32 and writes them once, rounded (no scratch
// to clear, add into atomically and round, as pool_bwd needs)
extern "C" __global__ void pool_bwd8(const uint4* dy, uint4* dx, const int4* mask, POOL_PARAMS) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i >= total) return;
    const int c = i % C, w = (i / C) % W, h = (i / (C * W)) % H;
    const long long n = i / (C * W * H);
    const int ah = h + ph - kh + 1, aw = w + pw - kw + 1;  // the windows over (h, w): oh0..oh1 by ow0..ow1
    const int oh0 = ah <= 0 ? 0 : (ah + sh - 1) / sh, oh1 = min((h + ph) / sh, OH - 1);
    const int ow0 = aw <= 0 ? 0 : (aw + sw - 1) / sw, ow1 = min((w + pw) / sw, OW - 1);
    float g[8], d[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) g[k] = 0.f;
    for (int oh = oh0; oh <= oh1; ++oh) {
        const int h0 = oh * sh - ph;
        for (int ow = ow0; ow <= ow1; ++ow) {
            const int w0 = ow * sw - pw;
            const long long j = ((n * OH + oh) * OW + ow) * C + c;
            unpack8(dy[j], d);
            if (is_max) {
                const int at = (h - h0) * kw + (w - w0);
                const int4 m0 = mask[2 * j], m1 = mask[2 * j + 1];
                const int m[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
#pragma unroll
                for (int k = 0; k < 8; ++k) if (m[k] == at) g[k] += d[k];
            } else {
                const float q = POOL_DIVISOR(h0, w0);
#pragma unroll
                for (int k = 0; k < 8; ++k) g[k] += d[k] / q;
            }
        }
    }
    dx[i] = pack8(g);
}
#endif
"""


PAD_CHANNELS_SOURCE = r"""
// x: rows of c 16-bit values (the pixels of an NHWC image batch, or the (k, h, w) rows of a channels-last filter);
// y: the same rows of g * 8 values, c's channels then zeros. One thread per 8 values of y: one 16-byte store.
extern "C" __global__ void pad_channels(const unsigned short* x, uint4* y, long long groups, int c, int g) {
    const long long q = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= groups) return;
    const long long row = q / g;
    const int c0 = (int)(q % g) * 8;
    unsigned int v[4] = {0u, 0u, 0u, 0u};
    for (int k = 0; k < 8; ++k) {
        if (c0 + k < c) v[k >> 1] |= (unsigned int)x[row * c + c0 + k] << ((k & 1) * 16);
    }
    uint4 o;
    o.x = v[0]; o.y = v[1]; o.z = v[2]; o.w = v[3];
    y[q] = o;
}
"""
"""The zero padding of 16-bit channels-last tensors to a multiple of 8 channels (see CudaBackend.PAD_CHANNELS)."""


_BLOCK_TOTAL = r"""
// the sum of v over the block (its threads a power of two), returned to every thread (red: a double of shared
// memory per thread)
__device__ double block_total(double v, double* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    const double total = red[0];
    __syncthreads();
    return total;
}
"""
"""Shared by the batch-norm combinations and the sum of squares."""

SUM_SQUARES_CHUNK = 4096
"""Elements of one tensor that one block of :data:`_SUM_SQUARES_SOURCE`'s first kernel reduces."""
SUMSQ_THREADS = 256
"""Threads of a block of :data:`_SUM_SQUARES_SOURCE`'s kernels (its shared memory: one double each)."""

_SUM_SQUARES_SOURCE = r"""
// The sum of the squares of many float32 tensors in one pass over them, each first multiplied in place by
// 1 / scale[0] where has_scale (loss scaling's unscale, the same product as the unscale kernel). Two kernels, in a
// fixed order of additions (the same sum on every run): block b reduces the chunk b of the tensors' chunks (up to
// `chunk` elements of tensor chunk_tensor[b] from chunk_start[b]; `ptrs` holds the tensors' addresses, `sizes`
// their element counts) into part[b], then one block adds the parts. Threads per block: a power of two, at most
// SUMSQ_THREADS.
extern "C" __global__ void sumsq_part(const unsigned long long* ptrs, const long long* sizes,
        const int* chunk_tensor, const long long* chunk_start, long long chunk, const float* scale, int has_scale,
        double* part) {
    __shared__ double red[SUMSQ_THREADS];
    const int b = blockIdx.x, t = chunk_tensor[b];
    float* x = (float*)ptrs[t];
    const long long lo = chunk_start[b], hi = min(lo + chunk, sizes[t]);
    const float inv = has_scale ? 1.f / scale[0] : 1.f;
    double acc = 0.0;
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = x[i];
        if (has_scale) { v = v * inv; x[i] = v; }
        acc += (double)v * (double)v;
    }
    const double total = block_total(acc, red);
    if (threadIdx.x == 0) part[b] = total;
}
extern "C" __global__ void sumsq_total(const double* part, int n, float* out) {
    __shared__ double red[SUMSQ_THREADS];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += part[i];
    const double total = block_total(acc, red);
    if (threadIdx.x == 0) out[0] = (float)total;
}
"""


def sum_squares_chunks(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The chunks of tensors of ``sizes`` elements (int64) that :data:`_SUM_SQUARES_SOURCE`'s blocks reduce: each
    chunk's tensor (int32) and first element (int64), tensor by tensor (a tensor of no elements has none)."""
    counts = -(-sizes // SUM_SQUARES_CHUNK)
    tensor = np.repeat(np.arange(len(sizes), dtype=np.int32), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    start = (np.arange(int(counts.sum()), dtype=np.int64) - first) * SUM_SQUARES_CHUNK
    return tensor, start


def sum_squares_source() -> str:
    """:data:`_SUM_SQUARES_SOURCE` with its block size defined."""
    return f"#define SUMSQ_THREADS {SUMSQ_THREADS}\n" + _BLOCK_TOTAL + _SUM_SQUARES_SOURCE

_BN_SOURCE = r"""
// Batch normalisation over [N, C, S] (S: every axis after C).
// The per-channel reductions run in two kernels: blocks (channel, split) each reduce a run of `rows` samples of
// one channel into a partial, then a block per channel combines its channel's partials (in double). Splitting
// a channel over several blocks keeps the GPU busy when there are few channels (64 blocks of one channel each
// left most of an H200 idle).
#define BLOCK 256
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}
// the sum of v over the block, returned to every thread (red: BLOCK / 32 + 1 floats of shared memory)
__device__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < BLOCK / 32 ? red[threadIdx.x] : 0.f;
        t = warp_sum(t);
        if (threadIdx.x == 0) red[BLOCK / 32] = t;
    }
    __syncthreads();
    const float total = red[BLOCK / 32];
    __syncthreads();
    return total;
}
// Loads of one float or four (float4, when S is a multiple of 4): the lanes' sum, sum of squared deviations and
// sum of products with deviations.
template <typename V> struct Lanes { static constexpr int n = 1; };
template <> struct Lanes<float4> { static constexpr int n = 4; };
__device__ __forceinline__ float lanes(float v) { return v; }
__device__ __forceinline__ float lanes(float4 v) { return (v.x + v.y) + (v.z + v.w); }
__device__ __forceinline__ float squares(float v, float m) { const float d = v - m; return d * d; }
__device__ __forceinline__ float squares(float4 v, float m) {
    return (squares(v.x, m) + squares(v.y, m)) + (squares(v.z, m) + squares(v.w, m));
}
__device__ __forceinline__ float products(float g, float v, float m) { return g * (v - m); }
__device__ __forceinline__ float products(float4 g, float4 v, float m) {
    return (products(g.x, v.x, m) + products(g.y, v.y, m)) + (products(g.z, v.z, m) + products(g.w, v.w, m));
}
#ifdef LOWP
// 16-bit activations: one value per load, converted to float
__device__ __forceinline__ float lanes(S v) { return LD(v); }
__device__ __forceinline__ float squares(S v, float m) { const float d = LD(v) - m; return d * d; }
__device__ __forceinline__ float products(S g, S v, float m) { return LD(g) * (LD(v) - m); }
#endif
// the k-th load of channel ch among samples [b0, b0 + rows): sample b0 + k / s, position k % s (s, and every
// index, in loads: S / 4 of them per sample and channel for float4)
#define AT(a, k) a[base + (long long)((k) / s) * row + ((k) % s)]
#define RUN_GEOMETRY \
    const int ch = blockIdx.x, b0 = blockIdx.y * rows; \
    const int count = (min(b0 + rows, n) - b0) * s; \
    const long long row = (long long)c * s, base = (long long)b0 * row + (long long)ch * s;
// partial statistics of a run: its mean and its sum of squared deviations from that mean (two passes over the
// run, which the cache holds: no cancellation when |mean| >> std)
template <typename V>
__device__ void stats_part(const V* x, float* part, int n, int c, int s, int rows) {
    __shared__ float red[BLOCK / 32 + 1];
    RUN_GEOMETRY
    float acc = 0.f;
    for (int k = threadIdx.x; k < count; k += BLOCK) acc += lanes(AT(x, k));
    const float m = block_sum(acc, red) / (float)(count * Lanes<V>::n);
    acc = 0.f;
    for (int k = threadIdx.x; k < count; k += BLOCK) acc += squares(AT(x, k), m);
    const float m2 = block_sum(acc, red);
    if (threadIdx.x == 0) {
        float* p = part + 2 * ((long long)ch * gridDim.y + blockIdx.y);
        p[0] = m;
        p[1] = m2;
    }
}
extern "C" __global__ void bn_stats_part(const float* x, float* part, int n, int c, int s, int rows) {
    stats_part(x, part, n, c, s, rows);
}
extern "C" __global__ void bn_stats_part4(const float4* x, float* part, int n, int c, int s4, int rows) {
    stats_part(x, part, n, c, s4, rows);
}
#ifdef LOWP
extern "C" __global__ void bn_stats_part_low(const S* x, float* part, int n, int c, int s, int rows) {
    stats_part(x, part, n, c, s, rows);
}
#endif
// The combinations of a channel's partials: one block per channel (blockIdx.x), its threads (a power of two, at
// most COMBINE_THREADS) sharing the runs, in double. One thread per channel reading its runs in turn took 95 us a
// call for 1,024 runs of 64 channels (ResNet-18's channels-last reductions) on an H100.
// (COMBINE_THREADS: defined in front of this source, from the Python constant)
""" + _BLOCK_TOTAL + r"""// mean and biased variance from the partials (Chan et al.'s pairwise combination)
extern "C" __global__ void bn_stats_combine(const float* part, float* mean, float* var, int n, int c, int s,
        int rows, int splits) {
    __shared__ double red[COMBINE_THREADS];
    const int ch = blockIdx.x;
    const float* p = part + 2LL * ch * splits;
    const double total = (double)n * s;
    double mu = 0.0;
    for (int j = threadIdx.x; j < splits; j += blockDim.x) mu += (double)(min(rows, n - j * rows) * s) * p[2 * j];
    mu = block_total(mu, red) / total;
    double m2 = 0.0;
    for (int j = threadIdx.x; j < splits; j += blockDim.x) {
        const double d = (double)p[2 * j] - mu;
        m2 += (double)p[2 * j + 1] + (double)(min(rows, n - j * rows) * s) * d * d;
    }
    m2 = block_total(m2, red);
    if (threadIdx.x == 0) {
        mean[ch] = (float)mu;
        var[ch] = (float)(m2 / total);
    }
}
// partial sums of dy and dy * (x - mean) over a run
template <typename V>
__device__ void grad_part(const V* x, const V* dy, const float* mean, float* part, int n, int c, int s, int rows) {
    __shared__ float red[BLOCK / 32 + 1];
    RUN_GEOMETRY
    const float m = mean[ch];
    float a = 0.f, b2 = 0.f;
    for (int k = threadIdx.x; k < count; k += BLOCK) {
        const V g = AT(dy, k);
        a += lanes(g);
        b2 += products(g, AT(x, k), m);
    }
    a = block_sum(a, red);
    b2 = block_sum(b2, red);
    if (threadIdx.x == 0) {
        float* p = part + 2 * ((long long)ch * gridDim.y + blockIdx.y);
        p[0] = a;
        p[1] = b2;
    }
}
extern "C" __global__ void bn_grad_part(const float* x, const float* dy, const float* mean, float* part, int n,
        int c, int s, int rows) {
    grad_part(x, dy, mean, part, n, c, s, rows);
}
extern "C" __global__ void bn_grad_part4(const float4* x, const float4* dy, const float* mean, float* part, int n,
        int c, int s4, int rows) {
    grad_part(x, dy, mean, part, n, c, s4, rows);
}
#ifdef LOWP
// a bias gradient: the partial sums of x over a run (one per block, as the statistics' partials)
extern "C" __global__ void channel_sum_part_low(const S* x, float* part, int n, int c, int s, int rows) {
    __shared__ float red[BLOCK / 32 + 1];
    RUN_GEOMETRY
    float acc = 0.f;
    for (int k = threadIdx.x; k < count; k += BLOCK) acc += lanes(AT(x, k));
    acc = block_sum(acc, red);
    if (threadIdx.x == 0) part[(long long)ch * gridDim.y + blockIdx.y] = acc;
}
extern "C" __global__ void bn_grad_part_low(const S* x, const S* dy, const float* mean, float* part, int n, int c,
        int s, int rows) {
    grad_part(x, dy, mean, part, n, c, s, rows);
}
#endif
// Channels-last activations: x as rows [M, C] of NHWC memory (M = N * H * W). Thread (ch, run) reduces channel
// ch over a run of `rows` rows, row after row, so neighbouring threads read neighbouring channels (coalesced, no
// shared memory); its partials go where the per-channel kernels put theirs, so the combine kernels serve both.
#define ROWS_GEOMETRY \
    const int ch = blockIdx.x * blockDim.x + threadIdx.x; \
    if (ch >= c) return; \
    const int b0 = blockIdx.y * rows, b1 = min(b0 + rows, m); \
    const long long at = (long long)b0 * c + ch;
#define ROWS_AT(a, k) LD(a[at + (long long)(k) * c])
extern "C" __global__ void bn_rows_stats_part(const S* x, float* part, int m, int c, int rows) {
    ROWS_GEOMETRY
    float acc = 0.f;
    for (int k = 0; k < b1 - b0; ++k) acc += ROWS_AT(x, k);
    const float mu = acc / (float)(b1 - b0);
    acc = 0.f;
    for (int k = 0; k < b1 - b0; ++k) { const float d = ROWS_AT(x, k) - mu; acc += d * d; }
    float* p = part + 2 * ((long long)ch * gridDim.y + blockIdx.y);
    p[0] = mu;
    p[1] = acc;
}
extern "C" __global__ void bn_rows_grad_part(const S* x, const S* dy, const float* mean, float* part, int m, int c,
        int rows) {
    ROWS_GEOMETRY
    const float mu = mean[ch];
    float a = 0.f, b2 = 0.f;
    for (int k = 0; k < b1 - b0; ++k) { const float g = ROWS_AT(dy, k); a += g; b2 += g * (ROWS_AT(x, k) - mu); }
    float* p = part + 2 * ((long long)ch * gridDim.y + blockIdx.y);
    p[0] = a;
    p[1] = b2;
}
// a bias gradient's partial sums (one per run, as channel_sum_part_low's)
extern "C" __global__ void rows_sum_part(const S* x, float* part, int m, int c, int rows) {
    ROWS_GEOMETRY
    float acc = 0.f;
    for (int k = 0; k < b1 - b0; ++k) acc += ROWS_AT(x, k);
    part[(long long)ch * gridDim.y + blockIdx.y] = acc;
}
// a bias gradient from its runs' partial sums (rows_sum_part's, channel_sum_part_low's): db = total + beta * db,
// the runs added in a fixed order in double (one block per channel, as the batch-norm combinations)
extern "C" __global__ void bias_total(const float* part, float* db, int splits, float beta) {
    __shared__ double red[COMBINE_THREADS];
    const int ch = blockIdx.x;
    const float* p = part + (long long)ch * splits;
    double t = 0.0;
    for (int j = threadIdx.x; j < splits; j += blockDim.x) t += p[j];
    t = block_total(t, red);
    if (threadIdx.x == 0) db[ch] = beta == 0.f ? (float)t : (float)t + beta * db[ch];
}
// sum dy and sum dy * (x - mean) / sqrt(var + eps) from the partials (one block per channel, as above)
extern "C" __global__ void bn_grad_combine(const float* part, const float* var, float* sum_dy, float* sum_dy_xhat,
        int c, int splits, float eps) {
    __shared__ double red[COMBINE_THREADS];
    const int ch = blockIdx.x;
    const float* p = part + 2LL * ch * splits;
    double a = 0.0, b2 = 0.0;
    for (int j = threadIdx.x; j < splits; j += blockDim.x) { a += p[2 * j]; b2 += p[2 * j + 1]; }
    a = block_total(a, red);
    b2 = block_total(b2, red);
    if (threadIdx.x == 0) {
        sum_dy[ch] = (float)a;
        sum_dy_xhat[ch] = (float)b2 / sqrtf(var[ch] + eps);
    }
}
// The per-element passes over rows [M, C] (channels-last memory, or [N, C]) with C a multiple of 8: eight values of
// one row a thread, their channels consecutive from c0 (no division per element), the per-channel arrays (16-byte
// aligned) read eight at a time; the same arithmetic as bn_apply4 and bn_backward4, per value.
__device__ __forceinline__ void load8(const S* p, long long v, float* out) {
#ifdef LOWP
    const uint4 u = reinterpret_cast<const uint4*>(p)[v];
    const S* h = reinterpret_cast<const S*>(&u);
#pragma unroll
    for (int k = 0; k < 8; ++k) out[k] = LD(h[k]);
#else
    const float4* q = reinterpret_cast<const float4*>(p) + 2 * v;
    const float4 a = q[0], b = q[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w; out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
#endif
}
__device__ __forceinline__ void store8(S* p, long long v, const float* in) {
#ifdef LOWP
    uint4 u;
    S* h = reinterpret_cast<S*>(&u);
#pragma unroll
    for (int k = 0; k < 8; ++k) h[k] = ST(in[k]);
    reinterpret_cast<uint4*>(p)[v] = u;
#else
    float4* q = reinterpret_cast<float4*>(p) + 2 * v;
    q[0] = make_float4(in[0], in[1], in[2], in[3]);
    q[1] = make_float4(in[4], in[5], in[6], in[7]);
#endif
}
__device__ __forceinline__ void channels8(const float* a, int c0, float* out) {
    const float4* q = reinterpret_cast<const float4*>(a + c0);
    const float4 p = q[0], r = q[1];
    out[0] = p.x; out[1] = p.y; out[2] = p.z; out[3] = p.w; out[4] = r.x; out[5] = r.y; out[6] = r.z; out[7] = r.w;
}
extern "C" __global__ void bn_rows_apply8(const S* x, S* y, const float* mean, const float* var, const float* gamma,
        const float* beta, int c, long long n8, float eps, int flags) {
    const long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= n8) return;
    const int c0 = (int)((v * 8) % c);
    float xs[8], m[8], vr[8], g[8], b[8];
    load8(x, v, xs);
    channels8(mean, c0, m);
    channels8(var, c0, vr);
    if (flags & 1) channels8(gamma, c0, g);
    if (flags & 2) channels8(beta, c0, b);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        float sc = 1.f / sqrtf(vr[k] + eps);
        if (flags & 1) sc *= g[k];
        xs[k] = (xs[k] - m[k]) * sc + ((flags & 2) ? b[k] : 0.f);
    }
    store8(y, v, xs);
}
extern "C" __global__ void bn_rows_backward8(const S* x, const S* dy, S* dx, const float* mean, const float* var,
        const float* gamma, const float* sum_dy, const float* sum_dy_xhat, int c, long long n8, float eps,
        float inv_m, int flags) {
    const long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= n8) return;
    const int c0 = (int)((v * 8) % c);
    float g[8], vr[8], gm[8];
    load8(dy, v, g);
    channels8(var, c0, vr);
    if (flags & 1) channels8(gamma, c0, gm);
    if (flags & 4) {
        float xs[8], m[8], sd[8], sdx[8];
        load8(x, v, xs);
        channels8(mean, c0, m);
        channels8(sum_dy, c0, sd);
        channels8(sum_dy_xhat, c0, sdx);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float invstd = 1.f / sqrtf(vr[k] + eps);
            const float a = (flags & 1) ? gm[k] * invstd : invstd;
            g[k] = a * g[k] - a * (sd[k] + (xs[k] - m[k]) * invstd * sdx[k]) * inv_m;
        }
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float invstd = 1.f / sqrtf(vr[k] + eps);
            g[k] *= (flags & 1) ? gm[k] * invstd : invstd;
        }
    }
    store8(dx, v, g);
}
// The per-element passes, four values per thread (float4): S is a multiple of 4, so the four share a channel.
// y = (x - mean) / sqrt(var + eps) * gamma + beta (flags: 1 gamma, 2 beta)
extern "C" __global__ void bn_apply4(const float4* x, float4* y, const float* mean, const float* var,
        const float* gamma, const float* beta, int c, int inner4, float eps, int flags, int n4) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const int ch = (i / inner4) % c;
    float sc = 1.f / sqrtf(var[ch] + eps);
    if (flags & 1) sc *= gamma[ch];
    const float m = mean[ch], sh = (flags & 2) ? beta[ch] : 0.f;
    float4 v = x[i];
    v.x = (v.x - m) * sc + sh;
    v.y = (v.y - m) * sc + sh;
    v.z = (v.z - m) * sc + sh;
    v.w = (v.w - m) * sc + sh;
    y[i] = v;
}
// dx = a dy - a (sum_dy + xhat sum_dy_xhat) / m with a = gamma / sqrt(var + eps) (flags: 1 gamma; 4 the batch's
// statistics, else dx = a dy, the statistics being constants)
extern "C" __global__ void bn_backward4(const float4* x, const float4* dy, float4* dx, const float* mean,
        const float* var, const float* gamma, const float* sum_dy, const float* sum_dy_xhat, int c, int inner4,
        float eps, float inv_m, int flags, int n4) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const int ch = (i / inner4) % c;
    const float invstd = 1.f / sqrtf(var[ch] + eps);
    const float a = (flags & 1) ? gamma[ch] * invstd : invstd;
    float4 g = dy[i];
    if (flags & 4) {
        const float m = mean[ch], sd = sum_dy[ch], sdx = sum_dy_xhat[ch];
        const float4 v = x[i];
        g.x = a * g.x - a * (sd + (v.x - m) * invstd * sdx) * inv_m;
        g.y = a * g.y - a * (sd + (v.y - m) * invstd * sdx) * inv_m;
        g.z = a * g.z - a * (sd + (v.z - m) * invstd * sdx) * inv_m;
        g.w = a * g.w - a * (sd + (v.w - m) * invstd * sdx) * inv_m;
    } else {
        g.x *= a;
        g.y *= a;
        g.z *= a;
        g.w *= a;
    }
    dx[i] = g;
}
"""


def vectorized_source(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], scalars: tuple[str, ...],
                      operation: str, read_outputs: bool = False, pointers: tuple[str, ...] = (),
                      skip: str = "", copy: str = "") -> str:
    """A float32 kernel ``name`` that applies ``operation`` (an ElementwiseKernel operation over type ``T``,
    reading ``inputs``, ``scalars`` and the ``raw`` arrays ``pointers``, and assigning ``outputs``) to four values
    per thread, through float4 loads and stores. Its arguments: the input arrays, the output arrays, the pointers,
    the scalars, then the number of float4s. ``read_outputs``: the operation also reads its outputs
    (``y = a * x + b * y``). ``skip``: a condition over the scalars and pointers (``rate[1] == (T)0``) under which
    every thread returns before it loads or stores anything. ``copy`` ("bf16" or "f16"): the first output is also
    stored rounded to that format into a 16-bit array (an argument after the outputs; lowp.CONVERT is prepended)."""
    params = ([f"T {a}" for a in inputs] + [f"T {p}" for p in scalars] + [f"const T* {p}" for p in pointers]
              + [f"T& {o}" for o in outputs])
    low = f"{outputs[0]}_low"
    args = ([f"const float4* {a}_4" for a in inputs] + [f"float4* {o}_4" for o in outputs]
            + ([f"ushort4* {low}"] if copy else [])
            + [f"const float* {p}" for p in pointers] + [f"float {p}" for p in scalars] + ["int n4"])
    loads = [f"const float4 {a} = {a}_4[i];" for a in inputs]
    loads += [f"float4 {o}" + (f" = {o}_4[i];" if read_outputs else ";") for o in outputs]

    def lane(q: str) -> str:
        return ", ".join([f"{a}.{q}" for a in inputs] + [*scalars, *pointers] + [f"{o}.{q}" for o in outputs])

    lanes = [f"op({lane(q)});" for q in "xyzw"]
    stores = [f"{o}_4[i] = {o};" for o in outputs]
    if copy:
        o = outputs[0]
        stores.append(f"{low}[i] = make_ushort4({', '.join(f'st_{copy}({o}.{q})' for q in 'xyzw')});")
    return "\n".join([
        *([CONVERT] if copy else []),
        "#define T float",
        f"__device__ __forceinline__ void op({', '.join(params)}) {{ {operation} }}",
        f'extern "C" __global__ void {name}({", ".join(args)}) {{',
        "    const int i = blockIdx.x * blockDim.x + threadIdx.x;",
        f"    if ({' || '.join(['i >= n4', *([f'({skip})'] if skip else [])])}) return;",
        *("    " + line for line in loads + lanes + stores),
        "}",
    ])
