"""fp16 dynamic loss scaling against a NumPy float64 reference of the same rule (PyTorch GradScaler's): a step
whose gradients overflow is skipped (weights and momentum untouched, bit for bit), the scale backs off, grows after
growth_interval good steps, and a checkpoint taken midway resumes bit-exactly."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import backend_or_skip, child_env

import leafpy as lp
from leafpy.errors import ConfigError

N, K, OUT = 8, 4, 3
LR, MOMENTUM = 0.1, 0.9


def _config(**scaling):
    net = lp.SequentialConfig(inputs=[("data", [N, K])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=OUT)))
    obj = lp.SequentialConfig(inputs=[("out", [N, OUT]), ("target", [N, OUT])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    return lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj),
                           solver="momentum", base_lr=LR, momentum=MOMENTUM, seed=4, **scaling)


def _data():
    rng = np.random.default_rng(1)
    return rng.standard_normal((N, K)), rng.standard_normal((N, OUT))


def _half(a):
    """float64 values rounded to float16 (overflow: inf) and back."""
    with np.errstate(over="ignore"):
        return np.asarray(a, np.float64).astype(np.float16).astype(np.float64)


def _reference(w, b, steps, scale, interval):
    """The float64 trajectory on the same batch every step: (weights, bias, [(scale, skipped steps) per step])."""
    w, b, _, _, _, history = _trajectory(w, b, [_data()] * steps, scale, interval)
    return w, b, history


def _trajectory(w, b, batches, scale, interval, dynamic=True, k=1, clip=None, decay=None):
    """The float64 trajectory: activations, weight copies and the loss's scaled gradient stored in float16,
    weights, gradients and momentum in float64; each update sums the scaled gradients of k batches and divides by
    the scale; a step with a non-finite gradient is skipped (dynamic: the scale halves, else it stays), a finite
    one is clipped to norm ``clip``, averaged over k, decayed by ``decay`` and applied. Returns (weights, bias,
    their momentum histories, (scale, good steps, skipped steps), [(scale, skipped steps) per update])."""
    hw, hb = np.zeros_like(w), np.zeros_like(b)
    good = skipped = 0
    history = []
    for u in range(len(batches) // k):
        gw, gb = np.zeros_like(w), np.zeros_like(b)
        for x, t in batches[u * k:(u + 1) * k]:
            x16 = _half(x)
            y = _half(x16 @ _half(w).T + _half(b))
            dy = _half(scale * 2.0 * (y - t) / y.size)
            with np.errstate(invalid="ignore"):  # inf - inf in an overflowing step
                gw, gb = gw + dy.T @ x16, gb + dy.sum(axis=0)
        with np.errstate(invalid="ignore"):
            gw, gb = gw / scale, gb / scale
            total = np.sum(gw * gw) + np.sum(gb * gb)
        if not np.isfinite(total):
            skipped += 1
            if dynamic:
                scale *= 0.5
                good = 0
        else:
            if clip is not None and np.sqrt(total) > clip:
                gw, gb = gw * (clip / np.sqrt(total)), gb * (clip / np.sqrt(total))
            gw, gb = gw / k, gb / k
            if decay is not None:
                gw, gb = gw + decay * w, gb + decay * b
            hw = MOMENTUM * hw + LR * gw
            hb = MOMENTUM * hb + LR * gb
            w, b = w - hw, b - hb
            if dynamic:
                good += 1
                if good == interval:
                    scale *= 2.0
                    good = 0
        history.append((scale, skipped))
    return w, b, hw, hb, (scale, good, skipped), history


def _solver(**scaling):
    be = lp.backend("native", precision="fp16")
    return lp.Solver.from_config(be, be, _config(**scaling))


def test_overflowing_scale_skips_backs_off_and_grows_like_the_reference():
    solver = _solver(loss_scale_init=2.0**40, loss_scale_growth_interval=3)
    assert solver.loss_scaling() == "dynamic"
    w0, b0 = (t.to_numpy().copy() for t in solver.network.learnable_weights_data())
    x, t = _data()
    ref_w, ref_b, history = _reference(w0.astype(np.float64), b0.astype(np.float64), 40, 2.0**40, 3)
    first_good = next(i for i, (_, skipped) in enumerate(history) if skipped == i)  # the first step not skipped
    assert first_good >= 10, "the test needs an initial scale that overflows for many steps"
    for i in range(40):
        solver.train_minibatch(x, t)
        if i < first_good:  # skipped so far: the weights and the momentum are untouched, bit for bit
            w, b = (t_.to_numpy() for t_ in solver.network.learnable_weights_data())
            assert np.array_equal(w, w0) and np.array_equal(b, b0), f"step {i} was skipped but changed weights"
            assert all(not np.any(s.to_numpy()) for state in solver.state for s in state)
        assert (solver.loss_scale, solver.skipped_steps) == history[i], f"step {i}"
    assert solver.iteration == 40  # skipped steps advance the iteration counter
    assert history[-1][1] > first_good, "the scale grew into overflow again later on"
    w, b = (t_.to_numpy() for t_ in solver.network.learnable_weights_data())
    np.testing.assert_allclose(w, ref_w, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(b, ref_b, rtol=1e-3, atol=1e-4)
    assert not np.allclose(w, w0), "training went on after the skipped steps"


def test_resume_mid_run_is_bit_exact(tmp_path):
    x, t = _data()
    whole = _solver(loss_scale_init=2.0**30, loss_scale_growth_interval=3)
    for _ in range(30):
        whole.train_minibatch(x, t)
    first = _solver(loss_scale_init=2.0**30, loss_scale_growth_interval=3)
    for _ in range(17):
        first.train_minibatch(x, t)
    first.save_checkpoint(str(tmp_path / "ckpt.leaf"))
    be = lp.backend("native", precision="fp16")
    resumed = lp.Solver.load_checkpoint(be, be, str(tmp_path / "ckpt.leaf"))
    assert resumed.config == first.config  # the loss-scaling settings travel with the checkpoint
    assert (resumed.loss_scale, resumed.loss_scale_good_steps, resumed.skipped_steps) == \
        (first.loss_scale, first.loss_scale_good_steps, first.skipped_steps)
    for _ in range(13):
        resumed.train_minibatch(x, t)
    assert resumed.skipped_steps == whole.skipped_steps > 0
    assert resumed.loss_scale == whole.loss_scale and resumed.iteration == whole.iteration == 30
    for a, b in zip(resumed.network.learnable_weights_data(), whole.network.learnable_weights_data()):
        assert np.array_equal(a.to_numpy(), b.to_numpy())


def test_static_scale_and_defaults(tmp_path):
    assert _solver(loss_scale=1024).loss_scaling() == "static"
    static = _solver(loss_scale=1024, loss_scale_backoff_factor=0.25)
    static.save_checkpoint(str(tmp_path / "static.leaf"))
    be = lp.backend("native", precision="fp16")
    assert lp.Solver.load_checkpoint(be, be, str(tmp_path / "static.leaf")).config == static.config
    run = lp.config.to_dict(lp.config.RunConfig(name="x", network=static.config.network,
                                                objective=static.config.objective, solver=static.config))
    assert run["solver"]["loss_scale"] == 1024.0 and run["solver"]["loss_scale_backoff_factor"] == 0.25
    assert _solver(loss_scale="none").loss_scaling() == "none"
    be = lp.backend("native", precision="bf16")
    assert lp.Solver.from_config(be, be, _config()).loss_scaling() == "none"
    fp16 = _solver()
    assert fp16.loss_scale == 65536.0 and fp16.config.loss_scale_growth_interval == 2000
    x, t = _data()
    static = _solver(loss_scale=2.0**40)  # a static scale never changes; its overflowing steps are skipped
    for _ in range(3):
        static.train_minibatch(x, t)
    assert static.loss_scale == 2.0**40 and static.skipped_steps == 3


@pytest.mark.parametrize("field,value", [("loss_scale", "dynamc"), ("loss_scale", -2.0),
                                         ("loss_scale_growth_factor", 0.5), ("loss_scale_backoff_factor", 1.5),
                                         ("loss_scale_growth_interval", 0),
                                         ("loss_scale_growth_interval", 2**24 + 1),
                                         # finite as Python floats, but inf and 0 in the float32 the scale is kept
                                         # in: every step would be skipped, silently, for ever
                                         ("loss_scale", 1e39), ("loss_scale_init", 1e39), ("loss_scale_init", 1e-46)])
def test_bad_loss_scale_settings_are_named(field, value):
    with pytest.raises(ConfigError, match=f"solver.{field}"):
        _config(**{field: value})


def test_scale_follows_the_setting_when_a_checkpoint_changes_hands(tmp_path):
    """A checkpoint saved without loss scaling, resumed in fp16, starts at the initial scale; one saved in fp16,
    resumed in bf16 (no scaling), leaves the loss unscaled."""
    x, t = _data()
    bf16 = lp.backend("native", precision="bf16")
    plain = lp.Solver.from_config(bf16, bf16, _config())
    plain.train_minibatch(x, t)
    plain.save_checkpoint(str(tmp_path / "plain.leaf"))
    fp16 = lp.backend("native", precision="fp16")
    assert lp.Solver.load_checkpoint(fp16, fp16, str(tmp_path / "plain.leaf")).loss_scale == 65536.0
    scaled = _solver(loss_scale_init=2.0**30)
    for _ in range(3):
        scaled.train_minibatch(x, t)
    assert scaled.loss_scale < 2.0**30
    scaled.save_checkpoint(str(tmp_path / "scaled.leaf"))
    resumed = lp.Solver.load_checkpoint(bf16, bf16, str(tmp_path / "scaled.leaf"))
    assert resumed.loss_scaling() == "none" and resumed.loss_scale == 1.0
    before = [w.to_numpy() for w in resumed.network.learnable_weights_data()]
    resumed.train_minibatch(x, t)
    step = [b - w.to_numpy() for b, w in zip(before, resumed.network.learnable_weights_data())]
    assert max(np.abs(s).max() for s in step) < 1.0  # an unscaled gradient's step, not 2**30 times one


# --- loss scaling on the device: steps replay, nothing is read back ----------------------------------------------
DEVICES = ["native", pytest.param("webgpu", marks=pytest.mark.webgpu), pytest.param("cuda", marks=pytest.mark.cuda)]
_BACKENDS: dict[str, lp.Backend] = {}


def _fp16(name):
    """The backend ``name`` in fp16 (skips where it or, on webgpu, the adapter's shader-f16 feature is missing)."""
    if name not in _BACKENDS:
        backend_or_skip(name)
        try:
            be = lp.backend(name, precision="fp16")
        except lp.BackendError as e:  # webgpu on an adapter without shader-f16
            pytest.skip(f"{name} backend has no fp16 here: {e}")
        _BACKENDS[name] = be
    return _BACKENDS[name]


class _Watch:
    """Counts, while ``active``, host reads of device data (SharedTensor.to_numpy and the backend's download) and
    the keys the solver's steps run under (None: the step may not be recorded)."""

    def __init__(self, monkeypatch, be):
        self.active, self.reads, self.keys = False, 0, []
        to_numpy, download = lp.SharedTensor.to_numpy, type(be).download

        def counted_to_numpy(tensor):
            self.reads += self.active
            return to_numpy(tensor)

        def counted_download(backend, buf, host):
            self.reads += self.active
            return download(backend, buf, host)

        run_step = be.run_step

        def watched_run_step(key, step):
            self.keys.append(key)
            return run_step(key, step)

        monkeypatch.setattr(lp.SharedTensor, "to_numpy", counted_to_numpy)
        monkeypatch.setattr(type(be), "download", counted_download)
        monkeypatch.setattr(be, "run_step", watched_run_step)

    def replays(self, be) -> int:
        recorder = getattr(be, "recorder", None)
        return recorder.replays if recorder is not None else 0


def _batches(calls, overflow):
    """Random batches; on the calls in ``overflow`` a target of 1e6, whose scaled gradient overflows float16."""
    rng = np.random.default_rng(7)
    batches = []
    for i in range(calls):
        x, t = rng.standard_normal((N, K)), rng.standard_normal((N, OUT))
        batches.append((x, np.full((N, OUT), 1e6) if i in overflow else t))
    return batches


SCALED_CASES = {
    "dynamic": (dict(loss_scale_init=2.0**8, loss_scale_growth_interval=3), 1, {3, 6, 7, 12}),
    "static": (dict(loss_scale=2.0**8), 1, {3, 6, 7, 12}),
    "accumulate-clip-decay": (dict(loss_scale_init=2.0**8, loss_scale_growth_interval=3, minibatch_size=2,
                                   clip_gradients=0.5, weight_decay=0.01), 2, {7, 13, 14, 25}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(SCALED_CASES))
def test_loss_scaled_steps_replay_and_match_the_reference(device, case, monkeypatch):
    """fp16 with loss scaling and overflow on chosen steps: every step from the third on (per accumulation phase)
    replays, none reads anything back, a skipped update leaves weights and momentum bit for bit as they were, and
    weights, momentum, scale, good steps and skipped steps end as in the float64 reference."""
    settings, k, overflow = SCALED_CASES[case]
    be = _fp16(device)
    solver = lp.Solver.from_config(be, be, _config(**settings))
    dynamic = "loss_scale" not in settings
    assert solver.loss_scaling() == ("dynamic" if dynamic else "static")
    w0, b0 = (t.to_numpy().astype(np.float64) for t in solver.network.learnable_weights_data())
    updates = 16
    batches = _batches(updates * k, overflow)
    watch = _Watch(monkeypatch, be)
    replays = watch.replays(be)
    skipped_updates = {i // k for i in overflow}
    for u in range(updates):
        if u in skipped_updates:
            before = [t.to_numpy() for t in solver.network.learnable_weights_data()]
            before += [s.to_numpy() for state in solver.state for s in state]
        for x, t in batches[u * k:(u + 1) * k]:
            watch.active = True
            solver.train_minibatch(x, t)
            watch.active = False
        if u in skipped_updates:
            after = [t.to_numpy() for t in solver.network.learnable_weights_data()]
            after += [s.to_numpy() for state in solver.state for s in state]
            assert all(np.array_equal(a, b) for a, b in zip(before, after)), f"update {u} was skipped but wrote"
    assert watch.reads == 0, "a loss-scaled step read device data back to the host"
    assert None not in watch.keys, "a loss-scaled step was not offered for recording"
    if device != "native":
        assert watch.replays(be) - replays == updates * k - 2 * (2 if k > 1 else 1)
    ref_w, ref_b, ref_hw, ref_hb, (scale, good, skipped), _ = _trajectory(
        w0, b0, batches, settings.get("loss_scale", 2.0**8), 3, dynamic=dynamic, k=k,
        clip=settings.get("clip_gradients"), decay=settings.get("weight_decay"))
    assert skipped == len(skipped_updates) and (scale != 2.0**8) == dynamic
    assert (solver.loss_scale, solver.loss_scale_good_steps, solver.skipped_steps) == (scale, good, skipped)
    assert solver.iteration == updates
    w, b = (t.to_numpy() for t in solver.network.learnable_weights_data())
    (hw,), (hb,) = ([s.to_numpy() for s in state] for state in solver.state)
    for got, want, what in ((w, ref_w, "weights"), (b, ref_b, "bias"), (hw, ref_hw, "weights' momentum"),
                            (hb, ref_hb, "bias's momentum")):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=what)


RULE_SETTINGS = {"momentum": dict(momentum=0.9), "nesterov": dict(momentum=0.9), "adam": dict(base_lr=0.01),
                 "rmsprop": dict(base_lr=0.01), "adagrad": dict(base_lr=0.05), "adadelta": dict(base_lr=1.0),
                 "adamw": dict(base_lr=0.01, weight_decay=0.1)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", list(RULE_SETTINGS))
def test_every_rule_skips_a_replayed_step_bit_for_bit(device, rule):
    """An overflowing step that replays leaves the weights and every rule's state as they were, backs the scale off,
    and the next finite step updates again."""
    be = _fp16(device)
    cfg = dataclasses.replace(_config(loss_scale_init=2.0**8), solver=rule, **RULE_SETTINGS[rule])
    solver = lp.Solver.from_config(be, be, cfg)
    batches = _batches(7, {5})
    replays = getattr(getattr(be, "recorder", None), "replays", 0)

    def values():
        return [t.to_numpy() for t in solver.network.learnable_weights_data()] + \
            [s.to_numpy() for state in solver.state for s in state]

    for x, t in batches[:5]:
        solver.train_minibatch(x, t)
    before = values()
    assert any(np.any(v != 0) for v in before[2:]), "the rule's state should have moved"
    solver.train_minibatch(*batches[5])
    assert all(np.array_equal(a, b) for a, b in zip(before, values())), "the skipped step wrote"
    assert (solver.loss_scale, solver.skipped_steps, solver.iteration) == (2.0**7, 1, 6)
    solver.train_minibatch(*batches[6])
    assert not np.array_equal(before[0], values()[0]), "the step after the skipped one applied nothing"
    if device != "native":
        assert be.recorder.replays - replays == 5


@pytest.mark.parametrize("device", DEVICES)
def test_a_scale_set_between_replayed_steps_reaches_the_device(device):
    """Setting the scale, its good steps and skipped steps (as a resume does) takes effect in the next replayed
    step: a scale of 2**40 overflows it, and the counts go on from the values set."""
    be = _fp16(device)
    solver = lp.Solver.from_config(be, be, _config(loss_scale_init=2.0**8, loss_scale_growth_interval=100))
    batches = _batches(6, set())
    for x, t in batches[:4]:
        solver.train_minibatch(x, t)
    assert (solver.loss_scale, solver.loss_scale_good_steps, solver.skipped_steps) == (2.0**8, 4, 0)
    solver.loss_scale, solver.loss_scale_good_steps, solver.skipped_steps = 2.0**40, 7, 2**30
    solver.train_minibatch(*batches[4])
    assert (solver.loss_scale, solver.loss_scale_good_steps, solver.skipped_steps) == (2.0**39, 0, 2**30 + 1)
    solver.loss_scale = 2.0**8
    solver.train_minibatch(*batches[5])
    assert (solver.loss_scale, solver.loss_scale_good_steps, solver.skipped_steps) == (2.0**8, 1, 2**30 + 1)
    if device != "native":
        assert be.recorder.replays >= 3


def test_cli_fp16_run_resumed_mid_way_equals_the_uninterrupted_run(tmp_path):
    """`leafpy train --precision fp16` stopped after an epoch (with a backed-off scale and skipped steps in its
    checkpoint) and resumed ends bit for bit where the uninterrupted run ends: weights, scale, counts."""
    root = Path(__file__).resolve().parent.parent
    env = child_env()

    def train(out, epochs, *extra):
        args = [sys.executable, "-m", "leafpy.cli", "train", str(root / "configs" / "digits_mlp.yaml"),
                "--precision", "fp16", "--out", str(out), "--epochs", str(epochs),
                "--set", "solver.loss_scale_init=16777216", "--set", "solver.loss_scale_growth_interval=5", *extra]
        done = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return lp.Solver.load_checkpoint(native, native, str(out / "checkpoint.leaf"))

    native = lp.backend("native", precision="fp16")
    whole = train(tmp_path / "whole", 2)
    part = train(tmp_path / "part", 1)
    assert part.iteration == whole.iteration // 2
    assert part.skipped_steps > 0 and part.loss_scale != 2.0**24, "the checkpoint should carry a changed scale"
    resumed = train(tmp_path / "part", 2, "--resume", str(tmp_path / "part" / "checkpoint.leaf"))
    assert resumed.iteration == whole.iteration
    assert (resumed.loss_scale, resumed.loss_scale_good_steps, resumed.skipped_steps) == \
        (whole.loss_scale, whole.loss_scale_good_steps, whole.skipped_steps)
    assert resumed.skipped_steps > part.skipped_steps or resumed.loss_scale != part.loss_scale
    for name, a, b in zip(whole.network.learnable_weights_names(), resumed.network.learnable_weights_data(),
                          whole.network.learnable_weights_data()):
        assert np.array_equal(a.to_numpy(), b.to_numpy()), name


def test_a_rule_that_cannot_skip_on_the_device_is_skipped_on_the_host(monkeypatch):
    """A custom rule built from plain primitives cannot see the skip flag on the device: under loss scaling its
    overflowing steps are skipped on the host (the steps then run eagerly) and leave the weights as they were."""
    from leafpy.solvers import UpdateRule, registry, update_rules

    class PlainSGD(UpdateRule):
        name = "plain_sgd_scaled_for_test"

        def update(self, backend, w, g, state, rate, lr_mult):
            host = np.empty(2, np.float32)
            backend.download(rate, host)  # [the step's rate, apply]
            backend.axpby(-float(host[0]) * lr_mult, g, 1.0, w)  # w -= rate * g, whatever rate[1] says

    update_rules()
    monkeypatch.setitem(registry._RULES, PlainSGD.name, PlainSGD)
    be = lp.backend("native", precision="fp16")
    solver = lp.Solver.from_config(be, be, dataclasses.replace(_config(loss_scale_init=2.0**8),
                                                               solver=PlainSGD.name))
    keys = []
    run_step = be.run_step
    monkeypatch.setattr(be, "run_step", lambda key, step: keys.append(key) or run_step(key, step))
    batches = _batches(4, {2})
    for x, t in batches[:2]:
        solver.train_minibatch(x, t)
    before = [w.to_numpy() for w in solver.network.learnable_weights_data()]
    solver.train_minibatch(*batches[2])
    assert all(np.array_equal(a, w.to_numpy()) for a, w in zip(before, solver.network.learnable_weights_data()))
    assert (solver.loss_scale, solver.skipped_steps) == (2.0**7, 1)
    solver.train_minibatch(*batches[3])
    assert not np.array_equal(before[0], solver.network.learnable_weights_data()[0].to_numpy())
    assert keys == [None] * 4, "a rule that cannot skip on the device must not be recorded"


PLAIN = ["native", pytest.param("webgpu", marks=pytest.mark.webgpu), pytest.param("cuda", marks=pytest.mark.cuda)]
BIG = float(np.float32(2.0**127))
DECISIONS = [  # sumsq, scale, [good, skipped], dynamic -> scale, [good, skipped], apply (growth 2, backoff 0.5, 3)
    (5.0, 8.0, [1, 4], True, 8.0, [2, 4], 1),
    (5.0, 8.0, [2, 4], True, 16.0, [0, 4], 1),
    (5.0, BIG, [2, 4], True, BIG, [0, 4], 1),  # growing would overflow float32: the scale stays
    (np.inf, 8.0, [2, 4], True, 4.0, [0, 5], 0),
    (np.nan, 8.0, [1, 0], True, 4.0, [0, 1], 0),
    (np.inf, 8.0, [2, 4], False, 8.0, [2, 5], 0),  # a static scale: only the skip is counted
    (5.0, 8.0, [2, 4], False, 8.0, [2, 4], 1),
]


@pytest.mark.parametrize("device", PLAIN)
def test_loss_scale_update_and_unscale_primitives(device):
    """The device's decision against the rule written out: apply or skip, back off, grow (unless the scale would
    overflow), count; and unscale multiplies by the scale's reciprocal."""
    be = backend_or_skip(device)
    for sumsq, scale, counts, dynamic, want_scale, want_counts, want_apply in DECISIONS:
        ts = [lp.SharedTensor.from_numpy(np.array(v, np.float32)) for v in ([sumsq], [scale], counts, [0.25, 0.5])]
        be.loss_scale_update(*(t.read_write(be) for t in ts), 2.0, 0.5, 3, dynamic)
        got = (float(ts[1].to_numpy()[0]), ts[2].to_numpy().tolist(), ts[3].to_numpy().tolist())
        assert got == (want_scale, want_counts, [0.25, want_apply]), (sumsq, scale, counts, dynamic)
    x = np.random.default_rng(3).standard_normal((5, 7)).astype(np.float32)
    tx, tscale = lp.SharedTensor.from_numpy(x), lp.SharedTensor.from_numpy(np.array([1024.0], np.float32))
    be.unscale(tx.read_write(be), tscale.read(be))
    np.testing.assert_allclose(tx.to_numpy(), x / 1024.0, rtol=1e-7)


@pytest.mark.parametrize("device", PLAIN)
def test_sum_squares_primitive(device):
    """Backend.sum_squares over gradients of many sizes (around cuda's 4096-element chunks): the float64 sum of
    squares; with a scale each buffer is first unscaled in place; called again with the same workspace (cuda keeps
    its tables there) it reads the buffers' new values; an inf in one buffer makes the sum inf."""
    be = backend_or_skip(device)
    rng = np.random.default_rng(11)
    shapes = [(1,), (64, 3, 11, 11), (4095,), (3, 4097), (10,)]
    xs = [(rng.standard_normal(s) * 30).astype(np.float32) for s in shapes]
    ts = [lp.SharedTensor.from_numpy(x) for x in xs]
    out, scale = lp.SharedTensor((1,), np.float32), lp.SharedTensor.from_numpy(np.array([512.0], np.float32))
    ws: dict = {}
    be.sum_squares([t.read_write(be) for t in ts], out.write(be), ws)
    assert float(out.to_numpy()[0]) == pytest.approx(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in xs),
                                                     rel=1e-5)
    be.sum_squares([t.read_write(be) for t in ts], out.write(be), ws, scale.read(be))
    unscaled = [x.astype(np.float64) / 512.0 for x in xs]
    for t, u in zip(ts, unscaled):
        np.testing.assert_allclose(t.to_numpy(), u, rtol=1e-6)
    assert float(out.to_numpy()[0]) == pytest.approx(sum(float(np.sum(u ** 2)) for u in unscaled), rel=1e-5)
    bad = xs[3].copy()
    bad[1, 4000] = np.inf
    ts[3].set(bad)
    be.sum_squares([t.read_write(be) for t in ts], out.write(be), ws)
    assert np.isinf(out.to_numpy()[0])


@pytest.mark.parametrize("saved,resumed", [("fp16", "fp32"), ("fp16", "bf16"), ("bf16", "fp16"), ("fp16", "fp16")])
def test_a_checkpoint_inside_gradient_accumulation_resumes_in_another_precision_with_the_right_step(tmp_path, saved,
                                                                                                  resumed):
    """minibatch_size 2, a checkpoint after the first of the two calls (the gradients accumulated so far carry the
    loss scale of the precision they were computed in), resumed in another precision: the update the second call
    makes is plain SGD's on both batches, against float64 NumPy (before: 60,000 times too large from fp16 to fp32 or
    bf16, the first batch's share divided by 65536 from bf16 to fp16)."""
    n, k, m = 8, 4, 3
    net = lp.SequentialConfig(inputs=[("data", [n, k])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=m)))
    obj = lp.SequentialConfig(inputs=[("out", [n, m]), ("target", [n, m])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj),
                          solver="momentum", momentum=0.0, base_lr=0.1, seed=4, minibatch_size=2)
    rng = np.random.default_rng(1)
    batches = [(rng.standard_normal((n, k)), rng.standard_normal((n, m))) for _ in range(2)]
    first = lp.backend("native", precision=saved)
    a = lp.Solver.from_config(first, first, cfg)
    w0, b0 = (t.to_numpy().astype(np.float64) for t in a.network.learnable_weights_data())
    a.train_minibatch(*batches[0])
    a.save_checkpoint(str(tmp_path / "mid.leaf"))
    second = lp.backend("native", precision=resumed)
    b = lp.Solver.load_checkpoint(second, second, str(tmp_path / "mid.leaf"))
    b.train_minibatch(*batches[1])
    grad = sum((2 * (x @ w0.T + b0 - t) / t.size).T @ x for x, t in batches) / 2
    step = b.network.learnable_weights_data()[0].to_numpy().astype(np.float64) - w0
    np.testing.assert_allclose(step, -0.1 * grad, rtol=0.02, atol=2e-3 * np.abs(grad).max())
