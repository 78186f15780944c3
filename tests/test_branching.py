"""Branching networks: a blob read by several layers (named inputs and outputs) receives the sum of their
gradients. Checked against a hand-written float64 NumPy network, by central differences, and on the device
backends against native."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import child_env
from gradcheck import check_layer_gradients
from test_backends import close, device  # noqa: F401  (device: the cuda and webgpu fixture)

import leafpy as lp


def branching_config(force_backward: bool = True) -> lp.SequentialConfig:
    """x -> fc1 -> relu -> {fc2, fc3} -> sum(0.5 * fc2, -2 * fc3) + h (a skip from relu) -> fc4."""
    cfg = lp.SequentialConfig(inputs=[("x", [3, 4])], force_backward=force_backward)
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=5)))
    cfg.add_layer(lp.LayerConfig("relu", "ReLU", outputs=["h"]))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=5), inputs=["h"], outputs=["a"]))
    cfg.add_layer(lp.LayerConfig("fc3", lp.LinearConfig(output_size=5), inputs=["h"], outputs=["b"]))
    cfg.add_layer(lp.LayerConfig("sum", lp.EltwiseConfig(operation="sum", coeff=[0.5, -2.0, 1.0]),
                                 inputs=["a", "b", "h"], outputs=["s"]))
    cfg.add_layer(lp.LayerConfig("fc4", lp.LinearConfig(output_size=2), inputs=["s"]))
    return cfg


def numpy_reference(x, w, dout):
    """Forward and backward of branching_config in float64, written out by hand."""
    w1, b1, w2, b2, w3, b3, w4, b4 = w
    z1 = x @ w1.T + b1
    h = np.maximum(z1, 0)
    a = h @ w2.T + b2
    b = h @ w3.T + b3
    s = 0.5 * a - 2.0 * b + h
    y = s @ w4.T + b4
    ds = dout @ w4
    da, db = 0.5 * ds, -2.0 * ds
    dh = da @ w2 + db @ w3 + ds  # three readers of h: their gradients add up
    dz1 = dh * (z1 > 0)
    grads = [dz1.T @ x, dz1.sum(0), da.T @ h, da.sum(0), db.T @ h, db.sum(0), dout.T @ s, dout.sum(0)]
    return y, dz1 @ w1, grads


def test_fan_out_sums_gradients_as_numpy(native64):
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", branching_config()), seed=2)
    rng = np.random.default_rng(0)
    for w in net.learnable_weights_data():  # biases too, so every path carries a signal
        w.set(rng.standard_normal(w.shape))
    x = rng.standard_normal((3, 4))
    dout = rng.standard_normal((3, 2))
    y = net.forward([x])[0].to_numpy()
    dx = net.backward([dout])[0].to_numpy()
    y_ref, dx_ref, g_ref = numpy_reference(x, [w.to_numpy() for w in net.learnable_weights_data()], dout)
    np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-10, atol=1e-12)
    for name, g, ref in zip(net.learnable_weights_names(), net.learnable_weights_gradients(), g_ref):
        np.testing.assert_allclose(g.to_numpy(), ref, rtol=1e-10, atol=1e-12, err_msg=name)


def test_fan_out_gradient_check(native64):
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", branching_config()), seed=4)
    x = np.random.default_rng(1).standard_normal((3, 4))
    assert check_layer_gradients(net, [x]) == x.size + sum(w.size for w in net.learnable_weights_data())


def test_an_input_read_by_several_layers_gets_the_summed_gradient(native64):
    """The container's input feeds two layers, and one layer reads the same blob twice."""
    cfg = lp.SequentialConfig(inputs=[("x", [2, 3])], force_backward=True)
    cfg.add_layer(lp.LayerConfig("sq", lp.EltwiseConfig(operation="prod"), inputs=["x", "x"], outputs=["q"]))
    cfg.add_layer(lp.LayerConfig("tanh", "TanH", inputs=["x"], outputs=["t"]))
    cfg.add_layer(lp.LayerConfig("max", lp.EltwiseConfig(operation="max"), inputs=["q", "t"]))
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", cfg))
    x = np.array([[0.3, -1.2, 0.8], [2.0, -0.1, 0.05]])
    dout = np.array([[1.0, 2.0, -1.0], [0.5, 3.0, 4.0]])
    y = net.forward([x])[0].to_numpy()
    dx = net.backward([dout])[0].to_numpy()
    q, t = x * x, np.tanh(x)
    np.testing.assert_allclose(y, np.maximum(q, t), rtol=1e-12)
    ref = np.where(q >= t, dout * 2 * x, dout * (1 - t * t))
    np.testing.assert_allclose(dx, ref, rtol=1e-12)


