"""Recorded training steps replay under every learning-rate policy, every update rule and gradient accumulation.

The step's rate (Adam's with its bias correction) is data in a device buffer written before the step, so a
recorded step stays valid while the rate changes. Each case trains on a replaying device backend and, as the
independent reference, on the native backend in float64 from the same weights; every step's loss and the final
weights must agree, and every step from the third on (per accumulation phase) must have been replayed."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from conftest import backend_or_skip, webgpu_offering
from test_reference_solver import mse_solver

import leafpy as lp
from leafpy.solvers.momentum import Momentum

ROOT = os.path.join(os.path.dirname(__file__), "..")

RULES = {"momentum": dict(base_lr=0.05, momentum=0.9), "nesterov": dict(base_lr=0.05, momentum=0.9),
         "adam": dict(base_lr=0.01), "rmsprop": dict(base_lr=0.002), "adagrad": dict(base_lr=0.02),
         "adadelta": dict(base_lr=1.0), "adamw": dict(base_lr=0.01)}
SCHEDULES = {"inv": dict(lr_policy="inv", gamma=0.3, power=0.75),  # Caffe's LeNet schedule, steeper
             "step": dict(lr_policy="step", stepsize=2, gamma=0.5),
             "poly": dict(lr_policy="poly", max_iter=12, power=2.0),
             "sigmoid": dict(lr_policy="sigmoid", gamma=-1.0, stepsize=3),
             "cosine-warmup": dict(lr_policy="cosine", max_iter=10, min_lr=1e-3, warmup_iter=3, warmup_factor=0.1)}
CASES = ([(rule, "inv", 1) for rule in RULES]
         + [(rule, schedule, k) for rule in ("adam", "momentum") for schedule in SCHEDULES for k in (1, 2)
            if (schedule, k) != ("inv", 1)])

DEVICES = [pytest.param("native"), pytest.param("webgpu", marks=pytest.mark.webgpu),
           pytest.param("cuda", marks=pytest.mark.cuda)]


def _config(rule, schedule, k, dropout=False, clip=None):
    run = lp.config.load(os.path.join(ROOT, "configs", "digits_mlp.yaml"))
    if dropout:  # a new mask every step, from a seed written before the step
        seq = run.solver.network.config
        seq.layers.insert(2, lp.LayerConfig("drop1", lp.DropoutConfig(ratio=0.4)))
    return dataclasses.replace(run.solver, solver=rule, minibatch_size=k, weight_decay=1e-3, clip_gradients=clip,
                               **RULES[rule], **SCHEDULES[schedule])


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("rule,schedule,k", CASES, ids=[f"{r}-{s}-k{k}" for r, s, k in CASES])
def test_replayed_steps_follow_the_schedule(device_name, rule, schedule, k):
    _train_against_float64(backend_or_skip(device_name), _config(rule, schedule, k), k)


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("k", [1, 2])
def test_replayed_steps_draw_fresh_dropout_masks(device_name, k):
    """Dropout's masks hash the same on every backend, so the float64 reference draws the same ones."""
    _train_against_float64(backend_or_skip(device_name), _config("adam", "inv", k, dropout=True), k)


@pytest.mark.parametrize("device_name", DEVICES)
def test_replayed_steps_clip_gradients_on_the_device(device_name):
    """Clipping scales the gradients by threshold / norm on the device (no readback), so clipped steps replay."""
    clipped = _train_against_float64(backend_or_skip(device_name), _config("momentum", "step", 1, clip=0.5), 1)
    unclipped = _train_against_float64(lp.backend("native"), _config("momentum", "step", 1), 1, replays=False)
    assert abs(clipped[-1] - unclipped[-1]) > 1e-3, "the threshold should clip these gradients"


def twins(device, cfg) -> tuple[lp.Solver, lp.Solver]:
    """A solver on ``device`` and its float64 native reference, from the same weights."""
    solver = lp.Solver.from_config(device, device, cfg)
    f64 = lp.backend("native", dtype="float64")
    reference = lp.Solver.from_config(f64, f64, cfg)
    for w, r in zip(solver.network.learnable_weights_data(), reference.network.learnable_weights_data()):
        r.set(w.to_numpy().astype(np.float64))
    return solver, reference


