"""Networks on native: a LeNet against a loop reference, any batch size, in-place reuse, backward pruning,
Leaf's sigmoid spec and the Leaf defects that concern layers."""

from __future__ import annotations

import numpy as np
import pytest
import random_nets
import reference as ref
from gradcheck import check_layer_gradients

import leafpy as lp


def lenet_config(batch=8, force_backward=False):
    cfg = lp.SequentialConfig(inputs=[("data", [batch, 1, 28, 28])], force_backward=force_backward)
    cfg.add_layer(lp.LayerConfig("conv1", lp.ConvolutionConfig(num_output=20, filter_shape=[5])))
    cfg.add_layer(lp.LayerConfig("pool1", lp.PoolingConfig(mode="max", filter_shape=[2], stride=[2])))
    cfg.add_layer(lp.LayerConfig("conv2", lp.ConvolutionConfig(num_output=50, filter_shape=[5])))
    cfg.add_layer(lp.LayerConfig("pool2", lp.PoolingConfig(mode="max", filter_shape=[2], stride=[2])))
    cfg.add_layer(lp.LayerConfig("flat", "Flatten"))
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=500)))
    cfg.add_layer(lp.LayerConfig("relu1", "ReLU"))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=10)))
    cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    return cfg


def rel_err(a, b):
    return np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30)


def test_lenet_matches_loop_reference(native):
    net = lp.Layer.from_config(native, lp.LayerConfig("lenet", lenet_config(force_backward=True)), seed=0)
    rng = np.random.default_rng(0)
    x = rng.random((8, 1, 28, 28)).astype(np.float32)
    dout = rng.standard_normal((8, 10)).astype(np.float32)
    out = net.forward([x])[0].to_numpy()
    dx = net.backward([dout])[0].to_numpy()
    names = net.learnable_weights_names()
    W = {n: w.to_numpy().astype(np.float64) for n, w in zip(names, net.learnable_weights_data())}
    G = {n: g.to_numpy() for n, g in zip(net.learnable_weights_names(), net.learnable_weights_gradients())}

    x64 = x.astype(np.float64)
    c1 = ref.conv2d(x64, W["conv1/weight"], W["conv1/bias"])
    p1, a1 = ref.maxpool(c1, 2, 2)
    c2 = ref.conv2d(p1, W["conv2/weight"], W["conv2/bias"])
    p2, a2 = ref.maxpool(c2, 2, 2)
    f = p2.reshape(8, -1)
    h = f @ W["fc1/weight"].T + W["fc1/bias"]
    r = np.maximum(h, 0)
    z = r @ W["fc2/weight"].T + W["fc2/bias"]
    y = ref.log_softmax(z)
    assert rel_err(out, y) < 1e-5

    d = dout.astype(np.float64)
    dz = d - np.exp(y) * d.sum(axis=1, keepdims=True)
    g_fc2w, g_fc2b = dz.T @ r, dz.sum(0)
    dh = (dz @ W["fc2/weight"]) * (h > 0)
    g_fc1w, g_fc1b = dh.T @ f, dh.sum(0)
    dp2 = (dh @ W["fc1/weight"]).reshape(p2.shape)
    dc2 = ref.maxpool_backward(c2.shape, a2, dp2)
    dp1, g_c2w, g_c2b = ref.conv2d_backward(p1, W["conv2/weight"], dc2)
    dc1 = ref.maxpool_backward(c1.shape, a1, dp1)
    dx_ref, g_c1w, g_c1b = ref.conv2d_backward(x64, W["conv1/weight"], dc1)
    expected = {"fc2/weight": g_fc2w, "fc2/bias": g_fc2b, "fc1/weight": g_fc1w, "fc1/bias": g_fc1b,
                "conv2/weight": g_c2w, "conv2/bias": g_c2b, "conv1/weight": g_c1w, "conv1/bias": g_c1b}
    for name, want in expected.items():
        assert rel_err(G[name], want) < 1e-5, name
    assert rel_err(dx, dx_ref) < 1e-5


def test_per_dimension_convolution_matches_reference(native64, rng):
    cfg = lp.ConvolutionConfig(num_output=3, filter_shape=[3, 2], stride=[2, 1], padding=[1, 0])
    layer = lp.Layer.from_config(native64, lp.LayerConfig("c", cfg), seed=0)
    x = rng.standard_normal((2, 2, 7, 5))
    y = layer.forward([x])[0].to_numpy()
    w, b = (t.to_numpy() for t in layer.learnable_weights_data())
    assert w.shape == (3, 2, 3, 2)
    np.testing.assert_allclose(y, ref.conv2d(x, w, b, (2, 1), (1, 0)), rtol=1e-10, atol=1e-12)


