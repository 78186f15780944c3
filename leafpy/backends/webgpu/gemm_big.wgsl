// The same GEMM with 128x128 tiles: each of the 16x16 threads keeps an 8x8 block of C in registers (two 4-row
// by two 4-column quarters, 64 apart, so workgroup-memory reads stay conflict-free). Staging reads walk the
// operand's contiguous axis with consecutive threads, whichever way each operand is transposed.
// Parameters as gemm.wgsl: u0 = M, u1 = N, u2 = K, u3 = flags, u4/u5/u6 = offsets, u7 = K range of a z-slice.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(2) var<storage, read> B: array<f32>;
@group(0) @binding(3) var<storage, read_write> C: array<f32>;

var<workgroup> As: array<f32, 2048>;  // [k][m]: 16 x 128
var<workgroup> Bs: array<f32, 2048>;  // [k][n]: 16 x 128

fn a_at(m: u32, k: u32, kend: u32) -> f32 {
    if (m >= p.u0 || k >= kend) { return 0.0; }
    if ((p.u3 & 1u) != 0u) { return A[p.u4 + k * p.u0 + m]; }
    return A[p.u4 + m * p.u2 + k];
}

fn b_at(k: u32, n: u32, kend: u32) -> f32 {
    if (k >= kend || n >= p.u1) { return 0.0; }
    if ((p.u3 & 2u) != 0u) { return B[p.u5 + n * p.u2 + k]; }
    return B[p.u5 + k * p.u1 + n];
}

@compute @workgroup_size(16, 16)
fn gemm_big(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let M = p.u0;
    let N = p.u1;
    let row0 = wid.y * 128u;
    let col0 = wid.x * 128u;
    let t = lid.y * 16u + lid.x;
    let kbeg = wid.z * p.u7;
    let kend = min(p.u2, kbeg + p.u7);
    let a_kfast = (p.u3 & 1u) == 0u;  // A row-major M x K: consecutive threads take consecutive k
    let b_kfast = (p.u3 & 2u) != 0u;  // B stored N x K
    var acc: array<vec4<f32>, 16>;
    for (var i = 0u; i < 16u; i = i + 1u) { acc[i] = vec4<f32>(0.0); }
    for (var k0 = kbeg; k0 < kend; k0 = k0 + 16u) {
        for (var l = 0u; l < 8u; l = l + 1u) {
            let e = t + l * 256u;  // 2048 elements of each tile, 8 per thread
            var kk: u32; var mm: u32;
            if (a_kfast) { kk = e % 16u; mm = e / 16u; } else { kk = e / 128u; mm = e % 128u; }
            As[kk * 128u + mm] = a_at(row0 + mm, k0 + kk, kend);
            var kb: u32; var nn: u32;
            if (b_kfast) { kb = e % 16u; nn = e / 16u; } else { kb = e / 128u; nn = e % 128u; }
            Bs[kb * 128u + nn] = b_at(k0 + kb, col0 + nn, kend);
        }
        workgroupBarrier();
        for (var k = 0u; k < 16u; k = k + 1u) {
            let ab = k * 128u;
            let a0 = vec4<f32>(As[ab + lid.y * 4u], As[ab + lid.y * 4u + 1u], As[ab + lid.y * 4u + 2u],
                               As[ab + lid.y * 4u + 3u]);
            let a1 = vec4<f32>(As[ab + 64u + lid.y * 4u], As[ab + 64u + lid.y * 4u + 1u],
                               As[ab + 64u + lid.y * 4u + 2u], As[ab + 64u + lid.y * 4u + 3u]);
            let b0 = vec4<f32>(Bs[ab + lid.x * 4u], Bs[ab + lid.x * 4u + 1u], Bs[ab + lid.x * 4u + 2u],
                               Bs[ab + lid.x * 4u + 3u]);
            let b1 = vec4<f32>(Bs[ab + 64u + lid.x * 4u], Bs[ab + 64u + lid.x * 4u + 1u],
                               Bs[ab + 64u + lid.x * 4u + 2u], Bs[ab + 64u + lid.x * 4u + 3u]);
            acc[0] = acc[0] + a0.x * b0; acc[1] = acc[1] + a0.x * b1;
            acc[2] = acc[2] + a0.y * b0; acc[3] = acc[3] + a0.y * b1;
            acc[4] = acc[4] + a0.z * b0; acc[5] = acc[5] + a0.z * b1;
            acc[6] = acc[6] + a0.w * b0; acc[7] = acc[7] + a0.w * b1;
            acc[8] = acc[8] + a1.x * b0; acc[9] = acc[9] + a1.x * b1;
            acc[10] = acc[10] + a1.y * b0; acc[11] = acc[11] + a1.y * b1;
            acc[12] = acc[12] + a1.z * b0; acc[13] = acc[13] + a1.z * b1;
            acc[14] = acc[14] + a1.w * b0; acc[15] = acc[15] + a1.w * b1;
        }
        workgroupBarrier();
    }
    let cbase = p.u6 + wid.z * M * N;
    for (var i = 0u; i < 8u; i = i + 1u) {
        let r = row0 + (i / 4u) * 64u + lid.y * 4u + (i % 4u);
        if (r >= M) { continue; }
        for (var h = 0u; h < 2u; h = h + 1u) {
            let v4 = acc[i * 2u + h];
            for (var j = 0u; j < 4u; j = j + 1u) {
                let c = col0 + h * 64u + lid.x * 4u + j;
                if (c >= N) { continue; }
                let o = cbase + r * N + c;
                var v = p.f0 * v4[j];
                if (p.f1 != 0.0) { v = v + p.f1 * C[o]; }
                C[o] = v;
            }
        }
    }
}