def assert_same_weights(solver, reference) -> None:
    for w, r in zip(solver.network.learnable_weights_data(), reference.network.learnable_weights_data()):
        a, b = w.to_numpy(), r.to_numpy()
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * max(1.0, float(np.abs(b).max())), err_msg="weights")


def _train_against_float64(device, cfg, k, replays=True):
    solver, reference = twins(device, cfg)
    ds = lp.data.digits()
    calls = 12
    batches = [(ds.x_train[i * 32:(i + 1) * 32], ds.y_train[i * 32:(i + 1) * 32]) for i in range(calls)]
    before = device.recorder.replays if replays else 0
    losses, expected, rates = [], [], []
    for x, y in batches:
        rates.append(solver.learning_rate())
        solver.train_minibatch(x, y)
        reference.train_minibatch(x, y)
        losses.append(solver.loss())
        expected.append(reference.loss())
    assert len(set(rates)) >= 3, f"the {cfg.lr_policy} schedule should change the rate: {rates}"
    np.testing.assert_allclose(losses, expected, rtol=2e-4, atol=1e-5, err_msg="per-step losses")
    assert_same_weights(solver, reference)
    if replays:
        done = device.recorder.replays - before
        # each accumulation phase (k of them) runs once as it is, once to be recorded, then from its recording
        assert done == calls - 2 * k, f"{done} of {calls} steps replayed ({device.recorder.error})"
    return losses


@pytest.mark.parametrize("device_name", DEVICES)
def test_a_reconfigured_solver_records_its_steps_anew(device_name):
    """A recording holds the rule's constants (momentum, weight decay, the clipping threshold): after reconfigure
    the solver's steps are recorded again, so the new settings take effect as they do on native."""
    device = backend_or_skip(device_name)
    cfg = _config("momentum", "step", 1)
    solver, reference = twins(device, cfg)
    ds = lp.data.digits()
    changed = dataclasses.replace(cfg, momentum=0.0, weight_decay=0.5, clip_gradients=0.01)
    for i in range(8):
        if i == 4:
            for s in (solver, reference):
                assert set(s.reconfigure(changed)) == {"momentum", "weight_decay", "clip_gradients"}
        x, y = ds.x_train[i * 32:(i + 1) * 32], ds.y_train[i * 32:(i + 1) * 32]
        solver.train_minibatch(x, y)
        reference.train_minibatch(x, y)
    assert_same_weights(solver, reference)


