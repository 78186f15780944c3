"""fp16 dynamic loss scaling against a NumPy float64 reference of the same rule (PyTorch GradScaler's): a step
whose gradients overflow is skipped (weights and momentum untouched, bit for bit), the scale backs off, grows after
growth_interval good steps, and a checkpoint taken midway resumes bit-exactly."""

from __future__ import annotations

import numpy as np
import pytest

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
    """The float64 trajectory: activations, weight copies and the loss's scaled gradient stored in float16,
    weights, gradients and momentum in float64; a step with a non-finite gradient is skipped."""
    x, t = _data()
    x16 = _half(x)
    hw, hb = np.zeros_like(w), np.zeros_like(b)
    good = skipped = 0
    history = []
    for _ in range(steps):
        y = _half(x16 @ _half(w).T + _half(b))
        dy = _half(scale * 2.0 * (y - t) / y.size)
        with np.errstate(invalid="ignore"):  # inf - inf in an overflowing step
            gw, gb = dy.T @ x16 / scale, dy.sum(axis=0) / scale
        if not np.isfinite(np.sum(gw * gw) + np.sum(gb * gb)):
            skipped += 1
            scale *= 0.5
            good = 0
        else:
            hw = MOMENTUM * hw + LR * gw
            hb = MOMENTUM * hb + LR * gb
            w, b = w - hw, b - hb
            good += 1
            if good == interval:
                scale *= 2.0
                good = 0
        history.append((scale, skipped))
    return w, b, history


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
                                         ("loss_scale_growth_interval", 0)])
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
