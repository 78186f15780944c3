"""Random networks over every layer type (tests/random_nets.py): what the generator reaches, and each network's
gradients on native float64 against central differences (the wiring in combination: branches, in-place runs after
every kind of layer, nested containers, shared weights, ids and labels). The same networks run on the device
backends against native in test_backends.py. ``-m random_corpus`` runs many more seeds."""

from __future__ import annotations

from collections import Counter

import ml_dtypes
import numpy as np
import pytest
import random_nets
import yaml
from conftest import webgpu_offering
from gradcheck import check_layer_gradients
from test_backends import check_random_network_matches_native, close, device_or_layout  # noqa: F401 (a fixture)

import leafpy as lp

CORPUS_SEEDS = range(1000, 1400)
"""A longer corpus, run with ``-m random_corpus``."""
FEATURES = {"residual", "eltwise-sum", "eltwise-prod", "eltwise-max", "concat", "slice", "slice-unread",
            "slice-concat-auto", "skip", "nested", "nested-two-inputs", "nested-deeper", "shared", "shared-nested",
            "named-in-place", "ids-fan-out", "pruned", "conv-2d-settings", "pool-padded", "reshape",
            "conv-dilated", "conv-pad-end", "conv-grouped", "conv-depthwise", "pool-global", "pool-ceil",
            "pool-exclude-pad", "softmax-axis", "flatten-axis",
            *random_nets.FAMILIES}


def _coverage(seeds):
    types: Counter = Counter()
    after: dict[str, set[tuple[str, bool]]] = {}
    features: set[str] = set()
    modes = set()
    for seed in seeds:
        case = random_nets.random_case(seed)
        types.update(case.layer_types())
        features |= case.features
        modes.add(case.training)
        for producer, layer, in_place in random_nets.in_place_positions(case.config):
            after.setdefault(producer, set()).add((layer, in_place))
    return types, after, features, modes


def test_the_default_seeds_reach_every_layer_type_and_feature():
    types, after, features, modes = _coverage(random_nets.DEFAULT_SEEDS)
    missing = set(lp.layer_types()) - set(types)
    assert not missing, f"layer types no default seed generates: {sorted(missing)}"
    # an in-place-capable layer reads the output of every kind of layer somewhere (whether the wiring lets it run
    # in place there is the wiring's decision: refused after a layer whose backward reads its output)
    never = set(lp.layer_types()) - set(after)
    assert not never, f"layer types never followed by an in-place-capable layer: {sorted(never)}"
    ran = {layer for pairs in after.values() for layer, in_place in pairs if in_place}
    refused = {layer for pairs in after.values() for layer, in_place in pairs if not in_place}
    assert set(random_nets.IN_PLACE_TYPES) <= ran, sorted(set(random_nets.IN_PLACE_TYPES) - ran)
    assert {"ReLU", "Sigmoid", "TanH", "LeakyReLU", "ELU"} <= refused
    assert not FEATURES - features, f"features no default seed uses: {sorted(FEATURES - features)}"
    assert modes == {True, False}


def test_a_seed_always_gives_the_same_network():
    for seed in (0, 7, 31):
        a, b = random_nets.random_case(seed), random_nets.random_case(seed)
        assert a.config == b.config and a.training == b.training
        assert [(i.name, i.shape, i.kind, i.bound) for i in a.inputs] == [(i.name, i.shape, i.kind, i.bound)
                                                                            for i in b.inputs]
    assert random_nets.random_case(1).config != random_nets.random_case(2).config


def _gradient_check(native64, seed):
    case = random_nets.random_case(seed)
    rng = np.random.default_rng(seed)
    net = random_nets.build(native64, case.config, rng, case.training)
    inputs = case.make_inputs(rng)
    checked = check_layer_gradients(net, inputs, tol=1e-5, untrained=random_nets.untrained(net),
                                    before_forward=lambda: random_nets.reset_dropout(net))
    trained = set(net.learnable_weights_names()) - set(random_nets.untrained(net))
    assert checked > 0 or not (trained or case.config.config.force_backward), case


