"""Random small networks for wiring tests: chains of every layer type that takes one input, with in-place runs
(activations, Reshape, Flatten, Dropout after other layers), BatchNorm, nested Sequentials and weights shared by
name."""

from __future__ import annotations

import math

import numpy as np

import leafpy as lp

ACTIVATIONS = ["ReLU", "Sigmoid", "TanH"]


def random_network(rng: np.random.Generator) -> tuple[lp.LayerConfig, list[int]]:
    """A network config over an input [2, C, H, H], and that input's shape."""
    n, c, h = 2, int(rng.integers(1, 3)), int(rng.integers(5, 8))
    shape = [n, c, h, h]
    cfg = lp.SequentialConfig(inputs=[("data", shape)], force_backward=True)
    cur = list(shape)
    for i in range(int(rng.integers(2, 7))):
        kind = rng.choice(["conv", "pool", "act", "act", "linear", "shared", "reshape", "flatten", "sequential",
                           "dropout", "batchnorm"])
        name = f"l{i}"
        if kind == "conv" and len(cur) == 4:
            f, s, p = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(0, 2))
            if cur[2] + 2 * p < f:
                continue
            out = int(rng.integers(1, 4))
            cfg.add_layer(lp.LayerConfig(name, lp.ConvolutionConfig(num_output=out, filter_shape=[f], stride=[s],
                                                                    padding=[p], bias=bool(rng.random() < 0.8))))
            side = (cur[2] + 2 * p - f) // s + 1
            cur = [n, out, side, side]
        elif kind == "pool" and len(cur) == 4 and cur[2] >= 2:
            s = int(rng.integers(1, 3))
            mode = str(rng.choice(["max", "average"]))
            cfg.add_layer(lp.LayerConfig(name, lp.PoolingConfig(mode=mode, filter_shape=[2], stride=[s])))
            side = (cur[2] - 2) // s + 1
            cur = [n, cur[1], side, side]
        elif kind == "act":
            cfg.add_layer(lp.LayerConfig(name, str(rng.choice(ACTIVATIONS))))
        elif kind == "linear":
            out = int(rng.integers(2, 6))
            cfg.add_layer(lp.LayerConfig(name, lp.LinearConfig(output_size=out, bias=bool(rng.random() < 0.7))))
            cur = [n, out]
        elif kind == "shared" and len(cur) == 2:
            # two Linear layers of one square weight (and bias) with an activation between them
            params = [lp.WeightConfig(name=f"{name}_w"), lp.WeightConfig(name=f"{name}_b")]
            for part in ("a", "b"):
                cfg.add_layer(lp.LayerConfig(f"{name}{part}", lp.LinearConfig(output_size=cur[1]), params=params))
                if part == "a":
                    cfg.add_layer(lp.LayerConfig(f"{name}act", str(rng.choice(ACTIVATIONS))))
        elif kind == "reshape":
            cfg.add_layer(lp.LayerConfig(name, lp.ReshapeConfig(shape=[n, -1, 1])))
            cur = [n, math.prod(cur[1:]), 1]
        elif kind == "flatten":
            cfg.add_layer(lp.LayerConfig(name, "Flatten"))
            cur = [n, math.prod(cur[1:])]
        elif kind == "batchnorm":
            cfg.add_layer(lp.LayerConfig(name, lp.BatchNormConfig(affine=bool(rng.random() < 0.7))))
        elif kind == "dropout":
            cfg.add_layer(lp.LayerConfig(name, lp.DropoutConfig(ratio=0.5)))
        elif kind == "sequential":
            inner = lp.SequentialConfig(inputs=[("x", list(cur))])
            inner.add_layer(lp.LayerConfig("act", str(rng.choice(ACTIVATIONS))))
            inner.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
            cfg.add_layer(lp.LayerConfig(name, inner))
            cur = [n, 3]
    if not cfg.layers:
        cfg.add_layer(lp.LayerConfig("act", str(rng.choice(ACTIVATIONS))))
    if len(cur) == 2 and rng.random() < 0.5:
        cfg.add_layer(lp.LayerConfig("out", str(rng.choice(["Softmax", "LogSoftmax"]))))
    return lp.LayerConfig("net", cfg), shape


def build(backend: lp.Backend, config: lp.LayerConfig, rng: np.random.Generator) -> lp.Layer:
    """The network in inference mode (Dropout passes through, BatchNorm uses its running statistics) with random
    weights: no bias starts at exactly 0, where a ReLU over padded positions would sit on its kink and make central
    differences meaningless; running variances are positive."""
    net = lp.Layer.from_config(backend, config, seed=0)
    net.set_training(False)
    for name, w in zip(net.learnable_weights_names(), net.learnable_weights_data()):
        values = rng.standard_normal(w.shape) * 0.7
        w.set(np.abs(values) + 0.5 if name.endswith("running_var") else values)
    return net


def untrained(net: lp.Layer) -> tuple[str, ...]:
    """The running statistics among the network's weights (no gradient by design)."""
    return tuple(n for n in net.learnable_weights_names() if n.endswith(("running_mean", "running_var")))
