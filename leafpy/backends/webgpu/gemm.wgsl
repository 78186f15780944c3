// C = alpha * op(A) op(B) + beta * C, row-major, register tiled, in four sizes:
//   gemm:     a 16x16 workgroup computes a 64x64 tile of C (8x8 and 32x32 with TS = 8), each thread a 4x4 block;
//             K in slices of TS;
//   gemm_big: a 16x16 workgroup computes a 128x128 tile, each thread four 4x4 blocks (rows ty*4 and 64 + ty*4,
//             columns tx*4 and 64 + tx*4, so that a warp's workgroup-memory reads do not collide), or with
//             BIG_ROWS = 64 a 64x128 tile, each thread two; K in slices of 8.
// Tiles of A and B are staged in workgroup memory as vec4 along m (A) and n (B), double-buffered; global reads walk
// the stored contiguous dimension, so they coalesce whichever operand is transposed. The transposes are pipeline
// constants.
// C is M x N, the product over K; the parameters:
struct GemmParams {
    m: u32,
    n: u32,
    k: u32,
    first_sample: u32,  // convolution modes: the sample that position 0 is in
    batch: u32,         // BATCHED: the number of products
    a_offset: u32,      // element offsets of A, B and C as bound
    b_offset: u32,
    c_offset: u32,
    k_slice: u32,       // the K range of one z-slice of the grid (split-K: slice z writes its partial product at
                        // C + z * M * N)
    lda: u32,           // row strides of A, B and C as stored (a block of a larger product is bound with its
    ldb: u32,           // parent's strides)
    ldc: u32,
    col0: u32,          // the first column of this dispatch (a product wider than the grid runs as several)
    alpha: f32,
    beta: f32,
}
//
// Convolution as implicit GEMM: pipeline constants describe one convolution's geometry, and the modes read an
// operand or write the product in place of the im2col columns and GEMM-layout matrices (positions
// pos = sample * OH * OW + y * OW + x count from first_sample; ckk = (c * KH + i) * KW + j):
//   A_MODE 1: op(A)[o][pos] = dy in NCHW;
//   B_MODE 1: op(B)[ckk][pos] = the im2col column of x; B_MODE 2: op(B)[pos][ckk] = the same, transposed;
//   B_MODE 3: op(B)[o][pos] = dy in NCHW;
//   C_MODE 1: C[o][pos] is stored to y in NCHW.
// and for the data gradient (positions xpos = sample * H * W + h * W + w of x, okk = (o * KH + i) * KW + j):
//   A_MODE 2: op(A)[c][okk] = w[o][c][i][j];  B_MODE 4: op(B)[okk][xpos] = the dy element that x[xpos] met
//   through w[o][.][i][j] (zero where none);  C_MODE 2: C[c][xpos] is stored to dx in NCHW.
@group(0) @binding(0) var<uniform> p: GemmParams;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;
// Epilogue: with HAS_BIAS, Bias[c] is added to column c of C (a linear layer's bias), or with C_MODE 1 Bias[o] to
// channel o of y (a convolution's); then the activation ACT (act_epilogue, generated from the activations'
// formulas) is applied to what C stores, or with ACT_OUT stored into ActOut beside the unchanged product.
@group(0) @binding(4) var<storage, read> Bias: array<f32>;
@group(0) @binding(5) var<storage, read_write> ActOut: array<f32>;

override TRANS_A: bool = false;
override TRANS_B: bool = false;
override A_MODE: u32 = 0u;
override B_MODE: u32 = 0u;
override C_MODE: u32 = 0u;
override CONV_C: u32 = 1u;
override CONV_O: u32 = 1u;
override HAS_BIAS: bool = false;
override ACT_OUT: bool = false;
// BATCHED: a batch of products of one shape, stored one after another in A, B and C; grid z = split * batch +
// product (C + z * M * N holds product z's result, or with split-K its partial, as in a single product)
override BATCHED: bool = false;
var<private> batch_a: u32 = 0u;  // element offsets of this z's A and B
var<private> batch_b: u32 = 0u;

// offset of (channel ch, position pos) in an NCHW tensor of CONV_O channels over OH x OW
fn nchw_out(ch: u32, pos: u32) -> u32 {
    let P = OH * OW;
    return ((p.first_sample + pos / P) * CONV_O + ch) * P + pos % P;
}

