"""The native backend's numba kernels: max pooling with the same outputs, argmax positions and gradients as NumPy's
passes and as a float64 loop reference, on every case it takes, with ties, NaN and dx's old contents; what it
leaves to NumPy; a convolution's columns gathered and added back by the kernels with NumPy's values; a replayed
step's Linear + ReLU calls joined, with the same values as the separate calls, and the patterns left apart; a
LeNet and an MLP trained with and without them; the switch through the ``leafpy`` command."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import reference as ref
from runs import brighter_half_npz, layer, run_file, train_history

import leafpy as lp
from leafpy.backends import compiled, native, updates
from leafpy.backends.pointwise import exp, param, sqrt, var

pytest.importorskip("numba")


@pytest.fixture
def small_inputs(monkeypatch):
    """The kernels take inputs of any size (the size floor only keeps numba's import away from small models)."""
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 0)
    monkeypatch.setattr(compiled, "COLUMNS_MIN_ELEMENTS", 0)


@pytest.fixture
def calls(monkeypatch):
    """The cases the kernels were run for."""
    seen: list[str] = []
    for name in ("max_pool", "max_pool_grad"):
        original = getattr(compiled, name)

        def spy(case, *args, _original=original, _name=name):
            seen.append(f"{_name}:{case}")
            return _original(case, *args)
        monkeypatch.setattr(compiled, name, spy)
    return seen


def _numpy_pool(be, x, kernel, stride, dy, monkeypatch):
    """Output, mask and gradient through NumPy's passes (the compiled kernels switched off)."""
    with monkeypatch.context() as m:
        m.setattr(compiled, "_KERNELS", [None])
        out, mask = np.empty(dy.shape, x.dtype), np.empty(dy.shape, np.int32)
        be.pool2d(x, out, mask, "max", kernel, stride, (0, 0))
        dx = np.full(x.shape, np.nan, x.dtype)
        be.pool2d_grad(dy, dx, mask, "max", kernel, stride, (0, 0))
    return out, mask, dx


