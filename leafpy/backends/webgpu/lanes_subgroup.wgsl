// A workgroup's 256 threads combined into one value (a sum, or a maximum), for the reductions, with subgroup
// operations (the adapter's "subgroup" feature): each subgroup combines its lanes in registers, and its first lane
// leaves the subgroup's value in workgroup memory; every thread then combines those few values (8 on a GPU with
// 32-lane subgroups) in the same order, so all threads hold the same result. Same interface as lanes.wgsl.
struct Lane {
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(num_subgroups) sg_count: u32,
}

var<workgroup> lane_parts: array<f32, 256>;

fn reduce_workgroup(lane: Lane, v: f32, is_max: bool) -> f32 {
    let total = subgroupAdd(v);
    let largest = subgroupMax(v);
    workgroupBarrier();  // an earlier call's readers are done with lane_parts
    if (lane.sg_lane == 0u) { lane_parts[lane.sg_id] = select(total, largest, is_max); }
    workgroupBarrier();
    var r = lane_parts[0];
    for (var k = 1u; k < lane.sg_count; k = k + 1u) {
        r = select(r + lane_parts[k], max(r, lane_parts[k]), is_max);
    }
    return r;
}
