"""The solver: learning-rate policies, the update rules step by step, clipping, accumulation, weight decay,
lr_mult, and real training on scikit-learn's digits."""

from __future__ import annotations

import math

import numpy as np
import pytest

import leafpy as lp


def policy(**kw):
    return lp.SolverConfig(**kw).learning_rate


def test_leaf_learning_rate_numbers():
    fixed = policy(lr_policy="fixed", base_lr=5)
    assert [fixed(i) for i in (0, 100, 1000)] == [5, 5, 5]
    step = policy(lr_policy="step", base_lr=5, gamma=0.5, stepsize=10)
    assert [step(i) for i in (0, 10, 20)] == pytest.approx([5, 2.5, 1.25])
    exp = policy(lr_policy="exp", base_lr=5, gamma=0.5)
    assert [exp(i) for i in range(4)] == pytest.approx([5, 2.5, 1.25, 0.625])


@pytest.mark.parametrize("it", [0, 1, 7, 250, 999])
def test_caffe_learning_rate_formulas(it):
    base, gamma, power = 0.1, 0.01, 0.75
    assert policy(lr_policy="inv", base_lr=base, gamma=gamma, power=power)(it) == pytest.approx(
        base * (1 + gamma * it) ** -power)
    steps = (5, 100, 500)
    assert policy(lr_policy="multistep", base_lr=base, gamma=0.5, stepvalues=steps)(it) == pytest.approx(
        base * 0.5 ** sum(it >= s for s in steps))
    assert policy(lr_policy="poly", base_lr=base, power=2.0, max_iter=1000)(it) == pytest.approx(
        base * (1 - it / 1000) ** 2)
    assert policy(lr_policy="sigmoid", base_lr=base, gamma=-0.05, stepsize=200)(it) == pytest.approx(
        base / (1 + math.exp(0.05 * (it - 200))))