CASES = [  # shape, kernel, stride, the kernel that takes it
    ((3, 4, 8, 10), (2, 2), (2, 2), "2x2"),
    ((2, 3, 9, 7), (2, 2), (2, 2), "2x2"),  # a ragged last row and column no window covers
    ((2, 5, 13, 13), (3, 3), (2, 2), "3x3"),  # overlapping windows (AlexNet's)
    ((2, 3, 9, 10), (3, 3), (1, 1), "3x3"),  # every input in up to nine windows
    ((1, 2, 11, 10), (3, 3), (3, 4), "3x3"),  # gaps between windows, a ragged edge
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,kernel,stride,case", CASES)
@pytest.mark.parametrize("values", ["distinct", "ties", "nan"])
def test_compiled_max_pooling_gives_numpy_passes_values(small_inputs, calls, monkeypatch, rng, shape, kernel, stride,
                                                        case, dtype, values):
    be = lp.backend("native")  # the primitives take the arrays' dtype
    if values == "ties":  # few distinct values: the first of equal maxima wins
        x = rng.integers(0, 3, shape).astype(dtype)
    else:
        x = (rng.permutation(np.arange(np.prod(shape))).reshape(shape) * 0.01 - 1).astype(dtype)
    if values == "nan":
        x.reshape(-1)[rng.choice(x.size, 5, replace=False)] = np.nan
    oh, ow = (shape[2] - kernel[0]) // stride[0] + 1, (shape[3] - kernel[1]) // stride[1] + 1
    dy = rng.standard_normal((shape[0], shape[1], oh, ow)).astype(dtype)
    dy.reshape(-1)[::7] *= -1
    if values == "nan":
        dy.reshape(-1)[3] = np.nan

    out, mask = np.empty(dy.shape, dtype), np.full(dy.shape, -1, np.int32)
    be.pool2d(x, out, mask, "max", kernel, stride, (0, 0))
    dx = np.full(shape, np.nan, dtype)  # every element is written: inputs no window covers get zero
    be.pool2d_grad(dy, dx, mask, "max", kernel, stride, (0, 0))
    assert calls == [f"max_pool:{case}", f"max_pool_grad:{case}"]

    want_out, want_mask, want_dx = _numpy_pool(be, x, kernel, stride, dy, monkeypatch)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(mask, want_mask)
    np.testing.assert_array_equal(dx, want_dx)  # overlapping windows too: the sums in NumPy's order
    if values == "nan":  # the NaN in dy reaches its window's maximum alone
        assert np.isnan(dx).sum() == 1
    if values != "nan" and kernel[0] == kernel[1] and stride[0] == stride[1]:  # the float64 loop reference
        ref_out, arg = ref.maxpool(x.astype(np.float64), kernel[0], stride[0])
        np.testing.assert_array_equal(out, ref_out)
        atol = 4 * np.finfo(dtype).eps * np.abs(dy).max()  # float64 sums of float32 values
        np.testing.assert_allclose(dx, ref.maxpool_backward(shape, arg, dy.astype(np.float64)), rtol=0, atol=atol)


@pytest.mark.parametrize("what", ["average", "padding", "float16", "strided view", "small", "other windows"])
def test_what_the_kernels_leave_to_numpy(calls, rng, what):
    be = lp.backend("native")
    x = rng.standard_normal((4, 16, 32, 32)).astype(np.float32)  # 65536 elements: the floor
    mode, padding, kernel = "max", (0, 0), (2, 2)
    if what == "average":
        mode = "average"
    elif what == "padding":
        padding = (1, 1)
    elif what == "float16":
        x = x.astype(np.float16)
    elif what == "strided view":
        x = np.ascontiguousarray(np.concatenate([x, x], axis=3))[:, :, :, ::2]
    elif what == "small":
        x = np.ascontiguousarray(x[:, :, :16])
    elif what == "other windows":  # 3x2 windows: NumPy's passes (the general kernel measured no faster)
        kernel = (3, 2)
    oh = (x.shape[2] + 2 * padding[0] - kernel[0]) // 2 + 1
    ow = (x.shape[3] + 2 * padding[1] - kernel[1]) // 2 + 1
    out, mask = np.empty((4, 16, oh, ow), x.dtype), np.empty((4, 16, oh, ow), np.int32)
    be.pool2d(x, out, mask, mode, kernel, (2, 2), padding)
    dx = np.empty_like(x) if x.flags.c_contiguous else np.empty((*x.shape[:3], 2 * x.shape[3]), x.dtype)[..., ::2]
    be.pool2d_grad(np.ones_like(out), dx, mask, mode, kernel, (2, 2), padding)
    assert calls == []
    x.reshape(-1)[0] = 0  # and at the floor, contiguous float32, it is taken
    x32 = np.ascontiguousarray(x, np.float32)
    if what in ("float16", "strided view"):
        out = np.empty(out.shape, np.float32)
        be.pool2d(x32, out, mask, "max", (2, 2), (2, 2), (0, 0))
        assert calls == ["max_pool:2x2"]


def test_a_lenet_trains_alike_with_and_without_the_kernels(monkeypatch, calls, column_calls):
    """Ten steps of LeNet-64 on 28x28 inputs (its poolings over 737,280 and 204,800 values, its convolutions'
    columns over 921,600 and 2,048,000, so the kernels run): the same losses and weights as through NumPy's
    passes."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import train_step as ts
    make, batch, shape, classes = ts.NETWORKS["lenet64"]
    data = np.random.default_rng(0).random((batch, *shape), dtype=np.float32)
    labels = np.random.default_rng(1).integers(0, classes, batch).astype(np.float32)
    results = []
    for kernels in (None, compiled.kernels()):
        monkeypatch.setattr(compiled, "_KERNELS", [kernels])
        be = lp.backend("native")
        solver = ts.leafpy_solver(be, make(), batch, classes, "momentum")
        losses = []
        for _ in range(10):
            solver.train_minibatch(lp.SharedTensor.from_numpy(data), lp.SharedTensor.from_numpy(labels))
            losses.append(solver.loss())
        results.append((losses, [w.to_numpy() for w in solver.network.learnable_weights_data()]))
    (losses0, weights0), (losses1, weights1) = results
    assert calls.count("max_pool:2x2") == 20 and calls.count("max_pool_grad:2x2") == 20  # two poolings, 10 steps
    # the first convolution's columns per image, the second's batch innermost (its data gradient's too)
    assert {name: column_calls.count(name) for name in COLUMN_KERNELS} == {
        "gather_windows": 10, "scatter_windows": 10, "gather_image_windows": 10, "scatter_image_windows": 0}
    np.testing.assert_allclose(losses1, losses0, rtol=1e-6)
    assert losses1[-1] < losses1[0]
    for a, b in zip(weights1, weights0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_leafpy_command_trains_alike_with_leafpy_compiled_0(tmp_path):
    """A user's run on 24x24 images (the poolings, the convolutions' columns and a 128 x 512 Linear + ReLU large
    enough for the kernels and the fused calls of replayed steps) and the same run with LEAFPY_COMPILED=0: the
    same losses, read from the command's own history file."""
    brighter_half_npz(tmp_path / "data.npz", 512, 24)
    (tmp_path / "net.yaml").write_text(f"""
name: pools
data: {{dataset: npz, path: {tmp_path / 'data.npz'}, batch_size: 128, test_fraction: 0.25, seed: 0}}
train: {{epochs: 2}}
network:
  type: Sequential
  inputs: [{{name: data, shape: [null, 1, 24, 24]}}]
  layers:
    - {{name: conv1, type: Convolution, num_output: 16, filter_shape: [3], padding: [1]}}
    - {{name: pool1, type: Pooling, mode: max, filter_shape: [2], stride: [2]}}
    - {{name: conv2, type: Convolution, num_output: 16, filter_shape: [3], padding: [1]}}
    - {{name: pool2, type: Pooling, mode: max, filter_shape: [3], stride: [2]}}
    - {{name: flat, type: Flatten}}
    - {{name: fc0, type: Linear, output_size: 512}}
    - {{name: relu0, type: ReLU}}
    - {{name: fc, type: Linear, output_size: 2}}
    - {{name: logsm, type: LogSoftmax}}
objective: nll
solver: {{solver: momentum, base_lr: 0.05, momentum: 0.9, seed: 0}}
""")
    probe = "from leafpy.backends import compiled; print(compiled.kernels() is not None)"
    for flag, loads in (("1", "True"), ("0", "False")):  # the command's own environment has the kernels, or not
        env = {**os.environ, "LEAFPY_COMPILED": flag}
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == loads, done.stderr
    finals = [train_history(tmp_path / "net.yaml", tmp_path / f"run{flag}", env={"LEAFPY_COMPILED": flag})
              for flag in ("1", "0")]
    assert len(finals[0]) == 2 and np.isfinite(finals[0]).all()
    np.testing.assert_allclose(finals[0], finals[1], rtol=1e-6)


