"""precision="fp16" on the webgpu backend (adapters with shader-f16; lavapipe offers it, so these run in CI).

Tolerances come from float16's unit roundoff u = 2**-11 (half the spacing of numbers in [1, 2)): a layer's results
against the same layer in float64 on native (from the same float16-rounded inputs) within
GROWTH * roundings * u, the rule test_mixed_precision.py states for native's fp16 emulation (roundings: 2 for the
stored result and a stored value read again, +1 for float16 weight copies, +T for a recurrent layer over T steps;
GROWTH = 4 for magnitude growth inside the layer); a single primitive within REDUCTION_DEPTH * u (float32
accumulation adds ~2**-24 per term, far below u at these lengths, so the float16 rounding of inputs and result
dominates); a training run against native's fp16 emulation within TRAINING_ULPS * u per step, relative to
max(1, |w|). Winograd convolutions, whose transforms amplify float32 roundings, add an estimate of those per element
(_winograd_sigmas), kept within the primitive's budget.
"""

from __future__ import annotations

import numpy as np
import pytest
import reference
from conftest import webgpu_offering
from test_gradients import CASES
from test_mixed_precision import GROWTH, _assert_forward_reads_the_masters, _linear_solver, _low, _roundings

import leafpy as lp
from leafpy.backends.base import Backend
from leafpy.backends.webgpu.sources import F35_POINTS, toom_cook
from leafpy.errors import BackendError

pytestmark = pytest.mark.webgpu

U = 2.0**-11
F16 = np.dtype(np.float16)
REDUCTION_DEPTH = 4
"""A primitive's error budget in units of u: float16 inputs exact, one rounding of the float16 result (u), and as
much again for float32 sums and the float16 rounding of a value the primitive reads back (a cast's round trip)."""
TRAINING_ULPS = 8
"""Per training step, in units of u: native and webgpu sum in different orders, so an element's float16 rounding
may differ by one spacing (2u relative) in any activation; a step passes it through forward, backward and update."""
WORST: dict[str, tuple[float, float]] = {}
"""case -> (largest relative error seen, tolerance): the per-layer table for reports."""


@pytest.fixture(scope="module")
def fp16():
    webgpu_offering("shader-f16")
    return lp.backend("webgpu", precision="fp16")  # offered: it must open


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float((np.abs(got - want) / np.maximum(1.0, np.abs(want))).max())


# --- refusals -------------------------------------------------------------------------------------------------------
def test_bf16_and_tf32_are_refused_with_the_alternative():
    with pytest.raises(BackendError, match=r"WGSL has no bfloat16.*use precision='fp16'.*or 'fp32'"):
        lp.backend("webgpu", precision="bf16")
    with pytest.raises(BackendError, match=r"no TF32.*precision='fp32'"):
        lp.backend("webgpu", precision="tf32")


def test_an_adapter_without_shader_f16_refuses_fp16(fp16, monkeypatch):
    adapter_type = type(fp16.adapter)
    offered = set(fp16.adapter.features)
    monkeypatch.setattr(adapter_type, "features", property(lambda self: offered - {"shader-f16"}))
    with pytest.raises(BackendError, match=r"'fp16' needs the adapter's shader-f16 feature.*precision='fp32'"):
        lp.backend("webgpu", precision="fp16")
    plain = lp.backend("webgpu", precision="fp32", power_preference="low-power")  # fp32 still opens
    with pytest.raises(BackendError, match="shader-f16"):
        plain.allocate(4, np.float16)


# --- memory and conversions -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 7, 1001])
def test_float16_buffers_round_trip_at_odd_lengths(fp16, n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float16)
    buf = fp16.allocate(n, np.float16)
    fp16.upload(x, buf)
    back = np.empty(n, np.float16)
    fp16.download(buf, back)
    np.testing.assert_array_equal(back, x)
    t = lp.SharedTensor.from_numpy(x.reshape(1, n), np.float16)
    assert t.read(fp16).dtype == F16 and fp16.view(t.read(fp16), (n,)).shape == (n,)
    np.testing.assert_array_equal(t.to_numpy(), x.reshape(1, n))


def test_casts_round_to_nearest_even_and_overflow_to_infinity(fp16):
    spacing = 2.0**-10
    x = np.array([1 + spacing / 2, 1 + 3 * spacing / 2, 2049, 2051, -2051, 1e-8, 3e-5, 65504, 65519.9, 65520,
                  -1e6, np.inf, np.nan] + list(np.random.default_rng(0).standard_normal(20) * 300), np.float32)
    f = lp.SharedTensor.from_numpy(x)
    h = lp.SharedTensor(x.shape, np.float16)
    fp16.cast(f.read(fp16), h.write(fp16))
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)  # IEEE conversion, ties to even
    np.testing.assert_array_equal(h.to_numpy(), want)
    back = lp.SharedTensor(x.shape, np.float32)
    fp16.cast(h.read(fp16), back.write(fp16))
    np.testing.assert_array_equal(back.to_numpy(), want.astype(np.float32))
    with pytest.raises(BackendError, match="cannot convert"):
        fp16.cast(f.read(fp16), lp.SharedTensor(x.shape, np.uint32).write(fp16))



def test_a_cast_between_float16_buffers_runs_the_float16_copy(fp16, monkeypatch):
    """cast's float16 -> float16 copy runs inside the elementwise family, past the float16 wrapper: the copy it
    calls picks the float16 kernel itself (a float32 copy would move 4-byte words past the buffer's end)."""
    x = np.arange(7, dtype=np.float16) - 3.5
    h = lp.SharedTensor(x.shape, np.float16)
    src = lp.SharedTensor.from_numpy(x, np.float16).read(fp16)
    fp16.flush()
    entries = []
    encode = fp16._encode
    monkeypatch.setattr(fp16, "_encode", lambda d: (entries.append(d.entry), encode(d)))
    fp16.cast(src, h.write(fp16))
    fp16.flush()
    assert entries == ["copy_h"], entries
    np.testing.assert_array_equal(h.to_numpy(), x)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_embedding_grad_into_a_float16_table_adds_every_row(fp16, beta):
    """Repeated ids add up (np.add.at in float64 is the reference); the scatter's atomics work on float32 bits, so a
    float16 table is accumulated through a float32 copy (it failed building a float16 scatter module)."""
    rng = np.random.default_rng(3)
    ids = np.array([1, 2, 3, 1, 0, 9, 1, 3], np.float32)
    dy = rng.normal(0, 1, (8, 4)).astype(np.float16)
    table = rng.normal(0, 1, (10, 4)).astype(np.float16)
    want = beta * table.astype(np.float64)
    np.add.at(want, ids.astype(int), dy.astype(np.float64))
    dt = lp.SharedTensor.from_numpy(table, np.float16)
    fp16.embedding_grad(lp.SharedTensor.from_numpy(ids).read(fp16), lp.SharedTensor.from_numpy(dy, np.float16).read(
        fp16), dt.read_write(fp16), beta)
    assert _rel(dt.to_numpy(), want) < 4e-3  # float16 rounding of a sum of up to 3 rows and the table


# --- primitives -----------------------------------------------------------------------------------------------------
def _upload(be, x, dtype=np.float16):
    t = lp.SharedTensor.from_numpy(np.asarray(x, dtype), dtype)
    return t, t.read_write(be)


