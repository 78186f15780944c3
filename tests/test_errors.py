"""Bad input raises the right LeafpyError subclass, naming the layer or config field and the fix."""

from __future__ import annotations

import numpy as np
import pytest

import leafpy as lp


def test_unknown_layer_type_lists_known_types():
    with pytest.raises(lp.ConfigError) as e:
        lp.LayerConfig("x", "Convolutoin")
    msg = str(e.value)
    assert "'Convolutoin'" in msg and "layer 'x'" in msg
    for known in ("Convolution", "Linear", "ReLU", "TanH", "Sequential"):
        assert known in msg


@pytest.mark.parametrize("make,field", [
    (lambda: lp.ConvolutionConfig(num_output=-4, filter_shape=[3]), "num_output"),
    (lambda: lp.ConvolutionConfig(num_output=4, filter_shape=[3, 3, 3]), "filter_shape"),
    (lambda: lp.ConvolutionConfig(num_output=4, filter_shape=[3], padding=[-1]), "padding"),
    (lambda: lp.LinearConfig(output_size=0), "output_size"),
    (lambda: lp.LinearConfig(output_size="ten"), "output_size"),
    (lambda: lp.PoolingConfig(mode="median", filter_shape=[2]), "mode"),
    (lambda: lp.PoolingConfig(filter_shape=[2], padding=[2]), "padding"),
    (lambda: lp.DropoutConfig(ratio=1.0), "ratio"),
    (lambda: lp.NegativeLogLikelihoodConfig(num_classes=0), "num_classes"),
    (lambda: lp.ReshapeConfig(shape=[1, -1, -1]), "shape"),
    (lambda: lp.WeightConfig(lr_mult=-1), "lr_mult"),
    (lambda: lp.FillerConfig(type="zeros"), "filler.type"),
    (lambda: lp.LayerConfig("fc", "Linear"), "LinearConfig"),
    (lambda: lp.SequentialConfig(inputs=[("data", [0, 3])]), "shape"),
])
def test_bad_config_values(make, field):
    with pytest.raises(lp.ConfigError, match=field):
        make()


def test_duplicate_layer_names():
    cfg = lp.SequentialConfig(inputs=[("data", [1, 2])])
    cfg.add_layer(lp.LayerConfig("a", "ReLU"))
    with pytest.raises(lp.ConfigError, match="'a'"):
        cfg.add_layer(lp.LayerConfig("a", "TanH"))


def test_wrong_number_of_inputs_names_the_layer(native):
    layer = lp.Layer.from_config(native, lp.LayerConfig("fc1", lp.LinearConfig(output_size=3)))
    with pytest.raises(lp.ShapeError) as e:
        layer.forward([np.zeros((64, 784)), np.zeros((64, 10))])
    assert str(e.value) == "layer 'fc1' (Linear): expected 1 input, got 2 (shapes (64, 784), (64, 10))"


def test_network_input_count_and_shape(native):
    cfg = lp.SequentialConfig(inputs=[("data", [8, 1, 28, 28])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    net = lp.Layer.from_config(native, lp.LayerConfig("lenet", cfg))
    with pytest.raises(lp.ShapeError, match=r"layer 'lenet' \(Sequential\): expected 1 input"):
        net.forward([np.zeros((8, 1, 28, 28)), np.zeros((8, 1))])
    with pytest.raises(lp.ShapeError) as e:
        net.forward([np.zeros((8, 1, 28, 27))])
    assert "'data'" in str(e.value) and "[N, 1, 28, 28]" in str(e.value) and "(8, 1, 28, 27)" in str(e.value)
    for not_a_list in (np.zeros((8, 1, 28, 28)), lp.SharedTensor.from_numpy(np.zeros((8, 1, 28, 28)))):
        with pytest.raises(lp.ShapeError, match=r"layer 'lenet': forward takes a list of inputs .*\[x\]"):
            net.forward(not_a_list)
    # a different batch size is fine
    assert net.forward([np.zeros((3, 1, 28, 28))])[0].shape == (3, 3)


def test_backward_before_forward(native):
    # a network is built with its tensors sized, so without this check backward would differentiate zeros
    cfg = lp.SequentialConfig(inputs=[("data", [4, 6])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    net = lp.Layer.from_config(native, lp.LayerConfig("mlp", cfg), seed=0)
    single = lp.Layer.from_config(native, lp.LayerConfig("fc1", lp.LinearConfig(output_size=3)), seed=0)
    for layer in (net, single):
        with pytest.raises(lp.ShapeError, match=rf"layer '{layer.name}': call forward before backward"):
            layer.backward([np.ones((4, 3), np.float32)])
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    net.forward([x])
    net.backward([np.ones((4, 3), np.float32)])
    np.testing.assert_allclose(net.learnable_weights_gradients()[0].to_numpy(), np.tile(x.sum(axis=0), (3, 1)))


def test_shapes_that_do_not_fit_between_layers_name_both(native):
    cfg = lp.SequentialConfig(inputs=[("data", [4, 10])])
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=16)))
    cfg.add_layer(lp.LayerConfig("conv2", lp.ConvolutionConfig(num_output=3, filter_shape=[3])))
    with pytest.raises(lp.ShapeError) as e:
        lp.Layer.from_config(native, lp.LayerConfig("net", cfg))
    msg = str(e.value)
    assert "layer 'conv2' (Convolution)" in msg and "(4, 16)" in msg and "layer 'fc1' (Linear)" in msg


def test_objective_class_count_mismatch(native):
    cfg = lp.SequentialConfig(inputs=[("network_out", [4, 12]), ("label", [4, 1])])
    cfg.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=10)))
    with pytest.raises(lp.ShapeError, match=r"layer 'nll' \(NegativeLogLikelihood\).*\[N, 10\].*\(4, 12\)"):
        lp.Layer.from_config(native, lp.LayerConfig("loss", cfg))


