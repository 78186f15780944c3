// Per-sample work over the class axis of [N, classes, inner]: one thread per (n, r).
struct ClassesParams {
    count: u32,     // threads: the run's N * inner (nll_grad: its samples * classes)
    classes: u32,
    inner: u32,
    is_log: u32,    // softmax, softmax_grad: 1 for log_softmax
    batch: u32,     // nll_grad: N of the whole batch
    a_offset: u32,  // element offsets of the run's first sample in a, b and c as bound (a run of samples past the
    b_offset: u32,  // binding limit)
    c_offset: u32,
}
@group(0) @binding(0) var<uniform> p: ClassesParams;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

fn at(row: u32, k: u32) -> u32 {
    let n = row / p.inner;
    let r = row % p.inner;
    return (n * p.classes + k) * p.inner + r;
}

// softmax / log_softmax: b = f(a)
@compute @workgroup_size(256)
fn softmax(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let row = flat_index(gid, nw);
    if (row >= p.count) { return; }
    var m = a[p.a_offset + at(row, 0u)];
    for (var k = 1u; k < p.classes; k = k + 1u) { m = max(m, a[p.a_offset + at(row, k)]); }
    var s = 0.0;
    for (var k = 0u; k < p.classes; k = k + 1u) { s = s + exp(a[p.a_offset + at(row, k)] - m); }
    let ls = log(s);
    for (var k = 0u; k < p.classes; k = k + 1u) {
        let z = a[p.a_offset + at(row, k)] - m;
        b[p.b_offset + at(row, k)] = select(exp(z) / s, z - ls, p.is_log == 1u);
    }
}

// softmax_grad: c = a * (b - sum(b * a)) with a = y, b = dy;  log: c = b - exp(a) * sum(b)
@compute @workgroup_size(256)
fn softmax_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let row = flat_index(gid, nw);
    if (row >= p.count) { return; }
    var s = 0.0;
    for (var k = 0u; k < p.classes; k = k + 1u) {
        let i = at(row, k);
        s = s + select(b[p.b_offset + i] * a[p.a_offset + i], b[p.b_offset + i], p.is_log == 1u);
    }
    for (var k = 0u; k < p.classes; k = k + 1u) {
        let i = at(row, k);
        let ai = a[p.a_offset + i];
        let bi = b[p.b_offset + i];
        c[p.c_offset + i] = select(ai * (bi - s), bi - exp(ai) * s, p.is_log == 1u);
    }
}

// nll_grad: c = 0 except c[n, label_n] = -b[0] / batch; a = labels, b = dloss. One thread per (n, k) of a run of
// samples.
@compute @workgroup_size(256)
fn nll_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let n = i / p.classes;
    let k = i % p.classes;
    c[p.c_offset + i] = select(0.0, -b[0] / f32(p.batch), u32(a[p.a_offset + n]) == k);
}

// The same over long rows, one 256-thread workgroup per row (workgroup (x, y) is row x + 65535 * y); the row's
// maximum and sums by reduce_workgroup (lanes.wgsl, or lanes_subgroup.wgsl).

@compute @workgroup_size(256)
fn softmax_rows(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lane.lid;
    let row = wid.x + wid.y * 65535u;
    let classes = select(0u, p.classes, row < p.count);  // a workgroup past the last row reads and writes nothing
    let t = lid.x;
    var m = -3.4028234e38;  // float32's lowest: a row whose values all lie below -3e38 has its own maximum
    for (var k = t; k < classes; k = k + 256u) { m = max(m, a[p.a_offset + at(row, k)]); }
    m = reduce_workgroup(lane, m, true);
    var s = 0.0;
    for (var k = t; k < classes; k = k + 256u) { s = s + exp(a[p.a_offset + at(row, k)] - m); }
    s = reduce_workgroup(lane, s, false);
    let ls = log(s);
    for (var k = t; k < classes; k = k + 256u) {
        let z = a[p.a_offset + at(row, k)] - m;
        b[p.b_offset + at(row, k)] = select(exp(z) / s, z - ls, p.is_log == 1u);
    }
}

@compute @workgroup_size(256)
fn softmax_grad_rows(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lane.lid;
    let row = wid.x + wid.y * 65535u;
    let classes = select(0u, p.classes, row < p.count);  // a workgroup past the last row reads and writes nothing
    let t = lid.x;
    var s = 0.0;
    for (var k = t; k < classes; k = k + 256u) {
        let i = at(row, k);
        s = s + select(b[p.b_offset + i] * a[p.a_offset + i], b[p.b_offset + i], p.is_log == 1u);
    }
    s = reduce_workgroup(lane, s, false);
    for (var k = t; k < classes; k = k + 256u) {
        let i = at(row, k);
        let ai = a[p.a_offset + i];
        let bi = b[p.b_offset + i];
        c[p.c_offset + i] = select(ai * (bi - s), bi - exp(ai) * s, p.is_log == 1u);
    }
}
