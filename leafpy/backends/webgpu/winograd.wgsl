// Winograd F(2x2, RxR) for RxR stride-1 convolutions, R = 3 or 5, and F(4x4, 3x3) (BLOCK = 4: the section at the
// end; for it, read 4x4 blocks and 6x6 tiles below): each 2x2 block of y is A^T [sum over c of
// (G g G^T) .* (B^T d B)] A, with g = w[o][c] and d the (R+1)x(R+1) patch of x under the block, so the sum over c
// becomes (R+1)^2 GEMMs (one per point xi of the transformed tile) between transforms:
//   winograd_filter: U[xi][o][c] = (G w[o][c] G^T)[xi]
//   winograd_input:  V[xi][c][t] = (B^T d B)[xi] for block t
//   (GEMM)           M[xi] = U[xi] V[xi], [O x C] times [C x T]
//   winograd_output: y[n][o] at block t = A^T m A (+ bias[o]), m[xi] = M[xi][o][t]
// and for the filter gradient (dL/dU = (A dY A^T) .* V, dL/dg = G^T (dL/dU) G):
//   winograd_dy:          Z[xi][o][t] = (A dy A^T)[xi], dy the 2x2 block t of dy (zero past its edge)
//   (GEMM)                dU[xi] = Z[xi] V[xi]^T, [O x T] times [T x C]
//   winograd_filter_grad: dw[o][c] = G^T dU[.][o][c] G + beta dw[o][c]
// R = 3: B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1], G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1],
// A^T = [1 1 1 0; 0 1 -1 -1]; R = 5: the matrices of the points 0, 1, -1, 2, -2 and infinity (see the F(2x2, 5x5)
// section). Blocks t = (n * TH + by) * TW + bx tile y (TH = ceil(OH / 2), TW = ceil(OW / 2)), counted from
// first_sample; the patch of block (by, bx) starts at row 2 by - PH, column 2 bx - PW of x, zero outside it. x has
// CONV_C channels of IN_H x IN_W, y CONV_O channels of OH x OW. A transformed tile's point is
// stored at xi * count + (the thread's index), xi = (R + 1) * row + column.
struct WinogradParams {
    count: u32,         // threads (also the distance between a transformed tile's points)
    blocks: u32,        // T: the 2x2 blocks of the chunk
    first_sample: u32,  // the chunk's first sample
    w_out: u32,         // winograd_filter: w is [w_out][w_in][R][R]
    w_in: u32,
    beta: f32,          // winograd_filter_grad: dw = the gradient + beta dw
}
@group(0) @binding(0) var<uniform> p: WinogradParams;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;

override CONV_C: u32 = 1u;
override CONV_O: u32 = 1u;
override FLIP: bool = false;
override HAS_BIAS: bool = false;
override R: u32 = 3u;
override BLOCK: u32 = 2u;  // the side of an output block: 2; 4 for F(4x4, 3x3), 3 for F(3x3, 5x5) (see their sections:
                           // the second is generated, sources.winograd_f3x3_5x5)

// F(4x4, 3x3): 6x6 tiles, like F(2x2, 5x5)
fn f43() -> bool { return R == 3u && BLOCK == 4u; }

// Where a thread's block t (counted from first_sample) lies: its sample, and its top-left output row and column.
struct Block { sample: u32, y: u32, x: u32 }

fn block_at(t: u32) -> Block {
    let tw = (OW + BLOCK - 1u) / BLOCK;
    let blocks = ((OH + BLOCK - 1u) / BLOCK) * tw;
    let b = t % blocks;
    return Block(p.first_sample + t / blocks, (b / tw) * BLOCK, (b % tw) * BLOCK);
}

// dst[(4 r + j) * stride + at] = v[j]: row r of a transformed tile
fn put_row(at: u32, stride: u32, r: u32, v: vec4<f32>) {
    dst[(4u * r) * stride + at] = v.x;
    dst[(4u * r + 1u) * stride + at] = v.y;
    dst[(4u * r + 2u) * stride + at] = v.z;
    dst[(4u * r + 3u) * stride + at] = v.w;
}

// Row r of the 3x3 filter at src[base], rotated 180 degrees with FLIP.
fn filter_row(base: u32, r: u32) -> vec3<f32> {
    if (FLIP) { return vec3<f32>(src[base + 8u - 3u * r], src[base + 7u - 3u * r], src[base + 6u - 3u * r]); }
    return vec3<f32>(src[base + 3u * r], src[base + 3u * r + 1u], src[base + 3u * r + 2u]);
}

