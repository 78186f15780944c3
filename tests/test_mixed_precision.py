"""Mixed precision on the native backend (bf16 and fp16 emulated: low-precision storage, float32 arithmetic).

Every layer of the gradient-check table runs in bf16 and fp16 against the same layer in float64 (which
test_gradients.py checks against central differences), within a tolerance derived from the format's unit roundoff
u and the number of roundings on the layer's longest path; activations are in the low-precision dtype (softmax's
and log-softmax's outputs in float32), weights and their gradients in float32. Loss scaling is in
test_loss_scaling.py, the command line in test_precision_runs.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import backend_or_skip
from test_gradients import CASES

import leafpy as lp
from leafpy.errors import BackendError, ConfigError

PRECISIONS = {"bf16": (np.dtype(ml_dtypes.bfloat16), 2.0**-8), "fp16": (np.dtype(np.float16), 2.0**-11)}
"""The activations' dtype and unit roundoff (half the spacing of numbers in [1, 2)) of each low precision."""
GROWTH = 4
"""Magnitude growth inside a layer for these O(1) test inputs: a sum of |x w| terms against its result, a forward
and a backward pass; fixed once for every layer, not fitted per layer."""
RECURRENT = ("LSTM", "GRU", "RNN")
WORST: dict[tuple[str, str], tuple[float, float]] = {}
"""(layer case, precision) -> (the largest relative error seen, the tolerance): the per-layer table, for reports."""


