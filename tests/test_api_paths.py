"""The Python API as a user writing a script or a notebook meets it: configs built by hand (README's and DESIGN's
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
])
def test_a_misspelt_config_field_is_a_config_error_listing_the_valid_fields(make, field):
    with pytest.raises(lp.ConfigError, match="unknown field") as err:
        make()
    assert field in str(err.value)


def test_a_filler_named_by_its_type_as_the_readme_lists_them_initialises_the_weight():
    # README: `filler` picks its initialisation (constant, glorot_uniform, gaussian, he); gaussian has std 0.01
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