// A row t of G g, times G^T.
fn times_gt(t: vec3<f32>) -> vec4<f32> {
    return vec4<f32>(t.x, 0.5 * (t.x + t.y + t.z), 0.5 * (t.x - t.y + t.z), t.z);
}

// One thread per filter w[i / w_in][i % w_in] of w [w_out][w_in][R][R] (count = w_out * w_in filters). The
// transformed convolution has output channel o = i / w_in and input channel c = i % w_in, or with FLIP (the data
// gradient: x is dy, y is dx, through w rotated 180 degrees) the reverse; U is written [xi][o][c].
@compute @workgroup_size(256)
fn winograd_filter(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    var at = i;
    if (FLIP) { at = (i % p.w_in) * p.w_out + i / p.w_in; }
    if (R == 5u && BLOCK == 3u) {
        filter35(i, at);
        return;
    }
    if (R == 5u) {
        filter5(i, at);
        return;
    }
    if (f43()) {
        filter43(i, at);
        return;
    }
    let g0 = filter_row(i * 9u, 0u);
    let g1 = filter_row(i * 9u, 1u);
    let g2 = filter_row(i * 9u, 2u);
    put_row(at, p.count, 0u, times_gt(g0));
    put_row(at, p.count, 1u, times_gt(0.5 * (g0 + g1 + g2)));
    put_row(at, p.count, 2u, times_gt(0.5 * (g0 - g1 + g2)));
    put_row(at, p.count, 3u, times_gt(g2));
}

fn x_at(row: u32, x: i32) -> f32 {
    if (x < 0 || x >= i32(IN_W)) { return 0.0; }
    return src[row + u32(x)];
}

// Four values of row y of the plane at src[plane], from column x0.
fn patch_row(plane: u32, y: i32, x0: i32) -> vec4<f32> {
    if (y < 0 || y >= i32(IN_H)) { return vec4<f32>(0.0); }
    let row = plane + u32(y) * IN_W;
    return vec4<f32>(x_at(row, x0), x_at(row, x0 + 1), x_at(row, x0 + 2), x_at(row, x0 + 3));
}

// A row r of B^T d, times B.
fn times_b(r: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(r.x - r.z, r.y + r.z, r.z - r.y, r.y - r.w);
}

// One thread per (channel c, block t): i = c * T + t, count = C * T, blocks = T; V[xi][c][t] = dst[xi * count + i].
@compute @workgroup_size(256)
fn winograd_input(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let c = i / p.blocks;
    let b = block_at(i % p.blocks);
    let y0 = i32(b.y) - i32(PH);
    let x0 = i32(b.x) - i32(PW);
    let plane = (b.sample * CONV_C + c) * IN_H * IN_W;
    if (R == 5u && BLOCK == 3u) {
        input35(i, plane, y0, x0);
        return;
    }
    if (R == 5u || f43()) {  // the same 6x6 B^T
        input5(i, plane, y0, x0);
        return;
    }
    let d0 = patch_row(plane, y0, x0);
    let d1 = patch_row(plane, y0 + 1, x0);
    let d2 = patch_row(plane, y0 + 2, x0);
    let d3 = patch_row(plane, y0 + 3, x0);
    put_row(i, p.count, 0u, times_b(d0 - d2));
    put_row(i, p.count, 1u, times_b(d1 + d2));
    put_row(i, p.count, 2u, times_b(d2 - d1));
    put_row(i, p.count, 3u, times_b(d1 - d3));
}

// Row r of a transformed tile: src[(4 r + j) * stride + at], j = 0..3.
fn get_row(at: u32, stride: u32, r: u32) -> vec4<f32> {
    return vec4<f32>(src[(4u * r) * stride + at], src[(4u * r + 1u) * stride + at],
                     src[(4u * r + 2u) * stride + at], src[(4u * r + 3u) * stride + at]);
}

// A row s of A^T m, times A.
fn times_a(s: vec4<f32>) -> vec2<f32> {
    return vec2<f32>(s.x + s.y + s.z, s.y - s.z - s.w);
}

fn put_y(at: u32, y: u32, x: u32, v: f32) {
    if (y >= OH || x >= OW) { return; }
    dst[at + y * OW + x] = act_epilogue(v);  // an activation run in place on y (ACT, generated)
}

