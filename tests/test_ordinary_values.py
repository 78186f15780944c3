"""Ordinary values that used to end in raw Python exceptions: learning-rate policies evaluated far from their
comfortable range (checked against SciPy / float64 references), odd arguments to the public API, empty batches,
and checkpoints whose counters cannot be right."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import expit

import leafpy as lp


def solver_config(**kw) -> lp.SolverConfig:
    return lp.SolverConfig(base_lr=0.01, **kw)


@pytest.mark.parametrize("it", [0, 1, 50_000, 99_999, 100_000, 100_001, 10**6, 10**9, 2**53])
def test_sigmoid_policy_far_from_its_step_matches_the_logistic_function(it):
    cfg = solver_config(lr_policy="sigmoid", gamma=0.01, stepsize=100_000)
    ref = 0.01 * expit(np.float64(0.01) * (it - 100_000))
    assert cfg.learning_rate(it) == pytest.approx(ref, rel=1e-12, abs=1e-300)
    assert cfg.learning_rate(0) == pytest.approx(0.0, abs=1e-300)  # Caffe: 0.01 / (1 + e^1000) = 0


def test_sigmoid_policy_with_a_negative_gamma_decays():
    cfg = solver_config(lr_policy="sigmoid", gamma=-0.5, stepsize=10)
    for it in (0, 10, 20, 5000):
        assert cfg.learning_rate(it) == pytest.approx(0.01 * expit(-0.5 * (it - 10)), rel=1e-12, abs=1e-300)


@pytest.mark.parametrize("gamma", [1.5, 2.0])
def test_a_growing_exp_policy_is_exact_until_it_overflows_then_a_config_error(gamma):
    cfg = solver_config(lr_policy="exp", gamma=gamma)
    with np.errstate(over="ignore"):
        refs = {it: np.float64(0.01) * np.power(np.float64(gamma), it) for it in (0, 10, 500, 1700, 1800, 5000)}
    for it, ref in refs.items():
        if np.isfinite(ref):
            assert cfg.learning_rate(it) == pytest.approx(ref, rel=1e-9)
        else:
            # (max_iter ends no run: the message does not send users to it)
            with pytest.raises(lp.ConfigError, match=rf"exp policy.*iteration {it}.*fewer epochs \(max_iter ends no"):
                cfg.learning_rate(it)


def test_step_and_exp_policies_underflow_to_zero_at_huge_iterations():
    for cfg in (solver_config(lr_policy="exp", gamma=0.5), solver_config(lr_policy="step", gamma=0.1, stepsize=1)):
        assert cfg.learning_rate(2**53) == 0.0 or cfg.learning_rate(2**53) < 1e-300


def test_inv_policy_with_a_negative_gamma_is_refused():
    """Its rate grows towards a pole at iteration 100; max_iter does not end training, so it is no way out."""
    with pytest.raises(lp.ConfigError, match=r"solver\.gamma.*inv.*iteration 100.*use gamma >= 0"):
        solver_config(lr_policy="inv", gamma=-0.01, power=0.75)
    with pytest.raises(lp.ConfigError, match=r"solver\.gamma.*inv"):
        solver_config(lr_policy="inv", gamma=-0.01, power=0.75, max_iter=99)
    cfg = solver_config(lr_policy="inv", gamma=0.01, power=0.75)
    for it in (0, 50, 10**6):
        assert cfg.learning_rate(it) == pytest.approx(0.01 * (1 + 0.01 * it) ** -0.75, rel=1e-12)


@pytest.mark.parametrize("rule", ["adagrad", "rmsprop", "adam", "adamw", "adadelta"])
def test_an_epsilon_float32_cannot_hold_is_refused_and_a_usual_one_keeps_unused_weights(rule):
    """An epsilon of 1e-50 is 0 in float32: a weight whose gradient is 0 (a feature that is always 0) would take the
    step 0/(sqrt(0) + 0) = nan. Refused, naming the field; with 1e-8 that weight does not move."""
    with pytest.raises(lp.ConfigError, match=r"solver\.epsilon: 1e-50 is below float32's smallest normal number "
                                             r"1\.17549e-38.*1e-8 is usual"):
        solver_config(solver=rule, epsilon=1e-50)
    net = lp.SequentialConfig(inputs=[("data", [4, 3])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    obj = lp.SequentialConfig(inputs=[("network_out", [4, 2]), ("target", [4, 2])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj), solver=rule,
                          base_lr=0.1, epsilon=1.2e-38, weight_decay=0.0, seed=0)
    be = lp.backend("native")
    solver = lp.Solver.from_config(be, be, cfg)
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    x[:, 0] = 0.0
    before = np.array(solver.network.named_weights()["fc/weight"])
    solver.train_minibatch(x, np.ones((4, 2), np.float32))
    after = np.array(solver.network.named_weights()["fc/weight"])
    assert np.all(np.isfinite(after))
    np.testing.assert_array_equal(after[:, 0], before[:, 0])  # no gradient, no decay: not moved
    if rule != "adadelta":  # (whose first steps are about sqrt(epsilon) long)
        assert np.all(after[:, 1:] != before[:, 1:])


def test_a_static_loss_scale_takes_numpy_numbers_and_refuses_strings():
    assert solver_config(loss_scale=np.float32(8)).loss_scale == 8.0
    assert solver_config(loss_scale=np.int64(1024)).loss_scale == 1024.0
    for bad in ("8", " 8 ", "1_0", True, [8]):
        with pytest.raises(lp.ConfigError, match=r"solver\.loss_scale: expected 'dynamic', 'none' or a positive "
                                                 r"number"):
            solver_config(loss_scale=bad)


def test_poly_policy_negative_power_is_refused_and_its_end_is_zero():
    with pytest.raises(lp.ConfigError, match=r"solver\.power.*poly"):
        solver_config(lr_policy="poly", power=-1.0, max_iter=100)
    cfg = solver_config(lr_policy="poly", power=2.0, max_iter=100)
    assert cfg.learning_rate(100) == 0.0 and cfg.learning_rate(10**6) == 0.0
    assert cfg.learning_rate(30) == pytest.approx(0.01 * 0.7**2, rel=1e-12)


def test_gamma_negative_for_multiplying_policies_is_refused():
    for policy in ("step", "exp", "multistep"):
        with pytest.raises(lp.ConfigError, match=r"solver\.gamma"):
            solver_config(lr_policy=policy, gamma=-0.1, stepvalues=(10,))


def test_unknown_or_positional_solver_config_arguments_are_config_errors():
    with pytest.raises(lp.ConfigError, match="unknown field 'foo'; valid fields: .*base_lr"):
        lp.SolverConfig(foo=1)
    with pytest.raises(lp.ConfigError, match="keyword arguments only"):
        lp.SolverConfig(0.01)


def test_backend_options_are_checked():
    with pytest.raises(lp.ConfigError, match="backend 'native'.*bogus"):
        lp.backend("native", dtype="bogus")
    with pytest.raises(lp.ConfigError, match="unknown option 'threads'; valid options: dtype"):
        lp.backend("native", threads=4)
    with pytest.raises(lp.ConfigError, match="unknown backend"):
        lp.backend(["native"])


def small_net(be, batch=4):
    cfg = lp.SequentialConfig(inputs=[("data", [batch, 3])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    return cfg


def small_solver(be, **kw):
    obj = lp.SequentialConfig(inputs=[("network_out", [4, 2]), ("label", [4, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=2)))
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", small_net(be)), objective=lp.LayerConfig("loss", obj),
                          base_lr=0.1, seed=0, **kw)
    return lp.Solver.from_config(be, be, cfg)


def test_paths_that_are_not_paths_are_config_errors(native, tmp_path):
    net = lp.Layer.from_config(native, lp.LayerConfig("net", small_net(native)))
    with pytest.raises(lp.ConfigError, match="Layer.save: path: expected a file path.*NoneType"):
        net.save(None)
    with pytest.raises(lp.ConfigError, match="Layer.load: path: expected a file path.*NoneType"):
        lp.Layer.load(native, None)
    with pytest.raises(lp.ConfigError, match="config.load: expected a path"):
        lp.config.load(None)


def test_an_empty_batch_and_a_scalar_input_are_shape_errors(native):
    net = lp.Layer.from_config(native, lp.LayerConfig("net", small_net(native)))
    with pytest.raises(lp.ShapeError, match="empty batch"):
        net.forward([np.zeros((0, 3), np.float32)])
    solver = small_solver(native)
    with pytest.raises(lp.ShapeError, match="empty batch"):
        solver.train_minibatch(np.zeros((0, 3), np.float32), np.zeros((0, 1)))
    linear = lp.Layer.from_config(native, lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    with pytest.raises(lp.ShapeError, match=r"layer 'fc' \(Linear\).*scalar"):
        linear.forward([np.float32(1.0)])


@pytest.mark.parametrize("config,shape", [
    (lp.LinearConfig(output_size=2), (0, 3)),
    (lp.ConvolutionConfig(num_output=2, filter_shape=[3]), (0, 1, 5, 5)),
    (lp.PoolingConfig(mode="max", filter_shape=[2], stride=[2]), (0, 1, 4, 4)),
    (lp.PoolingConfig(mode="max", global_pooling=True), (1, 3, 0, 4)),  # (it wrote no output: zeros came back)
    (lp.PoolingConfig(mode="average", global_pooling=True), (1, 3, 0, 4)),
    (lp.BatchNormConfig(), (2, 0)),
    (lp.NegativeLogLikelihoodConfig(num_classes=3), (0, 3)),
    ("MeanSquaredError", (0, 3)),
    ("Softmax", (0, 3)),
])
def test_a_layer_run_alone_refuses_an_input_without_values(native, config, shape):
    """A layer built alone (Layer.from_config, as docs/api.md runs one) given an empty batch or an axis of 0:
    a ShapeError naming the layer, as a Sequential gives (before: NumPy's reshape errors, IndexError,
    ZeroDivisionError, or global max pooling's never-written output)."""
    layer = lp.Layer.from_config(native, lp.LayerConfig("one", config))
    inputs = [np.zeros(shape, np.float32)] + ([np.zeros((shape[0], 1), np.float32)] if layer.num_inputs > 1 else [])
    with pytest.raises(lp.ShapeError, match=r"layer 'one' \(\w+\): input 0 has shape .*: no values; give a batch"):
        layer.forward(inputs)


def test_loss_before_any_step_is_an_error_and_after_a_step_is_the_nll(native, tmp_path):
    solver = small_solver(native)
    with pytest.raises(lp.LeafpyError, match="no minibatch has been trained"):
        solver.loss()
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    y = np.array([[0], [1], [1], [0]])
    w, b = (t.to_numpy().astype(np.float64) for t in solver.network.learnable_weights_data())
    solver.train_minibatch(x, y)
    z = x.astype(np.float64) @ w.T + b
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    assert solver.loss() == pytest.approx(-logp[np.arange(4), y[:, 0]].mean(), rel=1e-5)
    solver.save_checkpoint(str(tmp_path / "c.leaf"))
    again = lp.Solver.load_checkpoint(native, native, str(tmp_path / "c.leaf"))
    with pytest.raises(lp.LeafpyError, match="no minibatch has been trained"):
        again.loss()


def _damaged_checkpoint(native, path, **state):
    """A checkpoint written by leafpy's own writer from a solver whose counters were set to ``state``."""
    solver = small_solver(native, minibatch_size=2)
    x = np.ones((4, 3), np.float32)
    solver.train_minibatch(x, np.zeros((4, 1)))  # one call pending: the accumulation buffers hold something
    for k, v in state.items():
        setattr(solver, k, v)
    solver.save_checkpoint(str(path))


@pytest.mark.parametrize("state,match", [
    ({"_calls": 5}, "5 gradient-accumulation calls pending, expected fewer than its minibatch_size \\(2\\)"),
    ({"iteration": 2**64 - 1}, "iteration is 18446744073709551615"),
])
def test_checkpoint_counters_that_cannot_be_right_are_refused(native, tmp_path, state, match):
    path = tmp_path / "c.leaf"
    _damaged_checkpoint(native, path, **state)
    with pytest.raises(lp.SerializationError, match=match) as info:
        lp.Solver.load_checkpoint(native, native, str(path))
    assert str(path) in str(info.value)


def test_a_checkpoint_with_plausible_counters_loads(native, tmp_path):
    path = tmp_path / "c.leaf"
    _damaged_checkpoint(native, path, iteration=2**40)
    solver = lp.Solver.load_checkpoint(native, native, str(path))
    assert solver.iteration == 2**40 and math.isfinite(solver.learning_rate())


def test_a_pooling_padded_far_beyond_its_input_is_refused_before_it_allocates(native):
    """A 2 x 2 input pooled by a 10^9 window padded 10^9 - 1 (padding below the window is allowed): its output is
    2 x 2, its padded input 2 x 10^9 on each side. Refused naming the layer and its work array (before: NumPy's bare
    "array is too big"; a window of 2000 silently took 122 MB)."""
    k = 10**9
    layer = lp.Layer.from_config(native, lp.LayerConfig("pool", lp.PoolingConfig(
        mode="max", filter_shape=[k], stride=[k], padding=[k - 1])))
    with pytest.raises(lp.ConfigError, match=r"layer 'pool' \(Pooling\): outputs \[1, 1, 2, 2\]; work arrays "):
        layer.forward([np.ones((1, 1, 2, 2), np.float32)])
    small = lp.Layer.from_config(native, lp.LayerConfig("pool", lp.PoolingConfig(
        mode="max", filter_shape=[3], stride=[2], padding=[1])))
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    np.testing.assert_array_equal(small.forward([x])[0].to_numpy()[0, 0], [[5, 7], [13, 15]])
