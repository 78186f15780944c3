"""The Python API as a user writing a script or a notebook meets it: configs built by hand (docs/api.md's and DESIGN's
ways) and from YAML-like dicts, with the mistakes people make in them, and networks, solvers and trainers driven
from Python. Each test checks what the user sees (a LeafpyError naming the field and the fix, or a number) against
an expectation worked out independently (NumPy float64, a formula, the documented behaviour)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import leafpy as lp


def _net(layer: lp.LayerConfig, shape: tuple[int, ...] = (4, 6)) -> lp.Layer:
    cfg = lp.SequentialConfig(inputs=[("data", list(shape))])
    cfg.add_layer(layer)
    return lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg), seed=0)


# --- configs built by hand -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, field", [
    (lambda: lp.LinearConfig(outputsize=3), "output_size"),
    (lambda: lp.ConvolutionConfig(num_output=2, filter_shape=[3], strides=[1]), "stride"),
    (lambda: lp.PoolingConfig(mode="max", kernel_size=[2]), "filter_shape"),
    (lambda: lp.DropoutConfig(p=0.5), "ratio"),
    (lambda: lp.LSTMConfig(hidden=4), "hidden_size"),
    (lambda: lp.WeightConfig(nmae="w"), "name"),
    (lambda: lp.FillerConfig(kind="he"), "type"),
    (lambda: lp.LayerConfig("fc", "ReLU", output=["y"]), "outputs"),
    (lambda: lp.SequentialConfig(input=[("data", [4, 6])]), "inputs"),
])
def test_a_misspelt_config_field_is_a_config_error_listing_the_valid_fields(make, field):
    with pytest.raises(lp.ConfigError, match="unknown field") as err:
        make()
    assert field in str(err.value)


def test_a_filler_named_by_its_type_as_the_api_docs_list_them_initialises_the_weight():
    # docs/api.md: `filler` picks its initialisation (constant, glorot_uniform, gaussian, he); gaussian has std 0.01
    net = _net(lp.LayerConfig("fc", lp.LinearConfig(output_size=300), params=[lp.WeightConfig(filler="gaussian")]),
               (4, 200))
    w = net.named_weights()["fc/weight"].astype(np.float64)
    assert abs(w.std() - 0.01) < 0.001 and abs(w.mean()) < 0.001
    with pytest.raises(lp.ConfigError, match="filler"):
        lp.WeightConfig(filler=3)


def test_yaml_filler_given_by_its_type_name_and_params_given_as_a_mapping():
    cfg = lp.config.layer_from_dict({"name": "fc", "type": "Linear", "output_size": 300, "params": [{"filler": "he"}]})
    w = _net(cfg, (4, 200)).named_weights()["fc/weight"].astype(np.float64)
    assert abs(w.std() - math.sqrt(2.0 / 200)) < 0.1 * math.sqrt(2.0 / 200)  # He: std sqrt(2 / fan_in)
    with pytest.raises(lp.ConfigError, match=r"params: expected a list with one entry per weight"):
        lp.config.layer_from_dict({"name": "fc", "type": "Linear", "output_size": 3, "params": {"name": "w"}})


def test_params_that_is_one_weight_config_instead_of_a_list_is_a_config_error():
    with pytest.raises(lp.ConfigError, match=r"'fc'.params: expected a list of WeightConfig"):
        lp.LayerConfig("fc", lp.LinearConfig(output_size=2), params=lp.WeightConfig(name="w"))


@pytest.mark.parametrize("inputs", [{"data": [4, 6]}, ["data"], [("data", [4, 6], 1)]])
def test_sequential_inputs_not_given_as_name_shape_pairs_are_a_config_error(inputs):
    with pytest.raises(lp.ConfigError, match=r"SequentialConfig.inputs: expected .*\(name, shape\) pair"):
        lp.SequentialConfig(inputs=inputs)


@pytest.mark.parametrize("value", ["no", None, 0])
def test_set_training_takes_a_boolean(value):
    cfg = lp.SequentialConfig(inputs=[("data", [4, 6])])
    cfg.add_layer(lp.LayerConfig("drop", lp.DropoutConfig(ratio=0.5)))
    net = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg), seed=0)
    with pytest.raises(lp.ConfigError, match="set_training expects True or False"):
        net.set_training(value)
    net.set_training(False)  # inference: Dropout passes its input through
    x = np.arange(24, dtype=np.float64).reshape(4, 6)
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), x)


def test_a_trainer_callback_that_is_not_a_callback_is_refused_before_training(tmp_path):
    run = lp.config.load("digits_mlp")
    with pytest.raises(lp.ConfigError, match="lp.Callback"):
        lp.Trainer(run, backend=lp.backend("native"), callbacks=[print])


# --- metrics and data --------------------------------------------------------------------------------------------
def test_confusion_matrix_counts_class_indices_and_refuses_values_that_are_not_indices():
    cm = lp.ConfusionMatrix(3)
    cm.add(np.array([0, 1, 2, 2, 1]), np.array([0.0, 1.0, 1.0, 2.0, 2.0]))  # float targets that are indices
    expected = np.zeros((3, 3), np.int64)
    for target, pred in [(0, 0), (1, 1), (1, 2), (2, 2), (2, 1)]:
        expected[target, pred] += 1
    np.testing.assert_array_equal(cm.matrix, expected)
    assert cm.accuracy() == pytest.approx(3 / 5)
    for preds, targets, word in [([0.6, 1.9], [0, 1], "prediction 0 is 0.6"), ([0, 1], [0, 1.5], "target 1 is 1.5"),
                                 ([0], [np.nan], "target 0 is nan"), ([0], ["a"], "targets must be class indices")]:
        with pytest.raises(lp.ShapeError, match=word):
            cm.add(np.array(preds), np.array(targets))
    np.testing.assert_array_equal(cm.matrix, expected)  # nothing counted by the refused calls


def test_batches_takes_lists_and_refuses_a_bad_batch_size_or_unequal_lengths():
    x, y = [[1.0], [2.0], [3.0]], [0, 1, 2]
    got = list(lp.data.batches(x, y, 2, seed=None))
    assert [b[0].tolist() for b in got] == [[[1.0], [2.0]], [[3.0]]] and [b[1].tolist() for b in got] == [[0, 1], [2]]
    with pytest.raises(lp.ConfigError, match="data.batch_size: expected a positive integer, got '2'"):
        list(lp.data.batches(x, y, "2"))
    with pytest.raises(lp.ConfigError, match=r"x of shape \(3, 1\) and y of shape \(2,\)"):
        list(lp.data.batches(x, y[:2], 2))


# --- the Trainer from Python -----------------------------------------------------------------------------------------
def _tiny_dataset(n_test: int = 20) -> lp.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.random((60 + n_test, 1, 8, 8)).astype(np.float32)
    y = (x.reshape(len(x), -1).mean(axis=1) > 0.5).astype(np.int64)
    return lp.data.Dataset("tiny", x[:60], y[:60], x[60:], y[60:], 10)


def test_fit_called_again_goes_on_from_the_epoch_it_reached():
    # fit(epochs=E) trains "up to epoch E": a second call continues, as one longer call would
    run = lp.config.load("digits_mlp")  # batch_size 32: 60 samples make 2 iterations an epoch
    trainer = lp.Trainer(run, backend=lp.backend("native"), dataset=_tiny_dataset(), log=lambda line: None)
    trainer.fit(epochs=1)
    history = trainer.fit(epochs=3)
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert [r["iteration"] for r in history] == [2, 4, 6] and trainer.solver.iteration == 6
    assert trainer.fit(epochs=3) == history and trainer.solver.iteration == 6  # already there: nothing to do
    for epochs in ("4", 4.5, -1):
        with pytest.raises(lp.ConfigError, match="Trainer.fit: epochs: expected a non-negative integer"):
            trainer.fit(epochs=epochs)
    assert trainer.solver.iteration == 6


def test_a_trainer_dataset_that_is_not_a_dataset_or_has_no_held_out_samples_is_refused():
    run = lp.config.load("digits_mlp")
    ds = _tiny_dataset()
    with pytest.raises(lp.ConfigError, match=r"expected an lp.data.Dataset"):
        lp.Trainer(run, backend=lp.backend("native"), dataset=(ds.x_train, ds.y_train))
    with pytest.raises(lp.ConfigError, match="held-out split of tiny is empty"):
        lp.Trainer(run, backend=lp.backend("native"), dataset=_tiny_dataset(n_test=0))


def test_a_trainer_dataset_whose_samples_and_targets_differ_in_number_is_refused_naming_both():
    """One target too many trained on pairs shifted by one, too few failed with a raw IndexError mid-epoch, a
    y_test of another length only at the first evaluation, an x_train list with a raw TypeError: a Dataset
    refuses the first three when it is made, and the Trainer a dataset changed since; lists become arrays, and
    train as the arrays do."""
    run = lp.config.load("digits_mlp", ["train.epochs=1", "solver.seed=0"])
    x, y = _tiny_dataset().x_train, _tiny_dataset().y_train
    for given, says in (((x, np.append(y, 0), x, y), "x_train holds 60 samples and y_train 61 targets"),
                        ((x, y[:59], x, y), "x_train holds 60 samples and y_train 59 targets"),
                        ((x, y, x[:20], y[:19]), "x_test holds 20 samples and y_test 19 targets")):
        with pytest.raises(lp.ShapeError, match=f"Dataset 'tiny': {says}; give one target per sample"):
            lp.data.Dataset("tiny", *given, 10)
    with pytest.raises(lp.ShapeError, match="Dataset 'tiny': x_test: expected an array of numbers .* got str"):
        lp.data.Dataset("tiny", x, y, "x", y, 10)
    changed = _tiny_dataset()
    changed.y_train = np.append(changed.y_train, 0)
    with pytest.raises(lp.ShapeError, match="x_train holds 60 samples and y_train 61 targets"):
        lp.Trainer(run, backend=lp.backend("native"), dataset=changed)
    ds = _tiny_dataset()
    listed = lp.data.Dataset("tiny", ds.x_train.tolist(), ds.y_train.tolist(), ds.x_test, ds.y_test, 10)
    histories = [lp.Trainer(run, backend=lp.backend("native"), dataset=d, log=lambda m: None).fit()
                 for d in (ds, listed)]
    assert [h["test_loss"] for h in histories[0]] == pytest.approx([h["test_loss"] for h in histories[1]])


# --- documentation -----------------------------------------------------------------------------------------------
def _public_members():
    import inspect

    for name in lp.__all__:
        obj = getattr(lp, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            yield name, obj
        if inspect.isclass(obj) and obj.__module__.startswith("leafpy"):
            for member, value in vars(obj).items():
                if not member.startswith("_") and (inspect.isfunction(value) or isinstance(
                        value, (property, classmethod, staticmethod))):
                    yield f"{name}.{member}", getattr(obj, member) if not isinstance(value, property) else value


def test_every_public_name_and_method_has_a_docstring():
    import inspect

    missing = [name for name, obj in _public_members() if not inspect.getdoc(obj)]
    assert not missing, missing


# --- networks from Python ------------------------------------------------------------------------------------------
def test_from_config_and_load_name_a_seed_or_backend_of_the_wrong_kind(tmp_path):
    cfg = lp.LayerConfig("net", lp.SequentialConfig(inputs=[("data", [2, 4])],
                                                    layers=[lp.LayerConfig("fc", lp.LinearConfig(output_size=3))]))
    with pytest.raises(lp.ConfigError, match="Layer.from_config: seed: expected a non-negative integer"):
        lp.Layer.from_config(lp.backend("native"), cfg, seed="a")
    lp.Layer.from_config(lp.backend("native"), cfg, seed=0).save(str(tmp_path / "m.leaf"))
    with pytest.raises(lp.ConfigError, match=r"Layer.load: expected a backend \(leafpy.backend\(name\)\), got 'nat"):
        lp.Layer.load("native", str(tmp_path / "m.leaf"))