// offset of (channel ch, position pos) in an NCHW tensor shaped like x
fn nchw_in(ch: u32, pos: u32) -> u32 {
    let P = IN_H * IN_W;
    return ((p.first_sample + pos / P) * CONV_C + ch) * P + pos % P;
}

// dy[n][o][y][x] with y * SH + i - PH = h and x * SW + j - PW = w, for okk = (o, i, j) and xpos = (n, h, w)
fn dy_at(okk: u32, xpos: u32) -> f32 {
    let o = okk / (KH * KW);
    let i = (okk / KW) % KH;
    let j = okk % KW;
    let P = IN_H * IN_W;
    let q = xpos % P;
    let y = window_row(q / IN_W, i);
    let x = window_col(q % IN_W, j);
    if (y < 0 || x < 0) { return 0.0; }
    return B[(((p.first_sample + xpos / P) * CONV_O + o) * OH + u32(y)) * OW + u32(x)];
}

fn im2col_at(ckk: u32, pos: u32) -> f32 {
    let P = OH * OW;
    let tap = window_tap(ckk, pos % P);
    if (tap < 0) { return 0.0; }
    return B[(p.first_sample + pos / P) * CONV_C * IN_H * IN_W + u32(tap)];
}

// The filter gradient's gathers (A_MODE 1, B_MODE 2) of a K slice, four positions at a time. A thread fetches
// the same column of op(B) (one (c, i, j)) in every slice, so where it lies in x is worked out once, before the
// K loop (thread_setup). (Doing the same for the four positions of B_MODE 1 and 3 measured slower on an H200: the
// twelve registers it holds through the loop cost more than the divisions it saves.) Lanes outside the product
// or in the padding read index 0 and yield zero.
var<private> g_base: u32;  // c * IN_H * IN_W
var<private> g_y: i32;     // i - PH (far negative past the last column)
var<private> g_x: i32;     // j - PW

// Once per thread, before the K loop: a batched product's offsets and the filter gradient's gather state.
fn thread_setup(g: u32, col0: u32, cols: u32, kt: u32, z: u32) {
    if (BATCHED) {
        batch_a = (z % p.batch) * p.m * p.k;
        batch_b = (z % p.batch) * p.k * p.n;
    }
    if (B_MODE == 2u) {
        let ckk = col0 + g / (kt / 4u);
        let r = ckk % (KH * KW);
        g_base = (ckk / (KH * KW)) * IN_H * IN_W;
        g_y = select(-65536, i32(r / KW) - i32(PH), ckk < p.n);
        g_x = i32(r % KW) - i32(PW);
    }
}

// B_MODE 2: the thread's im2col row at positions pos .. pos + 3
fn gather_taps(pos0: u32, kend: u32) -> vec4<f32> {
    let pos = vec4<u32>(pos0) + vec4<u32>(0u, 1u, 2u, 3u);
    let P = OH * OW;
    let q = pos % vec4<u32>(P);
    let h = vec4<i32>((q / vec4<u32>(OW)) * SH) + g_y;
    let w = vec4<i32>((q % vec4<u32>(OW)) * SW) + g_x;
    let at = (vec4<u32>(p.first_sample) + pos / vec4<u32>(P)) * (CONV_C * IN_H * IN_W) + g_base
        + vec4<u32>(h * i32(IN_W) + w);
    let ok = (vec4<u32>(h) < vec4<u32>(IN_H)) & (vec4<u32>(w) < vec4<u32>(IN_W)) & (pos < vec4<u32>(kend));
    let i = select(vec4<u32>(0u), at, ok);
    return select(vec4<f32>(0.0), vec4<f32>(B[i.x], B[i.y], B[i.z], B[i.w]), ok);
}

// A_MODE 1: dy at channel o and positions pos .. pos + 3
fn gather_dy_rows(o: u32, pos0: u32, kend: u32) -> vec4<f32> {
    let pos = vec4<u32>(pos0) + vec4<u32>(0u, 1u, 2u, 3u);
    let P = OH * OW;
    let at = ((vec4<u32>(p.first_sample) + pos / vec4<u32>(P)) * CONV_O + o) * P + pos % vec4<u32>(P);
    let ok = (pos < vec4<u32>(kend)) & vec4<bool>(o < p.m);
    let i = select(vec4<u32>(0u), at, ok);
    return select(vec4<f32>(0.0), vec4<f32>(A[i.x], A[i.y], A[i.z], A[i.w]), ok);
}

