"""Every registered layer's input and weight gradients against central differences (float64, native)."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_layer_gradients

import leafpy as lp
from leafpy.layers.common.matmul import MatMulConfig
from leafpy.layers.container.wiring import wire
from leafpy.layers.loss.negative_log_likelihood import SoftmaxCrossEntropyConfig
from leafpy.layers.utility.transpose import TransposeConfig


def away_from_zero(rng, shape, gap=0.05):
    x = rng.uniform(-1, 1, shape)
    return np.where(np.abs(x) < gap, np.sign(x + 1e-12) * gap + x, x)


def distinct(rng, shape):
    """Values at least 0.01 apart, so max pooling never has near ties."""
    return rng.permutation(np.arange(np.prod(shape))).reshape(shape) * 0.01 - 0.3


def labels(rng, n, k):
    return rng.integers(0, k, (n, 1)).astype(np.float64)


def ignoring(rng, shape, k, ignore):
    """Class labels of ``shape`` with every third one ``ignore``."""
    out = rng.integers(0, k, shape).astype(np.float64)
    out.reshape(-1)[::3] = ignore
    return out


NLL = lp.NegativeLogLikelihoodConfig
SCE = SoftmaxCrossEntropyConfig
LOSS_CASES = [  # (options, scores shape, labels shape, ignore_index): every reduction, weights and ignore_index
    (dict(reduction="sum", weight=(0.5, 2.0, 1.0, 0.0, 3.0)), (4, 5), (4, 1), None),
    (dict(reduction="none", ignore_index=1), (3, 4, 2, 2), (3, 2, 2), 1),
    (dict(weight=(1.5, 0.25, 2.0), ignore_index=-1), (6, 3), (6,), -1),
    (dict(reduction="none", weight=(1.0, 3.0, 0.5)), (2, 3, 5), (2, 5), None),
    (dict(reduction="sum", ignore_index=4), (2, 5, 3), (2, 1, 3), 4),
]


def loss_inputs(scores, labels_shape, k, ignore):
    def make(r):
        return [r.standard_normal(scores), r.integers(0, k, labels_shape).astype(np.float64) if ignore is None
                else ignoring(r, labels_shape, k, ignore)]
    return make


def loss_cases(config_class):
    return [(config_class(num_classes=s[1], **o), loss_inputs(s, ls, s[1], i)) for o, s, ls, i in LOSS_CASES]


# One or more cases for every registered layer type; test_every_layer_type_has_a_case keeps this complete.
CASES = {
    "Linear": [
        (lp.LinearConfig(output_size=5), lambda r: [r.standard_normal((3, 4))]),
        (lp.LinearConfig(output_size=3, bias=False), lambda r: [r.standard_normal((2, 2, 3))]),
        (lp.LinearConfig(output_size=3, axis=-1), lambda r: [r.standard_normal((2, 4, 5))]),  # per time step
    ],
    "Convolution": [
        (lp.ConvolutionConfig(num_output=4, filter_shape=[3], stride=[1], padding=[1]),
         lambda r: [r.standard_normal((2, 3, 5, 5))]),
        (lp.ConvolutionConfig(num_output=2, filter_shape=[3, 2], stride=[1, 2], padding=[1, 0]),
         lambda r: [r.standard_normal((2, 2, 5, 6))]),
        (lp.ConvolutionConfig(num_output=4, filter_shape=[3], padding=[1], group=2),
         lambda r: [r.standard_normal((2, 4, 4, 5))]),
        (lp.ConvolutionConfig(num_output=3, filter_shape=[3], padding=[1], group=3, bias=False),  # depthwise
         lambda r: [r.standard_normal((2, 3, 5, 4))]),
        (lp.ConvolutionConfig(num_output=2, filter_shape=[3, 2], dilation=[2, 3], padding=[2, 1], stride=[1, 2]),
         lambda r: [r.standard_normal((2, 2, 6, 7))]),
        (lp.ConvolutionConfig(num_output=4, filter_shape=[2, 3], stride=[2, 1], padding=[0, 2], pad_end=[1, 0],
                              dilation=[1, 2], group=2),  # asymmetric padding
         lambda r: [r.standard_normal((1, 4, 5, 6))]),
    ],
    "Deconvolution": [
        (lp.DeconvolutionConfig(num_output=3, filter_shape=[3], stride=[2], padding=[1]),
         lambda r: [r.standard_normal((2, 2, 3, 3))]),
        (lp.DeconvolutionConfig(num_output=2, filter_shape=[2, 3], stride=[2, 1], output_padding=[1, 0],
                                bias=False), lambda r: [r.standard_normal((1, 3, 3, 4))]),
        (lp.DeconvolutionConfig(num_output=4, filter_shape=[3], stride=[1], padding=[2, 1], pad_end=[1, 0],
                                dilation=[2, 1], group=2), lambda r: [r.standard_normal((2, 4, 4, 3))]),
    ],
    "Pooling": [
        (lp.PoolingConfig(mode="max", filter_shape=[2], stride=[2]), lambda r: [distinct(r, (2, 2, 4, 4))]),
        (lp.PoolingConfig(mode="max", filter_shape=[3], stride=[2], padding=[1]),
         lambda r: [distinct(r, (1, 2, 5, 5))]),
        (lp.PoolingConfig(mode="average", filter_shape=[3, 2], stride=[2, 1], padding=[1, 0]),
         lambda r: [r.standard_normal((2, 2, 5, 4))]),
        (lp.PoolingConfig(mode="max", filter_shape=[3], stride=[2], ceil_mode=True),
         lambda r: [distinct(r, (1, 2, 6, 5))]),
        (lp.PoolingConfig(mode="average", filter_shape=[3], stride=[2], padding=[1], ceil_mode=True,
                          count_include_pad=False), lambda r: [r.standard_normal((2, 2, 6, 5))]),
        (lp.PoolingConfig(mode="average", filter_shape=[2, 3], stride=[1, 2], padding=[0, 1], pad_end=[1, 2]),
         lambda r: [r.standard_normal((1, 2, 4, 6))]),
        (lp.PoolingConfig(mode="max", filter_shape=[2, 3], stride=[2, 1], padding=[1, 0], pad_end=[0, 2]),
         lambda r: [distinct(r, (1, 2, 5, 4))]),
        (lp.PoolingConfig(mode="average", global_pooling=True), lambda r: [r.standard_normal((2, 3, 3, 4))]),
        (lp.PoolingConfig(mode="max", global_pooling=True), lambda r: [distinct(r, (2, 2, 3, 3))]),
    ],
    "ReLU": [("ReLU", lambda r: [away_from_zero(r, (3, 7))])],
    "Sigmoid": [("Sigmoid", lambda r: [r.standard_normal((3, 5))])],
    "TanH": [("TanH", lambda r: [r.standard_normal((3, 5))])],
    "LeakyReLU": [(lp.LeakyReLUConfig(negative_slope=0.2), lambda r: [away_from_zero(r, (3, 7))])],
    "ELU": [(lp.ELUConfig(alpha=0.7), lambda r: [2 * away_from_zero(r, (3, 7))])],
    "GELU": [(lp.GELUConfig(), lambda r: [2 * r.standard_normal((3, 5))]),
             (lp.GELUConfig(approximate="tanh"), lambda r: [2 * r.standard_normal((3, 5))])],
    "Softplus": [(lp.SoftplusConfig(), lambda r: [3 * r.standard_normal((3, 5))]),
                 # beta x on both sides of the threshold, away from it (the function steps there)
                 (lp.SoftplusConfig(beta=2.0, threshold=1.5), lambda r: [0.75 + away_from_zero(r, (3, 7), 0.1)])],
    "SiLU": [("SiLU", lambda r: [2 * r.standard_normal((3, 5))])],
    # inputs on both sides of each bound, away from it (the gradient steps there)
    "Clip": [(lp.ClipConfig(), lambda r: [3 + 4 * away_from_zero(r, (3, 7))]),
             (lp.ClipConfig(lower=-1.0, upper=0.5), lambda r: [np.where(r.random((3, 7)) < 0.5, -1.0, 0.5)
                                                                 + 0.5 * away_from_zero(r, (3, 7), 0.1)])],
    "Swish": [("Swish", lambda r: [2 * r.standard_normal((2, 3))])],
    "Softmax": [("Softmax", lambda r: [r.standard_normal((3, 5))]),
                ("Softmax", lambda r: [r.standard_normal((2, 3, 2))]),
                ("Softmax", lambda r: [r.standard_normal((2, 300))]),  # long rows: a workgroup per row
                (lp.SoftmaxConfig(axis=-1), lambda r: [r.standard_normal((2, 3, 4))]),
                (lp.SoftmaxConfig(axis=0), lambda r: [r.standard_normal((3, 2, 2))])],
    "LogSoftmax": [("LogSoftmax", lambda r: [r.standard_normal((3, 5))]),
                   ("LogSoftmax", lambda r: [r.standard_normal((2, 4, 3))]),
                   ("LogSoftmax", lambda r: [r.standard_normal((2, 100, 3))]),
                   (lp.LogSoftmaxConfig(axis=2), lambda r: [r.standard_normal((2, 3, 5))])],
    "NegativeLogLikelihood": [
        (lp.NegativeLogLikelihoodConfig(num_classes=5), lambda r: [r.standard_normal((4, 5)), labels(r, 4, 5)]),
        (lp.NegativeLogLikelihoodConfig(num_classes=3),
         lambda r: [r.standard_normal((6, 3)), labels(r, 6, 3).reshape(6)]),
        *loss_cases(NLL),
    ],
    "SoftmaxCrossEntropy": [
        (SCE(num_classes=5), lambda r: [r.standard_normal((4, 5)), labels(r, 4, 5)]),
        *loss_cases(SCE),
        (SCE(num_classes=4, log_prob=True, weight=(1.0, 0.5, 2.0, 1.5), ignore_index=2),  # both outputs' gradients
         loss_inputs((3, 4, 2), (3, 2), 4, 2)),
    ],
    "MeanSquaredError": [("MeanSquaredError", lambda r: [r.standard_normal((3, 4)), r.standard_normal((3, 4))])],
    "Reshape": [(lp.ReshapeConfig(shape=[1, 3, -1]), lambda r: [r.standard_normal((2, 6))]),
                (lp.ReshapeConfig(shape=[-1, 4], whole_shape=True), lambda r: [r.standard_normal((2, 3, 4))]),
                (lp.ReshapeConfig(shape=[-1, 2, 3]), lambda r: [r.standard_normal((2, 6))])],  # -1: the batch
    "Transpose": [(TransposeConfig(perm=[1, 0, 2]), lambda r: [r.standard_normal((3, 2, 4))]),
                  (TransposeConfig(perm=[2, 0, 3, 1]), lambda r: [r.standard_normal((2, 3, 4, 5))])],
    "MatMul": [("MatMul", lambda r: [r.standard_normal((2, 3, 4)), r.standard_normal((2, 4, 5))]),
               ("MatMul", lambda r: [r.standard_normal((3, 1, 2, 4)), r.standard_normal((2, 4, 3))]),  # broadcast
               (MatMulConfig(weight_shape=(1, 2, 4, 3)), lambda r: [r.standard_normal((3, 1, 5, 4))]),
               (MatMulConfig(weight_shape=(4, 2)), lambda r: [r.standard_normal((3, 4))])],
    "Flatten": [("Flatten", lambda r: [r.standard_normal((2, 3, 2, 2))]),
                (lp.FlattenConfig(axis=2), lambda r: [r.standard_normal((2, 3, 2, 2))]),
                (lp.FlattenConfig(axis=0), lambda r: [r.standard_normal((2, 3, 2))]),
                (lp.FlattenConfig(axis=-1), lambda r: [r.standard_normal((2, 3, 4))])],
    "Dropout": [(lp.DropoutConfig(ratio=0.3), lambda r: [r.standard_normal((4, 6))]),
                (lp.DropoutConfig(ratio=0.4, mask_output=True), lambda r: [r.standard_normal((3, 5))])],
    "BatchNorm": [(lp.BatchNormConfig(), lambda r: [r.standard_normal((4, 3, 2, 2)) * 2 + 1]),
                  (lp.BatchNormConfig(affine=False, eps=1e-3, momentum=0.5), lambda r: [r.standard_normal((5, 3))])],
    "Eltwise": [(lp.EltwiseConfig(), lambda r: [r.standard_normal((3, 4)), r.standard_normal((3, 4))]),
                (lp.EltwiseConfig(operation="sum", coeff=[0.5, -2.0, 1.5]),
                 lambda r: [r.standard_normal((2, 3, 2)) for _ in range(3)]),
                (lp.EltwiseConfig(operation="prod"), lambda r: [r.standard_normal((2, 5)) for _ in range(3)]),
                (lp.EltwiseConfig(operation="max"),  # distinct values: no near ties between the inputs
                 lambda r: list(distinct(r, (3, 2, 3, 2)))),
                (lp.EltwiseConfig(operation="max"), lambda r: list(distinct(r, (2, 4, 5)))),
                # broadcasting (NumPy's rules), and a weight operand
                (lp.EltwiseConfig(), lambda r: [r.standard_normal((3, 4, 5)), r.standard_normal((5,))]),
                (lp.EltwiseConfig(operation="prod"), lambda r: [r.standard_normal((3, 1, 5)),
                                                                r.standard_normal((2, 1))]),
                (lp.EltwiseConfig(operation="max"), lambda r: [distinct(r, (3, 4)), distinct(r, (3, 1)) + 0.005]),
                (lp.EltwiseConfig(coeff=[1.0, 0.5], weight_shape=[3, 4]), lambda r: [r.standard_normal((2, 3, 4))]),
                (lp.EltwiseConfig(operation="prod", weight_shape=[1, 4]), lambda r: [r.standard_normal((2, 3, 4))])],
    "Concat": [(lp.ConcatConfig(), lambda r: [r.standard_normal((2, 3, 2, 2)), r.standard_normal((2, 1, 2, 2)),
                                              r.standard_normal((2, 2, 2, 2))]),
               (lp.ConcatConfig(axis=-1), lambda r: [r.standard_normal((3, 2)), r.standard_normal((3, 4))]),
               (lp.ConcatConfig(axis=2), lambda r: [r.standard_normal((2, 2, 1, 3)), r.standard_normal((2, 2, 3, 3))])],
    "LRN": [(lp.LRNConfig(local_size=3, alpha=0.5, beta=0.75, k=2.0),
             lambda r: [r.standard_normal((2, 5, 2, 2))]),
            (lp.LRNConfig(local_size=5, alpha=1.5, beta=0.6, k=1.0), lambda r: [r.standard_normal((2, 4, 3))])],
    "Embedding": [(lp.EmbeddingConfig(input_dim=7, output_dim=3),  # repeated ids: their gradients add up
                   lambda r: [r.integers(0, 7, (3, 5)).astype(np.float64)]),
                  (lp.EmbeddingConfig(input_dim=5, output_dim=2), lambda r: [np.array([4.0, 0.0, 4.0, 2.0])])],
    "LSTM": [(lp.LSTMConfig(hidden_size=3), lambda r: [r.standard_normal((2, 4, 3))]),
             (lp.LSTMConfig(hidden_size=2, return_sequences=False), lambda r: [r.standard_normal((3, 3, 2))]),
             (lp.LSTMConfig(hidden_size=3, return_cell_state=True), lambda r: [r.standard_normal((2, 3, 2))]),
             (lp.LSTMConfig(hidden_size=2, return_sequences=False, return_cell_state=True),
              lambda r: [r.standard_normal((2, 4, 3))])],
    "GRU": [(lp.GRUConfig(hidden_size=3), lambda r: [r.standard_normal((2, 4, 3))]),
            (lp.GRUConfig(hidden_size=2, return_sequences=False), lambda r: [r.standard_normal((3, 3, 2))]),
            (lp.GRUConfig(hidden_size=3, linear_before_reset=False), lambda r: [r.standard_normal((2, 4, 3))]),
            (lp.GRUConfig(hidden_size=2, return_sequences=False, linear_before_reset=False),
             lambda r: [r.standard_normal((3, 3, 2))])],
    "RNN": [(lp.RNNConfig(hidden_size=3), lambda r: [r.standard_normal((2, 4, 2))]),
            (lp.RNNConfig(hidden_size=4, return_sequences=False), lambda r: [r.standard_normal((2, 3, 3))])],
    "Slice": [(lp.SliceConfig(slice_points=[1, 3]), lambda r: [r.standard_normal((2, 5, 2, 2))]),
              (lp.SliceConfig(axis=-1, slice_points=[2]), lambda r: [r.standard_normal((3, 2, 5))])],
}


def _params():
    for type_name, cases in sorted(CASES.items()):
        for i, case in enumerate(cases):
            yield pytest.param(type_name, case, id=f"{type_name}-{i}")


def test_every_layer_type_has_a_case():
    missing = set(lp.layer_types()) - set(CASES) - {"Sequential"}
    assert not missing, f"layer types without a gradient check: {sorted(missing)}"


@pytest.mark.parametrize("type_name,case", list(_params()))
def test_layer_gradients(native64, type_name, case):
    config, make_inputs = case
    rng = np.random.default_rng(7)
    layer = lp.Layer.from_config(native64, lp.LayerConfig("l", config), seed=3)
    inputs = make_inputs(rng)
    hook = (lambda: setattr(layer.worker, "calls", 0)) if type_name == "Dropout" else (lambda: None)
    checked = check_layer_gradients(layer, inputs, before_forward=hook)
    assert checked >= inputs[0].size


def test_dropout_check_really_drops(native64):
    layer = lp.Layer.from_config(native64, lp.LayerConfig("d", lp.DropoutConfig(ratio=0.5)), seed=1)
    x = np.ones((50, 40))
    y = layer.forward([x])[0].to_numpy()
    assert 0.4 < np.mean(y == 0) < 0.6
    assert np.allclose(y[y != 0], 2.0)
    layer.set_training(False)
    assert np.allclose(layer.forward([x])[0].to_numpy(), x)


def nested_config(force_backward=True):
    inner = lp.SequentialConfig(inputs=[("h", [2, 6])])
    inner.add_layer(lp.LayerConfig("fc_a", lp.LinearConfig(output_size=5)))
    inner.add_layer(lp.LayerConfig("tanh_a", "TanH"))
    inner.add_layer(lp.LayerConfig("fc_b", lp.LinearConfig(output_size=4)))
    outer = lp.SequentialConfig(inputs=[("data", [2, 1, 4, 4])], force_backward=force_backward)
    outer.add_layer(lp.LayerConfig("conv", lp.ConvolutionConfig(num_output=2, filter_shape=[3], padding=[1])))
    outer.add_layer(lp.LayerConfig("pool", lp.PoolingConfig(mode="average", filter_shape=[2])))
    outer.add_layer(lp.LayerConfig("sig", "Sigmoid"))
    outer.add_layer(lp.LayerConfig("flat", "Flatten"))
    outer.add_layer(lp.LayerConfig("fc0", lp.LinearConfig(output_size=6)))
    outer.add_layer(lp.LayerConfig("block", inner))
    outer.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    return outer


def test_nested_sequential_gradients(native64):
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", nested_config()), seed=5)
    assert "block/fc_a/weight" in net.learnable_weights_names()
    x = np.random.default_rng(0).standard_normal((2, 1, 4, 4))
    checked = check_layer_gradients(net, [x])
    n_weights = sum(w.size for w in net.learnable_weights_data())
    assert checked == x.size + n_weights


@pytest.mark.parametrize("type_name,case", list(_params()))
def test_backward_reads_the_output_only_where_the_layer_says_so(native64, type_name, case):
    """A layer after this one may overwrite its output in place unless it declares ``backward_reads_output``; so
    the gradients of a layer that does not declare it must not change when its output is overwritten between
    forward and backward."""
    config, make_inputs = case
    layer = lp.Layer.from_config(native64, lp.LayerConfig("l", config), seed=3)
    inputs = make_inputs(np.random.default_rng(7))
    if type_name == "Dropout":
        layer.worker.calls = 0
    outs = layer.forward([x.copy() for x in inputs])
    dys = [np.random.default_rng(1).standard_normal(o.shape) for o in outs]
    honest = [g.to_numpy() if g is not None else None for g in layer.backward(dys)]
    if type_name == "Dropout":
        layer.worker.calls = 0
    outs = layer.forward([x.copy() for x in inputs])
    for o in outs:  # what an in-place ReLU, TanH or Sigmoid after it would leave there
        o.set(np.tanh(o.to_numpy()) + 0.5)
    changed = any(g is not None and not np.allclose(g.to_numpy(), h, rtol=1e-12, atol=1e-12)
                  for g, h in zip(layer.backward(dys), honest))
    assert not changed or layer.worker.backward_reads_output, (
        f"{type_name}: backward reads the layer's output but the worker does not declare backward_reads_output")


def test_an_activation_after_lrn_leaves_the_output_lrn_backward_reads(native64):
    """LRN then TanH: TanH runs in place only where LRN's backward does not need LRN's output."""
    cfg = lp.SequentialConfig(inputs=[("data", [2, 4, 3])], force_backward=True)
    cfg.add_layer(lp.LayerConfig("lrn", lp.LRNConfig(local_size=3, alpha=0.5, beta=0.75, k=2.0)))
    cfg.add_layer(lp.LayerConfig("act", "TanH"))
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", cfg), seed=0)
    x = np.random.default_rng(0).standard_normal((2, 4, 3))
    assert check_layer_gradients(net, [x]) == x.size


def _in_place_cases():
    for type_name, cases in sorted(CASES.items()):
        for i, (config, make_inputs) in enumerate(cases):
            worker = lp.Layer.from_config(lp.backend("native", dtype="float64"), lp.LayerConfig("l", config)).worker
            if worker.in_place and worker.num_inputs == 1 and worker.num_outputs == 1:
                yield pytest.param(config, make_inputs, id=f"{type_name}-{i}")


@pytest.mark.parametrize("config,make_inputs", list(_in_place_cases()))
def test_layers_that_run_in_place_have_the_gradients_of_their_own_run(native64, config, make_inputs):
    """Each layer that may run in place, after a Linear over the last axis (so it does run in place), in a network
    checked against central differences."""
    x = make_inputs(np.random.default_rng(7))[0]
    cfg = lp.SequentialConfig(inputs=[("data", list(x.shape))], force_backward=True)
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=x.shape[-1], axis=-1)))
    cfg.add_layer(lp.LayerConfig("l", config))
    assert wire(cfg).steps[1].in_place
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", cfg), seed=3)
    weights = net.learnable_weights_data()
    weights[0].set(np.eye(x.shape[-1]) + 0.1 * np.random.default_rng(2).standard_normal(weights[0].shape))
    if isinstance(config, lp.DropoutConfig):
        net.set_training(False)
    assert check_layer_gradients(net, [x]) >= x.size
