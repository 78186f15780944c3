"""CUDA sources of the cuda backend's pooling and batch-normalisation kernels (compiled with CuPy's RawModule)."""

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
