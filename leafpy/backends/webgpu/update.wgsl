// Solver updates: w the weights, g the gradient, s1, s2 and s3 the rule's history, rate[0] the step's learning rate
// (written before the step, so a recorded step replays under any schedule) and rate[1] 1 to apply the update or 0
// to skip it (a loss-scaled step with inf or nan gradients: nothing is written). The rules' entry points, NAME_update,
// follow this file: generated from their lines of leafpy/backends/updates.py's TABLE.
struct UpdateParams {
    count: u32,      // elements in this dispatch
    lr_mult: f32,    // the parameter's learning-rate multiplier
    hp0: f32,        // a rule's hyper-parameters, in the order of its line in updates.TABLE
    hp1: f32,
    hp2: f32,
    hp3: f32,
    hp4: f32,
    hp5: f32,
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
@group(0) @binding(6) var<storage, read_write> s3: array<f32>;

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