def _low(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a`` rounded to the low-precision format, back in float64 (both runs then see the same inputs)."""
    return np.asarray(a, np.float64).astype(dtype).astype(np.float64)


def _roundings(type_name: str, layer: lp.Layer, inputs: list[np.ndarray]) -> int:
    """Roundings to the low format on the longest path to a compared value: the stored result and a stored value
    read again (an output a gradient reads), one more for low-precision weight copies, and one per time step for a
    recurrent layer (each step's error passes through the next)."""
    depth = 2
    if layer.has_weights and not layer.worker.master_precision_weights:
        depth += 1
    if type_name in RECURRENT:
        depth += inputs[0].shape[1]
    return depth


def _params():
    for type_name, cases in sorted(CASES.items()):
        for i, case in enumerate(cases):
            for precision in PRECISIONS:
                yield pytest.param(type_name, case, precision, False, id=f"{type_name}-{i}-{precision}")
            # bf16 with 4-D tensors stored NHWC: the layout under the emulation's casts
            yield pytest.param(type_name, case, "bf16", True, id=f"{type_name}-{i}-bf16-channels-last")


def _run(layer: lp.Layer, inputs: list[np.ndarray], dys: list[np.ndarray] | None):
    outs = layer.forward([x.copy() for x in inputs])
    if dys is None:
        return outs, None, None
    grads = layer.backward(dys)
    dx = [g.to_numpy().astype(np.float64) if g is not None else None for g in grads]
    dw = {n: g for n, g in zip(layer.learnable_weights_names(), layer.learnable_weights_gradients())}
    return outs, dx, dw


@pytest.mark.parametrize("type_name,case,precision,channels_last", list(_params()))
def test_layer_in_low_precision_against_float64(type_name, case, precision, channels_last):
    dtype, u = PRECISIONS[precision]
    config, make_inputs = case
    low_be = lp.backend("native", precision=precision, **({"channels_last": True} if channels_last else {}))
    ref_be = lp.backend("native", dtype=np.float64)
    inputs = [_low(x, dtype) for x in make_inputs(np.random.default_rng(7))]
    low = lp.Layer.from_config(low_be, lp.LayerConfig("l", config), seed=3)
    ref = lp.Layer.from_config(ref_be, lp.LayerConfig("l", config), seed=3)
    outs = low.forward([x.copy() for x in inputs])
    out_dtype = np.float32 if low.worker.master_precision_outputs else dtype  # softmax's stay in float32
    assert all(o.dtype == out_dtype for o in outs), [o.dtype for o in outs]
    ref.load_weights({n: np.asarray(w, np.float64) for n, w in low.named_weights().items()})
    rng = np.random.default_rng(11)
    dys = [_low(rng.standard_normal(o.shape), dtype) for o in outs]
    if type_name == "Dropout":  # the same masks: each layer draws from the same seed
        low.worker.calls = 0
    low_outs, low_dx, low_dw = _run(low, inputs, dys)
    ref_outs, ref_dx, ref_dw = _run(ref, inputs, dys)
    tol = GROWTH * _roundings(type_name, low, inputs) * u

    def close(got, want, what):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        err = np.abs(got - want) / np.maximum(1.0, np.abs(want))
        key = (f"{type_name}-{CASES[type_name].index(case)}", precision)
        WORST[key] = (max(WORST.get(key, (0.0, tol))[0], float(err.max())), tol)
        assert err.max() <= tol, f"{what} ({precision}): relative error {err.max():.3g} > {tol:.3g}"

    for i, (a, b) in enumerate(zip(low_outs, ref_outs)):
        assert a.dtype == out_dtype
        close(a.to_numpy(), b.to_numpy(), f"output {i}")
    for i, (a, b) in enumerate(zip(low_dx, ref_dx)):
        if b is not None:
            assert low.input_grads[i].dtype == dtype
            close(a, b, f"input gradient {i}")
    for name, g in low_dw.items():
        assert g.dtype == np.float32, f"{name}: weight gradients are float32 masters, got {g.dtype}"
        if name.endswith(("running_mean", "running_var")):
            continue  # not trained: no gradient
        close(g.to_numpy(), ref_dw[name].to_numpy(), f"gradient of {name}")
    for w in low.learnable_weights_data():
        assert w.dtype == np.float32


def test_low_precision_really_rounds():
    """The emulation stores activations in the low format: a Linear output differs from float32 by about u."""
    x = np.random.default_rng(0).standard_normal((8, 16))
    cfg = lp.LayerConfig("fc", lp.LinearConfig(output_size=8))
    f32 = lp.Layer.from_config(lp.backend("native"), cfg, seed=1)
    y32 = f32.forward([x])[0].to_numpy()
    for precision, (_, u) in PRECISIONS.items():
        layer = lp.Layer.from_config(lp.backend("native", precision=precision), cfg, seed=1)
        y = layer.forward([x])[0].to_numpy().astype(np.float64)
        rel = np.abs(y - y32) / np.maximum(1.0, np.abs(y32))
        assert u / 64 < rel.max() < 8 * u, (precision, rel.max())


def test_weight_copies_follow_the_master_weights():
    """After set(), the next forward pass reads the new values (the low-precision copy is refreshed)."""
    be = lp.backend("native", precision="bf16")
    layer = lp.Layer.from_config(be, lp.LayerConfig("fc", lp.LinearConfig(output_size=2, bias=False)), seed=0)
    x = np.ones((1, 3))
    layer.forward([x])
    layer.learnable_weights_data()[0].set(np.array([[1.0, 2.0, 3.0], [0.5, 0.25, -1.0]]))
    np.testing.assert_allclose(layer.forward([x])[0].to_numpy().astype(np.float64), [[6.0, -0.25]])


def _linear_solver(be: lp.Backend) -> lp.Solver:
    """SGD on a Linear layer (5 -> 3, with a bias) under a mean squared error, batch 6, no loss scaling (so a
    backend that records steps records these)."""
    net = lp.SequentialConfig(inputs=[("data", [6, 5])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    obj = lp.SequentialConfig(inputs=[("out", [6, 3]), ("target", [6, 3])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    return lp.Solver.from_config(be, be, lp.SolverConfig(network=lp.LayerConfig("net", net),
                                                         objective=lp.LayerConfig("loss", obj), base_lr=0.1,
                                                         loss_scale="none"))


def _assert_forward_reads_the_masters(net: lp.Layer, x: np.ndarray, dtype: np.dtype, u: float) -> None:
    """An inference pass of :func:`_linear_solver`'s network against float64 from its master weights as they are
    now and x, each rounded to ``dtype`` (the output rounded once more: within 4u)."""
    w, b = (_low(t.to_numpy(), dtype) for t in net.learnable_weights_data())
    want = _low(x, dtype) @ w.T + b
    got = net.forward([x])[0].to_numpy().astype(np.float64)
    assert (np.abs(got - want) / np.maximum(1.0, np.abs(want))).max() <= 4 * u


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_weight_copies_are_cast_again_only_after_their_masters_change(precision, monkeypatch):
    """Inference passes cast each master weight into its low-precision copy once; a training step's update writes
    the copies with the masters (Backend.solver_update's ``copy``: on native, a cast after the update), so the next
    pass casts nothing; a copy is cast again after its master is set(), and every pass computes from the masters as
    they are."""
    be = lp.backend("native", precision=precision)
    dtype, u = PRECISIONS[precision]
    casts: list[tuple[int, ...]] = []
    cast = be.cast
    monkeypatch.setattr(be, "cast", lambda x, out: casts.append(tuple(out.shape)) or cast(x, out))
    solver = _linear_solver(be)
    net = solver.network
    shapes = [w.shape for w in net.learnable_weights_data()]

    def weight_casts() -> list[tuple[int, ...]]:  # the network's input is cast at every pass too
        return [s for s in casts if s in shapes]

    rng = np.random.default_rng(3)
    x, t = rng.standard_normal((6, 5)), rng.standard_normal((6, 3))
    for _ in range(2):
        _assert_forward_reads_the_masters(net, x, dtype, u)
    assert weight_casts() == shapes, "one cast per weight, at the first pass"
    solver.train_minibatch(x, t)  # its forward pass finds the copies current; its update writes masters and copies
    assert weight_casts() == shapes * 2
    _assert_forward_reads_the_masters(net, x, dtype, u)
    assert weight_casts() == shapes * 2
    bias = net.learnable_weights_data()[1]
    bias.set(np.array([10.0, -20.0, 30.0]))
    _assert_forward_reads_the_masters(net, x, dtype, u)
    _assert_forward_reads_the_masters(net, x, dtype, u)
    assert weight_casts() == shapes * 2 + [bias.shape]
    bias.set(np.array([1.0, 2.0, 3.0]))  # set between steps: the step casts it before its forward pass reads it
    solver.train_minibatch(x, t)
    assert weight_casts() == shapes * 2 + [bias.shape] * 2 + shapes
    _assert_forward_reads_the_masters(net, x, dtype, u)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_an_update_writes_the_weights_copy_itself(precision, monkeypatch):
    """solver_update's ``copy`` (a weight's 16-bit compute copy) is written from the updated float32 weight, rounded
    to nearest even, into the copy itself: the backend's 16-bit emulation does not widen it into a float32 scratch
    (base.NARROW_OPERANDS), which would cost two more passes over every weight a step."""
    be = lp.backend("native", precision=precision)
    dtype, _ = PRECISIONS[precision]
    rng = np.random.default_rng(5)
    w, g = rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    h = np.zeros(300, np.float32)
    copy = np.zeros(300, dtype)
    targets = []
    cast = be.cast
    monkeypatch.setattr(be, "cast", lambda x, out: targets.append(out) or cast(x, out))
    want = w.astype(np.float64) - 0.1 * g.astype(np.float64)  # (the update may use g as scratch)
    be.solver_update("momentum", w, g, np.array([0.1, 1.0], np.float32), 1.0, (0.9,), h, copy=copy)
    assert len(targets) == 1 and targets[0] is copy
    np.testing.assert_allclose(w, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(copy.view(np.uint16), w.astype(dtype).view(np.uint16))


def test_ids_and_labels_stay_in_the_master_dtype():
    """Embedding ids above 256 are not exact in bfloat16: they are staged in float32."""
    be = lp.backend("native", precision="bf16")
    cfg = lp.SequentialConfig(inputs=[("ids", [2, 1])])
    cfg.add_layer(lp.LayerConfig("emb", lp.EmbeddingConfig(input_dim=1000, output_dim=2)))
    net = lp.Layer.from_config(be, lp.LayerConfig("net", cfg), seed=0)
    table = np.arange(2000, dtype=np.float64).reshape(1000, 2) / 1000
    net.load_weights({"emb/weight": table})
    out = net.forward([np.array([[257.0], [999.0]])])[0].to_numpy().astype(np.float64)
    np.testing.assert_allclose(out.reshape(2, 2), _low(table[[257, 999]], PRECISIONS["bf16"][0]))
    assert net.inputs[0].dtype == np.float32


def test_unknown_precision_is_named():
    with pytest.raises(ConfigError, match=r"unknown precision 'bf8'.*fp32, tf32, bf16, fp16"):
        lp.backend("native", precision="bf8")


@pytest.mark.parametrize("precision,hint", [("bf16", "WGSL has no bfloat16.*fp16.*shader-f16.*fp32"),
                                            ("tf32", "no TF32.*fp32")])
def test_webgpu_refuses_low_precision(precision, hint):
    backend_or_skip("webgpu")
    with pytest.raises(BackendError, match=hint):
        lp.backend("webgpu", precision=precision)
    assert lp.backend("webgpu", precision="fp32").precision == "fp32"


def test_backend_reports_its_precision():
    for precision, want in (("fp32", np.float32), ("tf32", np.float32), ("bf16", ml_dtypes.bfloat16),
                            ("fp16", np.float16)):
        be = lp.backend("native", precision=precision)
        assert be.precision == precision and be.compute_dtype == np.dtype(want) and be.dtype == np.float32
    assert lp.backend("native").precision == "fp32"


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_sums_accumulate_in_float32(precision):
    """A sum of 4096 ones is exact with float32 accumulation; summed in bfloat16 it would stop at 256 (256 + 1
    rounds back to 256), in float16 at 2048: products over 4096 inputs, a bias gradient over a batch of 4096 and a
    batch norm's statistics."""
    be = lp.backend("native", precision=precision)
    fc = lp.Layer.from_config(be, lp.LayerConfig("fc", lp.LinearConfig(output_size=2)), seed=0)
    fc.forward([np.ones((2, 4096))])
    fc.load_weights({"fc/weight": np.ones((2, 4096)), "fc/bias": np.zeros(2)})
    np.testing.assert_allclose(fc.forward([np.ones((2, 4096))])[0].to_numpy().astype(np.float64), 4096.0)
    wide = lp.Layer.from_config(be, lp.LayerConfig("fc", lp.LinearConfig(output_size=2)), seed=0)
    wide.forward([np.ones((4096, 1))])
    wide.backward([np.ones((4096, 2))])
    np.testing.assert_allclose(wide.learnable_weights_gradients()[1].to_numpy(), 4096.0)  # the bias's
    bn = lp.Layer.from_config(be, lp.LayerConfig("bn", lp.BatchNormConfig(momentum=1.0)), seed=0)
    x = np.full((4096, 1), 3.0)
    x[::2] = 1.0  # mean 2, variance 1
    bn.forward([x])
    stats = dict(zip(bn.learnable_weights_names(), bn.learnable_weights_data()))
    np.testing.assert_allclose(stats["bn/running_mean"].to_numpy(), 2.0, rtol=1e-6)


def test_solver_loss_runs_in_float32_behind_a_cast():
    """Under bf16 the network's output is bfloat16 and the objective's input float32: the loss is the float64 mean
    squared error of the bfloat16 output (within float32 rounding), and the weights stay float32."""
    be = lp.backend("native", precision="bf16")
    net = lp.SequentialConfig(inputs=[("data", [6, 5])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    obj = lp.SequentialConfig(inputs=[("out", [6, 3]), ("target", [6, 3])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    solver = lp.Solver.from_config(be, be, lp.SolverConfig(network=lp.LayerConfig("net", net),
                                                           objective=lp.LayerConfig("loss", obj), base_lr=0.1))
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((6, 5)), rng.standard_normal((6, 3))
    out = solver.train_minibatch(x, t).to_numpy()
    assert out.dtype == ml_dtypes.bfloat16 and solver.objective.inputs[0].dtype == np.float32
    assert solver.objective.backend.precision == "fp32"
    want = np.mean((out.astype(np.float64) - t) ** 2)
    assert abs(solver.loss() - want) <= 1e-6 * max(1.0, want)
    assert all(w.dtype == np.float32 for w in solver.network.learnable_weights_data())
    assert all(s.dtype == np.float32 for state in solver.state for s in state)


def test_bfloat16_arrays_are_accepted_as_data():
    """What a bf16 network returns (to_numpy gives bfloat16 arrays) can be fed to another network or set."""
    be = lp.backend("native", precision="bf16")
    first = lp.Layer.from_config(be, lp.LayerConfig("a", lp.LinearConfig(output_size=3)), seed=0)
    second = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("b", lp.LinearConfig(output_size=2)), seed=0)
    y = first.forward([np.ones((2, 4))])[0].to_numpy()
    assert y.dtype == ml_dtypes.bfloat16
    z = second.forward([y])[0].to_numpy()
    w, b = (t.to_numpy() for t in second.learnable_weights_data())
    np.testing.assert_allclose(z, y.astype(np.float64) @ w.T + b, rtol=1e-6, atol=1e-6)


def test_every_primitive_declares_the_operands_it_writes():
    """Emulating a primitive in another precision converts back exactly the operands it writes (base.WRITES):
    every primitive has an entry, naming parameters of its signature."""
    import inspect

    from leafpy.backends import base

    for name in base.PRIMITIVES + base.SHORTHANDS:
        if name in base.MEMORY:
            continue
        assert name in base.WRITES, f"{name} declares no written operands"
        params = inspect.signature(getattr(base.Backend, name)).parameters
        entry = base.WRITES[name]
        names = entry({p: True for p in params}) + entry({p: False for p in params}) if callable(entry) else entry
        assert names and all(n in params for n in names), (name, names)


def test_an_objective_replaced_on_another_precision_gets_the_output_in_its_own_dtype():
    """solver.objective = a network on another backend: the next step hands it the network's output in the dtype
    it takes (a float32 objective behind a bf16 network through a cast, a bf16 one directly), and the loss is the
    same to bf16's rounding either way."""
    be16, be32 = lp.backend("native", precision="bf16"), lp.backend("native")
    rng = np.random.default_rng(3)
    x, t = rng.standard_normal((6, 5)), rng.standard_normal((6, 3))
    solver = _linear_solver(be16)
    loss_cfg = solver.config.objective
    losses = []
    for objective_backend in (be32, be16, be32):
        solver.objective = lp.Layer.from_config(objective_backend, loss_cfg)
        solver.network.set_training(False)  # (the same weights for each: no update in between)
        out = solver.network.forward([x])[0].to_numpy().astype(np.float64)
        solver.train_minibatch(x, t)
        losses.append(solver.loss())
        assert solver.objective.inputs[0].dtype == objective_backend.compute_dtype
        np.testing.assert_allclose(losses[-1], np.mean((out - t) ** 2), rtol=2e-2)


def test_an_emulated_primitive_takes_its_operands_in_any_argument_form():
    """leafpy.backends.base.emulated: positional, keyword and mixed calls widen the same operands and write back
    the ones the primitive writes; a wrong call is Python's own TypeError; a method with ``*args`` is bound by
    inspect instead."""
    from leafpy.backends.base import emulated

    seen = []

    def gemm(a, trans_a, b, trans_b, out, alpha=1.0, beta=0.0):
        seen.append((a.dtype, b.dtype, out.dtype, alpha, beta))
        out[...] = alpha * (a.T if trans_a else a) @ (b.T if trans_b else b) + beta * out

    def is_low(x):
        return isinstance(x, np.ndarray) and x.dtype == np.float16

    def widen(operands):
        return {k: a.astype(np.float32) for k, a in operands.items()}

    def narrow(copy, operand):
        operand[...] = copy

    run = emulated("gemm", gemm, is_low, widen, narrow)
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((3, 4)).astype(np.float16), rng.standard_normal((4, 2)).astype(np.float16)
    want = (2.0 * a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    forms = [lambda out: run(a, False, b, False, out, 2.0),
             lambda out: run(a, False, b, False, out=out, alpha=2.0),
             lambda out: run(a=a, trans_a=False, b=b, trans_b=False, out=out, alpha=2.0, beta=0.0),
             lambda out: run(a, False, b=b, trans_b=False, alpha=2.0, out=out)]
    for form in forms:
        out = np.full((3, 2), 7.0, np.float16)  # (beta 0: replaced, written back from the float32 copy)
        form(out)
        np.testing.assert_array_equal(out, want)
        assert seen[-1] == (np.float32, np.float32, np.float32, 2.0, 0.0)
    with pytest.raises(TypeError):
        run(a, False, b, False, np.zeros((3, 2), np.float16), a=a)  # a given twice
    with pytest.raises(TypeError):
        run(a, False, b, False, np.zeros((3, 2), np.float16), gamma=1.0)  # no such parameter

    def scal(alpha, *xs):
        for x in xs:
            x *= alpha

    x, y = np.ones(3, np.float16), np.ones(2, np.float16)
    emulated("scal", scal, is_low, widen, narrow)(3.0, x, y)  # no operand by a name: the call runs as it is
    np.testing.assert_array_equal(x, np.full(3, 3.0))
    np.testing.assert_array_equal(y, np.full(2, 3.0))
