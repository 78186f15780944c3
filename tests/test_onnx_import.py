"""ONNX import as a user meets it: a model written by hand with onnx's helper API, read through ``leafpy summary``,
``leafpy convert`` (both ways) and ``leafpy predict``; weights in leafpy's layouts; what leafpy cannot compute
refused naming the node, the operator and the attribute; damaged files refused clearly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import backend_or_skip, child_env

import leafpy as lp

onnx = pytest.importorskip("onnx", reason="ONNX import tests need the onnx package (pip install 'leafpy-dl[onnx]')")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def leafpy(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run([sys.executable, "-m", "leafpy", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> TensorProto:
    return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)


def small_cnn(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu -> MaxPool -> Flatten -> Gemm (transB=0, alpha) -> LogSoftmax, batch open."""
    inits = [_init(rng, "w", (4, 1, 3, 3)), _init(rng, "b", (4,)), _init(rng, "fc_w", (4 * 3 * 3, 5)),
             _init(rng, "fc_b", (5,)), _init(rng, "scale", (4,)), _init(rng, "shift", (4,)),
             _init(rng, "mean", (4,)), numpy_helper.from_array(rng.uniform(0.5, 2, 4).astype(np.float32), "var")]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv1", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["n"], name="bn1",
                         epsilon=1e-3, momentum=0.8),
        helper.make_node("Relu", ["n"], ["r"], name="relu1"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["g"], name="fc", alpha=0.5, beta=2.0),
        helper.make_node("LogSoftmax", ["g"], ["y"], name="logsm", axis=1),
    ]
    graph = helper.make_graph(nodes, "small_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                 ["batch", 1, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, {"x": x})[0]


def test_a_hand_made_model_goes_through_summary_convert_and_predict(tmp_path):
    rng = np.random.default_rng(0)
    model = small_cnn(rng)
    onnx.save(model, str(tmp_path / "model.onnx"))
    x = rng.normal(size=(7, 1, 6, 6)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    want = reference(model, x)

    p = leafpy(tmp_path, "summary", "model.onnx")
    assert p.returncode == 0, p.stderr
    for name in ("conv1", "bn1", "pool1", "fc", "logsm"):
        assert name in p.stdout
    p = leafpy(tmp_path, "predict", "model.onnx", "--input", "x.npz", "--out", "pred.npz")
    assert p.returncode == 0, p.stderr
    np.testing.assert_allclose(np.load(tmp_path / "pred.npz")["outputs"], want, atol=1e-5)
    assert "predicted classes" in p.stdout

    p = leafpy(tmp_path, "convert", "model.onnx", "model.leaf")
    assert p.returncode == 0, p.stderr
    net = lp.Layer.load(lp.backend("native"), str(tmp_path / "model.leaf"))
    net.set_training(False)
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), want, atol=1e-5)

    p = leafpy(tmp_path, "convert", "model.leaf", "back.onnx", "--opset", "20")
    assert p.returncode == 0, p.stderr
    back = onnx.load(str(tmp_path / "back.onnx"))
    assert back.opset_import[0].version == 20
    np.testing.assert_allclose(reference(back, x), want, atol=1e-5)


def test_an_imported_model_trains_gradients_reach_its_weights():
    net = lp.onnx.load(small_cnn(np.random.default_rng(1)))
    x = np.random.default_rng(2).normal(size=(3, 1, 6, 6)).astype(np.float32)
    out = net.forward([x])[0]
    net.backward([np.ones(out.shape, np.float32)])
    grads = dict(zip(net.learnable_weights_names(), net.learnable_weights_gradients()))
    for name in ("conv1/weight", "conv1/bias", "bn1/weight", "fc/weight", "fc/bias"):
        assert float(np.abs(grads[name].to_numpy()).sum()) > 0, name


def test_batch_norm_momentum_and_gemm_layout_are_translated():
    net = lp.onnx.load(small_cnn(np.random.default_rng(3)))
    bn = next(layer for layer in net.layers if layer.name == "bn1")
    assert abs(bn.config.config.momentum - 0.2) < 1e-7 and abs(bn.config.config.eps - 1e-3) < 1e-9
    assert dict(zip(net.learnable_weights_names(), net.learnable_weights_data()))["fc/weight"].shape == (5, 36)


def _one_node(node, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph([node], "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_matmul_by_a_constant_is_a_linear_layer_per_time_step():
    rng = np.random.default_rng(4)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    model = _one_node(helper.make_node("MatMul", ["x", "w"], ["y"], name="proj"),
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4, 3])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4, 2])],
                      [numpy_helper.from_array(w, "w")])
    x = rng.normal(size=(5, 4, 3)).astype(np.float32)
    net = lp.onnx.load(model)
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), x @ w, atol=1e-5)