def test_a_branch_is_not_overwritten_in_place(native64):
    """ReLU may run in place only on a blob nobody else reads: here fc1's output is read by both branches."""
    cfg = lp.SequentialConfig(inputs=[("x", [2, 3])])
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=3), outputs=["z"]))
    cfg.add_layer(lp.LayerConfig("relu", "ReLU", inputs=["z"], outputs=["r"]))
    cfg.add_layer(lp.LayerConfig("sum", lp.EltwiseConfig(), inputs=["z", "r"]))
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", cfg))
    w, b = net.learnable_weights_data()
    w.set(np.eye(3))
    b.set(np.zeros(3))
    x = np.array([[1.0, -2.0, 3.0], [-0.5, 0.25, -4.0]])
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), x + np.maximum(x, 0), rtol=1e-12)


def _cut_branch_config(dead_end: bool) -> lp.SequentialConfig:
    """data -> fc0 -> a; a -> fc1 -> h -> fc2 -> g -> fc3 (propagate_down False: g gets no gradient) -> out;
    a -> fc4 -> p -> fc5 -> q; concat(out, q). ``dead_end``: also a -> fc6 -> d, read by no layer."""
    L = lp.LayerConfig
    cfg = lp.SequentialConfig(inputs=[("data", [4, 3])], force_backward=True)
    cfg.add_layer(L("fc0", lp.LinearConfig(output_size=3), inputs=["data"], outputs=["a"]))
    cfg.add_layer(L("fc1", lp.LinearConfig(output_size=3), inputs=["a"], outputs=["h"]))
    cfg.add_layer(L("fc2", lp.LinearConfig(output_size=3), inputs=["h"], outputs=["g"]))
    cfg.add_layer(L("fc3", lp.LinearConfig(output_size=3), inputs=["g"], outputs=["out"], propagate_down=[False]))
    if dead_end:
        cfg.add_layer(L("fc6", lp.LinearConfig(output_size=3), inputs=["a"], outputs=["d"]))
    cfg.add_layer(L("fc4", lp.LinearConfig(output_size=3), inputs=["a"], outputs=["p"]))
    cfg.add_layer(L("fc5", lp.LinearConfig(output_size=3), inputs=["p"], outputs=["q"]))
    cfg.add_layer(L("cat", lp.ConcatConfig(axis=1), inputs=["out", "q"]))
    return cfg


