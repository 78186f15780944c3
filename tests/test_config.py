"""YAML run files: round trips, the shipped configs, and every error path naming its place."""

from __future__ import annotations

import os

import pytest

import leafpy as lp
from leafpy import serialization

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")
SHIPPED = ["digits_lenet.yaml", "digits_mlp.yaml", "digits_bn.yaml", "mnist_lenet.yaml", "alexnet.yaml"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_round_trip(name, tmp_path):
    run = lp.config.load(os.path.join(CONFIGS, name))
    again = lp.config.loads(lp.config.dumps(run))
    assert again == run
    lp.config.save(run, tmp_path / name)
    assert lp.config.load(tmp_path / name) == run
    assert lp.config.dumps(lp.config.load(tmp_path / name)) == lp.config.dumps(run)


@pytest.mark.parametrize("name", SHIPPED)
def test_config_to_capnp_to_config(name):
    run = lp.config.load(os.path.join(CONFIGS, name))
    for cfg in (run.network, run.objective):
        msg = serialization.schema().LayerConfig.new_message()
        serialization.write_layer_config(msg, cfg)
        back = serialization.read_layer_config(serialization.schema().LayerConfig.from_bytes_packed(
            msg.to_bytes_packed()))
        assert back == cfg


def test_every_layer_type_and_option_in_yaml():
    text = """
name: all
network:
  type: Sequential
  inputs: [{name: data, shape: [4, 1, 6, 6]}]
  force_backward: true
  layers:
    - {name: conv, type: Convolution, num_output: 2, filter_shape: [3, 2], stride: [1, 2], padding: [1, 0],
       params: [{lr_mult: 2, decay_mult: 0, filler: {type: gaussian, std: 0.1}}, {name: tied}]}
    - {name: pool, type: Pooling, mode: average, filter_shape: [2], stride: [1]}
    - {name: bn, type: BatchNorm, eps: 0.001, momentum: 0.2, affine: false}
    - {name: tanh, type: TanH}
    - {name: sig, type: Sigmoid}
    - {name: reshape, type: Reshape, shape: [4, -1]}
    - {name: drop, type: Dropout, ratio: 0.1}
    - {name: fc, type: Linear, output_size: 3, bias: false, propagate_down: [true]}
    - name: block
      type: Sequential
      inputs: [{name: h, shape: [4, 3]}]
      layers: [{name: relu, type: ReLU}, {name: flat, type: Flatten}]
    - {name: soft, type: Softmax}
objective:
  type: Sequential
  inputs: [{name: out, shape: [4, 3]}, {name: target, shape: [4, 3]}]
  layers: [{name: mse, type: MeanSquaredError}]
solver: {solver: adam, base_lr: 0.001, lr_policy: multistep, stepvalues: [10, 20], clip_gradients: 1.0}
"""
    run = lp.config.loads(text)
    assert lp.config.loads(lp.config.dumps(run)) == run
    conv = run.network.config.layers[0]
    assert conv.params[0].filler.type == "gaussian" and conv.params[1].name == "tied"
    assert run.solver.stepvalues == (10, 20)
    assert run.network.config.layers[2].config == lp.BatchNormConfig(eps=0.001, momentum=0.2, affine=False)
    net = lp.Layer.from_config(lp.backend("native"), run.network)
    assert net.forward([__import__("numpy").zeros((4, 1, 6, 6))])[0].shape == (4, 3)


BASE = """
network:
  type: Sequential
  inputs: [{name: data, shape: [2, 4]}]
  layers:
    - {name: fc1, type: Linear, output_size: 3}
    - {name: relu, type: ReLU}
    - {name: fc2, type: Linear, output_size: 2}
objective:
  type: Sequential
  inputs: [{name: out, shape: [2, 2]}, {name: label, shape: [2, 1]}]
  layers: [{name: nll, type: NegativeLogLikelihood, num_classes: 2}]
"""


@pytest.mark.parametrize("old,new,message", [
    ("output_size: 2}", "output_size: -4}", r"network\.layers\[2\]\.output_size: expected a positive integer, got -4"),
    ("type: ReLU", "type: Relu", r"network\.layers\[1\]\.type: unknown layer type 'Relu'; known types: .*ReLU"),
    ("{name: relu, type: ReLU}", "{name: relu, type: ReLU, ratio: 3}",
     r"network\.layers\[1\]: unknown key 'ratio' for a ReLU layer; valid keys: name, type"),
    ("output_size: 3}", "output_sise: 3}", r"network\.layers\[0\]: unknown key 'output_sise'.*output_size"),
    ("{name: fc1, type: Linear, output_size: 3}", "{type: Linear, output_size: 3}",
     r"network\.layers\[0\]: missing 'name'"),
    ("num_classes: 2", "num_classes: zero", r"objective\.layers\[0\]\.num_classes"),
    ("shape: [2, 4]", "shape: [2, x]", r"network\.inputs\['data'\]\.shape\[1\]: expected a positive integer, got 'x'"),
    ("layers:\n    - {name: fc1", "layer:\n    - {name: fc1", r"network: unknown key 'layer' for a Sequential"),
])
def test_errors_name_the_path(old, new, message):
    assert old in BASE
    with pytest.raises(lp.ConfigError, match=message):
        lp.config.loads(BASE.replace(old, new, 1))


@pytest.mark.parametrize("extra,message", [
    ("solver: {momentum: 1.5}", r"solver\.momentum: expected a number in \[0, 1\)"),
    ("solver: {lr_policy: linear}", r"solver\.lr_policy: expected one of 'fixed'"),
    ("solver: {learning_rate: 0.1}", r"solver: unknown key 'learning_rate'.*base_lr"),
    ("data: {dataset: cifar}", r"data\.dataset: expected one of 'digits', 'mnist', 'fashion_mnist', 'npz'"),
    ("data: {batch_size: -1}", r"data\.batch_size"),
    ("data: {test_fraction: 1.5}", r"data\.test_fraction: expected a number in \(0, 1\)"),
    ("data: {test_fraction: half}", r"data\.test_fraction: expected a number, got 'half'"),
    ("data: {seed: -1}", r"data\.seed: expected a non-negative integer"),
    ("data: {dataset: npz, path: [a.npz]}", r"data\.path: expected a file or directory path"),
    ("data: {dataset: npz, num_classes: 0}", r"data\.num_classes: expected a positive integer"),
    ("train: {epochs: 0}", r"train\.epochs"),
    ("trian: {epochs: 2}", r"unknown key 'trian'.*train"),
])
def test_run_file_section_errors(extra, message):
    with pytest.raises(lp.ConfigError, match=message):
        lp.config.loads(BASE + extra)


def test_exponent_numbers_without_a_dot_are_numbers():
    # YAML 1.1 (PyYAML's default) reads 5e-4 as a string; run files read it as YAML 1.2 does
    run = lp.config.loads(BASE + "solver: {solver: adam, base_lr: 1e-3, weight_decay: 5E-4, epsilon: 1e-8, "
                                 "clip_gradients: +2e1, momentum: .5e0}\n")
    s = run.solver
    assert (s.base_lr, s.weight_decay, s.epsilon, s.clip_gradients, s.momentum) == (1e-3, 5e-4, 1e-8, 20.0, 0.5)
    assert lp.config.loads(lp.config.dumps(run)) == run
    run = lp.config.loads(BASE.replace("name: fc1", "name: 1e5x") + "name: 2e3e\n")  # not numbers: still text
    assert run.name == "2e3e" and run.network.config.layers[0].name == "1e5x"
    with pytest.raises(lp.ConfigError, match=r"solver\.base_lr: expected a number, got '1e'"):
        lp.config.loads(BASE + "solver: {base_lr: 1e}\n")


def test_a_key_given_twice_is_refused(tmp_path):
    # PyYAML keeps the last of two equal keys silently; a run file names the line of both
    p = tmp_path / "twice.yaml"
    p.write_text(BASE + "solver:\n  base_lr: 0.1\n  momentum: 0.9\n  base_lr: 0.01\n")
    with pytest.raises(lp.ConfigError, match=r"twice\.yaml: line 16: key 'base_lr' is given twice \(first at line 14"):
        lp.config.load(p)
    with pytest.raises(lp.ConfigError, match=r"line 6: key 'output_size' is given twice \(first at line 6\)"):
        lp.config.loads(BASE.replace("output_size: 3}", "output_size: 3, output_size: 4}"))
    # a merge key's values may be overridden, as YAML allows
    run = lp.config.loads(BASE + "solver: {<<: {solver: adam, base_lr: 0.5}, base_lr: 0.25}\n")
    assert (run.solver.solver, run.solver.base_lr) == ("adam", 0.25)


def test_overrides_change_one_value_each():
    run = lp.config.loads(BASE, overrides=["solver.base_lr=1e-3", "solver.solver=adagrad", "data.batch_size=2",
                                           "network.layers.fc1.output_size=7", "network.layers.2.bias=false",
                                           "objective.layers.nll.num_classes=2", "train={epochs: 3}"])
    assert (run.solver.base_lr, run.solver.solver, run.batch_size, run.epochs) == (1e-3, "adagrad", 2, 3)
    layers = run.network.config.layers
    assert layers[0].config.output_size == 7 and layers[2].config.bias is False
    plain = lp.config.loads(BASE)
    assert plain.network.config.layers[0].config.output_size == 3  # each load reads the text afresh
    for item, message in [
        ("solver.base_lr", r"expected KEY=VALUE"),
        ("network.layers.fc9.output_size=2", r"network\.layers\.fc9: no entry named 'fc9' \(entries: fc1, relu, fc2\)"),
        ("network.layers.7.output_size=2", r"network\.layers\.7: the list has 3 entries"),
        ("network.type.x=1", r"network\.type is 'Sequential', not a section to set 'x' in"),
        ("solver.base_lr=[", r"the value is not valid YAML"),
        ("solver.base_lr=-1", r"solver\.base_lr: expected a number in \[0, inf\)"),  # then checked as in a file
        ("solver.learning_rate=1", r"solver: unknown key 'learning_rate'"),
    ]:
        with pytest.raises(lp.ConfigError, match=message):
            lp.config.loads(BASE, overrides=[item])


def test_counts_written_as_whole_floats_are_those_integers_everywhere():
    """YAML's 2.0 for a count: taken as 2 in the train, data and solver sections alike (it was refused in some and
    taken in others); 2.5 and -1.0 are refused naming the key."""
    run = lp.config.loads(BASE, overrides=["train={epochs: 3.0}", "data.batch_size=2.0", "solver.warmup_iter=4.0",
                                           "solver.stepsize=5.0"])
    assert (run.epochs, run.batch_size, run.solver.warmup_iter, run.solver.stepsize) == (3, 2, 4, 5)
    assert type(run.epochs) is int and type(run.batch_size) is int and type(run.solver.warmup_iter) is int
    for item, key in (("train={epochs: 2.5}", "train.epochs"), ("data.batch_size=-1.0", "data.batch_size"),
                      ("solver.warmup_iter=0.5", "solver.warmup_iter")):
        with pytest.raises(lp.ConfigError, match=rf"{key}: expected a (positive|non-negative) integer"):
            lp.config.loads(BASE, overrides=[item])


def test_unsafe_yaml_is_refused(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(lp.ConfigError, match="not valid YAML"):
        lp.config.load(p)
    with pytest.raises(lp.LeafpyError, match="cannot read"):
        lp.config.load(tmp_path / "nope.yaml")
    p.write_text("- just\n- a list\n")
    with pytest.raises(lp.ConfigError, match="expected a mapping"):
        lp.config.load(p)


# --- run files without repetition: a null batch, the objective derived from the network ---------------------------
EXPLICIT = os.path.join(os.path.dirname(__file__), "data", "explicit_configs")


@pytest.mark.parametrize("name", lp.config.shipped())
def test_each_shipped_run_file_means_what_its_explicit_form_meant(name):
    """The shipped run files say the batch once and the objective by name: each loads to the same run as the
    explicit file it replaced (batch in every declared shape, the objective's Sequential and num_classes written
    out), and the run.yaml written from it is that explicit form."""
    short = lp.config.load(name)
    explicit = lp.config.load(os.path.join(EXPLICIT, f"{name}.yaml"))
    assert short == explicit
    written = lp.config.dumps(short)
    assert lp.config.loads(written) == explicit
    assert "null" not in written and "objective: nll" not in written and "num_classes" in written


MLP = """
name: mlp
data: {dataset: digits, batch_size: 16}
network:
  type: Sequential
  inputs: [{name: data, shape: [NETWORK_BATCH, 1, 8, 8]}]
  layers:
    - {name: flat, type: Flatten}
    - {name: fc, type: Linear, output_size: 10}
    - {name: logsm, type: LogSoftmax}
objective: OBJECTIVE
solver: {base_lr: 0.1}
"""
MLP_OBJECTIVE = """
  type: Sequential
  inputs: [{name: network_out, shape: [16, 10]}, {name: label, shape: [16, 1]}]
  layers:
    - {name: nll, type: NegativeLogLikelihood, num_classes: 10}"""


def _mlp(objective: str, batch: str = "null") -> str:
    return MLP.replace("NETWORK_BATCH", batch).replace("OBJECTIVE", objective)


@pytest.mark.parametrize("objective", ["nll", "NLL", "NegativeLogLikelihood", "{type: NegativeLogLikelihood}",
                                       "{name: nll, type: NegativeLogLikelihood, num_classes: 10}",
                                       MLP_OBJECTIVE.replace("[16, 10]", "[null, 10]").replace("[16, 1]", "[null, 1]")])
def test_a_short_objective_and_a_null_batch_mean_the_explicit_run(objective):
    explicit = lp.config.loads(_mlp(MLP_OBJECTIVE, "16"))
    run = lp.config.loads(_mlp(objective))
    assert run == explicit
    assert run.network.config.inputs[0][1] == (16, 1, 8, 8) and run.batch_size == 16
    assert lp.config.loads(lp.config.dumps(run)) == explicit


def test_a_null_batch_follows_the_batch_size_set_on_the_command_line_and_is_one_without_any():
    run = lp.config.loads(_mlp("nll"), overrides=["data.batch_size=64"])
    assert run.network.config.inputs[0][1] == (64, 1, 8, 8) and run.batch_size == 64
    assert [s for _, s in run.objective.config.inputs] == [(64, 10), (64, 1)]
    alone = lp.config.loads(_mlp("nll").replace("data: {dataset: digits, batch_size: 16}", ""))
    assert alone.network.config.inputs[0][1] == (1, 1, 8, 8) and alone.batch_size == 1
    assert lp.SequentialConfig(inputs=[("data", [None, 4])]).inputs == [("data", (1, 4))]


def test_mse_takes_a_target_of_the_network_output_shape():
    text = _mlp("mse").replace("    - {name: logsm, type: LogSoftmax}\n", "")
    explicit = _mlp("""
  type: Sequential
  inputs: [{name: network_out, shape: [16, 10]}, {name: target, shape: [16, 10]}]
  layers: [{name: mse, type: MeanSquaredError}]""", "16").replace("    - {name: logsm, type: LogSoftmax}\n", "")
    assert lp.config.loads(text) == lp.config.loads(explicit)
    assert lp.config.loads(text.replace("objective: mse", "objective: {type: MeanSquaredError}")) == \
        lp.config.loads(explicit)


@pytest.mark.parametrize("objective, message", [
    ("cross_entropy", "unknown objective 'cross_entropy'; short names: nll (NegativeLogLikelihood), mse"),
    ("{type: ReLU}", "objective.type: expected Sequential, or a loss layer alone: NegativeLogLikelihood, "
                     "MeanSquaredError, SoftmaxCrossEntropy; got 'ReLU'"),
    ("{type: NegativeLogLikelihood, num_classes: 7}", "objective.num_classes: 7, but the network's output has 10"),
])
def test_a_short_objective_that_cannot_be_expanded_is_refused_with_the_valid_choices(objective, message):
    with pytest.raises(lp.ConfigError) as e:
        lp.config.loads(_mlp(objective))
    assert message in str(e.value)


def test_nll_on_an_output_that_is_not_classes_is_a_config_error_naming_the_shape():
    text = _mlp("nll").replace("    - {name: flat, type: Flatten}\n    - {name: fc, type: Linear, output_size: 10}\n"
                               "    - {name: logsm, type: LogSoftmax}\n",
                               "    - {name: conv, type: Convolution, num_output: 4, filter_shape: [3]}\n")
    with pytest.raises(lp.ConfigError, match=r"log-probabilities of shape \[N, classes\], but the network's output "
                                             r"has shape \[16, 4, 6, 6\]"):
        lp.config.loads(text)
    broken = _mlp("nll").replace("output_size: 10}", "output_size: 10, axis: 3}")
    with pytest.raises(lp.ConfigError, match="network: layer 'fc'"):
        lp.config.loads(broken)


def _table_configs():
    from test_gradients import CASES

    for type_name, cases in sorted(CASES.items()):
        for i, (config, _) in enumerate(cases):
            yield pytest.param(config, id=f"{type_name}-{i}")


@pytest.mark.parametrize("config", list(_table_configs()))
def test_every_table_config_round_trips_through_yaml_and_capnp(config):
    """Each layer setting of the gradient table (group, dilation, pad_end, ceil_mode, ...) survives YAML -> config
    -> YAML and config -> capnp -> config."""
    lc = lp.LayerConfig("l", config)
    d = lp.config.layer_to_dict(lc)
    assert lp.config.layer_from_dict(d) == lc
    msg = serialization.schema().LayerConfig.new_message()
    serialization.write_layer_config(msg, lc)
    back = serialization.read_layer_config(serialization.schema().LayerConfig.from_bytes_packed(
        msg.to_bytes_packed()))
    assert back == lc


def test_a_file_from_before_the_new_settings_reads_them_as_their_defaults():
    """A convolution and a pooling layer written without the fields group, dilation, pad_end, ceil_mode,
    count_include_pad and global_pooling (as Leaf 0.2.1 and older leafpy wrote them) read back meaning what they
    meant: one group, no dilation, symmetric padding, floor sizes, padding counted."""
    schema = serialization.schema()
    msg = schema.LayerConfig.new_message()
    msg.name = "conv"
    conv = msg.layerType.init("convolution")
    conv.numOutput, conv.filterShape, conv.stride, conv.padding = 4, [3, 3], [1, 1], [1, 1]
    cfg = serialization.read_layer_config(schema.LayerConfig.from_bytes_packed(msg.to_bytes_packed())).config
    assert (cfg.group, cfg.dilation, cfg.pad_end) == (1, (1, 1), None)
    msg = schema.LayerConfig.new_message()
    msg.name = "pool"
    pool = msg.layerType.init("pooling")
    pool.mode, pool.filterShape, pool.stride, pool.padding = "average", [3, 3], [2, 2], [1, 1]
    cfg = serialization.read_layer_config(schema.LayerConfig.from_bytes_packed(msg.to_bytes_packed())).config
    assert (cfg.ceil_mode, cfg.count_include_pad, cfg.global_pooling, cfg.pad_end) == (False, True, False, None)


@pytest.mark.parametrize("make,match", [
    (lambda: lp.ConvolutionConfig(num_output=5, filter_shape=[3], group=2),
     r"group: num_output \(5\) must be a multiple"),
    (lambda: lp.ConvolutionConfig(num_output=4, filter_shape=[3], group=0), "ConvolutionConfig.group"),
    (lambda: lp.ConvolutionConfig(num_output=4, filter_shape=[3], dilation=[0]), r"ConvolutionConfig.dilation\[0\]"),
    (lambda: lp.ConvolutionConfig(num_output=4, filter_shape=[3], pad_end=[1, 2, 3]), "ConvolutionConfig.pad_end"),
    (lambda: lp.PoolingConfig(filter_shape=[2], pad_end=[2]), r"PoolingConfig.pad_end\[0\]: padding must be smaller"),
    (lambda: lp.PoolingConfig(ceil_mode="yes"), "PoolingConfig.ceil_mode: expected true or false"),
    (lambda: lp.PoolingConfig(count_include_pad=1), "PoolingConfig.count_include_pad: expected true or false"),
])
def test_bad_window_settings_are_config_errors_naming_the_field(make, match):
    with pytest.raises(lp.ConfigError, match=match):
        make()


def test_channels_that_do_not_split_into_the_groups_are_a_shape_error():
    cfg = lp.SequentialConfig(inputs=[("data", [2, 3, 5, 5])])
    cfg.add_layer(lp.LayerConfig("conv", lp.ConvolutionConfig(num_output=4, filter_shape=[3], group=2)))
    with pytest.raises(lp.ShapeError, match=r"layer 'conv'.*3 channels do not split into group 2"):
        lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg))