@pytest.mark.parametrize("it", [0, 1, 99, 100, 101, 550, 999, 1000, 1001, 5000])
def test_cosine_policy_and_linear_warm_up(it):
    """PyTorch's CosineAnnealingLR formula (T_max = max_iter, eta_min = min_lr), held at min_lr past max_iter; a
    warm-up over the first 100 iterations rises linearly from 0.2 times the rate at iteration 100 to that rate."""
    base, low, last = 0.4, 0.01, 1000
    def cosine(t):
        return low + (base - low) * (1 + math.cos(math.pi * min(t, last) / last)) / 2
    assert policy(lr_policy="cosine", base_lr=base, min_lr=low, max_iter=last)(it) == pytest.approx(cosine(it))
    warm = policy(lr_policy="cosine", base_lr=base, min_lr=low, max_iter=last, warmup_iter=100, warmup_factor=0.2)
    want = cosine(100) * (0.2 + 0.8 * it / 100) if it < 100 else cosine(it)
    assert warm(it) == pytest.approx(want)
    stepped = policy(lr_policy="step", base_lr=base, gamma=0.5, stepsize=300, warmup_iter=100)
    assert stepped(it) == pytest.approx(base * it / 100 if it < 100 else base * 0.5 ** (it // 300))


@pytest.mark.parametrize("rule", ["momentum", "adam", "adamw"])
def test_updates_follow_a_cosine_schedule_after_warm_up(native64, rng, rule):
    """Each update uses its iteration's rate: the warm-up's, then the cosine's, then min_lr."""
    base, low, last, warm = 0.3, 0.02, 8, 3

    def rate(it):
        cos = lambda t: low + (base - low) * (1 + math.cos(math.pi * min(t, last) / last)) / 2  # noqa: E731
        return cos(warm) * (0.25 + 0.75 * it / warm) if it < warm else cos(it)

    s = tiny_solver(native64, rule, base_lr=base, momentum=0.9, weight_decay=0.01, lr_policy="cosine", min_lr=low,
                    max_iter=last, warmup_iter=warm, warmup_factor=0.25)
    W0, b0 = (w.to_numpy() for w in s.network.learnable_weights_data())
    xs, ts = rng.standard_normal((11, 4, 3)), rng.standard_normal((11, 4, 2))
    want = by_hand(rule, W0, b0, xs, ts, lr=rate)
    for (x, t), (W, b) in zip(zip(xs, ts), want):
        s.train_minibatch(x, t)
        np.testing.assert_allclose(s.network.learnable_weights_data()[0].to_numpy(), W, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(s.network.learnable_weights_data()[1].to_numpy(), b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kw,field", [
    ({"base_lr": -0.1}, "base_lr"),
    ({"momentum": 1.0}, "momentum"),
    ({"momentum": -0.5}, "momentum"),
    ({"stepsize": 0}, "stepsize"),
    ({"lr_policy": "linear"}, "fixed.*step.*exp.*inv.*multistep.*poly.*sigmoid.*cosine"),
    ({"lr_policy": "cosine"}, "the cosine policy needs max_iter"),
    ({"min_lr": -1e-3}, "min_lr"),
    ({"warmup_iter": -1}, "warmup_iter"),
    ({"warmup_factor": 1.5}, "warmup_factor"),
    ({"solver": "lbfgs"}, "adam.*momentum.*nesterov.*rmsprop"),
    ({"lr_policy": "poly"}, "max_iter"),
    ({"lr_policy": "multistep"}, "stepvalues"),
    ({"lr_policy": "multistep", "stepvalues": 5}, "solver.stepvalues: expected a list"),
    ({"stepvalues": "100,200"}, "solver.stepvalues: expected a list"),
    ({"clip_gradients": 0}, "clip_gradients"),
    ({"minibatch_size": 0}, "minibatch_size"),
])
def test_invalid_solver_config(kw, field):
    with pytest.raises(lp.ConfigError, match=field):
        lp.SolverConfig(**kw)


@pytest.mark.parametrize("iteration", [-1, 2.5, True, "3"])
def test_the_rate_at_an_iteration_that_is_none_is_a_config_error(iteration):
    config = lp.SolverConfig(base_lr=0.1, warmup_iter=0)
    with pytest.raises(lp.ConfigError, match="learning_rate: iteration"):
        config.learning_rate(iteration)
    assert config.learning_rate(np.int64(7)) == 0.1


def tiny_solver(backend, solver, batch=4, **kw):
    """Linear 3 -> 2 (bias lr_mult 2, decay_mult 0) under a mean-squared-error objective."""
    net = lp.SequentialConfig(inputs=[("data", [batch, 3])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2),
                                 params=[lp.WeightConfig(), lp.WeightConfig(lr_mult=2.0, decay_mult=0.0)]))
    obj = lp.SequentialConfig(inputs=[("network_out", [batch, 2]), ("target", [batch, 2])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj),
                          solver=solver, seed=0, **kw)
    return lp.Solver.from_config(backend, backend, cfg)


def by_hand(solver_name, W, b, xs, ts, *, lr, m=0.9, wd=0.01, b1=0.9, b2=0.999, eps=1e-8, decay=0.99):
    """The same updates written out in NumPy (float64); ``lr``: a rate, or the rate of each iteration."""
    W, b = W.copy(), b.copy()
    hist = {k: [np.zeros_like(W), np.zeros_like(b)] for k in ("h", "m", "v", "u")}
    out = []
    for it, (x, t) in enumerate(zip(xs, ts)):
        y = x @ W.T + b
        dy = 2 * (y - t) / y.size
        # bias: decay_mult 0; AdamW decays the weights themselves (PyTorch's AdamW: w *= 1 - lr * decay first)
        gW, gb = dy.T @ x + (0.0 if solver_name == "adamw" else wd) * W, dy.sum(0)
        for k, (p, g, mult) in enumerate(((W, gW, 1.0), (b, gb, 2.0))):
            rate = (lr(it) if callable(lr) else lr) * mult
            if solver_name == "adamw" and k == 0:
                p *= 1.0 - rate * wd
            if solver_name in ("adam", "adamw"):
                hist["m"][k] = b1 * hist["m"][k] + (1 - b1) * g
                hist["v"][k] = b2 * hist["v"][k] + (1 - b2) * g * g
                t_ = it + 1
                rate_t = rate * np.sqrt(1 - b2 ** t_) / (1 - b1 ** t_)
                p -= rate_t * hist["m"][k] / (np.sqrt(hist["v"][k]) + eps)
            elif solver_name == "momentum":
                hist["h"][k] = m * hist["h"][k] + rate * g
                p -= hist["h"][k]
            elif solver_name == "nesterov":
                prev = hist["h"][k].copy()
                hist["h"][k] = m * hist["h"][k] + rate * g
                p -= (1 + m) * hist["h"][k] - m * prev
            elif solver_name == "rmsprop":
                hist["h"][k] = decay * hist["h"][k] + (1 - decay) * g * g
                p -= rate * g / (np.sqrt(hist["h"][k]) + eps)
            elif solver_name == "adagrad":
                hist["h"][k] = hist["h"][k] + g * g
                p -= rate * g / (np.sqrt(hist["h"][k]) + eps)
            elif solver_name == "adadelta":
                hist["h"][k] = decay * hist["h"][k] + (1 - decay) * g * g
                step = g * np.sqrt((hist["u"][k] + eps) / (hist["h"][k] + eps))
                hist["u"][k] = decay * hist["u"][k] + (1 - decay) * step * step
                p -= rate * step
            else:
                raise ValueError(solver_name)
        out.append((W.copy(), b.copy()))
    return out


@pytest.mark.parametrize("piece", [None, 4], ids=["whole", "in-pieces"])
@pytest.mark.parametrize("rule", ["momentum", "nesterov", "adam", "adamw", "rmsprop", "adagrad", "adadelta"])
def test_first_three_steps_by_hand(native64, rule, piece):
    if piece:
        native64.UPDATE_PIECE = piece  # the 2x3 weight updates in two pieces, on this instance only
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((4, 3)) for _ in range(3)]
    ts = [rng.standard_normal((4, 2)) for _ in range(3)]
    lr, eps = 0.1, 1e-6 if rule == "adadelta" else 1e-8  # AdaDelta's first steps are ~sqrt(eps): keep them visible
    solver = tiny_solver(native64, rule, base_lr=lr, momentum=0.9, weight_decay=0.01, epsilon=eps)
    W0, b0 = (w.to_numpy() for w in solver.network.learnable_weights_data())
    expected = by_hand(rule, W0, b0, xs, ts, lr=lr, eps=eps)
    for step, (x, t) in enumerate(zip(xs, ts)):
        solver.train_minibatch(x, t)
        W, b = (w.to_numpy() for w in solver.network.learnable_weights_data())
        tol = 1e-12
        np.testing.assert_allclose(W, expected[step][0], rtol=tol, atol=tol, err_msg=f"{rule} step {step}")
        np.testing.assert_allclose(b, expected[step][1], rtol=tol, atol=tol, err_msg=f"{rule} step {step}")
        assert not np.allclose(W, W0)
    assert solver.iteration == 3


