// 2-D pooling over NCHW, over a run of (n, c) planes. u0 = planes * OH * OW (forward) or planes * H * W
// (backward); u1/u2/u3 = element offsets of the run in src/dst/mask as bound. The geometry is pipeline constants
// (one pipeline per pooling shape, so the index arithmetic divides by constants).
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<storage, read_write> mask: array<i32>;

override IS_MAX: bool = true;
override H: u32 = 1u;
override W: u32 = 1u;
override KH: u32 = 1u;
override KW: u32 = 1u;
override SH: u32 = 1u;
override SW: u32 = 1u;
override PH: u32 = 0u;
override PW: u32 = 0u;
override OH: u32 = 1u;
override OW: u32 = 1u;

@compute @workgroup_size(256)
fn pool_fwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.u0) { return; }
    let x = idx % OW;
    let y = (idx / OW) % OH;
    let plane = idx / (OW * OH);
    let h0 = i32(y * SH) - i32(PH);
    let w0 = i32(x * SW) - i32(PW);
    var best = -3.0e38;
    var arg = 0;
    var sum = 0.0;
    for (var i = 0u; i < KH; i = i + 1u) {
        for (var j = 0u; j < KW; j = j + 1u) {
            let h = h0 + i32(i);
            let w = w0 + i32(j);
            var v = 0.0;
            let inside = h >= 0 && h < i32(H) && w >= 0 && w < i32(W);
            if (inside) { v = src[p.u1 + (plane * H + u32(h)) * W + u32(w)]; }
            if (IS_MAX) {
                if (inside && v > best) { best = v; arg = i32(i * KW + j); }
            } else {
                sum = sum + v;
            }
        }
    }
    if (IS_MAX) {
        dst[p.u2 + idx] = best;
        mask[p.u3 + idx] = arg;
    } else {
        dst[p.u2 + idx] = sum / f32(KH * KW);
    }
}

// one thread per input element: the sum over the windows that contain it (a gather: no atomics)
@compute @workgroup_size(256)
fn pool_bwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.u0) { return; }
    let w = idx % W;
    let h = (idx / W) % H;
    let plane = idx / (W * H);
    var s = 0.0;
    for (var i = 0u; i < KH; i = i + 1u) {
        let ty = i32(h + PH) - i32(i);
        if (ty < 0 || (u32(ty) % SH) != 0u) { continue; }
        let y = u32(ty) / SH;
        if (y >= OH) { continue; }
        for (var j = 0u; j < KW; j = j + 1u) {
            let tx = i32(w + PW) - i32(j);
            if (tx < 0 || (u32(tx) % SW) != 0u) { continue; }
            let x = u32(tx) / SW;
            if (x >= OW) { continue; }
            let o = (plane * OH + y) * OW + x;
            if (IS_MAX) {
                if (mask[p.u3 + o] == i32(i * KW + j)) { s = s + src[p.u1 + o]; }
            } else {
                s = s + src[p.u1 + o] / f32(KH * KW);
            }
        }
    }
    dst[p.u2 + idx] = s;
}
