"""Subgroup operations in the webgpu backend's reductions: where the adapter offers the "subgroup" feature (lavapipe
does, and so does NVIDIA's Vulkan driver) the sums and softmax rows combine a workgroup's values with
subgroupAdd/subgroupMax. Each reduction kernel (dot products, per-channel sums, class sums, softmax rows) is checked
against float64 NumPy with subgroups on and off, in float32 and in float16 storage."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import webgpu_offering

import leafpy as lp

pytestmark = pytest.mark.webgpu

_made: dict = {}


def _backend(subgroups: bool, precision: str = "fp32"):
    key = (subgroups, precision)
    if key not in _made:
        webgpu_offering("subgroup", *(["shader-f16"] if precision == "fp16" else []))
        _made[key] = lp.backend("webgpu", subgroups=subgroups, **({"precision": precision}
                                                                  if precision != "fp32" else {}))
    be = _made[key]
    assert be.subgroups is subgroups
    return be


def _put(be, host: np.ndarray, dtype=np.float32):
    buf = be.view(be.allocate(host.size, dtype), host.shape)
    be.upload(host.astype(dtype), buf)
    return buf


def _get(be, buf, dtype=np.float32) -> np.ndarray:
    out = np.empty(buf.shape, dtype)
    be.download(buf, out)
    return out.astype(np.float64)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_requiring_subgroups_where_they_are_offered_opens_and_uses_them():
    be = _backend(True)
    assert "subgroupAdd" in be.lanes and "subgroupAdd" not in _backend(False).lanes


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("subgroups", [False, True])
def test_reductions_match_float64(subgroups, precision):
    be = _backend(subgroups, precision)
    dt = np.float16 if precision == "fp16" else np.float32
    u = 2.0 ** -11 if precision == "fp16" else 2.0 ** -24
    rng = np.random.default_rng(3)
    f64 = lambda a: a.astype(dt).astype(np.float64)  # noqa: E731  the values the device holds

    # dot: 70,000 elements (several blocks of partial sums, then a row sum)
    x = rng.standard_normal(70_000)
    out = be.view(be.allocate(1, np.float32), (1,))
    be.dot(_put(be, x, dt), _put(be, x, dt), out)
    want = (f64(x) ** 2).sum()
    assert _get(be, out)[0] == pytest.approx(want, rel=1e-5)

    # per-channel sums: [N, C, H, W] (per-block partials) and [N, C] (column sums)
    for shape in ((6, 40, 9, 9), (300, 24)):
        dy = rng.standard_normal(shape)
        db = be.view(be.allocate(shape[1], np.float32), (shape[1],))
        be.bias_grad(_put(be, dy, dt), db)
        axes = (0, 2, 3) if len(shape) == 4 else (0,)
        np.testing.assert_allclose(_get(be, db), f64(dy).sum(axis=axes), rtol=1e-5, atol=1e-4)

    # class sums: the NLL of 64 samples over 10 classes
    logp = np.log(_softmax(rng.standard_normal((64, 10))))
    labels = rng.integers(0, 10, 64).astype(np.float32)
    loss = be.view(be.allocate(1, np.float32), (1,))
    be.nll(_put(be, logp, dt), _put(be, labels), loss)
    assert _get(be, loss)[0] == pytest.approx(-f64(logp)[np.arange(64), labels.astype(int)].mean(), rel=1e-5)

    # softmax over long rows (one workgroup per row: its maximum and its sum); values up to +-50, so a row maximum
    # taken wrongly overflows exp() (exp(100) > 3.4e38)
    x = 50.0 * rng.uniform(-1.0, 1.0, (5, 1000))
    x[3:] = rng.uniform(-60.0, -59.0, (2, 1000))  # rows with one spike: every other thread's own maximum is -60
    x[3, 17] = x[4, 901] = 60.0
    y = be.view(be.allocate(x.size, dt), x.shape)
    be.softmax(_put(be, x, dt), y)
    want = _softmax(f64(x))
    # relative error of exp(x - max): float32's rounding of the difference (|x - max| up to 100 here) times exp's
    # sensitivity, 100 * 2^-24 = 6e-6, plus exp's and the division's own; then the storage's rounding (float16 also
    # flushes values under its smallest subnormal, 6e-8, to zero; GPUs may flush float32's subnormals, under 1.2e-38)
    tiny = 6e-8 if precision == "fp16" else 1.2e-38
    np.testing.assert_allclose(_get(be, y, dt), want, rtol=4 * u + 2e-5, atol=tiny)
    be.log_softmax(_put(be, x, dt), y)
    logs = np.log(_softmax(f64(x)))
    np.testing.assert_allclose(_get(be, y, dt), logs, rtol=4 * u, atol=2e-3 if precision == "fp16" else 1e-4)
    dy = rng.standard_normal(x.shape)
    dx = be.view(be.allocate(x.size, dt), x.shape)
    sm = want.astype(dt)
    be.softmax_grad(_put(be, sm, dt), _put(be, dy, dt), dx)
    s64, d64 = sm.astype(np.float64), f64(dy)
    ref = s64 * (d64 - (s64 * d64).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(_get(be, dx, dt), ref, rtol=8 * u, atol=8 * u * np.abs(ref).max())


def test_a_network_trains_alike_with_and_without_subgroups():
    """Two training steps of a softmax classifier with 300 classes (long rows) give the same weights either way."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 20)).astype(np.float32), rng.integers(0, 300, 16).astype(np.float32)
    weights = []
    for subgroups in (False, True):
        be = _backend(subgroups)
        net = lp.SequentialConfig(inputs=[("data", [16, 20])])
        net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=300)))
        net.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
        obj = lp.SequentialConfig(inputs=[("out", [16, 300]), ("label", [16, 1])])
        obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=300)))
        solver = lp.Solver.from_config(be, be, lp.SolverConfig(
            network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj), base_lr=0.5, seed=1))
        for _ in range(2):
            solver.train_minibatch(x, y)
        weights.append([w.to_numpy() for w in solver.network.learnable_weights_data()])
    for a, b in zip(*weights):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
