"""Every layer, a whole solver step and checkpoints on the GPU backends, against native.

Each device backend is tried; where its package or device is missing the tests skip with the reason."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest
import random_nets
from conftest import backend_or_skip
from test_gradients import CASES

import leafpy as lp

ROOT = os.path.join(os.path.dirname(__file__), "..")

DEVICE_BACKENDS = [
    pytest.param(("cuda", {}), id="cuda", marks=pytest.mark.cuda),
    pytest.param(("cuda", {"use_cudnn": False}), id="cuda-im2col", marks=pytest.mark.cuda),
    pytest.param(("cuda", {"channels_last": True}), id="cuda-channels-last", marks=pytest.mark.cuda),
    pytest.param(("webgpu", {}), id="webgpu", marks=pytest.mark.webgpu),
]
CHANNELS_LAST_NATIVE = pytest.param(("native", {"channels_last": True}), id="native-channels-last")
"""4-D tensors stored NHWC on the CPU: the channels-last code paths and their conversions, against row-major
native (the cuda backend's channels-last primitives are its own, tested above on a GPU)."""


def _backend_param(request):
    name, options = request.param
    return backend_or_skip(name, **options)


@pytest.fixture(params=DEVICE_BACKENDS)
def device(request):
    return _backend_param(request)


@pytest.fixture(params=[*DEVICE_BACKENDS, CHANNELS_LAST_NATIVE])
def device_or_layout(request):
    """The device backends, and native storing 4-D tensors channels-last."""
    return _backend_param(request)


def close(a, b, what, rtol=2e-4, atol=2e-5):
    scale = max(float(np.abs(b).max()), 1.0)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale, err_msg=what)


def _gemm_matches_numpy(be, m, n, k, ta, tb, alpha, beta, what, seed=0):
    """C = alpha op(A) op(B) + beta C on ``be`` against NumPy, from random operands of those shapes."""
    rng = np.random.default_rng(seed)
    a = rng.random((k, m) if ta else (m, k), dtype=np.float32)
    b = rng.random((n, k) if tb else (k, n), dtype=np.float32)
    c0 = rng.random((m, n), dtype=np.float32)
    tc = lp.SharedTensor.from_numpy(c0)
    be.gemm(lp.SharedTensor.from_numpy(a).read(be), ta, lp.SharedTensor.from_numpy(b).read(be), tb,
            tc.read_write(be), alpha, beta)
    ref = alpha * ((a.T if ta else a) @ (b.T if tb else b)) + beta * c0
    close(tc.to_numpy(), ref, what, rtol=1e-4, atol=1e-5)


def _cases():
    for type_name, cases in sorted(CASES.items()):
        for i, case in enumerate(cases):
            yield pytest.param(case, id=f"{type_name}-{i}")


@pytest.mark.parametrize("case", list(_cases()))
def test_layer_matches_native(device_or_layout, case):
    device = device_or_layout
    config, make_inputs = case
    native = lp.backend("native")
    rng = np.random.default_rng(11)
    inputs = [x.astype(np.float32) for x in make_inputs(rng)]
    results = []
    for be in (native, device):
        layer = lp.Layer.from_config(be, lp.LayerConfig("l", config), seed=5)
        outs = [o.to_numpy() for o in layer.forward(inputs)]
        douts = [np.random.default_rng(3).standard_normal(o.shape).astype(np.float32) for o in outs]
        grads = layer.backward(douts)
        results.append((outs, [g.to_numpy() if g is not None else None for g in grads],
                        [g.to_numpy() for g in layer.learnable_weights_gradients()]))
    (o1, g1, w1), (o2, g2, w2) = results
    for a, b in zip(o2, o1):
        close(a, b, "output")
    for a, b in zip(g2, g1):
        assert (a is None) == (b is None)
        if a is not None:
            close(a, b, "input gradient")
    for a, b in zip(w2, w1):
        close(a, b, "weight gradient")


@pytest.mark.parametrize("seed", random_nets.DEFAULT_SEEDS)
def test_random_networks_match_native(device_or_layout, seed):
    # every layer type, branches, in-place runs, nested containers, shared weights, ids and labels, in training
    # or inference mode (tests/random_nets.py), at the declared batch and at another one
    check_random_network_matches_native(device_or_layout, seed)


def check_random_network_matches_native(device, seed, rtol=2e-4, atol=2e-5):
    """random_case(seed) on ``device`` against native float32: outputs, input gradients, weight gradients."""
    case = random_nets.random_case(seed)
    rng = np.random.default_rng(seed)
    nets = [random_nets.build(be, case.config, np.random.default_rng(seed), case.training)
            for be in (lp.backend("native"), device)]
    for batch in (case.inputs[0].shape[0], 3):
        xs = case.make_inputs(rng, batch, np.float32)
        given = [x.copy() for x in xs]
        outs = [[o.to_numpy() for o in net.forward(xs)] for net in nets]
        for i, (a, b) in enumerate(zip(outs[1], outs[0])):
            close(a, b, f"{case}: output {i}", rtol, atol)
        dys = [rng.standard_normal(o.shape).astype(np.float32) for o in outs[0]]  # a Slice may leave several
        dxs = [net.backward(dys) for net in nets]
        for i, (a, b) in enumerate(zip(dxs[1], dxs[0])):
            assert (a is None) == (b is None), f"{case}: input {i}"
            if a is not None:
                close(a.to_numpy(), b.to_numpy(), f"{case}: gradient of input {i}", rtol, atol)
        grads = [[g.to_numpy() for g in net.learnable_weights_gradients()] for net in nets]
        for name, a, b in zip(nets[0].learnable_weights_names(), grads[1], grads[0]):
            if name not in random_nets.untrained(nets[0]):
                close(a, b, f"{case}: {name} gradient", rtol, atol)
        for x, x0 in zip(xs, given):
            np.testing.assert_array_equal(x, x0, err_msg=f"{case}: a forward or backward pass changed its input")


def _solver(backend, dropout=True, **changes):
    """The default model's solver; without ``dropout`` its steps are replayable (no per-step masks)."""
    import dataclasses

    run = lp.config.load(os.path.join(ROOT, "configs", "digits_lenet.yaml"))
    if not dropout:
        seq = run.solver.network.config
        seq.layers = [lc for lc in seq.layers if lc.type != "Dropout"]
    return lp.Solver.from_config(backend, backend, dataclasses.replace(run.solver, **changes))


@pytest.mark.parametrize("changes,atol", [
    pytest.param(dict(solver="momentum", base_lr=0.05), 1e-4, id="momentum"),
    pytest.param(dict(solver="nesterov", base_lr=0.05), 1e-4, id="nesterov"),
    pytest.param(dict(solver="rmsprop", base_lr=0.001), 5e-4, id="rmsprop"),
    pytest.param(dict(solver="adam", base_lr=0.001), 5e-4, id="adam"),
    pytest.param(dict(solver="adamw", base_lr=0.001), 5e-4, id="adamw"),
    pytest.param(dict(solver="adagrad", base_lr=0.01), 5e-4, id="adagrad"),
    pytest.param(dict(solver="adadelta", base_lr=1.0, epsilon=1e-6), 5e-4, id="adadelta"),
    pytest.param(dict(solver="momentum", base_lr=0.05, minibatch_size=2, lr_policy="step", stepsize=1, gamma=0.5),
                 1e-4, id="momentum-accumulated"),
])
def test_solver_steps_match_native(device_or_layout, changes, atol):
    # Adam and RMSprop divide by sqrt(v): where a gradient is near zero the step is decided by rounding, hence a
    # looser atol
    device = device_or_layout
    ds = lp.data.digits()
    batches = list(lp.data.batches(ds.x_train[:96], ds.y_train[:96], 32, seed=0))
    solvers = [_solver(be, momentum=0.9, clip_gradients=10.0, weight_decay=1e-3, **changes)
               for be in (lp.backend("native"), device)]
    for xb, yb in batches:
        for s in solvers:
            s.train_minibatch(xb, yb)
    assert solvers[0].loss() == pytest.approx(solvers[1].loss(), rel=1e-3)
    for a, b in zip(*(s.network.learnable_weights_data() for s in solvers)):
        close(b.to_numpy(), a.to_numpy(), "weights after 3 steps", rtol=1e-3, atol=atol)