@pytest.mark.parametrize("attrs, attribute", [({"auto_pad": "SAME_MIDDLE"}, "auto_pad='SAME_MIDDLE'"),
                                              ({"pads": [0, 0, -1, 1]}, "pads"), ({"pads": [1, 1]}, "pads")])
def test_an_attribute_leafpy_cannot_compute_is_a_config_error_naming_node_operator_attribute(attrs, attribute):
    w = numpy_helper.from_array(np.ones((4, 1, 3, 3), np.float32), "w")
    model = _one_node(helper.make_node("Conv", ["x", "w"], ["y"], name="dw", kernel_shape=[3, 3], group=2,
                                        **attrs),
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 8, 8])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    with pytest.raises(lp.ConfigError, match=rf"ONNX node 'dw' \(Conv\): {attribute}.*leafpy supports"):
        lp.onnx.load(model)


def test_an_operator_leafpy_lacks_is_named_with_the_ones_it_has(tmp_path):
    model = _one_node(helper.make_node("Cos", ["x"], ["y"], name="t"),
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    onnx.save(model, str(tmp_path / "t.onnx"))
    p = leafpy(tmp_path, "summary", "t.onnx")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "ONNX node 't' (Cos): operator Cos is not supported" in p.stderr and "Conv" in p.stderr
    assert "t.onnx: ONNX node 't'" in p.stderr  # the file named, as a malformed file's errors name it
    with pytest.raises(lp.ConfigError, match=r"t\.onnx: ONNX node 't' \(Cos\)"):
        lp.onnx.load(str(tmp_path / "t.onnx"))


def test_truncated_and_external_data_files_are_serialization_errors(tmp_path):
    data = small_cnn(np.random.default_rng(5)).SerializeToString()
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(lp.SerializationError, match="cut.onnx"):
        lp.onnx.load(str(tmp_path / "cut.onnx"))
    model = small_cnn(np.random.default_rng(5))
    onnx.save_model(model, str(tmp_path / "ext.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.data", size_threshold=0)
    with pytest.raises(lp.SerializationError, match="external file"):
        lp.onnx.load(str(tmp_path / "ext.onnx"))


def test_a_tensor_larger_than_its_data_is_refused():
    model = small_cnn(np.random.default_rng(6))
    model.graph.initializer[0].dims[0] = 10**9
    with pytest.raises(lp.SerializationError, match="declares shape"):
        lp.onnx.load(model)


def test_import_leafpy_does_not_import_onnx():
    code = "import sys, leafpy; leafpy.onnx; print('onnx' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=child_env())
    assert p.stdout.strip() == "False", p.stderr


def _node_case(op, shape, weights=(), opset=17, **attrs):
    rng = np.random.default_rng(len(op) + len(attrs))
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, s).astype(np.float32), f"w{i}") for i, s in
             enumerate(weights)]
    node = helper.make_node(op, ["x", *[t.name for t in inits]], ["y"], name="n", **attrs)
    model = _one_node(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset)
    return model, rng.normal(0, 1, shape).astype(np.float32)


