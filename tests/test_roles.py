"""One role each, seen from outside: a Layer computes, a Sequential holds layers, and the Network runs the outermost
one and is all a Solver talks to; the old names (Layer.runner, the layer's attributes on solver.network) still work
and say what replaced them; layer.py and network.py do not import each other in a circle."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import numpy as np
import pytest

import leafpy as lp
from tests.conftest import webgpu_offering

LAYERS = Path(lp.__file__).parent / "layers"


def _mlp(batch: int = 16) -> lp.LayerConfig:
    cfg = lp.SequentialConfig(inputs=[("data", [batch, 6])])
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=12)))
    cfg.add_layer(lp.LayerConfig("relu1", "ReLU"))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=3)))
    cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    return lp.LayerConfig("mlp", cfg)


def _nll(batch: int = 16) -> lp.LayerConfig:
    cfg = lp.SequentialConfig(inputs=[("network_out", [batch, 3]), ("label", [batch, 1])])
    cfg.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=3)))
    return lp.LayerConfig("loss", cfg)


def _batch(n: int = 16):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)


def test_a_solver_trains_networks_built_and_fed_through_the_public_api(native):
    model = lp.Layer.from_config(native, _mlp(), seed=0)
    objective = lp.Layer.from_config(native, _nll())
    net = model.network
    assert isinstance(net, lp.Network) and net.layer is model and model.network is net
    solver = lp.Solver(net, objective.network, lp.SolverConfig(solver="momentum", base_lr=0.1, momentum=0.9))
    assert solver.network is net and solver.objective is objective.network
    x, y = _batch()
    losses = []
    for _ in range(30):
        out = solver.train_minibatch(x, y)
        losses.append(solver.loss())
    assert out is net.outputs[0] and out.shape == (16, 3)
    assert losses[-1] < 0.5 * losses[0]
    # the parameters the update moved are the network's, in network order, the layer's own tensors
    params = net.parameters()
    assert params.names == ["fc1/weight", "fc1/bias", "fc2/weight", "fc2/bias"]
    assert all(a is b for a, b in zip(params.data, model.learnable_weights_data()))
    assert net.learnable_weights_names() == model.learnable_weights_names()
    assert net.num_parameters() == model.num_parameters() == 6 * 12 + 12 + 12 * 3 + 3
    # the network's forward is the model's: same buffers, same values
    np.testing.assert_allclose(net.forward([x])[0].to_numpy(), model.forward([x])[0].to_numpy(), rtol=1e-6)


def test_a_solver_built_from_layers_holds_their_networks(native):
    model, objective = lp.Layer.from_config(native, _mlp()), lp.Layer.from_config(native, _nll())
    solver = lp.Solver(model, objective, lp.SolverConfig(solver="adam", base_lr=0.01))
    assert solver.network is model.network and solver.objective is objective.network
    with pytest.raises(lp.ConfigError, match=r"solver.network: expected a Network or a Layer .*got str"):
        lp.Solver("mlp", objective, lp.SolverConfig())  # type: ignore[arg-type]


def test_a_containers_outputs_follow_its_last_layer_across_batch_sizes(native):
    model = lp.Layer.from_config(native, _mlp())
    for n in (16, 5, 9):
        out = model.forward([_batch(n)[0]])[0]
        assert out.shape == (n, 3)
        assert model.outputs is model.layers[-1].outputs and model.output_grads is model.layers[-1].output_grads
        assert model.network.outputs[0] is out


def test_layer_runner_is_a_deprecated_name_of_layer_network(native):
    model = lp.Layer.from_config(native, _mlp())
    with pytest.warns(DeprecationWarning, match=r"Layer.runner is deprecated: use Layer.network"):
        runner = model.runner
    assert runner is model.network


def test_the_layers_other_attributes_through_solver_network_warn_and_work(native):
    solver = lp.Solver.from_config(native, native, lp.SolverConfig(network=_mlp(), objective=_nll()))
    with pytest.warns(DeprecationWarning, match=r"Network.layers: .* use network.layer.layers"):
        layers = solver.network.layers
    assert [layer.name for layer in layers] == ["fc1", "relu1", "fc2", "logsm"]
    with warnings.catch_warnings():  # the whole-network API is the Network's own: no warning
        warnings.simplefilter("error")
        solver.network.set_training(False)
        assert solver.network.training is False
        solver.network.load_weights(solver.network.named_weights())
        assert solver.network.config.name == "mlp"
    with pytest.raises(AttributeError, match=r"Network.backward_hook: .* set network.layer.backward_hook"):
        solver.network.backward_hook = print  # a container's attribute is set on the layer, not on its network


def _imports(path: Path) -> set[str]:
    """Every module a file imports, relative ones as written (".layer"), under TYPE_CHECKING too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_layer_and_network_modules_import_one_way():
    assert ".network" in _imports(LAYERS / "layer.py")
    network_imports = _imports(LAYERS / "network.py")
    assert not {".layer", "leafpy.layers.layer", ".container", ".container.sequential"} & network_imports, \
        network_imports


def test_a_trained_solver_network_exports_to_onnx_and_the_web_as_its_layer_does(native, tmp_path):
    pytest.importorskip("onnx", reason="the onnx extra is not installed")
    solver = lp.Solver.from_config(native, native, lp.SolverConfig(network=_mlp(), objective=_nll(), base_lr=0.1))
    x, y = _batch()
    solver.train_minibatch(x, y)
    with warnings.catch_warnings():  # solver.network is accepted where its layer was, with no deprecation
        warnings.simplefilter("error")
        lp.onnx.export(solver.network, tmp_path / "net.onnx")
        assert lp.onnx.to_model(solver.network).graph.name == lp.onnx.to_model(solver.network.layer).graph.name
    loaded = lp.onnx.load(tmp_path / "net.onnx", native)
    for name, w in solver.network.named_weights().items():
        np.testing.assert_allclose(loaded.named_weights()[name], w, rtol=1e-6, atol=1e-7)
    webgpu_offering()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lp.web.export(solver.network, tmp_path / "web", batch_sizes=[2], precision="fp32") == ["fp32"]
    assert (tmp_path / "web" / "model" / "plan.json").is_file()


def test_a_solver_of_networks_built_by_hand_saves_a_checkpoint_that_resumes(native, tmp_path):
    model, objective = lp.Layer.from_config(native, _mlp(), seed=0), lp.Layer.from_config(native, _nll())
    solver = lp.Solver(model.network, objective.network, lp.SolverConfig(solver="adam", base_lr=0.01))
    x, y = _batch()
    for _ in range(3):
        solver.train_minibatch(x, y)
    solver.save_checkpoint(str(tmp_path / "checkpoint.leaf"))  # its config names no network: the networks' own
    resumed = lp.Solver.load_checkpoint(native, native, str(tmp_path / "checkpoint.leaf"))
    assert resumed.iteration == 3 and resumed.network.config.name == "mlp"
    solver.train_minibatch(x, y)
    resumed.train_minibatch(x, y)
    for name, w in solver.network.named_weights().items():
        np.testing.assert_allclose(resumed.network.named_weights()[name], w, rtol=1e-5, atol=1e-6)
