// Scatter-add of rows (the embedding table's gradient): a thread per (position m, column k) adds dy[m, k] into
// dtable[ids[m], k] with a compare-and-swap loop on the float's bits (WGSL has no float atomics), so repeated ids
// add up whatever the order. s1 = ids [M], s2 = dy [M, D], s3 = dtable [V, D]. Past the storage-binding limit a
// dispatch binds a run of positions and a window of the table's rows; it adds only the rows in its window.
struct ScatterParams {
    count: u32,      // positions x D of this dispatch
    dim: u32,        // D
    vocab: u32,      // V
    first_row: u32,  // the first row of dtable bound
    rows: u32,       // the rows of dtable bound
    off1: u32,       // element offsets of s1..s3 as bound
    off2: u32,
    off3: u32,
}
@group(0) @binding(0) var<uniform> p: ScatterParams;
@group(0) @binding(1) var<storage, read_write> s1: array<f32>;
@group(0) @binding(2) var<storage, read_write> s2: array<f32>;
@group(0) @binding(3) var<storage, read_write> s3: array<atomic<u32>>;

@compute @workgroup_size(256)
fn embedding_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let row = u32(clamp(s1[p.off1 + i / p.dim], 0.0, f32(p.vocab - 1u)));
    if (row < p.first_row || row >= p.first_row + p.rows) { return; }
    let k = p.off3 + (row - p.first_row) * p.dim + i % p.dim;
    let v = s2[p.off2 + i];
    var old = atomicLoad(&s3[k]);
    loop {
        let r = atomicCompareExchangeWeak(&s3[k], old, bitcast<u32>(bitcast<f32>(old) + v));
        if (r.exchanged) { break; }
        old = r.old_value;
    }
}
