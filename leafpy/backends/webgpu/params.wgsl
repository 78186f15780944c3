// Included in every shader module. Each kernel family declares its parameters as a named struct in its own file
// (params.py packs them; one uniform buffer per distinct value).

// A flat index from a 2-D dispatch of 256-wide workgroups (large arrays need more than 65535 groups in x).
fn flat_index(gid: vec3<u32>, nw: vec3<u32>) -> u32 {
    return gid.x + gid.y * nw.x * 256u;
}

// Kernels that take four elements a thread (webgpu.params.PER_THREAD): a workgroup's 1024 in four coalesced rows
// of 256, so that each thread has four loads in flight; the thread's elements are quad_first(...) + 256 j, j < 4.
fn quad_first(gid: vec3<u32>, nw: vec3<u32>) -> u32 {
    let t = flat_index(gid, nw);
    return (t / 256u) * 1024u + t % 256u;
}
