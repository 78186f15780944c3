// Solver updates: w the weights, g the gradient, s1 and s2 the rule's history, rate[0] the step's learning rate
// (written before the step, so a recorded step replays under any schedule).
struct UpdateParams {
    count: u32,      // elements in this dispatch
    lr_mult: f32,    // the parameter's learning-rate multiplier
    momentum: f32,   // momentum_update, nesterov_update
    beta1: f32,      // adam_update
    beta2: f32,
    decay: f32,      // rmsprop_update, adadelta_update
    eps: f32,        // adam_update, rmsprop_update, adagrad_update, adadelta_update
    threshold: f32,  // clip_to_norm
}
@group(0) @binding(0) var<uniform> p: UpdateParams;
@group(0) @binding(1) var<storage, read> rate: array<f32>;
@group(0) @binding(2) var<storage, read_write> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> g: array<f32>;
@group(0) @binding(4) var<storage, read_write> s1: array<f32>;
@group(0) @binding(5) var<storage, read_write> s2: array<f32>;

fn lr() -> f32 { return rate[0] * p.lr_mult; }

// gradient clipping: rate[0] holds the squared norm of all gradients instead, w the gradient
@compute @workgroup_size(256)
fn clip_to_norm(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    let n = sqrt(rate[0]);
    if (i < p.count && n > p.threshold) { w[i] = w[i] * (p.threshold / n); }
}

@compute @workgroup_size(256)
fn momentum_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { let h = p.momentum * s1[i] + lr() * g[i]; s1[i] = h; w[i] = w[i] - h; }
}

// s1 = history, s2 = the history before this step
@compute @workgroup_size(256)
fn nesterov_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) {
        let prev = s1[i];
        let h = p.momentum * prev + lr() * g[i];
        s1[i] = h; s2[i] = prev;
        w[i] = w[i] - ((1.0 + p.momentum) * h - p.momentum * prev);
    }
}

@compute @workgroup_size(256)
fn adam_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) {
        let gi = g[i];
        let m = p.beta1 * s1[i] + (1.0 - p.beta1) * gi;
        let v = p.beta2 * s2[i] + (1.0 - p.beta2) * gi * gi;
        s1[i] = m; s2[i] = v;
        w[i] = w[i] - lr() * m / (sqrt(v) + p.eps);
    }
}

@compute @workgroup_size(256)
fn rmsprop_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) {
        let gi = g[i];
        let h = p.decay * s1[i] + (1.0 - p.decay) * gi * gi;
        s1[i] = h;
        w[i] = w[i] - lr() * gi / (sqrt(h) + p.eps);
    }
}

@compute @workgroup_size(256)
fn adagrad_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) {
        let gi = g[i];
        let h = s1[i] + gi * gi;
        s1[i] = h;
        w[i] = w[i] - lr() * gi / (sqrt(h) + p.eps);
    }
}

@compute @workgroup_size(256)
fn adadelta_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) {
        let gi = g[i];
        let h = p.decay * s1[i] + (1.0 - p.decay) * gi * gi;
        let step = gi * sqrt((s2[i] + p.eps) / (h + p.eps));
        s1[i] = h;
        s2[i] = p.decay * s2[i] + (1.0 - p.decay) * step * step;
        w[i] = w[i] - lr() * step;
    }
}
