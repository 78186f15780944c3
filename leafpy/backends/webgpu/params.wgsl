// Every kernel's parameters: twelve unsigned integers and eight floats (one uniform buffer per distinct value).
struct Params {
    u0: u32, u1: u32, u2: u32, u3: u32, u4: u32, u5: u32, u6: u32, u7: u32, u8: u32, u9: u32, u10: u32, u11: u32,
    f0: f32, f1: f32, f2: f32, f3: f32, f4: f32, f5: f32, f6: f32, f7: f32,
}

// A flat index from a 2-D dispatch of 256-wide workgroups (large arrays need more than 65535 groups in x).
fn flat_index(gid: vec3<u32>, nw: vec3<u32>) -> u32 {
    return gid.x + gid.y * nw.x * 256u;
}
