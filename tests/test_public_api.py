"""The public API exactly as the design document writes it (code outside the project calls these names)."""

from __future__ import annotations

import os

import numpy as np

import leafpy as lp

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_design_document_example(tmp_path):
    be = lp.backend("native")
    assert "native" in lp.available_backends()
    net_cfg = lp.SequentialConfig(inputs=[("data", [64, 1, 28, 28])], force_backward=False)
    net_cfg.add_layer(lp.LayerConfig("conv1", lp.ConvolutionConfig(num_output=20, filter_shape=[5], stride=[1],
                                                                   padding=[0])))
    net_cfg.add_layer(lp.LayerConfig("pool1", lp.PoolingConfig(mode="max", filter_shape=[2], stride=[2],
                                                               padding=[0])))
    net_cfg.add_layer(lp.LayerConfig("flat", "Flatten"))
    net_cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=500)))
    net_cfg.add_layer(lp.LayerConfig("relu1", "ReLU"))
    net_cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=10)))
    net_cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    net = lp.Layer.from_config(be, lp.LayerConfig("lenet", net_cfg))

    x = np.random.default_rng(0).random((64, 1, 28, 28)).astype(np.float32)
    out = net.forward([x])
    dx = net.backward([np.ones((64, 10), np.float32)])
    assert dx == [None]
    assert len(net.learnable_weights_data()) == len(net.learnable_weights_gradients()) == 6
    assert net.learnable_weights_names()[:3] == ["conv1/weight", "conv1/bias", "fc1/weight"]
    assert out[0].to_numpy().shape == (64, 10) and out[0].shape == (64, 10)
    w = net.learnable_weights_data()[0]
    w.set(np.zeros(w.shape, np.float32))
    assert np.all(w.to_numpy() == 0)
    t = lp.SharedTensor.from_numpy(x)
    assert t.shape == x.shape
    net.save(tmp_path / "lenet.leaf")
    net2 = lp.Layer.load(be, tmp_path / "lenet.leaf")
    np.testing.assert_array_equal(net2.forward([x])[0].to_numpy(), net.forward([x])[0].to_numpy())

    obj_cfg = lp.SequentialConfig(inputs=[("network_out", [64, 10]), ("label", [64, 1])])
    obj_cfg.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=10)))
    sol_cfg = lp.SolverConfig(network=lp.LayerConfig("lenet", net_cfg), objective=lp.LayerConfig("loss", obj_cfg),
                              solver="momentum", base_lr=0.01, momentum=0.9, lr_policy="step", gamma=0.1,
                              stepsize=1000, clip_gradients=None, weight_decay=5e-4, minibatch_size=1)
    solver = lp.Solver.from_config(be, be, sol_cfg)
    labels = np.random.default_rng(1).integers(0, 10, (64, 1))
    out = solver.train_minibatch(x, labels)
    assert isinstance(out, lp.SharedTensor) and out.shape == (64, 10)
    assert isinstance(solver.network, lp.Network) and isinstance(solver.network.layer, lp.Layer)
    assert solver.iteration == 1
    solver.save_checkpoint(tmp_path / "ckpt.leaf")
    solver = lp.Solver.load_checkpoint(be, be, tmp_path / "ckpt.leaf")
    assert solver.iteration == 1

    run = lp.config.load(os.path.join(ROOT, "configs", "digits_lenet.yaml"))
    assert isinstance(run.network, lp.LayerConfig) and isinstance(run.objective, lp.LayerConfig)
    assert isinstance(run.solver, lp.SolverConfig) and run.data["dataset"] == "digits"
