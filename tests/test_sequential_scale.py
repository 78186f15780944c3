"""A Sequential's size costs linear time: 20,000 trivial layers are declared, read from their YAML form, built,
run, saved and loaded in a few seconds (the duplicate-name check was a scan per layer: 20,000 took 8 s to declare
and 15 s to read)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import leafpy as lp

N = 20_000


def test_twenty_thousand_layers_declare_read_build_run_save_and_load_in_linear_time(tmp_path):
    start = time.perf_counter()
    doc = {"name": "deep", "type": "Sequential", "inputs": [{"name": "data", "shape": [2, 3]}],
           "layers": [{"name": f"r{i}", "type": "ReLU" if i % 2 else "Sigmoid"} for i in range(N)]}
    cfg = lp.config.layer_from_dict(doc)
    assert len(cfg.config.layers) == N
    declare = time.perf_counter() - start
    net = lp.Layer.from_config(lp.backend("native"), cfg)
    x = np.array([[-1.0, 0.0, 2.0], [0.5, -3.0, 1.0]], np.float32)
    y = net.forward([x])[0].to_numpy()
    ref = x.astype(np.float64)
    for _ in range(N // 2):  # sigmoid then ReLU, in float64
        ref = np.maximum(1.0 / (1.0 + np.exp(-ref)), 0.0)
    np.testing.assert_allclose(y, ref, rtol=1e-5)
    net.save(str(tmp_path / "deep.leaf"))
    again = lp.Layer.load(lp.backend("native"), str(tmp_path / "deep.leaf"))
    np.testing.assert_allclose(again.forward([x])[0].to_numpy(), ref, rtol=1e-5)
    total = time.perf_counter() - start
    # loose bounds for a busy machine: a linear scan per layer took 8.3 s to declare them, ~40 s in all
    assert declare < 3, f"declaring {N} layers took {declare:.1f} s"
    assert total < 30, f"{N} layers took {total:.1f} s"


def test_duplicate_layer_names_are_still_refused_even_after_the_list_is_changed_directly():
    cfg = lp.SequentialConfig(inputs=[("data", [2, 3])])
    cfg.add_layer(lp.LayerConfig("a", "ReLU"))
    with pytest.raises(lp.ConfigError, match="two layers are named 'a'"):
        cfg.add_layer(lp.LayerConfig("a", "Sigmoid"))
    cfg.layers.append(lp.LayerConfig("b", "ReLU"))
    with pytest.raises(lp.ConfigError, match="two layers are named 'b'"):
        cfg.add_layer(lp.LayerConfig("b", "TanH"))
    with pytest.raises(lp.ConfigError, match="two layers are named 'c'"):
        lp.SequentialConfig(layers=[lp.LayerConfig("c", "ReLU"), lp.LayerConfig("c", "ReLU")])
