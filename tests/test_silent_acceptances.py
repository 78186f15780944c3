"""Inputs that were once taken without a word and meant something else: npz files of times, dates, complex numbers
or text, float64 samples that float32 turns to 0, npz files holding two datasets, data settings the digits
dataset ignores, a checkpoint without its random layers' state, and a prefix view larger than its tensor."""

from __future__ import annotations

import numpy as np
import pytest

import leafpy as lp
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
