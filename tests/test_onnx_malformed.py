"""ONNX models that parse but break ONNX's own rules, written by hand with onnx's helper API: each is a
SerializationError (a malformed model) or a ConfigError (a value leafpy cannot compute) naming the node, the
operator and the attribute or input, from ``lp.onnx.load`` and from the ``leafpy`` command, never a raw traceback;
and an imported network computes the graph's inference function from its first forward pass."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, child_env

import leafpy as lp
from leafpy.onnx import importer

onnx = pytest.importorskip("onnx", reason="ONNX import tests need the onnx package (pip install 'leafpy-dl[onnx]')")
from onnx import AttributeProto, TensorProto, helper, numpy_helper  # noqa: E402

MALFORMED = "a malformed model; re-export it"


def _model(nodes, inits=None, x_shape=("N", 2, 8, 8), outputs=("y",), opset=17) -> onnx.ModelProto:
    """A graph of ``nodes`` reading "x" (float, ``x_shape``), its ``outputs`` float of any shape, ``inits`` (name ->
    array) its initializers."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _attribute(name: str, kind: int, **fields) -> AttributeProto:
    """An attribute of type ``kind`` holding ``fields`` as they are (helper.make_attribute would infer the type)."""
    a = AttributeProto()
    a.name, a.type = name, kind
    for key, value in fields.items():
        if isinstance(value, list):
            getattr(a, key).extend(value)
        else:
            setattr(a, key, value)
    return a


def _node(op: str, inputs: list[str], attributes=(), name: str = "n", **attrs) -> onnx.NodeProto:
    node = helper.make_node(op, inputs, ["y"], name=name, **attrs)
    node.attribute.extend(attributes)
    return node


FILTERS = {"w": np.ones((3, 2, 3, 3), np.float32)}


def _gemm(**attrs) -> onnx.ModelProto:
    return _model([_node("Gemm", ["x", "w"], **attrs)], {"w": np.ones((3, 4), np.float32)}, x_shape=("N", 4))


def _string_weight() -> onnx.ModelProto:
    model = _gemm(transB=1)
    t = model.graph.initializer[0]
    t.data_type = TensorProto.STRING
    t.ClearField("raw_data")
    t.string_data.extend([b"a"] * 12)
    return model


def _no_outputs() -> onnx.ModelProto:
    model = _gemm(transB=1)
    del model.graph.output[:]
    return model


