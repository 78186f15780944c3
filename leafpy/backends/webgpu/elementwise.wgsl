// Elementwise kernels, a thread per element.
struct ElementwiseParams {
    count: u32,           // elements in this dispatch
    base: u32,            // index of this dispatch's first element in the whole tensor
    channels: u32,        // bias_add: a is [N, channels, inner]
    inner: u32,
    key_multiplier: u32,  // dropout_mask's hash
    threshold: u32,
    slices: u32,          // split_sum
    part_inner: u32,      // block_into, block_from, split_sum
    whole_inner: u32,
    column: u32,
    value: f32,           // fill
    alpha: f32,           // scal, axpby, split_sum
    beta: f32,
    scale: f32,           // dropout_mask's kept value, scale_by_scalar
    act0: f32,            // an activation's parameters, in the order of its line in pointwise.TABLE
    act1: f32,
    act2: f32,
    act3: f32,
}
@group(0) @binding(0) var<uniform> p: ElementwiseParams;
@group(0) @binding(1) var<storage, read_write> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;
@group(0) @binding(4) var<storage, read_write> d: array<f32>;

// fill: a = value
@compute @workgroup_size(256)
fn fill(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { a[i] = p.value; }
}

// scal: a *= alpha
@compute @workgroup_size(256)
fn scal(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { a[i] = a[i] * p.alpha; }
}

// copy: b = a
@compute @workgroup_size(256)
fn copy(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { b[i] = a[i]; }
}

// axpby: b = alpha * a + beta * b
@compute @workgroup_size(256)
fn axpby(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { b[i] = p.alpha * a[i] + p.beta * b[i]; }
}

// mul: c = a * b
@compute @workgroup_size(256)
fn mul(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { c[i] = a[i] * b[i]; }
}

// maximum: c = max(a, b), NaN where either is (x + y carries it; WGSL's max need not)
@compute @workgroup_size(256)
fn maximum(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) {
        let x = a[i];
        let y = b[i];
        c[i] = select(select(y, x, x > y), x + y, x != x || y != y);
    }
}

// The activations' entry points (NAME, NAME_grad and their in-place twins) are generated from their formulas and
// appended to this module (backends/pointwise.py).

// bias_add: a[(n * channels + c) * inner + r] += b[c]
@compute @workgroup_size(256)
fn bias_add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { a[i] = a[i] + b[((i + p.base) / p.inner) % p.channels]; }
}

// dropout mask (the same hash as every backend): a = hash(i + seed * key_multiplier) >= threshold ? scale : 0,
// the draw's seed the bits of b[0] (a uint32 buffer)
@compute @workgroup_size(256)
fn dropout_mask(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) {
        var h = i + p.base + bitcast<u32>(b[0]) * p.key_multiplier;
        h = h ^ (h >> 16u); h = h * 0x85EBCA6Bu; h = h ^ (h >> 13u); h = h * 0xC2B2AE35u; h = h ^ (h >> 16u);
        a[i] = select(0.0, p.scale, h >= p.threshold);
    }
}

// mse_diff: c = a - b
@compute @workgroup_size(256)
fn sub(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { c[i] = a[i] - b[i]; }
}

// mse_grad: c = a * b[0] * scale   (a = diff, b = dloss, scale = 2 / n)
@compute @workgroup_size(256)
fn scale_by_scalar(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { c[i] = a[i] * b[0] * p.scale; }
}

// split-K: b = alpha * sum_s a[s * count + i] + beta * b, over the slices, into rows of part_inner values in rows
// of whole_inner from element `column` of b as bound (a block of C: a product blocked under the binding limit;
// part_inner = whole_inner and column 0 for all of C)
// the sum of element i over the p.slices slices of a (p.count apart), four slices a pass so that a thread has four
// loads in flight
fn slice_sum(i: u32) -> f32 {
    var s = vec4<f32>(0.0);
    var z = 0u;
    for (; z + 3u < p.slices; z = z + 4u) {
        let at = z * p.count + i;
        s = s + vec4<f32>(a[at], a[at + p.count], a[at + 2u * p.count], a[at + 3u * p.count]);
    }
    for (; z < p.slices; z = z + 1u) { s.x = s.x + a[z * p.count + i]; }
    return (s.x + s.y) + (s.z + s.w);
}

@compute @workgroup_size(256)
fn split_sum(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i >= p.count) { return; }
    let o = (i / p.part_inner) * p.whole_inner + p.column + i % p.part_inner;
    var v = p.alpha * slice_sum(i);
    if (p.beta != 0.0) { v = v + p.beta * b[o]; }
    b[o] = v;
}

// Blocks along an axis (Concat, Slice): a = part seen as [outer, part_inner], b = the whole tensor seen as
// [outer, whole_inner], the block starting at column `column`.
fn block_index(i: u32) -> u32 {
    let g = i + p.base;
    return (g / p.part_inner) * p.whole_inner + p.column + g % p.part_inner;
}

@compute @workgroup_size(256)
fn block_into(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { b[block_index(i)] = a[i]; }
}

@compute @workgroup_size(256)
fn block_from(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { a[i] = b[block_index(i)]; }
}