@pytest.mark.parametrize("device_name", DEVICES)
def test_dropout_draws_follow_native_around_replayed_steps_and_refused_batches(device_name):
    """Replayed steps run none of dropout's Python: a training-mode forward pass afterwards still draws a new mask,
    and a batch the solver refuses takes back the draw made for it, on every backend alike."""
    results = []
    for be in (backend_or_skip(device_name), lp.backend("native")):
        solver = lp.Solver.from_config(be, be, _config("momentum", "step", 1, dropout=True))
        drop = next(w for w in solver.network.workers() if hasattr(w, "draws_random"))
        ds = lp.data.digits()
        for i in range(4):
            solver.train_minibatch(ds.x_train[i * 32:(i + 1) * 32], ds.y_train[i * 32:(i + 1) * 32])
        solver.network.set_training(True)
        outs = [solver.network.forward([ds.x_test[:32]])[0].to_numpy() for _ in range(2)]
        before = solver.snapshot()["random"]
        with pytest.raises(lp.LeafpyError):
            solver.train_minibatch(ds.x_train[:32], np.full(32, 10.0))  # label 10 of 10 classes: refused
        assert solver.snapshot()["random"] == before, "a refused batch must not advance dropout's draws"
        results.append((drop.calls, before, outs))
    (calls, random, outs), (ref_calls, ref_random, ref_outs) = results
    assert calls == ref_calls == 6 and random == ref_random
    for a, b in zip(outs, ref_outs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert not np.allclose(outs[0], outs[1]), "each training-mode forward pass draws a new mask"


@pytest.mark.parametrize("device_name,precision", [pytest.param("webgpu", "fp16", marks=pytest.mark.webgpu),
                                                    pytest.param("cuda", "bf16", marks=pytest.mark.cuda),
                                                    pytest.param("cuda", "fp16", marks=pytest.mark.cuda)])
def test_a_weight_set_between_replayed_16_bit_steps_reaches_its_copy(device_name, precision):
    """Under bf16/fp16 the update writes each weight's 16-bit copy with the weight, and a replayed step casts
    nothing; a weight set between steps must still reach the copy the next replayed step reads. With the last
    layer's weight and bias loaded as zeros every class scores 0, so that step's loss is log(10) (a formula; a
    stale copy would give the trained network's loss), and training goes on from there as on a fresh solver."""
    if device_name == "webgpu":
        webgpu_offering("shader-f16")
    device = backend_or_skip(device_name, precision=precision)
    solver = lp.Solver.from_config(device, device, _config("momentum", "step", 1))
    ds = lp.data.digits()
    batches = [(ds.x_train[i * 32:(i + 1) * 32], ds.y_train[i * 32:(i + 1) * 32]) for i in range(8)]
    for x, y in batches[:5]:
        solver.train_minibatch(x, y)
    trained = solver.loss()
    assert abs(trained - np.log(10.0)) > 0.05
    names = solver.network.learnable_weights_names()
    shapes = [w.shape for w in solver.network.learnable_weights_data()]
    solver.network.load_weights({n: np.zeros(s) for n, s in zip(names[-2:], shapes[-2:])}, strict=False)
    before = device.recorder.replays
    losses = []
    for x, y in batches[5:]:
        solver.train_minibatch(x, y)
        losses.append(solver.loss())
    assert device.recorder.replays == before + 3, device.recorder.error
    np.testing.assert_allclose(losses[0], np.log(10.0), rtol=2e-3)
    assert losses[2] < losses[0], "training goes on from the loaded weights"


@pytest.mark.webgpu
def test_a_capture_that_fails_midway_runs_none_of_its_work():
    """A step that cannot be recorded runs as it is from then on; what the failed attempt had encoded is dropped,
    not submitted with the step's rerun."""
    be = backend_or_skip("webgpu")
    t = lp.SharedTensor.from_numpy(np.ones(1000, np.float32))
    t.read(be)
    calls = [0]

    def step():
        calls[0] += 1
        be.scal(2.0, t.read_write(be))
        if calls[0] == 2:  # the second run is the one the backend records
            raise lp.BackendError("this step cannot be recorded")

    for _ in range(3):
        be.run_step(("failing capture", id(t)), step)
    assert calls[0] == 4  # first run, the failed capture, its rerun, then run as it is
    np.testing.assert_allclose(t.to_numpy(), np.full(1000, 8.0), rtol=1e-6)  # three doublings ran, not four
    assert be.recorder.steps[("failing capture", id(t))].eager


def test_a_native_step_that_fails_while_recorded_raises_once_and_is_recorded_at_its_next_call():
    """On native a step's calls run while they are recorded: a step that raises then has run its work once, as an
    eager step would have, and the error reaches the caller. The failure was the step's (a refused batch, Ctrl-C),
    not the recording's: the next call records it, and the one after replays it (it ran eagerly for good)."""
    be = lp.backend("native")
    t = lp.SharedTensor.from_numpy(np.ones(1000, np.float32))
    calls = [0]

    def step():
        calls[0] += 1
        be.scal(2.0, t.read_write(be))
        if calls[0] == 2:  # the second run is the one the backend records
            raise lp.BackendError("this step fails")

    key = ("failing native step", id(t))
    be.run_step(key, step)
    with pytest.raises(lp.BackendError, match="this step fails"):
        be.run_step(key, step)
    be.run_step(key, step)
    assert calls[0] == 3
    np.testing.assert_allclose(t.to_numpy(), np.full(1000, 8.0), rtol=1e-6)  # three doublings, none twice
    assert not be.recorder.steps[key].eager
    replays = be.replays
    be.run_step(key, step)
    assert calls[0] == 3 and be.replays == replays + 1  # the recording ran, not the step's Python
    np.testing.assert_allclose(t.to_numpy(), np.full(1000, 16.0), rtol=1e-6)


def test_native_replays_the_primitive_calls_with_the_same_results():
    """A replayed native step is the recorded list of primitive calls on the same arrays: LeNet's losses and weights
    after 6 steps are the ones of steps run as they are (the same float32 operations in the same order)."""
    from leafpy.backends.native import NativeBackend

    results = []
    for replay in (False, True):
        be = NativeBackend()
        be.replay = replay
        cfg = lp.config.load(os.path.join(ROOT, "configs", "digits_lenet.yaml")).solver
        solver = lp.Solver.from_config(be, be, cfg)
        ds = lp.data.digits()
        losses = []
        for i in range(6):
            solver.train_minibatch(ds.x_train[i * 32:(i + 1) * 32], ds.y_train[i * 32:(i + 1) * 32])
            losses.append(solver.loss())
        results.append((losses, [w.to_numpy() for w in solver.network.learnable_weights_data()], be.replays))
    (eager, w_eager, none), (replayed, w_replayed, replays) = results
    assert (none, replays) == (0, 4)
    np.testing.assert_allclose(replayed, eager, rtol=1e-6)
    for a, b in zip(w_eager, w_replayed):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


# --- 16-bit weight copies: the update writes each weight's copy; every way a weight changes must reach its copy ---

MIXED = [pytest.param("native", "bf16"), pytest.param("native", "fp16"),
         pytest.param("webgpu", "fp16", marks=pytest.mark.webgpu),
         pytest.param("cuda", "bf16", marks=pytest.mark.cuda), pytest.param("cuda", "fp16", marks=pytest.mark.cuda)]
COPY_CASES = ("loaded", "shared", "shared-frozen", "frozen", "accumulated", "rule-of-its-own", "adamw", "two-solvers",
              "inference", "reconfigured")
CHANGES = (3, 6)  # the calls before which a case changes something


def _mixed_device(device_name: str, precision: str) -> lp.Backend:
    if device_name == "webgpu":
        webgpu_offering("shader-f16")
    return backend_or_skip(device_name, precision=precision)


def _copies_config(case: str) -> lp.SolverConfig:
    """The digits MLP of :func:`_config` as each case needs it: two layers sharing one weight by name (trained, or
    frozen: lr_mult 0), or the last layer frozen."""
    cfg = _config("adamw" if case == "adamw" else "momentum", "step", 2 if case == "accumulated" else 1)
    layers = cfg.network.config.layers
    if case.startswith("shared"):
        tied = [lp.WeightConfig(name="tied", lr_mult=0.0 if case == "shared-frozen" else 1.0)]
        layers[3:3] = [lp.LayerConfig(f"fc_tied{i}", lp.LinearConfig(output_size=128), params=tied) for i in (1, 2)]
    if case == "frozen":
        layers[-2] = lp.LayerConfig("fc2", lp.LinearConfig(output_size=10), params=[lp.WeightConfig(lr_mult=0.0)] * 2)
    return cfg


class _MomentumOfItsOwn(Momentum):
    """A rule written before ``UpdateRule.update`` took ``copy``: the solver casts the copies after it."""

    def update(self, backend, w, g, state, rate, lr_mult, decay=0.0):
        super().update(backend, w, g, state, rate, lr_mult, decay)


def _new_weights(solver: lp.Solver, seed: int) -> dict[str, np.ndarray]:
    """New values for the last Linear layer's weights, and for the weight shared by name where there is one."""
    net = solver.network
    rng = np.random.default_rng(seed)
    chosen = [(n, w) for n, w in zip(net.learnable_weights_names(), net.learnable_weights_data())
              if n.startswith("fc2/") or n == "tied"]
    return {n: rng.standard_normal(w.shape).astype(np.float32) * 0.1 for n, w in chosen}


def _train_copies_case(be: lp.Backend, case: str, calls: int = 9
                       ) -> tuple[list[float], dict[str, np.ndarray], list[np.ndarray], dict[str, np.ndarray]]:
    """Train ``case`` on ``be`` from fixed weights: each call's loss, the final weights and what the inference
    passes gave, and the weights loaded last."""
    cfg = _copies_config(case)
    solver = lp.Solver.from_config(be, be, cfg)
    rng = np.random.default_rng(0)
    for w in solver.network.learnable_weights_data():
        w.set(rng.standard_normal(w.shape) * 0.1)
    solvers = [solver]
    if case == "two-solvers":  # a second solver of the same network, taking every other step at its own rate
        second = lp.Solver.from_config(be, be, dataclasses.replace(cfg, base_lr=cfg.base_lr / 2))
        second.network = solver.network
        solvers.append(second)
    if case == "rule-of-its-own":
        solver.rule = _MomentumOfItsOwn(cfg)
    ds = lp.data.digits()
    losses, seen, loaded = [], [], {}
    for i in range(calls):
        if i in CHANGES and case == "inference":
            solver.network.set_training(False)
            seen.append(solver.network.forward([ds.x_test[:5]])[0].to_numpy())
            solver.network.set_training(True)
        elif i in CHANGES and case == "reconfigured":  # its steps recorded anew
            solver.reconfigure(dataclasses.replace(cfg, base_lr=cfg.base_lr / (2 + i), momentum=0.5))
        elif i in CHANGES and case != "two-solvers":
            loaded = _new_weights(solver, i)
            solver.network.load_weights(loaded, strict=False)
        s = solvers[i % len(solvers)]
        s.train_minibatch(ds.x_train[i * 32:(i + 1) * 32], ds.y_train[i * 32:(i + 1) * 32])
        losses.append(s.loss())
    return losses, solver.network.named_weights(), seen, loaded


@pytest.mark.parametrize("device_name,precision", MIXED)
@pytest.mark.parametrize("case", COPY_CASES)
def test_16_bit_weight_copies_follow_every_change_of_their_masters(device_name, precision, case):
    """Under bf16/fp16 the update writes each weight's 16-bit copy with the weight, and a replayed step casts only
    the copies of weights shared by name. Weights loaded between steps (and mid-accumulation), a weight shared by
    two layers (trained, or frozen and loaded anew: its copies cast in every replayed step), frozen weights
    (lr_mult 0) loaded anew, a rule that overrides ``update`` without ``copy``, AdamW's decoupled decay, a second
    solver of the same network, inference passes and reconfigure between steps must all give the losses, weights
    and inference outputs of the same training in float64 (within the 16-bit formats' roundoff:
    a stale copy is off by a whole step or a whole load)."""
    device = _mixed_device(device_name, precision)
    recorder = getattr(device, "recorder", None)
    before = recorder.replays if recorder is not None else 0
    losses, weights, seen, loaded = _train_copies_case(device, case)
    replayed = recorder.replays - before if recorder is not None else 0
    if device_name != "native":
        assert replayed >= 3, f"{replayed} steps replayed ({recorder.error})"
    f64 = lp.backend("native", dtype="float64")
    ref_losses, ref_weights, ref_seen, _ = _train_copies_case(f64, case)
    tol = 8e-3 if precision == "bf16" else 1.5e-3  # (a few times the roundoff seen on native and lavapipe)
    np.testing.assert_allclose(losses, ref_losses, rtol=tol, err_msg="per-step losses")
    for name, b in ref_weights.items():
        # Adam's steps are about ±lr wherever a gradient is near 0, whatever its size: roundoff flips a few
        atol = 5 * RULES["adamw"]["base_lr"] if case == "adamw" else tol * max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(weights[name], b, rtol=0, atol=atol, err_msg=name)
    for a, b in zip(seen, ref_seen):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * max(1.0, float(np.abs(b).max())), err_msg="inference")
    if case.endswith("frozen"):  # never moved from the values loaded last (bit for bit: nothing is added to them)
        for name in ["tied"] if case == "shared-frozen" else ["fc2/weight", "fc2/bias"]:
            np.testing.assert_array_equal(weights[name], loaded[name], err_msg=name)


