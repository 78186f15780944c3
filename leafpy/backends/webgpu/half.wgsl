// float16 <-> float32 conversions (this module is built only on a device opened with shader-f16, after half.py's
// prelude: `enable f16;`, params.wgsl and to_h). A thread per element; each entry point binds its own arrays.
struct HalfParams {
    count: u32,           // elements in this dispatch
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

// to_f16: h_out = to_h(f_in)
@compute @workgroup_size(256)
fn to_f16(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { h_out[i] = to_h(f_in[i]); }
}
