// A workgroup's 256 threads combined into one value (a sum, or a maximum), for the reductions: the entry points
// take their invocation's builtins as a Lane. This is the portable build, a tree in workgroup memory;
// lanes_subgroup.wgsl is the one for adapters with subgroup operations.
// Every thread of the workgroup calls reduce_workgroup (its barriers must be reached in uniform control flow, as the
// WGSL specification's uniformity analysis checks): an entry point takes @builtin(workgroup_id) on its own, outside
// the Lane (a struct holding a per-thread value is per-thread as a whole), and never returns before the call; a
// workgroup with nothing to sum runs its loops zero times instead.
struct Lane {
    @builtin(local_invocation_id) lid: vec3<u32>,
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