// One thread per (channel o, block t): i = o * T + t, count = O * T, blocks = T; M[xi][o][t] = src[xi * count + i].
@compute @workgroup_size(256)
fn winograd_output(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let o = i / p.blocks;
    let b = block_at(i % p.blocks);
    let at = (b.sample * CONV_O + o) * OH * OW;
    var bias_o = 0.0;
    if (HAS_BIAS) { bias_o = bias[o]; }
    if (R == 5u && BLOCK == 3u) {
        output35(i, at, b.y, b.x, bias_o);
        return;
    }
    if (R == 5u) {
        output5(i, at, b.y, b.x, bias_o);
        return;
    }
    if (f43()) {
        output43(i, at, b.y, b.x, bias_o);
        return;
    }
    let m0 = get_row(i, p.count, 0u);
    let m1 = get_row(i, p.count, 1u);
    let m2 = get_row(i, p.count, 2u);
    let m3 = get_row(i, p.count, 3u);
    let top = times_a(m0 + m1 + m2) + bias_o;
    let bottom = times_a(m1 - m2 - m3) + bias_o;
    put_y(at, b.y, b.x, top.x);
    put_y(at, b.y, b.x + 1u, top.y);
    put_y(at, b.y + 1u, b.x, bottom.x);
    put_y(at, b.y + 1u, b.x + 1u, bottom.y);
}

fn dy_at(plane: u32, y: u32, x: u32) -> f32 {
    if (y >= OH || x >= OW) { return 0.0; }
    return src[plane + y * OW + x];
}

// A row (a, b) of A dy, times A^T.
fn times_at(r: vec2<f32>) -> vec4<f32> {
    return vec4<f32>(r.x, r.x + r.y, r.x - r.y, -r.y);
}

// One thread per (channel o, block t) of dy (OH x OW, CONV_O channels): i = o * T + t, count = O * T,
// blocks = T; Z[xi][o][t] = dst[xi * count + i].
@compute @workgroup_size(256)
fn winograd_dy(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let o = i / p.blocks;
    let b = block_at(i % p.blocks);
    let plane = (b.sample * CONV_O + o) * OH * OW;
    if (f43()) {
        dy43(i, plane, b.y, b.x);
        return;
    }
    if (R == 5u && BLOCK == 3u) {
        dy35(i, plane, b.y, b.x);
        return;
    }
    let top = vec2<f32>(dy_at(plane, b.y, b.x), dy_at(plane, b.y, b.x + 1u));
    let bottom = vec2<f32>(dy_at(plane, b.y + 1u, b.x), dy_at(plane, b.y + 1u, b.x + 1u));
    if (R == 5u) {
        dy5(i, top, bottom);
        return;
    }
    put_row(i, p.count, 0u, times_at(top));
    put_row(i, p.count, 1u, times_at(top + bottom));
    put_row(i, p.count, 2u, times_at(top - bottom));
    put_row(i, p.count, 3u, times_at(-bottom));
}

// A row s of G^T dU, times G.
fn times_g(s: vec4<f32>) -> vec3<f32> {
    let h = 0.5 * (s.y + s.z);
    return vec3<f32>(s.x + h, 0.5 * (s.y - s.z), h + s.w);
}

// dw[at] = v + beta dw[at]
fn put_dw(at: u32, v: f32) {
    var s = v;
    if (p.beta != 0.0) { s = s + p.beta * dst[at]; }
    dst[at] = s;
}

// One thread per filter w[o][c]: i = o * C + c, count = O * C filters; dU[xi][o][c] = src[xi * count + i].
@compute @workgroup_size(256)
fn winograd_filter_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    if (R == 5u && BLOCK == 3u) {
        filter_grad35(i);
        return;
    }
    if (R == 5u) {
        filter_grad5(i);
        return;
    }
    if (f43()) {
        filter_grad43(i);
        return;
    }
    let u0 = get_row(i, p.count, 0u);
    let u1 = get_row(i, p.count, 1u);
    let u2 = get_row(i, p.count, 2u);
    let u3 = get_row(i, p.count, 3u);
    let h = 0.5 * (u1 + u2);
    let rows = array<vec3<f32>, 3>(times_g(u0 + h), times_g(0.5 * (u1 - u2)), times_g(h + u3));
    for (var r = 0u; r < 3u; r = r + 1u) {
        for (var j = 0u; j < 3u; j = j + 1u) {
            put_dw(i * 9u + r * 3u + j, rows[r][j]);
        }
    }
}

