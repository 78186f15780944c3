"""The native backend's own paths: its convolution layouts, each forced on shapes that would not pick it, against
loop references and central differences; scratch shared by layers; pooling in pieces (float64 unless said)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import reference as ref
from gradcheck import check_layer_gradients

import leafpy as lp

# (N, C, H, W), (O, kh, kw), stride, padding
SHAPES = [
    ((2, 3, 7, 6), (4, 3, 3), (1, 1), (1, 1)),
    ((3, 2, 9, 8), (5, 3, 2), (2, 1), (0, 1)),
    ((2, 1, 10, 10), (3, 5, 5), (1, 1), (2, 2)),
    ((1, 4, 6, 9), (2, 2, 4), (2, 3), (1, 0)),
]
PATHS = {
    "per-image": {"PER_IMAGE_MAX_K": 10**9, "PER_IMAGE_MIN_P": 0},
    "batch-innermost": {"PER_IMAGE_MAX_K": 0},
    "batch-innermost, split filter gradient": {"PER_IMAGE_MAX_K": 0, "FILTER_SPLIT": 4},
    "batch-innermost, in pieces": {"PER_IMAGE_MAX_K": 0, "CONV_PIECE_BYTES": 1},
    "batch-innermost, in pieces of the batch": {"PER_IMAGE_MAX_K": 0, "CONV_PIECE_BYTES": 1, "CONV_BATCH_PIECE_MIN": 0},
}


def _force(backend, monkeypatch, path):
    for name, value in PATHS[path].items():
        monkeypatch.setattr(backend, name, value)


def _conv_passes(backend, x, w, b, dy, stride, padding, dw0):
    """Forward (with bias), data gradient and filter gradient (beta 0.5 onto dw0) through the primitives."""
    ws: dict = {}
    out = np.empty(dy.shape)
    backend.conv2d(x, w, out, stride, padding, ws, b)
    dx = np.empty(x.shape)
    backend.conv2d_grad_data(dy, w, dx, stride, padding, ws)
    dw = dw0.copy()
    backend.conv2d_grad_filter(x, dy, dw, stride, padding, ws, 0.5)
    alone = dw0.copy()  # without the forward pass's columns at hand
    backend.conv2d_grad_filter(x, dy, alone, stride, padding, {}, 0.5)
    np.testing.assert_allclose(alone, dw, rtol=1e-12, atol=1e-12)
    return out, dx, dw


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("shape,filt,stride,padding", SHAPES)
def test_convolution_layouts_match_loop_reference(native64, monkeypatch, rng, path, shape, filt, stride, padding):
    _force(native64, monkeypatch, path)
    x = rng.standard_normal(shape)
    w = rng.standard_normal((filt[0], shape[1], filt[1], filt[2]))
    b = rng.standard_normal(filt[0])
    want_y = ref.conv2d(x, w, b, stride, padding)
    dy = rng.standard_normal(want_y.shape)
    dw0 = rng.standard_normal(w.shape)
    y, dx, dw = _conv_passes(native64, x, w, b, dy, stride, padding, dw0)
    want_dx, want_dw, _ = ref.conv2d_backward(x, w, dy, stride, padding)
    np.testing.assert_allclose(y, want_y, rtol=1e-10, atol=1e-10)
    no_bias = np.empty(want_y.shape)
    native64.conv2d(x, w, no_bias, stride, padding, {}, None)
    np.testing.assert_allclose(no_bias, ref.conv2d(x, w, None, stride, padding), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dw, want_dw + 0.5 * dw0, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("path", list(PATHS))
def test_convolution_layouts_pass_gradient_checks(native64, monkeypatch, path):
    _force(native64, monkeypatch, path)
    cfg = lp.ConvolutionConfig(num_output=3, filter_shape=[3, 2], stride=[1, 2], padding=[1, 1])
    layer = lp.Layer.from_config(native64, lp.LayerConfig("c", cfg), seed=2)
    x = np.random.default_rng(5).standard_normal((2, 2, 5, 6))
    assert check_layer_gradients(layer, [x]) >= x.size


def test_the_shapes_pick_their_layouts(native):
    """LeNet's first convolution (1 channel, 24 x 24 outputs) takes per-image columns, its second (20 channels of
    5 x 5, 8 x 8 outputs) the batch-innermost ones, whole at batch 64 and in pieces of the batch at 1024; AlexNet's
    second (96 channels of 5 x 5, 27 x 27 outputs) at batch 128 in pieces of output rows."""
    plain = ((1, 1), (0, 0), (1, 1), 1)
    assert native._conv_path((64, 1, 28, 28), (20, 1, 5, 5), (64, 20, 24, 24), *plain) == "per_image"
    assert native._conv_path((64, 20, 12, 12), (50, 20, 5, 5), (64, 50, 8, 8), *plain) == "shared"
    assert native._conv_path((1024, 20, 12, 12), (50, 20, 5, 5), (1024, 50, 8, 8), *plain) == "images"
    assert native._conv_path((128, 96, 27, 27), (256, 96, 5, 5), (128, 256, 27, 27), (1, 1), (2, 2), (1, 1),
                             1) == "shared"
    assert native._conv_path((64, 20, 12, 12), (50, 10, 5, 5), (64, 50, 8, 8), (1, 1), (0, 0), (1, 1),
                             2) == "general"
    assert not native._per_image((20, 1, 5, 5), (64, 20, 8, 8))


def test_float32_layouts_agree(native, monkeypatch, rng):
    """float32 convolutions through both layouts agree with the float64 loop reference to float32 rounding."""
    x = rng.standard_normal((4, 1, 20, 20)).astype(np.float32)
    w = rng.standard_normal((6, 1, 5, 5)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    want = ref.conv2d(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64))
    for path in ("per-image", "batch-innermost"):
        with monkeypatch.context() as m:
            _force(native, m, path)
            out = np.empty(want.shape, np.float32)
            native.conv2d(x, w, out, (1, 1), (0, 0), {}, b)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4, err_msg=path)


@pytest.mark.parametrize("mode,kernel,stride,padding", [
    ("max", (2, 2), (2, 2), (0, 0)), ("max", (3, 3), (2, 2), (1, 1)), ("average", (3, 2), (2, 1), (1, 0))])
def test_pooling_in_pieces_matches_whole(native64, monkeypatch, rng, mode, kernel, stride, padding):
    """Pooling in pieces of one sample gives what one pass over the batch gives, argmax positions included."""
    x = rng.permutation(np.arange(5 * 3 * 7 * 6)).reshape(5, 3, 7, 6) * 0.01
    oh = (7 + 2 * padding[0] - kernel[0]) // stride[0] + 1
    ow = (6 + 2 * padding[1] - kernel[1]) // stride[1] + 1
    dy = rng.standard_normal((5, 3, oh, ow))
    results = []
    for piece in (1 << 30, 1):
        monkeypatch.setattr(native64, "POOL_PIECE_BYTES", piece)
        out, mask, dx = np.empty(dy.shape), np.full(dy.shape, -1, np.int32), np.empty(x.shape)
        native64.pool2d(x, out, mask, mode, kernel, stride, padding)
        native64.pool2d_grad(dy, dx, mask, mode, kernel, stride, padding)
        results.append((out, mask, dx))
    (out, mask, dx), (out1, mask1, dx1) = results
    np.testing.assert_array_equal(out1, out)
    np.testing.assert_allclose(dx1, dx, rtol=1e-12, atol=1e-12)
    if mode == "max":
        np.testing.assert_array_equal(mask1, mask)
    if mode == "max" and padding == (0, 0):
        want, arg = ref.maxpool(x, kernel[0], stride[0])
        np.testing.assert_array_equal(out1, want)
        np.testing.assert_allclose(dx1, ref.maxpool_backward(x.shape, arg, dy), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", ["batch-innermost", "batch-innermost, in pieces"])
def test_layers_sharing_scratch_pass_gradient_checks(native64, monkeypatch, path):
    """Three convolutions of different sizes in a row share the native backend's per-call scratch (one buffer per
    name, grown to the largest); the network's gradients still pass the check."""
    _force(native64, monkeypatch, path)
    cfg = lp.SequentialConfig(inputs=[("data", [2, 2, 7, 7])], force_backward=True)
    cfg.add_layer(lp.LayerConfig("c1", lp.ConvolutionConfig(num_output=3, filter_shape=[3], padding=[1])))
    cfg.add_layer(lp.LayerConfig("t1", "TanH"))
    cfg.add_layer(lp.LayerConfig("c2", lp.ConvolutionConfig(num_output=4, filter_shape=[2], stride=[2])))
    cfg.add_layer(lp.LayerConfig("t2", "TanH"))
    cfg.add_layer(lp.LayerConfig("c3", lp.ConvolutionConfig(num_output=2, filter_shape=[3], padding=[2])))
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", cfg), seed=4)
    x = np.random.default_rng(3).standard_normal((2, 2, 7, 7))
    checked = check_layer_gradients(net, [x])
    assert checked == x.size + sum(w.size for w in net.learnable_weights_data())
    assert ("y_t", np.dtype(np.float64)) in native64._threads.work