def test_blas_and_reduction_primitives_on_float16_operands(fp16):
    rng = np.random.default_rng(3)
    x = _low(rng.standard_normal((5, 7)), F16)
    y = _low(rng.standard_normal((5, 7)), F16)
    tol = REDUCTION_DEPTH * U
    checks = []
    tx, bx = _upload(fp16, x)
    ty, by = _upload(fp16, y)
    fp16.axpby(0.5, bx, -2.0, by)
    checks.append(("axpby", ty.to_numpy(), 0.5 * x - 2.0 * y))
    tx, bx = _upload(fp16, x)
    fp16.scal(3.0, bx)
    checks.append(("scal", tx.to_numpy(), 3.0 * x))
    tz, bz = _upload(fp16, np.zeros_like(x))
    tx, bx = _upload(fp16, x)
    ty, by = _upload(fp16, y)
    fp16.mul(bx, by, bz)
    checks.append(("mul", tz.to_numpy(), x * y))
    fp16.fill(-0.75, tz.write(fp16))
    checks.append(("fill", tz.to_numpy(), np.full_like(x, -0.75)))
    fp16.copy(tx.read(fp16), tz.write(fp16))
    checks.append(("copy", tz.to_numpy(), x))
    out = lp.SharedTensor((1,), np.float32)
    fp16.dot(bx, by, out.write(fp16))
    checks.append(("dot", out.to_numpy(), [np.sum(x * y)]))
    tc, bc = _upload(fp16, np.full((5, 3), 0.25))
    tw, bw = _upload(fp16, _low(rng.standard_normal((3, 7)), F16))
    fp16.gemm(bx, False, bw, True, bc, 2.0, 0.5)
    checks.append(("gemm", tc.to_numpy(), 2.0 * x @ tw.to_numpy().astype(np.float64).T + 0.125))
    sumsq = lp.SharedTensor.from_numpy(np.array([4.0 * 35], np.float32))  # a norm of 2 sqrt(35), clipped to 1
    tx, bx = _upload(fp16, x)
    fp16.clip_to_norm(bx, sumsq.read(fp16), 1.0)
    checks.append(("clip_to_norm", tx.to_numpy(), x / (2 * np.sqrt(35))))
    for name, got, want in checks:
        err = _rel(got, want)
        WORST[name] = (err, tol)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


def test_in_place_and_several_written_operands_come_back(fp16):
    """An in-place activation (input and output one buffer) and MSE (diff and loss both written)."""
    x = _low(np.linspace(-2, 2, 9), F16)
    t, b = _upload(fp16, x)
    fp16.relu(b, b)
    np.testing.assert_array_equal(t.to_numpy(), np.maximum(x, 0).astype(np.float16))
    target = _low(np.linspace(1, -1, 9), F16)
    tt, bt = _upload(fp16, target)
    diff = lp.SharedTensor((9,), np.float16)
    loss = lp.SharedTensor((1,), np.float16)
    fp16.mse(fp16.view(b, (9, 1)), fp16.view(bt, (9, 1)), fp16.view(diff.write(fp16), (9, 1)), loss.write(fp16))
    want = np.maximum(x, 0) - target
    assert _rel(diff.to_numpy(), want) <= 2 * U
    assert _rel(loss.to_numpy(), [np.mean(want**2)]) <= REDUCTION_DEPTH * U


def _layer_params():
    for type_name, cases in sorted(CASES.items()):
        for i, case in enumerate(cases):
            yield pytest.param(type_name, case, id=f"{type_name}-{i}")


@pytest.mark.parametrize("type_name,case", list(_layer_params()))
def test_layer_in_fp16_against_float64(fp16, type_name, case):
    """Every layer (so every primitive a layer calls) in fp16 on webgpu against float64 native."""
    config, make_inputs = case
    ref_be = lp.backend("native", dtype=np.float64)
    inputs = [_low(x, F16) for x in make_inputs(np.random.default_rng(7))]
    low = lp.Layer.from_config(fp16, lp.LayerConfig("l", config), seed=3)
    ref = lp.Layer.from_config(ref_be, lp.LayerConfig("l", config), seed=3)
    outs = low.forward([x.copy() for x in inputs])
    ref.load_weights({n: np.asarray(w, np.float64) for n, w in low.named_weights().items()})
    out_dtype = np.float32 if low.worker.master_precision_outputs else F16
    assert all(o.dtype == out_dtype for o in outs), [o.dtype for o in outs]
    rng = np.random.default_rng(11)
    dys = [_low(rng.standard_normal(o.shape), F16) for o in outs]
    if type_name == "Dropout":  # the same masks: both layers draw from the same seed
        low.worker.calls = 0
    low_outs = [o.to_numpy() for o in low.forward([x.copy() for x in inputs])]
    low_dx = low.backward(dys)
    ref_outs = [o.to_numpy() for o in ref.forward([x.copy() for x in inputs])]
    ref_dx = ref.backward(dys)
    tol = GROWTH * _roundings(type_name, low, inputs) * U
    key = f"{type_name}-{CASES[type_name].index(case)}"

    def close(got, want, what):
        err = _rel(got, want)
        WORST[key] = (max(WORST.get(key, (0.0, tol))[0], err), tol)
        assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"

    for i, (a, b) in enumerate(zip(low_outs, ref_outs)):
        close(a, b, f"output {i}")
    for i, (a, b) in enumerate(zip(low_dx, ref_dx)):
        if b is not None:
            assert a.dtype == F16
            close(a.to_numpy(), b.to_numpy(), f"input gradient {i}")
    ref_grads = dict(zip(ref.learnable_weights_names(), ref.learnable_weights_gradients()))
    for name, g in zip(low.learnable_weights_names(), low.learnable_weights_gradients()):
        assert g.dtype == np.float32, f"{name}: weight gradients are float32 masters"
        if not name.endswith(("running_mean", "running_var")):
            close(g.to_numpy(), ref_grads[name].to_numpy(), f"gradient of {name}")


# --- training -------------------------------------------------------------------------------------------------------
def _lenet(batch: int, hidden: int = 16, **solver) -> lp.SolverConfig:
    net = lp.SequentialConfig(inputs=[("data", [batch, 1, 8, 8])])
    net.add_layer(lp.LayerConfig("conv1", lp.ConvolutionConfig(num_output=4, filter_shape=[3], stride=[1],
                                                               padding=[1])))
    net.add_layer(lp.LayerConfig("relu1", "ReLU"))
    net.add_layer(lp.LayerConfig("pool1", lp.PoolingConfig(mode="max", filter_shape=[2], stride=[2], padding=[0])))
    net.add_layer(lp.LayerConfig("flat", "Flatten"))
    net.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=hidden)))
    net.add_layer(lp.LayerConfig("tanh", "TanH"))
    net.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=10)))
    net.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    obj = lp.SequentialConfig(inputs=[("network_out", [batch, 10]), ("label", [batch, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=10)))
    return lp.SolverConfig(network=lp.LayerConfig("lenet", net), objective=lp.LayerConfig("loss", obj),
                           solver="momentum", base_lr=0.1, momentum=0.9, seed=1, **solver)


@pytest.mark.parametrize("loss_scale,hidden", [(None, 16), ("none", 16), (None, 512)],
                         ids=["dynamic-scaling", "no-scaling", "split-k"])
def test_lenet_trains_in_fp16_as_native_emulates_it(fp16, loss_scale, hidden):
    """Same weights, same batches: webgpu fp16 against native's fp16 emulation, step by step; with loss scaling or
    without, the steps are recorded and replayed; with 512 hidden units fc2's float16 product splits K (its float32
    partials summed into the float16 logits)."""
    steps, batch = 5, 8
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((batch, 1, 8, 8)).astype(np.float32) for _ in range(steps)]
    ys = [rng.integers(0, 10, (batch, 1)).astype(np.float32) for _ in range(steps)]
    runs = []
    for be in (lp.backend("native", precision="fp16"), fp16):
        solver = lp.Solver.from_config(be, be, _lenet(batch, hidden, loss_scale=loss_scale))
        replays = getattr(be, "replays", 0)
        outs, losses = [], []
        for x, y in zip(xs, ys):
            out = solver.train_minibatch(x, y)
            assert out.dtype == np.float32  # LogSoftmax's output stays float32
            outs.append(out.to_numpy().astype(np.float64))
            losses.append(float(solver.objective.outputs[0].to_numpy().reshape(-1)[0]))
        weights = {n: w.to_numpy() for n, w in zip(solver.network.learnable_weights_names(),
                                                   solver.network.learnable_weights_data())}
        runs.append((outs, losses, weights, getattr(be, "replays", 0) - replays))
    (n_outs, n_losses, n_weights, _), (w_outs, w_losses, w_weights, replays) = runs
    assert replays == steps - 2, "steps after the second should replay their recording"
    assert np.all(np.diff(n_losses[:1] + w_losses) != 0)
    for step in range(steps):
        tol = TRAINING_ULPS * U * (step + 1)
        assert _rel(w_outs[step], n_outs[step]) <= tol, f"output of step {step}"
        assert abs(w_losses[step] - n_losses[step]) / max(1.0, abs(n_losses[step])) <= tol, f"loss of step {step}"
    for name, w in n_weights.items():
        assert w_weights[name].dtype == np.float32
        assert _rel(w_weights[name], w) <= TRAINING_ULPS * U * steps, name