def test_clipping_clips_to_the_threshold_and_leaves_small_gradients(native64):
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((4, 3)) * 10, rng.standard_normal((4, 2)) * 10
    probe = tiny_solver(native64, "momentum", base_lr=0.0)
    out = probe.network.forward([x])[0]
    probe.objective.forward([out, t])
    probe.network.backward([probe.objective.backward([np.ones(1)])[0]])
    norm = math.sqrt(sum(np.sum(g.to_numpy() ** 2) for g in probe.network.learnable_weights_gradients()))
    for threshold in (norm / 4, norm * 2):
        s = tiny_solver(native64, "momentum", base_lr=1.0, clip_gradients=threshold)
        w0 = [w.to_numpy() for w in s.network.learnable_weights_data()]
        s.train_minibatch(x, t)
        # with lr 1 and zero momentum history, the applied step is lr_mult * clipped gradient
        steps = [(a - w.to_numpy()) / mult for a, w, mult in zip(w0, s.network.learnable_weights_data(), (1, 2))]
        applied = math.sqrt(sum(np.sum(d ** 2) for d in steps))
        assert applied == pytest.approx(min(threshold, norm), rel=1e-9)


@pytest.mark.parametrize("rule", ["momentum", "adam", "adagrad"])
def test_accumulation_equals_the_concatenated_batch(native64, rule):
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((4, 3)) for _ in range(6)]
    ts = [rng.standard_normal((4, 2)) for _ in range(6)]
    accumulated = tiny_solver(native64, rule, base_lr=0.05, momentum=0.9, minibatch_size=3, weight_decay=0.01)
    whole = tiny_solver(native64, rule, batch=12, base_lr=0.05, momentum=0.9, weight_decay=0.01)
    for x, t in zip(xs, ts):
        accumulated.train_minibatch(x, t)
    for k in (0, 3):
        whole.train_minibatch(np.concatenate(xs[k:k + 3]), np.concatenate(ts[k:k + 3]))
    assert accumulated.iteration == whole.iteration == 2
    for a, b in zip(accumulated.network.learnable_weights_data(), whole.network.learnable_weights_data()):
        np.testing.assert_allclose(a.to_numpy(), b.to_numpy(), rtol=1e-10, atol=1e-12)