WINDOW_AND_AXIS_CASES = {
    "conv_grouped_dilated_asymmetric": ("Conv", [2, 4, 9, 8], [(6, 2, 3, 2), (6,)],
                                        dict(group=2, dilations=[2, 1], pads=[1, 0, 2, 1])),
    "conv_depthwise_same_upper": ("Conv", [2, 4, 8, 8], [(4, 1, 3, 3)], dict(group=4, strides=[2, 2],
                                                                             auto_pad="SAME_UPPER")),
    "conv_same_lower": ("Conv", [2, 4, 4, 5], [(3, 4, 2, 2), (3,)], dict(auto_pad="SAME_LOWER")),
    "conv_valid": ("Conv", [2, 4, 6, 5], [(3, 4, 2, 3)], dict(auto_pad="VALID", strides=[2, 1])),
    "convtranspose_output_shape": ("ConvTranspose", [2, 4, 4, 4], [(4, 3, 3, 3), (6,)],
                                   dict(group=2, strides=[2, 2], output_shape=[10, 9])),
    "convtranspose_same_upper": ("ConvTranspose", [2, 2, 4, 3], [(2, 3, 3, 3)], dict(strides=[2, 2],
                                                                                     auto_pad="SAME_UPPER")),
    "convtranspose_pads_output_padding_dilations": ("ConvTranspose", [2, 2, 4, 3], [(2, 2, 3, 2)],
                                                    dict(strides=[3, 2], pads=[1, 0, 0, 1], output_padding=[2, 1],
                                                         dilations=[1, 2])),
    "maxpool_ceil_asymmetric": ("MaxPool", [2, 3, 9, 8], [], dict(kernel_shape=[3, 3], strides=[2, 2],
                                                                  pads=[1, 0, 0, 1], ceil_mode=1)),
    "averagepool_same_lower_excluding_pads": ("AveragePool", [2, 3, 5, 4], [], dict(kernel_shape=[2, 2],
                                                                                    auto_pad="SAME_LOWER")),
    "averagepool_ceil_counting_pads": ("AveragePool", [2, 3, 5, 4], [], dict(kernel_shape=[3, 3], strides=[2, 2],
                                                                             pads=[1, 1, 1, 1], ceil_mode=1,
                                                                             count_include_pad=1)),
    "globalaveragepool": ("GlobalAveragePool", [2, 3, 5, 4], [], {}),
    "globalmaxpool": ("GlobalMaxPool", [2, 3, 5, 4], [], {}),
    "softmax_axis_2": ("Softmax", [2, 3, 4, 5], [], dict(axis=2)),
    "logsoftmax_axis_last": ("LogSoftmax", [2, 3, 4, 5], [], dict(axis=-1)),
    "softmax_opset_11_flattened_at_axis_2": ("Softmax", [2, 3, 4, 5], [], dict(axis=2, opset=11)),
    "logsoftmax_opset_11_one_wide_axis": ("LogSoftmax", [2, 3, 4, 1], [], dict(axis=2, opset=11)),
    "logsoftmax_opset_11_default_axis": ("LogSoftmax", [2, 3, 4], [], dict(opset=11)),
    "flatten_axis_2": ("Flatten", [2, 3, 4, 5], [], dict(axis=2)),
    "flatten_axis_0": ("Flatten", [2, 3, 4], [], dict(axis=0)),
    "conv_1d_grouped_dilated": ("Conv", [2, 4, 9], [(6, 2, 3), (6,)], dict(group=2, pads=[1, 2], dilations=[2])),
    "convtranspose_1d": ("ConvTranspose", [2, 2, 5], [(2, 3, 3)], dict(strides=[2], output_padding=[1])),
    "averagepool_1d_ceil": ("AveragePool", [2, 3, 9], [], dict(kernel_shape=[3], strides=[2], pads=[1, 0],
                                                               ceil_mode=1)),
    "channel_shuffle": ("Transpose", [2, 3, 4, 2, 2], [], dict(perm=[0, 2, 1, 3, 4])),
    "maxpool_dilated": ("MaxPool", [2, 3, 7, 6], [], dict(kernel_shape=[3, 2], dilations=[2, 3])),
    "averagepool_dilated_ceil": ("AveragePool", [2, 3, 6, 6], [], dict(kernel_shape=[2, 2], dilations=[2, 2],
                                                                        ceil_mode=1, opset=19)),
    "maxpool_1d_dilated": ("MaxPool", [2, 3, 9], [], dict(kernel_shape=[3], dilations=[3])),
    "transpose_any_axes": ("Transpose", [2, 3, 4, 5], [], dict(perm=[0, 3, 2, 1])),
    "transpose_batch_and_time": ("Transpose", [2, 3, 4], [], dict(perm=[1, 0, 2])),
    "transpose_reversed": ("Transpose", [2, 3, 4], [], {}),
    "gemm_transposed_a_matrix_bias": ("Gemm", [6, 3], [(6, 4), (3, 4)], dict(transA=1, alpha=0.5, beta=0.25)),
    "matmul_batched_constant": ("MatMul", [2, 3, 4], [(2, 4, 5)], {}),
    "matmul_broadcast_constant": ("MatMul", [3, 1, 2, 4], [(2, 4, 3)], {}),
    "matmul_vector_constant": ("MatMul", [2, 3, 4], [(4,)], {}),
    "add_broadcast_constant": ("Add", [2, 3, 4], [(3, 1)], {}),
    "mul_broadcast_constant": ("Mul", [2, 3, 4], [(4,)], {}),
    "sub_scalar_constant": ("Sub", [2, 3], [()], {}),
    "max_broadcast_constant": ("Max", [2, 3, 4], [(1, 4)], {}),
}