MALFORMED_CASES = {
    "no graph outputs": (_no_outputs, r"ONNX graph 'g': no graph outputs"),
    "a graph output no node gives": (lambda: _model([_node("Relu", ["x"])], outputs=("y", "z")),
                                     r"ONNX graph output 'z': no node and no graph input gives it"),
    "a STRING initializer as Gemm's weight": (_string_weight, r"ONNX node 'n' \(Gemm\): input 1 \('w', the weight "
                                                              r"matrix\) holds strings"),
    "Conv strides as INT": (lambda: _model([_node("Conv", ["x", "w"], [_attribute("strides", AttributeProto.INT,
                                                                                  i=2)])], FILTERS),
                            r"ONNX node 'n' \(Conv\): attribute 'strides' is an integer \(INT\), where ONNX's Conv "
                            r"takes a list of integers \(INTS\)"),
    "an attribute of type UNDEFINED": (lambda: _model([_node("Conv", ["x", "w"], [_attribute(
        "strides", AttributeProto.UNDEFINED)])], FILTERS), r"ONNX node 'n' \(Conv\): attribute 'strides' is of no "
                                                           r"type \(UNDEFINED\)"),
    "MaxPool without kernel_shape": (lambda: _model([_node("MaxPool", ["x"])]),
                                     r"ONNX node 'n' \(MaxPool\): attribute 'kernel_shape' is missing; ONNX's MaxPool "
                                     r"requires it"),
    "auto_pad not UTF-8": (lambda: _model([_node("Conv", ["x", "w"], [_attribute("auto_pad", AttributeProto.STRING,
                                                                                 s=b"SAME\xff")])], FILTERS),
                           r"ONNX node 'n' \(Conv\): attribute 'auto_pad' holds bytes that are no UTF-8 text"),
    "transB as a STRING": (lambda: _gemm(transB="x"), r"ONNX node 'n' \(Gemm\): attribute 'transB' is a string "
                                                      r"\(STRING\), where ONNX's Gemm takes an integer \(INT\)"),
    "Gemm without B": (lambda: _model([_node("Gemm", ["x"])], x_shape=("N", 4)),
                       r"ONNX node 'n' \(Gemm\): input 1 \(B\) is missing; ONNX's Gemm requires it"),
    "a node without its output": (lambda: _model([helper.make_node("Relu", ["x"], [], name="n")]),
                                  r"ONNX node 'n' \(Relu\): output 0 \(Y\) is missing"),
    "Split sizes past the axis": (lambda: _model([_node("Split", ["x", "s"], axis=1)], {"s": np.array([3, 3])}),
                                  r"ONNX node 'n' \(Split\): split sizes \[3, 3\] for 1 outputs of an axis of 2"),
    "Split sizes short of the axis": (lambda: _model([helper.make_node("Split", ["x", "s"], ["y", "z"], name="n",
                                                                       axis=2)], {"s": np.array([1, 1])},
                                                     outputs=("y", "z")),
                                      r"ONNX node 'n' \(Split\): split sizes \[1, 1\] for 2 outputs of an axis of 8"),
    "Dropout's ratio not a scalar": (lambda: _model([_node("Dropout", ["x", "r"])],
                                                    {"r": np.array([0.1, 0.2], np.float32)}),
                                     r"ONNX node 'n' \(Dropout\): input 1 \('r'\) holds 2 values"),
    "an Identity whose output is its input": (lambda: _model([helper.make_node("Identity", ["x"], ["x"], name="n"),
                                                              _node("Relu", ["x"], name="r")]),
                                              r"ONNX node 'n' \(Identity\): output 0 \('x'\) is also its input, a "
                                              r"cycle"),
    "a node giving a graph input again": (lambda: _model([helper.make_node("Identity", ["x"], ["a"], name="one"),
                                                          helper.make_node("Identity", ["a"], ["x"], name="n"),
                                                          _node("Relu", ["x"], name="r")]),
                                          r"ONNX node 'n' \(Identity\): output 0 \('x'\) is already a graph input"),
}


@pytest.mark.parametrize("case", list(MALFORMED_CASES))
def test_a_malformed_model_is_a_serialization_error_naming_the_node_and_attribute(case):
    make, words = MALFORMED_CASES[case]
    with pytest.raises(lp.SerializationError, match=words) as e:
        lp.onnx.load(make())
    assert MALFORMED in str(e.value)


@pytest.mark.parametrize("node, words", [
    pytest.param(_node("MaxPool", ["x"], kernel_shape=[0, 0]), r"ONNX node 'n' \(MaxPool\): kernel_shape=\[0, 0\] is "
                 r"an empty window; every size of the kernel must be at least 1", id="empty pool window"),
    pytest.param(_node("Conv", ["x", "w"], kernel_shape=[0, 0]), r"ONNX node 'n' \(Conv\): kernel_shape=\[0, 0\] is "
                 r"an empty window", id="empty conv window"),
    pytest.param(_node("Conv", ["x", "w"], kernel_shape=[2, 2]), r"ONNX node 'n' \(Conv\): kernel_shape=\[2, 2\] "
                 r"does not match the filters' spatial shape \[3, 3\]", id="kernel_shape not the filters'"),
    pytest.param(_node("Conv", ["x", "w"], strides=[0, 0], auto_pad="SAME_UPPER"), r"ONNX node 'n' \(Conv\): "
                 r"strides=\[0, 0\] is not supported", id="zero strides with SAME padding"),
])
def test_a_window_leafpy_cannot_compute_is_a_config_error_naming_it(node, words):
    with pytest.raises(lp.ConfigError, match=words):
        lp.onnx.load(_model([node], FILTERS if "w" in node.input else None))