@pytest.mark.parametrize("seed", random_nets.DEFAULT_SEEDS)
def test_random_network_gradients(native64, seed):
    _gradient_check(native64, seed)


def pytest_generate_tests(metafunc):
    """The corpus's seeds are collected only when ``-m`` names random_corpus (one skipped test otherwise)."""
    if "corpus_seed" in metafunc.fixturenames:
        if "random_corpus" in (metafunc.config.option.markexpr or ""):
            metafunc.parametrize("corpus_seed", CORPUS_SEEDS)
        else:
            metafunc.parametrize("corpus_seed", [pytest.param(None, marks=pytest.mark.skip(
                reason="the long random-network corpus runs with -m random_corpus"))])


@pytest.mark.random_corpus
def test_random_network_gradients_corpus(native64, corpus_seed):
    _gradient_check(native64, corpus_seed)


@pytest.mark.random_corpus
def test_random_networks_match_native_corpus(device_or_layout, corpus_seed):  # noqa: F811
    check_random_network_matches_native(device_or_layout, corpus_seed)


def _random_solver(backend, case, output_shape, seed):
    """Momentum SGD with weight decay and clipping on the case's network, an MSE objective against a target."""
    obj = lp.SequentialConfig(inputs=[("out", list(output_shape)), ("target", list(output_shape))])
    obj.add_layer(lp.LayerConfig("mse", "MeanSquaredError"))
    solver = lp.Solver.from_config(backend, backend, lp.SolverConfig(
        network=case.config, objective=lp.LayerConfig("loss", obj), solver="momentum", base_lr=0.05, momentum=0.9,
        weight_decay=1e-3, clip_gradients=5.0, seed=0))
    rng = np.random.default_rng(seed)
    for name, w in zip(solver.network.learnable_weights_names(), solver.network.learnable_weights_data()):
        values = rng.standard_normal(w.shape) * 0.7
        w.set(np.abs(values) + 0.5 if name.endswith("running_var") else values)
    return solver


