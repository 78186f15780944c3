"""Model files whose weights hold NaN or infinite values (or values too large for float32), or one weight twice,
are refused when written and when read, naming the weight; ``allow_non_finite=True`` lets such a model through
with a warning. Files are crafted with the schema and a valid checksum, as a damaged run or a hostile writer
would leave them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import leafpy as lp
from leafpy import serialization as ser
from tests.hostile.corpus import write_weights as write_model
from tests.test_user_paths import failed_cleanly, leafpy


def _linear(seed: int = 0) -> lp.Layer:
    layer = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("fc", lp.LinearConfig(output_size=3)), seed=seed)
    layer.forward([np.ones((2, 4), np.float32)])
    return layer


def with_bad_values(weights: dict[str, np.ndarray], name: str, value: float, count: int) -> list:
    out = {k: v.copy() for k, v in weights.items()}
    out[name].reshape(-1)[:count] = value
    return list(out.items())


@pytest.mark.parametrize("value, words", [(np.nan, "3 NaN values"), (np.inf, "3 infinite values"),
                                          (-np.inf, "3 infinite values")])
def test_a_model_file_with_non_finite_weights_is_refused_naming_the_weight(tmp_path, value, words):
    layer = _linear()
    path = tmp_path / "model.leaf"
    write_model(path, layer.config, with_bad_values(layer.named_weights(), "fc/weight", value, 3))
    be = lp.backend("native")
    for load in (lambda: lp.Layer.load(be, str(path)), lambda: ser.load_weights(_linear(1), path)):
        with pytest.raises(lp.SerializationError) as e:
            load()
        assert str(path) in str(e.value) and "'fc/weight'" in str(e.value) and words in str(e.value)
        assert "retrain or load an earlier checkpoint" in str(e.value)
    with pytest.warns(RuntimeWarning, match="fc/weight"):
        loaded = lp.Layer.load(be, str(path), allow_non_finite=True)
    loaded.forward([np.ones((1, 4), np.float32)])  # a standalone layer makes its weights on its first pass
    assert np.count_nonzero(~np.isfinite(loaded.named_weights()["fc/weight"])) == 3


def test_saving_non_finite_or_overflowing_weights_is_refused_and_keeps_the_last_good_file(tmp_path):
    layer = _linear()
    path = tmp_path / "model.leaf"
    layer.save(str(path))
    good = path.read_bytes()
    w = layer.learnable_weights_data()[1]
    w.set(np.array([0.0, np.nan, 1.0], np.float32))
    with pytest.raises(lp.SerializationError, match=r"weight 'fc/bias' holds 1 NaN value; .*nothing was written"):
        layer.save(str(path))
    assert path.read_bytes() == good
    # float64 values beyond float32's range would be written as infinities
    weights = {"fc/weight": np.full((3, 4), 1e39), "fc/bias": np.zeros(3)}
    with pytest.raises(lp.SerializationError, match=r"'fc/weight' holds 12 infinite values \(12 of them finite "
                                                    r"values too large for float32\)"):
        ser.save_model(path, layer.config, weights)
    assert path.read_bytes() == good
    with pytest.warns(RuntimeWarning, match="fc/bias"):
        layer.save(str(path), allow_non_finite=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loaded = lp.Layer.load(lp.backend("native"), str(path), allow_non_finite=True)
    loaded.forward([np.ones((1, 4), np.float32)])
    assert np.isnan(loaded.named_weights()["fc/bias"][1])


def test_a_checkpoint_of_non_finite_weights_is_neither_written_nor_read(tmp_path):
    from tests.hostile.corpus import make_checkpoint

    path = tmp_path / "ckpt.leaf"
    make_checkpoint(path)
    solver = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"), str(path))
    good = path.read_bytes()
    w = solver.network.learnable_weights_data()[0]
    w.set(np.full(w.shape, np.inf, np.float32))
    with pytest.raises(lp.SerializationError, match="'fc/weight' holds 12 infinite values"):
        solver.save_checkpoint(str(path))
    assert path.read_bytes() == good
    msg = ser.editable_message(path, "SolverCheckpoint")
    msg.network.weightsData[1].tensor.raw = np.array([np.nan, 0, 0], "<f4").tobytes()
    path.write_bytes(ser.encode(msg, "SolverCheckpoint"))
    with pytest.raises(lp.SerializationError, match="'fc/bias' holds 1 NaN value"):
        lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"), str(path))


def test_a_model_file_naming_a_weight_twice_is_refused(tmp_path):
    layer = _linear()
    path = tmp_path / "twice.leaf"
    weights = list(layer.named_weights().items()) + [("fc/bias", np.ones(3, np.float32))]
    write_model(path, layer.config, weights)
    with pytest.raises(lp.SerializationError, match="weight 'fc/bias' appears twice"):
        lp.Layer.load(lp.backend("native"), str(path))


def test_predict_and_evaluate_refuse_a_trained_model_with_a_nan_weight(tmp_path):
    assert leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run").returncode == 0
    model = tmp_path / "run" / "model.leaf"
    saved = lp.Layer.load(lp.backend("native"), str(model))
    write_model(model, saved.config, with_bad_values(saved.named_weights(), "fc1/weight", np.nan, 3))
    np.savez(tmp_path / "new.npz", x=np.zeros((2, 1, 8, 8), np.float32))
    for args in (("predict", "run", "--input", "new.npz"), ("evaluate", "run")):
        p = leafpy(tmp_path, *args)
        failed_cleanly(p, "model.leaf", "weight 'fc1/weight' holds 3 NaN values", "retrain")


@pytest.mark.parametrize("edit,says", [
    (lambda m: (setattr(m, "rngSeeds", [7, 8]), setattr(m, "rngCalls", [3])), "2 random streams' seeds but 1 draw"),
    (lambda m: setattr(m, "lossScale", -5.0), "loss scale is -5.0, where it is positive"),
    (lambda m: setattr(m, "lossScale", float("nan")), "loss scale is nan, where it is positive"),
])
def test_a_checkpoint_with_damaged_random_streams_or_loss_scale_is_refused(tmp_path, edit, says):
    """Checkpoint fields edited by hand (checksum valid): seeds and draw counts of different lengths (zip dropped
    the extra seed; a Dropout layer took seed 7 the run never used), a negative or NaN loss scale (read as "no
    loss scaling") are refused as damaged, naming the file."""
    from tests.hostile.corpus import make_checkpoint

    path = tmp_path / "ckpt.leaf"
    make_checkpoint(path)
    msg = ser.editable_message(path, "SolverCheckpoint")
    edit(msg)
    path.write_bytes(ser.encode(msg, "SolverCheckpoint"))
    with pytest.raises(lp.SerializationError) as e:
        lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"), str(path))
    assert str(e.value).startswith(f"{path}: ") and says in str(e.value) and "damaged" in str(e.value)
