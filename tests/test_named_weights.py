"""The named-weights API (Layer.named_weights / load_weights) and the solver's state (Solver.snapshot / restore),
checked from the outside: against a Cap'n Proto reader that knows only the schema, a NumPy float64 forward pass,
and a solver that never stopped."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import backend_or_skip

import leafpy as lp

SCHEMA = Path(lp.__file__).resolve().parent / "leaf.capnp"
HEADER = struct.Struct("<8sIIQQI")  # magic, version, kind, words, payload bytes, CRC-32 (the file format)


def _mlp_config(shared: bool = False) -> lp.LayerConfig:
    inner = lp.SequentialConfig(inputs=[("h", [2, 5])])
    inner.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=5),
                                   params=[{"name": "tied"}] if shared else []))
    inner.add_layer(lp.LayerConfig("relu2", "ReLU"))
    cfg = lp.SequentialConfig(inputs=[("data", [2, 4])])
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=5)))
    cfg.add_layer(lp.LayerConfig("relu1", "ReLU"))
    cfg.add_layer(lp.LayerConfig("block", inner))
    if shared:  # a second layer using the weight named "tied" (shared, so it appears once)
        cfg.add_layer(lp.LayerConfig("fc3", lp.LinearConfig(output_size=5, bias=False), params=[{"name": "tied"}]))
    cfg.add_layer(lp.LayerConfig("out", lp.LinearConfig(output_size=3)))
    return lp.LayerConfig("net", cfg)


def _read_with_pycapnp(path: Path) -> dict[str, np.ndarray]:
    """The weights of a leafpy model file, read with pycapnp and the schema alone."""
    import capnp

    data = path.read_bytes()
    magic, version, kind, _, length, _ = HEADER.unpack_from(data)
    assert magic == b"\x89LEAFPY\n" and version == 2 and kind == 1
    msg = capnp.load(str(SCHEMA)).Layer.from_bytes_packed(data[HEADER.size:HEADER.size + length])
    raw = data[-(-(HEADER.size + length) // 64) * 64:]  # format 2: the raw section, 64-byte aligned, to the end
    out = {}
    for w in msg.weightsData:
        shape = tuple(int(d) for d in w.tensor.shape)
        count = int(np.prod(shape))
        out[w.name] = np.frombuffer(raw, dtype="<f4", count=count, offset=w.tensor.offset).reshape(shape)
    return out


@pytest.mark.parametrize("shared", [False, True])
def test_named_weights_of_a_loaded_network_are_what_the_file_holds(tmp_path, native, shared):
    net = lp.Layer.from_config(native, _mlp_config(shared), seed=3)
    path = tmp_path / "net.leaf"
    net.save(path)
    in_file = _read_with_pycapnp(path)
    loaded = lp.Layer.load(native, path).named_weights()
    expected = ["fc1/weight", "fc1/bias"] + (["tied", "block/fc2/bias"] if shared else
                                             ["block/fc2/weight", "block/fc2/bias"]) + ["out/weight", "out/bias"]
    assert list(loaded) == expected == list(in_file)
    for name in expected:
        assert loaded[name].dtype == np.float32
        np.testing.assert_array_equal(loaded[name], in_file[name])  # float32 bits stored and read back
    before = net.named_weights()
    for name in expected:
        np.testing.assert_array_equal(before[name], in_file[name])


def test_named_weights_are_copies(native):
    net = lp.Layer.from_config(native, _mlp_config(), seed=0)
    w = net.named_weights()
    w["fc1/weight"][...] = 7.0
    assert not np.any(net.named_weights()["fc1/weight"] == 7.0)


def test_loaded_weights_compute_what_numpy_computes(native):
    rng = np.random.default_rng(0)
    shapes = {"fc1/weight": (5, 4), "fc1/bias": (5,), "block/fc2/weight": (5, 5), "block/fc2/bias": (5,),
              "out/weight": (3, 5), "out/bias": (3,)}
    given = {name: rng.normal(size=shape) for name, shape in shapes.items()}  # float64, cast on the way in
    net = lp.Layer.from_config(native, _mlp_config(), seed=0)
    result = net.load_weights(given)
    assert result.missing == [] and result.unexpected == []
    x = rng.normal(size=(2, 4))
    y = net.forward([x.astype(np.float32)])[0].to_numpy()
    h = np.maximum(x @ given["fc1/weight"].T + given["fc1/bias"], 0)
    h = np.maximum(h @ given["block/fc2/weight"].T + given["block/fc2/bias"], 0)
    expected = h @ given["out/weight"].T + given["out/bias"]
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_a_standalone_layer_takes_its_weights_on_its_first_forward(native):
    layer = lp.Layer.from_config(native, lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    w, b = np.arange(6.0).reshape(2, 3), np.array([0.5, -0.5])
    layer.load_weights({"fc/weight": w, "fc/bias": b})
    x = np.array([[1.0, 2.0, 3.0]])
    np.testing.assert_allclose(layer.forward([x.astype(np.float32)])[0].to_numpy(), x @ w.T + b, rtol=1e-6)


def test_leaf_names_are_understood(native):
    net = lp.Layer.from_config(native, _mlp_config(), seed=0)
    w = net.named_weights()
    net.load_weights({"fc1-0": w["fc1/weight"] + 1, "fc1-1": w["fc1/bias"], "fc2-0": w["block/fc2/weight"],
                      "fc2-1": w["block/fc2/bias"], "out-0": w["out/weight"], "out-1": w["out/bias"]})
    np.testing.assert_allclose(net.named_weights()["fc1/weight"], w["fc1/weight"] + 1, rtol=1e-6)


def test_bad_weights_are_named_and_nothing_is_set(native):
    net = lp.Layer.from_config(native, _mlp_config(), seed=0)
    good = net.named_weights()
    zeros = {n: np.zeros_like(a) for n, a in good.items()}
    with pytest.raises(lp.ConfigError, match="'out/bias' is missing"):
        net.load_weights({n: a for n, a in zeros.items() if n != "out/bias"})
    with pytest.raises(lp.ConfigError, match="'fc9/weight' matches no weight.*fc1/weight"):
        net.load_weights({**zeros, "fc9/weight": np.zeros(3)})
    with pytest.raises(lp.ShapeError, match=r"'block/fc2/weight' has shape \(5, 4\).*needs \(5, 5\)"):
        net.load_weights({**zeros, "block/fc2/weight": np.zeros((5, 4))})
    with pytest.raises(lp.ShapeError, match="'fc1/bias'.*real numbers"):
        net.load_weights({**zeros, "fc1/bias": np.array(["a"] * 5)})
    with pytest.raises(lp.ConfigError, match="mapping"):
        net.load_weights(list(zeros.values()))
    after = net.named_weights()
    for name in good:  # every failed call left every weight as it was
        np.testing.assert_array_equal(after[name], good[name])


def test_not_strict_loads_what_fits_and_reports_the_rest(native):
    net = lp.Layer.from_config(native, _mlp_config(), seed=0)
    good = net.named_weights()
    result = net.load_weights({"fc1/bias": np.full(5, 2.0), "extra": np.zeros(1)}, strict=False)
    assert result.unexpected == ["extra"]
    assert result.missing == [n for n in good if n != "fc1/bias"]
    after = net.named_weights()
    np.testing.assert_allclose(after["fc1/bias"], 2.0)
    np.testing.assert_array_equal(after["out/weight"], good["out/weight"])
    with pytest.raises(lp.ShapeError, match="fc1/bias"):  # a misfit is an error even then
        net.load_weights({"fc1/bias": np.zeros(4)}, strict=False)


# --- solver state ---------------------------------------------------------------------------------------------
def _solver(native, rule: str, minibatch_size: int) -> lp.Solver:
    cfg = lp.SequentialConfig(inputs=[("data", [4, 6])])
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=8)))
    cfg.add_layer(lp.LayerConfig("relu", "ReLU"))
    cfg.add_layer(lp.LayerConfig("drop", lp.DropoutConfig(ratio=0.3)))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=3)))
    cfg.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    obj = lp.SequentialConfig(inputs=[("out", [4, 3]), ("label", [4, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=3)))
    sol = lp.SolverConfig(network=lp.LayerConfig("net", cfg), objective=lp.LayerConfig("loss", obj), solver=rule,
                          base_lr=0.05, momentum=0.9, lr_policy="inv", gamma=0.1, power=0.75,
                          weight_decay=1e-3, minibatch_size=minibatch_size, seed=5)
    return lp.Solver.from_config(native, native, sol)


def _batches(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(9)
    return [(rng.normal(size=(4, 6)).astype(np.float32), rng.integers(0, 3, size=(4, 1)).astype(np.float32))
            for _ in range(n)]


BACKENDS = [pytest.param("native", id="native"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
            pytest.param("webgpu", id="webgpu", marks=pytest.mark.webgpu)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule,minibatch_size", [("adam", 2), ("momentum", 1)])
def test_a_restored_solver_continues_bit_exactly(backend, rule, minibatch_size):
    be = backend_or_skip(backend)
    batches = _batches(10)
    original = _solver(be, rule, minibatch_size)
    for x, y in batches[:5]:  # with minibatch_size 2, one call is pending here
        original.train_minibatch(x, y)
    original.trainer_state = {"epoch": 1, "batch": 5}
    state, weights = original.snapshot(), original.network.named_weights()
    assert state["iteration"] == 5 // minibatch_size and state["pending_calls"] == 5 % minibatch_size
    assert set(state["history"]) == set(weights)
    assert state["random"] and state["trainer_state"] == {"epoch": 1, "batch": 5}

    fresh = _solver(be, rule, minibatch_size)
    fresh.network.load_weights(weights)
    fresh.restore(state)
    assert fresh.iteration == original.iteration and fresh.trainer_state == original.trainer_state
    for x, y in batches[5:]:
        a = original.train_minibatch(x, y).to_numpy()
        b = fresh.train_minibatch(x, y).to_numpy()
        np.testing.assert_array_equal(a, b)  # bit-exact resume is promised
    for name, w in original.network.named_weights().items():
        np.testing.assert_array_equal(fresh.network.named_weights()[name], w)


def test_snapshot_is_plain_values_and_a_copy(native):
    solver = _solver(native, "adam", 2)
    x, y = _batches(1)[0]
    solver.train_minibatch(x, y)
    state = solver.snapshot()
    assert set(state) == {"iteration", "pending_calls", "history", "accumulated", "random", "trainer_state",
                          "loss_scale"}
    assert type(state["iteration"]) is int and type(state["pending_calls"]) is int
    assert set(state["history"]["fc1/weight"]) == {"m", "v"}  # Adam's two moments
    for per_weight in state["history"].values():
        assert all(isinstance(a, np.ndarray) for a in per_weight.values())
    assert set(state["accumulated"]) == set(solver.network.named_weights())
    state["accumulated"]["fc1/weight"][...] = 123.0
    assert not np.any(solver.snapshot()["accumulated"]["fc1/weight"] == 123.0)


def test_restore_names_what_does_not_fit(native, tmp_path):
    solver = _solver(native, "adam", 2)
    x, y = _batches(1)[0]
    solver.train_minibatch(x, y)
    state = solver.snapshot()
    names = list(state["history"]["fc1/weight"])
    fresh = _solver(native, "adam", 2)
    bad = {**state, "history": {**state["history"], "fc1/weight": {names[0]: np.zeros((3, 3))}}}
    with pytest.raises(lp.ConfigError, match=f"history of 'fc1/weight' is missing '{names[1]}'"):
        fresh.restore(bad)
    bad["history"]["fc1/weight"] = {n: np.zeros((3, 3)) for n in names}
    with pytest.raises(lp.ShapeError, match=rf"history of 'fc1/weight' '{names[0]}' has shape \(3, 3\), expected "
                                            r"\(8, 6\)"):
        fresh.restore(bad)
    with pytest.raises(lp.ConfigError, match="accumulated is missing 'fc2/bias'"):
        fresh.restore({**state, "accumulated": {k: v for k, v in state["accumulated"].items() if k != "fc2/bias"}})
    with pytest.raises(lp.ConfigError, match="history has 'nope/weight'"):
        fresh.restore({**state, "history": {**state["history"], "nope/weight": {}}})
    with pytest.raises(lp.ConfigError, match="missing: trainer_state"):
        fresh.restore({k: v for k, v in state.items() if k != "trainer_state"})
    with pytest.raises(lp.ConfigError, match=r"3 gradient-accumulation calls pending.*minibatch_size \(2\)"):
        fresh.restore({**state, "pending_calls": 3})
    # what a checkpoint could not hold or continue from: refused here, not when the checkpoint is written or read
    nan = {**state, "history": {**state["history"], "fc1/weight": {n: np.full((8, 6), np.nan) for n in names}}}
    with pytest.raises(lp.ConfigError, match="history holds non-finite values"):
        fresh.restore(nan)
    for trainer_state, words in (({"epoch": -1}, "epoch is -1, expected a count"),
                                 ({"loss_sum": float("nan")}, "not JSON values"),
                                 ({"correct": 5, "scored": 2}, "5 correct predictions of 2 scored"),
                                 ({"mine": object()}, "not JSON values")):
        with pytest.raises(lp.ConfigError, match=words):
            fresh.restore({**state, "trainer_state": trainer_state})
    assert fresh.iteration == 0 and fresh.snapshot()["pending_calls"] == 0  # nothing was set
    # NumPy numbers a callback put there are JSON's numbers in the checkpoint, read back as such
    fresh.restore({**state, "trainer_state": {"epoch": np.int64(3), "loss_sum": np.float32(1.5), "mine": [1, 2]}})
    assert fresh.trainer_state == {"epoch": 3, "loss_sum": 1.5, "mine": [1, 2]}
    solver.trainer_state["sample"] = np.int32(7)
    path = str(tmp_path / "c.leaf")
    solver.save_checkpoint(path)
    assert lp.Solver.load_checkpoint(native, native, path).trainer_state["sample"] == 7
    solver.trainer_state["sample"] = -7
    with pytest.raises(lp.ConfigError, match="sample is -7"):
        solver.save_checkpoint(path)
    assert lp.Solver.load_checkpoint(native, native, path).trainer_state["sample"] == 7  # the good file kept


def test_a_rule_without_state_checkpoints_and_resumes(native, tmp_path, monkeypatch):
    """A rule whose state_names is empty stores no history; its checkpoint still loads and resumes exactly."""
    from leafpy.solvers import UpdateRule, registry, update_rules

    class PlainSGD(UpdateRule):
        name = "plain_sgd_for_test"

        def update(self, backend, w, g, state, rate, lr_mult):
            host = np.empty(2, np.float32)
            backend.download(rate, host)  # [the step's rate, apply] (native: no replay)
            backend.axpby(-float(host[0]) * lr_mult, g, 1.0, w)  # w -= rate * g

    update_rules()  # every real rule registered first
    monkeypatch.setitem(registry._RULES, PlainSGD.name, PlainSGD)
    batches = _batches(6)
    original = _solver(native, PlainSGD.name, 1)
    for x, y in batches[:3]:
        original.train_minibatch(x, y)
    assert original.snapshot()["history"] == {n: {} for n in original.network.named_weights()}
    original.save_checkpoint(str(tmp_path / "c.leaf"))
    resumed = lp.Solver.load_checkpoint(native, native, str(tmp_path / "c.leaf"))
    for x, y in batches[3:]:
        np.testing.assert_array_equal(original.train_minibatch(x, y).to_numpy(),
                                      resumed.train_minibatch(x, y).to_numpy())


def test_a_leaf_name_shared_by_layers_in_different_containers_is_refused():
    """Leaf named weights "{layer}-{i}": two blocks holding a layer "fc" both have "fc-0"; loading by that name must
    say so instead of filling one block and leaving the other."""
    be = lp.backend("native")
    outer = lp.SequentialConfig(inputs=[("data", [2, 3])])
    for block in ("b1", "b2"):
        inner = lp.SequentialConfig(inputs=[("x", [2, 3])])
        inner.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
        outer.add_layer(lp.LayerConfig(block, inner))
    net = lp.Layer.from_config(be, lp.LayerConfig("net", outer))
    net.forward([np.zeros((2, 3), np.float32)])
    with pytest.raises(lp.ConfigError, match=r"'fc-0' is Leaf's name of several weights here \(b1/fc/weight, "
                                             r"b2/fc/weight"):
        net.load_weights({"fc-0": np.zeros((3, 3)), "fc-1": np.zeros(3)}, strict=False)
