// Recurrent cells, one step t of N sequences of T steps with hidden size H: a thread per (sequence n, unit j).
// Per-sequence tensors are batch-first ([N, T, ...]); per-step ones are [N, ...]. Past the storage-binding limit
// a dispatch covers a run of sequences, each per-sequence or per-step tensor bound from that run's first sequence
// (at an aligned offset: element off1..off8 of s1..s8 as bound is where the run starts); biases are bound whole.
struct SequenceParams {
    count: u32,       // threads: N * H (embedding: M * D)
    steps: u32,       // T
    hidden: u32,      // H
    step: u32,        // t
    every_step: u32,  // 1 when the output holds every step ([N, T, H]), 0 when it holds the last step only ([N, H])
    dim: u32,         // embedding: D
    vocab: u32,       // embedding: V
    first_row: u32,   // embedding: the first table row bound (past the binding limit, a window of rows)
    rows: u32,        // embedding: the table rows bound
    off1: u32,        // element offsets of s1..s8 as bound
    off2: u32,
    off3: u32,
    off4: u32,
    off5: u32,
    off6: u32,
    off7: u32,
    off8: u32,
    parts: u32,       // > 0: the recurrent product (hw, or dh in the gradients) is held as this many split-K
    part_stride: u32, // partial products this far apart in the binding after the kernel's last; the cell adds
    alpha: f32,       // them up (alpha * their sum + beta * the operand) and stores that into the operand, as
    beta: f32,        // the product's own sum would have
}
@group(0) @binding(0) var<uniform> p: SequenceParams;
@group(0) @binding(1) var<storage, read_write> s1: array<f32>;
@group(0) @binding(2) var<storage, read_write> s2: array<f32>;
@group(0) @binding(3) var<storage, read_write> s3: array<f32>;
@group(0) @binding(4) var<storage, read_write> s4: array<f32>;
@group(0) @binding(5) var<storage, read_write> s5: array<f32>;
@group(0) @binding(6) var<storage, read_write> s6: array<f32>;
@group(0) @binding(7) var<storage, read_write> s7: array<f32>;
@group(0) @binding(8) var<storage, read_write> s8: array<f32>;

// tanh saturates to +-1 in f32 long before 15: clamping keeps any exp-based tanh finite
fn tanh_c(x: f32) -> f32 { return tanh(clamp(x, -15.0, 15.0)); }
fn sigm(x: f32) -> f32 { return 0.5 * (1.0 + tanh_c(0.5 * x)); }

// alpha * (the sum of the split-K partials at idx) + beta * v, the partials bound as s8, s7 or s6
fn scaled(total: f32, v: f32) -> f32 {
    if (p.beta != 0.0) { return p.alpha * total + p.beta * v; }
    return p.alpha * total;
}
fn summed8(v: f32, idx: u32) -> f32 {
    var total = 0.0;
    for (var z = 0u; z < p.parts; z = z + 1u) { total = total + s8[z * p.part_stride + idx]; }
    return scaled(total, v);
}
fn summed7(v: f32, idx: u32) -> f32 {
    var total = 0.0;
    for (var z = 0u; z < p.parts; z = z + 1u) { total = total + s7[z * p.part_stride + idx]; }
    return scaled(total, v);
}
fn summed6(v: f32, idx: u32) -> f32 {
    var total = 0.0;
    for (var z = 0u; z < p.parts; z = z + 1u) { total = total + s6[z * p.part_stride + idx]; }
    return scaled(total, v);
}

// A cell's thread i = n * H + j works on unit j of sequence n in step t; i is its element of a per-step [N, H]
// tensor. seq_at: its element of a per-sequence tensor of k values per unit ([N, T, k * H]: k = 1 for c, h and
// hprev, 4 or 3 for gates, the gate g lying g * H further on), step_at: of a per-step one ([N, k * H]).
fn seq_at(i: u32, k: u32) -> u32 { return ((i / p.hidden) * p.steps + p.step) * k * p.hidden + i % p.hidden; }
fn step_at(i: u32, k: u32) -> u32 { return (i / p.hidden) * k * p.hidden + i % p.hidden; }
// The output y and its gradient dy hold every step ([N, T, H]) or the last ([N, H]): whether step t is in them,
// and the thread's element there. hprev (h_{t-1} of every step) is 0 at step 0 and h_t at step t + 1.
fn in_y() -> bool { return p.every_step == 1u || p.step + 1u == p.steps; }
fn y_at(i: u32) -> u32 { return select(i, seq_at(i, 1u), p.every_step == 1u); }