def test_a_network_of_winograd_convolutions_trains_in_fp16_as_native_emulates_it(fp16, monkeypatch):
    """A 3x3 and a 5x5 convolution of 64 channels (webgpu: F(4x4, 3x3) and F(3x3, 5x5), every pass) in a network
    trained by momentum with dynamic loss scaling: four steps, outputs, losses and weights against native's float16
    emulation (direct convolutions), as the LeNet above."""
    steps, batch = 4, 2
    net = lp.SequentialConfig(inputs=[("data", [batch, 64, 6, 6])])
    for name, k in (("conv3", 3), ("conv5", 5)):
        net.add_layer(lp.LayerConfig(name, lp.ConvolutionConfig(num_output=64, filter_shape=[k], stride=[1],
                                                                padding=[k // 2])))
        net.add_layer(lp.LayerConfig("relu" + name[-1], "ReLU"))
    net.add_layer(lp.LayerConfig("flat", "Flatten"))
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=10)))
    net.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    obj = lp.SequentialConfig(inputs=[("network_out", [batch, 10]), ("label", [batch, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=10)))
    config = lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj),
                             solver="momentum", base_lr=0.02, momentum=0.9, seed=3)
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((batch, 64, 6, 6)).astype(np.float32) for _ in range(steps)]
    ys = [rng.integers(0, 10, (batch, 1)).astype(np.float32) for _ in range(steps)]
    blocks = []
    setup = fp16.convs._winograd_setup

    def counted(x, y, r, *a, **k):
        blocks.append((r, fp16.winograd_block(r)))
        return setup(x, y, r, *a, **k)

    monkeypatch.setattr(fp16.convs, "_winograd_setup", counted)
    runs = []
    for be in (lp.backend("native", precision="fp16"), fp16):
        solver = lp.Solver.from_config(be, be, config)
        outs, losses = [], []
        for x, y in zip(xs, ys):
            outs.append(solver.train_minibatch(x, y).to_numpy().astype(np.float64))
            losses.append(float(solver.objective.outputs[0].to_numpy().reshape(-1)[0]))
        runs.append((outs, losses, {n: w.to_numpy() for n, w in zip(solver.network.learnable_weights_names(),
                                                                    solver.network.learnable_weights_data())}))
    assert {(3, 4), (5, 3)} <= set(blocks), blocks
    (n_outs, n_losses, n_weights), (w_outs, w_losses, w_weights) = runs
    assert np.all(np.diff(n_losses) != 0)
    for step in range(steps):
        tol = TRAINING_ULPS * U * (step + 1)
        assert _rel(w_outs[step], n_outs[step]) <= tol, f"output of step {step}"
        assert abs(w_losses[step] - n_losses[step]) / max(1.0, abs(n_losses[step])) <= tol, f"loss of step {step}"
    for name, w in n_weights.items():
        assert _rel(w_weights[name], w) <= TRAINING_ULPS * U * steps, name


def test_replayed_steps_and_inference_between_them_read_the_current_master_weights(fp16):
    """Training steps recorded and replayed, an inference pass before the recorded one and after each replay: every
    step's output and every pass computes from the master weights as they are then (a step recorded while the
    float16 copies are current still casts them, as its replays follow updates; a replay's update is a change the
    next pass sees), against float64."""
    solver = _linear_solver(fp16)
    net = solver.network
    rng = np.random.default_rng(4)
    x, t = rng.standard_normal((6, 5)), rng.standard_normal((6, 3))
    replays = fp16.replays
    for step in range(5):
        if step == 1:  # the copies are current when the step is recorded
            _assert_forward_reads_the_masters(net, x, F16, U)
        w, b = (_low(m.to_numpy(), F16) for m in net.learnable_weights_data())
        out = solver.train_minibatch(x, t).to_numpy()
        assert _rel(out, _low(x, F16) @ w.T + b) <= 4 * U, f"output of step {step}"
        if step >= 2:  # after a replay
            _assert_forward_reads_the_masters(net, x, F16, U)
    assert fp16.replays - replays == 3, "steps after the second replay their recording"


@pytest.mark.parametrize("shape", [(4, 3, 5), (3, 7, 1001)])  # one partial workgroup; 20 of 1024 and a part
def test_activations_and_bias_add_run_in_float16_kernels(fp16, shape):
    """One dispatch each (no conversions around a float32 kernel), in place and out of place, against float64."""
    rng = np.random.default_rng(5)
    x = _low(rng.standard_normal(shape), F16)
    dy = _low(rng.standard_normal(shape), F16)
    bias = _low(rng.standard_normal(shape[1]), F16)
    tx, bx = _upload(fp16, x)
    tdy, bdy = _upload(fp16, dy)
    ty = lp.SharedTensor(x.shape, np.float16)
    tdx = lp.SharedTensor(x.shape, np.float16)
    fp16.flush()
    before = fp16.dispatches
    fp16.activation("sigmoid", bx, ty.write(fp16))
    fp16.activation_grad("sigmoid", ty.read(fp16), bdy, tdx.write(fp16))
    fp16.relu(bx, bx)
    for b in (bias.astype(np.float16), bias.astype(np.float32)):
        fp16.bias_add(bx, lp.SharedTensor.from_numpy(b, b.dtype).read(fp16))
    assert fp16.dispatches - before == 5
    y = 1 / (1 + np.exp(-x))
    assert _rel(ty.to_numpy(), y) <= U
    assert _rel(tdx.to_numpy(), dy * _low(y, F16) * (1 - _low(y, F16))) <= 2 * U
    assert _rel(tx.to_numpy(), np.maximum(x, 0) + 2 * bias[None, :, None]) <= 2 * U