@pytest.mark.parametrize("seed", random_nets.DEFAULT_SEEDS)
def test_random_network_solver_steps_match_native(device_or_layout, seed):  # noqa: F811
    """Three training steps (dropout masks, batch statistics, shared weights' summed gradients, the update) on the
    device against native; networks of one float or ids input and one output (the solver's form)."""
    case = random_nets.random_case(seed)
    probe = random_nets.build(lp.backend("native"), case.config, np.random.default_rng(0))
    outs = probe.forward(case.make_inputs(np.random.default_rng(0), None, np.float32))
    if len(case.inputs) != 1 or len(outs) != 1:
        pytest.skip(f"{case}: {len(case.inputs)} inputs and {len(outs)} outputs; the solver takes one of each")
    solvers = [_random_solver(be, case, outs[0].shape, seed) for be in (lp.backend("native"), device_or_layout)]
    rng = np.random.default_rng(seed)
    for step in range(3):
        x = case.make_inputs(rng, None, np.float32)[0]
        target = rng.standard_normal(outs[0].shape).astype(np.float32)
        got = [s.train_minibatch(x, target).to_numpy() for s in solvers]
        close(got[1], got[0], f"{case}: output of step {step}", rtol=1e-3, atol=1e-4)
    names = solvers[0].network.learnable_weights_names()
    weights = [[w.to_numpy() for w in s.network.learnable_weights_data()] for s in solvers]
    for name, a, b in zip(names, weights[1], weights[0]):
        close(a, b, f"{case}: {name} after three steps", rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("seed", random_nets.DEFAULT_SEEDS)
def test_random_networks_round_trip(native, tmp_path, seed):
    """YAML (through PyYAML's safe dump and load) and a model file give back the config, and the loaded model
    computes what the saved one computed."""
    case = random_nets.random_case(seed)
    text = yaml.safe_dump(lp.config.layer_to_dict(case.config))
    assert lp.config.layer_from_dict(yaml.safe_load(text)) == case.config, text
    net = random_nets.build(native, case.config, np.random.default_rng(seed))  # inference: no dropout masks
    xs = case.make_inputs(np.random.default_rng(1), None, np.float32)
    want = [o.to_numpy() for o in net.forward(xs)]
    net.save(tmp_path / "net.leaf")
    loaded = lp.Layer.load(native, tmp_path / "net.leaf")
    assert loaded.config == case.config
    loaded.set_training(False)
    for got, w in zip(loaded.forward(xs), want):
        np.testing.assert_allclose(got.to_numpy(), w, rtol=1e-6, atol=1e-6)


# --- low precision: the same network on two backends that round alike ----------------------------------------------
GROSS_ULPS = 128
"""Low-precision runs of one network on two backends, compared element by element relative to max(1, |value|), in
units of the format's u: storage rounds at every layer, and where the two backends sum in different orders a value
may land one spacing apart (2u), which later layers carry and magnitudes inside the network (up to ~100 for these
weights) amplify; 32u was the largest seen over 200 networks. A wiring or gradient defect is off by O(1)."""


def _low_precision_pair(base, other, seed, dtype, u):
    case = random_nets.random_case(seed)
    rng = np.random.default_rng(seed)
    nets = [random_nets.build(be, case.config, np.random.default_rng(seed), case.training) for be in (base, other)]
    for batch in (case.inputs[0].shape[0], 3):
        xs = [x.astype(dtype).astype(np.float32) for x in case.make_inputs(rng, batch)]
        outs = [[o.to_numpy() for o in net.forward([x.copy() for x in xs])] for net in nets]
        dys = [rng.standard_normal(o.shape).astype(dtype).astype(np.float32) for o in outs[0]]
        grads = [[g.to_numpy() if g is not None else None for g in net.backward(dys)] for net in nets]
        weights = [[g.to_numpy() for g in net.learnable_weights_gradients()] for net in nets]
        pairs = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(*outs))]
        pairs += [(f"gradient of input {i}", a, b) for i, (a, b) in enumerate(zip(*grads)) if b is not None]
        pairs += [(f"{n} gradient", a, b) for n, a, b in zip(nets[0].learnable_weights_names(), *weights)
                  if n not in random_nets.untrained(nets[0])]
        for what, want, got in pairs:
            want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
            err = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1.0)) / u
            assert err <= GROSS_ULPS, f"{case} at batch {batch}: {what} differs by {err:.3g}u"


@pytest.mark.parametrize("seed", random_nets.DEFAULT_SEEDS)
def test_random_networks_in_bf16_channels_last_match_row_major(seed):
    """native bf16 storing 4-D tensors NHWC against native bf16 row-major (the layout under the emulation's casts)."""
    _low_precision_pair(lp.backend("native", precision="bf16"),
                        lp.backend("native", precision="bf16", channels_last=True), seed,
                        np.dtype(ml_dtypes.bfloat16), 2.0**-8)


@pytest.fixture(scope="module")
def fp16_pair():
    """native's fp16 emulation and webgpu in fp16 (skipped where the adapter lacks shader-f16)."""
    webgpu_offering("shader-f16")
    return lp.backend("native", precision="fp16"), lp.backend("webgpu", precision="fp16")


@pytest.mark.webgpu
@pytest.mark.parametrize("seed", range(24))
def test_random_networks_in_webgpu_fp16_match_native_fp16(fp16_pair, seed):
    _low_precision_pair(*fp16_pair, seed, np.dtype(np.float16), 2.0**-11)


@pytest.mark.webgpu
@pytest.mark.random_corpus
def test_random_networks_in_webgpu_fp16_match_native_fp16_corpus(fp16_pair, corpus_seed):
    _low_precision_pair(*fp16_pair, corpus_seed, np.dtype(np.float16), 2.0**-11)


