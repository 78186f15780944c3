"""The plans leafpy.web exports, replayed with wgpu-py on this machine's WebGPU adapter (lavapipe) exactly as
leafpy.js replays them, against the native backend: every inference layer, softmax rows included (which Chrome
cannot compile yet), and the shipped digits networks (LeNet, ResNet, LSTM); the float16 plans (adapters with
shader-f16; lavapipe offers it) within test_webgpu_fp16.py's tolerance rule, and as the fp16 backend computes."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

import leafpy as lp
from tests.conftest import webgpu_offering
from tests.test_mixed_precision import GROWTH, _roundings
from tests.test_user_paths import failed_cleanly, leafpy
from tests.test_webgpu_fp16 import U, _rel
from tests.web_replay import CASES, network, replay


def _compare(net: lp.Layer, folder, sample: tuple[int, ...], batches: tuple[int, ...]) -> float:
    worst = 0.0
    for n in batches:
        x = np.random.default_rng(n).uniform(0, 1, (n, *sample)).astype(np.float32)
        want = net.forward([x])[0].to_numpy()
        got = replay(folder, x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


@pytest.mark.webgpu
@pytest.mark.parametrize("case", list(CASES))
def test_each_layer_types_plan_replays_as_native(tmp_path, case):
    webgpu_offering()
    sample, layers = CASES[case]
    net = network(case, sample, layers)
    lp.web.export(net, tmp_path, batch_sizes=[3])
    print(f"{case}: max |replayed plan - native| = {_compare(net, tmp_path, tuple(sample), (1, 3)):.3g}")


@pytest.mark.webgpu
@pytest.mark.parametrize("name", ["digits_lenet", "digits_resnet", "digits_lstm"])
def test_shipped_digits_networks_plans_replay_as_native(tmp_path, name):
    webgpu_offering()
    run = lp.config.load(name)
    net = lp.Layer.from_config(lp.backend("native"), run.network, seed=0)
    net.set_training(False)
    sample = tuple(run.network.config.inputs[0][1][1:])
    lp.web.export(net, tmp_path, batch_sizes=[4])
    doc = json.loads((tmp_path / "model" / "plan.json").read_text())
    assert doc["output_kind"] == "log_probabilities" and doc["input_shape"] == list(sample)
    print(f"{name}: max |replayed plan - native| = {_compare(net, tmp_path, sample, (1, 4)):.3g}")


def test_export_refuses_bad_arguments_with_leafpy_errors(tmp_path):
    net = network("small", *CASES["sigmoid_tanh"])
    for bad in ([], [0], ["8"], [True], "8"):
        with pytest.raises(lp.LeafpyError, match="batch_sizes"):
            lp.web.export(net, tmp_path / "out", batch_sizes=bad)
    (tmp_path / "file").write_text("x")
    # precision fp32, not "auto" (which asks the webgpu adapter first): refused without wgpu too
    with pytest.raises(lp.LeafpyError, match="not a folder"):
        lp.web.export(net, tmp_path / "file", precision="fp32")
    bare = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    with pytest.raises(lp.LeafpyError, match="declares 0 inputs"):
        lp.web.export(bare, tmp_path / "out", precision="fp32")
    with pytest.raises(lp.LeafpyError, match="expected a Layer"):
        lp.web.export("model.leaf", tmp_path / "out")  # type: ignore[arg-type]


def test_export_command_refuses_what_it_cannot_export(tmp_path):
    network("small", *CASES["sigmoid_tanh"]).save(str(tmp_path / "model.leaf"))
    failed_cleanly(leafpy(tmp_path, "export", "--web", "out", "missing.leaf"), "missing.leaf")
    failed_cleanly(leafpy(tmp_path, "export", "--web", "out", "model.leaf", "--batch-sizes", "8,x"),
                   "--batch-sizes")
    failed_cleanly(leafpy(tmp_path, "export", "--web", "model.leaf", "model.leaf", "--precision", "fp32"),
                   "not a folder")
    (tmp_path / "run").mkdir()
    failed_cleanly(leafpy(tmp_path, "export", "--web", "out", "run"), "no model.leaf")
    failed_cleanly(leafpy(tmp_path, "export", "--web", "out", "notes.txt"), "give a model")


# --- float16 plans ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp16():
    webgpu_offering("shader-f16")
    return lp.backend("webgpu", precision="fp16")


def _fp16_tolerance(net: lp.Layer) -> float:
    """test_webgpu_fp16.py's rule, GROWTH * roundings * u, over the network (after a forward): the roundings of
    each layer on the path, counted as test_mixed_precision._roundings counts them, and one for the input's cast."""
    roundings = 1 + sum(_roundings(layer.config.type, layer, [np.empty(layer.inputs[0].shape, np.float32)])
                        for layer in net.layers)
    return GROWTH * roundings * U


def _compare_fp16(net: lp.Layer, fp16, folder, sample: tuple[int, ...], batches: tuple[int, ...]) -> float:
    """The replayed fp16 plans against native float32 (the tolerance rule) and against the fp16 backend's own
    forward pass on the same weights (the same dispatches: within one float16 rounding)."""
    on16 = lp.Layer.from_config(fp16, net.config)
    on16.load_weights(net.named_weights())
    on16.set_training(False)
    worst = 0.0
    for n in batches:
        x = np.random.default_rng(n).uniform(0, 1, (n, *sample)).astype(np.float32)
        want = net.forward([x])[0].to_numpy()
        got = replay(folder, x, "fp16")
        assert got.dtype == np.float32 and got.shape == want.shape
        assert _rel(got, on16.forward([x])[0].to_numpy()) <= U, "the fp16 plan differs from the fp16 backend"
        err, tol = _rel(got, want), _fp16_tolerance(net)
        assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"
        assert err > 0, "no float16 rounding at all: the fp32 plans were replayed"
        worst = max(worst, err)
    return worst


