"""The wiring and gradient-memory plan as functions of configs, and Network: feeding a model and its objective.

The plans are computed from configs written by hand (no backend, no tensors) and compared with the blob names, in-
place decisions and storage counts derived by hand from Sequential's rules; the Network's gradients are compared
with a float64 NumPy formula.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import yaml
from conftest import child_env

import leafpy as lp
from leafpy.layers import plan_gradients, wire
from leafpy.layers.container.wiring import config_traits


def _seq(inputs, layers):
    return lp.SequentialConfig(inputs=inputs, layers=[lp.config.layer_from_dict(d) for d in layers])


def test_a_chain_is_wired_from_its_config_alone():
    cfg = _seq([("data", [4, 1, 6, 6])], [
        {"name": "conv", "type": "Convolution", "num_output": 2, "filter_shape": [3], "stride": [1], "padding": [1]},
        {"name": "relu", "type": "ReLU"},
        {"name": "pool", "type": "Pooling", "mode": "max", "filter_shape": [2], "stride": [2], "padding": [0]},
        {"name": "flat", "type": "Flatten"},
        {"name": "fc", "type": "Linear", "output_size": 3},
        {"name": "sig", "type": "Sigmoid"},
        {"name": "tanh", "type": "TanH"},
    ])
    w = wire(cfg)
    got = [(s.inputs, s.outputs, s.in_place) for s in w.steps]
    assert got == [
        (["data"], ["SEQUENTIAL_0"], False),
        (["SEQUENTIAL_0"], ["SEQUENTIAL_1"], True),      # ReLU over the convolution's output
        (["SEQUENTIAL_1"], ["SEQUENTIAL_2"], False),
        (["SEQUENTIAL_2"], ["SEQUENTIAL_3"], True),      # Flatten: a view of the pooled output
        (["SEQUENTIAL_3"], ["SEQUENTIAL_4"], False),
        (["SEQUENTIAL_4"], ["SEQUENTIAL_5"], True),      # Sigmoid over the Linear's output
        (["SEQUENTIAL_5"], ["SEQUENTIAL_OUTPUT_6"], False),  # TanH may not overwrite what Sigmoid's backward reads
    ]
    assert w.producer["data"] == -1 and w.consumers["SEQUENTIAL_4"] == [5]
    # gradients: conv+relu, pool+flat, fc+sig are groups; tanh's output gradient comes from outside; the blob
    # between sig and tanh is written by tanh; lifetimes alternate, so two storages serve the whole chain
    traits = [config_traits(lc) for lc in cfg.layers]
    takes = [[i > 0] for i in range(len(cfg.layers))]  # the data input takes no gradient
    slots = plan_gradients(w, traits, takes)
    roots = sorted(sorted(g.root for g in slot) for slot in slots)
    assert roots == [[0, 4], [2]]  # fc+sig's gradient is consumed before conv+relu's is written
    members = {g.root: g.members for slot in slots for g in slot}
    assert members[0] == [0, 1] and members[2] == [2, 3] and members[4] == [4, 5]


def test_a_residual_block_is_wired_by_name_and_its_shared_blob_keeps_its_own_gradient():
    cfg = _seq([("data", [2, 3])], [
        {"name": "fc1", "type": "Linear", "output_size": 3, "outputs": ["a"]},
        {"name": "relu1", "type": "ReLU", "inputs": ["a"], "outputs": ["a"]},   # Caffe's in-place request
        {"name": "fc2", "type": "Linear", "output_size": 3, "inputs": ["a"], "outputs": ["b"]},
        {"name": "add", "type": "Eltwise", "operation": "sum", "inputs": ["a", "b"], "outputs": ["s"]},
        {"name": "fc3", "type": "Linear", "output_size": 2, "inputs": ["s"]},
    ])
    w = wire(cfg)
    assert [s.inputs for s in w.steps] == [["data"], ["a"], ["a@relu1"], ["a@relu1", "b"], ["s"]]
    assert [s.outputs for s in w.steps] == [["a"], ["a@relu1"], ["b"], ["s"], ["SEQUENTIAL_OUTPUT_4"]]
    assert [s.in_place for s in w.steps] == [False, True, False, False, False]
    assert w.consumers["a@relu1"] == [2, 3]
    traits = [config_traits(lc) for lc in cfg.layers]
    takes = [[False], [True], [True], [True, True], [True]]
    slots = plan_gradients(w, traits, takes)
    planned = {g.root for slot in slots for g in slot}
    # fc1+relu1's gradient is the sum of fc2's and add's: it keeps its own; fc2 -> add, add -> fc3 share storages
    assert 0 not in planned and planned == {2, 3}
    assert len(slots) == 2  # add's output gradient is read while fc2's is written: they cannot share


def test_wiring_errors_name_the_layer_without_building_anything():
    cfg = _seq([("data", [2, 3])], [{"name": "fc", "type": "Linear", "output_size": 2, "inputs": ["nope"]}])
    with pytest.raises(lp.ConfigError, match=r"layer 'fc' \(Linear\): input blob 'nope' does not exist"):
        wire(cfg)


def test_a_second_writer_of_a_name_taken_over_in_place_is_refused():
    """An in-place request (b: h -> h) takes the name over; a later layer that writes 'h' without reading it is a
    second writer, refused as it is without the in-place request (and not wired as b's successor)."""
    layers = [{"name": "a", "type": "ReLU", "inputs": ["data"], "outputs": ["h"]},
              {"name": "b", "type": "TanH", "inputs": ["h"], "outputs": ["h"]},
              {"name": "c", "type": "Sigmoid", "inputs": ["data"], "outputs": ["h"]},
              {"name": "d", "type": "Concat", "axis": 1, "inputs": ["h", "data"]}]
    with pytest.raises(lp.ConfigError, match=r"layer 'c' \(Sigmoid\): output blob 'h' is already written by 'b'; "
                                             r"blob names must be unique"):
        wire(_seq([("data", [2, 3])], layers))
    with pytest.raises(lp.ConfigError, match=r"layer 'c' \(Sigmoid\): output blob 'h' is already written by 'a'"):
        wire(_seq([("data", [2, 3])], layers[:1] + layers[2:]))
    # a chain of in-place requests on one name stays allowed
    chain = [layers[0], layers[1], {"name": "e", "type": "ReLU", "inputs": ["h"], "outputs": ["h"]}]
    w = wire(_seq([("data", [2, 3])], chain))
    assert [s.outputs for s in w.steps] == [["h"], ["h@b"], ["h@e"]]


def test_leafpy_summary_refuses_a_run_file_with_a_second_writer(tmp_path):
    """The same through a run file, as a person writes one (`leafpy summary` reads it without training)."""
    (tmp_path / "run.yaml").write_text("""name: w
data: {dataset: digits}
network:
  type: Sequential
  inputs: [{name: data, shape: [null, 64]}]
  layers:
    - {name: a, type: Linear, output_size: 10, inputs: [data], outputs: [h]}
    - {name: b, type: TanH, inputs: [h], outputs: [h]}
    - {name: c, type: Linear, output_size: 10, inputs: [data], outputs: [h]}
    - {name: d, type: LogSoftmax, inputs: [h]}
objective: nll
solver: {solver: momentum, base_lr: 0.1}
""")
    p = subprocess.run([sys.executable, "-m", "leafpy.cli", "summary", "run.yaml"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=child_env())
    assert p.returncode == 1
    assert p.stderr.strip() == ("leafpy: error: run.yaml: layer 'c' (Linear): output blob 'h' is already written by "
                                "'b'; blob names must be unique")


def test_an_error_inside_a_nested_block_says_which_block(tmp_path):
    """Layer names are unique within a container only: the outer network has an 'add' of its own, so an error in
    the block's 'add' says it is inside 'block', from the configs (`leafpy summary`) and when built."""
    inner = lp.SequentialConfig(inputs=[("h", [4, 8])], layers=[
        lp.LayerConfig("fc", lp.LinearConfig(output_size=5), outputs=["a"]),
        lp.LayerConfig("add", lp.EltwiseConfig(operation="sum"), inputs=["a", "h"])])
    cfg = lp.SequentialConfig(inputs=[("data", [4, 8])], layers=[
        lp.LayerConfig("block", inner), lp.LayerConfig("add", lp.EltwiseConfig(operation="sum"),
                                                       inputs=["data", "data"])])
    from leafpy.layers.container.wiring import output_shapes
    where = r"in layer 'block' \(Sequential\): layer 'add' \(Eltwise\): shapes \(4, 5\), \(4, 8\) do not broadcast"
    with pytest.raises(lp.ShapeError, match=where):
        output_shapes(cfg)
    with pytest.raises(lp.ShapeError, match=where + r".*its input 'data' comes from input of 'net'"):
        lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg))
    run = lp.config.layer_to_dict(lp.LayerConfig("net", cfg))
    (tmp_path / "net.yaml").write_text(yaml.safe_dump({"name": "net", "network": run, "objective": "mse"}))
    p = subprocess.run([sys.executable, "-m", "leafpy.cli", "summary", "net.yaml"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=child_env())
    assert p.returncode == 1 and "in layer 'block' (Sequential): layer 'add' (Eltwise): shapes" in p.stderr, p.stderr


def test_a_blob_read_before_the_layer_that_writes_it_names_that_layer():
    cfg = _seq([("data", [2, 3])], [{"name": "fc", "type": "Linear", "output_size": 3, "inputs": ["h"]},
                                    {"name": "act", "type": "ReLU", "inputs": ["data"], "outputs": ["h"]}])
    with pytest.raises(lp.ConfigError, match=r"layer 'fc' \(Linear\): input blob 'h' is written by layer 'act', "
                                             r"which comes later: .*move 'fc' after"):
        wire(cfg)
    own = _seq([("data", [2, 3])], [{"name": "fc", "type": "Linear", "output_size": 3, "inputs": ["h"],
                                     "outputs": ["h"]}])
    with pytest.raises(lp.ConfigError, match=r"input blob 'h' is written by layer 'fc', which is this layer"):
        wire(own)


def _model_and_objective(be, n_in=4, classes=3):
    net_cfg = lp.SequentialConfig(inputs=[("data", [5, n_in])])
    net_cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=classes)))
    net_cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    obj_cfg = lp.SequentialConfig(inputs=[("out", [5, classes]), ("label", [5, 1])])
    obj_cfg.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=classes)))
    return (lp.Layer.from_config(be, lp.LayerConfig("m", net_cfg), seed=3),
            lp.Layer.from_config(be, lp.LayerConfig("loss", obj_cfg)))


