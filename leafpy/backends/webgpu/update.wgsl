// Solver updates: w the weights, g the gradient, s1 and s2 the rule's history, rate[0] the step's learning rate
// (written before the step, so a recorded step replays under any schedule). p.u0 = element count,
// p.f0 = lr_mult, p.f1 = momentum / beta1 / decay, p.f2 = beta2, p.f3 = eps.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> rate: array<f32>;
@group(0) @binding(2) var<storage, read_write> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> g: array<f32>;
@group(0) @binding(4) var<storage, read_write> s1: array<f32>;
@group(0) @binding(5) var<storage, read_write> s2: array<f32>;

fn lr() -> f32 { return rate[0] * p.f0; }

@compute @workgroup_size(256)
fn momentum_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) { let h = p.f1 * s1[i] + lr() * g[i]; s1[i] = h; w[i] = w[i] - h; }
}

// s1 = history, s2 = the history before this step
@compute @workgroup_size(256)
fn nesterov_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) {
        let prev = s1[i];
        let h = p.f1 * prev + lr() * g[i];
        s1[i] = h; s2[i] = prev;
        w[i] = w[i] - ((1.0 + p.f1) * h - p.f1 * prev);
    }
}

@compute @workgroup_size(256)
fn adam_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) {
        let gi = g[i];
        let m = p.f1 * s1[i] + (1.0 - p.f1) * gi;
        let v = p.f2 * s2[i] + (1.0 - p.f2) * gi * gi;
        s1[i] = m; s2[i] = v;
        w[i] = w[i] - lr() * m / (sqrt(v) + p.f3);
    }
}

@compute @workgroup_size(256)
fn rmsprop_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) {
        let gi = g[i];
        let h = p.f1 * s1[i] + (1.0 - p.f1) * gi * gi;
        s1[i] = h;
        w[i] = w[i] - lr() * gi / (sqrt(h) + p.f3);
    }
}

@compute @workgroup_size(256)
fn adagrad_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) {
        let gi = g[i];
        let h = s1[i] + gi * gi;
        s1[i] = h;
        w[i] = w[i] - lr() * gi / (sqrt(h) + p.f3);
    }
}

@compute @workgroup_size(256)
fn adadelta_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.u0) {
        let gi = g[i];
        let h = p.f1 * s1[i] + (1.0 - p.f1) * gi * gi;
        let step = gi * sqrt((s2[i] + p.f3) / (h + p.f3));
        s1[i] = h;
        s2[i] = p.f1 * s2[i] + (1.0 - p.f1) * step * step;
        w[i] = w[i] - lr() * step;
    }
}