@pytest.mark.parametrize("case", sorted(WINDOW_AND_AXIS_CASES))
def test_window_and_axis_attributes_import_as_onnx_computes_them(case):
    op, shape, weights, attrs = WINDOW_AND_AXIS_CASES[case]
    attrs = dict(attrs)
    opset = attrs.pop("opset", 17)
    model, x = _node_case(op, shape, weights, opset, **attrs)
    net = lp.onnx.load(model)
    net.set_training(False)
    # onnxruntime, not onnx's reference evaluator, which computes Softmax with opset 13's single axis at every opset
    # and ConvTranspose without its group
    ort = pytest.importorskip("onnxruntime", reason="the imported nodes are checked in onnxruntime")
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = net.forward([x])[0].to_numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("op, shape, weights, attrs, words", [
    ("ConvTranspose", [1, 2, 4, 4], [(2, 2, 3, 3)], dict(strides=[2, 2], output_shape=[7, 8]),
     r"output_shape=\[7, 8\] is not supported; leafpy supports an output_shape at least the computed output"),
    ("ConvTranspose", [1, 2, 4, 4], [(2, 2, 3, 3)], dict(strides=[2, 2], output_shape=[12, 9]),
     r"DeconvolutionConfig.*output_padding"),
    ("Softmax", [2, 3, 4], [], dict(axis=0, opset=11), r"axis=0 is not supported; leafpy supports before opset 13"),
    ("MaxPool", [1, 2, 6, 6], [], dict(kernel_shape=[2, 2], dilations=[2, 2], strides=[2, 2]),
     r"dilations=\[2, 2\] is not supported; leafpy supports dilations of 1, or dilated pooling with strides of 1"),
    ("Conv", [1, 3, 6, 6], [(4, 2, 3, 3)], dict(group=2), r"group 2 read 4 channels; the input has 3"),
])
def test_window_and_axis_attributes_leafpy_cannot_compute_are_refused_naming_them(op, shape, weights, attrs, words):
    attrs = dict(attrs)
    opset = attrs.pop("opset", 17)
    model, _ = _node_case(op, shape, weights, opset, **attrs)
    with pytest.raises(lp.ConfigError, match=rf"ONNX node 'n' \({op}\).*{words}"):
        lp.onnx.load(model)


DATA = ROOT / "tests" / "data" / "onnx"


@pytest.mark.parametrize("name", ["torch_resnet", "torch_lstm_text", "torch_birnn_tagger", "torch_mobilenet",
                                  "torch_window_settings", "torch_bilstm_text", "torch_gelu_mlp", "torch_stacked_hn"])
def test_models_pytorch_exported_import_and_match_pytorch_within_1e_4(name):
    """Written by tests/data/onnx/make_torch_models.py and make_torch_vision_models.py (torch.onnx.export, opset
    17); PyTorch's outputs beside."""
    saved = np.load(DATA / f"{name}.npz")
    net = lp.onnx.load(str(DATA / f"{name}.onnx"))
    net.set_training(False)
    x = saved["x"].astype(np.float32)
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), saved["y"], atol=1e-4)
    if name == "torch_birnn_tagger":  # time-major: its first axis is the sequence, fixed in the file
        return
    double = np.concatenate([x, x])  # the batch the file was written with is not the only one
    np.testing.assert_allclose(net.forward([double])[0].to_numpy()[len(x):], saved["y"], atol=1e-4)


def _layer_types(net) -> list[str]:
    return [lc.type for lc in net.config.config.layers]


def test_gelu_written_as_its_erf_or_tanh_formula_imports_as_one_gelu_layer(tmp_path):
    """Below opset 20 GELU has no ONNX operator: PyTorch writes x/sqrt(2) -> Erf -> +1 -> *x -> *0.5, leafpy's own
    export (x*(1/sqrt 2) -> Erf -> +1) * (0.5*x). Both read back as a GELU layer (Erf alone stays unsupported), with
    PyTorch's outputs, and a leafpy network with GELU goes out and back in at the default opset."""
    net = lp.onnx.load(str(DATA / "torch_gelu_mlp.onnx"))
    assert "GELU" in _layer_types(net) and "Erf" not in str(_layer_types(net))
    saved = np.load(DATA / "torch_gelu_mlp.npz")
    # the tanh form, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), is a GELU layer too: its constants are no
    # trainable weights that training would turn into another function
    assert _layer_types(net).count("GELU") == 2 and "TanH" not in _layer_types(net)
    assert sorted(c.config.approximate for c in net.config.config.layers if c.type == "GELU") == ["none", "tanh"]
    assert all(v.size > 1 for v in net.named_weights().values())
    np.testing.assert_allclose(net.forward([saved["x"]])[0].to_numpy(), saved["y"], atol=1e-5)
    cfg = lp.SequentialConfig(inputs=[("data", [2, 4])], layers=[
        lp.LayerConfig("fc", lp.LinearConfig(output_size=4), outputs=["h"]),
        lp.LayerConfig("g", "GELU", inputs=["h"], outputs=["g"]),
        lp.LayerConfig("add", lp.EltwiseConfig(operation="sum"), inputs=["g", "h"])])
    mine = lp.Layer.from_config(lp.backend("native", dtype=np.float64), lp.LayerConfig("net", cfg), seed=0)
    lp.onnx.export(mine, str(tmp_path / "m.onnx"))
    back = lp.onnx.load(str(tmp_path / "m.onnx"))
    assert _layer_types(back).count("GELU") == 1
    tanh_cfg = lp.SequentialConfig(inputs=[("data", [2, 4])], layers=[
        lp.LayerConfig("g", lp.GELUConfig(approximate="tanh"))])
    lp.onnx.export(lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", tanh_cfg)),
                   str(tmp_path / "t.onnx"), opset=17)
    assert [c.config.approximate for c in lp.onnx.load(str(tmp_path / "t.onnx")).config.config.layers] == ["tanh"]
    x = np.random.default_rng(0).standard_normal((2, 4))
    w = mine.named_weights()
    h = x @ np.asarray(w["fc/weight"], np.float64).T + np.asarray(w["fc/bias"], np.float64)
    from scipy.special import erf
    expected = 0.5 * h * (1 + erf(h / np.sqrt(2))) + h  # float64, by the formula
    np.testing.assert_allclose(back.forward([x.astype(np.float32)])[0].to_numpy(), expected, atol=1e-5)


