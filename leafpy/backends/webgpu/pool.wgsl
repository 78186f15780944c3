// 2-D pooling over NCHW. u0 = N * C * OH * OW (forward) or N * C * H * W (backward), u1 = H, u2 = W,
// u3 = kh | kw << 16, u4 = sh | sw << 16, u5 = ph | pw << 16, u6 = oh | ow << 16, u7 = 1 for max.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<storage, read_write> mask: array<i32>;

@compute @workgroup_size(256)
fn pool_fwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.u0) { return; }
    let kh = lo(p.u3); let kw = hi(p.u3);
    let oh = lo(p.u6); let ow = hi(p.u6);
    let x = idx % ow;
    let y = (idx / ow) % oh;
    let plane = idx / (ow * oh);
    let h0 = i32(y * lo(p.u4)) - i32(lo(p.u5));
    let w0 = i32(x * hi(p.u4)) - i32(hi(p.u5));
    var best = -3.0e38;
    var arg = 0;
    var sum = 0.0;
    for (var i = 0u; i < kh; i = i + 1u) {
        for (var j = 0u; j < kw; j = j + 1u) {
            let h = h0 + i32(i);
            let w = w0 + i32(j);
            var v = 0.0;
            let inside = h >= 0 && h < i32(p.u1) && w >= 0 && w < i32(p.u2);
            if (inside) { v = src[(plane * p.u1 + u32(h)) * p.u2 + u32(w)]; }
            if (p.u7 == 1u) {
                if (inside && v > best) { best = v; arg = i32(i * kw + j); }
            } else {
                sum = sum + v;
            }
        }
    }
    if (p.u7 == 1u) {
        dst[idx] = best;
        mask[idx] = arg;
    } else {
        dst[idx] = sum / f32(kh * kw);
    }
}

// one thread per input element: the sum over the windows that contain it (a gather: no atomics)
@compute @workgroup_size(256)
fn pool_bwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.u0) { return; }
    let kh = lo(p.u3); let kw = hi(p.u3);
    let sh = lo(p.u4); let sw = hi(p.u4);
    let oh = lo(p.u6); let ow = hi(p.u6);
    let w = idx % p.u2;
    let h = (idx / p.u2) % p.u1;
    let plane = idx / (p.u2 * p.u1);
    var s = 0.0;
    for (var i = 0u; i < kh; i = i + 1u) {
        let ty = i32(h + lo(p.u5)) - i32(i);
        if (ty < 0 || (u32(ty) % sh) != 0u) { continue; }
        let y = u32(ty) / sh;
        if (y >= oh) { continue; }
        for (var j = 0u; j < kw; j = j + 1u) {
            let tx = i32(w + hi(p.u5)) - i32(j);
            if (tx < 0 || (u32(tx) % sw) != 0u) { continue; }
            let x = u32(tx) / sw;
            if (x >= ow) { continue; }
            let o = (plane * oh + y) * ow + x;
            if (p.u7 == 1u) {
                if (mask[o] == i32(i * kw + j)) { s = s + src[o]; }
            } else {
                s = s + src[o] / f32(kh * kw);
            }
        }
    }
    dst[idx] = s;
}