BIG = 2**24  # values each of these folds gives (8 bytes a value counted: 128 MiB)
GROWING_FOLDS = {
    "ConstantOfShape": (["s"], {"s": np.array([BIG])}),
    "Range": (["a", "b", "d"], {"a": np.array(0), "b": np.array(BIG), "d": np.array(1)}),
    "Expand": (["v", "s"], {"v": np.ones(1, np.float32), "s": np.array([BIG])}),
    "Add": (["u", "v"], {"u": np.ones((4096, 1), np.float32), "v": np.ones((1, 4096), np.float32)}),
    "Gather": (["u", "i"], {"u": np.ones((1, 4096), np.float32), "i": np.zeros(4096, np.int64)}),
}


@pytest.mark.parametrize("op", list(GROWING_FOLDS))
def test_a_constant_fold_past_the_memory_available_is_refused_before_it_is_computed(monkeypatch, op):
    """Operators computed at import from constants can give far more values than the model holds (ConstantOfShape
    of [3 * 2**28]: 3 GB from 163 bytes): refused from the inputs' values, naming the node, before it is computed."""
    inputs, inits = GROWING_FOLDS[op]
    model = _model([helper.make_node(op, inputs, ["c"], name="big"), _node("Relu", ["x"])], inits)
    monkeypatch.setattr(importer, "available_memory", lambda: 2**26)
    with pytest.raises(lp.ConfigError, match=rf"ONNX node 'big' \({op}\): computing it from its constant inputs gives "
                                             rf"{BIG:,} values \(about 128\.0 MB\), more than the 64\.0 MB"):
        lp.onnx.load(model)


def test_gemm_reads_trans_b_as_it_reads_trans_a_0_or_1():
    with pytest.raises(lp.ConfigError, match=r"ONNX node 'n' \(Gemm\): transB=2 is not supported; leafpy supports "
                                             r"transB 0 or 1"):
        lp.onnx.load(_gemm(transB=2))


def test_an_int_where_onnx_declares_a_float_is_read_as_that_number():
    x = np.linspace(-2, 2, 16, dtype=np.float32).reshape(2, 8)
    net = lp.onnx.load(_model([_node("LeakyRelu", ["x"], alpha=2)], x_shape=("N", 8)))
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), np.where(x > 0, x, 2 * x), atol=1e-6)


def test_graph_outputs_of_one_value_are_each_given_and_a_constant_output_is_refused():
    x = np.linspace(-2, 2, 16, dtype=np.float32).reshape(2, 8)
    model = _model([_node("Relu", ["x"]), helper.make_node("Identity", ["y"], ["z"], name="same")], x_shape=("N", 8),
                   outputs=("y", "z"))
    y, z = (o.to_numpy() for o in lp.onnx.load(model).forward([x]))
    np.testing.assert_allclose(y.reshape(2, 8), np.maximum(x, 0))
    np.testing.assert_allclose(z.reshape(2, 8), np.maximum(x, 0))
    model = _model([_node("Relu", ["x"])], {"c": np.ones(3, np.float32)}, x_shape=("N", 8), outputs=("y", "c"))
    with pytest.raises(lp.ConfigError, match="ONNX graph output 'c' is a constant"):
        lp.onnx.load(model)


