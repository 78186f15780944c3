// Per-sample work over the class axis of [N, C, inner]: one thread per (n, r). u0 = N * inner, u1 = C, u2 = inner;
// u4/u5/u6 = element offsets of the first sample in a/b/c as bound (a run of samples past the binding limit).
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

fn at(row: u32, k: u32) -> u32 {
    let n = row / p.u2;
    let r = row % p.u2;
    return (n * p.u1 + k) * p.u2 + r;
}

// softmax / log_softmax: b = f(a); u3 = 1 for log
@compute @workgroup_size(256)
fn softmax(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let row = flat_index(gid, nw);
    if (row >= p.u0) { return; }
    var m = a[p.u4 + at(row, 0u)];
    for (var k = 1u; k < p.u1; k = k + 1u) { m = max(m, a[p.u4 + at(row, k)]); }
    var s = 0.0;
    for (var k = 0u; k < p.u1; k = k + 1u) { s = s + exp(a[p.u4 + at(row, k)] - m); }
    let ls = log(s);
    for (var k = 0u; k < p.u1; k = k + 1u) {
        let z = a[p.u4 + at(row, k)] - m;
        b[p.u5 + at(row, k)] = select(exp(z) / s, z - ls, p.u3 == 1u);
    }
}

// softmax_grad: c = a * (b - sum(b * a)) with a = y, b = dy;  log: c = b - exp(a) * sum(b)
@compute @workgroup_size(256)
fn softmax_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let row = flat_index(gid, nw);
    if (row >= p.u0) { return; }
    var s = 0.0;
    for (var k = 0u; k < p.u1; k = k + 1u) {
        let i = at(row, k);
        s = s + select(b[p.u5 + i] * a[p.u4 + i], b[p.u5 + i], p.u3 == 1u);
    }
    for (var k = 0u; k < p.u1; k = k + 1u) {
        let i = at(row, k);
        c[p.u6 + i] = select(a[p.u4 + i] * (b[p.u5 + i] - s), b[p.u5 + i] - exp(a[p.u4 + i]) * s, p.u3 == 1u);
    }
}

// nll_grad: c = 0 except c[n, label_n] = -b[0] / N; a = labels, b = dloss. One thread per (n, k) of a run of
// samples: u0 = its samples * C, u1 = C, u2 = N, u3/u4 = the run's offsets in a/c as bound.
@compute @workgroup_size(256)
fn nll_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.u0) { return; }
    let n = i / p.u1;
    let k = i % p.u1;
    c[p.u4 + i] = select(0.0, -b[0] / f32(p.u2), u32(a[p.u3 + n]) == k);
}

// The same over long rows, one 256-thread workgroup per row (workgroup (x, y) is row x + 65535 * y); the row's
// maximum and sums are trees in workgroup memory.
var<workgroup> red: array<f32, 256>;

// the maximum (is_max) or the sum of v over the workgroup's 256 threads
fn reduce_rows(t: u32, v: f32, is_max: bool) -> f32 {
    red[t] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (t < s) { red[t] = select(red[t] + red[t + s], max(red[t], red[t + s]), is_max); }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(256)
fn softmax_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = wid.x + wid.y * 65535u;
    if (row >= p.u0) { return; }
    let t = lid.x;
    var m = -3.0e38;
    for (var k = t; k < p.u1; k = k + 256u) { m = max(m, a[p.u4 + at(row, k)]); }
    m = reduce_rows(t, m, true);
    var s = 0.0;
    for (var k = t; k < p.u1; k = k + 256u) { s = s + exp(a[p.u4 + at(row, k)] - m); }
    s = reduce_rows(t, s, false);
    let ls = log(s);
    for (var k = t; k < p.u1; k = k + 256u) {
        let z = a[p.u4 + at(row, k)] - m;
        b[p.u5 + at(row, k)] = select(exp(z) / s, z - ls, p.u3 == 1u);
    }
}

@compute @workgroup_size(256)
fn softmax_grad_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = wid.x + wid.y * 65535u;
    if (row >= p.u0) { return; }
    let t = lid.x;
    var s = 0.0;
    for (var k = t; k < p.u1; k = k + 256u) {
        let i = at(row, k);
        s = s + select(b[p.u5 + i] * a[p.u4 + i], b[p.u5 + i], p.u3 == 1u);
    }
    s = reduce_rows(t, s, false);
    for (var k = t; k < p.u1; k = k + 256u) {
        let i = at(row, k);
        c[p.u6 + i] = select(a[p.u4 + i] * (b[p.u5 + i] - s), b[p.u5 + i] - exp(a[p.u4 + i]) * s, p.u3 == 1u);
    }
}