def test_weight_decay_is_applied(native64):
    """Leaf never implemented weight decay: with zero gradient signal, decay alone shrinks the weights."""
    s = tiny_solver(native64, "momentum", base_lr=0.1, weight_decay=0.5)
    x = np.zeros((4, 3))
    W0 = s.network.learnable_weights_data()[0].to_numpy()
    b0 = s.network.learnable_weights_data()[1].to_numpy()
    s.train_minibatch(x, np.zeros((4, 2)) + b0)  # prediction equals target: zero loss gradient
    np.testing.assert_allclose(s.network.learnable_weights_data()[0].to_numpy(), W0 * (1 - 0.1 * 0.5), rtol=1e-12)


def test_lr_mult_zero_freezes_a_weight(native64):
    net = lp.SequentialConfig(inputs=[("data", [2, 3])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2), params=[lp.WeightConfig(lr_mult=0.0)]))
    obj = lp.SequentialConfig(inputs=[("network_out", [2, 2]), ("target", [2, 2])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    s = lp.Solver.from_config(native64, native64, lp.SolverConfig(
        network=lp.LayerConfig("n", net), objective=lp.LayerConfig("o", obj), base_lr=0.5))
    W0, b0 = (w.to_numpy() for w in s.network.learnable_weights_data())
    s.train_minibatch(np.ones((2, 3)), np.full((2, 2), 3.0))
    W1, b1 = (w.to_numpy() for w in s.network.learnable_weights_data())
    np.testing.assert_array_equal(W0, W1)
    assert not np.allclose(b0, b1)


def test_confusion_matrix():
    cm = lp.ConfusionMatrix(3)
    cm.add([0, 1, 2, 2], [0, 1, 1, 2])
    assert cm.accuracy() == 0.75 and cm.samples == 4
    assert cm.matrix[1, 2] == 1
    assert "accuracy 75.00% of 4 predictions" in str(cm)
    # the recall column: correct / the class's samples; a class without samples shows a dash, not 0%
    rows = str(cm).splitlines()[1:4]
    assert [r.split()[-1] for r in rows] == ["100.0%", "50.0%", "100.0%"]
    few = lp.ConfusionMatrix(3)
    few.add([0, 2], [0, 2])
    assert str(few).splitlines()[2].split()[-1] == "-"
    running = lp.ConfusionMatrix(3, capacity=2)
    running.add([0, 0, 0], [1, 1, 1])
    running.add([2], [2])
    assert running.samples == 2 and running.accuracy() == 0.5
    out = np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1]])
    assert list(lp.predictions(out)) == [1, 0]
    with pytest.raises(lp.ShapeError):
        cm.add([3], [0])


def test_predictions_and_top_k_hits_of_a_class_at_every_position():
    """Outputs [N, C, d1, d2] (NegativeLogLikelihood's per-position scores): lp.predictions is the argmax over
    axis 1 at every position, [N, d1, d2], and top_k_hits counts every position's target (before: position 0
    alone)."""
    rng = np.random.default_rng(0)
    out = rng.standard_normal((6, 4, 3, 2))
    targets = rng.integers(0, 4, (6, 3, 2))
    np.testing.assert_array_equal(lp.predictions(out), out.argmax(axis=1))
    top2 = np.argsort(-out, axis=1)[:, :2]
    assert lp.metrics.top_k_hits(out, targets, 2) == int((top2 == targets[:, None]).any(axis=1).sum())
    assert lp.metrics.top_k_hits(out, targets, 1) == int((out.argmax(axis=1) == targets).sum())
    cm = lp.ConfusionMatrix(4)
    cm.add_outputs(out, targets)
    assert cm.samples == 36 and cm.accuracy() == pytest.approx(np.mean(out.argmax(axis=1) == targets))


