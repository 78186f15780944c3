"""ONNX's own backend node tests, for the operators leafpy's layers cover, run through leafpy.onnx.backend by
ONNX's runner (onnx.backend.test.BackendTest). Tests leafpy does not pass yet are listed with their reasons in
tests/onnx_exclusions.txt and skipped; every other in-scope test must pass. The table per operator:
``python -m leafpy.onnx.conformance --table``."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx", reason="the ONNX conformance tests need the onnx package (pip install 'leafpy-dl[onnx]')")

import onnx.backend.test  # noqa: E402
from conftest import backend_or_skip  # noqa: E402

import leafpy  # noqa: E402
import leafpy.onnx.backend  # noqa: E402
from leafpy.onnx import conformance  # noqa: E402

EXCLUSIONS = Path(__file__).with_name("onnx_exclusions.txt")


def excluded() -> dict[str, str]:
    """Test name -> its reason, from the exclusion file (comment lines and blank lines skipped)."""
    out = {}
    for line in EXCLUSIONS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, reason = line.partition("#")
            out[name.strip()] = reason.strip()
    return out


IN_SCOPE = [c.name for c in conformance.node_tests()]

with warnings.catch_warnings(), np.errstate(all="ignore"):
    warnings.simplefilter("ignore")
    _backend_test = onnx.backend.test.BackendTest(leafpy.onnx.backend, __name__)
for _name in IN_SCOPE:
    _backend_test.include(f"^{re.escape(_name)}_cpu$")
for _name in excluded():
    _backend_test.exclude(f"^{re.escape(_name)}_cpu$")
globals().update(_backend_test.test_cases)


def test_every_exclusion_is_an_in_scope_test_with_a_reason():
    scope = set(IN_SCOPE)
    for name, reason in excluded().items():
        assert name in scope, f"{name} in {EXCLUSIONS.name} is not an in-scope node test"
        assert len(reason) > 10, f"{name} in {EXCLUSIONS.name} has no reason"


def test_most_in_scope_node_tests_are_run_not_excluded():
    # 267 of 295 pass at the time of writing (227 before broadcasting, batched MatMul, Transpose, recurrent
    # directions and layouts, ONNX's GRU and dilated pooling; 176 before the loss options)
    assert len(IN_SCOPE) - len(excluded()) >= 267, (len(IN_SCOPE), len(excluded()))


LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
def _light(name: str):
    from onnx.backend.test.runner import Runner

    model = onnx.load(str(LIGHT / f"light_{name}.onnx"))
    inits = {i.name for i in model.graph.initializer}
    feeds = [Runner.generate_dummy_data(x) for x in model.graph.input if x.name not in inits]  # as ONNX's runner
    want = onnx.numpy_helper.to_array(onnx.load_tensor(str(LIGHT / f"light_{name}_output_0.pb")))
    return model, feeds, want


@pytest.mark.parametrize("name", ["resnet50", "squeezenet", "shufflenet", "inception_v1", "inception_v2",
                                  pytest.param("densenet121", marks=pytest.mark.slow),
                                  pytest.param("bvlc_alexnet", marks=pytest.mark.slow),
                                  pytest.param("zfnet512", marks=pytest.mark.slow),
                                  pytest.param("vgg19", marks=pytest.mark.slow)])
def test_light_models_in_the_onnx_wheel_match_their_stored_outputs(name):
    model, feeds, want = _light(name)
    got = leafpy.onnx.backend.prepare(model).run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-7)


def _with_random_weights(model, rng: np.random.Generator):
    """``model`` with each ConstantOfShape weight (a light model's weights are one value repeated, so that every
    class scores the same and the stored output is uniform) replaced by random values, and the last Softmax left
    out: the class scores then depend on every layer."""
    g = model.graph
    shapes = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
    kept = []
    for node in g.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in shapes:
            shape = shapes[node.input[0]].astype(np.int64)
            scale = 1 / np.sqrt(max(int(np.prod(shape[1:])), 1))
            value = rng.normal(0, scale, shape) if len(shape) > 1 else rng.uniform(0.5, 1.5, shape)
            g.initializer.append(onnx.numpy_helper.from_array(value.astype(np.float32), node.output[0]))
        else:
            kept.append(node)
    if kept[-1].op_type == "Softmax":
        g.output[0].name = kept.pop().input[0]
    del g.node[:]
    g.node.extend(kept)
    return model


@pytest.mark.parametrize("name", ["shufflenet", "inception_v1", "densenet121", "inception_v2",
                                  pytest.param("bvlc_alexnet", marks=pytest.mark.slow)])
def test_light_models_with_random_weights_match_onnxruntime(name):
    """Grouped convolution, a channel shuffle (Reshape, Transpose, Reshape), asymmetric pooling pads, a product and
    a sum by broadcast constants (densenet121's and inception_v2's input scaling): with the light models' constant
    weights these would all give the same uniform output, so random weights stand in for them."""
    ort = pytest.importorskip("onnxruntime", reason="the class scores are checked against onnxruntime")
    rng = np.random.default_rng(0)
    model = _with_random_weights(_light(name)[0], rng)
    x = rng.normal(0, 1, (1, 3, 224, 224)).astype(np.float32)
    inits = {t.name for t in model.graph.initializer}
    data = next(i.name for i in model.graph.input if i.name not in inits)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {data: x})[0]
    net = leafpy.onnx.load(model)
    net.set_training(False)
    got = net.forward([x])[0].to_numpy().reshape(want.shape)
    assert float(want.std()) > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


LIGHT_MODELS = ("shufflenet", "squeezenet", "inception_v1", "resnet50", "densenet121", "inception_v2",
                "bvlc_alexnet", "zfnet512", "vgg19")
GPU_LIGHT = [pytest.param(name, backend, marks=getattr(pytest.mark, backend), id=f"{name}-{backend}")
             for backend in ("webgpu", "cuda") for name in LIGHT_MODELS]
CPU_ADAPTER_LIGHT = ("shufflenet", "squeezenet", "inception_v1", "resnet50")
"""The ones a CPU Vulkan driver (where CI runs the webgpu tests) computes in a few seconds; densenet121 takes 34 s
there and vgg19 minutes, so the rest run on webgpu where its adapter is a GPU."""


@pytest.mark.parametrize("name,backend", GPU_LIGHT)
def test_light_models_with_random_weights_match_onnxruntime_on_a_gpu_backend(name, backend):
    """The same imported graphs (grouped convolution, channel shuffle, asymmetric pooling pads, broadcast constants,
    concatenations) on cuda and webgpu, checked against onnxruntime's scores on the CPU."""
    ort = pytest.importorskip("onnxruntime", reason="the class scores are checked against onnxruntime")
    be = backend_or_skip(backend)
    if backend == "webgpu" and name not in CPU_ADAPTER_LIGHT and be.adapter.info.get("adapter_type") == "CPU":
        pytest.skip(f"{name} on webgpu runs where the adapter is a GPU ({be.adapter_name} is a CPU emulation)")
    rng = np.random.default_rng(1)
    model = _with_random_weights(_light(name)[0], rng)
    x = rng.normal(0, 1, (1, 3, 224, 224)).astype(np.float32)
    inits = {t.name for t in model.graph.initializer}
    data = next(i.name for i in model.graph.input if i.name not in inits)
    quiet = ort.SessionOptions()
    quiet.log_severity_level = 3
    want = ort.InferenceSession(model.SerializeToString(), quiet, providers=["CPUExecutionProvider"]).run(
        None, {data: x})[0]
    net = leafpy.onnx.load(model, be)
    net.set_training(False)
    got = net.forward([x])[0].to_numpy().reshape(want.shape)
    assert float(want.std()) > 0.1
    # cuDNN and the WGSL kernels sum in other orders and may use TF32-free but reassociated reductions
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max()))


def test_every_excluded_test_still_fails_so_the_list_stays_true():
    """When a layer feature lands, the tests it makes pass leave the exclusion file (regenerate it with
    ``python -m leafpy.onnx.conformance --exclusions``)."""
    listed = excluded()
    cases = [c for c in conformance.node_tests() if c.name in listed]
    passing = [c.name for c in cases if conformance.run_case(leafpy.onnx.backend, c) is None]
    assert not passing, f"now passing, remove from {EXCLUSIONS.name}: {passing}"