@pytest.mark.parametrize("batch_sizes", [(5,), (5, 3, 7)])
def test_a_network_feeds_a_model_and_its_objective_by_hand(batch_sizes):
    be = lp.backend("native")
    model, objective = _model_and_objective(be)
    net, obj = model.network, objective.network
    assert isinstance(net, lp.Network) and net is model.network
    obj.require_input_gradients([True, False])
    rng = np.random.default_rng(0)
    generations = []
    for n in batch_sizes:
        x = rng.normal(size=(n, 4)).astype(np.float32)
        y = rng.integers(0, 3, size=n)
        net.feed([x])
        obj.connect(0, net.outputs[0], net.output_grads[0])
        obj.feed([None, y])  # labels [N] for the declared [N, 1]
        assert obj.inputs[0] is net.outputs[0]  # read with no copy
        net.run_forward()
        obj.run_forward()
        obj.backward([np.ones(1)])
        net.run_backward()
        generations.append(net.generation)
        w, b = (t.to_numpy().astype(np.float64) for t in net.parameters().data)
        dw, db = (t.to_numpy() for t in net.parameters().gradients)
        z = x.astype(np.float64) @ w.T + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        loss = -np.mean(np.log(p[np.arange(n), y]))
        dz = (p - np.eye(3)[y]) / n
        np.testing.assert_allclose(float(obj.outputs[0].to_numpy().reshape(-1)[0]), loss, rtol=1e-5)
        np.testing.assert_allclose(dw, dz.T @ x, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(db, dz.sum(0), rtol=1e-4, atol=1e-6)
    # a new batch size rebinds (a new generation); the declared size was bound when the model was built
    assert generations == sorted(set(generations)) and len(generations) == len(batch_sizes)
    assert [t.shape for t in net.parameters().data] == [(3, 4), (3,)]
    assert net.parameters().names == ["fc/weight", "fc/bias"]


def test_connect_names_a_missing_input():
    model, objective = _model_and_objective(lp.backend("native"))
    with pytest.raises(lp.ShapeError, match=r"layer 'loss': connect: input 2 does not exist .*2 inputs"):
        objective.network.connect(2, model.outputs[0])


def test_the_parameter_set_is_gathered_once_per_binding(monkeypatch):
    be = lp.backend("native")
    model, objective = _model_and_objective(be)
    solver = lp.Solver(model, objective, lp.SolverConfig(solver="momentum", base_lr=0.1, momentum=0.9))
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(5, 4)).astype(np.float32), rng.integers(0, 3, size=5)
    solver.train_minibatch(x, y)
    walks = []
    original = lp.Sequential._weight_entries
    monkeypatch.setattr(lp.Sequential, "_weight_entries", lambda self: walks.append(self.name) or original(self))
    for _ in range(4):
        solver.train_minibatch(x, y)
    assert walks == []
    solver.train_minibatch(x[:2], y[:2])  # another batch size: bound anew, gathered once
    assert walks == ["m"]