# --- defects the random networks found, each kept as a small case -------------------------------------------------
def test_a_weight_shared_with_a_layer_in_a_nested_container_gets_both_gradients(native64):
    """fc1 and fc2 (inside a nested container) share one weight and bias by name: their gradient is the sum of both
    layers' shares. It was only fc1's (each container let its own first layer overwrite the gradient)."""
    params = [lp.WeightConfig(name="w"), lp.WeightConfig(name="b")]
    inner = lp.SequentialConfig(inputs=[("x", [2, 3])])
    inner.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=3), params=params))
    cfg = lp.SequentialConfig(inputs=[("data", [2, 3])], force_backward=True)
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=3), params=params))
    cfg.add_layer(lp.LayerConfig("tanh", "TanH"))
    cfg.add_layer(lp.LayerConfig("inner", inner))
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", cfg), seed=0)
    assert net.learnable_weights_names() == ["w", "b"]
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((3, 3)), rng.standard_normal(3)
    for t, v in zip(net.learnable_weights_data(), (w, b)):
        t.set(v)
    x, dy = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    net.forward([x])
    dx = net.backward([dy])[0].to_numpy()
    # y = W tanh(W x + b) + b, written out in float64
    h = np.tanh(x @ w.T + b)
    dz = (dy @ w) * (1 - h * h)
    np.testing.assert_allclose(net.learnable_weights_gradients()[0].to_numpy(), dy.T @ h + dz.T @ x, rtol=1e-12)
    np.testing.assert_allclose(net.learnable_weights_gradients()[1].to_numpy(), dy.sum(0) + dz.sum(0), rtol=1e-12)
    np.testing.assert_allclose(dx, dz @ w, rtol=1e-12)
    check_layer_gradients(net, [x])  # and random_case(79) draws such a pair among other layers


NESTED_YAML = """
name: nested
network:
  type: Sequential
  inputs: [{name: data, shape: [2, 3]}]
  layers:
    - {name: fc, type: Linear, output_size: 3, outputs: [h]}
    - {name: tanh, type: TanH, inputs: [h], outputs: [t]}
    - name: block
      type: Sequential
      inputs: [{name: a, shape: [2, 3], from: t}, {name: b, shape: [2, 3], from: h}]
      outputs: [s]
      layers: [{name: add, type: Eltwise, operation: sum, coeff: [2.0, -1.0], inputs: [a, b]}]
    - {name: out, type: Eltwise, operation: prod, inputs: [s, h]}
objective:
  type: Sequential
  inputs: [{name: network_out, shape: [2, 3]}, {name: target, shape: [2, 3]}]
  layers: [{name: mse, type: MeanSquaredError}]
"""


def test_a_nested_container_wired_by_name_survives_yaml(native64):
    """A nested Sequential reading named blobs of its container (each declared input's ``from``) and naming its
    output: its wiring was dropped when written to YAML (the declared inputs take the key ``inputs``), so random
    networks with such containers (random_case(4) and 19 others of seeds 0-399) came back wired otherwise."""
    run = lp.config.loads(NESTED_YAML)
    block = run.network.config.layers[2]
    assert block.inputs == ("t", "h") and block.outputs == ("s",)
    assert lp.config.loads(lp.config.dumps(run)).network == run.network
    net = lp.Layer.from_config(native64, run.network, seed=1)
    w, b = (t.to_numpy() for t in net.learnable_weights_data())
    x = np.random.default_rng(0).standard_normal((2, 3))
    h = x @ w.T + b
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), (2 * np.tanh(h) - h) * h, rtol=1e-12)
    with pytest.raises(lp.ConfigError, match=r"network.layers\[2\].inputs: give every input a 'from'.*1 of 2"):
        lp.config.loads(NESTED_YAML.replace(", from: h}", "}"))