@pytest.mark.parametrize("device_name,precision", [p for p in MIXED if p.values[1] == "fp16"])
def test_skipped_16_bit_steps_leave_the_weights_and_their_copies_as_they_were(device_name, precision):
    """fp16 with a loss scale too large for the format: the first steps' gradients overflow and their updates are
    skipped (on the device: neither a weight nor its copy written). The training that follows is that of a solver
    without loss scaling started at the same weights and iteration (float64), as if the skipped steps never ran."""
    device = _mixed_device(device_name, precision)
    cfg = dataclasses.replace(_config("momentum", "step", 1), loss_scale="dynamic", loss_scale_init=2.0 ** 28,
                              loss_scale_growth_interval=1000)
    solver, reference = twins(device, cfg)
    reference.reconfigure(dataclasses.replace(cfg, loss_scale="none"))
    ds = lp.data.digits()
    batches = [(ds.x_train[i * 32:(i + 1) * 32], ds.y_train[i * 32:(i + 1) * 32]) for i in range(12)]
    losses = []
    for x, y in batches:
        solver.train_minibatch(x, y)
        losses.append(solver.loss())
    skipped = solver.skipped_steps
    assert 2 <= skipped <= 8, f"{skipped} steps skipped: the scale should overflow the first steps, then fit"
    reference.iteration = skipped
    expected = []
    for x, y in batches[skipped:]:
        reference.train_minibatch(x, y)
        expected.append(reference.loss())
    np.testing.assert_allclose(losses[skipped:], expected, rtol=4e-3, err_msg="losses after the skipped steps")
    for w, r in zip(solver.network.learnable_weights_data(), reference.network.learnable_weights_data()):
        b = r.to_numpy()
        np.testing.assert_allclose(w.to_numpy(), b, rtol=0, atol=4e-3 * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("device_name,precision", MIXED)
def test_a_rewound_16_bit_solver_trains_again_as_it_trained(device_name, precision, tmp_path):
    """A solver set back to an earlier state (Solver.restore of its snapshot, load_weights of its weights, as a
    resumed checkpoint) between replayed steps trains on the same batches again with the same losses and ends at
    the same weights: the weights set back reach their 16-bit copies before the next step reads them. So does a
    solver loaded from a checkpoint of that state."""
    device = _mixed_device(device_name, precision)
    solver = lp.Solver.from_config(device, device, _config("momentum", "step", 1))
    ds = lp.data.digits()
    batches = [(ds.x_train[i * 32:(i + 1) * 32], ds.y_train[i * 32:(i + 1) * 32]) for i in range(8)]
    losses, saved = [], None
    for i, (x, y) in enumerate(batches):
        if i == 4:
            saved = solver.snapshot(), solver.network.named_weights()
            solver.save_checkpoint(str(tmp_path / "at4.leaf"))
        solver.train_minibatch(x, y)
        losses.append(solver.loss())
    trained = solver.network.named_weights()
    solver.restore(saved[0])
    solver.network.load_weights(saved[1])
    for s in (solver, lp.Solver.load_checkpoint(device, device, str(tmp_path / "at4.leaf"))):
        again = []
        for x, y in batches[4:]:
            s.train_minibatch(x, y)
            again.append(s.loss())
        np.testing.assert_allclose(again, losses[4:], rtol=1e-5, err_msg="losses after the rewind")
        for name, w in s.network.named_weights().items():
            np.testing.assert_allclose(w, trained[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_input_gradients_asked_for_after_a_recorded_step_are_computed(native64):
    """A frozen first layer (its backward pruned from the recorded step), then require_input_gradients([True])
    after the step was recorded and replayed: the next steps record anew and give the input gradient float64 NumPy
    gives, dy @ W_fc @ W_frozen (before: the old recording was replayed and the input gradient stayed 0); and they
    go on replaying."""
    net = lp.SequentialConfig(inputs=[("data", [4, 3])])
    net.add_layer(lp.LayerConfig("frozen", lp.LinearConfig(output_size=3),
                                 params=[lp.WeightConfig(lr_mult=0.0), lp.WeightConfig(lr_mult=0.0)]))
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    solver = mse_solver(native64, net, solver="momentum", base_lr=0.1, momentum=0.0, seed=0)
    rng = np.random.default_rng(0)
    for step in range(7):
        x, t = rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
        if step == 3:
            assert native64.replays > 0  # the step was recorded and replayed before the change
            solver.network.require_input_gradients([True])
        fw, fb, w, b = (v.to_numpy() for v in solver.network.learnable_weights_data())
        solver.train_minibatch(x, t)
        if step >= 3:
            dy = 2 * ((x @ fw.T + fb) @ w.T + b - t) / t.size
            np.testing.assert_allclose(solver.network.input_grads[0].to_numpy(), dy @ w @ fw, rtol=1e-12,
                                       atol=1e-14, err_msg=f"step {step}")
    assert native64.replays >= 3  # recorded again at step 4, replayed at 5 and 6 (and before)


def test_ids_a_step_computes_are_checked_on_every_native_step():
    """An Embedding reading ids that the step computes (a Slice of a record of ids and features): each native step
    refuses an id past its table as the first steps do; a replayed one, which runs no layer's check, clamped it and
    trained on. The steps before the bad batch equal those of a backend that never replays."""
    n, t, v = 8, 4, 10
    net = lp.SequentialConfig(inputs=[("data", [n, 2 * t])])
    net.add_layer(lp.LayerConfig("split", lp.SliceConfig(axis=1, slice_points=[t]), inputs=["data"],
                                 outputs=["ids", "rest"]))
    net.add_layer(lp.LayerConfig("emb", lp.EmbeddingConfig(input_dim=v, output_dim=3), inputs=["ids"],
                                 outputs=["e"]))
    net.add_layer(lp.LayerConfig("flat", "Flatten", inputs=["e"], outputs=["f"]))
    net.add_layer(lp.LayerConfig("cat", lp.ConcatConfig(axis=1), inputs=["f", "rest"], outputs=["c"]))
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=5), inputs=["c"], outputs=["z"]))
    net.add_layer(lp.LayerConfig("logsm", "LogSoftmax", inputs=["z"], outputs=["out"]))
    obj = lp.SequentialConfig(inputs=[("out", [n, 5]), ("label", [n])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=5)))
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj),
                          solver="momentum", base_lr=0.1, momentum=0.9, seed=0)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, v, (n, 2 * t)).astype(np.float32) for _ in range(5)]
    labels = rng.integers(0, 5, n)
    batches[3][2, 1] = 25.0
    losses = {}
    for replay in (True, False):
        be = lp.backend("native", dtype="float32")  # (a backend of its own: options make a new instance)
        be.replay = replay
        solver = lp.Solver.from_config(be, be, cfg)
        losses[replay] = []
        for x in batches[:3]:
            solver.train_minibatch(x, labels)
            losses[replay].append(solver.loss())
        with pytest.raises(lp.ShapeError, match=r"layer 'emb' \(Embedding\): the id at sample 2, position 1 of the "
                                                r"batch is 25\.0"):
            solver.train_minibatch(batches[3], labels)
        solver.train_minibatch(batches[4], labels)
        losses[replay].append(solver.loss())
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)