def test_a_constant_index_along_the_first_axis_of_a_computed_value_is_refused_saying_why():
    """PyTorch's h_n[-1] of a two-layer LSTM, or y[-1] of a time-major one, is a Gather along axis 0 of a computed
    value: refused naming the index and the axis and what to export instead (the message spoke of an embedding
    table that must be constant)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Gather", ["r", "i"], ["y"], name="pick", axis=0)]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], initializer=[
        helper.make_tensor("i", TensorProto.INT64, [], [-1])]), opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(lp.ConfigError, match=r"ONNX node 'pick' \(Gather\): takes index \[-1\] along axis 0 of a "
                                             r"computed value.*export the last step of a batch-first output"):
        lp.onnx.load(model)


def test_erf_outside_the_gelu_formula_is_still_refused_by_name():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])
    model = helper.make_model(helper.make_graph([helper.make_node("Erf", ["x"], ["y"], name="e")], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(lp.ConfigError, match=r"ONNX node 'e' \(Erf\): operator Erf is not supported"):
        lp.onnx.load(model)


def test_a_batch_first_bidirectional_lstm_predicts_through_the_command_at_any_batch(tmp_path):
    """PyTorch's batch-first bidirectional LSTM (ONNX's layout 0 between Transposes and a Reshape joining the two
    directions) exported at batch 2 with a symbolic batch: `leafpy predict` (which loads it at batch 1) gives
    PyTorch's outputs at batch 4, and at a batch past the command's 64 at a time."""
    saved = np.load(DATA / "torch_bilstm_text.npz")
    for reps in (1, 20):
        np.savez(tmp_path / "x.npz", x=np.concatenate([saved["x"]] * reps))
        p = leafpy(tmp_path, "predict", str(DATA / "torch_bilstm_text.onnx"), "--input", "x.npz", "--out", "p.npz")
        assert p.returncode == 0, p.stderr
        np.testing.assert_allclose(np.load(tmp_path / "p.npz")["outputs"], np.concatenate([saved["y"]] * reps),
                                   atol=1e-4)


def test_a_pytorch_model_through_summary_and_predict(tmp_path):
    saved = np.load(DATA / "torch_resnet.npz")
    np.savez(tmp_path / "x.npz", x=saved["x"])
    p = leafpy(tmp_path, "summary", str(DATA / "torch_resnet.onnx"))
    assert p.returncode == 0 and "Eltwise" in p.stdout, p.stderr
    p = leafpy(tmp_path, "predict", str(DATA / "torch_resnet.onnx"), "--input", "x.npz", "--out", "p.npz")
    assert p.returncode == 0, p.stderr
    np.testing.assert_allclose(np.load(tmp_path / "p.npz")["outputs"], saved["y"], atol=1e-4)


@pytest.mark.parametrize("backend", ["native", pytest.param("webgpu", marks=pytest.mark.webgpu)])
def test_a_pytorch_mobilenet_converts_and_predicts_through_the_command(tmp_path, backend):
    """MobileNet-v2's blocks from PyTorch (depthwise convolutions, ReLU6 as Clip, residual sums): `leafpy convert`
    to a model file that predicts PyTorch's outputs, on each backend, and exports back to ONNX unchanged."""
    backend_or_skip(backend)
    saved = np.load(DATA / "torch_mobilenet.npz")
    np.savez(tmp_path / "x.npz", x=saved["x"])
    p = leafpy(tmp_path, "convert", str(DATA / "torch_mobilenet.onnx"), "mobilenet.leaf")
    assert p.returncode == 0, p.stderr
    p = leafpy(tmp_path, "summary", "mobilenet.leaf")
    assert p.returncode == 0 and "Clip" in p.stdout and "Eltwise" in p.stdout, p.stderr
    p = leafpy(tmp_path, "predict", "mobilenet.leaf", "--input", "x.npz", "--out", "p.npz", "--backend", backend)
    assert p.returncode == 0, p.stderr
    np.testing.assert_allclose(np.load(tmp_path / "p.npz")["outputs"], saved["y"], atol=1e-4)
    p = leafpy(tmp_path, "convert", "mobilenet.leaf", "again.onnx")
    assert p.returncode == 0, p.stderr
    ort = pytest.importorskip("onnxruntime", reason="the exported model is checked in onnxruntime")
    session = ort.InferenceSession(str(tmp_path / "again.onnx"))
    out = session.run(None, {session.get_inputs()[0].name: saved["x"].astype(np.float32)})[0]
    np.testing.assert_allclose(out, saved["y"], atol=1e-4)