@pytest.mark.parametrize("dead_end", [False, True])
def test_a_branch_cut_off_from_the_output_runs_no_backward_pass(native64, dead_end):
    """Layers whose outputs lead to the network's output only through a propagate_down: False (or nowhere) get
    no gradient and pass none on: the layers before them see only the gradients of the paths that reach the
    output (a cut-off layer that ran anyway read a gradient buffer no layer wrote that step, shared with another
    blob's gradient). Against float64 NumPy by hand, over two steps with other gradients."""
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", _cut_branch_config(dead_end)), seed=0)
    rng = np.random.default_rng(1)
    for w in net.learnable_weights_data():
        w.set(rng.standard_normal(w.shape))
    W = net.named_weights()
    lin = {n: (lambda v, n=n: v @ W[f"{n}/weight"].T + W[f"{n}/bias"]) for n in ("fc0", "fc1", "fc2", "fc3", "fc4",
                                                                                "fc5", "fc6")}
    for _ in range(2):
        x, dy = rng.standard_normal((4, 3)), rng.standard_normal((4, 6))
        y = net.forward([x])[0].to_numpy()
        dx = net.backward([dy])[0].to_numpy()
        grads = dict(zip(net.learnable_weights_names(), (g.to_numpy() for g in net.learnable_weights_gradients())))
        a = lin["fc0"](x)
        g = lin["fc2"](lin["fc1"](a))
        p = lin["fc4"](a)
        np.testing.assert_allclose(y, np.concatenate([lin["fc3"](g), lin["fc5"](p)], 1), rtol=1e-12, atol=1e-12)
        dq = dy[:, 3:]
        dp = dq @ W["fc5/weight"]
        da = dp @ W["fc4/weight"]  # fc1's path is cut: nothing of it reaches a
        expected = {"fc3": (dy[:, :3].T @ g, dy[:, :3].sum(0)), "fc5": (dq.T @ p, dq.sum(0)),
                    "fc4": (dp.T @ a, dp.sum(0)), "fc0": (da.T @ x, da.sum(0))}
        for name in ("fc0", "fc1", "fc2", "fc3", "fc4", "fc5") + (("fc6",) if dead_end else ()):
            want_w, want_b = expected.get(name, (np.zeros((3, 3)), np.zeros(3)))
            np.testing.assert_allclose(grads[f"{name}/weight"], want_w, rtol=1e-10, atol=1e-12, err_msg=name)
            np.testing.assert_allclose(grads[f"{name}/bias"], want_b, rtol=1e-10, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(dx, da @ W["fc0/weight"], rtol=1e-10, atol=1e-12)


def test_a_cut_inside_a_nested_container_stops_the_layers_before_it_too(native64):
    """data -> fc0 -> inner [fc1 -> fc2 (propagate_down False)] -> fc3: no gradient reaches fc0 or the data, so fc0
    runs no backward pass (the container tells which of its inputs its layers write a gradient of), its weight
    gradients are zero and the data's gradient is zero; fc2 and fc3 get theirs, as in float64 NumPy."""
    inner = lp.SequentialConfig(inputs=[("h", [4, 3])])
    inner.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=3)))
    inner.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=3), propagate_down=[False]))
    cfg = lp.SequentialConfig(inputs=[("data", [4, 3])], force_backward=True)
    cfg.add_layer(lp.LayerConfig("fc0", lp.LinearConfig(output_size=3)))
    cfg.add_layer(lp.LayerConfig("inner", inner))
    cfg.add_layer(lp.LayerConfig("fc3", lp.LinearConfig(output_size=2)))
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", cfg), seed=0)
    rng = np.random.default_rng(2)
    for w in net.learnable_weights_data():
        w.set(rng.standard_normal(w.shape))
    W = net.named_weights()
    x, dy = rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    net.forward([x])
    dx = net.backward([dy])[0].to_numpy()
    assert not net.layers[0].runs_backward and net.layers[1].runs_backward
    grads = dict(zip(net.learnable_weights_names(), (g.to_numpy() for g in net.learnable_weights_gradients())))
    h1 = (x @ W["fc0/weight"].T + W["fc0/bias"]) @ W["inner/fc1/weight"].T + W["inner/fc1/bias"]
    g = h1 @ W["inner/fc2/weight"].T + W["inner/fc2/bias"]
    dg = dy @ W["fc3/weight"]
    np.testing.assert_allclose(grads["fc3/weight"], dy.T @ g, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads["inner/fc2/weight"], dg.T @ h1, rtol=1e-10, atol=1e-12)
    for name in ("fc0/weight", "fc0/bias", "inner/fc1/weight", "inner/fc1/bias"):
        np.testing.assert_array_equal(grads[name], 0.0, err_msg=name)
    np.testing.assert_array_equal(dx, 0.0)


def test_fan_out_matches_native(device):  # noqa: F811
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    dout = rng.standard_normal((3, 2)).astype(np.float32)
    results = []
    for be in (lp.backend("native"), device):
        net = lp.Layer.from_config(be, lp.LayerConfig("net", branching_config()), seed=6)
        y = net.forward([x])[0].to_numpy()
        dx = net.backward([dout])[0].to_numpy()
        results.append([y, dx] + [g.to_numpy() for g in net.learnable_weights_gradients()])
    for what, a, b in zip(["output", "input gradient"] + [f"weight gradient {i}" for i in range(8)], *results):
        close(b, a, what)