def _dropout_mlp() -> lp.SolverConfig:
    net = lp.SequentialConfig(inputs=[("data", [16, 20])])
    net.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=32)))
    net.add_layer(lp.LayerConfig("drop", lp.DropoutConfig(ratio=0.5)))
    net.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=4)))
    net.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    obj = lp.SequentialConfig(inputs=[("o", [16, 4]), ("label", [16, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=4)))
    return lp.SolverConfig(network=lp.LayerConfig("mlp", net), objective=lp.LayerConfig("loss", obj),
                           solver="momentum", base_lr=0.1, momentum=0.9, seed=0)


@pytest.mark.parametrize("interrupted", [0, 1])
def test_a_step_interrupted_before_its_update_leaves_no_trace(interrupted):
    """Ctrl-C after a step's forward and backward, before its update (in its first run, in the run recorded; a
    replayed step runs no function put on the backend, which the test's Ctrl-C is): the weights, the iteration and
    the Dropout draws stay as they were, so training the batch again gives the uninterrupted run bit for bit (the
    mask's draw was used up), and the steps after it replay."""
    rng = np.random.default_rng(0)
    batches = [(rng.random((16, 20), dtype=np.float32), rng.integers(0, 4, 16)) for _ in range(7)]
    be = lp.backend("native", dtype="float32")
    reference = lp.Solver.from_config(be, be, _dropout_mlp())
    for x, y in batches:
        reference.train_minibatch(x, y)
    solver = lp.Solver.from_config(be, be, _dropout_mlp())
    replays = be.replays
    for step, (x, y) in enumerate(batches):
        if step == interrupted:
            before = solver.network.named_weights()
            be.solver_update = lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())
            try:
                with pytest.raises(KeyboardInterrupt):
                    solver.train_minibatch(x, y)
            finally:
                del be.solver_update
            assert solver.iteration == step
            for name, w in solver.network.named_weights().items():
                np.testing.assert_array_equal(w, before[name])
        solver.train_minibatch(x, y)
    # the steps after replay: all calls but the first run and the one recorded (again, after a recorded one failed)
    assert be.replays - replays == len(batches) + 1 - 2 - (interrupted == 1)
    for name, w in solver.network.named_weights().items():
        np.testing.assert_array_equal(w, reference.network.named_weights()[name])