// --- F(2x2, 5x5): 6x6 tiles. B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0;
// 0 4 0 -5 0 1], G = [1/4 0 0 0 0; -1/6 -1/6 -1/6 -1/6 -1/6; -1/6 1/6 -1/6 1/6 -1/6; 1/24 1/12 1/6 1/3 2/3;
// 1/24 -1/12 1/6 -1/3 2/3; 0 0 0 0 1], A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 1]. Each transform applies its matrix to
// the tile's columns, then to its rows.
alias Six = array<f32, 6>;
alias Five = array<f32, 5>;

fn times_bt6(a: Six) -> Six {
    return Six(4.0 * a[0] - 5.0 * a[2] + a[4], a[3] + a[4] - 4.0 * (a[1] + a[2]), 4.0 * (a[1] - a[2]) - a[3] + a[4],
               2.0 * (a[3] - a[1]) - a[2] + a[4], 2.0 * (a[1] - a[3]) - a[2] + a[4], 4.0 * a[1] - 5.0 * a[3] + a[5]);
}

fn times_g5(v: Five) -> Six {
    let e = v[0] + v[2] + v[4];
    let o = v[1] + v[3];
    let e4 = v[0] + 4.0 * v[2] + 16.0 * v[4];
    let o4 = 2.0 * v[1] + 8.0 * v[3];
    return Six(0.25 * v[0], -(e + o) / 6.0, (o - e) / 6.0, (e4 + o4) / 24.0, (e4 - o4) / 24.0, v[4]);
}

fn times_at6(a: Six) -> vec2<f32> {
    return vec2<f32>(a[0] + a[1] + a[2] + a[3] + a[4], a[1] - a[2] + 2.0 * (a[3] - a[4]) + a[5]);
}

// A times a column (p, q) of two.
fn times_a6(v: vec2<f32>) -> Six {
    return Six(v.x, v.x + v.y, v.x - v.y, v.x + 2.0 * v.y, v.x - 2.0 * v.y, v.y);
}

fn times_gt6(u: Six) -> Five {
    let s = u[1] + u[2];
    let d = u[1] - u[2];
    let s2 = u[3] + u[4];
    let d2 = u[3] - u[4];
    return Five(0.25 * u[0] - s / 6.0 + s2 / 24.0, d2 / 12.0 - d / 6.0, (s2 - s) / 6.0, d2 / 3.0 - d / 6.0,
                2.0 * s2 / 3.0 - s / 6.0 + u[5]);
}

// Every 6-point loop below is written out: arrays indexed by a loop counter may be placed in slow local memory.
fn put_six(at: u32, r: u32, v: Six) {
    let base = 6u * r * p.count + at;
    dst[base] = v[0];
    dst[base + p.count] = v[1];
    dst[base + 2u * p.count] = v[2];
    dst[base + 3u * p.count] = v[3];
    dst[base + 4u * p.count] = v[4];
    dst[base + 5u * p.count] = v[5];
}

// Column b of a 6x6 tile: src[(6 a + b) * count + at], a = 0..5.
fn tile_col(at: u32, b: u32) -> Six {
    let s = p.count * 6u;
    let base = b * p.count + at;
    return Six(src[base], src[base + s], src[base + 2u * s], src[base + 3u * s], src[base + 4u * s], src[base + 5u * s]);
}

// Column b of the (flipped) 5x5 filter at src[base].
fn filter_col(base: u32, b: u32) -> Five {
    if (FLIP) {
        let e = base + 24u - b;
        return Five(src[e], src[e - 5u], src[e - 10u], src[e - 15u], src[e - 20u]);
    }
    return Five(src[base + b], src[base + 5u + b], src[base + 10u + b], src[base + 15u + b], src[base + 20u + b]);
}