def test_any_batch_size_and_buffers_kept(native):
    net = lp.Layer.from_config(native, lp.LayerConfig("lenet", lenet_config(batch=4)), seed=0)
    rng = np.random.default_rng(1)
    x = rng.random((4, 1, 28, 28)).astype(np.float32)
    out4 = net.forward([x])[0]
    first = out4.to_numpy()
    storage = net.layers[0].outputs[0]._st
    net.forward([x])
    assert net.layers[0].outputs[0]._st is storage  # same batch: buffers kept
    for n in (1, 3, 9):
        xb = rng.random((n, 1, 28, 28)).astype(np.float32)
        out = net.forward([xb])[0].to_numpy()
        assert out.shape == (n, 10)
        # each sample is computed independently of the batch it is in
        single = net.forward([xb[:1]])[0].to_numpy()
        np.testing.assert_allclose(out[:1], single, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), first, rtol=1e-6)


def test_forward_leaves_inputs_unchanged(native):
    cfg = lp.SequentialConfig(inputs=[("data", [3, 4])])
    cfg.add_layer(lp.LayerConfig("relu", "ReLU"))
    cfg.add_layer(lp.LayerConfig("sig", "Sigmoid"))
    net = lp.Layer.from_config(native, lp.LayerConfig("net", cfg))
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    t = lp.SharedTensor.from_numpy(x)
    before = x.copy()
    net.forward([x])
    net.forward([t])
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(t.to_numpy(), before)