def test_networks_in_two_threads_keep_their_own_scratch():
    """The backend is shared (lp.backend returns one instance), its per-call scratch is not: two networks run
    forward and backward at the same time in two threads and get what they get alone."""
    be = lp.backend("native")

    def lenet(seed):
        cfg = lp.SequentialConfig(inputs=[("data", [8, 1, 20, 20])], force_backward=True)
        cfg.add_layer(lp.LayerConfig("conv1", lp.ConvolutionConfig(num_output=8, filter_shape=[5])))
        cfg.add_layer(lp.LayerConfig("pool1", lp.PoolingConfig(mode="max", filter_shape=[2], stride=[2])))
        cfg.add_layer(lp.LayerConfig("conv2", lp.ConvolutionConfig(num_output=16, filter_shape=[3])))
        cfg.add_layer(lp.LayerConfig("flat", "Flatten"))
        cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=10)))
        return lp.Layer.from_config(be, lp.LayerConfig("net", cfg), seed=seed)

    rng = np.random.default_rng(0)
    nets = [lenet(seed) for seed in range(2)]
    xs = [rng.random((8, 1, 20, 20), dtype=np.float32) for _ in nets]
    dys = [rng.random((8, 10), dtype=np.float32) for _ in nets]

    def run(i):
        out = nets[i].forward([xs[i]])[0].to_numpy().copy()
        dx = nets[i].backward([dys[i]])[0].to_numpy().copy()
        return out, dx, [g.to_numpy().copy() for g in nets[i].learnable_weights_gradients()]

    alone = [run(i) for i in range(2)]
    wrong = []

    def repeat(i):
        for _ in range(40):
            got = run(i)
            if not all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in
                       zip([got[0], got[1], *got[2]], [alone[i][0], alone[i][1], *alone[i][2]])):
                wrong.append(i)

    threads = [threading.Thread(target=repeat, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, f"{len(wrong)} of 80 concurrent runs differ from the runs alone"


def test_solvers_in_two_threads_train_as_they_do_alone():
    """Adam's update works in per-call scratch pieces too: two solvers training at once in two threads end with
    the weights each reaches alone."""
    be = lp.backend("native")
    rng = np.random.default_rng(1)
    xs = [rng.random((16, 300), dtype=np.float32) for _ in range(2)]
    ys = [rng.integers(0, 5, 16) for _ in range(2)]

    def solver(seed):
        net = lp.SequentialConfig(inputs=[("data", [16, 300])])
        net.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=400)))  # 120k weights: two update pieces
        net.add_layer(lp.LayerConfig("relu", "ReLU"))
        net.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=5)))
        net.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
        obj = lp.SequentialConfig(inputs=[("out", [16, 5]), ("label", [16, 1])])
        obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=5)))
        return lp.Solver.from_config(be, be, lp.SolverConfig(
            network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj), solver="adam",
            base_lr=0.01, seed=seed))

    def train(s, i):
        for _ in range(30):
            s.train_minibatch(xs[i], ys[i])

    alone = []
    for i in range(2):
        s = solver(i)
        train(s, i)
        alone.append([w.to_numpy() for w in s.network.learnable_weights_data()])
    together = [solver(i) for i in range(2)]
    threads = [threading.Thread(target=train, args=(together[i], i)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        for got, want in zip(together[i].network.learnable_weights_data(), alone[i]):
            np.testing.assert_allclose(got.to_numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape,kernel,stride", [((2, 3, 8, 6), (2, 2), (2, 2)), ((2, 3, 9, 7), (2, 2), (2, 2)),
                                                 ((1, 2, 9, 9), (2, 2), (3, 3)), ((1, 2, 6, 6), (3, 2), (3, 2))])
@pytest.mark.parametrize("mode", ["max", "average"])
def test_pooling_gradient_writes_every_input(native64, rng, shape, kernel, stride, mode):
    """Windows that tile the input write every element of dx; inputs no window covers (a ragged edge, gaps between
    windows) get zero: nothing of what dx held before survives."""
    x = rng.permutation(np.arange(np.prod(shape))).reshape(shape) * 0.01
    oh, ow = (shape[2] - kernel[0]) // stride[0] + 1, (shape[3] - kernel[1]) // stride[1] + 1
    dy = rng.standard_normal((shape[0], shape[1], oh, ow))
    out, mask = np.empty(dy.shape), np.empty(dy.shape, np.int32)
    native64.pool2d(x, out, mask, mode, kernel, stride, (0, 0))
    dx = np.full(shape, np.nan)
    native64.pool2d_grad(dy, dx, mask, mode, kernel, stride, (0, 0))
    want = np.zeros(shape)
    for i in range(oh):
        for j in range(ow):
            rows = slice(i * stride[0], i * stride[0] + kernel[0])
            cols = slice(j * stride[1], j * stride[1] + kernel[1])
            win = x[:, :, rows, cols].reshape(shape[0], shape[1], -1)
            if mode == "max":
                hit = (win == win.max(axis=2, keepdims=True)).reshape(shape[0], shape[1], *kernel)
                want[:, :, rows, cols] += hit * dy[:, :, i:i + 1, j:j + 1]
            else:
                want[:, :, rows, cols] += dy[:, :, i:i + 1, j:j + 1] / (kernel[0] * kernel[1])
    np.testing.assert_allclose(dx, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
def test_relu_in_pieces_is_max_of_x_and_zero(monkeypatch, dtype, in_place):
    """ReLU on native runs in pieces against an array of zeros (NumPy's fast loop): every piece, the last one short,
    equals max(x, 0) elementwise as float64 NumPy's formula gives it (NaN stays NaN, -inf is 0, inf stays), in place
    and not, and a channels-last (non-contiguous) view takes the general path with the same values."""
    be = lp.backend("native", dtype=dtype)
    monkeypatch.setattr(be, "RELU_PIECE", 1000)
    x = np.random.default_rng(8).standard_normal(3 * 1000 + 17).astype(dtype)
    x[[0, 999, 1000, 2500]] = [np.nan, -np.inf, np.inf, -0.0]
    want = np.where(np.isnan(x), np.nan, np.where(x.astype(np.float64) > 0, x, 0.0))
    out = x.copy() if in_place else np.full_like(x, 7.0)
    be.activation("relu", out if in_place else x, out)
    np.testing.assert_array_equal(out, want)
    nhwc = np.random.default_rng(9).standard_normal((2, 5, 6, 3)).astype(dtype).transpose(0, 3, 1, 2)
    got = np.empty_like(nhwc)
    be.activation("relu", nhwc, got)
    np.testing.assert_array_equal(got, np.maximum(nhwc, 0))