fn filter5(i: u32, at: u32) {
    let c0 = times_g5(filter_col(i * 25u, 0u));  // G applied to each column of the filter
    let c1 = times_g5(filter_col(i * 25u, 1u));
    let c2 = times_g5(filter_col(i * 25u, 2u));
    let c3 = times_g5(filter_col(i * 25u, 3u));
    let c4 = times_g5(filter_col(i * 25u, 4u));
    put_six(at, 0u, times_g5(Five(c0[0], c1[0], c2[0], c3[0], c4[0])));
    put_six(at, 1u, times_g5(Five(c0[1], c1[1], c2[1], c3[1], c4[1])));
    put_six(at, 2u, times_g5(Five(c0[2], c1[2], c2[2], c3[2], c4[2])));
    put_six(at, 3u, times_g5(Five(c0[3], c1[3], c2[3], c3[3], c4[3])));
    put_six(at, 4u, times_g5(Five(c0[4], c1[4], c2[4], c3[4], c4[4])));
    put_six(at, 5u, times_g5(Five(c0[5], c1[5], c2[5], c3[5], c4[5])));
}

// Column x of the patch: rows y0 .. y0 + 5 of the plane, zero outside it.
fn patch_col(plane: u32, y0: i32, x: i32) -> Six {
    if (x < 0 || x >= i32(IN_W)) { return Six(0.0, 0.0, 0.0, 0.0, 0.0, 0.0); }
    let at = i32(plane) + y0 * i32(IN_W) + x;
    let w = i32(IN_W);
    return Six(x_row(at, y0), x_row(at + w, y0 + 1), x_row(at + 2 * w, y0 + 2), x_row(at + 3 * w, y0 + 3),
               x_row(at + 4 * w, y0 + 4), x_row(at + 5 * w, y0 + 5));
}

fn x_row(at: i32, y: i32) -> f32 {
    if (y < 0 || y >= i32(IN_H)) { return 0.0; }
    return src[u32(at)];
}

fn input5(i: u32, plane: u32, y0: i32, x0: i32) {
    let c0 = times_bt6(patch_col(plane, y0, x0));  // B^T applied to each column of the patch
    let c1 = times_bt6(patch_col(plane, y0, x0 + 1));
    let c2 = times_bt6(patch_col(plane, y0, x0 + 2));
    let c3 = times_bt6(patch_col(plane, y0, x0 + 3));
    let c4 = times_bt6(patch_col(plane, y0, x0 + 4));
    let c5 = times_bt6(patch_col(plane, y0, x0 + 5));
    put_six(i, 0u, times_bt6(Six(c0[0], c1[0], c2[0], c3[0], c4[0], c5[0])));
    put_six(i, 1u, times_bt6(Six(c0[1], c1[1], c2[1], c3[1], c4[1], c5[1])));
    put_six(i, 2u, times_bt6(Six(c0[2], c1[2], c2[2], c3[2], c4[2], c5[2])));
    put_six(i, 3u, times_bt6(Six(c0[3], c1[3], c2[3], c3[3], c4[3], c5[3])));
    put_six(i, 4u, times_bt6(Six(c0[4], c1[4], c2[4], c3[4], c4[4], c5[4])));
    put_six(i, 5u, times_bt6(Six(c0[5], c1[5], c2[5], c3[5], c4[5], c5[5])));
}

fn output5(i: u32, at: u32, y: u32, x: u32, bias_o: f32) {
    let c0 = times_at6(tile_col(i, 0u));  // A^T applied to each column of m: (top, bottom)
    let c1 = times_at6(tile_col(i, 1u));
    let c2 = times_at6(tile_col(i, 2u));
    let c3 = times_at6(tile_col(i, 3u));
    let c4 = times_at6(tile_col(i, 4u));
    let c5 = times_at6(tile_col(i, 5u));
    let y0 = times_at6(Six(c0.x, c1.x, c2.x, c3.x, c4.x, c5.x)) + bias_o;
    let y1 = times_at6(Six(c0.y, c1.y, c2.y, c3.y, c4.y, c5.y)) + bias_o;
    put_y(at, y, x, y0.x);
    put_y(at, y, x + 1u, y0.y);
    put_y(at, y + 1u, x, y1.x);
    put_y(at, y + 1u, x + 1u, y1.y);
}

fn dy5(i: u32, top: vec2<f32>, bottom: vec2<f32>) {
    let l = times_a6(vec2<f32>(top.x, bottom.x));  // A applied to the block's two columns
    let r = times_a6(vec2<f32>(top.y, bottom.y));
    put_six(i, 0u, times_a6(vec2<f32>(l[0], r[0])));
    put_six(i, 1u, times_a6(vec2<f32>(l[1], r[1])));
    put_six(i, 2u, times_a6(vec2<f32>(l[2], r[2])));
    put_six(i, 3u, times_a6(vec2<f32>(l[3], r[3])));
    put_six(i, 4u, times_a6(vec2<f32>(l[4], r[4])));
    put_six(i, 5u, times_a6(vec2<f32>(l[5], r[5])));
}