def test_label_out_of_range(native):
    layer = lp.Layer.from_config(native, lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=3)))
    with pytest.raises(lp.ShapeError, match=r"layer 'nll'.*label 1 is 3\.0.*\[0, 2\]"):
        layer.forward([np.zeros((2, 3)), np.array([0, 3])])
    with pytest.raises(lp.ShapeError, match="layer 'nll'"):
        layer.forward([np.zeros((2, 3)), np.array([0.5, 1])])


def test_missing_blob(native):
    cfg = lp.SequentialConfig(inputs=[("data", [1, 4])])
    cfg.add_layer(lp.LayerConfig("a", "ReLU", inputs=["nope"]))
    with pytest.raises(lp.ConfigError, match=r"layer 'a' \(ReLU\): input blob 'nope' does not exist.*data"):
        lp.Layer.from_config(native, lp.LayerConfig("net", cfg))


def test_too_small_input_for_filter(native):
    layer = lp.Layer.from_config(native, lp.LayerConfig("c", lp.ConvolutionConfig(num_output=1, filter_shape=[5])))
    with pytest.raises(lp.ShapeError, match=r"layer 'c' \(Convolution\).*smaller than the filter"):
        layer.forward([np.zeros((1, 1, 3, 3))])


def test_unknown_backend():
    with pytest.raises(lp.ConfigError, match="native, cuda, webgpu"):
        lp.backend("opencl")


@pytest.mark.parametrize("value", [-1, 0, float("nan"), "1e-4", True])
def test_a_bad_conv_tolerance_is_refused_before_the_gpu_is_looked_for(value):
    """Checked first, so the error is the same on a machine with or without a GPU."""
    with pytest.raises(lp.ConfigError, match=r"backend 'cuda': conv_tolerance: expected"):
        lp.backend("cuda", conv_tolerance=value)


def test_inputs_that_are_not_numbers_name_the_place(native):
    cfg = lp.SequentialConfig(inputs=[("data", [4, 5])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    net = lp.Layer.from_config(native, lp.LayerConfig("net", cfg))
    where = r"layer 'net' \(Sequential\): input 0: "
    with pytest.raises(lp.ShapeError, match=where + r"expected real numbers .*dtype <U1"):
        net.forward([np.full((4, 5), "a")])
    with pytest.raises(lp.ShapeError, match=where + r"expected real numbers .*dtype complex128"):
        net.forward([np.zeros((4, 5), complex)])
    with pytest.raises(lp.ShapeError, match=where + r"expected an array of numbers, got list"):
        net.forward([[[1.0, 2.0], [3.0]]])
    assert net.forward([[[1] * 5] * 4])[0].shape == (4, 3)  # nested lists and integers are fine
    with pytest.raises(lp.ShapeError, match=r"SharedTensor\.from_numpy: expected real numbers"):
        lp.SharedTensor.from_numpy("abc")
    alone = lp.Layer.from_config(native, cfg.layers[0])  # one layer as the outermost
    with pytest.raises(lp.ShapeError, match=r"layer 'fc': input 0: expected real numbers"):
        alone.forward([np.full((4, 5), "a")])
    with pytest.raises(lp.ShapeError, match=r"layer 'fc': input 0: expected an array of numbers, got list"):
        alone.forward([[[1.0, 2.0], [3.0]]])
    obj = lp.SequentialConfig(inputs=[("out", [4, 3]), ("label", [4, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=3)))
    solver = lp.Solver.from_config(native, native, lp.SolverConfig(
        network=lp.LayerConfig("net", cfg), objective=lp.LayerConfig("loss", obj), base_lr=0.1))
    with pytest.raises(lp.ShapeError, match=r"Solver\.train_minibatch: target: expected real numbers"):
        solver.train_minibatch(np.zeros((4, 5)), np.array(["0", "1", "2", "0"]))
    solver.train_minibatch(np.zeros((4, 5)), [0, 1, 2, 0])


def test_the_label_check_finds_the_first_value_that_is_no_class_index():
    """leafpy._checks.first_non_index, which checks every step's labels, against a plain loop over the values."""
    from leafpy._checks import first_non_index

    def expected(values, count):
        for i, v in enumerate(values.reshape(-1).tolist()):
            if not (v == v and 0 <= v < count and v == int(v)):  # (v == v: not NaN; inf fails the range)
                return i
        return None

    rng = np.random.default_rng(4)
    odd = [-1, 10, 11, 2.5, -0.5, np.nan, np.inf, -np.inf, 9.999, 1e30]
    for trial in range(400):
        n = int(rng.integers(1, 40))
        values = rng.integers(0, 10, n).astype(np.float64)
        for _ in range(int(rng.integers(0, 3))):
            values[rng.integers(0, n)] = odd[rng.integers(0, len(odd))]
        for dtype in (np.float32, np.float64):
            x = values.astype(dtype).reshape(-1, 1) if trial % 2 else values.astype(dtype)
            assert first_non_index(x, 10) == expected(x, 10), x.reshape(-1)
    for ints in (np.array([0, 3, 9], np.int64), np.array([0, 10], np.int32), np.array([-1, 2], np.int8),
                 np.array([True, False]), np.array([], np.float32)):
        assert first_non_index(ints, 10) == expected(ints, 10)