def test_batch_norm_trains_and_infers_as_on_native(device_or_layout):
    """Running statistics written on the device reach the host; inference (fixed statistics) and its gradient."""
    device = device_or_layout
    cfg = lp.SequentialConfig(inputs=[("data", [16, 1, 8, 8])])
    cfg.add_layer(lp.LayerConfig("conv", lp.ConvolutionConfig(num_output=4, filter_shape=[3])))
    cfg.add_layer(lp.LayerConfig("bn", lp.BatchNormConfig()))
    cfg.add_layer(lp.LayerConfig("relu", "ReLU"))
    cfg.add_layer(lp.LayerConfig("flat", "Flatten"))
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=10)))
    cfg.add_layer(lp.LayerConfig("bn2", lp.BatchNormConfig(affine=False)))
    cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    obj = lp.SequentialConfig(inputs=[("out", [16, 10]), ("label", [16, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=10)))
    sol = lp.SolverConfig(network=lp.LayerConfig("net", cfg), objective=lp.LayerConfig("loss", obj),
                          solver="momentum", base_lr=0.05, momentum=0.9, seed=0)
    ds = lp.data.digits()
    solvers = [lp.Solver.from_config(be, be, sol) for be in (lp.backend("native"), device)]
    for xb, yb in lp.data.batches(ds.x_train[:48], ds.y_train[:48], 16, seed=0):
        for s in solvers:
            s.train_minibatch(xb, yb)
    for name, a, b in zip(solvers[0].network.learnable_weights_names(),
                          *(s.network.learnable_weights_data() for s in solvers)):
        close(b.to_numpy(), a.to_numpy(), f"{name} after 3 steps", rtol=1e-3, atol=1e-4)
    x = ds.x_test[:5]
    # forward passes alone (no solver step after them) leave the running statistics readable on the host
    nets = [lp.Layer.from_config(be, lp.LayerConfig("net", cfg), seed=1) for be in (lp.backend("native"), device)]
    for net in nets:
        net.forward([ds.x_test[:16]])
        net.forward([ds.x_test[16:40]])
    for name, a, b in zip(nets[0].learnable_weights_names(), *(n.learnable_weights_data() for n in nets)):
        close(b.to_numpy(), a.to_numpy(), f"{name} after two forward passes", rtol=1e-4, atol=1e-5)
    moved = dict(zip(nets[1].learnable_weights_names(), nets[1].learnable_weights_data()))["bn/running_mean"]
    assert np.any(moved.to_numpy() != 0)
    dy = np.random.default_rng(0).standard_normal((5, 10)).astype(np.float32)
    results = []
    for s in solvers:
        s.network.set_training(False)
        results.append((s.network.forward([x])[0].to_numpy(), s.network.backward([dy])))
    close(results[1][0], results[0][0], "inference output", rtol=1e-3, atol=1e-4)
    for name, a, b in zip(solvers[0].network.learnable_weights_names(),
                          *(s.network.learnable_weights_gradients() for s in solvers)):
        close(b.to_numpy(), a.to_numpy(), f"{name} gradient in inference", rtol=1e-3, atol=1e-4)


def test_checkpoints_move_between_backends(device_or_layout, tmp_path):
    device = device_or_layout
    native = lp.backend("native")
    x = lp.data.digits().x_test[:16]
    for src, dst in ((device, native), (native, device)):
        s = _solver(src)
        s.train_minibatch(x, np.arange(16) % 10)
        s.save_checkpoint(tmp_path / "c.leaf")
        t = lp.Solver.load_checkpoint(dst, dst, tmp_path / "c.leaf")
        assert t.iteration == 1
        s.network.set_training(False)
        t.network.set_training(False)
        close(t.network.forward([x])[0].to_numpy(), s.network.forward([x])[0].to_numpy(), "outputs")


def test_a_training_step_moves_no_data(device_or_layout):
    device = device_or_layout
    s = _solver(device)
    ds = lp.data.digits()
    x = lp.SharedTensor.from_numpy(ds.x_train[:32])
    y = lp.SharedTensor.from_numpy(ds.y_train[:32].astype(np.float32))
    s.train_minibatch(x, y)  # uploads the batch once
    lp.SharedTensor.reset_transfer_count()
    for _ in range(3):
        s.train_minibatch(x, y)
    device.synchronize()
    assert lp.SharedTensor.transfers_total == 0
    assert np.isfinite(s.loss())  # reading the loss is the caller's choice
    assert lp.SharedTensor.transfers_total == 1


REPLAYED_RULES = {"momentum": 0.05, "nesterov": 0.05, "rmsprop": 0.001, "adagrad": 0.01, "adadelta": 1.0}
"""Every rule a step may be recorded and replayed with, and a learning rate for it."""


@pytest.mark.cuda
@pytest.mark.parametrize("rule", sorted(REPLAYED_RULES))
def test_cuda_graph_replay_equals_eager_steps(rule):
    graphs, eager = backend_or_skip("cuda", graphs=True), backend_or_skip("cuda", graphs=False)
    import dataclasses

    run = lp.config.load(os.path.join(ROOT, "configs", "digits_mlp.yaml"))
    cfg = dataclasses.replace(run.solver, lr_policy="step", stepsize=3, solver=rule, base_lr=REPLAYED_RULES[rule])
    solvers = [lp.Solver.from_config(be, be, cfg) for be in (graphs, eager)]
    ds = lp.data.digits()
    batches = list(lp.data.batches(ds.x_train[:256], ds.y_train[:256], 32, seed=0))
    for i, (xb, yb) in enumerate(batches):
        if i == 5:  # weights changed on the host between steps must reach the replayed step
            for s in solvers:
                w = s.network.learnable_weights_data()[0]
                w.set(w.to_numpy() * 0.5)
        for s in solvers:
            s.train_minibatch(xb, yb)
    recorded = [e for e in graphs.recorder.steps.values() if e.recording is not None]
    assert recorded, f"no step was recorded as a CUDA graph: {graphs.record_error}"
    assert solvers[0].loss() == pytest.approx(solvers[1].loss(), rel=1e-5)
    for a, b in zip(*(s.network.learnable_weights_data() for s in solvers)):
        close(a.to_numpy(), b.to_numpy(), "weights", rtol=1e-5, atol=1e-6)


@pytest.mark.webgpu
def test_webgpu_step_is_one_submission():
    be = backend_or_skip("webgpu")
    run = lp.config.load(os.path.join(ROOT, "configs", "digits_mlp.yaml"))  # no dropout: no per-step seed
    s = lp.Solver.from_config(be, be, run.solver)
    ds = lp.data.digits()
    x = lp.SharedTensor.from_numpy(ds.x_train[:32])
    y = lp.SharedTensor.from_numpy(ds.y_train[:32].astype(np.float32))
    s.train_minibatch(x, y)
    s.train_minibatch(x, y)
    before, dispatched = be.submissions, be.dispatches
    pipelines, groups = len(be.gpu.pipelines), len(be.gpu.bind_groups)
    for _ in range(3):
        s.train_minibatch(x, y)
    assert be.submissions - before == 3  # no readback or upload inside a step
    assert be.dispatches - dispatched > 3 * 10
    assert (len(be.gpu.pipelines), len(be.gpu.bind_groups)) == (pipelines, groups)  # everything cached


@pytest.mark.webgpu
@pytest.mark.parametrize("rule", sorted(REPLAYED_RULES))
def test_webgpu_replayed_steps_equal_encoded_ones_and_see_host_changes(monkeypatch, rule):
    """Replayable steps are re-encoded from their recorded dispatches; they train exactly as steps run through the
    layers, including after weights are set from the host between steps."""
    replaying = backend_or_skip("webgpu", power_preference="low-power")  # separate instances whose option we can change
    encoding = backend_or_skip("webgpu", adapter=replaying.adapter_name)
    monkeypatch.setattr(encoding, "replay", False)
    ds = lp.data.digits()
    x, y = ds.x_train[:32], ds.y_train[:32]
    solvers = [_solver(be, dropout=False, solver=rule, base_lr=REPLAYED_RULES[rule]) for be in (replaying, encoding)]
    before = replaying.replays
    for step in range(6):
        if step == 4:  # the same new weights in both, from the host
            for s in solvers:
                w = s.network.learnable_weights_data()[0]
                w.set(np.full(w.shape, 0.01, np.float32))
        for s in solvers:
            s.train_minibatch(x, y)
    assert replaying.replays - before >= 3, "steps from the third on are replayed"
    assert encoding.replays == 0
    a, b = solvers
    assert a.loss() == pytest.approx(b.loss(), rel=1e-5)
    for wa, wb in zip(a.network.learnable_weights_data(), b.network.learnable_weights_data()):
        close(wa.to_numpy(), wb.to_numpy(), "weights", rtol=1e-5, atol=1e-7)


@pytest.mark.webgpu
def test_webgpu_replay_runs_the_recorded_work_and_never_a_step_that_allocates():
    be = backend_or_skip("webgpu", power_preference="low-power")
    acc = lp.SharedTensor.from_numpy(np.zeros(300, np.float32))
    one = lp.SharedTensor.from_numpy(np.ones(300, np.float32))
    one.read(be)

    def step():  # acc += 1
        be.axpby(1.0, one.read(be), 1.0, acc.read_write(be))

    before = be.replays
    for _ in range(5):
        be.run_step(("counting", 1), step)
    assert be.replays - before == 3  # first sight runs, second records, the rest replay
    np.testing.assert_array_equal(acc.to_numpy(), np.full(300, 5.0, np.float32))
    acc.set(np.full(300, 10.0, np.float32))  # a host change reaches the replayed step
    be.run_step(("counting", 1), step)
    np.testing.assert_array_equal(acc.to_numpy(), np.full(300, 11.0, np.float32))

    def allocating():  # a temporary per step: its buffer may be another tensor's by the next step
        tmp = lp.SharedTensor((300,))
        be.copy(one.read(be), tmp.write(be))
        be.axpby(1.0, tmp.read(be), 1.0, acc.read_write(be))

    before = be.replays
    for _ in range(4):
        be.run_step(("allocating", 1), allocating)
    assert be.replays == before and be.recorder.steps[("allocating", 1)].eager
    np.testing.assert_array_equal(acc.to_numpy(), np.full(300, 15.0, np.float32))


@pytest.mark.webgpu
def test_webgpu_recorded_steps_of_a_deleted_solver_are_dropped():
    import gc

    be = backend_or_skip("webgpu", power_preference="low-power")
    ds = lp.data.digits()
    s = _solver(be, dropout=False, solver="momentum")
    for _ in range(3):
        s.train_minibatch(ds.x_train[:32], ds.y_train[:32])
    assert any(e.recording is not None for e in be.recorder.steps.values())
    weights = weakref.ref(s.network.learnable_weights_data()[0])
    del s
    gc.collect()
    assert weights() is None, "a recorded step kept the deleted solver's weights alive"
    t = _solver(be, dropout=False, solver="momentum")
    t.train_minibatch(ds.x_train[:32], ds.y_train[:32])
    assert not any(e.dead() for e in be.recorder.steps.values())


@pytest.mark.webgpu
def test_webgpu_splits_work_over_the_binding_limit(monkeypatch):
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose limit we can lower
    monkeypatch.setattr(be, "max_binding", 1024)  # bytes: forces elementwise work into pieces
    rng = np.random.default_rng(0)
    x = rng.standard_normal(5000).astype(np.float32)
    tx, ty = lp.SharedTensor.from_numpy(x), lp.SharedTensor((5000,))
    be.relu(tx.read(be), ty.write(be))
    np.testing.assert_allclose(ty.to_numpy(), np.maximum(x, 0))
    b = rng.standard_normal(10).astype(np.float32)
    y4 = lp.SharedTensor.from_numpy(x.reshape(5, 10, 100))
    be.bias_add(y4.read_write(be), lp.SharedTensor.from_numpy(b).read(be))
    np.testing.assert_allclose(y4.to_numpy(), x.reshape(5, 10, 100) + b.reshape(1, 10, 1), rtol=1e-6)
    v = x.reshape(50, 2, 50) * 3 + 1  # samples of 400 bytes, 20000 bytes in all: batch norm in runs and pieces
    mean, var, y = (lp.SharedTensor(s) for s in ((2,), (2,), v.shape))
    tv = lp.SharedTensor.from_numpy(v)
    be.batch_norm_stats(tv.read(be), mean.write(be), var.write(be))
    be.batch_norm(tv.read(be), mean.read(be), var.read(be), None, None, y.write(be), 1e-5)
    ref = (v - v.mean(axis=(0, 2), keepdims=True)) / np.sqrt(v.var(axis=(0, 2), keepdims=True) + 1e-5)
    np.testing.assert_allclose(y.to_numpy(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.webgpu
def test_webgpu_adapter_choice_and_errors():
    be = backend_or_skip("webgpu")
    from leafpy.backends.webgpu import adapters

    names = adapters()
    assert be.adapter_name in names
    by_name = lp.backend("webgpu", adapter=be.adapter_name.split(" ")[0])
    assert by_name.adapter_name == be.adapter_name
    with pytest.raises(lp.BackendUnavailable, match="no adapter matches 'no-such-gpu'"):
        lp.backend("webgpu", adapter="no-such-gpu")
    with pytest.raises(lp.ConfigError, match="float32"):
        lp.backend("webgpu", dtype="float64")


@pytest.mark.webgpu
def test_webgpu_backends_share_one_device_per_adapter_and_features_and_keep_their_tensors_apart():
    """A process that makes many webgpu backends (a notebook re-running its cells, a test suite, a sweep) opens one
    wgpu device per adapter and feature set; each backend still has its own tensors, and a tensor one backend wrote
    and has not yet submitted reads back right on another."""
    from leafpy.backends.webgpu import device as webgpu_device

    first = backend_or_skip("webgpu", subgroups=False)
    opened = len(webgpu_device._DEVICES)
    made = [lp.backend("webgpu", subgroups=False) for _ in range(12)]
    assert len(webgpu_device._DEVICES) == opened
    assert all(b.gpu.device is first.gpu.device for b in made)
    assert len({b.key for b in (first, *made)}) == 13  # a tensor's copies tell the backends apart
    x = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    t, y, z = lp.SharedTensor.from_numpy(x), lp.SharedTensor((3, 4)), lp.SharedTensor((3, 4))
    made[0].relu(t.read(made[0]), y.write(made[0]))  # encoded on made[0], not yet submitted
    made[1].relu(y.read(made[1]), z.write(made[1]))  # made[1] takes y from made[0]
    np.testing.assert_array_equal(z.to_numpy(), np.maximum(x, 0))
    del made
    gc.collect()
    again = lp.backend("webgpu", subgroups=False)
    assert again.gpu.device is first.gpu.device and len(webgpu_device._DEVICES) == opened
    if "subgroup" in first.adapter.features:  # another feature set: another device
        other = lp.backend("webgpu", subgroups=True)
        assert other.gpu.device is not first.gpu.device


@pytest.mark.parametrize("m,n,k,ta,tb,beta", [
    (70, 90, 50, False, False, 0.0), (20, 25, 5000, False, True, 0.0), (30, 40, 9000, True, False, 0.5),
    (129, 65, 33, True, True, 1.0), (200, 130, 40, False, False, 0.0), (130, 257, 70, True, False, 1.0),
    (140, 150, 3000, False, True, 0.5), (256, 128, 17, True, True, 0.0)])
def test_gemm_shapes_transposes_and_split_k(device, m, n, k, ta, tb, beta):
    _gemm_matches_numpy(device, m, n, k, ta, tb, 2.0, beta, "gemm")


@pytest.mark.cuda
def test_cuda_tracks_peak_memory_in_use():
    be = backend_or_skip("cuda", graphs=False)
    be.track_memory()
    t = lp.SharedTensor((1 << 20,))
    t.write(be)
    assert be.peak_memory() >= 4 << 20
    del t


def _cuda_graphs_and_eager(**options):
    """A cuda backend that records steps, one that runs them eagerly (both with ``options``), and a batch of the
    default model's data."""
    graphs, eager = backend_or_skip("cuda", **options), backend_or_skip("cuda", graphs=False, **options)
    ds = lp.data.digits()
    return graphs, eager, ds.x_train[:32], ds.y_train[:32]


@pytest.mark.cuda
def test_cuda_graphs_of_a_deleted_solver_are_not_replayed_for_a_new_one():
    import gc

    graphs, eager, x, y = _cuda_graphs_and_eager()
    for round_ in range(3):  # new solvers often land at a deleted one's address
        losses = []
        for be in (graphs, eager):
            s = _solver(be, dropout=False, solver="momentum")
            for _ in range(4):
                s.train_minibatch(x, y)
            losses.append(s.loss())
            if be is graphs:
                assert any(e.recording is not None for e in be.recorder.steps.values()), be.record_error
            del s
            gc.collect()
        assert losses[0] == pytest.approx(losses[1], rel=1e-4), f"round {round_}"


@pytest.mark.cuda
def test_cuda_graphs_of_two_live_solvers_alternating_equal_eager():
    """Each recorded step owns its scratch memory: one solver's replay never writes another's tensors. Both backends
    keep only convolution plans that agree to 1e-5 (implicit GEMMs): plans chosen by timing on a busy GPU differ
    between the two, and a max pooling's choice flipped by their rounding changes conv1's gradient far more than the
    rounding itself."""
    graphs, eager, x, y = _cuda_graphs_and_eager(conv_tolerance=1e-5)
    rules = ("momentum", "nesterov")  # adaptive rules would amplify plan-dependent rounding of tiny gradients
    pairs = {str(be.graphs): [_solver(be, dropout=False, solver=r) for r in rules] for be in (graphs, eager)}
    for _ in range(6):
        for solvers in pairs.values():
            for s in solvers:
                s.train_minibatch(x, y)
    assert sum(e.recording is not None for e in graphs.recorder.steps.values()) >= 2, graphs.record_error
    for a, b in zip(*pairs.values()):
        assert a.loss() == pytest.approx(b.loss(), rel=1e-4)
        for wa, wb in zip(a.network.learnable_weights_data(), b.network.learnable_weights_data()):
            close(wa.to_numpy(), wb.to_numpy(), "weights", rtol=1e-4, atol=1e-6)


@pytest.mark.cuda
def test_cuda_recorded_steps_do_not_keep_a_deleted_solver_alive():
    import gc

    be = backend_or_skip("cuda")
    ds = lp.data.digits()
    s = _solver(be, dropout=False, solver="momentum")
    for _ in range(3):
        s.train_minibatch(ds.x_train[:32], ds.y_train[:32])
    assert any(e.recording is not None for e in be.recorder.steps.values()), be.record_error
    weights = weakref.ref(s.network.learnable_weights_data()[0])
    del s
    gc.collect()
    assert weights() is None, "a recorded step kept the deleted solver's weights alive"
    be.run_step(("another",), lambda: None)  # the next step drops what the deleted solver left
    assert not any(e.recording is not None for e in be.recorder.steps.values())


@pytest.mark.webgpu
def test_webgpu_buffers_return_to_a_pool():
    import gc

    be = backend_or_skip("webgpu")
    t = lp.SharedTensor((1234,))
    t.write(be)
    raw = t.buffer_on(be.key).raw
    del t
    gc.collect()
    u = lp.SharedTensor((1234,))
    u.write(be)
    assert u.buffer_on(be.key).raw is raw


@pytest.mark.webgpu
@pytest.mark.parametrize("m,n,k,ta,tb,beta", [(300, 200, 50, False, True, 0.0), (100, 250, 30, False, False, 0.5),
                                              (90, 300, 20, True, True, 1.0),
                                              # few rows, a long K: each block splits K, its partials summed
                                              # into the block of C (a large layer's product at a small batch)
                                              (8, 200, 2048, False, True, 0.5), (40, 100, 1024, False, True, 0.0)])
def test_webgpu_splits_gemm_over_the_binding_limit(monkeypatch, m, n, k, ta, tb, beta):
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose limit we can lower
    monkeypatch.setattr(be, "max_binding", 40_000)  # bytes: C (and A or B) exceed it in every case
    assert 4 * max(m * n, n * k) > be.max_binding
    entries = []
    encode = be._encode
    monkeypatch.setattr(be, "_encode", lambda d: (entries.append(d.entry), encode(d)))
    _gemm_matches_numpy(be, m, n, k, ta, tb, 1.5, beta, "blocked gemm")
    assert ("split_sum" in entries) == (k >= be.SPLIT_K_FROM), entries  # each block split K, its partials summed


def _convolution_passes_match_native(be, n, c, o, size, seed=0, rtol=2e-4, atol=2e-5, padding=1, bias=False,
                                     kernel=3):
    """Forward (with a bias), data gradient and filter gradient (accumulating with beta 0.5) of a kernel x kernel
    stride-1 convolution of n x c x size x size into o channels, on ``be`` against native; returns the dispatches
    each of the three passes took on ``be``."""
    native = lp.backend("native")
    rng = np.random.default_rng(seed)
    out = size + 2 * padding - kernel + 1
    x, w, dy, dw0, b = (rng.standard_normal(shape, dtype=np.float32) for shape in (
        (n, c, size, size), (o, c, kernel, kernel), (n, o, out, out), (o, c, kernel, kernel), (o,)))
    results, pad = [], (padding, padding)
    for bk in (native, be):
        t = {name: lp.SharedTensor.from_numpy(v) for name, v in (("x", x), ("w", w), ("dy", dy), ("dw", dw0), ("b", b))}
        y, dx = lp.SharedTensor(dy.shape), lp.SharedTensor(x.shape)
        counts = [getattr(bk, "dispatches", 0)]
        bk.conv2d(t["x"].read(bk), t["w"].read(bk), y.write(bk), (1, 1), pad, {},
                  bias=t["b"].read(bk) if bias else None)
        counts.append(getattr(bk, "dispatches", 0))
        bk.conv2d_grad_data(t["dy"].read(bk), t["w"].read(bk), dx.write(bk), (1, 1), pad, {})
        counts.append(getattr(bk, "dispatches", 0))
        bk.conv2d_grad_filter(t["x"].read(bk), t["dy"].read(bk), t["dw"].read_write(bk), (1, 1), pad, {}, 0.5)
        counts.append(getattr(bk, "dispatches", 0))
        results.append([y.to_numpy(), dx.to_numpy(), t["dw"].to_numpy()])
    for got, ref, what in zip(results[1], results[0], ("forward", "data gradient", "filter gradient")):
        close(got, ref, what, rtol=rtol, atol=atol)
    return tuple(int(b - a) for a, b in zip(counts, counts[1:]))


@pytest.mark.webgpu
@pytest.mark.parametrize("implicit", [True, False], ids=["implicit", "im2col"])
def test_webgpu_convolution_in_batch_chunks_matches_native(monkeypatch, implicit):
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose chunk size we can lower
    monkeypatch.setattr(be, "implicit_conv", implicit)
    # im2col columns of two samples: a batch of 5 runs in 3 chunks
    monkeypatch.setattr(be, "CONV_SCRATCH", 2 * 3 * 9 * 36 * 4)
    _convolution_passes_match_native(be, 5, 3, 4, 6)


@pytest.mark.webgpu
@pytest.mark.parametrize("kernel,n,padding,size,dispatches", [
    (3, 3, 1, 7, 4), (3, 3, 1, 6, 4), (3, 3, 1, 8, 4), (3, 3, 0, 9, 4), (3, 3, 2, 5, 4), (3, 2, 1, 67, 5),
    (3, 2, 1, 45, 4),
    (5, 3, 2, 7, 4), (5, 3, 1, 8, 4), (5, 2, 0, 9, 4), (5, 2, 4, 3, 4)])
def test_webgpu_winograd_convolution_matches_native(monkeypatch, kernel, n, padding, size, dispatches):
    """3x3 and 5x5 stride-1 convolutions with enough channels run all three passes as Winograd F(4x4, 3x3) and
    F(3x3, 5x5): outputs of each size modulo the block (a last block partly outside), each padding the data gradient
    can mirror, a bias in the output transform; with 578 blocks (3x3 at 67x67) the filter gradient's batched GEMM
    splits K (and sums the splits), with 288 (45x45) it does not."""
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose threshold we can lower
    monkeypatch.setattr(be, "WINOGRAD_MIN_CHANNELS", 5)
    counts = _convolution_passes_match_native(be, n, 6, 5, size, seed=padding, padding=padding, bias=True,
                                              kernel=kernel, rtol=5e-4, atol=5e-5)
    assert counts == (4, 4, dispatches), "two transforms, one batched GEMM (and a sum of splits), a transform"
    monkeypatch.setattr(be, "winograd", False)
    assert _convolution_passes_match_native(be, n, 6, 5, size, padding=padding, bias=True, kernel=kernel)[:2] == (1, 2)


@pytest.mark.webgpu
@pytest.mark.parametrize("kernel,n,padding,size,dispatches", [
    (3, 3, 1, 7, 4), (3, 3, 0, 6, 4), (3, 2, 1, 45, 5), (5, 3, 2, 7, 4), (5, 2, 1, 8, 4)])
def test_webgpu_winograd_2x2_blocks(monkeypatch, kernel, n, padding, size, dispatches):
    """With ``winograd_f4x4`` and ``winograd_f3x3`` off, 3x3 and 5x5 windows run F(2x2, 3x3) (the float16-tile
    path's algorithm) and F(2x2, 5x5): 1058 blocks at 45x45 split the filter gradient's K."""
    be = backend_or_skip("webgpu", power_preference="low-power")
    monkeypatch.setattr(be, "WINOGRAD_MIN_CHANNELS", 5)
    monkeypatch.setattr(be, "winograd_f4x4", False)
    monkeypatch.setattr(be, "winograd_f3x3", False)
    assert be.winograd_block(kernel) == 2
    counts = _convolution_passes_match_native(be, n, 6, 5, size, seed=padding, padding=padding, bias=True,
                                              kernel=kernel, rtol=5e-4, atol=5e-5)
    assert counts == (4, 4, dispatches)


@pytest.mark.webgpu
def test_webgpu_winograd_runs_in_batch_chunks(monkeypatch):
    """Transformed tiles over the scratch limit: the batch runs two samples at a time (three chunks); the filter
    gradient accumulates the chunks' products."""
    be = backend_or_skip("webgpu", power_preference="low-power")
    monkeypatch.setattr(be, "WINOGRAD_MIN_CHANNELS", 5)
    monkeypatch.setattr(be, "WINOGRAD_SCRATCH", 2 * 36 * 6 * 16 * 4)  # two samples of 4x4 blocks, 36 points, 6 channels
    counts = _convolution_passes_match_native(be, 5, 6, 5, 8, padding=2, bias=True, kernel=5, rtol=5e-4, atol=5e-5)
    assert counts == (10, 10, 10), "the filter transform (or the filter gradient's), then three per chunk"


@pytest.mark.webgpu
def test_webgpu_winograd_output_takes_an_in_place_relu(monkeypatch):
    be = backend_or_skip("webgpu", power_preference="low-power")
    monkeypatch.setattr(be, "WINOGRAD_MIN_CHANNELS", 4)
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((2, 4, 5, 5), dtype=np.float32), rng.standard_normal((4, 4, 3, 3), dtype=np.float32)
    ref = lp.SharedTensor((2, 4, 5, 5))
    native = lp.backend("native")
    native.conv2d(lp.SharedTensor.from_numpy(x).read(native), lp.SharedTensor.from_numpy(w).read(native),
                  ref.write(native), (1, 1), (1, 1), {})
    y = lp.SharedTensor((2, 4, 5, 5))
    be.conv2d(lp.SharedTensor.from_numpy(x).read(be), lp.SharedTensor.from_numpy(w).read(be), y.write(be),
              (1, 1), (1, 1), {})
    before = be.dispatches
    be.relu(y.read(be), y.read_write(be))
    assert be.dispatches == before, "the ReLU joins the output transform"
    close(y.to_numpy(), np.maximum(ref.to_numpy(), 0), "Winograd convolution and ReLU")


@pytest.mark.webgpu
def test_webgpu_profile_times_each_dispatch_by_entry_point():
    be = backend_or_skip("webgpu", power_preference="low-power")
    if not be.can_profile:
        pytest.skip(f"{be.adapter_name} offers no timestamp queries")
    rng = np.random.default_rng(0)
    a, b = rng.random((70, 40), dtype=np.float32), rng.random((40, 30), dtype=np.float32)
    c, r = lp.SharedTensor((70, 30)), lp.SharedTensor((70, 30))
    be.profile()
    be.gemm(lp.SharedTensor.from_numpy(a).read(be), False, lp.SharedTensor.from_numpy(b).read(be), False,
            c.write(be))
    be.relu(c.read(be), r.write(be))
    be.relu(c.read(be), r.write(be))
    close(r.to_numpy(), np.maximum(a @ b, 0), "profiled results")  # timed passes compute the same
    times = be.kernel_times
    gemms = [count for name, (_, count) in times.items() if name.startswith("gemm") and "TRANS_A=0 TRANS_B=0" in name]
    assert gemms == [1] and times["relu"][1] == 2, times
    assert all(seconds >= 0.0 for seconds, _ in times.values())
    be.profile(False)
    be.relu(c.read(be), r.write(be))
    be.synchronize()
    assert be.kernel_times is None


@pytest.mark.parametrize("op", ["relu", "sigmoid", "tanh"])
def test_activations_in_place_match_out_of_place(device, op):
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal(1000, dtype=np.float32), rng.standard_normal(1000, dtype=np.float32)
    f = {"relu": lambda v: np.maximum(v, 0), "sigmoid": lambda v: 1 / (1 + np.exp(-v)), "tanh": np.tanh}[op]
    g = {"relu": lambda y: (y > 0).astype(np.float32), "sigmoid": lambda y: y * (1 - y), "tanh": lambda y: 1 - y * y}
    t = lp.SharedTensor.from_numpy(x)
    xb = t.read(device)
    before = getattr(device, "dispatches", 0)
    getattr(device, op)(xb, t.read_write(device))  # y overwrites x
    if device.name == "webgpu":
        assert device.dispatches - before == 1, "in place: one kernel, no scratch copy"
    y = f(x)
    close(t.to_numpy(), y, f"{op} in place")
    td = lp.SharedTensor.from_numpy(dy)
    getattr(device, op + "_grad")(t.read(device), td.read(device), td.read_write(device))  # dx overwrites dy
    close(td.to_numpy(), dy * g[op](t.to_numpy()), f"{op} gradient in place")


def test_bias_grad_over_many_blocks_matches_native(device):
    rng = np.random.default_rng(0)
    dy, db0 = rng.standard_normal((9, 3, 41, 43), dtype=np.float32), rng.standard_normal(3, dtype=np.float32)
    tb = lp.SharedTensor.from_numpy(db0)
    device.bias_grad(lp.SharedTensor.from_numpy(dy).read(device), tb.read_write(device), 0.5)
    close(tb.to_numpy(), dy.sum(axis=(0, 2, 3)) + 0.5 * db0, "bias gradient", rtol=1e-4, atol=1e-5)


@pytest.mark.webgpu
def test_webgpu_convolution_past_the_binding_limit_binds_chunks_of_samples(monkeypatch):
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose limit we can lower
    # x (5184 bytes), y, dy and dx exceed it; one sample's columns (3888) fit
    monkeypatch.setattr(be, "max_binding", 4096)
    _convolution_passes_match_native(be, 12, 3, 4, 6, seed=3)


@pytest.mark.webgpu
def test_webgpu_implicit_convolution_on_large_tiles_and_split_k_matches_native():
    """Big enough for 128x128 tiles in the forward pass and split-K in the filter gradient."""
    be = backend_or_skip("webgpu")
    assert be.gemms.tile(128, 32 * 32 * 32)[1:3] == (128, 128)
    _convolution_passes_match_native(be, 32, 8, 128, 32, seed=1, rtol=1e-3, atol=1e-4)


@pytest.mark.webgpu
@pytest.mark.parametrize("stride,dispatches", [((1, 1), 1), ((2, 2), 2)], ids=["implicit", "columns"])
def test_webgpu_convolution_data_gradient_paths_match_native(monkeypatch, stride, dispatches):
    """With the implicit data gradient on: many input channels and a padded stride-1 window take one implicit
    GEMM; strided, GEMM then col2im."""
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose options we can change
    monkeypatch.setattr(be, "implicit_data_grad", True)
    native = lp.backend("native")
    rng = np.random.default_rng(2)
    x_shape, w = (3, 64, 7, 7), rng.standard_normal((16, 64, 3, 3), dtype=np.float32)
    oh = (7 + 2 - 3) // stride[0] + 1
    dy = rng.standard_normal((3, 16, oh, oh), dtype=np.float32)
    results = []
    for bk in (native, be):
        dx = lp.SharedTensor(x_shape)
        wt, dyt = lp.SharedTensor.from_numpy(w), lp.SharedTensor.from_numpy(dy)
        args = dyt.read(bk), wt.read(bk), dx.write(bk)
        before = getattr(bk, "dispatches", 0)
        bk.conv2d_grad_data(*args, stride, (1, 1), {})
        if bk is be:
            assert be.dispatches - before == dispatches
        results.append(dx.to_numpy())
    close(results[1], results[0], "data gradient", rtol=1e-3, atol=1e-4)


@pytest.mark.webgpu
@pytest.mark.parametrize("mode,kernel,stride,padding", [("max", (3, 3), (2, 2), (1, 1)), ("average", (2, 2), (2, 2),
                                                                                             (0, 0))])
def test_webgpu_pooling_past_the_binding_limit_runs_in_pieces(monkeypatch, mode, kernel, stride, padding):
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose limit we can lower
    monkeypatch.setattr(be, "max_binding", 4096)  # bytes: x (4800) and dx exceed it; a run of planes fits
    native = lp.backend("native")
    rng = np.random.default_rng(0)
    x = rng.permutation(1200).reshape(3, 4, 10, 10).astype(np.float32)  # distinct: no ties in the max
    oh = (10 + 2 * padding[0] - kernel[0]) // stride[0] + 1
    dy = rng.standard_normal((3, 4, oh, oh), dtype=np.float32)
    results = []
    for bk in (native, be):
        y, m, dx = lp.SharedTensor((3, 4, oh, oh)), lp.SharedTensor((3, 4, oh, oh), np.int32), lp.SharedTensor(x.shape)
        mask = m.write(bk) if mode == "max" else None
        xb, before = lp.SharedTensor.from_numpy(x).read(bk), getattr(bk, "dispatches", 0)
        bk.pool2d(xb, y.write(bk), mask, mode, kernel, stride, padding)
        if bk is be:
            assert be.dispatches - before >= 2, "in pieces"
        bk.pool2d_grad(lp.SharedTensor.from_numpy(dy).read(bk), dx.write(bk), m.read(bk) if mode == "max" else None,
                       mode, kernel, stride, padding)
        results.append([y.to_numpy(), dx.to_numpy()])
    close(results[1][0], results[0][0], "pooled")
    close(results[1][1], results[0][1], "pooling gradient")


@pytest.mark.webgpu
def test_webgpu_bias_gradient_past_the_binding_limit_runs_in_pieces(monkeypatch):
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose limit we can lower
    monkeypatch.setattr(be, "max_binding", 8192)
    rng = np.random.default_rng(0)
    dy, db0 = rng.standard_normal((40, 3, 8, 8), dtype=np.float32), rng.standard_normal(3, dtype=np.float32)
    tb = lp.SharedTensor.from_numpy(db0)
    before = be.dispatches
    be.bias_grad(lp.SharedTensor.from_numpy(dy).read(be), tb.read_write(be), 0.5)
    assert be.dispatches - before >= 3, "runs of samples, then the sum"
    close(tb.to_numpy(), dy.sum(axis=(0, 2, 3)) + 0.5 * db0, "bias gradient in pieces", rtol=1e-4, atol=1e-5)


@pytest.mark.webgpu
@pytest.mark.parametrize("limit", [None, 4096], ids=["whole", "past-the-limit"])
def test_webgpu_reductions_in_blocks_and_pieces_match_numpy(monkeypatch, limit):
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose limit we can lower
    monkeypatch.setattr(be, "PARTS_BLOCK", 1000)  # several blocks per run
    if limit:
        monkeypatch.setattr(be, "max_binding", limit)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(5000, dtype=np.float32), rng.standard_normal(5000, dtype=np.float32)
    tx, ty = lp.SharedTensor.from_numpy(x), lp.SharedTensor.from_numpy(y)
    out = lp.SharedTensor((1,))
    be.dot(tx.read(be), ty.read(be), out.write(be))
    assert out.to_numpy()[0] == pytest.approx(float(x @ y), rel=1e-4, abs=1e-3)
    be.dot(tx.read(be), tx.read(be), out.write(be))
    assert out.to_numpy()[0] == pytest.approx(float(x @ x), rel=1e-4)
    diff = lp.SharedTensor((5000,))
    be.mse(tx.read(be), ty.read(be), diff.write(be), out.write(be))
    assert out.to_numpy()[0] == pytest.approx(float(np.mean((x - y) ** 2)), rel=1e-4)
    logp = rng.standard_normal((300, 7), dtype=np.float32)
    labels = rng.integers(0, 7, 300)
    tl, tp = lp.SharedTensor.from_numpy(labels.astype(np.float32)), lp.SharedTensor.from_numpy(logp)
    be.nll(tp.read(be), tl.read(be), out.write(be))
    assert out.to_numpy()[0] == pytest.approx(float(-logp[np.arange(300), labels].mean()), rel=1e-4)
    dx, dloss = lp.SharedTensor((300, 7)), lp.SharedTensor.from_numpy(np.array([2.0], np.float32))
    be.nll_grad(tl.read(be), dloss.read(be), dx.write(be))
    ref = np.zeros((300, 7), np.float32)
    ref[np.arange(300), labels] = -2.0 / 300
    close(dx.to_numpy(), ref, "nll gradient")


@pytest.mark.webgpu
@pytest.mark.parametrize("tile", [("gemm", 32, 32, (("TS", 8), ("TILES", 128))), ("gemm", 64, 64, ()),
                                  ("gemm_big", 64, 128, (("BIG_ROWS", 64),)), ("gemm_big", 128, 128, ())],
                         ids=["32x32", "64x64", "64x128", "128x128"])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_webgpu_every_gemm_tile_matches_numpy(monkeypatch, tile, ta, tb):
    """Each tile kernel, forced, on ragged shapes: partial tiles in m, n and the last K slice."""
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose tile choice we can force
    monkeypatch.setattr(be.gemms, "tile", lambda *shape: tile)
    _gemm_matches_numpy(be, 133, 70, 45, ta, tb, 1.5, 0.5, f"{tile[0]} {tile[1]}x{tile[2]}", seed=1)
    if ta or tb:
        return
    # a batch of three products in one dispatch (the Winograd convolution's GEMMs)
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((3, 133, 45), dtype=np.float32), rng.standard_normal((3, 45, 70), dtype=np.float32)
    c = lp.SharedTensor((3, 133, 70))
    before = be.dispatches
    be.gemms.product(lp.SharedTensor.from_numpy(a).read(be), False, lp.SharedTensor.from_numpy(b).read(be), False,
             c.write(be), 133, 70, 45, 1.0, 0.0, batch=3)
    assert be.dispatches - before == 1
    close(c.to_numpy(), a @ b, f"batched {tile[0]} {tile[1]}x{tile[2]}", rtol=1e-4, atol=1e-5)


@pytest.mark.webgpu
def test_webgpu_bias_and_relu_join_the_gemm_that_wrote_them(monkeypatch):
    """A linear layer's bias add and an in-place ReLU on the product run in the GEMM's store: one kernel. A ReLU
    into another buffer, or a bias after the ReLU, runs on its own."""
    be = backend_or_skip("webgpu", power_preference="low-power")
    rng = np.random.default_rng(4)
    x, w, b = (rng.standard_normal(s, dtype=np.float32) for s in ((37, 50), (70, 50), (70,)))
    tx, tw, tb = (lp.SharedTensor.from_numpy(a) for a in (x, w, b))
    y, y2 = lp.SharedTensor((37, 70)), lp.SharedTensor((37, 70))
    xb, wb, bb, yb, y2b = tx.read(be), tw.read(be), tb.read(be), y.write(be), y2.write(be)  # uploads done
    be.flush()
    encoded = []
    real = be._encode
    monkeypatch.setattr(be, "_encode", lambda d: (encoded.append(d.entry), real(d)))
    be.gemm(xb, False, wb, True, yb)
    be.bias_add(yb, bb)
    be.relu(yb, yb)
    be.flush()
    assert encoded == ["gemm"], encoded
    ref = np.maximum(x @ w.T + b, 0)
    close(y.to_numpy(), ref, "gemm + bias + relu", rtol=1e-4, atol=1e-5)
    encoded.clear()
    yb, y2b = y.write(be), y2.write(be)
    be.gemm(xb, False, wb, True, yb)
    be.relu(yb, y2b)  # not in place: y keeps the product
    be.bias_add(yb, bb)  # y's GEMM is already encoded
    be.flush()
    assert encoded == ["gemm", "relu", "bias_add"], encoded
    close(y2.to_numpy(), np.maximum(x @ w.T, 0), "relu of the product", rtol=1e-4, atol=1e-5)
    close(y.to_numpy(), x @ w.T + b, "product + bias", rtol=1e-4, atol=1e-5)


@pytest.mark.webgpu
@pytest.mark.parametrize("k", [40, 3000], ids=["plain", "split-k"])
def test_webgpu_gemm_wider_than_the_grid_runs_in_column_spans(monkeypatch, k):
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose limit we can lower
    monkeypatch.setattr(be, "max_groups", 3)  # workgroups per grid dimension: every product below is wider
    rng = np.random.default_rng(5)
    a, b = rng.random((70, k), dtype=np.float32), rng.random((k, 700), dtype=np.float32)
    tc = lp.SharedTensor((70, 700))
    before = be.dispatches
    be.gemm(lp.SharedTensor.from_numpy(a).read(be), False, lp.SharedTensor.from_numpy(b).read(be), False,
            tc.write(be))
    assert be.dispatches - before >= 3
    close(tc.to_numpy(), a @ b, "gemm in column spans", rtol=1e-4, atol=1e-5)


@pytest.mark.webgpu
def test_webgpu_convolution_wider_than_the_grid_runs_in_column_spans(monkeypatch):
    be = backend_or_skip("webgpu", power_preference="low-power")
    monkeypatch.setattr(be, "max_groups", 4)
    _convolution_passes_match_native(be, 6, 3, 4, 9, seed=2)


@pytest.mark.webgpu
def test_webgpu_gemm_that_cannot_be_split_says_so(monkeypatch):
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose limit we can lower
    monkeypatch.setattr(be, "max_binding", 40_000)
    a = lp.SharedTensor((40, 12000))  # transposed A whose every stored row (one k) is 48 KB
    b = lp.SharedTensor((30, 40))
    c = lp.SharedTensor((12000, 30))
    with pytest.raises(lp.BackendError, match="cannot be split"):
        be.gemm(a.read(be), True, b.read(be), True, c.write(be))


@pytest.mark.webgpu
def test_webgpu_class_rows_past_the_binding_limit_run_in_pieces_or_say_why(monkeypatch):
    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose limit we can lower
    monkeypatch.setattr(be, "max_binding", 4096)
    rng = np.random.default_rng(0)
    for n, c in ((6, 1000), (200, 30)):  # a workgroup per row, a thread per row; both over 4096 bytes
        x, dy = rng.standard_normal((n, c), dtype=np.float32), rng.standard_normal((n, c), dtype=np.float32)
        y, dx = lp.SharedTensor((n, c)), lp.SharedTensor((n, c))
        before = be.dispatches
        be.log_softmax(lp.SharedTensor.from_numpy(x).read(be), y.write(be))
        assert be.dispatches - before >= 2, "in pieces"
        ref = x - x.max(1, keepdims=True)
        ref -= np.log(np.exp(ref).sum(1, keepdims=True))
        close(y.to_numpy(), ref, "log_softmax in pieces")
        be.log_softmax_grad(y.read(be), lp.SharedTensor.from_numpy(dy).read(be), dx.write(be))
        close(dx.to_numpy(), dy - np.exp(ref) * dy.sum(1, keepdims=True), "log_softmax_grad in pieces")
    x = lp.SharedTensor.from_numpy(np.zeros((2, 2000), np.float32))  # one sample's 8000 bytes cannot be split
    with pytest.raises(lp.BackendError, match="one item of 8000 bytes exceeds the storage binding limit of 4096"):
        be.softmax(x.read(be), lp.SharedTensor((2, 2000)).write(be))


@pytest.mark.cuda
def test_cuda_tf32_convolution_and_gemm_stay_within_tf32_error():
    be = backend_or_skip("cuda", tf32=True)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((256, 512), dtype=np.float32), rng.standard_normal((512, 128), dtype=np.float32)
    tc = lp.SharedTensor((256, 128))
    be.gemm(lp.SharedTensor.from_numpy(a).read(be), False, lp.SharedTensor.from_numpy(b).read(be), False,
            tc.write(be))
    ref = a.astype(np.float64) @ b
    assert np.abs(tc.to_numpy() - ref).max() <= 1e-2 * np.abs(ref).max()
    x, w = rng.standard_normal((4, 8, 12, 12), dtype=np.float32), rng.standard_normal((6, 8, 3, 3), dtype=np.float32)
    native = lp.backend("native")
    outs = []
    for bk in (native, be):
        ty = lp.SharedTensor((4, 6, 12, 12))
        bk.conv2d(lp.SharedTensor.from_numpy(x).read(bk), lp.SharedTensor.from_numpy(w).read(bk), ty.write(bk),
                  (1, 1), (1, 1), {})
        outs.append(ty.to_numpy())
    assert np.abs(outs[1] - outs[0]).max() <= 1e-2 * np.abs(outs[0]).max()


@pytest.mark.cuda
def test_cuda_without_the_cudnn_frontend_convolves_through_im2col(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cudnn", None)  # `import cudnn` now raises ImportError
    be = backend_or_skip("cuda", use_cudnn=None)  # a new instance (the default one is cached)
    assert not be.uses_cudnn
    with pytest.raises(lp.BackendUnavailable, match="cuDNN graphs unavailable"):
        lp.backend("cuda", use_cudnn=True)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 3, 7, 7), dtype=np.float32), rng.standard_normal((4, 3, 3, 3), dtype=np.float32)
    outs = []
    for bk in (lp.backend("native"), be):
        y = lp.SharedTensor((2, 4, 4, 4))
        bk.conv2d(lp.SharedTensor.from_numpy(x).read(bk), lp.SharedTensor.from_numpy(w).read(bk), y.write(bk),
                  (2, 2), (1, 1), {})
        outs.append(y.to_numpy())
    close(outs[1], outs[0], "im2col convolution")


@pytest.mark.webgpu
def test_webgpu_scratch_grows_in_place_and_recorded_steps_forget_the_old_buffer(monkeypatch):
    """One scratch buffer per use, grown to the largest size asked for; when it grows, the old buffer goes back to
    the pool, so steps recorded against it are forgotten: a replay must never write into a tensor that took it."""
    import gc

    be = backend_or_skip("webgpu", power_preference="low-power")
    twin = backend_or_skip("webgpu", adapter=be.adapter_name)
    monkeypatch.setattr(twin, "replay", False)
    ds = lp.data.digits()
    x, y = ds.x_train[:32], ds.y_train[:32]
    solvers = [_solver(b, dropout=False, solver="momentum") for b in (be, twin)]
    for _ in range(3):
        for s in solvers:
            s.train_minibatch(x, y)
    assert be.replays >= 1 and be.recorder.steps
    tag = max(be.mem.scratches, key=lambda t: be.mem.scratches[t].size)
    old = be.mem.scratches[tag].size
    assert be.mem.scratch(old // 2, tag).size == old // 2  # smaller asks are prefixes of the same buffer
    assert be.mem.scratch(old // 2, tag).raw is be.mem.scratches[tag].raw
    be.mem.scratch(old + 1, tag)
    assert be.mem.scratches[tag].size == old + 1
    gc.collect()
    bystander = lp.SharedTensor.from_numpy(np.full(old, 7.0, np.float32))
    be.scal(1.0, bystander.read_write(be))  # on the device only; its buffer is most likely the old scratch buffer
    replays = be.replays
    for _ in range(3):
        for s in solvers:
            s.train_minibatch(x, y)
    assert be.replays - replays == 2  # recorded again, then replayed
    np.testing.assert_array_equal(bystander.to_numpy(), np.full(old, 7.0, np.float32))
    # a step seen for the first time keeps its place when it grows a buffer (it has recorded nothing yet)
    be.run_step(("growing", 1), lambda: be.mem.scratch(be.mem.scratches[tag].size + 1, tag))
    assert ("growing", 1) in be.recorder.steps
    a, b = solvers
    assert a.loss() == pytest.approx(b.loss(), rel=1e-5)
    for wa, wb in zip(a.network.learnable_weights_data(), b.network.learnable_weights_data()):
        close(wa.to_numpy(), wb.to_numpy(), "weights", rtol=1e-5, atol=1e-7)


def _max_pool_reference(x, kernel, stride, padding):
    """Max pooling in float64 over each window's input positions only (padding never wins); the gradient of each
    window to its first largest input position (an all -inf window's: its first input position)."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    y = np.empty((n, c, oh, ow))
    where = np.empty((n, c, oh, ow, 2), np.int64)
    for i in range(oh):
        for j in range(ow):
            r0, c0 = max(i * sh - ph, 0), max(j * sw - pw, 0)
            r1, c1 = min(i * sh - ph + kh, h), min(j * sw - pw + kw, w)
            window = x[:, :, r0:r1, c0:c1].astype(np.float64).reshape(n, c, -1)
            k = window.argmax(axis=2)  # the first of equal maxima (of all -inf: the first position)
            y[:, :, i, j] = np.take_along_axis(window, k[..., None], 2)[..., 0]
            where[:, :, i, j] = np.stack([r0 + k // (c1 - c0), c0 + k % (c1 - c0)], -1)
    return y, where


@pytest.mark.parametrize("name", ["native", pytest.param("cuda", marks=pytest.mark.cuda),
                                  pytest.param("webgpu", marks=pytest.mark.webgpu)])
@pytest.mark.parametrize("kernel,stride,padding", [((2, 2), (2, 2), (1, 1)), ((3, 3), (2, 2), (1, 1)),
                                                   ((3, 3), (1, 1), (1, 1))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])  # float64: the array code's padded path on cuda too
def test_max_pooling_windows_of_minus_infinity_at_the_padding_send_their_gradient_to_the_input(name, kernel, stride,
                                                                                               padding, dtype):
    """Windows over the padding whose input positions are all -inf: -inf out, and the gradient to the window's
    first input position (never to the padding, where it would be lost), as in a window without padding."""
    if name == "webgpu" and dtype == np.float64:
        pytest.skip("webgpu computes in float32 and float16 only")
    be = backend_or_skip(name)
    rng = np.random.default_rng(5)
    x = rng.permutation(2 * 3 * 7 * 7).reshape(2, 3, 7, 7).astype(dtype)
    x[:, :, :3, :3] = -np.inf  # the top-left windows: -inf at every input position
    x[0, 1] = -np.inf          # a whole plane
    y_ref, where = _max_pool_reference(x, kernel, stride, padding)
    dy = rng.integers(1, 9, y_ref.shape).astype(dtype)
    dx_ref = np.zeros(x.shape)
    for idx in np.ndindex(*y_ref.shape):
        dx_ref[idx[0], idx[1], where[idx][0], where[idx][1]] += dy[idx]
    y, m, dx = (lp.SharedTensor(y_ref.shape, dtype), lp.SharedTensor(y_ref.shape, np.int32),
                lp.SharedTensor(x.shape, dtype))
    be.pool2d(lp.SharedTensor.from_numpy(x).read(be), y.write(be), m.write(be), "max", kernel, stride, padding)
    be.pool2d_grad(lp.SharedTensor.from_numpy(dy).read(be), dx.write(be), m.read(be), "max", kernel, stride, padding)
    assert y.to_numpy().dtype == dtype
    np.testing.assert_array_equal(y.to_numpy(), y_ref.astype(dtype))
    np.testing.assert_allclose(dx.to_numpy(), dx_ref, rtol=0, atol=0)
    assert dx.to_numpy().sum() == dy.sum()  # nothing lost


@pytest.mark.parametrize("name", ["native", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_max_pooling_passes_a_nan_on_and_keeps_its_windows_gradient_in_the_input(name):
    """A NaN is the maximum of its window (as NumPy's maximum makes it), on native and cuda alike; the window's
    gradient stays on an input position, with padding too. (WGSL may assume no NaN: webgpu is not asked.)"""
    be = backend_or_skip(name)
    x = np.array([[[[np.nan, 1, 5, 2], [2, 3, 4, np.nan], [0, 1, 2, 3], [7, 6, 5, 4]]]], np.float32)
    for padding in ((0, 0), (1, 1)):
        oh = (4 + 2 * padding[0] - 2) // 2 + 1
        y, m, dx = lp.SharedTensor((1, 1, oh, oh)), lp.SharedTensor((1, 1, oh, oh), np.int32), lp.SharedTensor(x.shape)
        dy = np.arange(1, oh * oh + 1, dtype=np.float32).reshape(1, 1, oh, oh)
        be.pool2d(lp.SharedTensor.from_numpy(x).read(be), y.write(be), m.write(be), "max", (2, 2), (2, 2), padding)
        be.pool2d_grad(lp.SharedTensor.from_numpy(dy).read(be), dx.write(be), m.read(be), "max", (2, 2), (2, 2),
                       padding)
        out, grad = y.to_numpy(), dx.to_numpy()
        if padding == (0, 0):
            np.testing.assert_array_equal(out[0, 0], [[np.nan, np.nan], [7, 5]])
        else:
            np.testing.assert_array_equal(out[0, 0], [[np.nan, 5, 2], [2, 4, np.nan], [7, 6, 4]])
        assert grad.sum() == dy.sum(), (padding, grad)  # every window's gradient reaches the input


@pytest.mark.parametrize("name", ["native", pytest.param("cuda", marks=pytest.mark.cuda),
                                  pytest.param("webgpu", marks=pytest.mark.webgpu)])
@pytest.mark.parametrize("size", [6, 64])  # NumPy's passes, and (native) the compiled kernels
def test_an_infinite_max_pooling_gradient_reaches_its_windows_maximum_alone(name, size):
    """As in PyTorch: dy goes where the window's maximum was and 0 elsewhere, so an inf in dy is not inf * 0 = NaN
    over the rest of its window."""
    be = backend_or_skip(name)
    rng = np.random.default_rng(2)
    x = rng.permutation(4 * 16 * size * size).reshape(4, 16, size, size).astype(np.float32)
    half = size // 2
    dy = rng.standard_normal((4, 16, half, half)).astype(np.float32)
    dy[0, 0, 0, 0], dy[1, 2, 1, 1] = np.inf, -np.inf
    y, m, dx = lp.SharedTensor(dy.shape), lp.SharedTensor(dy.shape, np.int32), lp.SharedTensor(x.shape)
    be.pool2d(lp.SharedTensor.from_numpy(x).read(be), y.write(be), m.write(be), "max", (2, 2), (2, 2), (0, 0))
    be.pool2d_grad(lp.SharedTensor.from_numpy(dy).read(be), dx.write(be), m.read(be), "max", (2, 2), (2, 2), (0, 0))
    got = dx.to_numpy()
    windows = x.reshape(4, 16, half, 2, half, 2).transpose(0, 1, 2, 4, 3, 5).reshape(4, 16, half, half, 4)
    want = np.zeros((4, 16, half, half, 4), np.float32)
    np.put_along_axis(want, windows.argmax(-1)[..., None], dy[..., None], -1)
    want = want.reshape(4, 16, half, half, 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(x.shape)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got, want)
