"""A solver's weights, gradients and history laid out one after another (``Backend.arrange``, the native backend's
``host_arena``), and each run of alike weights updated in one call (``Backend.span``): the values kept by the
layout, the same training with the updates joined and apart, what stays apart, and a user's run through the
``leafpy`` command, interrupted and resumed, against the same run in one go."""

from __future__ import annotations

import os

import numpy as np
import pytest
from runs import brighter_half_npz, train_history

import leafpy as lp
from leafpy.backends import compiled, native
from leafpy.tensor import HOST, host_arena


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _adjacent(arrays: list) -> bool:
    return all(_address(a) + a.nbytes == _address(b) for a, b in zip(arrays, arrays[1:]))


# --- the layout ------------------------------------------------------------------------------------------------------
def test_host_arena_keeps_each_tensors_values_and_lays_them_out_in_order(rng):
    shapes = [(3, 4), (5,), (2, 3, 2), (7,)]
    tensors = [lp.SharedTensor(s) for s in shapes]
    values = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    for t, v in zip(tensors[:3], values):
        t.set(v)
    alias = tensors[0].alias((12,))  # a view of one storage moves with it
    assert host_arena(tensors)
    for t, v in zip(tensors[:3], values):
        np.testing.assert_array_equal(t.to_numpy(), v)
    assert not tensors[3].is_fresh_on(HOST)  # never written: still zeros, still nowhere fresh
    np.testing.assert_array_equal(tensors[3].to_numpy(), np.zeros(7, np.float32))
    buffers = [t.buffer_on(HOST) for t in tensors]
    assert _adjacent(buffers) and buffers[0].base is buffers[1].base
    np.testing.assert_array_equal(alias.to_numpy(), values[0].reshape(12))
    tensors[1].set(np.arange(5))  # writes land in the arena's piece
    np.testing.assert_array_equal(buffers[1], np.arange(5))
    assert host_arena(list(reversed(tensors)))  # laid out again (pieces of an arena may move), the values kept
    np.testing.assert_array_equal(tensors[1].to_numpy(), np.arange(5))
    np.testing.assert_array_equal(tensors[2].to_numpy(), values[2])
    assert _adjacent([t.buffer_on(HOST) for t in reversed(tensors)])


def test_host_arena_refuses_what_it_cannot_lay_out():
    a, b = lp.SharedTensor((4,)), lp.SharedTensor((4,), np.float64)
    assert not host_arena([a, b])  # two dtypes
    assert not host_arena([a, a.alias()])  # one storage twice
    assert not host_arena([])
    owned = np.arange(6, dtype=np.float32)
    shared = lp.SharedTensor.from_dlpack(owned)  # the caller's memory: it stays theirs
    before = a.buffer_on(HOST)
    assert not host_arena([a, shared])
    assert a.buffer_on(HOST) is before
    owned[0] = 42
    assert shared.to_numpy()[0] == 42


def test_a_weights_host_view_taken_after_the_solver_was_made_follows_training():
    """``np.asarray(weight)`` is a live view of the host copy: taken once the solver has laid its weights out (when
    it is made), it shows each update, through eager and replayed steps alike."""
    be, solver = _mlp("adam")
    weight = solver.network.learnable_weights_data()[0]
    view = np.asarray(weight)
    seen = []
    rng = np.random.default_rng(2)
    for _ in range(4):
        solver.train_minibatch(rng.standard_normal((32, 64)).astype(np.float32),
                               rng.integers(0, 10, (32, 1)).astype(np.float32))
        np.testing.assert_array_equal(view, weight.to_numpy())
        seen.append(view.copy())
    assert be.recorder.replays >= 1 and not np.array_equal(seen[-1], seen[-2])


