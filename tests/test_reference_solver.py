"""Whole solver steps against a NumPy float64 reference of the documented step: clip the accumulated gradients by
their global L2 norm, average them over ``minibatch_size`` calls, add L2 weight decay times each weight's
``decay_mult``, then the update rule with the policy's rate times ``lr_mult`` (Caffe's order), under a static loss
scale, over enough updates that the learning rate changes and the clipping both binds and does not."""

from __future__ import annotations

import math

import numpy as np
import pytest

import leafpy as lp

RULES = ["momentum", "nesterov", "adam", "adamw", "rmsprop", "adagrad", "adadelta"]
MULTS = ((1.0, 3.0), (2.0, 0.0))  # (lr_mult, decay_mult) of the weight and of the bias
SETTINGS = dict(base_lr=0.05, momentum=0.8, lr_policy="multistep", gamma=0.5, stepvalues=(2, 5), minibatch_size=2,
                clip_gradients=18.0, weight_decay=0.05, loss_scale=8.0, epsilon=1e-6, rms_decay=0.9, beta1=0.8,
                beta2=0.95)


def mse_solver(backend, net: lp.SequentialConfig, **solver) -> lp.Solver:
    """A solver of ``net`` (one declared input [N, ...], output [N, M]) under a mean squared error objective."""
    n = net.inputs[0][1][0]
    out = next(layer.config.output_size for layer in reversed(net.layers) if layer.type == "Linear")
    obj = lp.SequentialConfig(inputs=[("network_out", [n, out]), ("target", [n, out])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj), **solver)
    return lp.Solver.from_config(backend, backend, cfg)


def make_solver(backend, rule):
    net = lp.SequentialConfig(inputs=[("data", [4, 3])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2),
                                 params=[lp.WeightConfig(lr_mult=lr, decay_mult=d) for lr, d in MULTS]))
    obj = lp.SequentialConfig(inputs=[("network_out", [4, 2]), ("target", [4, 2])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    settings = dict(SETTINGS, base_lr=1.0) if rule == "adadelta" else SETTINGS
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj), solver=rule,
                          seed=0, **settings)
    return lp.Solver.from_config(backend, backend, cfg), settings


def reference_updates(rule, settings, weights, batches):
    """The weights after each update, in NumPy float64, from the formulas in docs/solvers.md and the rules'
    modules (Caffe's forms)."""
    s = settings
    k, m, eps, decay = s["minibatch_size"], s["momentum"], s["epsilon"], s["rms_decay"]
    ws = [w.copy() for w in weights]
    state = [[np.zeros_like(w), np.zeros_like(w)] for w in ws]
    out, acc, norms = [], None, []
    for call, (x, t) in enumerate(batches):
        y = x @ ws[0].T + ws[1]
        dy = 2.0 * (y - t) / y.size  # MeanSquaredError: the mean over every element
        grads = [dy.T @ x, dy.sum(axis=0)]
        acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
        if (call + 1) % k:
            continue
        it = len(out)
        lr = s["base_lr"] * s["gamma"] ** sum(1 for v in s["stepvalues"] if it >= v)
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in acc))
        norms.append(norm)
        scale = s["clip_gradients"] / norm if norm > s["clip_gradients"] else 1.0
        for j, (w, g) in enumerate(zip(ws, acc)):
            lr_mult, decay_mult = MULTS[j]
            rate = lr * lr_mult
            if rule == "adamw":  # decoupled: the weights shrink by rate * decay before Adam's step
                g = g * scale / k
                w *= 1.0 - rate * s["weight_decay"] * decay_mult
            else:
                g = g * scale / k + s["weight_decay"] * decay_mult * w
            h, u = state[j]
            if rule == "momentum":
                h[...] = m * h + rate * g
                w -= h
            elif rule == "nesterov":
                prev = h.copy()
                h[...] = m * h + rate * g
                w -= (1 + m) * h - m * prev
            elif rule in ("adam", "adamw"):
                h[...] = s["beta1"] * h + (1 - s["beta1"]) * g
                u[...] = s["beta2"] * u + (1 - s["beta2"]) * g * g
                step = it + 1
                w -= rate * math.sqrt(1 - s["beta2"] ** step) / (1 - s["beta1"] ** step) * h / (np.sqrt(u) + eps)
            elif rule == "rmsprop":
                h[...] = decay * h + (1 - decay) * g * g
                w -= rate * g / (np.sqrt(h) + eps)
            elif rule == "adagrad":
                h += g * g
                w -= rate * g / (np.sqrt(h) + eps)
            else:  # adadelta
                h[...] = decay * h + (1 - decay) * g * g
                d = g * np.sqrt((u + eps) / (h + eps))
                u[...] = decay * u + (1 - decay) * d * d
                w -= rate * d
        out.append([w.copy() for w in ws])
        acc = None
    return out, norms


