// float16 <-> float32 conversions (this module is built only on a device opened with shader-f16; `enable f16;`
// is put before params.wgsl). A thread per element; each entry point binds its own pair of arrays.
struct HalfParams {
    count: u32,           // elements in this dispatch
    two: f32,             // 2.0 (a uniform, so that the overflow is not folded at compile time)
}
@group(0) @binding(0) var<uniform> p: HalfParams;
@group(0) @binding(1) var<storage, read> h_in: array<f16>;
@group(0) @binding(2) var<storage, read_write> f_out: array<f32>;
@group(0) @binding(1) var<storage, read> f_in: array<f32>;
@group(0) @binding(2) var<storage, read_write> h_out: array<f16>;

// to_f32: f_out = h_in (exact)
@compute @workgroup_size(256)
fn to_f32(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { f_out[i] = f32(h_in[i]); }
}

// to_f16: h_out = f_in rounded to nearest (even on ties); past float16's largest finite value (65504, and what
// rounds to it from below 65520) an infinity of the same sign, as loss scaling expects from an overflow
@compute @workgroup_size(256)
fn to_f16(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) {
        let x = f_in[i];
        if (abs(x) >= 65520.0) {  // the largest finite value doubled overflows at run time
            h_out[i] = f16(clamp(x, -65504.0, 65504.0)) * f16(p.two);
        } else {
            h_out[i] = f16(x);
        }
    }
}
