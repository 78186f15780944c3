// Winograd F(2x2, RxR) for RxR stride-1 convolutions, R = 3 or 5: each 2x2 block of y is A^T [sum over c of
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
// section). Blocks t = (n * TH + by) * TW + bx tile y (TH = ceil(OH / 2), TW = ceil(OW / 2)), counted from sample
// u2; the patch of block (by, bx) starts at row 2 by - PH, column 2 bx - PW of x, zero outside it. x has CONV_C
// channels of IN_H x IN_W, y CONV_O channels of OH x OW. A transformed tile's point is
// stored at xi * u0 + (the thread's index), xi = (R + 1) * row + column.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;

override CONV_C: u32 = 1u;
override CONV_O: u32 = 1u;
override FLIP: bool = false;
override HAS_BIAS: bool = false;
override RELU: bool = false;
override R: u32 = 3u;

// Where a thread's block t (counted from sample u2) lies: its sample, and its top-left output row and column.
struct Block { sample: u32, y: u32, x: u32 }

fn block_at(t: u32) -> Block {
    let tw = (OW + 1u) / 2u;
    let blocks = ((OH + 1u) / 2u) * tw;
    let b = t % blocks;
    return Block(p.u2 + t / blocks, (b / tw) * 2u, (b % tw) * 2u);
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

// One thread per filter w[i / u2][i % u2] of w [u1][u2][3][3] (u0 = u1 * u2 filters). The transformed convolution
// has output channel o = i / u2 and input channel c = i % u2, or with FLIP (the data gradient: x is dy, y is dx,
// through w rotated 180 degrees) the reverse; U is written [xi][o][c].
@compute @workgroup_size(256)
fn winograd_filter(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.u0) { return; }
    var at = i;
    if (FLIP) { at = (i % p.u2) * p.u1 + i / p.u2; }
    if (R == 5u) {
        filter5(i, at);
        return;
    }
    let g0 = filter_row(i * 9u, 0u);
    let g1 = filter_row(i * 9u, 1u);
    let g2 = filter_row(i * 9u, 2u);
    put_row(at, p.u0, 0u, times_gt(g0));
    put_row(at, p.u0, 1u, times_gt(0.5 * (g0 + g1 + g2)));
    put_row(at, p.u0, 2u, times_gt(0.5 * (g0 - g1 + g2)));
    put_row(at, p.u0, 3u, times_gt(g2));
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

// One thread per (channel c, block t): i = c * T + t, u0 = C * T, u1 = T; V[xi][c][t] = dst[xi * u0 + i].
@compute @workgroup_size(256)
fn winograd_input(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.u0) { return; }
    let c = i / p.u1;
    let b = block_at(i % p.u1);
    let y0 = i32(b.y) - i32(PH);
    let x0 = i32(b.x) - i32(PW);
    let plane = (b.sample * CONV_C + c) * IN_H * IN_W;
    if (R == 5u) {
        input5(i, plane, y0, x0);
        return;
    }
    let d0 = patch_row(plane, y0, x0);
    let d1 = patch_row(plane, y0 + 1, x0);
    let d2 = patch_row(plane, y0 + 2, x0);
    let d3 = patch_row(plane, y0 + 3, x0);
    put_row(i, p.u0, 0u, times_b(d0 - d2));
    put_row(i, p.u0, 1u, times_b(d1 + d2));
    put_row(i, p.u0, 2u, times_b(d2 - d1));
    put_row(i, p.u0, 3u, times_b(d1 - d3));
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
    var s = v;
    if (RELU) { s = max(s, 0.0); }
    dst[at + y * OW + x] = s;
}

// One thread per (channel o, block t): i = o * T + t, u0 = O * T, u1 = T; M[xi][o][t] = src[xi * u0 + i].
@compute @workgroup_size(256)
fn winograd_output(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.u0) { return; }
    let o = i / p.u1;
    let b = block_at(i % p.u1);
    let at = (b.sample * CONV_O + o) * OH * OW;
    var bias_o = 0.0;
    if (HAS_BIAS) { bias_o = bias[o]; }
    if (R == 5u) {
        output5(i, at, b.y, b.x, bias_o);
        return;
    }
    let m0 = get_row(i, p.u0, 0u);
    let m1 = get_row(i, p.u0, 1u);
    let m2 = get_row(i, p.u0, 2u);
    let m3 = get_row(i, p.u0, 3u);
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

// One thread per (channel o, block t) of dy (OH x OW, CONV_O channels): i = o * T + t, u0 = O * T, u1 = T;
// Z[xi][o][t] = dst[xi * u0 + i].
@compute @workgroup_size(256)
fn winograd_dy(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.u0) { return; }
    let o = i / p.u1;
    let b = block_at(i % p.u1);
    let plane = (b.sample * CONV_O + o) * OH * OW;
    let top = vec2<f32>(dy_at(plane, b.y, b.x), dy_at(plane, b.y, b.x + 1u));
    let bottom = vec2<f32>(dy_at(plane, b.y + 1u, b.x), dy_at(plane, b.y + 1u, b.x + 1u));
    if (R == 5u) {
        dy5(i, top, bottom);
        return;
    }
    put_row(i, p.u0, 0u, times_at(top));
    put_row(i, p.u0, 1u, times_at(top + bottom));
    put_row(i, p.u0, 2u, times_at(top - bottom));
    put_row(i, p.u0, 3u, times_at(-bottom));
}

