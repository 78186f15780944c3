"""Update rules from their formula table (leafpy/backends/updates.py): a rule added at run time (its table line, its
UpdateRule, nothing else) trains a network on every backend as a float64 NumPy reference of its formula says; the
generated NumPy code writes nothing on a skipped step, needs little scratch, and follows the formula for every
operation the table offers; badly formed lines are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import backend_or_skip

import leafpy as lp
from leafpy.backends import updates
from leafpy.backends.native import NativeBackend
from leafpy.backends.pointwise import maximum, minimum, param, sign, sqrt, var, where
from leafpy.errors import BackendError
from leafpy.solvers import UpdateRule, registry

W, G, M, LR = var("w"), var("g"), var("m"), var("lr")
BETA1, BETA2, DECAY = param("beta1"), param("beta2"), param("decay")

LION = updates.Rule("lion", ("m",), ("beta1", "beta2", "decay"), (
    ("c", M * BETA1 + G * (1.0 - BETA1)),  # a local: the interpolation the sign is taken of
    ("w", W * (1.0 - var("policy_lr") * DECAY) - LR * sign(var("c"))),
    ("m", M * BETA2 + G * (1.0 - BETA2)),
))
"""Lion (Chen et al., 2023), with decoupled weight decay: a rule the table does not have."""


class Lion(UpdateRule):
    name = "lion"
    state_names = ("momentum",)
    hyper = ("beta1", "beta2")
    skips_on_device = True
    decoupled_weight_decay = True


SETTINGS = dict(base_lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1, lr_policy="step", stepsize=3, gamma=0.5)
MULTS = ((1.0, 1.0), (2.0, 0.0))  # (lr_mult, decay_mult) of the weight and of the bias


@pytest.fixture
def lion(monkeypatch):
    """Lion in the formula table and in the solver registry for one test (the registry loaded first, as a user's
    program that registers a rule finds it)."""
    registry.update_rules()
    monkeypatch.setitem(updates.TABLE, "lion", LION)
    monkeypatch.setitem(registry._RULES, "lion", Lion)


def _solver(backend):
    net = lp.SequentialConfig(inputs=[("data", [8, 5])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3),
                                 params=[lp.WeightConfig(lr_mult=lr, decay_mult=d) for lr, d in MULTS]))
    obj = lp.SequentialConfig(inputs=[("network_out", [8, 3]), ("target", [8, 3])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj), solver="lion",
                          seed=0, **SETTINGS)
    return lp.Solver.from_config(backend, backend, cfg)


def _reference(weights, batches):
    """Lion's weights after each step, in float64, straight from its definition."""
    s = SETTINGS
    ws = [w.astype(np.float64) for w in weights]
    ms = [np.zeros_like(w) for w in ws]
    out = []
    for it, (x, t) in enumerate(batches):
        y = x @ ws[0].T + ws[1]
        dy = 2.0 * (y - t) / y.size
        grads = [dy.T @ x, dy.sum(axis=0)]
        lr = s["base_lr"] * s["gamma"] ** (it // s["stepsize"])
        for w, g, m, (lr_mult, decay_mult) in zip(ws, grads, ms, MULTS):
            c = s["beta1"] * m + (1 - s["beta1"]) * g
            w *= 1 - lr * lr_mult * s["weight_decay"] * decay_mult
            w -= lr * lr_mult * np.sign(c)
            m[...] = s["beta2"] * m + (1 - s["beta2"]) * g
        out.append([w.copy() for w in ws])
    return out


@pytest.mark.parametrize("name", ["native", pytest.param("webgpu", marks=pytest.mark.webgpu)])
def test_a_rule_added_at_run_time_trains_as_its_formula_says(lion, name):
    backend = lp.backend("native") if name == "native" else backend_or_skip(name)
    rng = np.random.default_rng(7)
    batches = [(rng.standard_normal((8, 5)), rng.standard_normal((8, 3))) for _ in range(7)]
    solver = _solver(backend)
    expected = _reference([w.to_numpy() for w in solver.network.learnable_weights_data()], batches)
    for step, (x, t) in enumerate(batches):
        solver.train_minibatch(x.astype(np.float32), t.astype(np.float32))
        got = [w.to_numpy() for w in solver.network.learnable_weights_data()]
        for what, g, e in zip(("weight", "bias"), got, expected[step]):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=f"{name}: {what} after step {step}")
    # the history is the rule's, saved under its state name
    assert set(solver.snapshot()["history"]["fc/weight"]) == {"momentum"}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_operation_of_the_table_in_the_generated_numpy_code(dtype):
    """A rule that reassigns a local and its state and uses every operation, against the formula evaluated in
    float64 by NumPy directly; pieces smaller than the weight, and a skipped step that writes nothing."""
    h, d = var("h"), var("d")
    rule = updates.Rule("every_op", ("h", "k"), ("a", "b"), (
        ("d", sqrt(h + 1.0) * param("a") - G / (2.0 + G * G)),
        ("d", where(var("d") > 0.1, maximum(var("d"), G), minimum(-var("d"), G * 0.5))),
        ("h", h * param("b") + d * d),
        ("k", sign(G) * LR + d),
        ("w", W - d * LR),
        ("h", h + 1.0),
    ))
    rng = np.random.default_rng(3)
    n = 1000
    w, g, h, k = (rng.standard_normal(n).astype(dtype) for _ in range(4))
    h = np.abs(h)
    a, b, lr, lr_mult = 0.7, 0.5, 0.03, 2.0
    be = NativeBackend(dtype)
    be.UPDATE_PIECE = 256  # several pieces, the last one short
    updates.register(rule)
    try:
        args = [x.copy() for x in (w, g, h, k)]
        be.solver_update("every_op", args[0], args[1], np.array([lr, 0.0], dtype), lr_mult, (a, b), *args[2:])
        assert all(np.array_equal(x, y) for x, y in zip(args, (w, g, h, k))), "a skipped step wrote"
        be.solver_update("every_op", args[0], args[1], np.array([lr, 1.0], dtype), lr_mult, (a, b), *args[2:])
    finally:
        del updates.TABLE["every_op"]
    w64, g64, h64 = (x.astype(np.float64) for x in (w, g, h))
    rate = lr * lr_mult
    d64 = np.sqrt(h64 + 1.0) * a - g64 / (2.0 + g64 * g64)
    d64 = np.where(d64 > 0.1, np.maximum(d64, g64), np.minimum(-d64, g64 * 0.5))
    expected = (w64 - d64 * rate, g64, h64 * b + d64 * d64 + 1.0, np.sign(g64) * rate + d64)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for name, got, want in zip(("w", "g", "h", "k"), args, expected):
        if name != "g":  # the gradient may serve as scratch
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=name)