// op(A)[m][k], zero outside [0, M) x [0, kend) (the plain operands and A_MODE 2; A_MODE 1 gathers above)
fn load_a(m: u32, k: u32, kend: u32) -> f32 {
    if (m >= p.m || k >= kend) { return 0.0; }
    if (A_MODE == 2u) { return A[((k / (KH * KW)) * CONV_C + m) * KH * KW + k % (KH * KW)]; }
    if (TRANS_A) { return A[p.a_offset + batch_a + k * p.lda + m]; }
    return A[p.a_offset + batch_a + m * p.lda + k];
}

// op(B)[k][n], zero outside [0, kend) x [0, N) (the plain operands and B_MODE 1, 3 and 4; B_MODE 2 gathers above)
fn load_b(k: u32, n: u32, kend: u32) -> f32 {
    if (k >= kend || n >= p.n) { return 0.0; }
    if (B_MODE == 4u) { return dy_at(k, n); }
    if (B_MODE == 1u) { return im2col_at(k, n); }
    if (B_MODE == 3u) { return B[nchw_out(k, n)]; }
    if (TRANS_B) { return B[p.b_offset + batch_b + n * p.ldb + k]; }
    return B[p.b_offset + batch_b + k * p.ldb + n];
}

fn store_c(r: u32, c: u32, v: f32, z: u32) {
    if (r >= p.m || c >= p.n) { return; }
    var o = p.c_offset + z * p.m * p.n + r * p.ldc + c;
    if (C_MODE == 1u) { o = nchw_out(r, c); }
    if (C_MODE == 2u) { o = nchw_in(r, c); }
    var s = p.alpha * v;
    if (p.beta != 0.0) { s = s + p.beta * C[o]; }
    if (HAS_BIAS) { s = s + Bias[select(c, r, C_MODE == 1u)]; }
    if (ACT_OUT) {
        C[o] = s;
        ActOut[o] = act_epilogue(s);
    } else {
        C[o] = act_epilogue(s);
    }
}

// Two tiles each (double buffering) of TILES / 2 vec4s: 256 (gemm_big, gemm with TS = 16) or 64 (TS = 8: a
// smaller footprint lets more 64-thread workgroups share a multiprocessor). An array sized by an expression of
// overrides (2 * TS * TS) breaks naga 29's specialisation of kernels using other overrides; one override works.
override TILES: u32 = 512u;
var<workgroup> As: array<vec4<f32>, TILES>;  // two tiles of [k][m / 4]: gemm [TS][TS], gemm_big [8][BIG_ROWS / 4]
var<workgroup> Bs: array<vec4<f32>, TILES>;  // two tiles of [k][n / 4]: gemm [TS][TS], gemm_big [8][32]

// Tiles of op(A) (rows x kt at row0, k0) and op(B) (kt x cols at k0, col0) move in groups of four values, one
// group per thread (rows * kt / 4 = the workgroup size in every kernel). Stored transposed (m or n contiguous in
// memory) a group is 4 consecutive m (n); otherwise 4 consecutive k. A thread fetches its groups of the next K
// slice into registers before it computes on the current one, so global latency hides behind the arithmetic,
// and puts them into the other of two workgroup tiles: one barrier per K slice.
fn fetch_a(g: u32, row0: u32, k0: u32, kend: u32, rows: u32, kt: u32) -> vec4<f32> {
    if (TRANS_A) {
        let m = row0 + (g % (rows / 4u)) * 4u;
        let k = k0 + g / (rows / 4u);
        return vec4<f32>(load_a(m, k, kend), load_a(m + 1u, k, kend), load_a(m + 2u, k, kend), load_a(m + 3u, k, kend));
    }
    let m = row0 + g / (kt / 4u);
    let k = k0 + (g % (kt / 4u)) * 4u;
    if (A_MODE == 1u) { return gather_dy_rows(m, k, kend); }
    return vec4<f32>(load_a(m, k, kend), load_a(m, k + 1u, kend), load_a(m, k + 2u, kend), load_a(m, k + 3u, kend));
}

fn put_a(g: u32, v: vec4<f32>, base: u32, rows: u32, kt: u32) {
    let q = rows / 4u;  // vec4s per k row of the tile
    if (TRANS_A) {
        As[base + g] = v;  // g = kk * q + m / 4
        return;
    }
    let mm = g / (kt / 4u);
    let k4 = (g % (kt / 4u)) * 4u;
    let at = base + k4 * q + mm / 4u;
    As[at][mm % 4u] = v.x;
    As[at + q][mm % 4u] = v.y;
    As[at + 2u * q][mm % 4u] = v.z;
    As[at + 3u * q][mm % 4u] = v.w;
}