def test_top_k_hits_refuses_targets_that_are_not_class_indices_and_a_k_below_1():
    """Targets 1.7 and 2.9 are no classes (before: truncated to 1 and 2, counted as hits), nor is 3 of three
    classes; k 0 or -1 asks for nothing (before: 0 hits)."""
    out = np.array([[0.1, 0.5, 0.4], [0.2, 0.3, 0.5]])
    assert lp.metrics.top_k_hits(out, [1, 2], 1) == 2 and lp.metrics.top_k_hits(out, [1.0, 0.0], 1) == 1
    with pytest.raises(lp.ShapeError, match="top_k_hits: target 0 is 1.7; targets must be class indices in"):
        lp.metrics.top_k_hits(out, [1.7, 2.9], 1)
    with pytest.raises(lp.ShapeError, match="target 1 is 3; targets must be class indices in \\[0, 2\\]"):
        lp.metrics.top_k_hits(out, [1, 3], 5)
    with pytest.raises(lp.ShapeError, match="2 outputs .* but 3 targets"):
        lp.metrics.top_k_hits(out, [1, 2, 0], 1)
    for k in (0, -1):
        with pytest.raises(lp.ConfigError, match=f"top_k_hits: k: expected a positive integer, got {k}"):
            lp.metrics.top_k_hits(out, [1, 2], k)


def test_regression_scores_refuse_predictions_and_targets_of_other_layouts():
    """Predictions [4] and targets [1, 4] (one sample of four values) are not four samples (before: broadcast to
    [4, 4], MSE 3.5 where the four pairs' is 0.25), nor are [4, 2] and [4, 1]; [4] and [4, 1] are one layout, and
    score as scikit-learn does."""
    pytest.importorskip("sklearn", reason="scikit-learn's regression metrics are the independent reference")
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    p, t = np.array([1.0, 2, 3, 4]), np.array([1.0, 2, 3, 5])
    scores = lp.metrics.regression_scores(p, t[:, None])
    assert scores == pytest.approx({"mse": mean_squared_error(t, p), "mae": mean_absolute_error(t, p),
                                    "r2": r2_score(t, p)})
    with pytest.raises(lp.ShapeError, match=r"predicted of shape \(4,\) and target of shape \(1, 4\)"):
        lp.metrics.regression_scores(p, t[None, :])
    with pytest.raises(lp.ShapeError, match=r"predicted of shape \(4, 2\) and target of shape \(4, 1\)"):
        lp.metrics.regression_scores(np.zeros((4, 2)), np.zeros((4, 1)))
    with pytest.raises(lp.ShapeError, match=r"predicted of shape \(3,\) and target of shape \(4,\)"):
        lp.metrics.regression_scores(p[:3], t)


# --- real data ------------------------------------------------------------------------------------------------
def train_digits(net_cfg, epochs, batch=32, lr=0.05):
    ds = lp.data.digits(test_fraction=0.2, seed=0)
    be = lp.backend("native")
    obj = lp.SequentialConfig(inputs=[("network_out", [batch, 10]), ("label", [batch, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=10)))
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", net_cfg), objective=lp.LayerConfig("loss", obj),
                          solver="momentum", base_lr=lr, momentum=0.9, weight_decay=1e-4, lr_policy="step",
                          gamma=0.5, stepsize=400, seed=0)
    solver = lp.Solver.from_config(be, be, cfg)
    for epoch in range(epochs):
        for xb, yb in lp.data.batches(ds.x_train, ds.y_train, batch, seed=0, epoch=epoch):
            solver.train_minibatch(xb, yb)
    solver.network.set_training(False)
    cm = lp.ConfusionMatrix(10)
    cm.add_outputs(solver.network.forward([ds.x_test])[0], ds.y_test)
    assert cm.samples == 359
    return cm.accuracy(), solver


