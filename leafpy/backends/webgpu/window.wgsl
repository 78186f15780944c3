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