@pytest.mark.parametrize("rule", RULES)
def test_solver_steps_match_the_documented_step(native64, rule):
    rng = np.random.default_rng(4)
    batches = [(rng.standard_normal((4, 3)) * 2, rng.standard_normal((4, 2))) for _ in range(16)]
    solver, settings = make_solver(native64, rule)
    weights = [w.to_numpy() for w in solver.network.learnable_weights_data()]
    expected, norms = reference_updates(rule, settings, weights, batches)
    # the accumulated gradients' norm passes the threshold on some updates and not on others (and their average's
    # never does, so clipping the average instead would differ)
    clip = settings["clip_gradients"]
    assert any(n > clip for n in norms) and any(n <= clip for n in norms), norms
    updates = 0
    for call, (x, t) in enumerate(batches):
        solver.train_minibatch(x, t)
        if (call + 1) % settings["minibatch_size"]:
            continue
        got = [w.to_numpy() for w in solver.network.learnable_weights_data()]
        for name, g, e in zip(("weight", "bias"), got, expected[updates]):
            np.testing.assert_allclose(g, e, rtol=1e-11, atol=1e-13, err_msg=f"{rule}: {name} after update {updates}")
        updates += 1
    assert solver.iteration == updates == 8


@pytest.mark.parametrize("scaled", [False, True])
def test_clipping_measures_the_weights_that_move_and_a_frozen_layers_are_left_out(native64, scaled):
    """A frozen layer (lr_mult 0 on its weights, as in fine-tuning) before a trained one: the global norm that
    clipping compares is the trained weights' alone, as in Caffe (a frozen weight's diff stays 0) and PyTorch
    (clip_grad_norm_ over the trainable parameters), and the frozen weights never move."""
    net = lp.SequentialConfig(inputs=[("data", [4, 3])])
    net.add_layer(lp.LayerConfig("frozen", lp.LinearConfig(output_size=3),
                                 params=[lp.WeightConfig(lr_mult=0.0), lp.WeightConfig(lr_mult=0.0)]))
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    solver = mse_solver(native64, net, solver="momentum", base_lr=0.1, momentum=0.0, clip_gradients=0.5, seed=0,
                        loss_scale=8.0 if scaled else None)
    f_w, f_b, w, b = (t.to_numpy() for t in solver.network.learnable_weights_data())
    rng = np.random.default_rng(3)
    for _ in range(3):
        x, t = rng.standard_normal((4, 3)) * 3, rng.standard_normal((4, 2))
        h = x @ f_w.T + f_b
        dy = 2.0 * (h @ w.T + b - t) / t.size
        gw, gb = dy.T @ h, dy.sum(axis=0)
        norm = math.sqrt(float(np.sum(gw * gw) + np.sum(gb * gb)))
        dh = dy @ w  # the frozen layer's gradients: what counting them would add to the norm
        whole = math.sqrt(norm ** 2 + float(np.sum((dh.T @ x) ** 2) + np.sum(dh.sum(axis=0) ** 2)))
        assert whole > 1.05 * norm > 0.5
        w, b = w - 0.1 * gw * 0.5 / norm, b - 0.1 * gb * 0.5 / norm
        solver.train_minibatch(x, t)
        got = [t.to_numpy() for t in solver.network.learnable_weights_data()]
        np.testing.assert_array_equal(got[0], f_w)
        np.testing.assert_array_equal(got[1], f_b)
        np.testing.assert_allclose(got[2], w, rtol=1e-11, atol=1e-13)
        np.testing.assert_allclose(got[3], b, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("rule", ["momentum", "adam"])
def test_weights_cut_off_from_the_loss_move_by_weight_decay_alone(native64, rule):
    """fc0 -> fc1 -> fc2, whose input takes no gradient (propagate_down: False): fc0 and fc1 get none from the
    loss, so each step their gradient is weight decay alone (Caffe clears every gradient each iteration), never
    an earlier step's leftovers. Against the rule's formula in float64 over six steps."""
    net = lp.SequentialConfig(inputs=[("data", [4, 3])])
    net.add_layer(lp.LayerConfig("fc0", lp.LinearConfig(output_size=3)))
    net.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=3)))
    net.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=2), propagate_down=[False]))
    obj = lp.SequentialConfig(inputs=[("network_out", [4, 2]), ("target", [4, 2])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    lr, wd, m, b1, b2, eps = 0.1, 0.1, 0.9, 0.9, 0.999, 1e-8
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj), solver=rule,
                          base_lr=lr, momentum=m, weight_decay=wd, beta1=b1, beta2=b2, epsilon=eps, seed=0)
    solver = lp.Solver.from_config(native64, native64, cfg)
    names = solver.network.learnable_weights_names()
    cut = {n: w.to_numpy().copy() for n, w in zip(names, solver.network.learnable_weights_data())
           if n.startswith(("fc0/", "fc1/"))}
    state = {n: [np.zeros_like(w), np.zeros_like(w)] for n, w in cut.items()}
    rng = np.random.default_rng(0)
    for step in range(1, 7):
        solver.train_minibatch(rng.standard_normal((4, 3)), rng.standard_normal((4, 2)))
        for n, w in cut.items():
            g = wd * w  # bias too: decay_mult 1
            h, u = state[n]
            if rule == "momentum":
                h[...] = m * h + lr * g
                w -= h
            else:
                h[...] = b1 * h + (1 - b1) * g
                u[...] = b2 * u + (1 - b2) * g * g
                w -= lr * math.sqrt(1 - b2 ** step) / (1 - b1 ** step) * h / (np.sqrt(u) + eps)
        got = dict(zip(names, (w.to_numpy() for w in solver.network.learnable_weights_data())))
        for n, w in cut.items():
            np.testing.assert_allclose(got[n], w, rtol=1e-10, atol=1e-12, err_msg=f"{n} after step {step}")