def test_in_place_layers_share_buffers_and_match_out_of_place(native, rng):
    cfg = lp.SequentialConfig(inputs=[("data", [4, 2, 6, 6])], force_backward=True)
    cfg.add_layer(lp.LayerConfig("conv", lp.ConvolutionConfig(num_output=3, filter_shape=[3], padding=[1])))
    cfg.add_layer(lp.LayerConfig("relu", "ReLU"))
    cfg.add_layer(lp.LayerConfig("flat", "Flatten"))
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=5)))
    cfg.add_layer(lp.LayerConfig("sig", "Sigmoid"))
    cfg.add_layer(lp.LayerConfig("drop", lp.DropoutConfig(ratio=0.5)))
    cfg.add_layer(lp.LayerConfig("reshape", lp.ReshapeConfig(shape=[1, 5, 1])))
    cfg.add_layer(lp.LayerConfig("smax", "Softmax"))
    net = lp.Layer.from_config(native, lp.LayerConfig("net", cfg), seed=2)
    L = {layer.name: layer for layer in net.layers}
    assert L["relu"].in_place and L["relu"].outputs[0].shares_storage(L["conv"].outputs[0])
    assert L["flat"].in_place and L["flat"].outputs[0].shares_storage(L["conv"].outputs[0])
    assert L["sig"].in_place and L["sig"].outputs[0].shares_storage(L["fc"].outputs[0])
    # dropout would overwrite the sigmoid output that sigmoid's backward reads: it must not run in place
    assert not L["drop"].in_place
    assert L["reshape"].in_place and L["reshape"].outputs[0].shares_storage(L["drop"].outputs[0])
    assert L["relu"].output_grads[0].shares_storage(L["conv"].output_grads[0])

    net.set_training(False)
    x = rng.standard_normal((4, 2, 6, 6)).astype(np.float32)
    dout = rng.standard_normal((4, 5, 1)).astype(np.float32)
    y = net.forward([x])[0].to_numpy()
    dx = net.backward([dout])[0].to_numpy()
    grads = [g.to_numpy() for g in net.learnable_weights_gradients()]

    # the same computation, each layer standalone (out of place), with the network's weights
    chain = []
    for lc in cfg.layers:
        layer = lp.Layer.from_config(native, lc)
        layer.set_training(False)
        chain.append(layer)
    h = x
    for layer in chain:
        layer.forward([h])  # creates the weights (their shapes follow the input)
        for mine, theirs in zip(layer.learnable_weights_data(), L[layer.name].learnable_weights_data()):
            mine.set(theirs.to_numpy())
        h = layer.forward([h])[0].to_numpy()
    np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-6)
    g = dout
    out_of_place_grads = []
    for layer in reversed(chain):
        g = layer.backward([g])[0].to_numpy()
        out_of_place_grads = [w.to_numpy() for w in layer.learnable_weights_gradients()] + out_of_place_grads
    np.testing.assert_allclose(dx, g, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, out_of_place_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _count_calls(monkeypatch, worker):
    calls = []
    original = worker.backward_input

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(worker, "backward_input", spy)
    return calls


def test_pruning_skips_first_layer_input_gradient(native, monkeypatch, rng):
    net = lp.Layer.from_config(native, lp.LayerConfig("lenet", lenet_config(batch=2)), seed=0)
    calls = _count_calls(monkeypatch, net.layers[0].worker)
    fc2_calls = _count_calls(monkeypatch, net.layers[7].worker)
    net.forward([rng.random((2, 1, 28, 28))])
    dx = net.backward([np.ones((2, 10))])
    assert calls == [] and dx == [None]
    assert fc2_calls == [1]
    # the first layer's weights still get gradients
    assert np.abs(net.learnable_weights_gradients()[0].to_numpy()).sum() > 0


def test_force_backward_computes_input_gradient(native, monkeypatch, rng):
    net = lp.Layer.from_config(native, lp.LayerConfig("lenet", lenet_config(batch=2, force_backward=True)), seed=0)
    calls = _count_calls(monkeypatch, net.layers[0].worker)
    net.forward([rng.random((2, 1, 28, 28))])
    dx = net.backward([np.ones((2, 10))])
    assert calls == [1] and dx[0] is not None and np.abs(dx[0].to_numpy()).sum() > 0


def test_layers_before_the_first_weighted_layer_are_pruned(native, monkeypatch, rng):
    """Leaf counted every layer as feeding the loss, so nothing was ever pruned."""
    cfg = lp.SequentialConfig(inputs=[("data", [2, 16])])
    cfg.add_layer(lp.LayerConfig("sig", "Sigmoid"))
    cfg.add_layer(lp.LayerConfig("reshape", lp.ReshapeConfig(shape=[2, 1, 4, 4])))
    cfg.add_layer(lp.LayerConfig("conv", lp.ConvolutionConfig(num_output=2, filter_shape=[3])))
    net = lp.Layer.from_config(native, lp.LayerConfig("net", cfg))
    sig_calls = _count_calls(monkeypatch, net.layers[0].worker)
    conv_calls = _count_calls(monkeypatch, net.layers[2].worker)
    net.forward([rng.random((2, 16))])
    net.backward([np.ones((2, 2, 2, 2))])
    assert sig_calls == [] and conv_calls == []
    assert [layer.runs_backward for layer in net.layers] == [False, False, True]


def test_propagate_down_false_stops_gradient(native, monkeypatch, rng):
    cfg = lp.SequentialConfig(inputs=[("data", [2, 6])], force_backward=True)
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=4)))
    cfg.add_layer(lp.LayerConfig("tanh", "TanH"))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=3), propagate_down=[False]))
    net = lp.Layer.from_config(native, lp.LayerConfig("net", cfg), seed=1)
    fc2_calls = _count_calls(monkeypatch, net.layers[2].worker)
    tanh_calls = _count_calls(monkeypatch, net.layers[1].worker)
    net.forward([rng.random((2, 6))])
    dx = net.backward([np.ones((2, 3))])
    assert fc2_calls == [] and tanh_calls == []
    assert dx == [None] or np.abs(dx[0].to_numpy()).sum() == 0
    names = net.learnable_weights_names()
    grads = dict(zip(names, (g.to_numpy() for g in net.learnable_weights_gradients())))
    assert np.abs(grads["fc2/weight"]).sum() > 0
    assert np.abs(grads["fc1/weight"]).sum() == 0  # nothing flowed past fc2


@pytest.mark.parametrize("with_reshape", [False, True])
def test_leaf_sigmoid_spec(native, with_reshape):
    cfg = lp.SequentialConfig(inputs=[("in", [1, 1, 3] if with_reshape else [1, 3])])
    if with_reshape:
        cfg.add_layer(lp.LayerConfig("reshape", lp.ReshapeConfig(shape=[1, 1, 3])))
    cfg.add_layer(lp.LayerConfig("sigmoid", "Sigmoid"))
    net = lp.Layer.from_config(native, lp.LayerConfig("net", cfg))
    x = np.array([1.0, 1.0, 2.0], np.float32).reshape([1, 1, 3] if with_reshape else [1, 3])
    out = net.forward([x])[0].to_numpy().reshape(-1)
    np.testing.assert_allclose(out, [0.7310586, 0.7310586, 0.8807971], rtol=1e-6)


