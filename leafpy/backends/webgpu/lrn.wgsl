// Local response normalisation across channels (Caffe's LRN). Tensors are [N, channels, inner].
struct LrnParams {
    count: u32,     // elements in this dispatch
    base: u32,      // index of this dispatch's first element in the whole tensor
    channels: u32,
    inner: u32,
    size: u32,      // the window, in channels
    alpha: f32,     // lrn: alpha / size; lrn_grad: 2 alpha beta / size
    beta: f32,
    k: f32,
}
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
@group(0) @binding(4) var<storage, read_write> d: array<f32>;
@group(0) @binding(5) var<storage, read_write> e: array<f32>;
@group(0) @binding(0) var<uniform> p: LrnParams;

// lrn: a = x, b = scale, c = y
@compute @workgroup_size(256)
fn lrn(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let g = i + p.base;
    let ch = i32((g / p.inner) % p.channels);
    let base = g - u32(ch) * p.inner;  // channel 0 of this sample and position
    let pre = (i32(p.size) - 1) / 2;
    var total = 0.0;
    for (var j = max(ch - pre, 0); j <= min(ch - pre + i32(p.size) - 1, i32(p.channels) - 1); j = j + 1) {
        let v = a[base + u32(j) * p.inner];
        total = total + v * v;
    }
    let s = p.k + p.alpha * total;
    b[g] = s;
    c[g] = a[g] * pow(s, -p.beta);
}

// lrn_grad: a = x, b = y, c = scale, d = dy, e = dx
@compute @workgroup_size(256)
fn lrn_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let g = i + p.base;
    let ch = i32((g / p.inner) % p.channels);
    let base = g - u32(ch) * p.inner;
    let pre = (i32(p.size) - 1) / 2;
    let post = i32(p.size) - 1 - pre;
    var total = 0.0;
    for (var j = max(ch - post, 0); j <= min(ch + pre, i32(p.channels) - 1); j = j + 1) {
        let k = base + u32(j) * p.inner;
        total = total + d[k] * b[k] / c[k];
    }
    e[g] = d[g] * pow(c[g], -p.beta) - p.alpha * a[g] * total;
}
