// Reductions by workgroups of 256 threads (trees in workgroup memory; no float atomics).
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

// Partial sums over blocks of a run of elements, a workgroup per block, finished by sum_rows (so long vectors are
// reduced in parallel, and a run past the storage-binding limit is bound on its own). u0 = elements (samples for
// nll) in the run, u3 = block length, u4 = index of the run's first block in the partial sums, u5/u6 = offsets of
// the run in a/b as bound.
fn block_range(blk: u32) -> vec2<u32> {
    return vec2<u32>(blk * p.u3, min(p.u0, (blk + 1u) * p.u3));
}

// dot_parts: c[u4 + blk] = sum a * b over the block
@compute @workgroup_size(256)
fn dot_parts(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = block_range(wid.x);
    var s = 0.0;
    for (var i = r.x + lid.x; i < r.y; i = i + 256u) { s = s + a[p.u5 + i] * b[p.u6 + i]; }
    partial[lid.x] = s;
    let total = tree(lid.x);
    if (lid.x == 0u) { c[p.u4 + wid.x] = total; }
}

// square_parts: b[u4 + blk] = sum a * a over the block
@compute @workgroup_size(256)
fn square_parts(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = block_range(wid.x);
    var s = 0.0;
    for (var i = r.x + lid.x; i < r.y; i = i + 256u) { let v = a[p.u5 + i]; s = s + v * v; }
    partial[lid.x] = s;
    let total = tree(lid.x);
    if (lid.x == 0u) { b[p.u4 + wid.x] = total; }
}

// nll_parts: c[u4 + blk] = sum over the block's samples i of a[i * C + label_i], labels in b; u1 = C
@compute @workgroup_size(256)
fn nll_parts(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = block_range(wid.x);
    var s = 0.0;
    for (var i = r.x + lid.x; i < r.y; i = i + 256u) { s = s + a[p.u5 + i * p.u1 + u32(b[p.u6 + i])]; }
    partial[lid.x] = s;
    let total = tree(lid.x);
    if (lid.x == 0u) { c[p.u4 + wid.x] = total; }
}

// bias_grad_part: workgroup (c, blk) sums channel c over its block of the N * inner values of a run of samples:
// b[c * u3 + u5 + blk] = sum a[u6 + (n * C + c) * inner + r]; u0 = N (of the run), u1 = C, u2 = inner,
// u3 = blocks of all runs, u4 = block length, u5 = this run's first block, u6 = the run's offset in a as bound
@compute @workgroup_size(256)
fn bias_grad_part(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let ch = wid.x;
    let per = p.u0 * p.u2;
    let end = min(per, (wid.y + 1u) * p.u4);
    var s = 0.0;
    for (var j = wid.y * p.u4 + lid.x; j < end; j = j + 256u) {
        let n = j / p.u2;
        let r = j % p.u2;
        s = s + a[p.u6 + (n * p.u1 + ch) * p.u2 + r];
    }
    partial[lid.x] = s;
    let total = tree(lid.x);
    if (lid.x == 0u) { b[ch * p.u3 + p.u5 + wid.y] = total; }
}

// sum_rows: one workgroup per row r < u2 of a [u2 x u0]: b[r] = f0 * sum_j a[r * u0 + j] + f1 * b[r]; with u1 = 1
// a is read as [u0 x u2] (b[r] sums column r): split-K partial products with few outputs; u3 = 1: b[r] = sqrt(b[r])
@compute @workgroup_size(256)
fn sum_rows(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let r = wid.x + wid.y * 65535u;
    if (r >= p.u2) { return; }
    var s = 0.0;
    if (p.u1 == 1u) {
        for (var j = lid.x; j < p.u0; j = j + 256u) { s = s + a[j * p.u2 + r]; }
    } else {
        for (var j = lid.x; j < p.u0; j = j + 256u) { s = s + a[r * p.u0 + j]; }
    }
    partial[lid.x] = s;
    let total = tree(lid.x);
    if (lid.x == 0u) {
        var v = p.f0 * total;
        if (p.f1 != 0.0) { v = v + p.f1 * b[r]; }
        if (p.u3 == 1u) { v = sqrt(v); }
        b[r] = v;
    }
}