def test_resnet_run_file_trains_to_99_percent(tmp_path):
    """configs/digits_resnet.yaml (two residual blocks wired by name) through the leafpy command."""
    from test_cli import ROOT, accuracy

    def run(*args: str) -> subprocess.CompletedProcess:
        env = child_env()
        return subprocess.run([sys.executable, "-m", "leafpy.cli", *args], capture_output=True, text=True,
                              timeout=300, cwd=ROOT, env=env)

    run_file = str(ROOT / "configs" / "digits_resnet.yaml")
    p = run("train", run_file, "--out", str(tmp_path / "run"))
    assert p.returncode == 0, p.stderr
    acc = accuracy(p.stdout)
    assert acc >= 0.99
    e = run("evaluate", str(tmp_path / "run"))
    assert e.returncode == 0, e.stderr
    assert accuracy(e.stdout) == pytest.approx(acc)
    net = lp.Layer.load(lp.backend("native"), str(tmp_path / "run" / "model.leaf"))
    adds = [lc for lc in net.config.config.layers if lc.type == "Eltwise"]
    assert [lc.inputs for lc in adds] == [("res1", "stem"), ("res2", "block1")]


BRANCHING_YAML = """
name: branches
network:
  type: Sequential
  inputs: [{name: data, shape: [2, 6, 3]}]
  layers:
    - {name: cut, type: Slice, axis: 1, slice_points: [2, 5], outputs: [p, q, r]}
    - {name: join, type: Concat, axis: -1, inputs: [p, p], outputs: [pp]}
    - {name: scaled, type: Eltwise, operation: sum, coeff: [2.0, -0.5], inputs: [q, q]}
    - {name: big, type: Eltwise, operation: max, inputs: [r, r], outputs: [big]}
    - {name: mul, type: Eltwise, operation: prod, inputs: [big, big]}
objective:
  type: Sequential
  inputs: [{name: network_out, shape: [2, 1, 3]}, {name: target, shape: [2, 1, 3]}]
  layers: [{name: mse, type: MeanSquaredError}]
solver: {solver: momentum, base_lr: 0.1}
"""


def test_branching_layers_in_yaml(tmp_path):
    run = lp.config.loads(BRANCHING_YAML)
    layers = {lc.name: lc for lc in run.network.config.layers}
    assert layers["cut"].config == lp.SliceConfig(axis=1, slice_points=[2, 5])
    assert layers["cut"].outputs == ("p", "q", "r")
    assert layers["join"].config == lp.ConcatConfig(axis=-1) and layers["join"].inputs == ("p", "p")
    assert layers["scaled"].config == lp.EltwiseConfig(operation="sum", coeff=[2.0, -0.5])
    assert layers["big"].config.operation == "max" and layers["mul"].config.operation == "prod"
    again = lp.config.loads(lp.config.dumps(run))
    assert again.network == run.network
    # and through a model file
    net = lp.Layer.from_config(lp.backend("native"), run.network)
    x = np.arange(36, dtype=np.float32).reshape(2, 6, 3) - 10
    y = net.forward([x])[0].to_numpy()
    np.testing.assert_allclose(y, (x[:, 5:] ** 2), rtol=1e-6)
    net.save(tmp_path / "b.leaf")
    loaded = lp.Layer.load(lp.backend("native"), tmp_path / "b.leaf")
    assert loaded.config == run.network
    np.testing.assert_array_equal(loaded.forward([x])[0].to_numpy(), y)


