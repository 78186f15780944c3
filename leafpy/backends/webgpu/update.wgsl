// Solver updates: w the weights, g the gradient, s1 and s2 the rule's history, rate[0] the step's learning rate
// (written before the step, so a recorded step replays under any schedule) and rate[1] 1 to apply the update or 0
// to skip it (a loss-scaled step with inf or nan gradients: nothing is written).
struct UpdateParams {
    count: u32,      // elements in this dispatch
    lr_mult: f32,    // the parameter's learning-rate multiplier
    momentum: f32,   // momentum_update, nesterov_update
    beta1: f32,      // adam_update
    beta2: f32,
    decay: f32,      // rmsprop_update, adadelta_update; adam_update: AdamW's weight decay (0: Adam)
    eps: f32,        // adam_update, rmsprop_update, adagrad_update, adadelta_update
    threshold: f32,  // clip_to_norm
    growth: f32,     // loss_scale_update: the growth factor, the backoff factor, the good steps before growing and
    backoff: f32,    // whether the scale is dynamic (1) or static (0)
    interval: f32,
    dynamic: u32,
}
@group(0) @binding(0) var<uniform> p: UpdateParams;
@group(0) @binding(1) var<storage, read> rate: array<f32>;
@group(0) @binding(2) var<storage, read_write> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> g: array<f32>;
@group(0) @binding(4) var<storage, read_write> s1: array<f32>;
@group(0) @binding(5) var<storage, read_write> s2: array<f32>;

fn lr() -> f32 { return rate[0] * p.lr_mult; }

fn applies(i: u32) -> bool { return i < p.count && rate[1] != 0.0; }

// whether x is finite, from its bits (WGSL has no isinf or isnan): an exponent of all ones is inf or nan
fn finite(x: f32) -> bool { return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u; }

// loss scaling: rate[0] holds the scale instead, w the gradient
@compute @workgroup_size(256)
fn unscale(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (i < p.count) { w[i] = w[i] * (1.0 / rate[0]); }
}

// loss scaling's decision, one thread: rate[0] holds the sum of squares of the unscaled gradients instead, w the
// scale, g the counts [good steps, skipped steps] and s1 the update's [step rate, apply] (see
// Backend.loss_scale_update)
@compute @workgroup_size(256)
fn loss_scale_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    if (flat_index(gid, nw) != 0u) { return; }
    let ok = finite(rate[0]);
    s1[1] = select(0.0, 1.0, ok);
    if (!ok) { g[1] = g[1] + 1.0; }
    if (p.dynamic != 0u) {
        var s = w[0];
        var good = g[0];
        if (!ok) {
            s = s * p.backoff;
            good = 0.0;
        } else {
            good = good + 1.0;
            if (good >= p.interval) {
                let grown = s * p.growth;
                if (finite(grown)) { s = grown; }
                good = 0.0;
            }
        }
        w[0] = s;
        g[0] = good;
    }
}

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
    if (applies(i)) { let h = p.momentum * s1[i] + lr() * g[i]; s1[i] = h; w[i] = w[i] - h; }
}

// s1 = history, s2 = the history before this step
@compute @workgroup_size(256)
fn nesterov_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (applies(i)) {
        let prev = s1[i];
        let h = p.momentum * prev + lr() * g[i];
        s1[i] = h; s2[i] = prev;
        w[i] = w[i] - ((1.0 + p.momentum) * h - p.momentum * prev);
    }
}

@compute @workgroup_size(256)
fn adam_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (applies(i)) {
        let gi = g[i];
        let m = p.beta1 * s1[i] + (1.0 - p.beta1) * gi;
        let v = p.beta2 * s2[i] + (1.0 - p.beta2) * gi * gi;
        s1[i] = m; s2[i] = v;
        var wi = w[i];
        if (p.decay != 0.0) { wi = wi * (1.0 - rate[2] * p.lr_mult * p.decay); }  // AdamW: [rate, apply, lr]
        w[i] = wi - lr() * m / (sqrt(v) + p.eps);
    }
}

@compute @workgroup_size(256)
fn rmsprop_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (applies(i)) {
        let gi = g[i];
        let h = p.decay * s1[i] + (1.0 - p.decay) * gi * gi;
        s1[i] = h;
        w[i] = w[i] - lr() * gi / (sqrt(h) + p.eps);
    }
}

@compute @workgroup_size(256)
fn adagrad_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (applies(i)) {
        let gi = g[i];
        let h = s1[i] + gi * gi;
        s1[i] = h;
        w[i] = w[i] - lr() * gi / (sqrt(h) + p.eps);
    }
}

@compute @workgroup_size(256)
fn adadelta_update(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat_index(gid, nw);
    if (applies(i)) {
        let gi = g[i];
        let h = p.decay * s1[i] + (1.0 - p.decay) * gi * gi;
        let step = gi * sqrt((s2[i] + p.eps) / (h + p.eps));
        s1[i] = h;
        s2[i] = p.decay * s2[i] + (1.0 - p.decay) * step * step;
        w[i] = w[i] - lr() * step;
    }
}
