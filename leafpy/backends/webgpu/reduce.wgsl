// Reductions in one workgroup of 256 threads (tree in workgroup memory; no float atomics).
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
@group(0) @binding(4) var<storage, read_write> d: array<f32>;

var<workgroup> partial: array<f32, 256>;

fn tree(t: u32) -> f32 {
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (t < s) { partial[t] = partial[t] + partial[t + s]; }
        workgroupBarrier();
    }
    return partial[0];
}

// dot: c[0] = sum(a * b); u1 = 1 for sqrt (nrm2 of a with b = a)
@compute @workgroup_size(256)
fn dot(@builtin(local_invocation_id) lid: vec3<u32>) {
    var s = 0.0;
    for (var i = lid.x; i < p.u0; i = i + 256u) { s = s + a[i] * b[i]; }
    partial[lid.x] = s;
    let total = tree(lid.x);
    if (lid.x == 0u) { c[0] = select(total, sqrt(total), p.u1 == 1u); }
}

// nll: c[0] = -mean_i a[i * C + label_i], labels in b; u0 = N, u1 = C
@compute @workgroup_size(256)
fn nll(@builtin(local_invocation_id) lid: vec3<u32>) {
    var s = 0.0;
    for (var i = lid.x; i < p.u0; i = i + 256u) { s = s + a[i * p.u1 + u32(b[i])]; }
    partial[lid.x] = s;
    let total = tree(lid.x);
    if (lid.x == 0u) { c[0] = -total / f32(p.u0); }
}

// sum of squares / n: b[0] = sum(a * a) / u0
@compute @workgroup_size(256)
fn mean_square(@builtin(local_invocation_id) lid: vec3<u32>) {
    var s = 0.0;
    for (var i = lid.x; i < p.u0; i = i + 256u) { s = s + a[i] * a[i]; }
    partial[lid.x] = s;
    let total = tree(lid.x);
    if (lid.x == 0u) { b[0] = total / f32(p.u0); }
}

// bias_grad: one workgroup per channel c: b[c] = sum_{n,r} a[(n * C + c) * inner + r] + f0 * b[c]
// u0 = N, u1 = C, u2 = inner
@compute @workgroup_size(256)
fn bias_grad(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let ch = wid.x;
    let per = p.u0 * p.u2;
    var s = 0.0;
    for (var j = lid.x; j < per; j = j + 256u) {
        let n = j / p.u2;
        let r = j % p.u2;
        s = s + a[(n * p.u1 + ch) * p.u2 + r];
    }
    partial[lid.x] = s;
    let total = tree(lid.x);
    if (lid.x == 0u) { b[ch] = total + p.f0 * b[ch]; }
}
