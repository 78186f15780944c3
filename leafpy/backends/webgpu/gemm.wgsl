// C = f0 * op(A) op(B) + f1 * C, row-major, register tiled: a 16x16 workgroup computes a 64x64 tile of C,
// each thread a 4x4 block held in registers; K advances in slices of 16 staged in workgroup memory.
// u0 = M, u1 = N, u2 = K, u3 = flags (1: A transposed, 2: B transposed), u4/u5/u6 = element offsets of A/B/C,
// u7 = the K range of one z-slice of the grid (split-K: slice z writes its partial product at C + z * M * N),
// u8/u9/u10 = row strides of A, B and C as stored (a block of a larger product is bound with its parent's strides).
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;

const TILE: u32 = 64u;
const KT: u32 = 16u;
var<workgroup> As: array<vec4<f32>, 256>;  // [k][m / 4]: 16 x 16 vec4
var<workgroup> Bs: array<vec4<f32>, 256>;  // [k][n / 4]

fn load_a(m: u32, k: u32, kend: u32) -> f32 {
    if (m >= p.u0 || k >= kend) { return 0.0; }
    if ((p.u3 & 1u) != 0u) { return A[p.u4 + k * p.u8 + m]; }
    return A[p.u4 + m * p.u8 + k];
}

fn load_b(k: u32, n: u32, kend: u32) -> f32 {
    if (k >= kend || n >= p.u1) { return 0.0; }
    if ((p.u3 & 2u) != 0u) { return B[p.u5 + n * p.u9 + k]; }
    return B[p.u5 + k * p.u9 + n];
}

@compute @workgroup_size(16, 16)
fn gemm(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let M = p.u0;
    let N = p.u1;
    let K = p.u2;
    let row0 = wid.y * TILE;
    let col0 = wid.x * TILE;
    let t = lid.y * 16u + lid.x;
    var acc: array<vec4<f32>, 4>;
    for (var i = 0u; i < 4u; i = i + 1u) { acc[i] = vec4<f32>(0.0); }
    let kbeg = wid.z * p.u7;
    let kend = min(K, kbeg + p.u7);
    for (var k0 = kbeg; k0 < kend; k0 = k0 + KT) {
        // each thread stages 4 values of A (one vec4 along m) and 4 of B (one vec4 along n)
        let kk = t / 16u;
        let q = t % 16u;
        let m = row0 + q * 4u;
        let ka = k0 + kk;
        As[kk * 16u + q] = vec4<f32>(load_a(m, ka, kend), load_a(m + 1u, ka, kend), load_a(m + 2u, ka, kend),
                                     load_a(m + 3u, ka, kend));
        let n = col0 + q * 4u;
        Bs[kk * 16u + q] = vec4<f32>(load_b(ka, n, kend), load_b(ka, n + 1u, kend), load_b(ka, n + 2u, kend),
                                     load_b(ka, n + 3u, kend));
        workgroupBarrier();
        for (var k = 0u; k < KT; k = k + 1u) {
            let a = As[k * 16u + lid.y];
            let b = Bs[k * 16u + lid.x];
            acc[0] = acc[0] + a.x * b;
            acc[1] = acc[1] + a.y * b;
            acc[2] = acc[2] + a.z * b;
            acc[3] = acc[3] + a.w * b;
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i = i + 1u) {
        let r = row0 + lid.y * 4u + i;
        if (r >= M) { continue; }
        for (var j = 0u; j < 4u; j = j + 1u) {
            let cidx = col0 + lid.x * 4u + j;
            if (cidx >= N) { continue; }
            let o = p.u6 + wid.z * M * N + r * p.u10 + cidx;
            var v = p.f0 * acc[i][j];
            if (p.f1 != 0.0) { v = v + p.f1 * C[o]; }
            C[o] = v;
        }
    }
}