def test_the_leafpy_command_names_the_file_node_and_attribute_without_a_traceback(tmp_path):
    """``leafpy summary``, ``convert`` and ``predict`` as a user runs them on malformed files: exit status 1, the
    file, the node, the operator and the attribute on stderr."""
    cases = {
        "strides.onnx": (MALFORMED_CASES["Conv strides as INT"][0](), ["summary", "{path}"],
                         "ONNX node 'n' (Conv): attribute 'strides' is an integer (INT)"),
        "pool.onnx": (MALFORMED_CASES["MaxPool without kernel_shape"][0](), ["convert", "{path}", "{dir}/out.leaf"],
                      "ONNX node 'n' (MaxPool): attribute 'kernel_shape' is missing"),
        "outputs.onnx": (_no_outputs(), ["predict", "{path}", "--input", "{dir}/x.npz"],
                         "ONNX graph 'g': no graph outputs"),
    }
    np.savez(tmp_path / "x.npz", x=np.ones((2, 4), np.float32))
    for name, (model, command, words) in cases.items():
        path = tmp_path / name
        path.write_bytes(model.SerializeToString())
        args = [a.format(path=path, dir=tmp_path) for a in command]
        p = subprocess.run([sys.executable, "-m", "leafpy", *args], cwd=ROOT, env=child_env(), capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 1, (name, p.returncode, p.stderr)
        assert "Traceback" not in p.stderr, p.stderr
        assert f"{path}: {words}" in p.stderr, p.stderr
    with pytest.raises(lp.SerializationError, match="strides.onnx: ONNX node 'n' \\(Conv\\): attribute 'strides'"):
        lp.onnx.read_weights(tmp_path / "strides.onnx")


def test_an_imported_network_computes_the_inference_function_from_its_first_forward():
    """BatchNormalization (running statistics far from a batch's, a scale and a bias) then Dropout (ratio 0.5):
    the first forward pass of the imported network is ONNX's inference function, computed here in float64, and it
    leaves the running statistics as the model gives them."""
    rng = np.random.default_rng(7)
    stats = {"scale": rng.normal(1, 0.5, 3), "bias": rng.normal(0, 1, 3), "mean": rng.normal(0, 2, 3),
             "var": rng.uniform(0.3, 3, 3)}
    inits = {k: v.astype(np.float32) for k, v in stats.items()}
    inits["ratio"] = np.array(0.5, np.float32)
    eps = 1e-3
    nodes = [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["n"], name="bn",
                              epsilon=eps, momentum=0.7),
             helper.make_node("Dropout", ["n", "ratio"], ["y"], name="drop")]
    net = lp.onnx.load(_model(nodes, inits, x_shape=("N", 3, 4, 4)))
    x = rng.normal(0, 1, (5, 3, 4, 4)).astype(np.float32)
    mean, var, scale, bias = (inits[k].astype(np.float64)[:, None, None] for k in ("mean", "var", "scale", "bias"))
    want = (x.astype(np.float64) - mean) / np.sqrt(var + np.float32(eps).astype(np.float64)) * scale + bias
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), want, rtol=1e-5, atol=1e-5)
    weights = net.named_weights()
    np.testing.assert_array_equal(weights["bn/running_mean"], inits["mean"])
    np.testing.assert_array_equal(weights["bn/running_var"], inits["var"])


@pytest.mark.parametrize("make", [
    pytest.param(lambda: _model([_node("Gemm", ["x", "w"], transB=1)], {"w": np.ones((4, 5), np.float32)},
                                x_shape=("N", 3)), id="weights of another shape than the input takes"),
    pytest.param(lambda: _model([_node("Relu", ["x"])], x_shape=("N", 100_000, 100_000, 100_000)),
                 id="a size past memory"),
])
def test_what_building_an_imported_network_refuses_names_the_file(tmp_path, make):
    """Past conversion, building the network (shapes, memory, the weights' shapes) refuses a model too: those
    errors name the file as conversion's do, in Python and through the command."""
    path = tmp_path / "odd.onnx"
    path.write_bytes(make().SerializeToString())
    with pytest.raises(lp.LeafpyError) as e:
        lp.onnx.load(str(path))
    assert str(e.value).startswith(str(path)), e.value
    np.savez(tmp_path / "x.npz", x=np.ones((2, 3), np.float32))
    p = subprocess.run([sys.executable, "-m", "leafpy", "predict", "odd.onnx", "--input", "x.npz"], cwd=tmp_path,
                       env=child_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stderr.startswith("leafpy: error: odd.onnx: "), p.stderr
    assert "Traceback" not in p.stderr
