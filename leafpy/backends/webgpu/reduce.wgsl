// Reductions by workgroups of 256 threads (reduce_workgroup: lanes.wgsl or lanes_subgroup.wgsl; no float atomics).
struct ReduceParams {
    count: u32,        // the *_parts kernels: elements (nll_parts, bias_grad_part: samples) of the run
    classes: u32,      // nll_parts: C
    channels: u32,     // bias_grad_part: a is [N, channels, inner]
    inner: u32,
    block: u32,        // block length
    blocks: u32,       // bias_grad_part: blocks of all runs
    first_block: u32,  // index of the run's first block in the partial sums
    a_offset: u32,     // offsets of the run in a and b as bound
    b_offset: u32,
    length: u32,       // sum_rows: a is [rows x length]
    rows: u32,
    columns: u32,      // sum_rows: 1 = a is [length x rows] (b[r] sums column r)
    alpha: f32,        // sum_rows: b[r] = alpha * sum + beta * b[r]
    beta: f32,
}
@group(0) @binding(0) var<uniform> p: ReduceParams;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
@group(0) @binding(4) var<storage, read_write> d: array<f32>;

// Partial sums over blocks of a run of elements, a workgroup per block, finished by sum_rows (so long vectors are
// reduced in parallel, and a run past the storage-binding limit is bound on its own).
fn block_range(blk: u32) -> vec2<u32> {
    return vec2<u32>(blk * p.block, min(p.count, (blk + 1u) * p.block));
}

// The *_parts kernels read four elements a thread per pass (a workgroup's 1024 in four coalesced rows of 256), so
// that each thread has four loads in flight: with one, a pass over a large gradient ran at a third of the memory
// bandwidth.
fn quad(o: u32) -> vec4<f32> { return vec4<f32>(a[o], a[o + 256u], a[o + 512u], a[o + 768u]); }
fn quad_b(o: u32) -> vec4<f32> { return vec4<f32>(b[o], b[o + 256u], b[o + 512u], b[o + 768u]); }

// dot_parts: c[first_block + blk] = sum a * b over the block
@compute @workgroup_size(256)
fn dot_parts(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lane.lid;
    let r = block_range(wid.x);
    var s = vec4<f32>(0.0);
    var i = r.x + lid.x;
    for (; i + 768u < r.y; i = i + 1024u) { s = s + quad(p.a_offset + i) * quad_b(p.b_offset + i); }
    for (; i < r.y; i = i + 256u) { s.x = s.x + a[p.a_offset + i] * b[p.b_offset + i]; }
    let total = reduce_workgroup(lane, s.x + s.y + s.z + s.w, false);
    if (lid.x == 0u) { c[p.first_block + wid.x] = total; }
}

// square_parts: b[first_block + blk] = sum a * a over the block
@compute @workgroup_size(256)
fn square_parts(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lane.lid;
    let r = block_range(wid.x);
    var s = vec4<f32>(0.0);
    var i = r.x + lid.x;
    for (; i + 768u < r.y; i = i + 1024u) { let v = quad(p.a_offset + i); s = s + v * v; }
    for (; i < r.y; i = i + 256u) { let v = a[p.a_offset + i]; s.x = s.x + v * v; }
    let total = reduce_workgroup(lane, s.x + s.y + s.z + s.w, false);
    if (lid.x == 0u) { b[p.first_block + wid.x] = total; }
}

// unscale_square_parts: a = a * (1 / c[0]) (loss scaling's unscale, as update.wgsl's unscale), then
// b[first_block + blk] = sum a * a over the block
@compute @workgroup_size(256)
fn unscale_square_parts(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lane.lid;
    let r = block_range(wid.x);
    let inv = 1.0 / c[0];
    var s = vec4<f32>(0.0);
    var i = r.x + lid.x;
    for (; i + 768u < r.y; i = i + 1024u) {
        let o = p.a_offset + i;
        let v = quad(o) * inv;
        a[o] = v.x;
        a[o + 256u] = v.y;
        a[o + 512u] = v.z;
        a[o + 768u] = v.w;
        s = s + v * v;
    }
    for (; i < r.y; i = i + 256u) {
        let v = a[p.a_offset + i] * inv;
        a[p.a_offset + i] = v;
        s.x = s.x + v * v;
    }
    let total = reduce_workgroup(lane, s.x + s.y + s.z + s.w, false);
    if (lid.x == 0u) { b[p.first_block + wid.x] = total; }
}

// nll_parts: c[first_block + blk] = sum over the block's samples i of a[i * classes + label_i], labels in b
@compute @workgroup_size(256)
fn nll_parts(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lane.lid;
    let r = block_range(wid.x);
    var s = 0.0;
    for (var i = r.x + lid.x; i < r.y; i = i + 256u) { s = s + a[p.a_offset + i * p.classes + u32(b[p.b_offset + i])]; }
    let total = reduce_workgroup(lane, s, false);
    if (lid.x == 0u) { c[p.first_block + wid.x] = total; }
}

// bias_grad_part: workgroup (c, blk) sums channel c over its block of the N * inner values of a run of samples:
// b[c * blocks + first_block + blk] = sum a[a_offset + (n * channels + c) * inner + r]
// element j of channel ch's N * inner values in a [N, channels, inner]
fn channel_at(ch: u32, j: u32) -> f32 {
    return a[p.a_offset + ((j / p.inner) * p.channels + ch) * p.inner + j % p.inner];
}

@compute @workgroup_size(256)
fn bias_grad_part(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lane.lid;
    let ch = wid.x;
    let per = p.count * p.inner;
    let end = min(per, (wid.y + 1u) * p.block);
    var s = vec4<f32>(0.0);
    var j = wid.y * p.block + lid.x;
    for (; j + 768u < end; j = j + 1024u) {
        s = s + vec4<f32>(channel_at(ch, j), channel_at(ch, j + 256u), channel_at(ch, j + 512u),
                          channel_at(ch, j + 768u));
    }
    for (; j < end; j = j + 256u) { s.x = s.x + channel_at(ch, j); }
    let total = reduce_workgroup(lane, s.x + s.y + s.z + s.w, false);
    if (lid.x == 0u) { b[ch * p.blocks + p.first_block + wid.y] = total; }
}

// sum_rows: one workgroup per row r of a [rows x length]: b[r] = alpha * sum_j a[r * length + j] + beta * b[r]; with
// columns = 1 a is read as [length x rows] (b[r] sums column r): split-K partial products with few outputs
@compute @workgroup_size(256)
fn sum_rows(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lane.lid;
    let r = wid.x + wid.y * 65535u;
    let n = select(0u, p.length, r < p.rows);  // a workgroup past the last row sums nothing
    var s = 0.0;
    if (p.columns == 1u) {
        for (var j = lid.x; j < n; j = j + 256u) { s = s + a[j * p.rows + r]; }
    } else {
        for (var j = lid.x; j < n; j = j + 256u) { s = s + a[r * p.length + j]; }
    }
    let total = reduce_workgroup(lane, s, false);
    if (lid.x == 0u && r < p.rows) {
        var v = p.alpha * total;
        if (p.beta != 0.0) { v = v + p.beta * b[r]; }
        b[r] = v;
    }
}