def test_a_pytorch_bidirectional_time_major_rnn_converts_and_predicts_as_onnxruntime_computes(tmp_path):
    """PyTorch's bidirectional LSTM and GRU (batch_first=False: ONNX's layout 0, both directions in one node, zero
    initial states built from the input's Shape) through ``leafpy convert`` to a .leaf model and back to ONNX, and
    ``leafpy predict`` on PyTorch's file and on leafpy's export: onnxruntime's outputs (PyTorch's), within 1e-4."""
    ort = pytest.importorskip("onnxruntime", reason="the converted model is checked against onnxruntime")
    model = DATA / "torch_birnn_tagger.onnx"
    saved = np.load(DATA / "torch_birnn_tagger.npz")
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": saved["x"]})[0]
    np.testing.assert_allclose(want, saved["y"], atol=1e-5)
    np.savez(tmp_path / "x.npz", x=saved["x"])
    for args in (("convert", str(model), "tagger.leaf"), ("convert", "tagger.leaf", "back.onnx")):
        p = leafpy(tmp_path, *args)
        assert p.returncode == 0, p.stderr
    p = leafpy(tmp_path, "summary", "tagger.leaf")
    assert p.returncode == 0 and "LSTM" in p.stdout and "GRU" in p.stdout, p.stderr
    for source in (str(model), "back.onnx"):  # PyTorch's file, and leafpy's export of the converted model
        p = leafpy(tmp_path, "predict", source, "--input", "x.npz", "--out", "p.npz")
        assert p.returncode == 0, p.stderr
        got = np.load(tmp_path / "p.npz")["outputs"]
        np.testing.assert_allclose(got.reshape(want.shape), want, atol=1e-4)


def test_a_trained_run_exports_and_its_onnx_model_evaluates_and_fine_tunes_as_its_model_leaf(tmp_path):
    run_file = str(ROOT / "configs" / "digits_mlp.yaml")
    p = leafpy(tmp_path, "train", run_file, "--epochs", "1", "--out", "run")
    assert p.returncode == 0, p.stderr
    p = leafpy(tmp_path, "convert", "run", "run/model.onnx")
    assert p.returncode == 0, p.stderr
    leaf, onnx_file = leafpy(tmp_path, "evaluate", "run"), leafpy(tmp_path, "evaluate", "run/model.onnx")
    assert leaf.returncode == 0 and onnx_file.returncode == 0, onnx_file.stderr
    score = [line for line in leaf.stdout.splitlines() if line.startswith("held-out")]
    assert score and score == [line for line in onnx_file.stdout.splitlines() if line.startswith("held-out")]
    p = leafpy(tmp_path, "train", run_file, "--epochs", "1", "--out", "tuned", "--weights", "run/model.onnx")
    assert p.returncode == 0, p.stderr
    assert "starting from the weights in run/model.onnx" in p.stdout + p.stderr