// A row s of G^T dU, times G.
fn times_g(s: vec4<f32>) -> vec3<f32> {
    let h = 0.5 * (s.y + s.z);
    return vec3<f32>(s.x + h, 0.5 * (s.y - s.z), h + s.w);
}

// dw[at] = v + beta dw[at] (f0 = beta)
fn put_dw(at: u32, v: f32) {
    var s = v;
    if (p.f0 != 0.0) { s = s + p.f0 * dst[at]; }
    dst[at] = s;
}

// One thread per filter w[o][c]: i = o * C + c, u0 = O * C filters; dU[xi][o][c] = src[xi * u0 + i]; f0 = beta.
@compute @workgroup_size(256)
fn winograd_filter_grad(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.u0) { return; }
    if (R == 5u) {
        filter_grad5(i);
        return;
    }
    let u0 = get_row(i, p.u0, 0u);
    let u1 = get_row(i, p.u0, 1u);
    let u2 = get_row(i, p.u0, 2u);
    let u3 = get_row(i, p.u0, 3u);
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

fn put_six(at: u32, r: u32, v: Six) {
    for (var j = 0u; j < 6u; j = j + 1u) { dst[(6u * r + j) * p.u0 + at] = v[j]; }
}

fn filter5(i: u32, at: u32) {
    var cols: array<Six, 5>;  // G applied to each column of the filter
    for (var b = 0u; b < 5u; b = b + 1u) {
        var col: Five;
        for (var a = 0u; a < 5u; a = a + 1u) {
            var k = i * 25u + a * 5u + b;
            if (FLIP) { k = i * 25u + 24u - a * 5u - b; }
            col[a] = src[k];
        }
        cols[b] = times_g5(col);
    }
    for (var r = 0u; r < 6u; r = r + 1u) {
        put_six(at, r, times_g5(Five(cols[0][r], cols[1][r], cols[2][r], cols[3][r], cols[4][r])));
    }
}

fn input5(i: u32, plane: u32, y0: i32, x0: i32) {
    var cols: array<Six, 6>;  // B^T applied to each column of the patch
    for (var b = 0u; b < 6u; b = b + 1u) {
        var col: Six;
        let x = x0 + i32(b);
        for (var a = 0u; a < 6u; a = a + 1u) {
            let y = y0 + i32(a);
            var v = 0.0;
            if (y >= 0 && y < i32(IN_H) && x >= 0 && x < i32(IN_W)) { v = src[plane + u32(y) * IN_W + u32(x)]; }
            col[a] = v;
        }
        cols[b] = times_bt6(col);
    }
    for (var r = 0u; r < 6u; r = r + 1u) {
        put_six(i, r, times_bt6(Six(cols[0][r], cols[1][r], cols[2][r], cols[3][r], cols[4][r], cols[5][r])));
    }
}

fn output5(i: u32, at: u32, y: u32, x: u32, bias_o: f32) {
    var top: Six;  // the two rows of A^T m
    var bottom: Six;
    for (var b = 0u; b < 6u; b = b + 1u) {
        var col: Six;
        for (var a = 0u; a < 6u; a = a + 1u) { col[a] = src[(6u * a + b) * p.u0 + i]; }
        let v = times_at6(col);
        top[b] = v.x;
        bottom[b] = v.y;
    }
    let y0 = times_at6(top) + bias_o;
    let y1 = times_at6(bottom) + bias_o;
    put_y(at, y, x, y0.x);
    put_y(at, y, x + 1u, y0.y);
    put_y(at, y + 1u, x, y1.x);
    put_y(at, y + 1u, x + 1u, y1.y);
}

fn dy5(i: u32, top: vec2<f32>, bottom: vec2<f32>) {
    let left = times_a6(vec2<f32>(top.x, bottom.x));  // A applied to the block's two columns
    let right = times_a6(vec2<f32>(top.y, bottom.y));
    for (var r = 0u; r < 6u; r = r + 1u) { put_six(i, r, times_a6(vec2<f32>(left[r], right[r]))); }
}

fn filter_grad5(i: u32) {
    var cols: array<Five, 6>;  // G^T applied to each column of dU
    for (var b = 0u; b < 6u; b = b + 1u) {
        var col: Six;
        for (var a = 0u; a < 6u; a = a + 1u) { col[a] = src[(6u * a + b) * p.u0 + i]; }
        cols[b] = times_gt6(col);
    }
    for (var r = 0u; r < 5u; r = r + 1u) {
        let v = times_gt6(Six(cols[0][r], cols[1][r], cols[2][r], cols[3][r], cols[4][r], cols[5][r]));
        for (var c = 0u; c < 5u; c = c + 1u) { put_dw(i * 25u + r * 5u + c, v[c]); }
    }
}