def _spy(layer) -> dict:
    """Counts of the worker's backward calls on one layer (an instance attribute over the class's method)."""
    counts = {"backward_input": 0, "backward_parameters": 0}
    worker = layer.worker
    for name in counts:
        method = getattr(worker, name)

        def counted(*args, _method=method, _name=name):
            counts[_name] += 1
            return _method(*args)
        setattr(worker, name, counted)
    return counts


def _frozen(name: str, n: int, **kw) -> lp.LayerConfig:
    return lp.LayerConfig(name, lp.LinearConfig(output_size=n), params=[lp.WeightConfig(lr_mult=0.0)] * 2, **kw)


def test_a_frozen_backbone_runs_no_backward_pass_and_the_head_trains_as_by_hand(native64, monkeypatch):
    """Fine-tuning a head on a frozen backbone (lr_mult 0 on every backbone weight): as in Caffe
    (param_propagate_down) and PyTorch (requires_grad=False), nothing flows into the backbone, so its layers run
    no backward pass at all, their weights' gradients stay zero and the weights never move; the head's momentum
    steps match float64 NumPy."""
    net = lp.SequentialConfig(inputs=[("data", [5, 3])])
    net.add_layer(_frozen("fz0", 4))
    net.add_layer(lp.LayerConfig("relu", "ReLU"))
    net.add_layer(_frozen("fz1", 3))
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    obj = lp.SequentialConfig(inputs=[("network_out", [5, 2]), ("target", [5, 2])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    lr, m, wd = 0.1, 0.9, 0.01
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj),
                          solver="momentum", base_lr=lr, momentum=m, weight_decay=wd, seed=0)
    monkeypatch.setattr(native64, "replay", False)  # every step through the layers' Python, which the spies count
    solver = lp.Solver.from_config(native64, native64, cfg)
    spies = [_spy(layer) for layer in solver.network.layer.layers]
    w0, b0, w1, b1, w, b = (t.to_numpy().copy() for t in solver.network.learnable_weights_data())
    hw, hb = np.zeros_like(w), np.zeros_like(b)
    rng = np.random.default_rng(5)
    for _ in range(4):
        x, t = rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
        h = np.maximum(x @ w0.T + b0, 0) @ w1.T + b1
        dy = 2.0 * (h @ w.T + b - t) / t.size
        hw, hb = m * hw + lr * (dy.T @ h + wd * w), m * hb + lr * (dy.sum(axis=0) + wd * b)
        w, b = w - hw, b - hb
        solver.train_minibatch(x, t)
    got = [t.to_numpy() for t in solver.network.learnable_weights_data()]
    for g, e in zip(got[:4], (w0, b0, w1, b1)):
        np.testing.assert_array_equal(g, e)
    np.testing.assert_allclose(got[4], w, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(got[5], b, rtol=1e-11, atol=1e-13)
    assert [s["backward_input"] + s["backward_parameters"] for s in spies[:3]] == [0, 0, 0], spies
    assert spies[3] == {"backward_input": 0, "backward_parameters": 4}  # the head: its weights only
    for g in solver.network.learnable_weights_gradients()[:4]:
        assert not np.any(g.to_numpy())


def test_a_frozen_layer_between_trained_ones_passes_the_gradient_on_without_weight_gradients(native64, monkeypatch):
    """fc0 (trained) -> frozen -> fc2 (trained): the frozen layer runs its input gradient only (no weight-gradient
    GEMM), and fc0 steps as float64 NumPy says, through the frozen weights."""
    net = lp.SequentialConfig(inputs=[("data", [5, 3])])
    net.add_layer(lp.LayerConfig("fc0", lp.LinearConfig(output_size=4)))
    net.add_layer(lp.LayerConfig("tanh", "TanH"))
    net.add_layer(_frozen("mid", 3))
    net.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=2)))
    obj = lp.SequentialConfig(inputs=[("network_out", [5, 2]), ("target", [5, 2])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    lr = 0.2
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj),
                          solver="momentum", base_lr=lr, momentum=0.0, seed=0)
    monkeypatch.setattr(native64, "replay", False)
    solver = lp.Solver.from_config(native64, native64, cfg)
    mid = _spy(solver.network.layer.layers[2])
    w0, b0, wm, bm, w2, b2 = (t.to_numpy().copy() for t in solver.network.learnable_weights_data())
    rng = np.random.default_rng(6)
    for _ in range(3):
        x, t = rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
        a = np.tanh(x @ w0.T + b0)
        h = a @ wm.T + bm
        dy = 2.0 * (h @ w2.T + b2 - t) / t.size
        dz = (dy @ w2 @ wm) * (1 - a * a)
        w2, b2 = w2 - lr * dy.T @ h, b2 - lr * dy.sum(axis=0)
        w0, b0 = w0 - lr * dz.T @ x, b0 - lr * dz.sum(axis=0)
        solver.train_minibatch(x, t)
    got = [t.to_numpy() for t in solver.network.learnable_weights_data()]
    for g, e in zip(got, (w0, b0, wm, bm, w2, b2)):
        np.testing.assert_allclose(g, e, rtol=1e-11, atol=1e-13)
    assert mid == {"backward_input": 3, "backward_parameters": 0}


