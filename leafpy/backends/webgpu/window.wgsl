// The geometry of a sliding window (convolution or pooling) as pipeline constants: input IN_H x IN_W, window
// KH x KW, stride SH x SW, padding PH x PW, output OH x OW. Shared by the modules that gather through windows.
override IN_H: u32 = 1u;
override IN_W: u32 = 1u;
override KH: u32 = 1u;
override KW: u32 = 1u;
override SH: u32 = 1u;
override SW: u32 = 1u;
override PH: u32 = 0u;
override PW: u32 = 0u;
override OH: u32 = 1u;
override OW: u32 = 1u;

// The output row whose window covers input row h at window row i, or -1 where none does.
fn window_row(h: u32, i: u32) -> i32 {
    let t = i32(h + PH) - i32(i);
    if (t < 0 || u32(t) % SH != 0u || u32(t) / SH >= OH) { return -1; }
    return t / i32(SH);
}

// The output column whose window covers input column w at window column j, or -1 where none does.
fn window_col(w: u32, j: u32) -> i32 {
    let t = i32(w + PW) - i32(j);
    if (t < 0 || u32(t) % SW != 0u || u32(t) / SW >= OW) { return -1; }
    return t / i32(SW);
}

// The first and last output rows whose windows cover input row h (first > last where none does).
fn covering_rows(h: u32) -> vec2<i32> {
    let t = i32(h + PH);
    let lo = t - i32(KH) + 1;
    return vec2<i32>(select(0, (lo + i32(SH) - 1) / i32(SH), lo > 0), min(i32(OH) - 1, t / i32(SH)));
}

// The first and last output columns whose windows cover input column w (first > last where none does).
fn covering_cols(w: u32) -> vec2<i32> {
    let t = i32(w + PW);
    let lo = t - i32(KW) + 1;
    return vec2<i32>(select(0, (lo + i32(SW) - 1) / i32(SW), lo > 0), min(i32(OW) - 1, t / i32(SW)));
}

// Where im2col row ckk = (c * KH + i) * KW + j, output position q = y * OW + x reads within one sample of x: the
// offset c * IN_H * IN_W + h * IN_W + w, or -1 in the padding.
fn window_tap(ckk: u32, q: u32) -> i32 {
    let i = (ckk / KW) % KH;
    let j = ckk % KW;
    let h = i32((q / OW) * SH + i) - i32(PH);
    let w = i32((q % OW) * SW + j) - i32(PW);
    if (h < 0 || h >= i32(IN_H) || w < 0 || w >= i32(IN_W)) { return -1; }
    return i32((ckk / (KH * KW)) * IN_H * IN_W) + h * i32(IN_W) + w;
}