# --- Leaf's defects --------------------------------------------------------------------------------------------
def test_nll_uses_every_row_and_the_batch_size(native):
    """Leaf's NLL read only row 0 and ignored the batch size."""
    layer = lp.Layer.from_config(native, lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=3)))
    logp = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.25, 0.5, 0.25]], np.float32))
    lab = np.array([0, 2, 1])
    loss = layer.forward([logp, lab])[0].to_numpy()[0]
    assert loss == pytest.approx(-(np.log(0.7) + np.log(0.8) + np.log(0.5)) / 3, rel=1e-6)
    dx = layer.backward([np.ones(1)])[0].to_numpy()
    expected = np.zeros((3, 3))
    expected[[0, 1, 2], lab] = -1 / 3
    np.testing.assert_allclose(dx, expected, rtol=1e-6)


@pytest.mark.parametrize("kind", ["Softmax", "LogSoftmax"])
def test_softmax_normalises_each_sample(native, rng, kind):
    """Leaf's native Softmax/LogSoftmax normalised across the whole batch."""
    layer = lp.Layer.from_config(native, lp.LayerConfig("s", kind))
    x = rng.standard_normal((4, 6)).astype(np.float32) * 3
    y = layer.forward([x])[0].to_numpy()
    p = y if kind == "Softmax" else np.exp(y)
    np.testing.assert_allclose(p.sum(axis=1), np.ones(4), rtol=1e-6)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(p, e / e.sum(axis=1, keepdims=True), rtol=1e-5)


def test_tanh_has_a_config_entry(native):
    """Leaf had no TanH entry in its layer type config."""
    layer = lp.Layer.from_config(native, lp.LayerConfig("t", "TanH"))
    np.testing.assert_allclose(layer.forward([np.array([[0.5, -1.0]])])[0].to_numpy(), np.tanh([[0.5, -1.0]]),
                               rtol=1e-6)


def test_average_pooling_and_cpu_convolution(native):
    """Leaf had no average pooling, and no Convolution or Pooling on the CPU."""
    layer = lp.Layer.from_config(native, lp.LayerConfig("p", lp.PoolingConfig(mode="average", filter_shape=[2])))
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    np.testing.assert_allclose(layer.forward([x])[0].to_numpy().reshape(2, 2), [[2.5, 4.5], [10.5, 12.5]])


@pytest.mark.parametrize("config", [lp.LinearConfig(output_size=2),
                                    lp.ConvolutionConfig(num_output=2, filter_shape=[1])])
def test_linear_and_convolution_have_bias(native, config):
    """Leaf's Linear and Convolution had no bias."""
    layer = lp.Layer.from_config(native, lp.LayerConfig("l", config))
    x = np.zeros((1, 3, 1, 1), np.float32) if isinstance(config, lp.ConvolutionConfig) else np.zeros((1, 3), np.float32)
    layer.forward([x])  # a standalone layer's weights take their shapes from the first input
    assert layer.learnable_weights_names() == ["l/weight", "l/bias"]
    layer.learnable_weights_data()[1].set(np.array([1.5, -2.0], np.float32))
    y = layer.forward([x])[0].to_numpy().reshape(-1)
    np.testing.assert_allclose(y, [1.5, -2.0])
    off = lp.Layer.from_config(native, lp.LayerConfig("n", type(config)(**{**config.__dict__, "bias": False})))
    off.forward([x])
    assert off.learnable_weights_names() == ["n/weight"]