def test_the_test_backend_rebuilds_when_run_time_weights_change():
    import leafpy.onnx.backend as backend

    model = _one_node(helper.make_node("Gemm", ["x", "w"], ["y"], name="fc"),
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                       helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    rep = backend.prepare(model)
    x = np.ones((2, 3), np.float32)
    for scale in (1.0, 2.0):
        w = np.arange(12, dtype=np.float32).reshape(3, 4) * scale
        np.testing.assert_allclose(rep.run([x, w])[0], x @ w, rtol=1e-6)


def test_a_fifo_or_a_directory_named_onnx_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    (tmp_path / "dir.onnx").mkdir()
    for path, words in ((fifo, "a FIFO, not a regular file"), (tmp_path / "dir.onnx", "a directory")):
        p = leafpy(tmp_path, "summary", str(path))
        assert p.returncode == 1 and words in p.stderr and "Traceback" not in p.stderr, p.stderr


def _recurrent_case(op, direction, layout, outputs, hidden=3, steps=4, batch=2, features=2):
    """One LSTM, GRU or RNN node (layout 0: X [T, N, I]; 1: [N, T, I]) whose ``outputs`` are graph outputs."""
    rng = np.random.default_rng(5)
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    dirs = 2 if direction == "bidirectional" else 1
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, s).astype(np.float32), name) for name, s in
             (("W", (dirs, gates * hidden, features)), ("R", (dirs, gates * hidden, hidden)),
              ("B", (dirs, 2 * gates * hidden)))]
    names = ["Y", "Y_h", "Y_c"][:2 + (op == "LSTM")]
    extra = {"linear_before_reset": int(direction != "reverse")} if op == "GRU" else {}  # ONNX's default 0 too
    node = helper.make_node(op, ["x", "W", "R", "B"], [o if o in outputs else "" for o in names], name="rnn",
                            hidden_size=hidden, direction=direction, layout=layout, **extra)
    shape = [steps, batch, features] if layout == 0 else [batch, steps, features]
    model = _one_node(node, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                      [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return model, rng.normal(0, 1, shape).astype(np.float32)


@pytest.mark.parametrize("op, direction, layout, outputs", [
    ("LSTM", "bidirectional", 0, ["Y", "Y_h", "Y_c"]),
    ("LSTM", "reverse", 1, ["Y_h", "Y_c"]),
    ("GRU", "bidirectional", 1, ["Y", "Y_h"]),
    ("GRU", "reverse", 0, ["Y"]),
    ("RNN", "forward", 0, ["Y", "Y_h"]),
    ("RNN", "bidirectional", 0, ["Y_h"]),
])
def test_recurrent_directions_layouts_and_outputs_import_as_onnx_computes_them(op, direction, layout, outputs):
    """Reverse and bidirectional layers, ONNX's time-major layout 0 and batch-first layout 1, every step's output Y
    with the last one Y_h (and the LSTM's last cell state Y_c): leafpy's outputs match ONNX's reference evaluator's
    (onnxruntime's CPU refuses layout 1), and the imported network trains (its weights get gradients)."""
    from onnx.reference import ReferenceEvaluator

    model, x = _recurrent_case(op, direction, layout, outputs)
    want = ReferenceEvaluator(model).run(None, {"x": x})
    net = lp.onnx.load(model, batch_size=x.shape[0])
    net.set_training(False)
    got = [o.to_numpy() for o in net.forward([x])]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.reshape(w.shape), w, atol=1e-5)
    net.backward([np.ones(o.shape, np.float32) for o in net.forward([x])])
    assert all(np.abs(g.to_numpy()).sum() > 0 for g in net.learnable_weights_gradients())


def test_gather_reshape_and_dropout_mask_import_as_onnxruntime_computes_them():
    """Gather on an axis after the first of a 3-D constant table, a Reshape that moves values across the first axis,
    and Dropout's mask output (all true in inference)."""
    ort = pytest.importorskip("onnxruntime", reason="the imported nodes are checked in onnxruntime")
    rng = np.random.default_rng(2)
    table = numpy_helper.from_array(rng.normal(0, 1, (3, 5, 2)).astype(np.float32), "table")
    shape = numpy_helper.from_array(np.array([-1, 4], np.int64), "shape")
    ratio = numpy_helper.from_array(np.array(0.3, np.float32), "ratio")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["g"], name="gather", axis=1),
             helper.make_node("Reshape", ["g", "shape"], ["r"], name="reshape"),
             helper.make_node("Dropout", ["r", "ratio"], ["y", "mask"], name="drop")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("mask", TensorProto.BOOL, None)], [table, shape, ratio])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    ids = np.array([[4, 0], [2, 2]], np.int64)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})
    net = lp.onnx.load(model)
    net.set_training(False)
    y, mask = (o.to_numpy() for o in net.forward([ids.astype(np.float32)]))
    np.testing.assert_allclose(y.reshape(want[0].shape), want[0], atol=1e-6)
    assert mask.size == want[1].size and want[1].all() and (mask == 1).all()


def _bidirectional_lstm_graph(tail: list, out_shape: list, consts: dict) -> tuple:
    """x [N, T, I] batch-first, Transpose to ONNX's layout 0, a bidirectional LSTM (Y [T, 2, N, H]), then ``tail``
    reading Y and giving y: the model, and an input."""
    t, n, i, h = 6, 4, 5, 7
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)
             for name, shape in (("W", (2, 4 * h, i)), ("R", (2, 4 * h, h)), ("B", (2, 8 * h)))]
    inits += [numpy_helper.from_array(np.asarray(v, np.int64), k) for k, v in consts.items()]
    front = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
             helper.make_node("LSTM", ["xt", "W", "R", "B"], ["Y"], hidden_size=h, direction="bidirectional")]
    graph = helper.make_graph(front + tail, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, t, i])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, rng.standard_normal((n, t, i)).astype(np.float32)