fn fetch_b(g: u32, col0: u32, k0: u32, kend: u32, cols: u32, kt: u32) -> vec4<f32> {
    if (TRANS_B) {
        let n = col0 + g / (kt / 4u);
        let k = k0 + (g % (kt / 4u)) * 4u;
        if (B_MODE == 2u) { return gather_taps(k, kend); }
        return vec4<f32>(load_b(k, n, kend), load_b(k + 1u, n, kend), load_b(k + 2u, n, kend), load_b(k + 3u, n, kend));
    }
    let n = col0 + (g % (cols / 4u)) * 4u;
    let k = k0 + g / (cols / 4u);
    return vec4<f32>(load_b(k, n, kend), load_b(k, n + 1u, kend), load_b(k, n + 2u, kend), load_b(k, n + 3u, kend));
}

fn put_b(g: u32, v: vec4<f32>, base: u32, cols: u32, kt: u32) {
    let q = cols / 4u;
    if (!TRANS_B) {
        Bs[base + g] = v;
        return;
    }
    let nn = g / (kt / 4u);
    let k4 = (g % (kt / 4u)) * 4u;
    let at = base + k4 * q + nn / 4u;
    Bs[at][nn % 4u] = v.x;
    Bs[at + q][nn % 4u] = v.y;
    Bs[at + 2u * q][nn % 4u] = v.z;
    Bs[at + 3u * q][nn % 4u] = v.w;
}

fn store4(r: u32, c: u32, v: vec4<f32>, z: u32) {
    store_c(r, c, v.x, z);
    store_c(r, c + 1u, v.y, z);
    store_c(r, c + 2u, v.z, z);
    store_c(r, c + 3u, v.w, z);
}

// gemm: a TS x TS workgroup computes a (4 TS) x (4 TS) tile, each thread a 4x4 block; TS = 16 (64x64 tiles) or,
// for products with a side of at most 32, TS = 8 (32x32 tiles waste less of each tile). Accumulators are named
// registers, not arrays: an array indexed in a loop may be placed in slow local memory.
override TS: u32 = 16u;

@compute @workgroup_size(TS, TS)
fn gemm(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let tile = TS * 4u;
    let row0 = wid.y * tile;
    let col0 = p.col0 + wid.x * tile;
    let t = lid.y * TS + lid.x;
    var c0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0);
    let kbeg = select(wid.z, wid.z / p.batch, BATCHED) * p.k_slice;
    let kend = min(p.k, kbeg + p.k_slice);
    let kt = TS;  // K slice: tile * kt / 4 = TS * TS groups, one per thread
    thread_setup(t, col0, tile, kt, wid.z);
    var fa = fetch_a(t, row0, kbeg, kend, tile, kt);
    var fb = fetch_b(t, col0, kbeg, kend, tile, kt);
    var base = 0u;
    for (var k0 = kbeg; k0 < kend; k0 = k0 + kt) {
        put_a(t, fa, base, tile, kt);
        put_b(t, fb, base, tile, kt);
        workgroupBarrier();
        fa = fetch_a(t, row0, k0 + kt, kend, tile, kt);
        fb = fetch_b(t, col0, k0 + kt, kend, tile, kt);
        for (var k = 0u; k < kt; k = k + 1u) {
            let a = As[base + k * TS + lid.y];
            let b = Bs[base + k * TS + lid.x];
            c0 = c0 + a.x * b;
            c1 = c1 + a.y * b;
            c2 = c2 + a.z * b;
            c3 = c3 + a.w * b;
        }
        base = TS * TS - base;
    }
    let r = row0 + lid.y * 4u;
    let c = col0 + lid.x * 4u;
    store4(r, c, c0, wid.z);
    store4(r + 1u, c, c1, wid.z);
    store4(r + 2u, c, c2, wid.z);
    store4(r + 3u, c, c3, wid.z);
}

// gemm_big: BIG_ROWS = 128: cHI holds row (H / 2) * 64 + ty * 4 + I, columns (H % 2) * 64 + tx * 4 .. + 3;
// BIG_ROWS = 64 (a 64x128 tile for products of 64 or 192 rows): only c0I and c1I, from half as much of A.
override BIG_ROWS: u32 = 128u;