def test_a_frozen_batch_norm_between_trained_layers_still_passes_the_right_gradient(native64):
    """BatchNorm's input gradient needs the sums its weight pass computes: with its scale and shift frozen it
    still runs that pass, and fc0's first step is the same as with them trained (the gradient into fc0 on the
    first step does not depend on whether BatchNorm's own weights will move)."""
    def first_step(frozen: bool) -> list[np.ndarray]:
        net = lp.SequentialConfig(inputs=[("data", [6, 3])])
        net.add_layer(lp.LayerConfig("fc0", lp.LinearConfig(output_size=4)))
        params = [lp.WeightConfig(lr_mult=0.0)] * 2 if frozen else []
        net.add_layer(lp.LayerConfig("bn", lp.BatchNormConfig(), params=params))
        net.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=2)))
        solver = mse_solver(native64, net, solver="momentum", base_lr=0.3, momentum=0.0, seed=0)
        rng = np.random.default_rng(7)
        solver.train_minibatch(rng.standard_normal((6, 3)), rng.standard_normal((6, 2)))
        return [t.to_numpy() for t in solver.network.learnable_weights_data()]

    frozen, trained = first_step(True), first_step(False)
    np.testing.assert_allclose(frozen[0], trained[0], rtol=1e-12, atol=1e-14)  # fc0's weight
    np.testing.assert_allclose(frozen[1], trained[1], rtol=1e-12, atol=1e-14)
    assert not np.allclose(frozen[2], trained[2])  # bn's scale: frozen in one, moved in the other


@pytest.mark.parametrize("first,second", [(0.0, 1.0), (1.0, 0.0)])
def test_a_weight_shared_by_a_frozen_and_a_trained_layer_gets_its_whole_gradient(native64, first, second):
    """W shared by name between layer a (lr_mult `first`) and layer b (`second`), run by net.backward without a
    solver (which refuses such a network): W trains where one of its layers trains it, so both layers add their
    parts, as float64 NumPy says (before: the frozen layer's part was left out)."""
    net = lp.SequentialConfig(inputs=[("data", [3, 4])])
    net.add_layer(lp.LayerConfig("a", lp.LinearConfig(output_size=4, bias=False),
                                 params=[lp.WeightConfig(name="W", lr_mult=first)]))
    net.add_layer(lp.LayerConfig("t", "TanH"))
    net.add_layer(lp.LayerConfig("b", lp.LinearConfig(output_size=4, bias=False),
                                 params=[lp.WeightConfig(name="W", lr_mult=second)]))
    layer = lp.Layer.from_config(native64, lp.LayerConfig("net", net), seed=0)
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    w = layer.learnable_weights_data()[0].to_numpy().copy()
    layer.forward([x])
    layer.backward([dy])
    h = np.tanh(x @ w.T)
    np.testing.assert_allclose(layer.learnable_weights_gradients()[0].to_numpy(),
                               dy.T @ h + ((dy @ w) * (1 - h ** 2)).T @ x, rtol=1e-12, atol=1e-13)
