"""Inputs that were once taken without a word and meant something else: npz files of times, dates, complex numbers
or text, float64 samples that float32 turns to 0, npz files holding two datasets, data settings the digits
dataset ignores, a checkpoint without its random layers' state, and a prefix view larger than its tensor."""

from __future__ import annotations

import numpy as np
import pytest

import leafpy as lp
from leafpy.layers.common.matmul import MatMulConfig
from tests.hostile.corpus import edited_checkpoint, make_checkpoint, npz_oddities
from tests.test_user_paths import failed_cleanly, leafpy

NPZ_WORDS = {"timedelta": "time spans (timedelta64)", "datetime": "dates (datetime64)",
             "complex": "complex numbers", "text": "holds text of dtype",
             "underflow": "18 nonzero values that become 0 in float32",
             "two-layouts": "holds both x, y and x_train, y_train, x_test, y_test"}


@pytest.mark.parametrize("name", list(NPZ_WORDS))
def test_npz_files_that_are_not_one_dataset_of_real_numbers_are_refused(tmp_path, name):
    path = next(p for p in npz_oddities(tmp_path) if p.name == f"npz-{name}.npz")
    with pytest.raises(lp.SerializationError) as e:
        lp.data.npz(str(path))
    assert str(path) in str(e.value) and NPZ_WORDS[name] in str(e.value)


def test_training_on_an_npz_of_time_spans_is_refused_through_the_command(tmp_path):
    x = np.arange(60 * 64).astype("timedelta64[s]").reshape(60, 1, 8, 8)
    np.savez(tmp_path / "times.npz", x=x, y=np.arange(60) % 10)
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run", "--set", "data.dataset=npz",
               "--set", "data.path=times.npz")
    failed_cleanly(p, "times.npz", "timedelta64")
    assert not (tmp_path / "run" / "checkpoint.leaf").exists()


@pytest.mark.parametrize("setting", ["data.num_classes=12", "data.path=mine.npz"])
def test_data_settings_the_digits_dataset_would_ignore_are_refused(tmp_path, setting):
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run", "--set", setting)
    failed_cleanly(p, setting.split("=")[0], "digits", "npz")


def test_a_checkpoint_without_its_dropout_state_is_refused(tmp_path):
    good = tmp_path / "good.leaf"
    make_checkpoint(good, dropout=True)
    bad = edited_checkpoint(good, tmp_path / "bad.leaf", rngCalls=[], rngSeeds=[])
    be = lp.backend("native")
    with pytest.raises(lp.SerializationError, match="bad.leaf: .*random has 0 entries, the network has 1"):
        lp.Solver.load_checkpoint(be, be, str(bad))


def test_a_prefix_view_larger_than_the_tensor_is_refused_and_keeps_its_data():
    t = lp.SharedTensor.from_numpy(np.arange(6, dtype=np.float32))
    with pytest.raises(lp.ShapeError, match="prefix_view: shape \\(10,\\) needs 10 elements.*holds 6"):
        t.prefix_view((10,))
    np.testing.assert_array_equal(t.to_numpy(), np.arange(6, dtype=np.float32))
    np.testing.assert_array_equal(t.prefix_view((2, 2)).to_numpy(), [[0, 1], [2, 3]])


@pytest.mark.parametrize("build,words", [
    (lambda: lp.ReshapeConfig(shape=[2, 0, 5]), r"ReshapeConfig\.shape\[1\]: expected a positive integer or -1"),
    (lambda: lp.EltwiseConfig(coeff={}), "EltwiseConfig.coeff: expected a list of numbers"),
    (lambda: lp.EltwiseConfig(weight_shape={}), "EltwiseConfig.weight_shape: expected a list"),
    (lambda: MatMulConfig(weight_shape={}), r"MatMulConfig\.weight_shape: expected \[\]"),
    (lambda: lp.SliceConfig(axis=1, slice_points={2}), "SliceConfig.slice_points: expected a list"),
], ids=["Reshape 0", "Eltwise coeff {}", "Eltwise weight_shape {}", "MatMul weight_shape {}", "Slice a set"])
def test_settings_that_meant_something_else_are_refused(build, words):
    """A Reshape entry 0 was taken as -1 (inferred: [2, 0, 5] gave [2, 12, 5]), and an empty mapping (YAML's {})
    where a list belongs as the empty list; a set has no order to cut at."""
    with pytest.raises(lp.ConfigError, match=words):
        build()


def test_a_reshape_to_zero_in_a_run_file_is_refused_and_a_saved_inferred_entry_loads_back(tmp_path):
    text = ("network: {type: Sequential, inputs: [{name: data, shape: [2, 3, 4, 5]}], "
            "layers: [{name: r, type: Reshape, shape: [%s]}]}\nobjective: mse\n")
    with pytest.raises(lp.ConfigError, match=r"network\.layers\[0\]\.shape\[1\]: expected a positive integer or -1"):
        lp.config.loads(text % "2, 0, 5")
    net = lp.Layer.from_config(lp.backend("native"), lp.config.loads(text % "2, -1, 5").network, seed=0)
    net.save(str(tmp_path / "m.leaf"))
    back = lp.Layer.load(lp.backend("native"), str(tmp_path / "m.leaf"))
    assert back.config == net.config
    x = np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5)
    np.testing.assert_array_equal(back.forward([x])[0].to_numpy(), x.reshape(2, 12, 5))