def test_weight_sharing_by_name(native, rng):
    """Leaf never matched weights shared by name."""
    cfg = lp.SequentialConfig(inputs=[("data", [2, 4])])
    shared = [lp.WeightConfig(name="tied_w"), lp.WeightConfig(name="tied_b")]
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=4), params=shared))
    cfg.add_layer(lp.LayerConfig("tanh", "TanH"))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=4), params=shared))
    net = lp.Layer.from_config(native, lp.LayerConfig("net", cfg), seed=0)
    assert net.learnable_weights_names() == ["tied_w", "tied_b"]
    assert net.layers[0].weights[0] is net.layers[2].weights[0]
    x = rng.standard_normal((2, 4)).astype(np.float32)
    dout = rng.standard_normal((2, 4)).astype(np.float32)
    net.forward([x])
    net.backward([dout])
    gw = net.learnable_weights_gradients()[0].to_numpy()
    # the shared gradient is the sum of both uses
    W = net.learnable_weights_data()[0].to_numpy().astype(np.float64)
    b = net.learnable_weights_data()[1].to_numpy().astype(np.float64)
    h = np.tanh(x @ W.T + b)
    dh = (dout @ W) * (1 - h * h)
    np.testing.assert_allclose(gw, dout.T @ h + dh.T @ x, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("field,values", [("lr_mult", (1.0, 2.0)), ("lr_mult", (1.0, 0.0)), ("decay_mult", (1.0, 0.0))])
def test_layers_sharing_a_weight_with_other_multipliers_are_refused(tmp_path, field, values):
    """One weight has one update: two layers sharing it by name with other lr_mult or decay_mult (where the first
    layer's silently won) are refused by a solver naming the weight, both layers and the field, through the command
    too; such a network still runs, and its model file still loads and predicts."""
    cfg = lp.SequentialConfig(inputs=[("data", [2, 4])])
    for name, v in zip(("fc1", "fc2"), values):
        cfg.add_layer(lp.LayerConfig(name, lp.LinearConfig(output_size=4),
                                     params=[lp.WeightConfig(name="tied_w", **{field: v})]))
    be = lp.backend("native")
    net = lp.Layer.from_config(be, lp.LayerConfig("net", cfg), seed=0)
    net.save(str(tmp_path / "tied.leaf"))
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(lp.Layer.load(be, str(tmp_path / "tied.leaf")).forward([x])[0].to_numpy(),
                                  net.forward([x])[0].to_numpy())
    obj = lp.SequentialConfig(inputs=[("network_out", [2, 4]), ("target", [2, 4])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    with pytest.raises(lp.ConfigError, match=rf"layer 'fc2'.*'tied_w' has {field} {values[0]:g} in layer 'fc1'.*"
                                             rf"{values[1]:g} here"):
        lp.Solver.from_config(be, be, lp.SolverConfig(network=lp.LayerConfig("net", cfg),
                                                      objective=lp.LayerConfig("loss", obj)))
    from test_user_paths import failed_cleanly, leafpy

    (tmp_path / "run.yaml").write_text(
        "name: tied\ndata: {dataset: npz, path: d.npz}\nnetwork:\n  type: Sequential\n  inputs: [{name: data, "
        "shape: [null, 4]}]\n  layers:\n    - {name: fc1, type: Linear, output_size: 4, params: [{name: tied_w, "
        f"{field}: {values[0]}}}]}}\n    - {{name: fc2, type: Linear, output_size: 4, params: [{{name: tied_w, "
        f"{field}: {values[1]}}}]}}\n    - {{name: sm, type: LogSoftmax}}\nobjective: nll\n")
    np.savez(tmp_path / "d.npz", x=np.ones((8, 4), np.float32), y=np.arange(8) % 4)
    failed_cleanly(leafpy(tmp_path, "train", "run.yaml", "--out", "r"), "tied_w", field, "fc1", "fc2")


def test_weight_fillers(native):
    for filler, check in [
        (lp.FillerConfig(type="constant", value=0.25), lambda w: np.allclose(w, 0.25)),
        (lp.FillerConfig(type="gaussian", std=0.1), lambda w: 0.08 < w.std() < 0.12),
        (lp.FillerConfig(type="glorot_uniform"), lambda w: np.abs(w).max() <= np.sqrt(6 / (200 + 100)) + 1e-7),
        (lp.FillerConfig(type="he"), lambda w: 0.85 * np.sqrt(2 / 200) < w.std() < 1.15 * np.sqrt(2 / 200)),
    ]:
        layer = lp.Layer.from_config(native, lp.LayerConfig(
            "fc", lp.LinearConfig(output_size=100), params=[lp.WeightConfig(filler=filler)]), seed=0)
        layer.forward([np.zeros((1, 200), np.float32)])
        w = layer.learnable_weights_data()[0].to_numpy()
        assert check(w), filler
        assert np.all(layer.learnable_weights_data()[1].to_numpy() == 0)


def test_output_gradients_share_two_buffers_in_a_chain(native, rng):
    net = lp.Layer.from_config(native, lp.LayerConfig("lenet", lenet_config(batch=4)), seed=0)
    net.forward([rng.random((4, 1, 28, 28)).astype(np.float32)])
    net.backward([np.ones((4, 10), np.float32)])
    inner = net.layers[:-1]  # the last layer's output gradient comes from outside
    storages = {id(layer.output_grads[0]._st) for layer in inner if layer.runs_backward}
    assert len(storages) == 2
    # a layer's output gradient and the gradient it writes for its input never share storage
    for layer in inner:
        for g in layer.input_grads:
            if g is not None and not layer.in_place:
                assert not g.shares_storage(layer.output_grads[0]), layer.name


@pytest.mark.parametrize("seed", range(40))
def test_random_networks_pass_the_gradient_check(native64, seed):
    # the wiring in combination: in-place runs after every kind of layer, nested containers, shared weights
    rng = np.random.default_rng(seed)
    config, shape = random_nets.random_network(rng)
    net = random_nets.build(native64, config, rng)
    assert check_layer_gradients(net, [rng.standard_normal(shape)], tol=1e-5,
                                 untrained=random_nets.untrained(net)) > 0


def _bn_reference(x, gamma, beta, mean, var, eps):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * gamma.reshape(shape) + beta.reshape(shape)


def test_batch_norm_statistics_modes_and_files(native64, tmp_path, rng):
    cfg = lp.SequentialConfig(inputs=[("data", [6, 3, 4, 4])])
    cfg.add_layer(lp.LayerConfig("conv", lp.ConvolutionConfig(num_output=3, filter_shape=[3], padding=[1])))
    cfg.add_layer(lp.LayerConfig("bn", lp.BatchNormConfig(momentum=0.25, eps=1e-3),
                                 params=[lp.WeightConfig(lr_mult=2.0), lp.WeightConfig(), lp.WeightConfig()]))
    cfg.add_layer(lp.LayerConfig("relu", "ReLU"))
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", cfg), seed=0)
    names = net.learnable_weights_names()
    assert names[2:] == ["bn/weight", "bn/bias", "bn/running_mean", "bn/running_var"]
    # running statistics are never trained, whatever params say; weight and bias keep theirs
    assert [(c.lr_mult, c.decay_mult) for c in net.learnable_weights_configs()[2:]] == [
        (2.0, 1.0), (1.0, 1.0), (0.0, 0.0), (0.0, 0.0)]
    weights = dict(zip(names, net.learnable_weights_data()))
    gamma, beta = rng.standard_normal(3), rng.standard_normal(3)
    weights["bn/weight"].set(gamma)
    weights["bn/bias"].set(beta)
    conv = net.layers[0]
    x = rng.standard_normal((6, 3, 4, 4)) * 2 + 3
    y = net.forward([x])[0].to_numpy()
    c = conv.outputs[0].to_numpy()  # the convolution's output, before normalisation
    mean, var = c.mean(axis=(0, 2, 3)), c.var(axis=(0, 2, 3))
    np.testing.assert_allclose(y, np.maximum(_bn_reference(c, gamma, beta, mean, var, 1e-3), 0), atol=1e-12)
    # running statistics move a quarter of the way to the batch's (the variance unbiased)
    np.testing.assert_allclose(weights["bn/running_mean"].to_numpy(), 0.25 * mean, atol=1e-12)
    np.testing.assert_allclose(weights["bn/running_var"].to_numpy(), 0.75 + 0.25 * c.var(axis=(0, 2, 3), ddof=1),
                               atol=1e-12)
    net.forward([x])
    np.testing.assert_allclose(weights["bn/running_mean"].to_numpy(), (1 - 0.75 ** 2) * mean, atol=1e-12)
    # inference normalises with the running statistics, and changes them no more
    rm, rv = weights["bn/running_mean"].to_numpy(), weights["bn/running_var"].to_numpy()
    net.set_training(False)
    x2 = rng.standard_normal((2, 3, 4, 4))
    y2 = net.forward([x2])[0].to_numpy()
    np.testing.assert_allclose(y2, np.maximum(_bn_reference(conv.outputs[0].to_numpy(), gamma, beta, rm, rv, 1e-3),
                                              0), atol=1e-12)
    np.testing.assert_array_equal(weights["bn/running_mean"].to_numpy(), rm)
    # the statistics travel with the model
    net.save(tmp_path / "bn.leaf")
    loaded = lp.Layer.load(native64, tmp_path / "bn.leaf")
    loaded.set_training(False)
    np.testing.assert_allclose(loaded.forward([x2])[0].to_numpy(), y2, rtol=1e-6, atol=1e-6)  # files hold float32
    assert loaded.learnable_weights_configs()[4].lr_mult == 0.0


def test_batch_norm_on_one_value_per_channel_keeps_its_running_variance(native64, rng):
    """A last batch of one sample with no axes after C: the batch variance is 0 and has no unbiased estimate, so
    the running variance must not be pulled towards 0 (inference would then divide by sqrt(eps)); the running mean
    moves as usual."""
    cfg = lp.SequentialConfig(inputs=[("data", [1, 3])])
    cfg.add_layer(lp.LayerConfig("bn", lp.BatchNormConfig(momentum=0.5)))
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", cfg), seed=0)
    weights = dict(zip(net.learnable_weights_names(), net.learnable_weights_data()))
    weights["bn/running_var"].set(np.array([2.0, 3.0, 4.0]))
    x = rng.standard_normal((1, 3))
    net.forward([x])
    np.testing.assert_allclose(weights["bn/running_var"].to_numpy(), [2.0, 3.0, 4.0], atol=1e-12)
    np.testing.assert_allclose(weights["bn/running_mean"].to_numpy(), 0.5 * x[0], atol=1e-12)


def test_batch_norm_statistics_are_left_alone_by_the_solver(native64, rng):
    # weight decay 0.5 and a rate of 0.1 would shrink them visibly if the update touched them
    net = lp.SequentialConfig(inputs=[("data", [8, 4])])
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    net.add_layer(lp.LayerConfig("bn", lp.BatchNormConfig(momentum=0.5)))
    obj = lp.SequentialConfig(inputs=[("out", [8, 3]), ("target", [8, 3])])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    for rule in ("momentum", "adam", "adagrad"):
        solver = lp.Solver.from_config(native64, native64, lp.SolverConfig(
            network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj), solver=rule, base_lr=0.1,
            momentum=0.9, weight_decay=0.5, seed=0))
        weights = dict(zip(solver.network.learnable_weights_names(), solver.network.learnable_weights_data()))
        mean, var = np.zeros(3), np.ones(3)
        for _ in range(3):
            x, t = rng.standard_normal((8, 4)), rng.standard_normal((8, 3))
            h = x @ weights["fc/weight"].to_numpy().T + weights["fc/bias"].to_numpy()  # what bn will see
            solver.train_minibatch(x, t)
            mean = 0.5 * mean + 0.5 * h.mean(axis=0)
            var = 0.5 * var + 0.5 * h.var(axis=0, ddof=1)
            np.testing.assert_allclose(weights["bn/running_mean"].to_numpy(), mean, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(weights["bn/running_var"].to_numpy(), var, rtol=1e-12, atol=1e-12)
        assert not np.allclose(weights["bn/weight"].to_numpy(), 1.0)  # while weight and bias train


def test_params_on_a_container_from_python_are_refused(native):
    """A Sequential has no weights of its own: params given to it would be dropped silently, so they are refused
    (the YAML reader refuses them too)."""
    inner = lp.SequentialConfig(inputs=[("x", [2, 3])])
    inner.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    outer = lp.SequentialConfig(inputs=[("data", [2, 3])])
    outer.add_layer(lp.LayerConfig("blk", inner, params=[lp.WeightConfig(lr_mult=0.0)]))
    with pytest.raises(lp.ConfigError, match="layer 'blk' .*give them to the layers inside it"):
        lp.Layer.from_config(native, lp.LayerConfig("net", outer))


def test_a_layer_inside_a_container_is_not_run_on_its_own(native, rng):
    """A contained layer runs as its container binds it: its own forward (or a Network of its own) would rebind it
    to tensors of its own, and the container would go on running it on those (wrong outputs from then on, and a
    second thread unguarded). Refused naming both layers and the way out; the network is untouched."""
    cfg = lp.SequentialConfig(inputs=[("data", [3, 4])])
    cfg.add_layer(lp.LayerConfig("fc0", lp.LinearConfig(output_size=5)))
    cfg.add_layer(lp.LayerConfig("relu", "ReLU"))
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=2)))
    net = lp.Layer.from_config(native, lp.LayerConfig("outer", cfg), seed=0)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    before = net.forward([x])[0].to_numpy().copy()
    for call in (lambda: net.layers[0].forward([x]), lambda: net.layers[2].backward([np.ones((3, 2), np.float32)]),
                 lambda: net.layers[0].network):
        with pytest.raises(lp.LeafpyError, match=r"layer 'fc\d' is part of layer 'outer'.*Layer.from_config"):
            call()
    np.testing.assert_array_equal(net.forward([x])[0].to_numpy(), before)
    alone = lp.Layer.from_config(native, net.layers[0].config)  # the way out the message gives
    alone.load_weights(net.layers[0].named_weights())
    w, b = (net.named_weights()[f"fc0/{k}"] for k in ("weight", "bias"))
    np.testing.assert_allclose(alone.forward([x])[0].to_numpy(), x @ w.T + b, rtol=1e-5, atol=1e-6)