def test_the_built_in_rules_need_at_most_one_piece_of_scratch():
    """The generated code writes each node into its target or into memory no later node reads (the gradient, a
    state buffer being replaced): the built-in rules need no more scratch than the hand-written code they replace,
    and momentum, the commonest, none."""
    scratch = {name: updates.numpy_source(rule)[1] for name, rule in updates.TABLE.items()}
    assert scratch["momentum"] == 0 and scratch["nesterov"] == 0, scratch
    assert max(scratch.values()) == 1, scratch


@pytest.mark.parametrize("steps,message", [
    ((("w", W - var("q")),), "reads ['q'] before they are assigned"),
    ((("w", W - param("x")),), "undeclared parameters ['x']"),
    ((("g", G * 2.0),), "assigns 'g'"),
    ((("h", G),), "no step assigns w"),
])
def test_badly_formed_lines_are_refused_by_name(steps, message):
    with pytest.raises(BackendError, match="update rule 'bad'") as err:
        updates.Rule("bad", ("h",), (), steps)
    assert message in str(err.value)


def test_an_unknown_rule_names_the_known_ones():
    with pytest.raises(BackendError, match="unknown update rule 'nope'; known: momentum, nesterov"):
        NativeBackend().solver_update("nope", np.zeros(2, np.float32), np.zeros(2, np.float32),
                                      np.array([0.1, 1.0], np.float32), 1.0)



