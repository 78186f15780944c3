"""The native backend's compiled max pooling (numba): the same outputs, argmax positions and gradients as NumPy's
passes and as a float64 loop reference, on every case it takes, with ties, NaN and dx's old contents; what it
leaves to NumPy; a LeNet trained with and without it; the switch through the ``leafpy`` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import reference as ref

import leafpy as lp
from leafpy.backends import compiled

pytest.importorskip("numba")


@pytest.fixture
def small_inputs(monkeypatch):
    """The kernels take inputs of any size (the size floor only keeps numba's import away from small models)."""
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", 0)


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
    ((2, 5, 13, 13), (3, 3), (2, 2), "windows"),  # overlapping windows (AlexNet's)
    ((1, 2, 11, 10), (3, 2), (3, 3), "windows"),  # gaps between windows
    ((2, 2, 7, 9), (1, 4), (1, 2), "windows"),
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
    # overlapping windows add an input's gradients in another order: a few roundings of the largest |dy|
    atol = 4 * np.finfo(dtype).eps * np.nanmax(np.abs(dy))
    np.testing.assert_allclose(dx, want_dx, rtol=0, atol=atol)
    np.testing.assert_array_equal(np.isnan(dx), np.isnan(want_dx))
    if values != "nan" and kernel[0] == kernel[1] and stride[0] == stride[1]:  # the float64 loop reference
        ref_out, arg = ref.maxpool(x.astype(np.float64), kernel[0], stride[0])
        np.testing.assert_array_equal(out, ref_out)
        np.testing.assert_allclose(dx, ref.maxpool_backward(shape, arg, dy.astype(np.float64)), rtol=0, atol=atol)


@pytest.mark.parametrize("what", ["average", "padding", "float16", "strided view", "small"])
def test_what_the_kernels_leave_to_numpy(calls, rng, what):
    be = lp.backend("native")
    x = rng.standard_normal((4, 16, 32, 32)).astype(np.float32)  # 65536 elements: the floor
    mode, padding = "max", (0, 0)
    if what == "average":
        mode = "average"
    elif what == "padding":
        padding = (1, 1)
    elif what == "float16":
        x = x.astype(np.float16)
    elif what == "strided view":
        x = np.ascontiguousarray(np.concatenate([x, x], axis=3))[:, :, :, ::2]
    elif what == "small":
        x = x[:, :, :16]
    oh = (x.shape[2] + 2 * padding[0] - 2) // 2 + 1
    ow = (x.shape[3] + 2 * padding[1] - 2) // 2 + 1
    out, mask = np.empty((4, 16, oh, ow), x.dtype), np.empty((4, 16, oh, ow), np.int32)
    be.pool2d(x, out, mask, mode, (2, 2), (2, 2), padding)
    assert calls == []
    x.reshape(-1)[0] = 0  # and at the floor, contiguous float32, it is taken
    x32 = np.ascontiguousarray(x, np.float32)
    if what in ("float16", "strided view"):
        out = np.empty(out.shape, np.float32)
        be.pool2d(x32, out, mask, "max", (2, 2), (2, 2), (0, 0))
        assert calls == ["max_pool:2x2"]


def test_a_lenet_trains_alike_with_and_without_the_kernels(monkeypatch):
    """Ten steps of LeNet-64 on 28x28 inputs (its poolings over 737,280 and 204,800 values, so the kernels run):
    the same losses and weights as through NumPy's passes."""
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
    np.testing.assert_allclose(losses1, losses0, rtol=1e-6)
    assert losses1[-1] < losses1[0]
    for a, b in zip(weights1, weights0):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_leafpy_command_trains_alike_with_leafpy_compiled_0(tmp_path):
    """A user's run on 24x24 images (the poolings large enough for the kernels) and the same run with
    LEAFPY_COMPILED=0: the same loss, read from the command's own metrics file."""
    rng = np.random.default_rng(0)
    x = rng.random((256, 1, 24, 24), dtype=np.float32)
    y = (x[:, 0, :12].mean(axis=(1, 2)) > x[:, 0, 12:].mean(axis=(1, 2))).astype(np.int64)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    (tmp_path / "net.yaml").write_text(f"""
name: pools
data: {{dataset: npz, path: {tmp_path / 'data.npz'}, batch_size: 64, test_fraction: 0.25, seed: 0}}
train: {{epochs: 2}}
network:
  type: Sequential
  inputs: [{{name: data, shape: [null, 1, 24, 24]}}]
  layers:
    - {{name: conv1, type: Convolution, num_output: 16, filter_shape: [3], padding: [1]}}
    - {{name: pool1, type: Pooling, mode: max, filter_shape: [2], stride: [2]}}
    - {{name: pool2, type: Pooling, mode: max, filter_shape: [3], stride: [2]}}
    - {{name: flat, type: Flatten}}
    - {{name: fc, type: Linear, output_size: 2}}
    - {{name: logsm, type: LogSoftmax}}
objective: nll
solver: {{solver: momentum, base_lr: 0.05, momentum: 0.9, seed: 0}}
""")
    finals = []
    for flag in ("1", "0"):
        out = tmp_path / f"run{flag}"
        env = {**os.environ, "LEAFPY_COMPILED": flag}
        subprocess.run([sys.executable, "-m", "leafpy.cli", "train", str(tmp_path / "net.yaml"), "--backend",
                        "native", "--out", str(out)], env=env, check=True, capture_output=True, timeout=300)
        history = json.loads((out / "history.json").read_text())
        finals.append([(e["loss"], e["test_loss"]) for e in history])
    assert len(finals[0]) == 2 and np.isfinite(finals[0]).all()
    np.testing.assert_allclose(finals[0], finals[1], rtol=1e-6)