def _fc_net(batch):
    cfg = lp.SequentialConfig(inputs=[("data", [batch, 100])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    return lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("n", cfg), seed=0)


def test_a_declared_batch_larger_than_any_fed_is_never_allocated():
    """The declared batch is a placeholder ("any batch size works"): a network declared for 10**7 samples and fed
    two allocates two samples' input, not the 4 GB the declaration would take."""
    import tracemalloc

    net = _fc_net(10**7)
    x = np.random.default_rng(0).random((2, 100)).astype(np.float32)
    tracemalloc.start()
    try:
        out = np.asarray(net.forward([x])[0])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20, peak
    w, b = (np.asarray(t) for t in net.learnable_weights_data())
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T + b, rtol=1e-5, atol=1e-6)


def test_a_batch_whose_input_could_not_be_allocated_leaves_the_network_usable(monkeypatch):
    """A batch too large for memory is refused where its input buffer is allocated; the next ordinary batch
    allocates its own size again (the refused size was kept as the storage's and every later batch failed)."""
    import leafpy.tensor as tensor_module

    class LimitedNumpy:  # NumPy, with allocations of more than a million elements refused as a full machine would
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def zeros(n, dtype=float):
            if n > 10**6:
                raise MemoryError(f"Unable to allocate {n} elements")
            return np.zeros(n, dtype)

        empty = zeros

    net = _fc_net(8)
    x = np.random.default_rng(1).random((8, 100)).astype(np.float32)
    before = np.asarray(net.forward([x])[0]).copy()
    monkeypatch.setattr(tensor_module, "np", LimitedNumpy())
    with pytest.raises(MemoryError):
        net.forward([np.broadcast_to(np.float32(1), (10**5, 100))])
    np.testing.assert_array_equal(np.asarray(net.forward([x])[0]), before)