UPDATE_PARAMS = {"momentum": 0.9, "beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "decay": 0.9}
"""A value for each hyper-parameter of the table's rules (and Lion's), for tests that run a rule's kernels."""
FLOAT4_CASES = [  # layout of every operand, shape, whether the cuda backend takes the float4 kernel
    ("aligned", (65540,), True),  # 16,385 float4s: the last block partly past the end
    ("unaligned", (65540,), False),  # the same values 4 bytes into their buffers
    ("aligned", (4099,), False),  # not a multiple of 4
    ("channels-last", (64, 3, 5, 5), True),  # NCHW views of NHWC memory (a filter of a channels-last network)
]


def _operands(rule, shape):
    """w, g and the rule's state (non-negative) of ``shape``: the same values for the same shape."""
    rng = np.random.default_rng(int(np.prod(shape)))
    return [rng.standard_normal(shape).astype(np.float32) for _ in "wg"] + [
        np.abs(rng.standard_normal(shape)).astype(np.float32) for _ in rule.state]


def _on_gpu(cp, a, layout):
    if layout == "unaligned":
        view = cp.empty(a.size + 1, a.dtype)[1:].reshape(a.shape)
        view[...] = cp.asarray(a)
        return view
    if layout == "channels-last":
        return cp.ascontiguousarray(cp.asarray(a).transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    return cp.asarray(a)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", [*updates.TABLE, "lion"])
def test_the_cuda_float4_and_elementwise_updates_agree(lion, kind):
    """Every rule on the cuda backend, through its float4 kernel (float32 operands of one size, a multiple of 4,
    aligned) and through its ElementwiseKernel (the same values unaligned; a size not a multiple of 4): the two
    agree with each other and with the native backend, and a skipped step (rate[1] == 0) changes no bit."""
    be = backend_or_skip("cuda")
    import cupy as cp

    rule = updates.rule(kind)
    params = tuple(UPDATE_PARAMS[p] for p in rule.params)
    got = {}
    for layout, shape, float4 in FLOAT4_CASES:
        w, g, *state = _operands(rule, shape)
        case = f"{kind}, {layout} {shape}"
        for applies in (0.0, 1.0):
            rate = np.array([0.01, applies, 0.02], np.float32)
            dw, dg, *ds = (_on_gpu(cp, a, layout) for a in (w, g, *state))
            assert be._fits_float4(dg, dw, *ds, any_order=True) == float4, case
            be.solver_update(kind, dw, dg, cp.asarray(rate), 2.0, params, *ds)
            out = got[layout, shape] = [cp.asnumpy(a) for a in (dw, *ds)]
            if not applies:
                assert all(np.array_equal(a, b) for a, b in zip(out, [w, *state])), f"{case}: a skipped step wrote"
        want = [w.copy(), *(s.copy() for s in state)]
        NativeBackend(np.float32).solver_update(kind, want[0], g, rate, 2.0, params, *want[1:])
        for name, a, b in zip(("w", *rule.state), out, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{case}: {name}")
    for name, a, b in zip(("w", *rule.state), got["aligned", (65540,)], got["unaligned", (65540,)]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=f"{kind}: {name}, float4 vs one per thread")


@pytest.mark.webgpu
@pytest.mark.parametrize("kind", [*updates.TABLE, "lion"])
def test_a_webgpu_float16_update_writes_the_weights_copy_in_its_own_pass(lion, kind):
    """Under precision "fp16" every rule (Lion added at run time: the float16 module is built again) runs as its
    update16 twin, which stores the float16 copy of the updated weight as it stores the weight: the weight and the
    state as the native backend's float32 update, the copy the weight rounded to nearest even (NumPy's cast), no
    second pass (no to_f16 dispatch); a skipped step (rate[1] == 0) changes no bit of the weight, state or copy."""
    be = backend_or_skip("webgpu", precision="fp16")
    rule = updates.rule(kind)
    params = tuple(UPDATE_PARAMS[p] for p in rule.params)
    w, g, *state = _operands(rule, (70001,))  # more than one workgroup row of the dispatch grid
    stale = np.full(w.shape, 0.5, np.float16)
    for applies in (0.0, 1.0):
        rate = lp.SharedTensor.from_numpy(np.array([0.01, applies, 0.02], np.float32))
        tw, tg, *ts = (lp.SharedTensor.from_numpy(a) for a in (w, g, *state))
        copy = lp.SharedTensor.from_numpy(stale, np.float16)
        bufs = [t.read_write(be) for t in (tw, tg, *ts)]
        entries = []
        dispatch = be.enc.dispatch
        be.enc.dispatch = lambda module, entry, *a, **k: entries.append(entry) or dispatch(module, entry, *a, **k)
        try:
            be.solver_update(kind, bufs[0], bufs[1], rate.read(be), 2.0, params, *bufs[2:],
                             copy=copy.read_write(be))
        finally:
            be.enc.dispatch = dispatch
        assert entries == [f"{rule.name}_update_h"], entries
        got = [t.to_numpy() for t in (tw, *ts)]
        if not applies:
            assert all(np.array_equal(a, b) for a, b in zip(got, [w, *state])), f"{kind}: a skipped step wrote"
            np.testing.assert_array_equal(copy.to_numpy().view(np.uint16), stale.view(np.uint16))
            continue
        want = [w.copy(), *(s.copy() for s in state)]
        NativeBackend(np.float32).solver_update(kind, want[0], g.copy(), np.array([0.01, 1.0, 0.02], np.float32),
                                                2.0, params, *want[1:])
        for name, a, b in zip(("w", *rule.state), got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{kind}: {name}")
        np.testing.assert_array_equal(copy.to_numpy().view(np.uint16), got[0].astype(np.float16).view(np.uint16))