def test_bad_branching_settings_are_reported(native):
    with pytest.raises(lp.ConfigError, match="slice_points.*increasing"):
        lp.SliceConfig(slice_points=[3, 2])
    with pytest.raises(lp.ConfigError, match="operation 'sum' only"):
        lp.EltwiseConfig(operation="max", coeff=[1, 2])
    cfg = lp.SequentialConfig(inputs=[("a", [2, 3]), ("b", [2, 4])])
    cfg.add_layer(lp.LayerConfig("add", lp.EltwiseConfig(), inputs=["a", "b"]))
    with pytest.raises(lp.ShapeError, match=r"layer 'add' \(Eltwise\): shapes \(2, 3\), \(2, 4\) do not broadcast"):
        lp.Layer.from_config(native, lp.LayerConfig("net", cfg))
    cfg = lp.SequentialConfig(inputs=[("a", [2, 3])])
    cfg.add_layer(lp.LayerConfig("cut", lp.SliceConfig(slice_points=[3])))
    with pytest.raises(lp.ShapeError, match=r"layer 'cut' \(Slice\).*inside axis 1 of length 3"):
        lp.Layer.from_config(native, lp.LayerConfig("net", cfg))
    cfg = lp.SequentialConfig(inputs=[("a", [2, 3]), ("b", [2, 3])])
    cfg.add_layer(lp.LayerConfig("join", lp.ConcatConfig(axis=4), inputs=["a", "b"]))
    with pytest.raises(lp.ShapeError, match=r"layer 'join' \(Concat\): axis 4 is outside"):
        lp.Layer.from_config(native, lp.LayerConfig("net", cfg))


@pytest.mark.parametrize("n", [5, 13, 10**9 + 1])  # wider than the channels; far wider (an ONNX file's LRN size)
def test_lrn_is_caffes_across_channel_formula(native64, n):
    """y = x / (k + alpha / n * sum of x^2 over the n channels centred on each one) ** beta, written out; a window
    past the channels costs no more than one over all of them (zeros past the edges are not summed one by one)."""
    x = np.random.default_rng(3).standard_normal((2, 6, 2, 3)) * 2
    alpha, beta, k = 0.8, 0.7, 1.5
    layer = lp.Layer.from_config(native64, lp.LayerConfig("lrn", lp.LRNConfig(local_size=n, alpha=alpha, beta=beta,
                                                                               k=k)))
    y = layer.forward([x])[0].to_numpy()
    ref = np.empty_like(x)
    half = (n - 1) // 2
    for c in range(6):
        window = x[:, max(c - half, 0):min(c + half + 1, 6)]
        ref[:, c] = x[:, c] / (k + alpha / n * np.sum(window ** 2, axis=1)) ** beta
    np.testing.assert_allclose(y, ref, rtol=1e-12)
    assert check_layer_gradients(layer, [x]) > 0  # and its gradient against central differences


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_eltwise_max_takes_infinities_as_numbers_on_native(dtype):
    """A masked score (-inf), a log of 0, an overflow (+inf): max over them is NumPy's maximum, and the gradient
    goes to the first input that holds it (Caffe's rule; two equal infinities: the first)."""
    _eltwise_max_with_infinities(lp.backend("native", dtype=dtype))


def test_eltwise_max_takes_infinities_as_numbers_on_the_device(device):  # noqa: F811
    _eltwise_max_with_infinities(device)


def _eltwise_max_with_infinities(be):
    a = np.array([[1.0, -np.inf, 2.0, -np.inf, np.inf, 4.0, 3.0, -np.inf]], np.float32)
    b = np.array([[-np.inf, 3.0, 1.0, -np.inf, np.inf, 5.0, 3.0, np.inf]], np.float32)
    cfg = lp.SequentialConfig(inputs=[("a", [1, 8]), ("b", [1, 8])], force_backward=True)
    cfg.add_layer(lp.LayerConfig("max", lp.EltwiseConfig(operation="max"), inputs=["a", "b"]))
    net = lp.Layer.from_config(be, lp.LayerConfig("net", cfg))
    y = net.forward([a, b])[0].to_numpy()
    np.testing.assert_array_equal(y, np.maximum(a, b))
    dy = np.arange(1, 9, dtype=np.float32).reshape(1, 8)
    da, db = (g.to_numpy() for g in net.backward([dy]))
    second = (b > a)  # strictly larger: the later input takes the gradient
    np.testing.assert_array_equal(da, np.where(second, 0, dy))
    np.testing.assert_array_equal(db, np.where(second, dy, 0))
