// Included in every shader module. Each kernel family declares its parameters as a named struct in its own file
// (params.py packs them; one uniform buffer per distinct value).

// A flat index from a 2-D dispatch of 256-wide workgroups (large arrays need more than 65535 groups in x).
fn flat_index(gid: vec3<u32>, nw: vec3<u32>) -> u32 {
    return gid.x + gid.y * nw.x * 256u;
}