def test_the_default_model_trains_without_importing_numba(tmp_path):
    """``make demo``'s run (the digits LeNet, its columns, poolings and updates below every kernel's floor) through
    the command, in a process that would import numba at its first large piece of work: it never does, so its
    start-up is what it was without the kernels."""
    probe = ("import runpy, sys; sys.argv = ['leafpy', 'train', 'configs/digits_lenet.yaml', '--epochs', '1', "
             f"'--out', {str(tmp_path / 'run')!r}]\n"
             "try:\n    runpy.run_module('leafpy', run_name='__main__')\nexcept SystemExit as e:\n"
             "    assert not e.code, e.code\n"
             "print('numba imported:', 'numba' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=os.path.join(os.path.dirname(__file__), ".."),
                          env={**os.environ, "LEAFPY_COMPILED": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "numba imported: False" in done.stdout
    assert (tmp_path / "run" / "model.leaf").is_file()


# --- a convolution's columns ---------------------------------------------------------------------------------------
COLUMN_KERNELS = ("gather_windows", "scatter_windows", "gather_image_windows", "scatter_image_windows")


@pytest.fixture
def column_calls(monkeypatch):
    """The column kernels that ran, by name (move_windows's two ways as gather_windows and scatter_windows)."""
    seen: list[str] = []
    module = compiled.kernels()
    for name in ("move_windows", "gather_image_windows", "scatter_image_windows"):
        original = getattr(module, name)

        def spy(*args, _original=original, _name=name):
            seen.append(_name if _name != "move_windows" else "scatter_windows" if args[-1] else "gather_windows")
            return _original(*args)
        monkeypatch.setattr(module, name, spy)
    return seen


def _conv_all(be, x, w, b, dy, stride, padding):
    """Forward, filter gradient and data gradient, each output pre-filled with NaN (every element is written)."""
    ws: dict = {}
    y = np.full(dy.shape, np.nan, x.dtype)
    dw, dx = np.full(w.shape, np.nan, x.dtype), np.full(x.shape, np.nan, x.dtype)
    be.conv2d(x, w, y, stride, padding, ws, b)
    be.conv2d_grad_filter(x, dy, dw, stride, padding, ws)
    be.conv2d_grad_data(dy, w, dx, stride, padding, ws)
    return y, dw, dx


CONV_CASES = [  # x shape, filters, kernel, stride, padding, the kernels that take it
    ((16, 20, 12, 12), 50, 5, 1, 0, {"gather_windows", "scatter_windows"}),  # LeNet's second convolution
    ((24, 6, 11, 9), 8, 3, 2, 1, {"gather_windows", "scatter_windows"}),  # strided, padded, ragged
    ((16, 5, 10, 13), 4, (3, 2), (1, 3), 0, {"gather_windows", "scatter_windows"}),  # unequal windows and strides
    ((8, 1, 28, 28), 20, 5, 1, 0, {"gather_image_windows", "scatter_image_windows"}),  # per image (LeNet's first)
    ((4, 3, 33, 35), 6, 3, 2, 1, {"gather_image_windows", "scatter_image_windows"}),  # per image, strided, padded
    ((4, 1, 36, 12), 3, 5, 1, 0, {"gather_image_windows", "scatter_image_windows"}),  # per image, 8 columns wide
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,filters,kernel,stride,padding,kernels", CONV_CASES)
def test_column_kernels_give_numpy_passes_values(small_inputs, column_calls, monkeypatch, rng, shape, filters,
                                                 kernel, stride, padding, kernels, dtype):
    """A convolution's columns gathered, and its data gradient's columns added back, by the kernels: exactly the
    values of NumPy's passes (the same copies, the same sums in the same order), NaN in dy included, and the
    float64 loop reference's."""
    be = lp.backend("native")
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    n, c, h, wd = shape
    oh, ow = (h + 2 * padding - kh) // sh + 1, (wd + 2 * padding - kw) // sw + 1
    x = rng.standard_normal(shape).astype(dtype)
    w = rng.standard_normal((filters, c, kh, kw)).astype(dtype)
    b = rng.standard_normal(filters).astype(dtype)
    dy = rng.standard_normal((n, filters, oh, ow)).astype(dtype)
    args = ((sh, sw), (padding, padding))
    got = _conv_all(be, x, w, b, dy, *args)
    assert set(column_calls) == kernels
    with monkeypatch.context() as m:
        m.setattr(compiled, "_KERNELS", [None])
        want = _conv_all(be, x, w, b, dy, *args)
    for a, e in zip(got, want):
        np.testing.assert_array_equal(a, e)
    if (sh, sw) == (sh, sh):  # the loop reference takes one stride
        y64 = ref.conv2d(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), (sh, sw), (padding,) * 2)
        dx64, dw64, _ = ref.conv2d_backward(x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64),
                                            (sh, sw), (padding,) * 2)
        tol = 50 * np.finfo(dtype).eps
        for a, e in zip(got, (y64, dw64, dx64)):
            np.testing.assert_allclose(a, e, rtol=0, atol=tol * max(1.0, np.abs(e).max()))
    dy[0, 0, 0, 0] = np.nan  # a NaN reaches the data gradient alike
    got, want = _conv_all(be, x, w, b, dy, *args), None
    with monkeypatch.context() as m:
        m.setattr(compiled, "_KERNELS", [None])
        want = _conv_all(be, x, w, b, dy, *args)
    np.testing.assert_array_equal(got[2], want[2])
    assert np.isnan(got[2][0]).any() and not np.isnan(got[2][1:]).any()


def test_column_kernels_in_pieces_of_rows_and_of_the_batch(small_inputs, column_calls, monkeypatch, rng):
    """Columns cut into pieces of output rows (large images) and of the batch: each piece through the kernels
    (their first output row and the data gradient's running sums), exactly as NumPy's passes."""
    be = lp.backend("native")
    x = rng.standard_normal((16, 8, 14, 14)).astype(np.float32)
    w = rng.standard_normal((12, 8, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((16, 12, 7, 7)).astype(np.float32)
    results = []
    for piece, minimum in ((6 << 10, 1 << 20), (16 << 10, 2)):  # rows of a few outputs; then 4 images a piece
        monkeypatch.setattr(native.NativeBackend, "CONV_PIECE_BYTES", piece)
        monkeypatch.setattr(native.NativeBackend, "CONV_BATCH_PIECE_MIN", minimum)
        monkeypatch.setattr(compiled, "MIN_BATCH_RUN", 1)
        column_calls.clear()
        got = _conv_all(be, x, w, None, dy, (2, 2), (1, 1))
        assert column_calls.count("gather_windows") > 2 and column_calls.count("scatter_windows") > 1
        with monkeypatch.context() as m:
            m.setattr(compiled, "_KERNELS", [None])
            want = _conv_all(be, x, w, None, dy, (2, 2), (1, 1))
        for a, e in zip(got, want):
            np.testing.assert_array_equal(a, e)
        results.append(got)
    for a, e in zip(*results):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("what", ["short batch", "small", "float16", "strided input"])
def test_what_the_column_kernels_leave_to_numpy(column_calls, rng, what):
    be = lp.backend("native")
    n = 8 if what == "short batch" else 32
    x = rng.standard_normal((n, 20, 12, 12)).astype(np.float16 if what == "float16" else np.float32)
    if what == "small":  # 1 x 5 x 5 taps over 8 x 8 outputs of 32 images: 51,200 values of columns
        x = np.ascontiguousarray(x[:, :1])
    w = rng.standard_normal((50, x.shape[1], 5, 5)).astype(x.dtype)
    dy = rng.standard_normal((n, 50, 8, 8)).astype(x.dtype)
    if what == "strided input":  # the data gradient lands in a view: its own scratch, contiguous, takes the kernel
        x = np.concatenate([x, x], axis=3)[..., ::2]
    _conv_all(be, x, w, None, dy, (1, 1), (0, 0))
    if what == "strided input":
        assert column_calls == ["gather_windows", "scatter_windows"]  # NumPy copied the view in first
    else:
        assert column_calls == []
    x32 = np.ascontiguousarray(x, np.float32)  # and the same at 32 images of float32 values, contiguous: taken
    x32 = np.concatenate([x32] * (32 // n), axis=0) if n < 32 else x32
    w32, dy32 = w.astype(np.float32), np.concatenate([dy.astype(np.float32)] * (32 // n), axis=0)
    if what == "small":
        return
    column_calls.clear()
    _conv_all(be, x32, w32, None, dy32, (1, 1), (0, 0))
    assert column_calls == ["gather_windows", "scatter_windows"]


# --- update rules as one loop over the elements -------------------------------------------------------------------
HYPER = {"momentum": (0.9,), "nesterov": (0.9,), "adam": (0.9, 0.999, 1e-8), "adamw": (0.9, 0.999, 1e-8, 0.01),
         "rmsprop": (0.95, 1e-8), "adagrad": (1e-8,), "adadelta": (0.95, 1e-6)}


def _loops_run(monkeypatch) -> list[str]:
    """The rules whose loop kernel ran, by name."""
    seen: list[str] = []
    original = compiled.update_loop

    def spy(rule):
        found = original(rule)
        if found is not None:
            seen.append(rule.name)
        return found
    monkeypatch.setattr(compiled, "update_loop", spy)
    return seen


def _update_both(monkeypatch, be, kind, arrays, rate, params, lr_mult=1.5):
    """The update through the loop kernel and through the NumPy code, on copies: (loop's arrays, NumPy's)."""
    out = []
    for loop in (True, False):
        a = [x.copy() for x in arrays]
        with monkeypatch.context() as m:
            if not loop:
                m.setattr(compiled, "_KERNELS", [None])
            be.solver_update(kind, a[0], a[1], rate, lr_mult, params, **dict(zip(("s1", "s2", "s3"), a[2:])))
        out.append(a)
    return out


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", sorted(HYPER))
def test_update_loops_give_the_numpy_codes_values(monkeypatch, rng, kind, dtype):
    """Every rule of the table as one loop: the weights and history the NumPy code writes, exactly, with zeros,
    infinities, NaN and huge values among the gradients and a negative history value (a square root's NaN); a
    skipped step (rate[1] 0) writes nothing."""
    monkeypatch.setattr(compiled, "UPDATE_MIN_ELEMENTS", 0)
    be = lp.backend("native", blas="numpy", dtype=dtype)
    rule = updates.TABLE[kind]
    n = 1000
    w, g = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    g[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e30, 3.0]
    state = [np.abs(rng.standard_normal(n)).astype(dtype) for _ in rule.state]
    if state:
        state[0][9] = -1.0
    arrays = [w, g, *state]
    rate = np.array([0.01, 1.0, 0.02][:3 if kind == "adamw" else 2], dtype)
    seen = _loops_run(monkeypatch)
    looped, plain = _update_both(monkeypatch, be, kind, arrays, rate, HYPER[kind])
    assert seen == [kind]  # the loop took it; NumPy's code the other
    for name, a, b in zip(("w", "g", *rule.state), looped, plain):
        if name != "g":  # the NumPy code may use the gradient as scratch
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert not np.isnan(looped[0][8:]).all() and np.isfinite(looped[0][10:]).all()
    skipped = [x.copy() for x in arrays]
    be.solver_update(kind, skipped[0], skipped[1], np.array([0.01, 0.0, 0.02][:rate.size], dtype), 1.5,
                     HYPER[kind], **dict(zip(("s1", "s2", "s3"), skipped[2:])))
    for a, b in zip(skipped, arrays):
        np.testing.assert_array_equal(a, b)


def test_a_registered_rule_runs_as_a_loop_or_as_numpy_code(monkeypatch, rng):
    """A rule of its own: with a scalar local, a local reassigned, its state assigned twice and a buffer assigned
    a scalar, the loop gives the NumPy code's values; with an operation a loop does not take (exp), NumPy's code
    runs it."""
    monkeypatch.setattr(compiled, "UPDATE_MIN_ELEMENTS", 0)
    w_, g_, lr, h, c, d = var("w"), var("g"), var("lr"), var("h"), var("c"), var("d")
    mine = updates.Rule("mine", ("h", "k"), ("a", "b"), (
        ("c", param("a") * 2.0 + 1.0),
        ("d", sqrt(h + c) * param("b") - g_ / (2.0 + g_ * g_)),
        ("d", -d * d + c),
        ("h", h * param("b") + d),
        ("k", c),
        ("w", w_ - d * lr),
        ("h", h + 1.0),
    ))
    other = updates.Rule("other", ("h",), (), (("h", h + exp(g_)), ("w", w_ - h * lr)))
    assert updates.loop_sources(other) is None
    be = lp.backend("native", blas="numpy")
    arrays = [rng.standard_normal(500).astype(np.float32) for _ in range(4)]
    arrays[2] = np.abs(arrays[2])
    for rule in (mine, other):
        updates.register(rule)
        try:
            looped, plain = _update_both(monkeypatch, be, rule.name, arrays[:2 + len(rule.state)],
                                         np.array([0.05, 1.0], np.float32), (0.3, 0.8)[:len(rule.params)])
        finally:
            del updates.TABLE[rule.name]
        for a, b in zip(looped[:1] + looped[2:], plain[:1] + plain[2:]):
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(looped[0], arrays[0])
    assert compiled.update_loop(mine) is not None and compiled.update_loop(other) is None


def test_numpy_float64_hyper_parameters_keep_the_numpy_code(monkeypatch, rng):
    """NumPy multiplies float32 arrays by a NumPy float64 in float64 before it rounds; the loop rounds its scalars
    first. A hyper-parameter or lr_mult given as a NumPy float64 (a custom rule's call) therefore keeps NumPy's
    code, and its values."""
    monkeypatch.setattr(compiled, "UPDATE_MIN_ELEMENTS", 0)
    seen = _loops_run(monkeypatch)
    be = lp.backend("native", blas="numpy")
    arrays = [rng.standard_normal(4096).astype(np.float32) for _ in range(3)]
    rate = np.array([0.01, 1.0], np.float32)
    for lr_mult, params in ((1.5, (np.float64(0.9),)), (np.float64(1.5), (0.9,))):
        looped, plain = _update_both(monkeypatch, be, "nesterov", arrays + [arrays[2] * 2], rate, params, lr_mult)
        assert seen == []
        for a, b in zip(looped[:1] + looped[2:], plain[:1] + plain[2:]):
            np.testing.assert_array_equal(a, b)
    _update_both(monkeypatch, be, "nesterov", arrays + [arrays[2] * 2], rate, (0.9,), 1.5)
    assert seen == ["nesterov"]  # Python numbers: the loop


def test_update_loops_are_cached_between_processes(tmp_path):
    """A rule's loop is compiled through a module file in LEAFPY_CACHE_DIR, with numba's cache: a second process
    loads its machine code (a cache hit, no compilation); a module file changed on disk is written again before it
    is imported; a cache folder that cannot be written leaves the loop compiled in the process, still right."""
    probe = """
import numpy as np
from leafpy.backends import compiled, updates
loop = compiled.update_loop(updates.TABLE["adam"])
w = np.linspace(-1, 1, 300, dtype=np.float32)
g, m, v = np.cos(w), np.sin(w), w * w
loop[1](loop[0](np.array([0.01, 1.0], np.float32), 1.0, (0.9, 0.999, 1e-8), w.dtype), w, g, m, v)
stats = getattr(loop[1], "stats", None)
print("hits", sum(stats.cache_hits.values()), "misses", sum(stats.cache_misses.values()), "path", stats.cache_path)
print("w", w.tobytes().hex()[:64])
"""

    def run(folder):
        env = {**os.environ, "LEAFPY_CACHE_DIR": str(folder), "LEAFPY_COMPILED": "1"}
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.split("\n")

    first = run(tmp_path / "cache")
    modules = list((tmp_path / "cache" / "update_loops").glob("loop_*.py"))
    assert len(modules) == 1 and "def kernel(consts, w, g, m, v):" in modules[0].read_text()
    assert first[0].startswith("hits 0 misses 1 path ") and str(tmp_path / "cache") in first[0]
    second = run(tmp_path / "cache")
    assert second[0].startswith("hits 1 misses 0 ") and second[1] == first[1]
    text = modules[0].read_text()
    modules[0].write_text(text.replace("for i in range(w.size):", "for i in range(1):"))  # changed on disk
    third = run(tmp_path / "cache")
    assert modules[0].read_text() == text and third[1] == first[1]
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    fourth = run(blocked)  # the folder cannot be made: compiled here only, without a cache
    assert fourth[0] == "hits 0 misses 1 path None" and fourth[1] == first[1]


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("what", ["small", "float16", "strided", "another dtype"])
def test_what_the_update_loops_leave_to_numpy(monkeypatch, rng, what):
    seen = _loops_run(monkeypatch)
    be = lp.backend("native", blas="numpy")
    n = compiled.UPDATE_MIN_ELEMENTS
    dtype = np.float16 if what == "float16" else np.float32
    w, g, m, v = (rng.standard_normal(2 * n if what == "strided" else n).astype(dtype) for _ in range(4))
    if what == "small":
        w, g, m, v = w[:n - 1], g[:n - 1], m[:n - 1], v[:n - 1]
    elif what == "strided":
        w, g, m, v = w[::2], g[::2], m[::2], v[::2]
    elif what == "another dtype":
        v = v.astype(np.float64)
    rate = np.array([0.01, 1.0], np.float32)
    if what in ("small", "float16"):  # (strided arrays and mixed dtypes are no update's operands: the loop refuses)
        be.solver_update("adam", w, g, rate, 1.0, HYPER["adam"], s1=m, s2=v)
        assert seen == []
    assert not compiled.update_case(w, g, (m, v), 1.0, HYPER["adam"])
    w32, g32, m32, v32 = (np.ascontiguousarray(a, np.float32) for a in (w, g, m, v))  # and at the floor: taken
    if what == "small":
        w32, g32, m32, v32 = (np.concatenate([a, a[:1]]) for a in (w32, g32, m32, v32))
    be.solver_update("adam", w32, g32, rate, 1.0, HYPER["adam"], s1=m32, s2=v32)
    assert seen == ["adam"]


# --- fused calls of a recorded step -----------------------------------------------------------------------------------
def _kernel_names(be) -> list[str]:
    names = []
    for entry in be.recorder.steps.values():
        for fn, _, _ in entry.recording or []:
            names.append(getattr(fn, "py_func", fn).__name__)
    return names


def test_an_mlp_trains_alike_with_its_linear_and_relu_calls_fused(monkeypatch):
    """MLP-128's replayed steps join each Linear's bias with its ReLU, each ReLU's gradient with the bias gradient
    of the Linear before it, and the loss's four calls: the same losses and weights as the separate calls, over
    every update rule."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import train_step as ts
    make, batch, shape, classes = ts.NETWORKS["mlp128"]
    rng = np.random.default_rng(0)
    data = [(lp.SharedTensor.from_numpy(rng.random((batch, *shape), dtype=np.float32)),
             lp.SharedTensor.from_numpy(rng.integers(0, classes, (batch, 1)).astype(np.float32))) for _ in range(3)]
    be = lp.backend("native")
    for rule in ("momentum", "adam"):
        results = []
        for kernels in (None, compiled.kernels()):
            monkeypatch.setattr(compiled, "_KERNELS", [kernels])
            be.recorder.forget()
            solver = ts.leafpy_solver(be, make(), batch, classes, rule)
            losses = []
            for i in range(8):
                solver.train_minibatch(*data[i % 3])
                losses.append(solver.loss())
            names = _kernel_names(be)
            results.append((losses, [w.to_numpy() for w in solver.network.learnable_weights_data()], names))
        (losses0, weights0, names0), (losses1, weights1, names1) = results
        assert "bias_relu" not in names0 and names1.count("bias_relu") >= 2 and names1.count("relu_grad_bias") >= 2
        assert "loss_head" not in names0 and names1.count("loss_head") >= 1
        assert names1.count("bias_grad") == names0.count("bias_grad") - names1.count("relu_grad_bias")
        np.testing.assert_allclose(losses1, losses0, rtol=1e-6)
        for a, b in zip(weights1, weights0):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_fusion_that_fails_leaves_the_recorded_calls_and_each_step_runs_once(monkeypatch):
    """Where joining a recorded step's calls raises, the step (which has run while it was recorded) keeps its calls
    as recorded and is never run a second time: the same losses as steps that are never recorded."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import train_step as ts
    make, batch, shape, classes = ts.NETWORKS["mlp128"]
    rng = np.random.default_rng(1)
    data = [(rng.random((batch, *shape), dtype=np.float32), rng.integers(0, classes, (batch, 1)).astype(np.float32))
            for _ in range(3)]

    def broken(calls, primitives):
        raise RuntimeError("a fusion that fails")
    runs = []
    be = lp.backend("native")
    monkeypatch.setattr(compiled, "fuse", broken)
    for replay in (True, False):
        monkeypatch.setattr(be, "replay", replay)
        before = be.recorder.replays
        solver = ts.leafpy_solver(be, make(), batch, classes, "momentum")
        losses = []
        for i in range(5):
            solver.train_minibatch(*data[i % 3])
            losses.append(solver.loss())
        runs.append((losses, be.recorder.replays - before))
    assert runs[0][0] == runs[1][0] and runs[0][1] >= 2 and runs[1][1] == 0


def _calls(be, a, *, kind="relu", relu_in="y", between="product", beta=0.0, grad_of="dx", out="z", grad_into="dx"):
    """A forward pattern (bias_add, activation) and a backward one (activation_grad, a product, bias_grad) over the
    arrays ``a``, with one thing changed by the keywords."""
    gemm_out = {"product": "dw", "writes db": "db2", "writes dx": "dx", "reads db": "dw"}[between]
    gemm_in = a["db2"] if between == "reads db" else a["x"]
    op = {name: fn.__get__(be) for name, fn in native.FUSABLE.items()}  # as a recording holds them
    return [
        (op["bias_add"], (a["y"], a["b"]), {}),
        (op["activation"], (kind, a[relu_in], a[out], ()), {}),
        (op["activation_grad"], (kind, a[out], a["dz"], a[grad_into], ()), {}),
        (op["gemm"], (a[grad_into], True, gemm_in, False, a[gemm_out], 1.0, 0.0), {}),
        (op["bias_grad"], (a[grad_of if grad_of != "dx" else grad_into], a["db"], beta), {}),
    ]


def _arrays(rng, n=256, c=512, dtype=np.float32):
    a = {k: rng.standard_normal((n, c)).astype(dtype) for k in ("y", "z", "dz", "dx", "other")}
    a["x"] = rng.standard_normal((n, 8)).astype(dtype)
    a["dw"] = np.zeros((c, 8), dtype)
    a["b"], a["db"] = rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)
    a["db2"] = a["db"][:8].reshape(1, 8) if c >= 8 else np.zeros((1, 8), dtype)  # a view of db, for a product
    return a


def _run(calls):
    for fn, args, kwargs in calls:
        fn(*args, **kwargs)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("in_place", [False, True])
def test_fused_calls_compute_what_the_calls_they_replace_computed(rng, dtype, beta, in_place):
    """The joined calls write the same values (in place: the ReLU over its input, the gradient over dy, as the
    layers run them when they may)."""
    be = lp.backend("native")
    a = _arrays(rng, dtype=dtype)
    a["y"][::3] = -np.abs(a["y"][::3])  # negative, zero and positive sums with the bias
    a["y"][5, :7] = -a["b"][:7]
    a["z"][::2] = 0
    a["dz"][0, 0] = np.nan
    where = {"out": "y", "grad_into": "dz"} if in_place else {}
    b = {k: v.copy() for k, v in a.items()}
    fused = compiled.fuse(_calls(be, b, beta=beta, **where), native.FUSABLE)
    assert [getattr(f, "py_func", f).__name__ for f, _, _ in fused] == ["bias_relu", "relu_grad_bias", "gemm"]
    _run(_calls(be, a, beta=beta, **where))
    _run(fused)
    for k in ("y", "z", "dz", "dx", "dw", "db"):
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)


class _Subclass(native.NativeBackend):
    def bias_add(self, y, b):  # another meaning of the name: never replaced by a kernel
        y -= b


@pytest.mark.parametrize("change", [{"kind": "leaky_relu"}, {"relu_in": "other"}, {"between": "writes db"},
                                    {"between": "writes dx"}, {"between": "reads db"}, {"grad_of": "other"}, "small",
                                    "small before numba is loaded",
                                    "one column", "numpy beta", "subclass", "overlapping z", "overlapping dx"])
def test_calls_that_cannot_be_joined_stay_apart(monkeypatch, rng, change):
    """Each change keeps one pattern (or both) as recorded; the lists are only inspected, never run. Small: under
    LOADED_FUSE_MIN_ELEMENTS (2,048 values), or under FUSE_MIN_ELEMENTS (32,768) while numba is not loaded (it
    stays so)."""
    be = lp.backend("native")
    if change == "small before numba is loaded":
        monkeypatch.setattr(compiled, "_KERNELS", [])
    rows = {"small": 4, "small before numba is loaded": 64, "one column": 1 << 17}.get(str(change), 256)
    a = _arrays(rng, n=rows, c=1 if change == "one column" else 512)
    if isinstance(change, str) and change.startswith("overlapping"):  # a row apart in one buffer
        whole = rng.standard_normal((257, 512)).astype(np.float32)
        first, second = ("y", "z") if change == "overlapping z" else ("dz", "dx")
        a[first], a[second] = whole[:256], whole[1:]
    calls = _calls(be, a, **(change if isinstance(change, dict) else {}))
    if change == "numpy beta":  # NumPy would multiply db by it in float64
        calls[-1] = (calls[-1][0], (*calls[-1][1][:2], np.float64(0.9)), {})
    if change == "subclass":
        calls[0] = (_Subclass.bias_add.__wrapped__.__get__(be), calls[0][1], {})
    fused = compiled.fuse(calls, native.FUSABLE)
    names = [getattr(f, "py_func", f).__name__ for f, _, _ in fused]
    if change in ("numpy beta", "one column", "overlapping dx"):
        assert names[0] == "bias_relu" and names[1:] == ["activation_grad", "gemm", "bias_grad"]
    elif change == "overlapping z":
        assert names[:2] == ["bias_add", "activation"] and names[2] == "relu_grad_bias"
    elif change == "subclass":
        assert names[:2] == ["bias_add", "activation"] and names[2] == "relu_grad_bias"
    elif change in ("small", "small before numba is loaded") or "kind" in change:
        assert names == [f.__name__ for f, _, _ in calls]
        if change == "small before numba is loaded":
            assert compiled._KERNELS == []
    elif "relu_in" in change:
        assert names[:2] == ["bias_add", "activation"] and "relu_grad_bias" in names
    else:
        assert names[0] == "bias_relu" and names[1:] == ["activation_grad", "gemm", "bias_grad"]


# --- a classifier's loss as one call ------------------------------------------------------------------------------
def _head_calls(be, a, *, reduction="mean", in_place=False, weight=(), ignore_index=None, labels="labels"):
    """What a replayed step records for LogSoftmax + NegativeLogLikelihood (``in_place``: the loss's own
    log-softmax, its gradient written over the NLL's), as the recording holds the calls."""
    op = {name: fn.__get__(be) for name, fn in native.FUSABLE.items()}
    options = dict(weight=weight, ignore_index=ignore_index, reduction=reduction)
    dx2 = a["dx"] if in_place else a["dx2"]
    return [(op["log_softmax"], (a["x"], a["o"]), {}),
            (op["nll"], (a["o"], a[labels], a["loss"]), options),
            (op["nll_grad"], (a[labels], a["dloss"], a["dx"]), options),
            (op["log_softmax_grad"], (a["o"], a["dx"], dx2), {})]


def _head_arrays(rng, n, c, dtype=np.float32):
    a = {"x": (rng.standard_normal((n, c)) * 5).astype(dtype)}
    for k in ("o", "dx", "dx2"):
        a[k] = rng.standard_normal((n, c)).astype(dtype)
    a["labels"] = rng.integers(0, c, (n, 1)).astype(np.float32)
    a["loss"], a["dloss"] = np.zeros(1, dtype), np.array([rng.uniform(0.5, 2)], dtype)
    return a


def _same_bits(a, b, what):
    """Equal, a zero's sign included (NaN where NaN: its sign bit means nothing, and NumPy's -1 * NaN keeps it where
    compiled code may flip it)."""
    np.testing.assert_array_equal(a, b, err_msg=what)
    finite = ~np.isnan(a)
    np.testing.assert_array_equal(np.signbit(a[finite]), np.signbit(b[finite]), err_msg=f"{what}: the signs")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,c", [(1, 1), (3, 2), (128, 10), (129, 7), (300, 130), (1030, 3)])
@pytest.mark.parametrize("reduction,in_place", [("mean", False), ("sum", False), ("mean", True)])
def test_the_loss_as_one_call_computes_what_its_four_calls_computed(rng, dtype, n, c, reduction, in_place):
    """log_softmax, nll, nll_grad and log_softmax_grad joined: the same bits in the log-probabilities, the loss and
    both gradients, with the sums in NumPy's pairwise order (rows and batches under and over 128 values), logits
    that overflow exp, a NaN and an infinity."""
    be = lp.backend("native")
    compiled.kernels()
    a = _head_arrays(rng, n, c, dtype)
    a["x"][0, 0] = 90.0  # exp overflows float32 without the shift
    if n > 2 and c > 1:
        a["x"][1, 1] = np.nan
        a["x"][2, 0] = -np.inf
    b = {k: v.copy() for k, v in a.items()}
    fused = compiled.fuse(_head_calls(be, b, reduction=reduction, in_place=in_place), native.FUSABLE)
    assert len(fused) == 1 and fused[0][0].__name__ == "loss_head"
    _run(_head_calls(be, a, reduction=reduction, in_place=in_place))
    for step in range(2):  # twice: a replay runs it again on the same arrays, with the next batch's values
        if step:
            a["x"][...] = b["x"][...] = (rng.standard_normal((n, c)) * 3).astype(dtype)
            a["labels"][...] = b["labels"][...] = rng.integers(0, c, (n, 1))
            _run(_head_calls(be, a, reduction=reduction, in_place=in_place))
        _run(fused)
        for k in ("o", "loss", "dx", "dx2"):
            _same_bits(b[k], a[k], f"{k}, run {step + 1}")
    x = a["x"].astype(np.float64)  # and what they mean, in float64
    logp = x - x.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    picks = -logp[np.arange(n), a["labels"].reshape(-1).astype(int)]
    np.testing.assert_allclose(b["o"], logp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b["loss"][0], picks.mean() if reduction == "mean" else picks.sum(), rtol=1e-5)


def test_a_label_that_is_no_class_index_runs_the_four_calls_and_their_error(rng):
    """A replayed loss whose labels went bad since it was recorded (-1, C, 2.5 would index NumPy's way) runs the
    recorded calls, so it ends as they end; the arrays are left as they would have left them."""
    be = lp.backend("native")
    compiled.kernels()
    a = _head_arrays(rng, 16, 5)
    b = {k: v.copy() for k, v in a.items()}
    fused = compiled.fuse(_head_calls(be, b), native.FUSABLE)
    assert fused[0][0].__name__ == "loss_head"
    for bad in (5.0, 7.0):  # past the classes: NumPy's indexing raises
        a["labels"][3] = b["labels"][3] = bad
        with pytest.raises(IndexError):
            _run(_head_calls(be, a))
        with pytest.raises(IndexError):
            _run(fused)
    for bad in (-1.0, 2.5):  # NumPy takes these (the last class, class 2): the calls' values
        a["labels"][3] = b["labels"][3] = bad
        _run(_head_calls(be, a))
        _run(fused)
        for k in ("o", "loss", "dx", "dx2"):
            _same_bits(b[k], a[k], f"{k} with a label {bad}")


@pytest.mark.parametrize("change", ["class weights", "ignore_index", "reduction none", "other labels",
                                    "labels before numba is loaded", "labels in the loss's buffer"])
def test_losses_the_one_call_does_not_take_keep_their_calls(monkeypatch, rng, change):
    be = lp.backend("native")
    a = _head_arrays(rng, 64, 10)
    a["other"] = a["labels"].copy()
    options = {"class weights": dict(weight=tuple(range(1, 11))), "ignore_index": dict(ignore_index=3),
               "reduction none": dict(reduction="none")}.get(change, {})
    if change == "reduction none":
        a["loss"] = np.zeros((64, 1), np.float32)
    calls = _head_calls(be, a, **options)
    if change == "other labels":
        calls[2] = (calls[2][0], (a["other"], *calls[2][1][1:]), calls[2][2])
    if change == "labels before numba is loaded":  # 640 logits: too few to import numba for
        monkeypatch.setattr(compiled, "_KERNELS", [])
    if change == "labels in the loss's buffer":  # read as indices after the loss is written: NumPy's calls raise
        compiled.kernels()
        a = _head_arrays(rng, 1, 10)
        a["labels"] = a["loss"]
        calls = _head_calls(be, a)
    fused = compiled.fuse(calls, native.FUSABLE)
    assert [getattr(f, "__name__", "") for f, _, _ in fused] == [f.__name__ for f, _, _ in calls]
    if change == "labels before numba is loaded":
        assert compiled._KERNELS == []


def test_a_resumed_command_run_with_the_loss_as_one_call_equals_the_uninterrupted_run(tmp_path):
    """The run of ``test_the_leafpy_command_trains_alike_with_leafpy_compiled_0`` (its poolings load the kernels, so
    replayed steps take the loss as one call; its first step after a resume is recorded, so it runs the four
    calls): two epochs straight, and one epoch then a resume to two, give the same weights, bit for bit. 12 outputs
    (two of them classes), so each row's sums take NumPy's pairwise order."""
    brighter_half_npz(tmp_path / "data.npz", 256, 24)
    (tmp_path / "net.yaml").write_text(run_file(
        [layer("conv1", "Convolution", num_output=16, filter_shape=[3], padding=[1]),
         layer("pool1", "Pooling", mode="max", filter_shape=[2], stride=[2]), layer("flat", "Flatten"),
         layer("fc", "Linear", output_size=12), layer("logsm", "LogSoftmax")], [1, 24, 24],
        data={"dataset": "npz", "path": str(tmp_path / "data.npz"), "batch_size": 48, "test_fraction": 0.25,
              "seed": 0},
        solver={"solver": "momentum", "base_lr": 0.05, "momentum": 0.9, "seed": 0}, train={"epochs": 2},
        name="pools"))
    train_history(tmp_path / "net.yaml", tmp_path / "whole", "--epochs", "2")
    train_history(tmp_path / "net.yaml", tmp_path / "cut", "--epochs", "1")
    train_history(tmp_path / "net.yaml", tmp_path / "cut", "--epochs", "2", "--resume",
                  str(tmp_path / "cut" / "checkpoint.leaf"))
    whole, cut = (lp.Layer.load(lp.backend("native"), str(tmp_path / d / "model.leaf")) for d in ("whole", "cut"))
    for a, b in zip(whole.learnable_weights_data(), cut.learnable_weights_data()):
        np.testing.assert_array_equal(a.to_numpy(), b.to_numpy())


def test_threads_reaching_a_rules_first_update_together_share_one_built_loop(monkeypatch, tmp_path):
    """Threads each training a solver of their own reach an update rule's first large update together: one builds
    its loop, the others wait for it (a second thread found the module half made, with no kernel yet, and raised
    an AttributeError); every thread gets the same kernel."""
    import threading
    import time

    monkeypatch.setenv("LEAFPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "_LOOPS", {})
    built = []
    make = compiled._cached_kernel

    def slow(source):  # the window in which a second thread met the half-made module, widened
        built.append(source)
        time.sleep(0.3)
        return make(source)

    monkeypatch.setattr(compiled, "_cached_kernel", slow)
    rule = updates.TABLE["adamw"]
    got, errors = [], []
    barrier = threading.Barrier(4)

    def first_update():
        barrier.wait()
        try:
            got.append(compiled.update_loop(rule))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=first_update) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(built) == 1
    assert len(got) == 4 and all(g is got[0] for g in got) and got[0][1] is not None
