// Batch normalisation: per-element kernels over [N, channels, inner] tensors, and per-channel kernels (count =
// channels).
struct BatchNormParams {
    count: u32,         // elements (or channels) in this dispatch
    base: u32,          // index of this dispatch's first element in the whole tensor
    channels: u32,
    inner: u32,         // values per channel and sample (H * W)
    has_gamma: u32,     // bn_coefficients, bn_grad_coefficients
    has_beta: u32,      // bn_coefficients
    batch_stats: u32,   // bn_grad_coefficients: normalised by this batch's statistics
    eps: f32,
    inv_count: f32,     // bn_grad_coefficients: 1 / values per channel
}
@group(0) @binding(0) var<uniform> p: BatchNormParams;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
@group(0) @binding(4) var<storage, read_write> d: array<f32>;
@group(0) @binding(5) var<storage, read_write> e: array<f32>;
@group(0) @binding(6) var<storage, read_write> f: array<f32>;

fn channel(i: u32) -> u32 {
    return ((i + p.base) / p.inner) % p.channels;
}

// c = (a - b[ch])^2   (a = x, b = mean)
@compute @workgroup_size(256)
fn bn_centered_square(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { let v = a[i] - b[channel(i)]; c[i] = v * v; }
}

// d = a * (b - c[ch])   (a = dy, b = x, c = mean)
@compute @workgroup_size(256)
fn bn_dy_centered(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { d[i] = a[i] * (b[i] - c[channel(i)]); }
}

// per channel: a *= 1 / sqrt(b + eps)   (a = sum dy (x - mean), b = var: a becomes sum dy xhat)
@compute @workgroup_size(256)
fn bn_times_invstd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { a[i] = a[i] * inverseSqrt(b[i] + p.eps); }
}

// per channel: e[i] = scale, e[count + i] = shift with scale = gamma / sqrt(var + eps), shift = beta - mean * scale
// (a = mean, b = var, c = gamma if has_gamma != 0, d = beta if has_beta != 0)
@compute @workgroup_size(256)
fn bn_coefficients(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    var scale = inverseSqrt(b[i] + p.eps);
    if (p.has_gamma != 0u) { scale = scale * c[i]; }
    var shift = -a[i] * scale;
    if (p.has_beta != 0u) { shift = shift + d[i]; }
    e[i] = scale;
    e[p.count + i] = shift;
}

// c = a * b[ch] + b[channels + ch]   (a = x, b = scale and shift, c = y)
@compute @workgroup_size(256)
fn bn_affine(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { let ch = channel(i); c[i] = a[i] * b[ch] + b[p.channels + ch]; }
}

// per channel, the data gradient dx = A dy + B x + K as f[i], f[count + i], f[2 count + i]:
// A = gamma / sqrt(var + eps); with this batch's statistics (batch_stats != 0) B = -A sum_dy_xhat inv_count /
// sqrt(var + eps), K = -A sum_dy inv_count - B mean, otherwise B = K = 0. a = mean, b = var, c = gamma if
// has_gamma != 0, d = sum dy, e = sum dy xhat
@compute @workgroup_size(256)
fn bn_grad_coefficients(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let invstd = inverseSqrt(b[i] + p.eps);
    var scale = invstd;
    if (p.has_gamma != 0u) { scale = scale * c[i]; }
    var bx = 0.0;
    var k = 0.0;
    if (p.batch_stats != 0u) {
        bx = -scale * e[i] * p.inv_count * invstd;
        k = -scale * d[i] * p.inv_count - bx * a[i];
    }
    f[i] = scale;
    f[p.count + i] = bx;
    f[2u * p.count + i] = k;
}

// d = c[ch] * a + c[channels + ch] * b + c[2 channels + ch]   (a = dy, b = x, c = coefficients, d = dx)
@compute @workgroup_size(256)
fn bn_grad_apply(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) {
        let ch = channel(i);
        d[i] = c[ch] * a[i] + c[p.channels + ch] * b[i] + c[2u * p.channels + ch];
    }
}