fn put_dw_row(at: u32, v: Five) {
    put_dw(at, v[0]);
    put_dw(at + 1u, v[1]);
    put_dw(at + 2u, v[2]);
    put_dw(at + 3u, v[3]);
    put_dw(at + 4u, v[4]);
}

fn filter_grad5(i: u32) {
    let c0 = times_gt6(tile_col(i, 0u));  // G^T applied to each column of dU
    let c1 = times_gt6(tile_col(i, 1u));
    let c2 = times_gt6(tile_col(i, 2u));
    let c3 = times_gt6(tile_col(i, 3u));
    let c4 = times_gt6(tile_col(i, 4u));
    let c5 = times_gt6(tile_col(i, 5u));
    put_dw_row(i * 25u, times_gt6(Six(c0[0], c1[0], c2[0], c3[0], c4[0], c5[0])));
    put_dw_row(i * 25u + 5u, times_gt6(Six(c0[1], c1[1], c2[1], c3[1], c4[1], c5[1])));
    put_dw_row(i * 25u + 10u, times_gt6(Six(c0[2], c1[2], c2[2], c3[2], c4[2], c5[2])));
    put_dw_row(i * 25u + 15u, times_gt6(Six(c0[3], c1[3], c2[3], c3[3], c4[3], c5[3])));
    put_dw_row(i * 25u + 20u, times_gt6(Six(c0[4], c1[4], c2[4], c3[4], c4[4], c5[4])));
}

// --- F(4x4, 3x3): 6x6 tiles over 4x4 output blocks (BLOCK = 4), the points of F(2x2, 5x5): B^T as there,
// G = [1/4 0 0; -1/6 -1/6 -1/6; -1/6 1/6 -1/6; 1/24 1/12 1/6; 1/24 -1/12 1/6; 0 0 1],
// A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1]. A quarter fewer tile points than F(2x2, 3x3) per
// output where the output's side is a multiple of 4 (9 instead of 16 per 2x2 of output; 13x13: 576 against 784).
fn times_g3(v: vec3<f32>) -> Six {
    let e = v.x + v.z;
    let e4 = v.x + 4.0 * v.z;
    return Six(0.25 * v.x, -(e + v.y) / 6.0, (v.y - e) / 6.0, (e4 + 2.0 * v.y) / 24.0, (e4 - 2.0 * v.y) / 24.0, v.z);
}

fn times_at4(a: Six) -> vec4<f32> {
    let s = a[1] + a[2];
    let d = a[1] - a[2];
    let s2 = a[3] + a[4];
    let d2 = a[3] - a[4];
    return vec4<f32>(a[0] + s + s2, d + 2.0 * d2, s + 4.0 * s2, d + 8.0 * d2 + a[5]);
}

// A times a column of four.
fn times_a4(v: vec4<f32>) -> Six {
    let e = v.x + v.z;
    let o = v.y + v.w;
    let e4 = v.x + 4.0 * v.z;
    let o4 = 2.0 * v.y + 8.0 * v.w;
    return Six(v.x, e + o, e - o, e4 + o4, e4 - o4, v.w);
}

fn times_gt3(u: Six) -> vec3<f32> {
    let s = u[1] + u[2];
    let d = u[2] - u[1];
    let s2 = u[3] + u[4];
    return vec3<f32>(0.25 * u[0] - s / 6.0 + s2 / 24.0, d / 6.0 + (u[3] - u[4]) / 12.0, (s2 - s) / 6.0 + u[5]);
}

fn filter43(i: u32, at: u32) {
    let g0 = filter_row(i * 9u, 0u);
    let g1 = filter_row(i * 9u, 1u);
    let g2 = filter_row(i * 9u, 2u);
    let c0 = times_g3(vec3<f32>(g0.x, g1.x, g2.x));  // G applied to each column of the filter
    let c1 = times_g3(vec3<f32>(g0.y, g1.y, g2.y));
    let c2 = times_g3(vec3<f32>(g0.z, g1.z, g2.z));
    put_six(at, 0u, times_g3(vec3<f32>(c0[0], c1[0], c2[0])));
    put_six(at, 1u, times_g3(vec3<f32>(c0[1], c1[1], c2[1])));
    put_six(at, 2u, times_g3(vec3<f32>(c0[2], c1[2], c2[2])));
    put_six(at, 3u, times_g3(vec3<f32>(c0[3], c1[3], c2[3])));
    put_six(at, 4u, times_g3(vec3<f32>(c0[4], c1[4], c2[4])));
    put_six(at, 5u, times_g3(vec3<f32>(c0[5], c1[5], c2[5])));
}

