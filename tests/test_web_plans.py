"""The plans leafpy.web exports, replayed with wgpu-py on this machine's WebGPU adapter (lavapipe) exactly as
leafpy.js replays them, against the native backend: every inference layer, softmax rows included (which Chrome
cannot compile yet), and the shipped digits networks (LeNet, ResNet, LSTM)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import leafpy as lp
from tests.conftest import webgpu_offering
from tests.test_user_paths import failed_cleanly, leafpy
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
    with pytest.raises(lp.LeafpyError, match="not a folder"):
        lp.web.export(net, tmp_path / "file")
    bare = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    with pytest.raises(lp.LeafpyError, match="declares 0 inputs"):
        lp.web.export(bare, tmp_path / "out")
    with pytest.raises(lp.LeafpyError, match="expected a Layer"):
        lp.web.export("model.leaf", tmp_path / "out")  # type: ignore[arg-type]


def test_export_command_refuses_what_it_cannot_export(tmp_path):
    network("small", *CASES["sigmoid_tanh"]).save(str(tmp_path / "model.leaf"))
    failed_cleanly(leafpy(tmp_path, "export", "--web", "out", "missing.leaf"), "missing.leaf")
    failed_cleanly(leafpy(tmp_path, "export", "--web", "out", "model.leaf", "--batch-sizes", "8,x"),
                   "--batch-sizes")
    failed_cleanly(leafpy(tmp_path, "export", "--web", "model.leaf", "model.leaf"), "not a folder")
    (tmp_path / "run").mkdir()
    failed_cleanly(leafpy(tmp_path, "export", "--web", "out", "run"), "no model.leaf")
    failed_cleanly(leafpy(tmp_path, "export", "--web", "out", "notes.txt"), "give a model")