def test_backward_takes_output_gradients_as_forward_takes_inputs():
    """Output gradients as users have them (a PyTorch tensor that requires grad, bfloat16, a big-endian array, a
    list) give the float64 reference's weight gradient; a ragged list is a ShapeError naming the gradient."""
    torch = pytest.importorskip("torch")
    net = _fc_net(4)
    x = np.random.default_rng(2).random((4, 100)).astype(np.float32)
    g = np.arange(12, dtype=np.float32).reshape(4, 3) / 8  # (exact in bfloat16)
    want = g.astype(np.float64).T @ x
    for given in (torch.tensor(g, requires_grad=True), torch.tensor(g, dtype=torch.bfloat16), g.astype(">f4"),
                  g.tolist()):
        net.forward([x])
        net.backward([given])
        np.testing.assert_allclose(np.asarray(net.learnable_weights_gradients()[0]), want, rtol=1e-5)
    with pytest.raises(lp.ShapeError, match="output gradient 0: expected an array of numbers"):
        net.backward([[[1.0, 2.0, 3.0], [1.0]]])
    with pytest.raises(lp.ShapeError, match=r"expected 1 input \(data\), got 2 \(shapes a ragged list, \(4, 100\)\)"):
        net.forward([[[1.0, 2.0], [3.0]], x])


