// Elementwise kernels. p.u0 is the element count everywhere.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
@group(0) @binding(4) var<storage, read_write> d: array<f32>;

// fill: a = f0
@compute @workgroup_size(256)
fn fill(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { a[i] = p.f0; }
}

// scal: a *= f0
@compute @workgroup_size(256)
fn scal(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { a[i] = a[i] * p.f0; }
}

// copy: b = a
@compute @workgroup_size(256)
fn copy(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { b[i] = a[i]; }
}

// axpby: b = f0 * a + f1 * b
@compute @workgroup_size(256)
fn axpby(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { b[i] = p.f0 * a[i] + p.f1 * b[i]; }
}

// mul: c = a * b
@compute @workgroup_size(256)
fn mul(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { c[i] = a[i] * b[i]; }
}

// The activations' entry points (NAME, NAME_grad and their in-place twins) are generated from their formulas and
// appended to this module (backends/pointwise.py).

// bias_add: a[(n * C + c) * inner + r] += b[c]; u1 = C, u2 = inner, u3 = index of a[0] in the whole tensor
@compute @workgroup_size(256)
fn bias_add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { a[i] = a[i] + b[((i + p.u3) / p.u2) % p.u1]; }
}

// dropout mask (the same hash as every backend): a = hash(i + seed * u1) >= u2 ? f0 : 0, the draw's seed the
// bits of b[0] (a uint32 buffer); u3 = index of this dispatch's first element
@compute @workgroup_size(256)
fn dropout_mask(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) {
        var h = i + p.u3 + bitcast<u32>(b[0]) * p.u1;
        h = h ^ (h >> 16u); h = h * 0x85EBCA6Bu; h = h ^ (h >> 13u); h = h * 0xC2B2AE35u; h = h ^ (h >> 16u);
        a[i] = select(0.0, p.f0, h >= p.u2);
    }
}

// mse_diff: c = a - b
@compute @workgroup_size(256)
fn sub(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { c[i] = a[i] - b[i]; }
}

// mse_grad: c = a * b[0] * f0   (a = diff, b = dloss, f0 = 2 / n)
@compute @workgroup_size(256)
fn scale_by_scalar(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { c[i] = a[i] * b[0] * p.f0; }
}

// split-K: b = f0 * sum_s a[s * u0 + i] + f1 * b, over u1 slices
@compute @workgroup_size(256)
fn split_sum(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.u0) { return; }
    var s = 0.0;
    for (var z = 0u; z < p.u1; z = z + 1u) { s = s + a[z * p.u0 + i]; }
    var v = p.f0 * s;
    if (p.f1 != 0.0) { v = v + p.f1 * b[i]; }
    b[i] = v;
}

// Blocks along an axis (Concat, Slice): a = part seen as [outer, u1], b = the whole tensor seen as [outer, u2],
// the block starting at column u3; u4 = index of a[0] in the whole part.
fn block_index(i: u32) -> u32 {
    let g = i + p.u4;
    return (g / p.u1) * p.u2 + p.u3 + g % p.u1;
}

@compute @workgroup_size(256)
fn block_into(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { b[block_index(i)] = a[i]; }
}

@compute @workgroup_size(256)
fn block_from(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { a[i] = b[block_index(i)]; }
}
