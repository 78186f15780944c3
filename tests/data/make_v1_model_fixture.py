"""Run as ``python tests/data/make_v1_model_fixture.py`` from a checkout of commit 19c53fc (file format 1: the
weights held in the message as Tensor.raw).

Writes tests/data/v1_model.leaf, a small network (Convolution with bias, Linear) saved by that leafpy, and
tests/data/v1_model.npz, the weights it holds and the output it computes for a fixed input: a file of format 1
must load and compute the same after the format changes."""

import os
import sys

import numpy as np

sys.path.insert(0, os.getcwd())
import leafpy as lp  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
be = lp.backend("native")
cfg = lp.SequentialConfig(inputs=[("data", [2, 1, 6, 6])])
cfg.add_layer(lp.LayerConfig("conv1", lp.ConvolutionConfig(num_output=3, filter_shape=(3,), bias=True)))
cfg.add_layer(lp.LayerConfig("relu1", "ReLU"))
cfg.add_layer(lp.LayerConfig("flat", lp.ReshapeConfig(shape=(2, 48))))
cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=5)))
net = lp.Layer.from_config(be, lp.LayerConfig("net", cfg), seed=3)
net.save(os.path.join(here, "v1_model.leaf"))
x = np.random.default_rng(1).standard_normal((2, 1, 6, 6)).astype(np.float32)
out = net.forward([x])[0].to_numpy()
np.savez(os.path.join(here, "v1_model.npz"), x=x, out=out, **{k.replace("/", "__"): v
                                                           for k, v in net.named_weights().items()})
