// Direct convolution for what the implicit GEMM, im2col and Winograd paths do not take: grouped (depthwise
// included), dilated, and padded differently after than before. One thread per element written: the output
// (forward), the input gradient (a gather over the windows that read it: no atomics) or the filter gradient (a sum
// over the batch and output positions). The geometry is pipeline constants; the padding after each dimension is
// implied by the output's size.
struct DirectParams {
    count: u32,   // threads of the launch
    beta: f32,    // filter gradient: dw = sum + beta * dw
}
@group(0) @binding(0) var<uniform> p: DirectParams;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;

// IN_H, IN_W, KH, KW, SH, SW, PH, PW, OH, OW: window.wgsl's; besides them
override BATCH: u32 = 1u;
override C_IN: u32 = 1u;
override C_OUT: u32 = 1u;
override GROUPS: u32 = 1u;
override DH: u32 = 1u;
override DW: u32 = 1u;

// y[n][o][y][x] = sum over the group's channels and taps of x[n][c][y SH + i DH - PH][x SW + j DW - PW] w[o][c][i][j]
// (a: x, b: w, dst: y)
@compute @workgroup_size(256)
fn direct_fwd(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.count) { return; }
    let ox = idx % OW;
    let oy = (idx / OW) % OH;
    let o = (idx / (OW * OH)) % C_OUT;
    let n = idx / (OW * OH * C_OUT);
    let cg = C_IN / GROUPS;
    let c0 = (o / (C_OUT / GROUPS)) * cg;
    var s = 0.0;
    for (var c = 0u; c < cg; c = c + 1u) {
        let xbase = (n * C_IN + c0 + c) * IN_H;
        let wbase = (o * cg + c) * KH;
        for (var i = 0u; i < KH; i = i + 1u) {
            let h = i32(oy * SH + i * DH) - i32(PH);
            if (h < 0 || h >= i32(IN_H)) { continue; }
            for (var j = 0u; j < KW; j = j + 1u) {
                let w = i32(ox * SW + j * DW) - i32(PW);
                if (w < 0 || w >= i32(IN_W)) { continue; }
                s = s + a[(xbase + u32(h)) * IN_W + u32(w)] * b[(wbase + i) * KW + j];
            }
        }
    }
    dst[idx] = s;
}

// dx[n][c][h][w] = sum over the outputs of c's group and the taps whose window reads (h, w) of dy w
// (a: dy, b: w, dst: dx)
@compute @workgroup_size(256)
fn direct_data(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.count) { return; }
    let w = idx % IN_W;
    let h = (idx / IN_W) % IN_H;
    let c = (idx / (IN_W * IN_H)) % C_IN;
    let n = idx / (IN_W * IN_H * C_IN);
    let cg = C_IN / GROUPS;
    let og = C_OUT / GROUPS;
    let g = c / cg;
    var s = 0.0;
    for (var i = 0u; i < KH; i = i + 1u) {
        let th = i32(h + PH) - i32(i * DH);
        if (th < 0 || u32(th) % SH != 0u || u32(th) / SH >= OH) { continue; }
        let oy = u32(th) / SH;
        for (var j = 0u; j < KW; j = j + 1u) {
            let tw = i32(w + PW) - i32(j * DW);
            if (tw < 0 || u32(tw) % SW != 0u || u32(tw) / SW >= OW) { continue; }
            let ox = u32(tw) / SW;
            for (var q = 0u; q < og; q = q + 1u) {
                let o = g * og + q;
                s = s + a[((n * C_OUT + o) * OH + oy) * OW + ox] * b[((o * cg + c - g * cg) * KH + i) * KW + j];
            }
        }
    }
    dst[idx] = s;
}

// dw[o][c][i][j] = sum over the batch and output positions of dy[n][o][y][x] x[n][group's c][window tap] + beta dw
// (a: x, b: dy, dst: dw)
@compute @workgroup_size(256)
fn direct_filter(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.count) { return; }
    let cg = C_IN / GROUPS;
    let j = idx % KW;
    let i = (idx / KW) % KH;
    let cl = (idx / (KW * KH)) % cg;
    let o = idx / (KW * KH * cg);
    let c = (o / (C_OUT / GROUPS)) * cg + cl;
    var s = 0.0;
    for (var n = 0u; n < BATCH; n = n + 1u) {
        for (var oy = 0u; oy < OH; oy = oy + 1u) {
            let h = i32(oy * SH + i * DH) - i32(PH);
            if (h < 0 || h >= i32(IN_H)) { continue; }
            for (var ox = 0u; ox < OW; ox = ox + 1u) {
                let w = i32(ox * SW + j * DW) - i32(PW);
                if (w < 0 || w >= i32(IN_W)) { continue; }
                s = s + b[((n * C_OUT + o) * OH + oy) * OW + ox] * a[((n * C_IN + c) * IN_H + u32(h)) * IN_W + u32(w)];
            }
        }
    }
    var prev = 0.0;
    if (p.beta != 0.0) { prev = p.beta * dst[idx]; }
    dst[idx] = s + prev;
}
