// Local response normalisation across channels (Caffe's LRN). Tensors are [N, C, S] with u1 = C, u2 = S,
// u3 = the window size; u4 = index of the first element of this dispatch; u0 = how many elements it covers.
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
@group(0) @binding(4) var<storage, read_write> d: array<f32>;
@group(0) @binding(5) var<storage, read_write> e: array<f32>;
@group(0) @binding(0) var<uniform> p: Params;

// lrn: a = x, b = scale, c = y; f0 = alpha / size, f1 = beta, f2 = k
@compute @workgroup_size(256)
fn lrn(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.u0) { return; }
    let g = i + p.u4;
    let ch = i32((g / p.u2) % p.u1);
    let base = g - u32(ch) * p.u2;  // channel 0 of this sample and position
    let pre = (i32(p.u3) - 1) / 2;
    var total = 0.0;
    for (var j = max(ch - pre, 0); j <= min(ch - pre + i32(p.u3) - 1, i32(p.u1) - 1); j = j + 1) {
        let v = a[base + u32(j) * p.u2];
        total = total + v * v;
    }
    let s = p.f2 + p.f0 * total;
    b[g] = s;
    c[g] = a[g] * pow(s, -p.f1);
}

// lrn_grad: a = x, b = y, c = scale, d = dy, e = dx; f0 = 2 alpha beta / size, f1 = beta
@compute @workgroup_size(256)
fn lrn_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.u0) { return; }
    let g = i + p.u4;
    let ch = i32((g / p.u2) % p.u1);
    let base = g - u32(ch) * p.u2;
    let pre = (i32(p.u3) - 1) / 2;
    let post = i32(p.u3) - 1 - pre;
    var total = 0.0;
    for (var j = max(ch - post, 0); j <= min(ch + pre, i32(p.u1) - 1); j = j + 1) {
        let k = base + u32(j) * p.u2;
        total = total + d[k] * b[k] / c[k];
    }
    e[g] = d[g] * pow(c[g], -p.f1) - p.f0 * a[g] * total;
}
