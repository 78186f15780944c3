"""A solver's weights, gradients and history laid out one after another (``Backend.arrange``, the native backend's
``host_arena``), and a native recorded step's alike updates joined into one call: the values kept by the layout,
the same training with the updates joined and apart, what stays apart, and a user's run through the ``leafpy``
command, interrupted and resumed, against the same run in one go."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

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


def _mlp(rule: str, batch: int = 32, lr_mults: tuple = (1.0, 2.0), decay: float = 0.0005, blas: str = "auto",
         **extra):
    """An MLP 64-256-128-10 whose biases learn at another rate (Caffe's habit) on the native backend."""
    net = lp.SequentialConfig(inputs=[("data", [batch, 64])])
    for i, width in enumerate((256, 128)):
        params = [lp.WeightConfig(lr_mult=lr_mults[0]), lp.WeightConfig(lr_mult=lr_mults[1], decay_mult=0.0)]
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
    assert [configs[i].lr_mult for i in solver._update_order(grads)] == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    sizes = (64 * 256 + 256 * 128 + 128 * 10, 10, 256 + 128)  # weights; the last bias (decay_mult 1); the biases
    # the weights and the last bias differ in decay_mult (their L2 decay's axpby): two runs of lr_mult 1
    assert _updates(be) == [("axpby", sizes[0] + sizes[1]), ("solver_update", sizes[0] + sizes[1]),
                            ("solver_update", sizes[2])]


@pytest.mark.parametrize("path", ["numpy", "loop", "mkl"])
@pytest.mark.parametrize("rule", ["momentum", "nesterov", "adam", "adamw", "rmsprop", "adagrad", "adadelta"])
def test_joined_updates_train_as_the_separate_updates_do(monkeypatch, rule, path):
    """Six steps (the last four replayed) with the updates joined, and with each weight's update a call of its own:
    the same losses and weights, exactly (one formula per element either way: NumPy's ufuncs, or the numba loop
    that gives their values). MKL's momentum (two threads) rounds an element by where it falls in the call: there
    the weights agree to float32 rounding."""
    if path == "loop":
        pytest.importorskip("numba")
        monkeypatch.setattr(compiled, "UPDATE_MIN_ELEMENTS", 0)  # every update through the loop, joined or not
    if path == "mkl" and (rule != "momentum" or lp.backend("native", blas="auto").blas != "mkl"):
        pytest.skip("MKL runs the momentum rule only, where its runtime is installed on an Intel CPU")
    extra = {"decay": 0.01} if rule == "adamw" else {}  # decoupled: AdamW applies it itself
    results, calls = [], []
    for join in (True, False):
        monkeypatch.setattr(native, "join_updates", native.join_updates if join else (lambda c: c))
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


def _update_calls(be, arrays: list[tuple], lr_mults=None, rates=None, copies=None, decay=None) -> list:
    """Hand-built update calls over (w, g, h) triples (momentum), as a recorded step holds them."""
    fn = native.FUSABLE["solver_update"].__get__(be)
    axpby = native.FUSABLE["axpby"].__get__(be)
    rate = np.array([0.1, 1.0], np.float32)
    out = []
    for k, (w, g, h) in enumerate(arrays):
        if decay is not None:
            out.append((axpby, (decay, w, 1.0, g), {}))
        out.append((fn, ("momentum", w, g, rates[k] if rates else rate, lr_mults[k] if lr_mults else 1.0, (0.9,)),
                     {"copy": copies[k] if copies else None, "s1": h}))
    return out


def _arena_triples(rng, sizes, gap=0):
    """(w, g, h) per size, each kind of buffer one after another in an arena of its own (``gap`` values apart)."""
    arenas = [rng.standard_normal(sum(sizes) + gap * len(sizes)).astype(np.float32) for _ in range(3)]
    out, offset = [], 0
    for n in sizes:
        out.append(tuple(a[offset:offset + n].reshape(n // 4, 4) for a in arenas))
        offset += n + gap
    return out


@pytest.mark.parametrize("decay", [None, 0.01])
def test_join_updates_computes_what_the_separate_calls_compute(rng, decay):
    be = lp.backend("native")
    triples = _arena_triples(rng, [40, 8, 400])
    copies = [[a.copy() for a in t] for t in triples]
    calls = _update_calls(be, triples, decay=decay)
    joined = native.join_updates(calls)
    assert [fn.__name__ for fn, _, _ in joined] == ["axpby"] * (decay is not None) + ["solver_update"]
    assert joined[-1][1][1].size == 448
    for fn, args, kwargs in joined:
        fn(*args, **kwargs)
    for fn, args, kwargs in _update_calls(be, copies, decay=decay):
        fn(*args, **kwargs)
    for t, c in zip(triples, copies):
        for a, b in zip(t, c):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("change", ["gap", "lr_mult", "rate", "copy", "order", "decay pairs another weight"])
def test_updates_that_cannot_be_joined_stay_apart(rng, change):
    be = lp.backend("native")
    triples = _arena_triples(rng, [40, 8], gap=4 if change == "gap" else 0)
    kw: dict = {}
    if change == "lr_mult":
        kw["lr_mults"] = [1.0, 2.0]
    elif change == "rate":
        kw["rates"] = [np.array([0.1, 1.0], np.float32), np.array([0.1, 1.0], np.float32)]
    elif change == "copy":
        kw["copies"] = [None, np.empty((2, 4), np.float16)]
    elif change == "order":
        triples = triples[::-1]
    calls = _update_calls(be, triples, **kw)
    if change == "decay pairs another weight":  # the decay of w0 into g1: not the L2 decay of the update after it
        calls = _update_calls(be, triples, decay=0.01)
        calls[0] = (calls[0][0], (0.01, triples[0][0], 1.0, triples[1][1]), {})
    assert native.join_updates(calls) == calls


# --- the user's path -----------------------------------------------------------------------------------------------
def test_the_leafpy_command_resumes_a_run_with_joined_updates_as_it_ran_in_one_go(tmp_path):
    """An Adam run whose biases learn at twice the rate, with weight decay, on 16x16 images from an npz file: two
    epochs in one go, and one epoch, stopped, then resumed for the second (a new process lays the restored
    weights out again); the same per-epoch losses, and the same as a run whose updates are each a call of its own
    (the join switched off by a sitecustomize module)."""
    rng = np.random.default_rng(0)
    x = rng.random((384, 1, 16, 16), dtype=np.float32)
    y = (x[:, 0, :8].mean(axis=(1, 2)) > x[:, 0, 8:].mean(axis=(1, 2))).astype(np.int64)
    np.savez(tmp_path / "data.npz", x=x, y=y)
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
solver: {{solver: adam, base_lr: 0.002, weight_decay: 0.0005, seed: 0}}
""")
    apart = tmp_path / "apart"
    apart.mkdir()  # a sitecustomize that runs each update as a call of its own
    (apart / "sitecustomize.py").write_text("from leafpy.backends import native\n"
                                            "native.join_updates = lambda calls: calls\n")

    def train(out, *args, env_extra=None):
        env = {**os.environ, **(env_extra or {})}
        done = subprocess.run([sys.executable, "-m", "leafpy.cli", "train", str(tmp_path / "net.yaml"), "--backend",
                               "native", "--out", str(out), *args], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        return [(e["loss"], e["test_loss"]) for e in json.loads((out / "history.json").read_text())]

    whole = train(tmp_path / "whole")
    train(tmp_path / "parts", "--epochs", "1")
    resumed = train(tmp_path / "parts", "--epochs", "2", "--resume", str(tmp_path / "parts" / "checkpoint.leaf"))
    separate = train(tmp_path / "separate", env_extra={"PYTHONPATH": os.pathsep.join(
        [str(apart), os.environ.get("PYTHONPATH", "")])})
    assert len(whole) == 2 and np.isfinite(whole).all() and whole[1][0] < whole[0][0]
    assert resumed == whole
    assert separate == whole
