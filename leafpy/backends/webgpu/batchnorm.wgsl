// Batch normalisation. Per-element kernels: u0 = elements in this piece, u1 = C, u2 = values per channel and sample
// (H * W), u3 = the piece's first element (channel of element i: ((i + u3) / u2) % u1). Per-channel kernels: u0 = C.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
@group(0) @binding(4) var<storage, read_write> d: array<f32>;
@group(0) @binding(5) var<storage, read_write> e: array<f32>;
@group(0) @binding(6) var<storage, read_write> f: array<f32>;

fn channel(i: u32) -> u32 {
    return ((i + p.u3) / p.u2) % p.u1;
}

// c = (a - b[ch])^2   (a = x, b = mean)
@compute @workgroup_size(256)
fn bn_centered_square(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { let v = a[i] - b[channel(i)]; c[i] = v * v; }
}

// d = a * (b - c[ch])   (a = dy, b = x, c = mean)
@compute @workgroup_size(256)
fn bn_dy_centered(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { d[i] = a[i] * (b[i] - c[channel(i)]); }
}

// per channel: a *= 1 / sqrt(b + f0)   (a = sum dy (x - mean), b = var: a becomes sum dy xhat)
@compute @workgroup_size(256)
fn bn_times_invstd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { a[i] = a[i] * inverseSqrt(b[i] + p.f0); }
}

// per channel: e[i] = scale, e[u0 + i] = shift with scale = gamma / sqrt(var + f0), shift = beta - mean * scale
// (a = mean, b = var, c = gamma if u1 != 0, d = beta if u2 != 0)
@compute @workgroup_size(256)
fn bn_coefficients(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.u0) { return; }
    var scale = inverseSqrt(b[i] + p.f0);
    if (p.u1 != 0u) { scale = scale * c[i]; }
    var shift = -a[i] * scale;
    if (p.u2 != 0u) { shift = shift + d[i]; }
    e[i] = scale;
    e[p.u0 + i] = shift;
}

// c = a * b[ch] + b[u1 + ch]   (a = x, b = scale and shift, c = y)
@compute @workgroup_size(256)
fn bn_affine(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { let ch = channel(i); c[i] = a[i] * b[ch] + b[p.u1 + ch]; }
}

// per channel, the data gradient dx = A dy + B x + K as f[i], f[u0 + i], f[2 u0 + i]: A = gamma / sqrt(var + f0);
// with this batch's statistics (u2 != 0) B = -A sum_dy_xhat f1 / sqrt(var + f0), K = -A sum_dy f1 - B mean
// (f1 = 1 / values per channel), otherwise B = K = 0. a = mean, b = var, c = gamma if u1 != 0, d = sum dy,
// e = sum dy xhat
@compute @workgroup_size(256)
fn bn_grad_coefficients(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.u0) { return; }
    let invstd = inverseSqrt(b[i] + p.f0);
    var scale = invstd;
    if (p.u1 != 0u) { scale = scale * c[i]; }
    var bx = 0.0;
    var k = 0.0;
    if (p.u2 != 0u) {
        bx = -scale * e[i] * p.f1 * invstd;
        k = -scale * d[i] * p.f1 - bx * a[i];
    }
    f[i] = scale;
    f[p.u0 + i] = bx;
    f[2u * p.u0 + i] = k;
}

// d = c[ch] * a + c[u1 + ch] * b + c[2 u1 + ch]   (a = dy, b = x, c = coefficients, d = dx)
@compute @workgroup_size(256)
fn bn_grad_apply(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) {
        let ch = channel(i);
        d[i] = c[ch] * a[i] + c[p.u1 + ch] * b[i] + c[2u * p.u1 + ch];
    }
}