fn put_y4(at: u32, y: u32, x: u32, v: vec4<f32>) {
    put_y(at, y, x, v.x);
    put_y(at, y, x + 1u, v.y);
    put_y(at, y, x + 2u, v.z);
    put_y(at, y, x + 3u, v.w);
}

fn output43(i: u32, at: u32, y: u32, x: u32, bias_o: f32) {
    let c0 = times_at4(tile_col(i, 0u));  // A^T applied to each column of m: its four rows
    let c1 = times_at4(tile_col(i, 1u));
    let c2 = times_at4(tile_col(i, 2u));
    let c3 = times_at4(tile_col(i, 3u));
    let c4 = times_at4(tile_col(i, 4u));
    let c5 = times_at4(tile_col(i, 5u));
    put_y4(at, y, x, times_at4(Six(c0.x, c1.x, c2.x, c3.x, c4.x, c5.x)) + bias_o);
    put_y4(at, y + 1u, x, times_at4(Six(c0.y, c1.y, c2.y, c3.y, c4.y, c5.y)) + bias_o);
    put_y4(at, y + 2u, x, times_at4(Six(c0.z, c1.z, c2.z, c3.z, c4.z, c5.z)) + bias_o);
    put_y4(at, y + 3u, x, times_at4(Six(c0.w, c1.w, c2.w, c3.w, c4.w, c5.w)) + bias_o);
}

// Column x of dy's 4x4 block at rows y .. y + 3 (zero past dy's edge).
fn dy_col4(plane: u32, y: u32, x: u32) -> vec4<f32> {
    return vec4<f32>(dy_at(plane, y, x), dy_at(plane, y + 1u, x), dy_at(plane, y + 2u, x), dy_at(plane, y + 3u, x));
}

fn dy43(i: u32, plane: u32, y: u32, x: u32) {
    let c0 = times_a4(dy_col4(plane, y, x));  // A applied to the block's four columns
    let c1 = times_a4(dy_col4(plane, y, x + 1u));
    let c2 = times_a4(dy_col4(plane, y, x + 2u));
    let c3 = times_a4(dy_col4(plane, y, x + 3u));
    put_six(i, 0u, times_a4(vec4<f32>(c0[0], c1[0], c2[0], c3[0])));
    put_six(i, 1u, times_a4(vec4<f32>(c0[1], c1[1], c2[1], c3[1])));
    put_six(i, 2u, times_a4(vec4<f32>(c0[2], c1[2], c2[2], c3[2])));
    put_six(i, 3u, times_a4(vec4<f32>(c0[3], c1[3], c2[3], c3[3])));
    put_six(i, 4u, times_a4(vec4<f32>(c0[4], c1[4], c2[4], c3[4])));
    put_six(i, 5u, times_a4(vec4<f32>(c0[5], c1[5], c2[5], c3[5])));
}

fn filter_grad43(i: u32) {
    let c0 = times_gt3(tile_col(i, 0u));  // G^T applied to each column of dU
    let c1 = times_gt3(tile_col(i, 1u));
    let c2 = times_gt3(tile_col(i, 2u));
    let c3 = times_gt3(tile_col(i, 3u));
    let c4 = times_gt3(tile_col(i, 4u));
    let c5 = times_gt3(tile_col(i, 5u));
    let rows = array<vec3<f32>, 3>(times_gt3(Six(c0.x, c1.x, c2.x, c3.x, c4.x, c5.x)),
                                   times_gt3(Six(c0.y, c1.y, c2.y, c3.y, c4.y, c5.y)),
                                   times_gt3(Six(c0.z, c1.z, c2.z, c3.z, c4.z, c5.z)));
    for (var r = 0u; r < 3u; r = r + 1u) {
        for (var j = 0u; j < 3u; j = j + 1u) {
            put_dw(i * 9u + r * 3u + j, rows[r][j]);
        }
    }
}
