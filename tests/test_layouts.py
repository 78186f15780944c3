"""Arrays of the declared size in another layout (channels-last images, transposed gradients) are ShapeErrors
that say which transpose fits, in the API and in the leafpy command; layouts that only differ by axes of length
1 at the end, or images into a flat input, still run."""

from __future__ import annotations

import numpy as np
import pytest
from test_cli import run

import leafpy as lp


def _conv_net(channels=3):
    cfg = lp.SequentialConfig(inputs=[("data", [4, channels, 6, 6])])
    cfg.add_layer(lp.LayerConfig("conv", lp.ConvolutionConfig(num_output=2, filter_shape=[3])))
    cfg.add_layer(lp.LayerConfig("flat", "Flatten"))
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    return lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg), seed=0)


def test_channels_last_images_are_refused_with_the_transpose_that_fits():
    net = _conv_net()
    x = np.random.default_rng(0).standard_normal((4, 3, 6, 6)).astype(np.float32)
    with pytest.raises(lp.ShapeError, match=r"got \(4, 6, 6, 3\).*x\.transpose\(0, 3, 1, 2\)"):
        net.forward([x.transpose(0, 2, 3, 1)])
    with pytest.raises(lp.ShapeError, match=r"declared \[4, 3, 6, 6\]\), got \(4, 108\).*x\.reshape"):
        net.forward([x.reshape(4, -1)])
    # the suggested transpose gives what the channels-first array gives
    a = net.forward([x])[0].to_numpy()
    b = net.forward([np.ascontiguousarray(x.transpose(0, 2, 3, 1).transpose(0, 3, 1, 2))])[0].to_numpy()
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_transposed_gradient_is_refused():
    net = _conv_net()
    net.forward([np.zeros((4, 3, 6, 6), np.float32)])
    with pytest.raises(lp.ShapeError, match=r"must have shape \(4, 3\), got \(3, 4\).*g\.T"):
        net.backward([np.ones((3, 4), np.float32)])
    net.backward([np.ones((4, 3, 1), np.float32)])  # a trailing axis of length 1 is the same layout


def test_labels_and_flat_inputs_keep_working():
    cfg = lp.SequentialConfig(inputs=[("data", [5, 16])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    net = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("mlp", cfg), seed=0)
    x = np.random.default_rng(1).standard_normal((5, 4, 4)).astype(np.float32)
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), net.forward([x.reshape(5, 16)])[0].to_numpy())
    obj = lp.SequentialConfig(inputs=[("out", [5, 3]), ("label", [5, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=3)))
    loss = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("loss", obj))
    logp = np.log(np.full((5, 3), 1 / 3, np.float32))
    out = loss.forward([logp, np.array([0, 1, 2, 0, 1])])[0].to_numpy()  # labels [N] for [N, 1]
    np.testing.assert_allclose(out.reshape(-1)[0], np.log(3), rtol=1e-6)


def test_the_command_refuses_channels_last_images_before_training(tmp_path):
    rng = np.random.default_rng(2)
    np.savez(tmp_path / "images.npz", x=rng.random((40, 6, 6, 3)).astype(np.float32), y=rng.integers(0, 3, 40))
    (tmp_path / "run.yaml").write_text(f"""
name: layout
data: {{dataset: npz, path: {tmp_path / 'images.npz'}, batch_size: 8, test_fraction: 0.25}}
train: {{epochs: 1}}
network:
  type: Sequential
  inputs: [{{name: data, shape: [8, 3, 6, 6]}}]
  layers:
    - {{name: conv, type: Convolution, num_output: 2, filter_shape: [3]}}
    - {{name: flat, type: Flatten}}
    - {{name: fc, type: Linear, output_size: 3}}
    - {{name: logsm, type: LogSoftmax}}
objective:
  type: Sequential
  inputs: [{{name: out, shape: [8, 3]}}, {{name: label, shape: [8, 1]}}]
  layers: [{{name: nll, type: NegativeLogLikelihood, num_classes: 3}}]
solver: {{solver: momentum, base_lr: 0.01, momentum: 0.9}}
""")
    p = run("train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "out"))
    assert p.returncode != 0
    assert "x.transpose(0, 3, 1, 2)" in p.stderr and "[6, 6, 3]" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "out" / "model.leaf").exists()