def _mlp(rule: str, batch: int = 32, lr_mults: tuple = (1.0, 2.0), decay: float = 0.0005, blas: str = "auto",
         bias_decay_mult: float = 0.0, **extra):
    """An MLP 64-256-128-10 whose biases learn at another rate (Caffe's habit) on the native backend."""
    net = lp.SequentialConfig(inputs=[("data", [batch, 64])])
    for i, width in enumerate((256, 128)):
        params = [lp.WeightConfig(lr_mult=lr_mults[0]),
                  lp.WeightConfig(lr_mult=lr_mults[1], decay_mult=bias_decay_mult)]
        net.add_layer(lp.LayerConfig(f"fc{i}", lp.LinearConfig(output_size=width), params=params))
        net.add_layer(lp.LayerConfig(f"relu{i}", "ReLU"))
    net.add_layer(lp.LayerConfig("out", lp.LinearConfig(output_size=10)))
    net.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    obj = lp.SequentialConfig(inputs=[("network_out", [batch, 10]), ("label", [batch, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=10)))
    hyper = {"momentum": dict(momentum=0.9), "nesterov": dict(momentum=0.9), "rmsprop": dict(rms_decay=0.9)}
    cfg = lp.SolverConfig(network=lp.LayerConfig("mlp", net), objective=lp.LayerConfig("loss", obj), solver=rule,
                          base_lr=0.01, weight_decay=decay, seed=3, **{**hyper.get(rule, {}), **extra})
    be = lp.backend("native", blas=blas)
    return be, lp.Solver.from_config(be, be, cfg)


def _train(solver, steps: int = 6) -> tuple[list[float], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    initial = [w.to_numpy() for w in solver.network.learnable_weights_data()]
    losses = []
    for _ in range(steps):
        x = rng.standard_normal((32, 64)).astype(np.float32)
        y = rng.integers(0, 10, (32, 1)).astype(np.float32)
        solver.train_minibatch(x, y)
        losses.append(solver.loss())
    final = [w.to_numpy() for w in solver.network.learnable_weights_data()]
    assert all(not np.array_equal(a, b) for a, b in zip(initial, final))  # every weight moved
    return losses, final


def _updates(be) -> list[tuple]:
    """The recorded step's update calls: (name, the weight's size)."""
    (entry,) = [e for e in be.recorder.steps.values() if e.recording is not None]
    return [(fn.__name__, args[1].size) for fn, args, _ in entry.recording if fn.__name__ in ("solver_update", "axpby")]


def test_a_solver_lays_out_alike_weights_together_and_the_step_updates_each_run_once():
    be, solver = _mlp("momentum")
    _train(solver, 3)
    params = solver.network.parameters()
    weights, grads, configs = params[0], params[1], params[3]
    for group in ((0, 2, 4, 5), (1, 3)):  # lr_mult 1 (the last layer's bias too) and lr_mult 2
        for tensors in (weights, grads, [s[0] for s in solver.state]):
            assert _adjacent([tensors[i].buffer_on(HOST) for i in group])
    assert solver._update_runs(grads) == [[0, 2, 4, 5], [1, 3]]
    assert [configs[i].lr_mult for i in (0, 2, 4, 5, 1, 3)] == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    sizes = (64 * 256 + 256 * 128 + 128 * 10, 10, 256 + 128)  # weights; the last bias (decay_mult 1); the biases
    # the weights and the last bias differ in decay_mult (their L2 decay's axpby): two runs of lr_mult 1
    assert _updates(be) == [("axpby", sizes[0] + sizes[1]), ("solver_update", sizes[0] + sizes[1]),
                            ("solver_update", sizes[2])]


@pytest.mark.parametrize("path", ["numpy", "loop", "mkl"])
@pytest.mark.parametrize("rule", ["momentum", "nesterov", "adam", "adamw", "rmsprop", "adagrad", "adadelta"])
def test_joined_updates_train_as_the_separate_updates_do(monkeypatch, rule, path):
    """Six steps (the first two eager, the last four replayed) with each run of alike weights updated in one call,
    and with each weight's update a call of its own: the same losses and weights, exactly (one formula per element
    either way: NumPy's ufuncs, or the numba loop that gives their values). MKL's momentum (two threads) rounds an
    element by where it falls in the call: there the two agree to float32 rounding (and each run is the same from
    its first step to its last, resumed or not: the command's test below)."""
    if path == "loop":
        pytest.importorskip("numba")
        monkeypatch.setattr(compiled, "UPDATE_MIN_ELEMENTS", 0)  # every update through the loop, joined or not
    if path == "mkl" and (rule != "momentum" or lp.backend("native", blas="auto").blas != "mkl"):
        pytest.skip("MKL runs the momentum rule only, where its runtime is installed on an Intel CPU")
    extra = {"decay": 0.01} if rule == "adamw" else {}  # decoupled: AdamW applies it itself
    results, calls = [], []
    span = native.NativeBackend.span
    for join in (True, False):
        monkeypatch.setattr(native.NativeBackend, "span", span if join else (lambda self, buffers: None))
        be, solver = _mlp(rule, blas="auto" if path == "mkl" else "numpy", **extra)
        results.append(_train(solver))
        calls.append(_updates(be))
        assert be.recorder.replays >= 3
    (losses0, weights0), (losses1, weights1) = results
    if path == "mkl":
        np.testing.assert_allclose(losses0, losses1, rtol=1e-6)
    else:
        assert losses0 == losses1
    for a, b in zip(weights0, weights1):
        if path == "mkl":
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
        else:
            np.testing.assert_array_equal(a, b)
    assert len([c for c in calls[0] if c[0] == "solver_update"]) in (2, 3)  # runs of lr_mult (and decay_mult)
    assert len([c for c in calls[1] if c[0] == "solver_update"]) == 6


def _arena_views(rng, sizes, gap=0, dtype=np.float32):
    """Views of one arena, one per size, ``gap`` values apart, each reshaped [n // 4, 4]."""
    arena = rng.standard_normal(sum(sizes) + gap * len(sizes)).astype(dtype)
    out, offset = [], 0
    for n in sizes:
        out.append(arena[offset:offset + n].reshape(n // 4, 4))
        offset += n + gap
    return arena, out


def test_span_joins_buffers_that_lie_one_after_another(rng):
    be = lp.backend("native")
    arena, views = _arena_views(rng, [40, 8, 400])
    joined = be.span(views)
    assert joined.shape == (448,) and np.shares_memory(joined, arena)
    np.testing.assert_array_equal(joined, np.concatenate([v.reshape(-1) for v in views]))
    assert be.span(views[1:]).size == 408 and be.span(views[:1]).size == 40
    _, gapped = _arena_views(rng, [40, 8], gap=4)
    other = rng.standard_normal(8).astype(np.float32).reshape(2, 4)
    doubles = rng.standard_normal(56)
    for apart in (gapped, views[::-1], [views[0], views[2]], [views[0], other], [views[0], doubles[20:24]],
                  [arena[:40:2].reshape(5, 4), arena[20:28].reshape(2, 4)], [arena.view(np.float64)[:4]]):
        assert be.span(apart) is None
    np.testing.assert_array_equal(be.span([doubles[:3], doubles[3:7]]), doubles[:7])  # any dtype, one at a time


def test_what_is_updated_apart(monkeypatch):
    """Weights alike are one call; weights of other lr_mult or decay_mult another; a rule with an update of its own
    (which may read a weight's shape) gets each weight alone, and so does a weight with a 16-bit copy."""
    be, solver = _mlp("momentum", lr_mults=(1.0, 1.0), bias_decay_mult=1.0)
    _train(solver, 3)
    assert [name for name, _ in _updates(be)] == ["axpby", "solver_update"]  # one run: every weight alike
    from leafpy.solvers.momentum import Momentum

    class Own(Momentum):
        def update(self, backend, w, g, state, rate, lr_mult, decay=0.0, copy=None):
            assert w.ndim in (1, 2)  # the weight as it is, never a run of several
            super().update(backend, w, g, state, rate, lr_mult, decay, copy)
    be, solver = _mlp("momentum", lr_mults=(1.0, 1.0), bias_decay_mult=1.0, decay=0.0)
    solver.rule = Own(solver.config)
    solver._order_of = None  # the rule changed: the runs are planned again
    _train(solver, 3)
    assert len(_updates(be)) == 6
    bf16 = lp.backend("native", precision="bf16")
    net = lp.SequentialConfig(inputs=[("data", [8, 64])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=4)))
    obj = lp.SequentialConfig(inputs=[("network_out", [8, 4]), ("target", [8, 4])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    solver = lp.Solver.from_config(bf16, bf16, lp.SolverConfig(
        network=lp.LayerConfig("n", net), objective=lp.LayerConfig("o", obj), base_lr=0.01, seed=0))
    assert solver._update_runs(solver._update_grads()) == [[0], [1]]  # each weight has its 16-bit copy


# --- the user's path -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["adam", "momentum"])
def test_the_leafpy_command_resumes_a_run_with_joined_updates_as_it_ran_in_one_go(tmp_path, rule):
    """A run whose biases learn at twice the rate, with weight decay, on 16x16 images from an npz file: two epochs
    in one go, and one epoch, stopped, then resumed for the second (a new process lays the restored weights out
    again); the same per-epoch losses, exactly (with MKL, its momentum too). Adam's also equal a run whose
    updates are each a call of its own (the joining switched off by a sitecustomize module)."""
    brighter_half_npz(tmp_path / "data.npz", 384, 16)
    (tmp_path / "net.yaml").write_text(f"""
name: joined
data: {{dataset: npz, path: {tmp_path / 'data.npz'}, batch_size: 64, test_fraction: 0.25, seed: 0}}
train: {{epochs: 2}}
network:
  type: Sequential
  inputs: [{{name: data, shape: [null, 1, 16, 16]}}]
  layers:
    - {{name: flat, type: Flatten}}
    - {{name: fc0, type: Linear, output_size: 384, params: [{{lr_mult: 1}}, {{lr_mult: 2, decay_mult: 0}}]}}
    - {{name: relu0, type: ReLU}}
    - {{name: fc1, type: Linear, output_size: 2, params: [{{lr_mult: 1}}, {{lr_mult: 2, decay_mult: 0}}]}}
    - {{name: logsm, type: LogSoftmax}}
objective: nll
solver: {{solver: {rule}, base_lr: 0.002, momentum: 0.9, weight_decay: 0.0005, seed: 0}}
""")
    apart = tmp_path / "apart"
    apart.mkdir()  # a sitecustomize that runs each update as a call of its own
    (apart / "sitecustomize.py").write_text("from leafpy.backends import native\n"
                                            "native.NativeBackend.span = lambda self, buffers: None\n")

    def train(out, *args, env_extra=None):
        return train_history(tmp_path / "net.yaml", out, *args, env=env_extra)

    whole = train(tmp_path / "whole")
    train(tmp_path / "parts", "--epochs", "1")
    resumed = train(tmp_path / "parts", "--epochs", "2", "--resume", str(tmp_path / "parts" / "checkpoint.leaf"))
    assert len(whole) == 2 and np.isfinite(whole).all() and whole[1][0] < whole[0][0]
    assert resumed == whole
    if rule == "adam":
        separate = train(tmp_path / "separate", env_extra={"PYTHONPATH": os.pathsep.join(
            [str(apart), os.environ.get("PYTHONPATH", "")])})
        assert separate == whole
