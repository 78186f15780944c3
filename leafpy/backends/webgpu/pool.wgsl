// 2-D pooling over NCHW, over a run of (n, c) planes. The geometry is pipeline constants (one pipeline per pooling
// shape, so the index arithmetic divides by constants).
struct PoolParams {
    count: u32,        // threads: planes * OH * OW (forward, pool_bwd_tiled) or planes * IN_H * IN_W (pool_bwd)
    src_offset: u32,   // element offsets of the run in src, dst and mask as bound
    dst_offset: u32,
    mask_offset: u32,
}
@group(0) @binding(0) var<uniform> p: PoolParams;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<storage, read_write> mask: array<i32>;
// the backward kernels only read the mask: bound read-only (the same binding, other entry points)
@group(0) @binding(3) var<storage, read> argmax: array<i32>;

override IS_MAX: bool = true;
// average windows divide by their positions inside [LH, HH) x [LW, HW): the input and its padding (Caffe's
// count_include_pad), or the input only
override LH: i32 = 0;
override LW: i32 = 0;
override HH: i32 = 1;
override HW: i32 = 1;

fn divisor(y: u32, x: u32) -> f32 {
    let h0 = i32(y * SH) - i32(PH);
    let w0 = i32(x * SW) - i32(PW);
    let rows = min(h0 + i32(KH), HH) - max(h0, LH);
    let cols = min(w0 + i32(KW), HW) - max(w0, LW);
    return f32(max(rows * cols, 1));
}

@compute @workgroup_size(256)
fn pool_fwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.count) { return; }
    let x = idx % OW;
    let y = (idx / OW) % OH;
    let plane = idx / (OW * OH);
    let h0 = i32(y * SH) - i32(PH);
    let w0 = i32(x * SW) - i32(PW);
    // the maximum starts at the window's first input position: an all -inf window gives -inf, and its mask (its
    // gradient) an input position, not the padding
    let a0 = max(-h0, 0);
    let b0 = max(-w0, 0);
    var best = -3.0e38;
    var arg = a0 * i32(KW) + b0;
    if (IS_MAX && a0 < i32(KH) && b0 < i32(KW) && h0 + a0 < i32(IN_H) && w0 + b0 < i32(IN_W)) {
        best = src[p.src_offset + (plane * IN_H + u32(h0 + a0)) * IN_W + u32(w0 + b0)];
    }
    var sum = 0.0;
    for (var i = 0u; i < KH; i = i + 1u) {
        for (var j = 0u; j < KW; j = j + 1u) {
            let h = h0 + i32(i);
            let w = w0 + i32(j);
            var v = 0.0;
            let inside = h >= 0 && h < i32(IN_H) && w >= 0 && w < i32(IN_W);
            if (inside) { v = src[p.src_offset + (plane * IN_H + u32(h)) * IN_W + u32(w)]; }
            if (IS_MAX) {
                if (inside && v > best) { best = v; arg = i32(i * KW + j); }
            } else {
                sum = sum + v;
            }
        }
    }
    if (IS_MAX) {
        dst[p.dst_offset + idx] = best;
        mask[p.mask_offset + idx] = arg;
    } else {
        dst[p.dst_offset + idx] = sum / divisor(y, x);
    }
}

// one thread per input element: the sum over the windows that contain it (a gather: no atomics)
@compute @workgroup_size(256)
fn pool_bwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.count) { return; }
    let w = idx % IN_W;
    let h = (idx / IN_W) % IN_H;
    let plane = idx / (IN_W * IN_H);
    let rows = covering_rows(h);
    let cols = covering_cols(w);
    var s = 0.0;
    for (var y = rows.x; y <= rows.y; y = y + 1) {
        let i = h + PH - u32(y) * SH;
        for (var x = cols.x; x <= cols.y; x = x + 1) {
            let j = w + PW - u32(x) * SW;
            let o = (plane * OH + u32(y)) * OW + u32(x);
            if (IS_MAX) {
                if (argmax[p.mask_offset + o] == i32(i * KW + j)) { s = s + src[p.src_offset + o]; }
            } else {
                s = s + src[p.src_offset + o] / divisor(u32(y), u32(x));
            }
        }
    }
    dst[p.dst_offset + idx] = s;
}

// windows that tile the input exactly (kernel = stride, no padding, IN = OUT * stride): one thread per output
// element writes its window of dx, each input element belonging to exactly one window.
@compute @workgroup_size(256)
fn pool_bwd_tiled(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.count) { return; }
    let x = idx % OW;
    let y = (idx / OW) % OH;
    let plane = idx / (OW * OH);
    let g = src[p.src_offset + idx];
    let arg = argmax[p.mask_offset + idx];
    for (var i = 0u; i < KH; i = i + 1u) {
        for (var j = 0u; j < KW; j = j + 1u) {
            var v = g / divisor(y, x);
            if (IS_MAX) { v = select(0.0, g, arg == i32(i * KW + j)); }
            dst[p.dst_offset + (plane * IN_H + y * SH + i) * IN_W + x * SW + j] = v;
        }
    }
}