@pytest.mark.parametrize("m,n,k,ta,tb,a_dtype,c_dtype,beta,dispatches", [
    (20, 12, 40, False, True, np.float16, np.float16, 0.0, 1),   # a linear layer's forward: one kernel
    (70, 130, 33, True, False, np.float16, np.float16, 0.5, 1),  # larger tiles, beta read from a float16 C
    (16, 24, 1500, True, False, np.float16, np.float32, 1.0, 2),  # a weight gradient into float32: split K, summed
    # a linear layer's forward with a long K and few tiles (AlexNet's fully connected layers): split K too, the
    # float32 partials summed into the float16 product (a workgroup per output; a thread per output past 16384)
    (8, 64, 2048, False, True, np.float16, np.float16, 0.0, 2),
    (64, 300, 1024, False, True, np.float16, np.float16, 0.5, 2),
    (8, 36, 9, False, True, np.float32, np.float32, 0.0, 1),     # a recurrent product: float32 state, float16 weights
])
def test_gemm_reads_float16_and_accumulates_in_float32(fp16, m, n, k, ta, tb, a_dtype, c_dtype, beta, dispatches):
    rng = np.random.default_rng(m + n + k)
    a = _low(rng.standard_normal((k, m) if ta else (m, k)), F16)
    b = _low(rng.standard_normal((n, k) if tb else (k, n)), F16)
    c0 = _low(rng.standard_normal((m, n)), F16)
    ta_, ba = _upload(fp16, a, a_dtype)
    tb_, bb = _upload(fp16, b)
    tc, bc = _upload(fp16, c0, c_dtype)
    fp16.flush()
    before = fp16.dispatches
    fp16.gemm(fp16.view(ba, a.shape), ta, fp16.view(bb, b.shape), tb, fp16.view(bc, (m, n)), 1.5, beta)
    fp16.flush()
    assert fp16.dispatches - before == dispatches
    want = 1.5 * (a.T if ta else a) @ (b.T if tb else b) + beta * c0
    err = _rel(tc.to_numpy(), want)
    tol = REDUCTION_DEPTH * U if c_dtype == np.float16 else 1e-4  # float32 C: float32 sums of up to 1500 terms only
    WORST[f"gemm {m}x{n}x{k} C {np.dtype(c_dtype)}"] = (err, tol)
    assert tc.to_numpy().dtype == c_dtype and err <= tol, err


@pytest.mark.parametrize("n,c,o,size,kernel,stride,pad", [
    (2, 3, 4, 7, 3, (1, 1), (1, 1)),
    (3, 16, 16, 6, 3, (1, 1), (1, 1)),   # 3x3 stride 1 below WINOGRAD_MIN_CHANNELS: an implicit GEMM
    (2, 2, 5, 9, 5, (2, 2), (2, 1)),
])
def test_convolution_runs_as_float16_implicit_gemms(fp16, n, c, o, size, kernel, stride, pad):
    """Forward with a bias, data gradient and filter gradient (into float32, accumulating with beta 0.5): one GEMM
    dispatch each (two for a split filter gradient), against float64 loops over output positions."""
    rng = np.random.default_rng(n * c + o)
    x = _low(rng.standard_normal((n, c, size, size)), F16)
    w = _low(rng.standard_normal((o, c, kernel, kernel)), F16)
    b = _low(rng.standard_normal(o), F16)
    y_ref = reference.conv2d(x, w, b, stride, pad)
    dy = _low(rng.standard_normal(y_ref.shape), F16)
    dw0 = rng.standard_normal(w.shape).astype(np.float32)
    dx_ref, dw_ref, _ = reference.conv2d_backward(x, w, dy, stride, pad)
    tx, bx = _upload(fp16, x)
    tw, bw = _upload(fp16, w)
    tb, bb = _upload(fp16, b)
    tdy, bdy = _upload(fp16, dy)
    tdw, bdw = _upload(fp16, dw0, np.float32)
    y = lp.SharedTensor(y_ref.shape, np.float16)
    dx = lp.SharedTensor(x.shape, np.float16)
    fp16.flush()
    before = fp16.dispatches
    fp16.conv2d(bx, bw, y.write(fp16), stride, pad, {}, bias=bb)
    fp16.conv2d_grad_data(bdy, bw, dx.write(fp16), stride, pad, {})
    fp16.flush()
    assert fp16.dispatches - before == 2
    fp16.conv2d_grad_filter(bx, bdy, bdw, stride, pad, {}, 0.5)
    tol = REDUCTION_DEPTH * U
    for name, got, want in (("conv2d", y.to_numpy(), y_ref), ("conv2d_grad_data", dx.to_numpy(), dx_ref),
                            ("conv2d_grad_filter", tdw.to_numpy(), dw_ref + 0.5 * dw0)):
        err = _rel(got, want)
        WORST[f"{name} {n}x{c}x{size}x{size} by {o}x{kernel}x{kernel}"] = (err, tol)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"
    assert tdw.to_numpy().dtype == np.float32


# --- Winograd convolutions ------------------------------------------------------------------------------------------
# F(MxM, RxR)'s matrices (Lavin and Gray; winograd.wgsl's comments): B^T, G and A^T, by (M, R). F(4x4, 3x3) and
# F(2x2, 5x5) share their points (0, +-1, +-2, infinity) and so B^T.
_BT6 = np.array([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
                 [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]], np.float64)
_WINOGRAD = {
    (2, 3): (np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64),
             np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]]),
             np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float64)),
    (4, 3): (_BT6,
             np.array([[1 / 4, 0, 0], [-1 / 6] * 3, [-1 / 6, 1 / 6, -1 / 6], [1 / 24, 1 / 12, 1 / 6],
                       [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]]),
             np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
                      np.float64)),
    (2, 5): (_BT6,
             np.array([[1 / 4, 0, 0, 0, 0], [-1 / 6] * 5, [-1 / 6, 1 / 6, -1 / 6, 1 / 6, -1 / 6],
                       [1 / 24, 1 / 12, 1 / 6, 1 / 3, 2 / 3], [1 / 24, -1 / 12, 1 / 6, -1 / 3, 2 / 3],
                       [0, 0, 0, 0, 1]]),
             np.array([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 1]], np.float64)),
    # F(3x3, 5x5)'s, as the backend builds them (the test checks them against the direct correlation first)
    (3, 5): tuple(np.array(a, np.float64) for a in toom_cook(3, 5, F35_POINTS)),
}
EPS32 = 2.0**-24
TRANSFORM_STEPS = 26
"""Roundings on a path through the transforms: up to 8 in the filter (or dy) transform, 8 in the input transform, 9
in the output (or filter-gradient) transform with the bias, 1 for the product; the GEMM adds its K."""
WINOGRAD_Z = 4.0
"""Standard deviations of the float32 error allowed: the float32 path's measured errors on these shapes stay
below 1.8 sigma (their rms is 0.27 sigma: the estimate is conservative)."""