@compute @workgroup_size(16, 16)
fn gemm_big(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let row0 = wid.y * BIG_ROWS;
    let tall = BIG_ROWS == 128u;
    let qa = BIG_ROWS / 4u;  // vec4s per k row of the A tile
    let col0 = p.col0 + wid.x * 128u;
    let t = lid.y * 16u + lid.x;
    var c00 = vec4<f32>(0.0);
    var c01 = vec4<f32>(0.0);
    var c02 = vec4<f32>(0.0);
    var c03 = vec4<f32>(0.0);
    var c10 = vec4<f32>(0.0);
    var c11 = vec4<f32>(0.0);
    var c12 = vec4<f32>(0.0);
    var c13 = vec4<f32>(0.0);
    var c20 = vec4<f32>(0.0);
    var c21 = vec4<f32>(0.0);
    var c22 = vec4<f32>(0.0);
    var c23 = vec4<f32>(0.0);
    var c30 = vec4<f32>(0.0);
    var c31 = vec4<f32>(0.0);
    var c32 = vec4<f32>(0.0);
    var c33 = vec4<f32>(0.0);
    let kbeg = select(wid.z, wid.z / p.batch, BATCHED) * p.k_slice;
    let kend = min(p.k, kbeg + p.k_slice);
    let loads_a = t < BIG_ROWS * 2u;  // the A tile has BIG_ROWS * 8 / 4 groups
    thread_setup(t, col0, 128u, 8u, wid.z);
    var fa = vec4<f32>(0.0);
    if (loads_a) { fa = fetch_a(t, row0, kbeg, kend, BIG_ROWS, 8u); }
    var fb = fetch_b(t, col0, kbeg, kend, 128u, 8u);
    var base = 0u;
    for (var k0 = kbeg; k0 < kend; k0 = k0 + 8u) {
        if (loads_a) { put_a(t, fa, base, BIG_ROWS, 8u); }
        put_b(t, fb, base, 128u, 8u);
        workgroupBarrier();
        if (loads_a) { fa = fetch_a(t, row0, k0 + 8u, kend, BIG_ROWS, 8u); }
        fb = fetch_b(t, col0, k0 + 8u, kend, 128u, 8u);
        for (var k = 0u; k < 8u; k = k + 1u) {
            let a0 = As[base + k * qa + lid.y];
            let b0 = Bs[base + k * 32u + lid.x];
            let b1 = Bs[base + k * 32u + 16u + lid.x];
            c00 = c00 + a0.x * b0;
            c01 = c01 + a0.y * b0;
            c02 = c02 + a0.z * b0;
            c03 = c03 + a0.w * b0;
            c10 = c10 + a0.x * b1;
            c11 = c11 + a0.y * b1;
            c12 = c12 + a0.z * b1;
            c13 = c13 + a0.w * b1;
            if (tall) {
                let a1 = As[base + k * qa + 16u + lid.y];
                c20 = c20 + a1.x * b0;
                c21 = c21 + a1.y * b0;
                c22 = c22 + a1.z * b0;
                c23 = c23 + a1.w * b0;
                c30 = c30 + a1.x * b1;
                c31 = c31 + a1.y * b1;
                c32 = c32 + a1.z * b1;
                c33 = c33 + a1.w * b1;
            }
        }
        base = 256u - base;
    }
    let r0 = row0 + lid.y * 4u;
    let r1 = r0 + 64u;
    let q0 = col0 + lid.x * 4u;
    let q1 = q0 + 64u;
    store4(r0 + 0u, q0, c00, wid.z);
    store4(r0 + 1u, q0, c01, wid.z);
    store4(r0 + 2u, q0, c02, wid.z);
    store4(r0 + 3u, q0, c03, wid.z);
    store4(r0 + 0u, q1, c10, wid.z);
    store4(r0 + 1u, q1, c11, wid.z);
    store4(r0 + 2u, q1, c12, wid.z);
    store4(r0 + 3u, q1, c13, wid.z);
    if (!tall) { return; }
    store4(r1 + 0u, q0, c20, wid.z);
    store4(r1 + 1u, q0, c21, wid.z);
    store4(r1 + 2u, q0, c22, wid.z);
    store4(r1 + 3u, q0, c23, wid.z);
    store4(r1 + 0u, q1, c30, wid.z);
    store4(r1 + 1u, q1, c31, wid.z);
    store4(r1 + 2u, q1, c32, wid.z);
    store4(r1 + 3u, q1, c33, wid.z);
}

