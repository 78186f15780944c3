// A workgroup's 256 threads combined into one value (a sum, or a maximum), for the reductions: the entry points
// take their builtins as a Lane. This is the portable build, a tree in workgroup memory; lanes_subgroup.wgsl is the
// one for adapters with subgroup operations.
struct Lane {
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
}

var<workgroup> lane_parts: array<f32, 256>;

// every thread's v combined (sum, or maximum with is_max); the result reaches every thread
fn reduce_workgroup(lane: Lane, v: f32, is_max: bool) -> f32 {
    let t = lane.lid.x;
    workgroupBarrier();  // an earlier call's readers are done with lane_parts
    lane_parts[t] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (t < s) { lane_parts[t] = select(lane_parts[t] + lane_parts[t + s], max(lane_parts[t], lane_parts[t + s]), is_max); }
        workgroupBarrier();
    }
    return lane_parts[0];
}
