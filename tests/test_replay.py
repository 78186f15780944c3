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

import leafpy as lp

ROOT = os.path.join(os.path.dirname(__file__), "..")

RULES = {"momentum": dict(base_lr=0.05, momentum=0.9), "nesterov": dict(base_lr=0.05, momentum=0.9),
         "adam": dict(base_lr=0.01), "rmsprop": dict(base_lr=0.002), "adagrad": dict(base_lr=0.02),
         "adadelta": dict(base_lr=1.0)}
SCHEDULES = {"inv": dict(lr_policy="inv", gamma=0.3, power=0.75),  # Caffe's LeNet schedule, steeper
             "step": dict(lr_policy="step", stepsize=2, gamma=0.5),
             "poly": dict(lr_policy="poly", max_iter=12, power=2.0),
             "sigmoid": dict(lr_policy="sigmoid", gamma=-1.0, stepsize=3)}
CASES = ([(rule, "inv", 1) for rule in RULES]
         + [(rule, schedule, k) for rule in ("adam", "momentum") for schedule in SCHEDULES for k in (1, 2)
            if (schedule, k) != ("inv", 1)])

DEVICES = [pytest.param("webgpu", marks=pytest.mark.webgpu), pytest.param("cuda", marks=pytest.mark.cuda)]


def _device(name):
    try:
        return lp.backend(name)
    except lp.BackendUnavailable as e:
        pytest.skip(f"{name} backend unavailable: {e}")


def _config(rule, schedule, k):
    run = lp.config.load(os.path.join(ROOT, "configs", "digits_mlp.yaml"))
    return dataclasses.replace(run.solver, solver=rule, minibatch_size=k, weight_decay=1e-3,
                               **RULES[rule], **SCHEDULES[schedule])


@pytest.mark.parametrize("device_name", DEVICES)
@pytest.mark.parametrize("rule,schedule,k", CASES, ids=[f"{r}-{s}-k{k}" for r, s, k in CASES])
def test_replayed_steps_follow_the_schedule(device_name, rule, schedule, k):
    device = _device(device_name)
    cfg = _config(rule, schedule, k)
    solver = lp.Solver.from_config(device, device, cfg)
    f64 = lp.backend("native", dtype="float64")
    reference = lp.Solver.from_config(f64, f64, cfg)
    for w, r in zip(solver.network.learnable_weights_data(), reference.network.learnable_weights_data()):
        r.set(w.to_numpy().astype(np.float64))
    ds = lp.data.digits()
    calls = 12
    batches = [(ds.x_train[i * 32:(i + 1) * 32], ds.y_train[i * 32:(i + 1) * 32]) for i in range(calls)]
    before = device.replays if hasattr(device, "replays") else device.recorder.replays
    losses, expected, rates = [], [], []
    for x, y in batches:
        rates.append(solver.learning_rate())
        solver.train_minibatch(x, y)
        reference.train_minibatch(x, y)
        losses.append(solver.loss())
        expected.append(reference.loss())
    assert len(set(rates)) >= 3, f"the {schedule} schedule should change the rate: {rates}"
    np.testing.assert_allclose(losses, expected, rtol=2e-4, atol=1e-5, err_msg="per-step losses")
    for w, r in zip(solver.network.learnable_weights_data(), reference.network.learnable_weights_data()):
        a, b = w.to_numpy(), r.to_numpy()
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * max(1.0, float(np.abs(b).max())), err_msg="weights")
    replays = device.recorder.replays - before
    # each accumulation phase (k of them) runs once as it is, once to be recorded, then from its recording
    assert replays == calls - 2 * k, f"{replays} of {calls} steps replayed ({device.recorder.error})"