def test_a_deleted_solvers_recorded_step_lets_go_of_its_memory():
    """The native backend is one per process and keeps each thread's recorded steps; a recording held its
    operands' arrays, so a deleted solver's weights, gradients and Adam state (here about 50 MB) stayed alive until
    another step was recorded (a script that trained, then only predicted, kept them all along). Once the solver is
    deleted, the memory is released."""
    import gc
    import tracemalloc

    be = lp.backend("native")
    cfg = lp.SequentialConfig(inputs=[("data", [16, 256])])
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=2048)))
    cfg.add_layer(lp.LayerConfig("relu1", "ReLU"))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=1024)))
    cfg.add_layer(lp.LayerConfig("fc3", lp.LinearConfig(output_size=10)))
    obj = lp.SequentialConfig(inputs=[("out", [16, 10]), ("label", [16, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=10)))
    x = np.random.default_rng(0).random((16, 256), dtype=np.float32)
    y = np.arange(16) % 10

    def train() -> lp.Solver:
        solver = lp.Solver.from_config(be, be, lp.SolverConfig(
            network=lp.LayerConfig("net", cfg), objective=lp.LayerConfig("loss", obj), solver="adam", base_lr=1e-3))
        for _ in range(4):
            solver.train_minibatch(x, y)
        return solver

    train()  # (what a first step loads once: the compiled update loop, the scratch buffers)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        replays = be.replays
        solver = train()
        assert be.replays > replays
        held = tracemalloc.get_traced_memory()[0] - before
        del solver
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    weights = (256 * 2048 + 2048 * 1024 + 1024 * 10) * 4
    assert held > 4 * weights, held  # weights, gradients, Adam's two states
    assert left < weights, f"{left} of {held} bytes still held"