@pytest.mark.slow
def test_digits_mlp_reaches_96_percent():
    cfg = lp.SequentialConfig(inputs=[("data", [32, 1, 8, 8])])
    cfg.add_layer(lp.LayerConfig("flat", "Flatten"))
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=128)))
    cfg.add_layer(lp.LayerConfig("relu1", "ReLU"))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=10)))
    cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    acc, solver = train_digits(cfg, epochs=20)
    assert acc >= 0.96, acc
    assert solver.loss() < 0.5


@pytest.mark.slow
def test_digits_convnet_reaches_97_percent():
    cfg = lp.SequentialConfig(inputs=[("data", [32, 1, 8, 8])])
    cfg.add_layer(lp.LayerConfig("conv1", lp.ConvolutionConfig(num_output=20, filter_shape=[3], padding=[1])))
    cfg.add_layer(lp.LayerConfig("relu1", "ReLU"))
    cfg.add_layer(lp.LayerConfig("pool1", lp.PoolingConfig(mode="max", filter_shape=[2])))
    cfg.add_layer(lp.LayerConfig("conv2", lp.ConvolutionConfig(num_output=40, filter_shape=[3], padding=[1])))
    cfg.add_layer(lp.LayerConfig("relu2", "ReLU"))
    cfg.add_layer(lp.LayerConfig("pool2", lp.PoolingConfig(mode="max", filter_shape=[2])))
    cfg.add_layer(lp.LayerConfig("flat", "Flatten"))
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=100)))
    cfg.add_layer(lp.LayerConfig("relu3", "ReLU"))
    cfg.add_layer(lp.LayerConfig("drop", lp.DropoutConfig(ratio=0.2)))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=10)))
    cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    acc, _ = train_digits(cfg, epochs=15)
    assert acc >= 0.97, acc


def test_trainer_state_survives_a_checkpoint(tmp_path):
    import leafpy as lp
    from leafpy.errors import SerializationError
    from leafpy.serialization import _read_trainer_state

    net = lp.SequentialConfig(inputs=[("data", [4, 3])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    obj = lp.SequentialConfig(inputs=[("out", [4, 2]), ("label", [4, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=2)))
    be = lp.backend("native")
    cfg = lp.SolverConfig(network=lp.LayerConfig("n", net), objective=lp.LayerConfig("o", obj), base_lr=0.1)
    solver = lp.Solver.from_config(be, be, cfg)
    assert lp.Solver.load_checkpoint(be, be, _save(solver, tmp_path / "a.leaf")).trainer_state == {}
    solver.trainer_state = {"epoch": 3, "batch": 17, "note": "x"}
    back = lp.Solver.load_checkpoint(be, be, _save(solver, tmp_path / "b.leaf"))
    assert back.trainer_state == {"epoch": 3, "batch": 17, "note": "x"}
    for bad in ("[1, 2]", "{not json", "x" * (2 << 20)):
        with pytest.raises(SerializationError, match="trainer state"):
            _read_trainer_state(bad, "ckpt.leaf")


def _save(solver, path):
    solver.save_checkpoint(str(path))
    return str(path)


def test_clipping_zero_gradients_is_quiet_and_leaves_them_zero():
    """The clipping factor threshold / norm is computed on the device; a zero norm must not divide by zero."""
    import warnings

    be = lp.backend("native")
    g = np.zeros(5, np.float32)
    total = np.zeros(1, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        be.clip_to_norm(g, total, 1.0)
    assert not g.any()
    g = np.full(4, 3.0, np.float32)
    be.clip_to_norm(g, np.array([36.0], np.float32), 2.0)  # norm 6 > 2: scaled by 1/3
    np.testing.assert_allclose(g, np.full(4, 1.0), rtol=1e-6)


def test_regression_scores_refuse_a_flat_row_against_a_grid_either_way():
    p, t = np.zeros((5, 8)), np.zeros((5, 2, 4))
    for a, b in ((p, t), (t, p)):
        with pytest.raises(lp.ShapeError, match="regression_scores: expected predicted and target values of one"):
            lp.metrics.regression_scores(a, b)
    assert lp.metrics.regression_scores(np.arange(4.0), np.arange(4.0)[:, None])["mse"] == 0.0