def _tiles(x, pad: int, r: int, oh: int, ow: int, m: int):
    """x's (M+R-1)x(M+R-1) patches under each MxM block of an OH x OW output: [N][C][TH][TW][M+R-1][M+R-1]."""
    n, c, h, wd = x.shape
    th, tw, t = -(-oh // m), -(-ow // m), m + r - 1
    xp = np.zeros((n, c, m * th + r - 1, m * tw + r - 1))
    xp[:, :, pad:pad + h, pad:pad + wd] = x
    return np.stack([np.stack([xp[:, :, m * i:m * i + t, m * j:m * j + t] for j in range(tw)], 2)
                     for i in range(th)], 2)


def _winograd_forward(x, w, pad: int, m: int, power: int = 1):
    """The correlation of x with w [O][C][R][R] padded by ``pad``, as Winograd F(MxM, RxR) in float64 with every
    matrix and value raised to ``power``: power 1 is the algorithm itself, power 2 the sum of the squares of every
    term of its expansion (what independent roundings add up to in quadrature)."""
    r = w.shape[2]
    bt, g, at = (a**power for a in _WINOGRAD[m, r])
    oh, ow = x.shape[2] + 2 * pad - r + 1, x.shape[3] + 2 * pad - r + 1
    u = np.einsum("ai,ocij,bj->ocab", g, w**power, g)
    v = np.einsum("ai,ncyxij,bj->ncyxab", bt, _tiles(x, pad, r, oh, ow, m)**power, bt)
    y = np.einsum("pa,ocab,ncyxab,qb->noypxq", at, u, v, at)
    return y.reshape(x.shape[0], w.shape[0], m * y.shape[2], m * y.shape[4])[:, :, :oh, :ow]


def _winograd_sigmas(x, w, dy, pad: int, m: int) -> tuple:
    """Estimated standard deviations of the float32 Winograd path's errors in y, dx and dw (each element): the
    roundings of 2**-24 relative at the K + TRANSFORM_STEPS steps of a path, independent, add in quadrature
    (Higham, Accuracy and Stability of Numerical Algorithms, 2.8): 2**-24 sqrt(K + TRANSFORM_STEPS) times the root
    of the summed squares of the algorithm's terms. A worst-case bound (the same steps on absolute values) is
    hundreds of u for F(2x2, 5x5), whose points 0, +-1, +-2 and infinity amplify the float32 roundings."""
    n, c = x.shape[:2]
    o, r = w.shape[0], w.shape[2]
    oh, ow = dy.shape[2:]
    sigma_y = EPS32 * np.sqrt(c + TRANSFORM_STEPS) * np.sqrt(_winograd_forward(x, w, pad, m, power=2))
    flipped = w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)  # the data gradient: dy through w rotated, channels swapped
    sigma_dx = EPS32 * np.sqrt(o + TRANSFORM_STEPS) * np.sqrt(_winograd_forward(dy, flipped, r - 1 - pad, m,
                                                                                  power=2))
    bt, g, at = (a**2 for a in _WINOGRAD[m, r])
    th, tw = -(-oh // m), -(-ow // m)
    blocks = np.zeros((n, o, m * th, m * tw))
    blocks[:, :, :oh, :ow] = dy**2
    blocks = blocks.reshape(n, o, th, m, tw, m).transpose(0, 1, 2, 4, 3, 5)
    z = np.einsum("ia,noyxij,jb->noyxab", at, blocks, at)  # A dy A^T, squared
    v = np.einsum("ai,ncyxij,bj->ncyxab", bt, _tiles(x, pad, r, oh, ow, m)**2, bt)
    du = np.einsum("noyxab,ncyxab->ocab", z, v)
    sigma_dw = EPS32 * np.sqrt(n * th * tw + TRANSFORM_STEPS) * np.sqrt(np.einsum("ai,ocab,bj->ocij", g, du, g))
    return sigma_y, sigma_dx, sigma_dw


@pytest.mark.parametrize("n,c,o,size,kernel,pad,dw_dtype,chunked", [
    (1, 64, 72, 6, 3, 0, np.float32, False),
    (2, 64, 72, 5, 3, 1, np.float16, True),    # one sample per chunk: each transform and GEMM twice
    (1, 72, 64, 4, 3, 2, np.float32, False),
    (1, 64, 72, 7, 5, 0, np.float32, False),
    (1, 72, 64, 6, 5, 1, np.float16, False),
    (1, 64, 64, 5, 5, 2, np.float32, False),
])
def test_winograd_convolutions_in_float16_against_float64(fp16, monkeypatch, n, c, o, size, kernel, pad, dw_dtype,
                                                          chunked):
    """Stride-1 3x3 and 5x5 convolutions with at least WINOGRAD_MIN_CHANNELS channels run forward (with a float16
    bias), data gradient and filter gradient (into float32 or float16, with beta 0.5) as Winograd F(2x2, RxR) on
    float16 x, w and dy, against float64 loops over output positions.

    The error model: float16 inputs are exact, the transforms, tiles and GEMM sums are float32, and a float16 result
    is rounded once, when stored (u relative). The float32 part is estimated per element by _winograd_sigmas and
    allowed WINOGRAD_Z of its sigmas: |got - want| <= u max(1, |want|) (float16 results) + Z sigma + the float32
    store's and beta's roundings. On these shapes that is at most 0.2 u past the rounding for F(2x2, 3x3) and 2.2 u
    for F(2x2, 5x5), within the REDUCTION_DEPTH u a primitive may take."""
    import reference

    rng = np.random.default_rng(n + c + o + size + kernel + pad)
    x = _low(rng.standard_normal((n, c, size, size)), F16)
    w = _low(rng.standard_normal((o, c, kernel, kernel)) * 0.5, F16)
    b = _low(rng.standard_normal(o), F16)
    stride, padding = (1, 1), (pad, pad)
    y_ref = reference.conv2d(x, w, b, stride, padding)
    dy = _low(rng.standard_normal(y_ref.shape), F16)
    dw0 = _low(rng.standard_normal(w.shape), F16)
    dx_ref, dw_ref, _ = reference.conv2d_backward(x, w, dy, stride, padding)
    m = fp16.winograd_block(kernel)  # F(4x4, 3x3) and F(2x2, 5x5)
    np.testing.assert_allclose(_winograd_forward(x, w, pad, m), y_ref - b.reshape(1, -1, 1, 1), atol=1e-9)
    sigmas = _winograd_sigmas(x, w, dy, pad, m)
    if chunked:
        blocks = (-(-(size + 2 * pad - kernel + 1) // m)) ** 2  # per sample
        monkeypatch.setattr(fp16, "WINOGRAD_SCRATCH", 4 * (m + kernel - 1) ** 2 * max(c, o) * blocks)
    calls = []
    for name in ("_winograd", "_winograd_filter_grad"):
        method = getattr(fp16, name)
        monkeypatch.setattr(fp16, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    monkeypatch.setattr(fp16, "convert", lambda x, out: pytest.fail("a float16 operand was converted"))
    _, bx = _upload(fp16, x)
    _, bw = _upload(fp16, w)
    _, bb = _upload(fp16, b)
    _, bdy = _upload(fp16, dy)
    tdw, bdw = _upload(fp16, dw0, dw_dtype)
    y, dx = lp.SharedTensor(y_ref.shape, np.float16), lp.SharedTensor(x.shape, np.float16)
    fp16.flush()
    counts = [fp16.dispatches]
    fp16.conv2d(bx, bw, y.write(fp16), stride, padding, {}, bias=bb)
    fp16.flush()
    counts.append(fp16.dispatches)
    fp16.conv2d_grad_data(bdy, bw, dx.write(fp16), stride, padding, {})
    counts.append(fp16.dispatches)
    fp16.conv2d_grad_filter(bx, bdy, bdw, stride, padding, {}, 0.5)
    counts.append(fp16.dispatches)
    assert calls == ["_winograd", "_winograd", "_winograd_filter_grad"]
    per_chunk = 3 * (2 if chunked else 1)  # a filter transform, then an input transform, a GEMM and an output each
    assert [b - a for a, b in zip(counts, counts[1:])] == [1 + per_chunk] * 3
    for name, got, want, sigma in (("conv2d", y.to_numpy(), y_ref, sigmas[0]),
                                   ("conv2d_grad_data", dx.to_numpy(), dx_ref, sigmas[1]),
                                   ("conv2d_grad_filter", tdw.to_numpy(), dw_ref + 0.5 * dw0, sigmas[2])):
        scale = np.maximum(1.0, np.abs(want))
        rounding = U if got.dtype == F16 else 4 * EPS32  # float16: the store; float32: the store and beta's terms
        tol = rounding + WINOGRAD_Z * sigma / scale
        assert got.dtype == (dw_dtype if name == "conv2d_grad_filter" else F16)
        assert tol.max() <= REDUCTION_DEPTH * U, f"{name}: the estimate leaves the primitive budget"
        err = np.abs(got.astype(np.float64) - want) / scale
        WORST[f"{name} Winograd {n}x{c}x{size}x{size} by {o}x{kernel}x{kernel} pad {pad}"] = (
            float(err.max()), float(tol.max()))
        worst = np.unravel_index(np.argmax(err - tol), err.shape)
        assert np.all(err <= tol), f"{name}: relative error {err[worst]:.3g} > {tol[worst]:.3g} at {worst}"


@pytest.mark.parametrize("kernel,pad", [(3, 1), (5, 2)])
def test_winograd_float16_tiles_for_3x3_windows(fp16, monkeypatch, kernel, pad):
    """With ``winograd_f16_tiles`` a 3x3 convolution's transformed tiles and their products under F(2x2, 3x3) are
    float16 (the batched tile product reads and writes float16; the filter gradient's sums stay float32), within
    the primitive budget of REDUCTION_DEPTH u against float64 (each tile is one more float16 rounding); 5x5 windows,
    and 3x3 ones under F(4x4, 3x3) (the default), keep float32 tiles (the coefficients of their points made float16
    tiles ~20 u off)."""
    import reference

    monkeypatch.setattr(fp16, "winograd_f16_tiles", True)
    monkeypatch.setattr(fp16, "winograd_f4x4", False)
    rng = np.random.default_rng(kernel)
    n, c, o, size = 2, 64, 64, 6
    x = _low(rng.standard_normal((n, c, size, size)), F16)
    w = _low(rng.standard_normal((o, c, kernel, kernel)) / np.sqrt(c * kernel * kernel), F16)
    stride, padding = (1, 1), (pad, pad)
    y_ref = reference.conv2d(x, w, np.zeros(o), stride, padding)
    dy = _low(rng.standard_normal(y_ref.shape), F16)
    dx_ref, dw_ref, _ = reference.conv2d_backward(x, w, dy, stride, padding)
    modules = []
    encode = fp16._encode
    monkeypatch.setattr(fp16, "_encode", lambda d: (modules.append((d.module, d.entry)), encode(d)))
    _, bx = _upload(fp16, x)
    _, bw = _upload(fp16, w)
    _, bdy = _upload(fp16, dy)
    y, dx = lp.SharedTensor(y_ref.shape, np.float16), lp.SharedTensor(x.shape, np.float16)
    dw = lp.SharedTensor(w.shape, np.float32)
    fp16.conv2d(bx, bw, y.write(fp16), stride, padding, {})
    fp16.conv2d_grad_data(bdy, bw, dx.write(fp16), stride, padding, {})
    fp16.conv2d_grad_filter(bx, bdy, dw.write(fp16), stride, padding, {}, 0.0)
    fp16.flush()
    products = [m for m, e in modules if m.startswith("gemm")]
    assert any(e == "winograd_input" for _, e in modules), modules
    if kernel == 3:  # forward and data gradient: float16 tile products; the filter gradient: float32 sums
        assert products.count("gemm16ABC") >= 2 and "gemm16AB" in products, products
    else:
        assert "gemm16ABC" not in products and "gemm16AB" not in products, products
    for name, got, want in (("conv2d", y, y_ref), ("conv2d_grad_data", dx, dx_ref), ("conv2d_grad_filter", dw,
                                                                                     dw_ref)):
        err = float(np.abs(got.to_numpy().astype(np.float64) - want).max() / np.abs(want).max())
        WORST[f"{name} Winograd float16 tiles {kernel}x{kernel}"] = (err, REDUCTION_DEPTH * U)
        assert err <= REDUCTION_DEPTH * U, f"{name}: {err:.3g}"


@pytest.mark.parametrize("min_channels,winograd", [(64, True), (65, False)])
def test_float16_convolutions_choose_winograd_as_float32_does(fp16, monkeypatch, min_channels, winograd):
    """A 3x3 stride-1 convolution of 64 channels in and out: with WINOGRAD_MIN_CHANNELS 64 both precisions take
    Winograd for all three passes (float16 with no float32 copies), and an in-place ReLU joins the float16 output
    transform's store; at 65 both take the implicit GEMMs (one dispatch a pass for forward and filter gradient)."""
    plain = lp.backend("webgpu")
    shapes = ((2, 64, 5, 5), (64, 64, 3, 3), (2, 64, 5, 5))
    for be in (fp16, plain):
        monkeypatch.setattr(be, "WINOGRAD_MIN_CHANNELS", min_channels)
        assert bool(be.convs.winograd_chunk(*shapes, (1, 1), (1, 1))) == winograd
    calls = []
    for name in ("_winograd", "_winograd_filter_grad"):
        method = getattr(fp16, name)
        monkeypatch.setattr(fp16, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    monkeypatch.setattr(fp16, "convert", lambda x, out: pytest.fail("a float16 operand was converted"))
    rng = np.random.default_rng(21)
    x = _low(rng.standard_normal(shapes[0]), F16)
    w = _low(rng.standard_normal(shapes[1]) * 0.5, F16)
    dy = _low(rng.standard_normal(shapes[2]), F16)
    _, bx = _upload(fp16, x)
    _, bw = _upload(fp16, w)
    _, bdy = _upload(fp16, dy)
    y, dx = lp.SharedTensor(shapes[2], np.float16), lp.SharedTensor(shapes[0], np.float16)
    dw = lp.SharedTensor(shapes[1], np.float32)
    fp16.flush()
    counts = [fp16.dispatches]
    by = y.write(fp16)
    fp16.conv2d(bx, bw, by, (1, 1), (1, 1), {})
    fp16.relu(by, by)
    fp16.flush()
    counts.append(fp16.dispatches)
    fp16.conv2d_grad_filter(bx, bdy, dw.write(fp16), (1, 1), (1, 1), {}, 0.0)
    fp16.flush()
    counts.append(fp16.dispatches)
    fp16.conv2d_grad_data(bdy, bw, dx.write(fp16), (1, 1), (1, 1), {})
    assert calls == (["_winograd", "_winograd_filter_grad", "_winograd"] if winograd else [])
    assert [b - a for a, b in zip(counts, counts[1:])] == ([4, 4] if winograd else [1, 1])
    import reference

    want_dx, want_dw, _ = reference.conv2d_backward(x, w, dy, (1, 1), (1, 1))
    assert _rel(y.to_numpy(), np.maximum(reference.conv2d(x, w, None, (1, 1), (1, 1)), 0)) <= REDUCTION_DEPTH * U
    assert _rel(dx.to_numpy(), want_dx) <= REDUCTION_DEPTH * U
    assert _rel(dw.to_numpy(), want_dw) <= REDUCTION_DEPTH * U


@pytest.mark.parametrize("mode", ["max", "average"])
def test_pooling_runs_in_float16_kernels(fp16, mode):
    """2x2 windows of stride 2: one dispatch forward, one backward, against float64 window reductions."""
    rng = np.random.default_rng(9)
    x = _low(rng.standard_normal((2, 3, 6, 8)), F16)
    windows = x.reshape(2, 3, 3, 2, 4, 2).transpose(0, 1, 2, 4, 3, 5).reshape(2, 3, 3, 4, 4)
    y_ref = windows.max(axis=-1) if mode == "max" else windows.mean(axis=-1)
    dy = _low(rng.standard_normal(y_ref.shape), F16)
    if mode == "max":
        picked = windows == y_ref[..., None]
        dx_win = picked * dy[..., None]
    else:
        dx_win = np.repeat(dy[..., None] / 4, 4, axis=-1)
    dx_ref = dx_win.reshape(2, 3, 3, 4, 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(x.shape)
    tx, bx = _upload(fp16, x)
    tdy, bdy = _upload(fp16, dy)
    y, dx = lp.SharedTensor(y_ref.shape, np.float16), lp.SharedTensor(x.shape, np.float16)
    mask = fp16.view(fp16.allocate(y_ref.size, np.int32), y_ref.shape) if mode == "max" else None
    fp16.flush()
    before = fp16.dispatches
    fp16.pool2d(bx, y.write(fp16), mask, mode, (2, 2), (2, 2), (0, 0))
    fp16.pool2d_grad(bdy, dx.write(fp16), mask, mode, (2, 2), (2, 2), (0, 0))
    fp16.flush()
    assert fp16.dispatches - before == 2
    assert _rel(y.to_numpy(), y_ref) <= U and _rel(dx.to_numpy(), dx_ref) <= U


@pytest.mark.parametrize("shape,dispatches", [((37, 6), 1), ((5, 4, 3, 7), 2)])
def test_bias_gradient_sums_float16_in_float32(fp16, shape, dispatches):
    """Per-channel sums of a float16 dy into a float32 gradient with beta: one pass over dy, then the partials."""
    rng = np.random.default_rng(4)
    dy = _low(rng.standard_normal(shape), F16)
    db0 = rng.standard_normal(shape[1]).astype(np.float32)
    tdy, bdy = _upload(fp16, dy)
    tdb, bdb = _upload(fp16, db0, np.float32)
    fp16.flush()
    before = fp16.dispatches
    fp16.bias_grad(bdy, bdb, 0.5)
    fp16.flush()
    assert fp16.dispatches - before == dispatches
    axes = tuple(i for i in range(len(shape)) if i != 1)
    assert _rel(tdb.to_numpy(), dy.sum(axis=axes) + 0.5 * db0) <= 1e-5  # float32 sums of exact float16 values


def test_dropout_products_in_place_and_an_aliased_gradient(fp16):
    """x *= mask (float32) in place in one float16 kernel; a gradient written over the output it reads (no float16
    in-place twin for that) still comes out right, by emulation."""
    rng = np.random.default_rng(8)
    x = _low(rng.standard_normal(50), F16)
    mask = np.where(rng.random(50) < 0.3, 0.0, 1 / 0.7).astype(np.float32)
    tx, bx = _upload(fp16, x)
    tm, bm = _upload(fp16, mask, np.float32)
    fp16.flush()
    before = fp16.dispatches
    fp16.mul(bx, bm, bx)
    fp16.flush()
    assert fp16.dispatches - before == 1
    assert _rel(tx.to_numpy(), x * mask) <= U
    y = _low(np.abs(rng.standard_normal(50)) * (rng.random(50) < 0.5), F16)
    dy = _low(rng.standard_normal(50), F16)
    ty, by = _upload(fp16, y)
    _, bdy = _upload(fp16, dy)
    fp16.activation_grad("relu", by, bdy, by)
    np.testing.assert_array_equal(ty.to_numpy(), np.where(y > 0, dy, 0).astype(np.float16))


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("classes", [10, 700])
def test_softmax_reads_float16_and_its_gradient_writes_float16(fp16, log, classes):
    """Forward from a float16 x into the float32 output the objective reads, gradient from float32 into a float16
    dx: one dispatch each, against float64."""
    rng = np.random.default_rng(classes)
    x = _low(rng.standard_normal((6, classes)) * 3, F16)
    dy = rng.standard_normal((6, classes)).astype(np.float32)
    _, bx = _upload(fp16, x)
    y, dx = lp.SharedTensor(x.shape, np.float32), lp.SharedTensor(x.shape, np.float16)
    _, bdy = _upload(fp16, dy, np.float32)
    fp16.flush()
    before = fp16.dispatches
    (fp16.log_softmax if log else fp16.softmax)(bx, y.write(fp16))
    (fp16.log_softmax_grad if log else fp16.softmax_grad)(y.read(fp16), bdy, dx.write(fp16))
    fp16.flush()
    assert fp16.dispatches - before == 2
    e = np.exp(x - x.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    want_y = np.log(p) if log else p
    want_dx = dy - p * dy.sum(axis=1, keepdims=True) if log else p * (dy - (dy * p).sum(axis=1, keepdims=True))
    assert _rel(y.to_numpy(), want_y) <= 1e-5  # float32 output
    assert _rel(dx.to_numpy(), want_dx) <= 2 * U


@pytest.mark.parametrize("bias_dtype,dispatches", [(np.float16, 1), (np.float32, 3)])
def test_bias_and_relu_join_the_float16_gemm_store(fp16, bias_dtype, dispatches):
    """A linear layer's product, bias and in-place ReLU: one dispatch where the bias has the product's dtype (a
    float32 bias is added by its own kernel, and the ReLU then by its own), against float64 with one rounding at
    the store."""
    rng = np.random.default_rng(2)
    x = _low(rng.standard_normal((9, 20)), F16)
    w = _low(rng.standard_normal((12, 20)), F16)
    b = _low(rng.standard_normal(12), F16)
    _, bx = _upload(fp16, x)
    _, bw = _upload(fp16, w)
    _, bb = _upload(fp16, b, bias_dtype)
    y = lp.SharedTensor((9, 12), np.float16)
    fp16.flush()
    before = fp16.dispatches
    by = y.write(fp16)
    fp16.gemm(fp16.view(bx, x.shape), False, fp16.view(bw, w.shape), True, by)
    fp16.bias_add(by, bb)
    fp16.relu(by, by)
    fp16.flush()
    assert fp16.dispatches - before == dispatches
    want = np.maximum(x @ w.T + b, 0)
    if bias_dtype == np.float32:  # the product is rounded to float16 before the bias is added
        want = np.maximum(_low(x @ w.T, F16) + b, 0)
    assert _rel(y.to_numpy(), want) <= 2 * U


@pytest.mark.parametrize("rows", [4, 701])  # 24 elements; 4,206 (four threads' worth each, the last block partial)
def test_level1_blas_and_blocks_run_in_float16_kernels(fp16, rows):
    """copy, fill, scal, axpby and a Concat block: one dispatch each, no conversions."""
    x = _low(np.linspace(-3, 3, rows * 6).reshape(rows, 6), F16)
    tx, bx = _upload(fp16, x)
    ty, by = _upload(fp16, np.zeros_like(x))
    whole = lp.SharedTensor((rows, 9), np.float16)
    bw = whole.write(fp16)
    fp16.flush()
    before = fp16.dispatches
    fp16.fill(0.5, bw)
    fp16.copy(bx, by)
    fp16.scal(-2.0, by)
    fp16.axpby(1.0, bx, 0.25, by)
    fp16.copy_block(by, bw, 6, 9, 2, True)
    fp16.flush()
    assert fp16.dispatches - before == 5
    want = np.full((rows, 9), 0.5)
    want[:, 2:8] = x - 0.5 * x
    assert _rel(whole.to_numpy(), want) <= 2 * U


def test_overflowing_loss_scale_skips_steps_as_on_native(fp16):
    """A scale of 2**40 overflows float16's gradients to infinity: the steps are skipped and the scale backed off
    exactly as under native's emulation, and the weights stay untouched while it does."""
    steps, batch = 4, 8
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((batch, 1, 8, 8)).astype(np.float32) for _ in range(steps)]
    ys = [rng.integers(0, 10, (batch, 1)).astype(np.float32) for _ in range(steps)]
    runs = []
    for be in (lp.backend("native", precision="fp16"), fp16):
        solver = lp.Solver.from_config(be, be, _lenet(batch, loss_scale_init=2.0**40))
        first = [w.to_numpy() for w in solver.network.learnable_weights_data()]
        trace = []
        for x, y in zip(xs, ys):
            solver.train_minibatch(x, y)
            trace.append((solver.skipped_steps, solver.loss_scale))
        runs.append(trace)
        if be is fp16:
            assert trace[0] == (1, 2.0**39)
            if trace[1][0] == 2:  # still skipping: nothing moved
                for w0, w in zip(first, solver.network.learnable_weights_data()):
                    np.testing.assert_array_equal(w.to_numpy(), w0)
    assert runs[1] == runs[0]


def test_batch_norm_runs_in_float16_kernels(fp16, monkeypatch):
    """Statistics, normalisation and both backward passes on a float16 x, y, dy and dx (float32 statistics,
    weights and sums) with no float32 copies made, against float64."""
    conversions = []
    convert = fp16.convert
    monkeypatch.setattr(fp16, "convert", lambda x, out: conversions.append(x.shape) or convert(x, out))
    rng = np.random.default_rng(12)
    x = _low(rng.standard_normal((4, 3, 5, 2)) * 2 + 1, F16)
    dy = _low(rng.standard_normal(x.shape), F16)
    gamma, beta = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    eps = 1e-5
    _, bx = _upload(fp16, x)
    _, bdy = _upload(fp16, dy)
    f32 = {k: lp.SharedTensor((3,), np.float32) for k in ("mean", "var", "sum_dy", "sum_dy_xhat")}
    g, b = (lp.SharedTensor.from_numpy(v) for v in (gamma, beta))
    y, dx = lp.SharedTensor(x.shape, np.float16), lp.SharedTensor(x.shape, np.float16)
    mean, var, sdy, sdx = (f32[k].write(fp16) for k in ("mean", "var", "sum_dy", "sum_dy_xhat"))
    fp16.batch_norm_stats(bx, mean, var)
    fp16.batch_norm(bx, mean, var, g.read(fp16), b.read(fp16), y.write(fp16), eps)
    fp16.batch_norm_grad_sums(bx, bdy, mean, var, sdy, sdx, eps)
    fp16.batch_norm_grad(bx, bdy, mean, var, g.read(fp16), sdy, sdx, dx.write(fp16), eps, True)
    assert conversions == []
    want = reference.batch_norm(x, dy, gamma, beta, eps)
    assert _rel(f32["mean"].to_numpy(), want.mean) <= 1e-5 and _rel(f32["var"].to_numpy(), want.var) <= 1e-5
    assert _rel(y.to_numpy(), want.y) <= 2 * U
    assert _rel(f32["sum_dy_xhat"].to_numpy(), want.sum_dy_xhat) <= 1e-4
    assert _rel(dx.to_numpy(), want.dx) <= 2 * U


def test_lrn_runs_in_float16_kernels(fp16, monkeypatch):
    """Caffe's across-channel LRN and its gradient on float16 x, y, dy and dx (a float32 scale), no float32
    copies made, against float64."""
    conversions = []
    convert = fp16.convert
    monkeypatch.setattr(fp16, "convert", lambda x, out: conversions.append(x.shape) or convert(x, out))
    rng = np.random.default_rng(13)
    x = _low(rng.standard_normal((2, 6, 3, 3)), F16)
    dy = _low(rng.standard_normal(x.shape), F16)
    size, alpha, beta, k = 5, 0.5, 0.75, 2.0
    _, bx = _upload(fp16, x)
    _, bdy = _upload(fp16, dy)
    scale = lp.SharedTensor(x.shape, np.float32)
    y, dx = lp.SharedTensor(x.shape, np.float16), lp.SharedTensor(x.shape, np.float16)
    fp16.lrn(bx, scale.write(fp16), y.write(fp16), size, alpha, beta, k)
    fp16.lrn_grad(bx, y.read(fp16), scale.read(fp16), bdy, dx.write(fp16), size, alpha, beta)
    assert conversions == []
    sq = np.pad(x**2, ((0, 0), (size // 2, size // 2), (0, 0), (0, 0)))
    s = k + alpha / size * sum(sq[:, i:i + 6] for i in range(size))
    y_ref = x * s**-beta
    ratio = np.pad(dy * _low(y_ref, F16) / s, ((0, 0), (size // 2, size // 2), (0, 0), (0, 0)))
    dx_ref = dy * s**-beta - 2 * alpha * beta / size * x * sum(ratio[:, i:i + 6] for i in range(size))
    assert _rel(scale.to_numpy(), s) <= 1e-5
    assert _rel(y.to_numpy(), y_ref) <= 2 * U
    assert _rel(dx.to_numpy(), dx_ref) <= 2 * U


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
def test_recurrent_layers_and_embeddings_make_no_float32_copies(fp16, monkeypatch, cell):
    """An Embedding feeding a recurrent layer, forward and backward in fp16: every conversion is a cast (the input,
    the weight copies), none is a float32 copy made for a kernel; the float16 results match float64 (the layer table
    above covers their values)."""
    casting, conversions = [], []
    convert, cast = fp16.convert, fp16.cast

    def converting(x, out):
        if not casting:
            conversions.append(x.shape)
        convert(x, out)

    def casting_to(x, out):
        casting.append(1)
        cast(x, out)
        casting.clear()

    monkeypatch.setattr(fp16, "convert", converting)
    monkeypatch.setattr(fp16, "cast", casting_to)
    config = {"LSTM": lp.LSTMConfig, "GRU": lp.GRUConfig, "RNN": lp.RNNConfig}[cell](hidden_size=5,
                                                                                     return_sequences=True)
    net = lp.SequentialConfig(inputs=[("ids", [3, 4])], force_backward=False)
    net.add_layer(lp.LayerConfig("emb", lp.EmbeddingConfig(input_dim=11, output_dim=6)))
    net.add_layer(lp.LayerConfig("rec", config))
    layer = lp.Layer.from_config(fp16, lp.LayerConfig("net", net), seed=4)
    ids = np.random.default_rng(0).integers(0, 11, (3, 4)).astype(np.float32)
    out = layer.forward([ids])[0]
    layer.backward([np.ones(out.shape, np.float32)])
    grads = [g.to_numpy() for g in layer.learnable_weights_gradients()]
    assert conversions == [] and all(np.isfinite(g).all() and np.abs(g).sum() > 0 for g in grads)


def test_float16_tensors_past_the_binding_limit_run_on_float32_copies(fp16, monkeypatch):
    """With a 1 KiB binding limit the float16 kernels step aside: conversions and the float32 kernels go in pieces."""
    be = lp.backend("webgpu", precision="fp16", power_preference="low-power")  # an instance whose limit we lower
    monkeypatch.setattr(be, "max_binding", 1024)
    rng = np.random.default_rng(6)
    x = _low(rng.standard_normal(3001), F16)
    tx, bx = _upload(be, x)
    ty = lp.SharedTensor((3001,), np.float16)
    be.activation("tanh", bx, ty.write(be))
    assert _rel(ty.to_numpy(), np.tanh(x)) <= U
    v = _low(rng.standard_normal((30, 2, 25)) * 3 + 1, F16)
    _, bv = _upload(be, v)
    mean, var = lp.SharedTensor((2,), np.float32), lp.SharedTensor((2,), np.float32)
    y = lp.SharedTensor(v.shape, np.float16)
    be.batch_norm_stats(bv, mean.write(be), var.write(be))
    be.batch_norm(bv, mean.read(be), var.read(be), None, None, y.write(be), 1e-5)
    ref = (v - v.mean(axis=(0, 2), keepdims=True)) / np.sqrt(v.var(axis=(0, 2), keepdims=True) + 1e-5)
    assert _rel(y.to_numpy(), ref) <= 2 * U


def test_full_precision_twin_shares_the_device_and_its_command_stream(fp16):
    twin = fp16.full_precision()
    assert (fp16.precision, fp16.compute_dtype, fp16.mixed) == ("fp16", F16, True)
    assert (twin.precision, twin.compute_dtype, twin.mixed) == ("fp32", np.dtype(np.float32), False)
    assert isinstance(twin, Backend) and twin.key == fp16.key and twin.full_precision() is twin
    assert fp16.full_precision() is twin and lp.backend("webgpu").full_precision() is lp.backend("webgpu")
    # work queued on either runs in the order it was queued: the twin's fill lands before the backend's scal
    t = lp.SharedTensor((5,), np.float32)
    twin.fill(2.0, t.write(twin))
    fp16.scal(3.0, t.read_write(fp16))
    np.testing.assert_array_equal(t.to_numpy(), np.full(5, 6.0))
