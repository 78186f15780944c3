"""Layers against NumPy float64 references written from their documented formulas, for settings the gradient check
table does not reach."""

from __future__ import annotations

import math

import numpy as np
import pytest

import leafpy as lp


@pytest.mark.parametrize("shape,axis", [((3, 2, 4), -2), ((2, 3, 4, 2), -2), ((2, 3, 2, 4), -3),
                                        ((2, 3, 4, 2), 2), ((2, 3, 4), -1)])
def test_linear_axis_counted_from_the_end_keeps_the_axes_before_it(native64, shape, axis):
    """``axis`` counts in the input: the axes before it are kept, the rest flattened into the features, for a
    negative axis as for a positive one (the output has fewer axes than the input when more than one is
    flattened)."""
    rng = np.random.default_rng(11)
    layer = lp.Layer.from_config(native64, lp.LayerConfig("fc", lp.LinearConfig(output_size=3, axis=axis)), seed=0)
    x = rng.standard_normal(shape)
    kept = shape[:axis % len(shape)]
    y = layer.forward([x])[0].to_numpy()
    w, b = (t.to_numpy() for t in layer.learnable_weights_data())
    rows = x.reshape(math.prod(kept), -1)
    assert w.shape == (3, rows.shape[1])
    np.testing.assert_allclose(y, (rows @ w.T + b).reshape(*kept, 3), rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx = layer.backward([dy])[0].to_numpy()
    dy_rows = dy.reshape(-1, 3)
    np.testing.assert_allclose(dx, (dy_rows @ w).reshape(shape), rtol=1e-12, atol=1e-12)
    dw, db = (t.to_numpy() for t in layer.learnable_weights_gradients())
    np.testing.assert_allclose(dw, dy_rows.T @ rows, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(db, dy_rows.sum(axis=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("config,shape", [
    (dict(num_output=4, filter_shape=[3], group=2), (2, 4, 5, 5)),
    (dict(num_output=6, filter_shape=[3], padding=[1], group=3), (2, 3, 6, 5)),  # depthwise, channel multiplier 2
    (dict(num_output=3, filter_shape=[3, 2], dilation=[2, 3], padding=[2, 1]), (1, 2, 7, 8)),
    (dict(num_output=4, filter_shape=[3], stride=[2, 1], padding=[1, 2], pad_end=[2, 0], dilation=[2, 1], group=2),
     (2, 4, 7, 6)),
    (dict(num_output=2, filter_shape=[2], stride=[2], padding=[0], pad_end=[1]), (1, 2, 5, 5)),
])
def test_grouped_dilated_asymmetric_convolution_matches_a_loop_reference(native64, config, shape):
    """Convolution with group, dilation and padding after (pad_end) other than before, against explicit loops over
    groups and output positions."""
    import reference

    rng = np.random.default_rng(3)
    cfg = lp.ConvolutionConfig(**config)
    layer = lp.Layer.from_config(native64, lp.LayerConfig("conv", cfg), seed=0)
    x = rng.standard_normal(shape)
    y = layer.forward([x])[0].to_numpy()
    w, b = (t.to_numpy() for t in layer.learnable_weights_data())
    assert w.shape[1] == shape[1] // cfg.group
    ref = reference.conv2d_grouped(x, w, b, cfg.stride, cfg.padding, cfg.pad_end or cfg.padding, cfg.dilation,
                                   cfg.group)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("config,shape", [
    (dict(mode="max", filter_shape=[3], stride=[2], ceil_mode=True), (2, 2, 6, 7)),
    (dict(mode="average", filter_shape=[3], stride=[2], padding=[1], ceil_mode=True), (1, 2, 6, 5)),
    (dict(mode="average", filter_shape=[3], stride=[2], padding=[1], count_include_pad=False), (1, 2, 5, 6)),
    (dict(mode="average", filter_shape=[3], stride=[2], padding=[1], ceil_mode=True, count_include_pad=False),
     (2, 1, 6, 6)),
    (dict(mode="max", filter_shape=[3, 2], stride=[1, 2], padding=[0, 1], pad_end=[2, 0]), (1, 2, 5, 5)),
    (dict(mode="average", filter_shape=[3], stride=[1], padding=[1, 0], pad_end=[0, 2]), (1, 2, 4, 5)),
])
def test_pooling_ceil_mode_padding_and_divisors_match_a_loop_reference(native64, config, shape):
    """Pooling with ceil_mode, count_include_pad and padding after (pad_end) other than before, against loops that
    follow PyTorch's and Caffe's definitions."""
    import reference

    cfg = lp.PoolingConfig(**config)
    layer = lp.Layer.from_config(native64, lp.LayerConfig("pool", cfg))
    x = np.random.default_rng(5).permutation(np.arange(np.prod(shape))).reshape(shape) * 0.1
    y = layer.forward([x])[0].to_numpy()
    ref = reference.pool2d(x, cfg.mode, cfg.filter_shape, cfg.stride, cfg.padding, cfg.pad_end or cfg.padding,
                           cfg.ceil_mode, cfg.count_include_pad)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["max", "average"])
def test_global_pooling_pools_each_whole_plane(native64, mode):
    layer = lp.Layer.from_config(native64, lp.LayerConfig("gp", lp.PoolingConfig(mode=mode, global_pooling=True)))
    x = np.random.default_rng(1).standard_normal((2, 3, 5, 4))
    y = layer.forward([x])[0].to_numpy()
    want = x.max(axis=(2, 3)) if mode == "max" else x.mean(axis=(2, 3))
    np.testing.assert_allclose(y, want.reshape(2, 3, 1, 1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("shape,axis", [((2, 3, 4, 5), 2), ((2, 3, 4, 5), -1), ((3, 4, 2), 0), ((2, 5), 1)])
def test_softmax_over_any_axis_matches_the_formula(native64, kind, shape, axis):
    """Softmax and LogSoftmax over ``axis``: exp(x) / sum over that axis (and its log), with the gradients
    y (dy - sum(dy y)) and dy - exp(y) sum(dy)."""
    config = (lp.SoftmaxConfig if kind == "Softmax" else lp.LogSoftmaxConfig)(axis=axis)
    layer = lp.Layer.from_config(native64, lp.LayerConfig("sm", config))
    rng = np.random.default_rng(2)
    x, dy = rng.standard_normal(shape), rng.standard_normal(shape)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    p = e / e.sum(axis=axis, keepdims=True)
    want = p if kind == "Softmax" else np.log(p)
    np.testing.assert_allclose(layer.forward([x])[0].to_numpy(), want, rtol=1e-12, atol=1e-12)
    grad = p * (dy - (dy * p).sum(axis=axis, keepdims=True)) if kind == "Softmax" else (
        dy - p * dy.sum(axis=axis, keepdims=True))
    np.testing.assert_allclose(layer.backward([dy])[0].to_numpy(), grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape,axis,want", [((2, 3, 4, 5), 1, (2, 60)), ((2, 3, 4, 5), 2, (6, 20)),
                                             ((2, 3, 4), 0, (1, 24)), ((2, 3, 4), 3, (24, 1)),
                                             ((2, 3, 4), -1, (6, 4))])
def test_flatten_axis_keeps_the_axes_before_it_in_the_first_dimension(native64, shape, axis, want):
    layer = lp.Layer.from_config(native64, lp.LayerConfig("f", lp.FlattenConfig(axis=axis)))
    x = np.random.default_rng(0).standard_normal(shape)
    y = layer.forward([x])[0].to_numpy()
    np.testing.assert_array_equal(y, x.reshape(want))


def test_an_axis_outside_the_input_is_a_shape_error_naming_the_range(native64):
    cfg = lp.SequentialConfig(inputs=[("data", [2, 3, 4])])
    cfg.add_layer(lp.LayerConfig("sm", lp.SoftmaxConfig(axis=3)))
    with pytest.raises(lp.ShapeError, match=r"layer 'sm'.*axis 3 is outside an input of shape \(2, 3, 4\).*-3 to 2"):
        lp.Layer.from_config(native64, lp.LayerConfig("net", cfg))
    with pytest.raises(lp.ConfigError, match="FlattenConfig.axis: expected an integer axis"):
        lp.FlattenConfig(axis="last")


@pytest.mark.parametrize("config,shape", [
    (dict(num_output=3, filter_shape=[3], stride=[2]), (2, 2, 3, 4)),
    (dict(num_output=2, filter_shape=[3, 2], stride=[2, 3], padding=[1, 0], output_padding=[1, 2]), (1, 3, 3, 3)),
    (dict(num_output=4, filter_shape=[2], stride=[1], padding=[1], pad_end=[0], group=2, dilation=[2]), (2, 4, 4, 3)),
    (dict(num_output=3, filter_shape=[3], stride=[2], padding=[1], group=3, bias=False), (1, 3, 3, 3)),
])
def test_deconvolution_matches_a_scatter_reference(native64, config, shape):
    """Deconvolution (stride, padding before and after, output_padding, dilation, group) against the scatter
    definition of a transposed convolution."""
    import reference

    cfg = lp.DeconvolutionConfig(**config)
    layer = lp.Layer.from_config(native64, lp.LayerConfig("deconv", cfg), seed=0)
    x = np.random.default_rng(4).standard_normal(shape)
    y = layer.forward([x])[0].to_numpy()
    weights = [t.to_numpy() for t in layer.learnable_weights_data()]
    assert weights[0].shape == (shape[1], cfg.num_output // cfg.group, *cfg.filter_shape)
    ref = reference.deconv2d(x, weights[0], weights[1] if cfg.bias else None, cfg.stride, cfg.padding,
                             cfg.pad_end or cfg.padding, cfg.output_padding, cfg.dilation, cfg.group)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("force_backward", [True, False])
def test_deconvolution_gradients_follow_new_inputs_in_the_same_buffers(native, force_backward):
    """Deconvolution runs the convolution primitives in other roles (its forward pass is a data gradient): a second
    step with new values in the same buffers must give that step's gradients, not reuse the first step's
    transposes or columns (with the data gradient, and without it as for a network's first layer)."""
    def net():
        cfg = lp.SequentialConfig(inputs=[("data", [2, 4, 5, 5])], force_backward=force_backward)
        cfg.add_layer(lp.LayerConfig("d", lp.DeconvolutionConfig(num_output=3, filter_shape=[3], stride=[2],
                                                                 padding=[1])))
        return lp.Layer.from_config(native, lp.LayerConfig("net", cfg), seed=1)

    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((2, 4, 5, 5)).astype(np.float32) for _ in range(2)]
    dys = [rng.standard_normal((2, 3, 9, 9)).astype(np.float32) for _ in range(2)]
    layer = net()
    for x, dy in zip(xs, dys):
        layer.forward([x])
        layer.backward([dy])
    got = [g.to_numpy() for g in layer.learnable_weights_gradients()]
    fresh = net()
    y = fresh.forward([xs[1]])[0].to_numpy()
    fresh.backward([dys[1]])
    want = [g.to_numpy() for g in fresh.learnable_weights_gradients()]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    layer.forward([xs[0]])
    np.testing.assert_allclose(layer.forward([xs[1]])[0].to_numpy(), y, rtol=1e-6, atol=1e-6)


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def test_gru_with_the_reset_gate_before_the_product_matches_its_formula(native64):
    """GRU ``linear_before_reset: false`` (ONNX's default): n = tanh(x W_inᵀ + b_in + (r h) W_hnᵀ + b_hn), step by
    step in float64 (its gradients: test_gradients.py), and not what PyTorch's form computes."""
    from leafpy.layers.common.recurrent import GRUConfig

    rng = np.random.default_rng(8)
    hs = 3
    layer = lp.Layer.from_config(native64, lp.LayerConfig("gru", GRUConfig(hidden_size=hs, linear_before_reset=False)),
                                 seed=0)
    x = rng.standard_normal((2, 4, 2))
    layer.forward([x])  # the weights take their shapes from the first input
    for t in layer.learnable_weights_data():
        t.set(rng.normal(0, 0.5, t.shape))
    w_ih, w_hh, b_ih, b_hh = (t.to_numpy() for t in layer.learnable_weights_data())

    def reference(x):
        h = np.zeros((x.shape[0], hs))
        out = []
        for step in range(x.shape[1]):
            a = x[:, step] @ w_ih.T + b_ih
            b = h @ w_hh.T + b_hh
            r, z = _sigmoid(a[:, :hs] + b[:, :hs]), _sigmoid(a[:, hs:2 * hs] + b[:, hs:2 * hs])
            n = np.tanh(a[:, 2 * hs:] + (r * h) @ w_hh[2 * hs:].T + b_hh[2 * hs:])
            h = (1 - z) * n + z * h
            out.append(h)
        return np.stack(out, 1)

    y = layer.forward([x])[0].to_numpy()
    np.testing.assert_allclose(y, reference(x), rtol=1e-12, atol=1e-12)
    pytorch_form = lp.Layer.from_config(native64, lp.LayerConfig("gru", GRUConfig(hidden_size=hs)), seed=0)
    pytorch_form.forward([x])
    pytorch_form.load_weights(dict(zip(pytorch_form.learnable_weights_names(), [w_ih, w_hh, b_ih, b_hh])))
    pytorch_form.set_training(False)
    assert np.abs(pytorch_form.forward([x])[0].to_numpy() - y).max() > 1e-3  # the two forms differ


def test_lstm_last_cell_state_matches_its_formula(native64):
    rng = np.random.default_rng(9)
    hs = 2
    cfg = lp.LSTMConfig(hidden_size=hs, return_cell_state=True)
    layer = lp.Layer.from_config(native64, lp.LayerConfig("lstm", cfg), seed=0)
    x = rng.standard_normal((3, 5, 2))
    layer.forward([x])  # the weights take their shapes from the first input
    w_ih, w_hh, b = (t.to_numpy() for t in layer.learnable_weights_data())
    h = c = np.zeros((3, hs))
    for step in range(5):
        a = x[:, step] @ w_ih.T + h @ w_hh.T + b
        i, f, g, o = (a[:, k * hs:(k + 1) * hs] for k in range(4))
        c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
        h = _sigmoid(o) * np.tanh(c)
    y, cell = (o.to_numpy() for o in layer.forward([x]))
    np.testing.assert_allclose(y[:, -1], h, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cell, c, rtol=1e-12, atol=1e-12)


def test_broadcast_eltwise_matmul_and_transpose_match_numpy(native64):
    """Eltwise broadcasting (NumPy's rules) with a weight operand, MatMul over broadcast stacks, Transpose: outputs
    as NumPy computes them; gradients summed over the axes an operand was repeated along."""
    from leafpy.layers.common.matmul import MatMulConfig
    from leafpy.layers.utility.transpose import TransposeConfig

    rng = np.random.default_rng(10)
    x, v, c = rng.standard_normal((2, 3, 4)), rng.standard_normal((3, 1)), rng.standard_normal((4,))
    prod = lp.Layer.from_config(native64, lp.LayerConfig("p", lp.EltwiseConfig(operation="prod", weight_shape=[4])))
    prod.forward([x, v])  # the weights take their shapes from the first input
    prod.load_weights({"p/weight": c})
    y = prod.forward([x, v])[0].to_numpy()
    np.testing.assert_allclose(y, x * v * c, rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx, dv = (g.to_numpy() for g in prod.backward([dy]))
    np.testing.assert_allclose(dx, dy * v * c, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dv, (dy * x * c).sum(axis=(0, 2))[:, None], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(prod.learnable_weights_gradients()[0].to_numpy(), (dy * x * v).sum(axis=(0, 1)),
                               rtol=1e-12, atol=1e-12)

    a, b = rng.standard_normal((3, 1, 2, 4)), rng.standard_normal((2, 4, 5))
    mm = lp.Layer.from_config(native64, lp.LayerConfig("mm", "MatMul"))
    y = mm.forward([a, b])[0].to_numpy()
    np.testing.assert_allclose(y, a @ b, rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    da, db = (g.to_numpy() for g in mm.backward([dy]))
    np.testing.assert_allclose(da, (dy @ np.swapaxes(b, -1, -2)).sum(axis=1, keepdims=True), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(db, (np.swapaxes(a, -1, -2) @ dy).sum(axis=0), rtol=1e-12, atol=1e-12)
    held = lp.Layer.from_config(native64, lp.LayerConfig("mm", MatMulConfig(weight_shape=(2, 4, 5))))
    held.forward([a])
    held.load_weights({"mm/weight": b})
    np.testing.assert_allclose(held.forward([a])[0].to_numpy(), a @ b, rtol=1e-12, atol=1e-12)

    t = lp.Layer.from_config(native64, lp.LayerConfig("t", TransposeConfig(perm=[2, 0, 3, 1])))
    y = t.forward([a])[0].to_numpy()
    np.testing.assert_array_equal(y, a.transpose(2, 0, 3, 1))
    dy = rng.standard_normal(y.shape)
    np.testing.assert_array_equal(t.backward([dy])[0].to_numpy(), dy.transpose(1, 3, 0, 2))


def test_dropout_mask_output_marks_the_kept_values(native64):
    layer = lp.Layer.from_config(native64, lp.LayerConfig("d", lp.DropoutConfig(ratio=0.25, mask_output=True)),
                                 seed=2)
    x = np.random.default_rng(1).uniform(1, 2, (40, 30))
    y, mask = (o.to_numpy() for o in layer.forward([x]))
    assert set(np.unique(mask)) == {0.0, 1.0} and 0.2 < 1 - mask.mean() < 0.3
    np.testing.assert_allclose(y, x * mask / 0.75, rtol=1e-12, atol=1e-12)
    layer.set_training(False)
    y, mask = (o.to_numpy() for o in layer.forward([x]))
    np.testing.assert_array_equal(y, x)
    assert (mask == 1).all()


def test_batch_norm_keeps_float32_precision_where_the_mean_dwarfs_the_spread():
    """Values 1e3 + 1e-2 noise per channel: the output x scale + (beta - mean scale) added two terms of 1e5 that
    cancel, and the float32 sum of the mean erred by about 1e-4, a percent of the spread; the output was 0.017 off
    and the input gradient 0.23 (of 280), 3 and 7 times PyTorch's float32 errors. Centred first, with the mean
    corrected by the deviations' own mean, both are within float32's reach of the float64 formula."""
    rng = np.random.default_rng(12)
    x = (1e3 + 1e-2 * rng.standard_normal((8, 2, 3, 3))).astype(np.float32)
    layer = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("bn", lp.BatchNormConfig()), seed=0)
    layer.set_training(True)
    y = layer.forward([x])[0].to_numpy()
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = layer.backward([dy])[0].to_numpy()
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    mean = x64.mean(axis=(0, 2, 3), keepdims=True)
    var = x64.var(axis=(0, 2, 3), keepdims=True)
    xhat = (x64 - mean) / np.sqrt(var + 1e-5)
    m = x.size // x.shape[1]
    want_dx = (dy64 - dy64.mean(axis=(0, 2, 3), keepdims=True)
               - xhat * (dy64 * xhat).sum(axis=(0, 2, 3), keepdims=True) / m) / np.sqrt(var + 1e-5)
    assert np.abs(y - xhat).max() < 5e-3  # (float32 holds a mean of 1e3 to 3e-5: 3e-3 of the spread)
    assert np.abs(dx - want_dx).max() < 0.1 and np.abs(want_dx).max() > 100