@pytest.mark.webgpu
@pytest.mark.parametrize("case", ["conv_relu_pool_linear", "batchnorm_dropout", "more_activations", "lstm",
                                  "log_softmax"])
def test_fp16_plans_replay_as_native_within_float16_tolerance(tmp_path, fp16, case):
    sample, layers = CASES[case]
    net = network(case, sample, layers)
    assert lp.web.export(net, tmp_path, batch_sizes=[3], precision="both") == ["fp32", "fp16"]
    doc = json.loads((tmp_path / "model" / "plan.json").read_text())
    entries = [s["entry"] for s in doc["fp16"]["plans"][0]["steps"] if "entry" in s]
    assert entries[0] == "to_f16" and any("16" in m for m in doc["fp16"]["modules"])
    assert {t["dtype"] for t in doc["fp16"]["weights"]["tensors"].values()} >= {"float16"}
    worst = _compare_fp16(net, fp16, tmp_path, tuple(sample), (1, 3))
    print(f"{case}: max relative |fp16 plan - native| = {worst:.3g} (tolerance {_fp16_tolerance(net):.3g})")


@pytest.mark.webgpu
def test_digits_lenet_fp16_plans_replay_as_native_within_float16_tolerance(tmp_path, fp16):
    run = lp.config.load("digits_lenet")
    net = lp.Layer.from_config(lp.backend("native"), run.network, seed=0)
    net.set_training(False)
    lp.web.export(net, tmp_path, batch_sizes=[4], precision="fp16")
    doc = json.loads((tmp_path / "model" / "plan.json").read_text())
    assert doc["precisions"] == ["fp16"] and "plans" not in doc and not (tmp_path / "model" / "weights.bin").exists()
    x = lp.data.digits().x_test[:4]
    worst = _compare_fp16(net, fp16, tmp_path, x.shape[1:], (1, 4))
    print(f"digits LeNet: max relative |fp16 plan - native| = {worst:.3g} (tolerance {_fp16_tolerance(net):.3g})")


@pytest.mark.webgpu
def test_export_command_writes_the_precisions_asked_for(tmp_path, fp16):
    network("small", *CASES["sigmoid_tanh"]).save(str(tmp_path / "model.leaf"))
    for option, want in [([], ["fp32", "fp16"]), (["--precision", "both"], ["fp32", "fp16"]),
                         (["--precision", "fp32"], ["fp32"]), (["--precision", "fp16"], ["fp16"])]:
        out = tmp_path / f"site{len(option)}{want[-1]}"
        p = leafpy(tmp_path, "export", "--web", str(out), "model.leaf", "--batch-sizes", "2", *option)
        assert p.returncode == 0, p.stderr
        assert f"precisions {', '.join(want)}" in p.stdout, p.stdout
        assert "lacks shader-f16" not in p.stdout, p.stdout  # this adapter offers it: fp32 alone was asked for
        doc = json.loads((out / "model" / "plan.json").read_text())
        assert doc["precisions"] == want
        for precision in want:
            variant = doc if precision == "fp32" else doc[precision]
            assert [plan["batch"] for plan in variant["plans"]] == [1, 2]
            for entry in [variant["weights"], *variant["modules"].values()]:
                data = (out / "model" / entry["file"]).read_bytes()
                assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"]
        assert ("fp16" in doc) == ("fp16" in want) and ("plans" in doc) == ("fp32" in want)
    # an fp32 export over one that had fp16 plans leaves no float16 weights behind
    p = leafpy(tmp_path, "export", "--web", str(tmp_path / "site0fp16"), "model.leaf", "--precision", "fp32")
    assert p.returncode == 0 and sorted(f.name for f in (tmp_path / "site0fp16" / "model").glob("*.bin")) == [
        "weights.bin"], p.stderr
    p = leafpy(tmp_path, "export", "--web", "bad", "model.leaf", "--precision", "fp64")
    assert p.returncode == 2 and "--precision" in p.stderr and "fp16" in p.stderr, p.stderr
    with pytest.raises(lp.LeafpyError, match="precision: expected one of auto, fp32, fp16, both"):
        lp.web.export(network("small", *CASES["sigmoid_tanh"]), tmp_path / "bad", precision="half")


def test_a_layer_without_a_webgpu_kernel_is_named_when_export_refuses_it(tmp_path):
    """A Transpose (its forward reads back to the host on webgpu): the export refuses the network naming the layer
    and its type (before: 'this network reads data back ...', no layer named)."""
    webgpu_offering()
    from leafpy.layers.utility.transpose import TransposeConfig

    cfg = lp.SequentialConfig(inputs=[("data", [1, 4, 3])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    cfg.add_layer(lp.LayerConfig("swap", TransposeConfig(perm=[1, 0])))
    cfg.add_layer(lp.LayerConfig("relu", "ReLU"))
    net = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("n", cfg), seed=0)
    with pytest.raises(lp.LeafpyError, match=r"leafpy.web: layer 'swap' \(Transpose\) reads data back to the host"):
        lp.web.export(net, tmp_path / "x")