def test_labels_past_float32s_exact_integers_are_refused():
    with pytest.raises(lp.ConfigError, match=r"num_classes: at most 16777216 classes"):
        lp.NegativeLogLikelihoodConfig(num_classes=2**24 + 2)
    with pytest.raises(lp.ConfigError, match=r"ignore_index: expected an integer label to ignore from -2\*\*24"):
        lp.NegativeLogLikelihoodConfig(num_classes=10, ignore_index=2**24 + 1)
    assert lp.NegativeLogLikelihoodConfig(num_classes=2**24, ignore_index=-100).num_classes == 2**24


def test_a_refused_batch_leaves_the_network_as_it_was(native, tmp_path):
    """A batch a whole-shape Reshape cannot take is refused; the network was left bound part way to it, so the next
    call at the batch that worked raised a bare ValueError from matmul, and an ONNX export wrote the refused shape.
    Now the next call computes what the first did (x @ W.T + b in float64) and the export has the working batch."""
    cfg = lp.SequentialConfig(inputs=[("x", [1, 4])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=4)))
    cfg.add_layer(lp.LayerConfig("flat", lp.ReshapeConfig(shape=[1, 4], whole_shape=True)))
    net = lp.Layer.from_config(native, lp.LayerConfig("net", cfg), seed=0)
    x = np.random.default_rng(3).standard_normal((6, 4)).astype(np.float32)
    w, b = (t.to_numpy().astype(np.float64) for t in net.learnable_weights_data())
    want = x[:1].astype(np.float64) @ w.T + b
    np.testing.assert_allclose(net.forward([x[:1]])[0].to_numpy(), want, rtol=1e-6)
    for _ in range(2):
        with pytest.raises(lp.ShapeError, match="cannot reshape"):
            net.forward([x])
        np.testing.assert_allclose(net.forward([x[:1]])[0].to_numpy(), want, rtol=1e-6)
        net.forward([x[1:2]])
    with pytest.raises(lp.ShapeError, match="cannot reshape"):
        net.forward([x[:3]])
    assert net.inputs[0].shape == (1, 4)
    onnx = pytest.importorskip("onnx", reason="the exported file is read with onnx")
    lp.onnx.export(net, str(tmp_path / "net.onnx"))
    dims = onnx.load(str(tmp_path / "net.onnx")).graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims] == [1, 4]
