// Convolution layout kernels for im2col + GEMM, over a chunk of the batch [n0, n0 + nc).
// Geometry in q: (C, H, W), (kh, kw), (sh, sw), (ph, pw), (oh, ow) packed into the Params integers and floats:
// u0 = element count of the launch, u1 = C, u2 = H, u3 = W, u4 = kh | kw << 16, u5 = sh | sw << 16,
// u6 = ph | pw << 16, u7 = oh | ow << 16; f0 = n0, f1 = nc, f2 = O (channels of y/dy).
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

// cols[(c * kh + i) * kw + j][nl * P + y * ow + x] = x_padded[n0 + nl][c][y * sh + i - ph][x * sw + j - pw]
@compute @workgroup_size(256)
fn im2col(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.u0) { return; }
    let kh = lo(p.u4); let kw = hi(p.u4);
    let oh = lo(p.u7); let ow = hi(p.u7);
    let P = oh * ow;
    let nc = u32(p.f1);
    let cols = nc * P;
    let row = idx / cols;
    let col = idx % cols;
    let c = row / (kh * kw);
    let i = (row / kw) % kh;
    let j = row % kw;
    let nl = col / P;
    let y = (col % P) / ow;
    let x = col % ow;
    let hy = i32(y * lo(p.u5) + i) - i32(lo(p.u6));
    let wx = i32(x * hi(p.u5) + j) - i32(hi(p.u6));
    var v = 0.0;
    if (hy >= 0 && hy < i32(p.u2) && wx >= 0 && wx < i32(p.u3)) {
        let n = u32(p.f0) + nl;
        v = src[((n * p.u1 + c) * p.u2 + u32(hy)) * p.u3 + u32(wx)];
    }
    dst[idx] = v;
}

// dx[n0 + nl][c][h][w] = sum of dcols over every (i, j, y, x) that im2col read (h, w) from (a gather: no atomics)
@compute @workgroup_size(256)
fn col2im(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.u0) { return; }
    let kh = lo(p.u4); let kw = hi(p.u4);
    let sh = lo(p.u5); let sw = hi(p.u5);
    let ph = lo(p.u6); let pw = hi(p.u6);
    let oh = lo(p.u7); let ow = hi(p.u7);
    let P = oh * ow;
    let cols = u32(p.f1) * P;
    let w = idx % p.u3;
    let h = (idx / p.u3) % p.u2;
    let c = (idx / (p.u3 * p.u2)) % p.u1;
    let nl = idx / (p.u3 * p.u2 * p.u1);
    var s = 0.0;
    for (var i = 0u; i < kh; i = i + 1u) {
        let ty = i32(h + ph) - i32(i);
        if (ty < 0 || (u32(ty) % sh) != 0u) { continue; }
        let y = u32(ty) / sh;
        if (y >= oh) { continue; }
        for (var j = 0u; j < kw; j = j + 1u) {
            let tx = i32(w + pw) - i32(j);
            if (tx < 0 || (u32(tx) % sw) != 0u) { continue; }
            let x = u32(tx) / sw;
            if (x >= ow) { continue; }
            s = s + src[((c * kh + i) * kw + j) * cols + nl * P + y * ow + x];
        }
    }
    let n = u32(p.f0) + nl;
    dst[((n * p.u1 + c) * p.u2 + h) * p.u3 + w] = s;
}

// between the GEMM layout [O][nc * P] and NCHW for samples n0.. n0 + nc; f3 = 0: GEMM -> NCHW (outputs),
// f3 = 1: NCHW -> GEMM (output gradients). u0 = nc * O * P
@compute @workgroup_size(256)
fn relayout(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.u0) { return; }
    let P = lo(p.u7) * hi(p.u7);
    let O = u32(p.f2);
    let nc = u32(p.f1);
    let q = idx % P;
    let o = (idx / P) % O;
    let nl = idx / (P * O);
    let gemm = o * nc * P + nl * P + q;
    let nchw = ((u32(p.f0) + nl) * O + o) * P + q;
    if (p.f3 == 0.0) { dst[nchw] = src[gemm]; } else { dst[gemm] = src[nchw]; }
}
