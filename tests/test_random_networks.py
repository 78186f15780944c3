"""Random networks over every layer type (tests/random_nets.py): what the generator reaches, and each network's
gradients on native float64 against central differences (the wiring in combination: branches, in-place runs after
every kind of layer, nested containers, shared weights, ids and labels). The same networks run on the device
backends against native in test_backends.py. ``-m random_corpus`` runs many more seeds."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import random_nets
from gradcheck import check_layer_gradients

import leafpy as lp

CORPUS_SEEDS = range(1000, 1400)
"""A longer corpus, run with ``-m random_corpus``."""
FEATURES = {"residual", "eltwise-sum", "eltwise-prod", "eltwise-max", "concat", "slice", "slice-unread",
            "slice-concat-auto", "skip", "nested", "nested-two-inputs", "nested-deeper", "shared", "shared-nested",
            "named-in-place", "ids-fan-out", "reshape", *random_nets.FAMILIES}


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
    assert checked > 0, case


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