// lstm_cell: s1 = gates [N, T, 4H] (x W_ih^T in, activated i, f, g, o out), s2 = hw [N, 4H], s3 = bias [4H],
// s4 = c [N, T, H], s5 = h [N, H], s6 = hprev [N, T, H], s7 = y, s8 = hw's split-K partials (parts > 0)
@compute @workgroup_size(256)
fn lstm_cell(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let hs = p.hidden;
    let t = p.step;
    let j = i % hs;
    let s0 = seq_at(i, 1u);
    let g0 = p.off1 + seq_at(i, 4u);
    let w = step_at(i, 4u);
    let w0 = p.off2 + w;
    var hi = s2[w0];
    var hf = s2[w0 + hs];
    var hg = s2[w0 + 2u * hs];
    var ho = s2[w0 + 3u * hs];
    if (p.parts > 0u) {
        hi = summed8(hi, w);
        hf = summed8(hf, w + hs);
        hg = summed8(hg, w + 2u * hs);
        ho = summed8(ho, w + 3u * hs);
        s2[w0] = hi;
        s2[w0 + hs] = hf;
        s2[w0 + 2u * hs] = hg;
        s2[w0 + 3u * hs] = ho;
    }
    let gi = sigm(s1[g0] + hi + s3[j]);
    let gf = sigm(s1[g0 + hs] + hf + s3[j + hs]);
    let gg = tanh_c(s1[g0 + 2u * hs] + hg + s3[j + 2u * hs]);
    let go = sigm(s1[g0 + 3u * hs] + ho + s3[j + 3u * hs]);
    s1[g0] = gi;
    s1[g0 + hs] = gf;
    s1[g0 + 2u * hs] = gg;
    s1[g0 + 3u * hs] = go;
    var cn = gi * gg;
    if (t > 0u) { cn = cn + gf * s4[p.off4 + s0 - hs]; }
    s4[p.off4 + s0] = cn;
    let hv = go * tanh_c(cn);
    s5[p.off5 + i] = hv;
    if (t == 0u) { s6[p.off6 + s0] = 0.0; }
    if (t + 1u < p.steps) { s6[p.off6 + s0 + hs] = hv; }
    if (in_y()) { s7[p.off7 + y_at(i)] = hv; }
}

// lstm_cell_grad: s1 = gates [N, T, 4H] (activated), s2 = c [N, T, H], s3 = dh [N, H] (from step t + 1),
// s4 = dy, s5 = dc [N, H] (dL/dc_t in, dL/dc_{t-1} out), s6 = dgates [N, T, 4H], s7 = dgates_t [N, 4H],
// s8 = dh's split-K partials (parts > 0)
@compute @workgroup_size(256)
fn lstm_cell_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let hs = p.hidden;
    let t = p.step;
    let s0 = seq_at(i, 1u);
    var dh = s3[p.off3 + i];
    if (p.parts > 0u) {
        dh = summed8(dh, i);
        s3[p.off3 + i] = dh;
    }
    if (in_y()) { dh = dh + s4[p.off4 + y_at(i)]; }
    let g = seq_at(i, 4u);
    let g0 = p.off1 + g;
    let gi = s1[g0];
    let gf = s1[g0 + hs];
    let gg = s1[g0 + 2u * hs];
    let go = s1[g0 + 3u * hs];
    let c0 = p.off2 + s0;
    let tc = tanh_c(s2[c0]);
    let dc = s5[p.off5 + i] + dh * go * (1.0 - tc * tc);
    var df = 0.0;
    if (t > 0u) { df = dc * s2[c0 - hs] * gf * (1.0 - gf); }
    let di = dc * gg * gi * (1.0 - gi);
    let dg = dc * gi * (1.0 - gg * gg);
    let d_o = dh * tc * go * (1.0 - go);
    s5[p.off5 + i] = dc * gf;
    let d0 = p.off6 + g;
    s6[d0] = di;
    s6[d0 + hs] = df;
    s6[d0 + 2u * hs] = dg;
    s6[d0 + 3u * hs] = d_o;
    let w0 = p.off7 + step_at(i, 4u);
    s7[w0] = di;
    s7[w0 + hs] = df;
    s7[w0 + 2u * hs] = dg;
    s7[w0 + 3u * hs] = d_o;
}

// rnn_cell: s1 = pre [N, T, H] (x W_ih^T in, h_t out), s2 = hw [N, H], s3 = bias [H], s4 = h [N, H],
// s5 = hprev [N, T, H], s6 = y, s7 = hw's split-K partials (parts > 0)
@compute @workgroup_size(256)
fn rnn_cell(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let hs = p.hidden;
    let t = p.step;
    let j = i % hs;
    let s0 = seq_at(i, 1u);
    var hw = s2[p.off2 + i];
    if (p.parts > 0u) {
        hw = summed7(hw, i);
        s2[p.off2 + i] = hw;
    }
    let hv = tanh_c(s1[p.off1 + s0] + hw + s3[j]);
    s1[p.off1 + s0] = hv;
    s4[p.off4 + i] = hv;
    if (t == 0u) { s5[p.off5 + s0] = 0.0; }
    if (t + 1u < p.steps) { s5[p.off5 + s0 + hs] = hv; }
    if (in_y()) { s6[p.off6 + y_at(i)] = hv; }
}