@pytest.mark.parametrize("case", ["shape_then_reshape", "shape_of_y", "reshape_to_2n", "relu_of_y", "back_to_4d"])
def test_a_bidirectional_lstms_output_read_in_other_ways_is_what_onnxruntime_computes(case):
    """Around the batch-first reading of both directions' steps: their shape read by Shape (as exporters with
    dynamic shapes write it), a Reshape whose middle axis is not the batch, Y read as it is, and transposed back."""
    ort = pytest.importorskip("onnxruntime", reason="the reference is onnxruntime")
    t, n, h = 6, 4, 7
    tails = {
        "shape_then_reshape": ([helper.make_node("Transpose", ["Y"], ["Yt"], perm=[0, 2, 1, 3]),
                                helper.make_node("Shape", ["Yt"], ["s"], start=0, end=2),
                                helper.make_node("Concat", ["s", "m1"], ["tgt"], axis=0),
                                helper.make_node("Reshape", ["Yt", "tgt"], ["Ys"]),
                                helper.make_node("Transpose", ["Ys"], ["y"], perm=[1, 0, 2])], [n, t, 2 * h],
                               {"m1": [-1]}),
        "shape_of_y": ([helper.make_node("Shape", ["Y"], ["s"], start=0, end=1),
                        helper.make_node("Concat", ["s", "m1"], ["tgt"], axis=0),
                        helper.make_node("Reshape", ["Y", "tgt"], ["y"])], [t, 2 * n * h], {"m1": [-1]}),
        "reshape_to_2n": ([helper.make_node("Transpose", ["Y"], ["Yt"], perm=[0, 2, 1, 3]),
                           helper.make_node("Reshape", ["Yt", "t3"], ["y"])], [t, 2 * n, h], {"t3": [0, 2 * n, -1]}),
        "relu_of_y": ([helper.make_node("Relu", ["Y"], ["y"])], [t, 2, n, h], {}),
        "back_to_4d": ([helper.make_node("Transpose", ["Y"], ["Yt"], perm=[0, 2, 1, 3]),
                        helper.make_node("Transpose", ["Yt"], ["y"], perm=[1, 0, 2, 3])], [n, t, 2, h], {}),
    }
    model, x = _bidirectional_lstm_graph(*tails[case])
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = lp.onnx.load(model, batch_size=n).forward([x])[0].to_numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("index", [0, -1])
@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_the_last_hidden_state_picked_from_y_h_is_what_onnxruntime_computes(op, index):
    """PyTorch's `_, h = gru(x); fc(h[-1])` on a batch-first input: Transpose, the recurrent node (layout 0), a
    Gather of index 0 or -1 on axis 0 of Y_h [1, N, H], then Gemm; at two batch sizes."""
    ort = pytest.importorskip("onnxruntime", reason="the reference is onnxruntime")
    t, i, h, gates = 5, 4, 6, {"GRU": 3, "LSTM": 4}[op]
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.4, name)
             for name, shape in (("W", (1, gates * h, i)), ("R", (1, gates * h, h)), ("B", (1, 2 * gates * h)),
                                 ("fw", (3, h)), ("fb", (3,)))]
    inits.append(numpy_helper.from_array(np.array(index, np.int64), "k"))
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),
             helper.make_node(op, ["xt", "W", "R", "B"], ["", "hn"], hidden_size=h),
             helper.make_node("Gather", ["hn", "k"], ["last"], axis=0),
             helper.make_node("Gemm", ["last", "fw", "fb"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", t, i])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    net = lp.onnx.load(model)
    for n in (2, 7):
        x = rng.standard_normal((n, t, i)).astype(np.float32)
        np.testing.assert_allclose(net.forward([x])[0].to_numpy(), session.run(None, {"x": x})[0], atol=1e-5)


def test_a_stacked_networks_h_n_given_whole_as_a_graph_output_imports():
    """h_n of a stacked LSTM [layers, N, H] as an output of the graph beside the classifier's (PyTorch's model
    returning (logits, h_n)): the import, which joins the layers' last states only where something reads them
    whole, called the graph malformed. Both outputs now come out with onnxruntime's values (a network's outputs of
    different batch axes come side by side in one row each, as for any such graph: reshaped here to ONNX's)."""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime computes the reference outputs")
    model = onnx.load(str(DATA / "torch_stacked_hn.onnx"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("/lstm/Concat_1_output_0", onnx.TensorProto.FLOAT,
                                                                 [2, "N", 9]))
    x = np.load(DATA / "torch_stacked_hn.npz")["x"].astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    net = lp.onnx.load(model, batch_size=len(x))
    got = [t.to_numpy() for t in net.forward([x])]
    assert [g.size for g in got] == [w.size for w in want] == [15, 90]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.reshape(w.shape), w, atol=1e-5)
