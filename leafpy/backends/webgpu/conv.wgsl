// Convolution layout kernels for im2col + GEMM, over a chunk of nc samples of the batch. The geometry is pipeline
// constants (index arithmetic divides by constants).
struct ConvParams {
    count: u32,         // threads of the launch
    offset: u32,        // element offset of the chunk's first sample in the NCHW tensor as bound
    samples: u32,       // nc: the chunk's samples
    out_channels: u32,  // relayout: O, the channels of y or dy
    to_gemm: u32,       // relayout: 0 = GEMM layout -> NCHW (outputs), 1 = NCHW -> GEMM layout (output gradients)
}
@group(0) @binding(0) var<uniform> p: ConvParams;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

override CONV_C: u32 = 1u;

// cols[(c * kh + i) * kw + j][nl * P + y * ow + x] = x_padded[nl][c][y * sh + i - ph][x * sw + j - pw]
@compute @workgroup_size(256)
fn im2col(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.count) { return; }
    let P = OH * OW;
    let nc = p.samples;
    let cols = nc * P;
    let row = idx / cols;
    let col = idx % cols;
    let nl = col / P;
    let tap = window_tap(row, col % P);
    var v = 0.0;
    if (tap >= 0) { v = src[p.offset + nl * CONV_C * IN_H * IN_W + u32(tap)]; }
    dst[idx] = v;
}

// dx[nl][c][h][w] = sum of dcols over every (i, j, y, x) that im2col read (h, w) from (a gather: no atomics)
@compute @workgroup_size(256)
fn col2im(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.count) { return; }
    let P = OH * OW;
    let cols = p.samples * P;
    let w = idx % IN_W;
    let h = (idx / IN_W) % IN_H;
    let c = (idx / (IN_W * IN_H)) % CONV_C;
    let nl = idx / (IN_W * IN_H * CONV_C);
    let rows = covering_rows(h);
    let cs = covering_cols(w);
    var s = 0.0;
    for (var y = rows.x; y <= rows.y; y = y + 1) {
        let i = h + PH - u32(y) * SH;
        for (var x = cs.x; x <= cs.y; x = x + 1) {
            let j = w + PW - u32(x) * SW;
            s = s + src[((c * KH + i) * KW + j) * cols + nl * P + u32(y) * OW + u32(x)];
        }
    }
    dst[p.offset + ((nl * CONV_C + c) * IN_H + h) * IN_W + w] = s;
}

// between the GEMM layout [O][nc * P] and NCHW for the chunk's samples, a thread per element
@compute @workgroup_size(256)
fn relayout(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let idx = flat_index(gid, nw);
    if (idx >= p.count) { return; }
    let P = OH * OW;
    let O = p.out_channels;
    let nc = p.samples;
    let q = idx % P;
    let o = (idx / P) % O;
    let nl = idx / (P * O);
    let gemm = o * nc * P + nl * P + q;
    let nchw = p.offset + (nl * O + o) * P + q;
    if (p.to_gemm == 0u) { dst[nchw] = src[gemm]; } else { dst[gemm] = src[nchw]; }
}