// rnn_cell_grad: s1 = pre [N, T, H] (h of every step), s2 = dh [N, H], s3 = dy, s4 = dpre [N, T, H],
// s5 = dpre_t [N, H], s6 = dh's split-K partials (parts > 0)
@compute @workgroup_size(256)
fn rnn_cell_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let s0 = seq_at(i, 1u);
    var dh = s2[p.off2 + i];
    if (p.parts > 0u) {
        dh = summed6(dh, i);
        s2[p.off2 + i] = dh;
    }
    if (in_y()) { dh = dh + s3[p.off3 + y_at(i)]; }
    let hv = s1[p.off1 + s0];
    let d = dh * (1.0 - hv * hv);
    s4[p.off4 + s0] = d;
    s5[p.off5 + i] = d;
}

// gru_cell: s1 = pre [N, T, 3H] (x W_ih^T in, activated r, z, n out), s2 = hw [N, 3H], s3 = bias_ih [3H],
// s4 = bias_hh [3H], s5 = hn [N, T, H] (W_hn h + b_hn, kept), s6 = h [N, H], s7 = hprev [N, T, H], s8 = y
@compute @workgroup_size(256)
fn gru_cell(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let hs = p.hidden;
    let t = p.step;
    let j = i % hs;
    let s0 = seq_at(i, 1u);
    let g0 = p.off1 + seq_at(i, 3u);
    let w0 = p.off2 + step_at(i, 3u);
    let r = sigm(s1[g0] + s3[j] + s2[w0] + s4[j]);
    let z = sigm(s1[g0 + hs] + s3[j + hs] + s2[w0 + hs] + s4[j + hs]);
    let bn = s2[w0 + 2u * hs] + s4[j + 2u * hs];
    let nv = tanh_c(s1[g0 + 2u * hs] + s3[j + 2u * hs] + r * bn);
    s1[g0] = r;
    s1[g0 + hs] = z;
    s1[g0 + 2u * hs] = nv;
    s5[p.off5 + s0] = bn;
    var hp = 0.0;
    if (t > 0u) { hp = s7[p.off7 + s0]; }
    let hv = (1.0 - z) * nv + z * hp;
    s6[p.off6 + i] = hv;
    if (t == 0u) { s7[p.off7 + s0] = 0.0; }
    if (t + 1u < p.steps) { s7[p.off7 + s0 + hs] = hv; }
    if (in_y()) { s8[p.off8 + y_at(i)] = hv; }
}

// gru_cell_grad: s1 = pre [N, T, 3H] (activated), s2 = hn [N, T, H], s3 = hprev [N, T, H], s4 = dh [N, H] (dL/dh_t
// in, its direct share of dL/dh_{t-1} out), s5 = dy, s6 = dpre [N, T, 3H], s7 = dpre_h [N, T, 3H], s8 = dpre_h_t
@compute @workgroup_size(256)
fn gru_cell_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let hs = p.hidden;
    let s0 = seq_at(i, 1u);
    var dh = s4[p.off4 + i];
    if (in_y()) { dh = dh + s5[p.off5 + y_at(i)]; }
    let g = seq_at(i, 3u);
    let g0 = p.off1 + g;
    let r = s1[g0];
    let z = s1[g0 + hs];
    let nv = s1[g0 + 2u * hs];
    let dn = dh * (1.0 - z) * (1.0 - nv * nv);
    let dz = dh * (s3[p.off3 + s0] - nv) * z * (1.0 - z);
    let dr = dn * s2[p.off2 + s0] * r * (1.0 - r);
    s4[p.off4 + i] = dh * z;
    let d6 = p.off6 + g;
    s6[d6] = dr;
    s6[d6 + hs] = dz;
    s6[d6 + 2u * hs] = dn;
    let d7 = p.off7 + g;
    s7[d7] = dr;
    s7[d7 + hs] = dz;
    s7[d7 + 2u * hs] = dn * r;
    let w0 = p.off8 + step_at(i, 3u);
    s8[w0] = dr;
    s8[w0 + hs] = dz;
    s8[w0 + 2u * hs] = dn * r;
}

// embedding: s1 = ids [M], s2 = table [V, D] (rows first_row .. first_row + rows as bound), s3 = out [M, D]; a
// position whose row lies outside the bound rows is left to the dispatch that binds it
@compute @workgroup_size(256)
fn embedding(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let row = u32(clamp(s1[p.off1 + i / p.dim], 0.0, f32(p.vocab - 1u)));
    if (row < p.first_row || row >= p.first_row + p.rows) { return; }
    s3[p.off3 + i] = s2[p.off2 + (row - p.first_row) * p.dim + i % p.dim];
}
