"""Sequence layers: Embedding, LSTM, RNN and the per-time-step Linear, against float64 NumPy references written
out here (PyTorch's formulas, unrolled step by step), by central differences, on the device backends against
native, in YAML and model files, and the shipped digits_lstm.yaml trained through the leafpy command."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import backend_or_skip, child_env
from gradcheck import check_layer_gradients
from test_backends import close, device  # noqa: F401  (device: the cuda and webgpu fixture)

import leafpy as lp


def sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def lstm_reference(x, w_ih, w_hh, b, dout, return_sequences):
    """PyTorch's LSTM (gates i, f, g, o; one bias standing for b_ih + b_hh) forward and backward through time, one
    step at a time: (output, dL/dx, [dL/dw_ih, dL/dw_hh, dL/db]) for dL/doutput = dout."""
    n, steps, _ = x.shape
    hs = w_hh.shape[1]
    h, c = np.zeros((n, hs)), np.zeros((n, hs))
    saved, outs = [], []
    for t in range(steps):
        a = x[:, t] @ w_ih.T + h @ w_hh.T + b
        i, f, g, o = sigmoid(a[:, :hs]), sigmoid(a[:, hs:2 * hs]), np.tanh(a[:, 2 * hs:3 * hs]), sigmoid(a[:, 3 * hs:])
        saved.append((h, c, i, f, g, o))
        c = f * c + i * g
        h = o * np.tanh(c)
        outs.append(h)
    y = np.stack(outs, axis=1) if return_sequences else h
    dw_ih, dw_hh, db, dx = np.zeros_like(w_ih), np.zeros_like(w_hh), np.zeros_like(b), np.zeros_like(x)
    dh_next, dc_next = np.zeros((n, hs)), np.zeros((n, hs))
    for t in reversed(range(steps)):
        h_prev, c_prev, i, f, g, o = saved[t]
        c_t = f * c_prev + i * g
        dh = dh_next + (dout[:, t] if return_sequences else (dout if t == steps - 1 else 0.0))
        tc = np.tanh(c_t)
        dc = dc_next + dh * o * (1 - tc ** 2)
        da = np.concatenate([dc * g * i * (1 - i), dc * c_prev * f * (1 - f), dc * i * (1 - g ** 2),
                             dh * tc * o * (1 - o)], axis=1)
        dw_ih += da.T @ x[:, t]
        dw_hh += da.T @ h_prev
        db += da.sum(axis=0)
        dx[:, t] = da @ w_ih
        dh_next, dc_next = da @ w_hh, dc * f
    return y, dx, [dw_ih, dw_hh, db]


def rnn_reference(x, w_ih, w_hh, b, dout, return_sequences):
    """A tanh RNN (h_t = tanh(x_t W_ihᵀ + h_{t-1} W_hhᵀ + b)) forward and backward, one step at a time."""
    n, steps, _ = x.shape
    hs = w_hh.shape[1]
    h = np.zeros((n, hs))
    hist = [h]
    for t in range(steps):
        h = np.tanh(x[:, t] @ w_ih.T + h @ w_hh.T + b)
        hist.append(h)
    y = np.stack(hist[1:], axis=1) if return_sequences else h
    dw_ih, dw_hh, db, dx = np.zeros_like(w_ih), np.zeros_like(w_hh), np.zeros_like(b), np.zeros_like(x)
    dh_next = np.zeros((n, hs))
    for t in reversed(range(steps)):
        dh = dh_next + (dout[:, t] if return_sequences else (dout if t == steps - 1 else 0.0))
        da = dh * (1 - hist[t + 1] ** 2)
        dw_ih += da.T @ x[:, t]
        dw_hh += da.T @ hist[t]
        db += da.sum(axis=0)
        dx[:, t] = da @ w_ih
        dh_next = da @ w_hh
    return y, dx, [dw_ih, dw_hh, db]


def gru_reference(x, w_ih, w_hh, b_ih, b_hh, dout, return_sequences):
    """PyTorch's GRU (gates r, z, n; the reset gate multiplies W_hn h + b_hn) forward and backward, one step at a
    time: (output, dL/dx, [dL/dw_ih, dL/dw_hh, dL/db_ih, dL/db_hh])."""
    n, steps, _ = x.shape
    hs = w_hh.shape[1]
    h = np.zeros((n, hs))
    saved, outs = [], []
    for t in range(steps):
        a = x[:, t] @ w_ih.T + b_ih
        b = h @ w_hh.T + b_hh
        r = sigmoid(a[:, :hs] + b[:, :hs])
        z = sigmoid(a[:, hs:2 * hs] + b[:, hs:2 * hs])
        g = np.tanh(a[:, 2 * hs:] + r * b[:, 2 * hs:])
        saved.append((h, r, z, g, b[:, 2 * hs:]))
        h = (1 - z) * g + z * h
        outs.append(h)
    y = np.stack(outs, axis=1) if return_sequences else h
    grads = [np.zeros_like(w) for w in (w_ih, w_hh, b_ih, b_hh)]
    dx = np.zeros_like(x)
    dh_next = np.zeros((n, hs))
    for t in reversed(range(steps)):
        h_prev, r, z, g, bn = saved[t]
        dh = dh_next + (dout[:, t] if return_sequences else (dout if t == steps - 1 else 0.0))
        dg = dh * (1 - z) * (1 - g ** 2)
        dz = dh * (h_prev - g) * z * (1 - z)
        dr = dg * bn * r * (1 - r)
        da = np.concatenate([dr, dz, dg], axis=1)
        db = np.concatenate([dr, dz, dg * r], axis=1)
        grads[0] += da.T @ x[:, t]
        grads[1] += db.T @ h_prev
        grads[2] += da.sum(axis=0)
        grads[3] += db.sum(axis=0)
        dx[:, t] = da @ w_ih
        dh_next = db @ w_hh + dh * z
    return y, dx, grads


RECURRENT = [pytest.param(lp.LSTMConfig, lstm_reference, 4, id="LSTM"),
             pytest.param(lp.GRUConfig, gru_reference, 3, id="GRU"),
             pytest.param(lp.RNNConfig, rnn_reference, 1, id="RNN")]


@pytest.mark.parametrize("config_class,reference,gates", RECURRENT)
@pytest.mark.parametrize("return_sequences", [True, False])
def test_recurrent_layer_matches_the_unrolled_reference(native64, config_class, reference, gates, return_sequences):
    n, steps, d, hs = 3, 5, 4, 6
    rng = np.random.default_rng(0)
    layer = lp.Layer.from_config(native64, lp.LayerConfig("rec", config_class(
        hidden_size=hs, return_sequences=return_sequences)))
    x = rng.standard_normal((n, steps, d))
    layer.forward([x])  # weights are made for the first input's shape
    biases = ["rec/bias_ih", "rec/bias_hh"] if gates == 3 else ["rec/bias"]
    assert layer.learnable_weights_names() == ["rec/weight_ih", "rec/weight_hh", *biases]
    assert [w.shape for w in layer.learnable_weights_data()] == [(gates * hs, d), (gates * hs, hs)] + \
        [(gates * hs,)] * len(biases)
    weights = [rng.standard_normal(w.shape) * 0.6 for w in layer.learnable_weights_data()]
    for w, v in zip(layer.learnable_weights_data(), weights):
        w.set(v)
    dout = rng.standard_normal((n, steps, hs) if return_sequences else (n, hs))
    y = layer.forward([x])[0].to_numpy()
    dx = layer.backward([dout])[0].to_numpy()
    y_ref, dx_ref, g_ref = reference(x, *weights, dout, return_sequences)
    np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-10, atol=1e-12)
    for name, g, ref in zip(layer.learnable_weights_names(), layer.learnable_weights_gradients(), g_ref):
        np.testing.assert_allclose(g.to_numpy(), ref, rtol=1e-10, atol=1e-12, err_msg=name)
    # a second pass at another batch size and with other weights: nothing of the first remains
    weights = [w * -0.5 for w in weights]
    for w, v in zip(layer.learnable_weights_data(), weights):
        w.set(v)
    x = rng.standard_normal((2, steps, d))
    dout = dout[:2]
    y_ref, dx_ref, g_ref = reference(x, *weights, dout, return_sequences)
    np.testing.assert_allclose(layer.forward([x])[0].to_numpy(), y_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(layer.backward([dout])[0].to_numpy(), dx_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(layer.learnable_weights_gradients()[1].to_numpy(), g_ref[1], rtol=1e-10, atol=1e-12)


def embedding_reference(ids, table, dout):
    """Row lookup, and the table's gradient as a sum over positions written as a loop."""
    y = np.stack([table[int(i)] for i in ids.reshape(-1)]).reshape(*ids.shape, table.shape[1])
    g = np.zeros_like(table)
    for i, d in zip(ids.reshape(-1), dout.reshape(-1, table.shape[1])):
        g[int(i)] += d
    return y, g


def test_embedding_looks_up_rows_and_sums_the_gradients_of_repeated_ids(native64):
    layer = lp.Layer.from_config(native64, lp.LayerConfig("emb", lp.EmbeddingConfig(input_dim=6, output_dim=3)))
    ids = np.array([[1, 4, 1, 1], [0, 5, 4, 1]], dtype=np.float64)  # 1 four times, 4 twice, 2 and 3 never
    layer.forward([ids])
    table = layer.learnable_weights_data()[0].to_numpy()
    dout = np.random.default_rng(1).standard_normal((2, 4, 3))
    y = layer.forward([ids])[0].to_numpy()
    grads = layer.backward([dout])
    y_ref, g_ref = embedding_reference(ids, table, dout)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12)
    assert grads == [None]  # ids take no gradient
    g = layer.learnable_weights_gradients()[0].to_numpy()
    np.testing.assert_allclose(g, g_ref, rtol=1e-12)
    assert np.all(g[[2, 3]] == 0)
    # ids [N] give [N, D]
    np.testing.assert_allclose(layer.forward([np.array([5.0, 0.0])])[0].to_numpy(), table[[5, 0]], rtol=1e-12)


@pytest.mark.parametrize("bad", [6.0, -1.0, 2.5, np.nan])
def test_embedding_refuses_ids_out_of_range(native, bad):
    layer = lp.Layer.from_config(native, lp.LayerConfig("emb", lp.EmbeddingConfig(input_dim=6, output_dim=2)))
    with pytest.raises(lp.ShapeError, match=r"layer 'emb' \(Embedding\): the id at sample 0, "
                                             r"position 2 of the batch is .*integers in \[0, 5\]"):
        layer.forward([np.array([[0.0, 3.0, bad]])])


def _embedding_solver(be):
    net = lp.SequentialConfig(inputs=[("ids", [2, 3])])
    net.add_layer(lp.LayerConfig("emb", lp.EmbeddingConfig(input_dim=10, output_dim=3)))
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    net.add_layer(lp.LayerConfig("lsm", "LogSoftmax"))
    model = lp.Layer.from_config(be, lp.LayerConfig("m", net)).network
    obj = lp.SequentialConfig(inputs=[("out", [2, 2]), ("label", [2, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=2)))
    loss = lp.Layer.from_config(be, lp.LayerConfig("loss", obj)).network
    return lp.Solver(model, loss, lp.SolverConfig(solver="momentum", base_lr=0.1, momentum=0.0))


@pytest.mark.parametrize("bad", [10.0, -1.0, 2.5])
def test_a_replayed_training_step_still_refuses_ids_out_of_range(bad):
    """From its third call a training step is replayed (no layer's forward runs): the batch's ids are still checked
    before the step, and the weights are left as they were."""
    be = lp.backend("native")
    assert be.replay
    solver = _embedding_solver(be)
    good, labels = np.array([[1, 2, 3], [4, 5, 6]], np.float32), np.array([[0], [1]])
    for _ in range(4):
        solver.train_minibatch(good, labels)
    assert be.replays > 0
    before = [w.to_numpy().copy() for w in solver.network.learnable_weights_data()]
    ids = good.copy()
    ids[1, 2] = bad
    with pytest.raises(lp.ShapeError, match=r"layer 'emb' \(Embedding\): the id at sample 1, "
                                             r"position 2 of the batch is .*integers in \[0, 9\]"):
        solver.train_minibatch(ids, labels)
    for b, w in zip(before, solver.network.learnable_weights_data()):
        np.testing.assert_array_equal(w.to_numpy(), b)
    solver.train_minibatch(good, labels)  # and training goes on with good ids


def _clamps(be):
    """Ids that only a device holds are not read back per step: out of range they read and write the nearest
    row, never outside the table."""
    rng = np.random.default_rng(2)
    table = rng.standard_normal((4, 3)).astype(np.float32)
    ids = np.array([-3.0, 0.0, 9.0, 2.0, 3.0, 7.0], np.float32)
    dy = rng.standard_normal((6, 3)).astype(np.float32)
    clamped = np.clip(ids, 0, 3)
    y_ref, g_ref = embedding_reference(clamped, table.astype(np.float64), dy.astype(np.float64))
    t_ids, t_table = lp.SharedTensor.from_numpy(ids), lp.SharedTensor.from_numpy(table)
    out = lp.SharedTensor((6, 3))
    be.embedding(t_ids.read(be), t_table.read(be), out.write(be))
    close(out.to_numpy(), y_ref, f"{be.name} lookup")
    g = lp.SharedTensor.from_numpy(np.ones((4, 3), np.float32))
    be.embedding_grad(t_ids.read(be), lp.SharedTensor.from_numpy(dy).read(be), g.read_write(be), 0.5)
    close(g.to_numpy(), g_ref + 0.5, f"{be.name} gradient (beta 0.5 keeps half of the ones)")


def test_embedding_clamps_ids_it_cannot_check(native):
    _clamps(native)


def test_embedding_clamps_ids_on_the_device(device):  # noqa: F811
    _clamps(device)


def sequence_model(force_backward: bool = False, batch: int = 3) -> lp.SequentialConfig:
    """ids [N, 5] -> Embedding -> LSTM -> RNN -> Linear per step -> GRU (all every step) -> LSTM (last step)."""
    cfg = lp.SequentialConfig(inputs=[("ids", [batch, 5])], force_backward=force_backward)
    cfg.add_layer(lp.LayerConfig("emb", lp.EmbeddingConfig(input_dim=7, output_dim=4)))
    cfg.add_layer(lp.LayerConfig("lstm1", lp.LSTMConfig(hidden_size=5)))
    cfg.add_layer(lp.LayerConfig("rnn", lp.RNNConfig(hidden_size=4)))
    cfg.add_layer(lp.LayerConfig("step_fc", lp.LinearConfig(output_size=3, axis=-1)))
    cfg.add_layer(lp.LayerConfig("gru", lp.GRUConfig(hidden_size=3)))
    cfg.add_layer(lp.LayerConfig("lstm2", lp.LSTMConfig(hidden_size=2, return_sequences=False)))
    return cfg


def test_sequence_network_gradient_check(native64):
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", sequence_model(force_backward=True)), seed=3)
    ids = np.random.default_rng(4).integers(0, 7, (3, 5)).astype(np.float64)
    checked = check_layer_gradients(net, [ids])
    assert checked == sum(w.size for w in net.learnable_weights_data())  # every weight; the ids take none
    assert net.backward([np.ones((3, 2))]) == [None]  # even with force_backward


def test_per_step_linear_is_linear_at_every_step(native64):
    layer = lp.Layer.from_config(native64, lp.LayerConfig("fc", lp.LinearConfig(output_size=3, axis=-1)))
    x = np.random.default_rng(5).standard_normal((2, 4, 5))
    y = layer.forward([x])[0].to_numpy()
    w, b = (t.to_numpy() for t in layer.learnable_weights_data())
    assert w.shape == (3, 5)
    assert y.shape == (2, 4, 3)
    for t in range(4):
        np.testing.assert_allclose(y[:, t], x[:, t] @ w.T + b, rtol=1e-12)
    dout = np.random.default_rng(6).standard_normal((2, 4, 3))
    np.testing.assert_allclose(layer.backward([dout])[0].to_numpy(), dout @ w, rtol=1e-12)
    np.testing.assert_allclose(layer.learnable_weights_gradients()[0].to_numpy(),
                               sum(dout[:, t].T @ x[:, t] for t in range(4)), rtol=1e-12)
    # axis 2 of a 4-D input keeps [N, A] and flattens the rest
    layer = lp.Layer.from_config(native64, lp.LayerConfig("fc", lp.LinearConfig(output_size=2, axis=2)))
    assert layer.forward([np.zeros((2, 3, 4, 5))])[0].shape == (2, 3, 2)
    assert layer.learnable_weights_data()[0].shape == (2, 20)


def test_bad_sequence_settings_are_reported(native):
    with pytest.raises(lp.ConfigError, match=r"LSTMConfig\.hidden_size: expected a positive integer, got 0"):
        lp.LSTMConfig(hidden_size=0)
    with pytest.raises(lp.ConfigError, match=r"RNNConfig\.return_sequences: expected true"):
        lp.RNNConfig(hidden_size=2, return_sequences="yes")
    with pytest.raises(lp.ConfigError, match=r"EmbeddingConfig\.input_dim: at most 16777216 ids"):
        lp.EmbeddingConfig(input_dim=2**25, output_dim=2)
    with pytest.raises(lp.ConfigError, match=r"LinearConfig\.axis: .*not 0"):
        lp.LinearConfig(output_size=2, axis=0)
    lstm = lp.Layer.from_config(native, lp.LayerConfig("lstm", lp.LSTMConfig(hidden_size=2)))
    with pytest.raises(lp.ShapeError, match=r"layer 'lstm' \(LSTM\): expected a batch-first sequence \[N, T, "
                                            r"input_size\], got \(4, 8\)"):
        lstm.forward([np.zeros((4, 8))])
    emb = lp.Layer.from_config(native, lp.LayerConfig("emb", lp.EmbeddingConfig(input_dim=3, output_dim=2)))
    with pytest.raises(lp.ShapeError, match=r"expected ids of shape \[N\] or \[N, T\], got \(2, 3, 4\)"):
        emb.forward([np.zeros((2, 3, 4))])
    fc = lp.Layer.from_config(native, lp.LayerConfig("fc", lp.LinearConfig(output_size=2, axis=3)))
    with pytest.raises(lp.ShapeError, match=r"layer 'fc' \(Linear\): axis 3 does not leave"):
        fc.forward([np.zeros((2, 3, 4))])


SEQUENCE_YAML = """
name: sequences
network:
  type: Sequential
  inputs: [{name: ids, shape: [2, 6]}]
  layers:
    - {name: emb, type: Embedding, input_dim: 9, output_dim: 4}
    - {name: lstm, type: LSTM, hidden_size: 5}
    - {name: drop, type: Dropout, ratio: 0.2}
    - {name: gru, type: GRU, hidden_size: 4}
    - {name: rnn, type: RNN, hidden_size: 3, return_sequences: false}
    - {name: fc, type: Linear, output_size: 2, axis: -1}
objective:
  type: Sequential
  inputs: [{name: out, shape: [2, 2]}, {name: target, shape: [2, 2]}]
  layers: [{name: mse, type: MeanSquaredError}]
solver: {solver: adam, base_lr: 0.01}
"""


def test_sequence_layers_in_yaml_and_model_files(tmp_path, native):
    run = lp.config.loads(SEQUENCE_YAML)
    layers = {lc.name: lc for lc in run.network.config.layers}
    assert layers["emb"].config == lp.EmbeddingConfig(input_dim=9, output_dim=4)
    assert layers["lstm"].config == lp.LSTMConfig(hidden_size=5, return_sequences=True)
    assert layers["rnn"].config == lp.RNNConfig(hidden_size=3, return_sequences=False)
    assert layers["gru"].config == lp.GRUConfig(hidden_size=4) != lp.LSTMConfig(hidden_size=4)
    assert layers["fc"].config == lp.LinearConfig(output_size=2, axis=-1)
    assert lp.config.loads(lp.config.dumps(run)) == run
    net = lp.Layer.from_config(native, run.network, seed=1)
    net.set_training(False)
    ids = np.array([[0, 8, 3, 3, 1, 2], [7, 7, 7, 0, 4, 5]], np.float32)
    y = net.forward([ids])[0].to_numpy()
    net.save(tmp_path / "seq.leaf")
    loaded = lp.Layer.load(native, tmp_path / "seq.leaf")
    assert loaded.config == run.network
    loaded.set_training(False)
    np.testing.assert_array_equal(loaded.forward([ids])[0].to_numpy(), y)


def test_sequence_network_matches_native(device):  # noqa: F811
    results = []
    for be in (lp.backend("native"), device):
        net = lp.Layer.from_config(be, lp.LayerConfig("net", sequence_model()), seed=8)
        run = []
        for batch in (3, 2):  # the declared batch and another: workspaces are sized again
            ids = np.random.default_rng(batch).integers(0, 7, (batch, 5)).astype(np.float32)
            y = net.forward([ids])[0].to_numpy()
            net.backward([np.random.default_rng(10 + batch).standard_normal(y.shape).astype(np.float32)])
            run.append([y] + [g.to_numpy() for g in net.learnable_weights_gradients()])
        results.append(run)
    names = ["output"] + [f"{n} gradient" for n in net.learnable_weights_names()]
    for a_run, b_run in zip(*results):
        for what, a, b in zip(names, a_run, b_run):
            close(b, a, what)


def _lstm_solver(backend):
    run = lp.config.load(os.path.join(os.path.dirname(__file__), "..", "configs", "digits_lstm.yaml"))
    cfg = dataclasses.replace(run.solver, solver="momentum", base_lr=0.05, momentum=0.9)
    return lp.Solver.from_config(backend, backend, cfg)


def test_lstm_training_steps_replay_and_match_native(device):  # noqa: F811
    """Six steps of digits_lstm.yaml's network: on cuda the steps are recorded as a CUDA graph and replayed, on
    webgpu re-encoded from their recording, with no transfer inside a step; both end where native does."""
    ds = lp.data.digits()
    x = lp.SharedTensor.from_numpy(ds.x_train[:32])
    y = lp.SharedTensor.from_numpy(ds.y_train[:32].astype(np.float32))
    solvers = [_lstm_solver(be) for be in (lp.backend("native"), device)]
    replays = device.recorder.replays
    for s in solvers:
        s.train_minibatch(x, y)  # uploads the batch once
    device.synchronize()
    lp.SharedTensor.reset_transfer_count()
    for _ in range(5):
        solvers[1].train_minibatch(x, y)
    device.synchronize()
    assert lp.SharedTensor.transfers_total == 0  # nothing read back or sent inside the steps
    for _ in range(5):
        solvers[0].train_minibatch(x, y)
    recorded = [e for e in device.recorder.steps.values() if e.recording is not None]
    assert recorded, f"no step was recorded: {getattr(device, 'record_error', None)}"
    assert device.recorder.replays - replays >= 3  # steps from the third on replay the recording
    assert solvers[0].loss() == pytest.approx(solvers[1].loss(), rel=1e-3)
    for a, b in zip(*(s.network.learnable_weights_data() for s in solvers)):
        close(b.to_numpy(), a.to_numpy(), "weights after 6 steps", rtol=1e-3, atol=1e-4)


def test_lstm_run_file_trains_to_95_percent(tmp_path):
    """configs/digits_lstm.yaml (the digits as 8 rows of 8 pixels) through the leafpy command."""
    from test_cli import ROOT, accuracy

    def run(*args: str) -> subprocess.CompletedProcess:
        env = child_env()
        return subprocess.run([sys.executable, "-m", "leafpy.cli", *args], capture_output=True, text=True,
                              timeout=300, cwd=ROOT, env=env)

    p = run("train", str(ROOT / "configs" / "digits_lstm.yaml"), "--out", str(tmp_path / "run"))
    assert p.returncode == 0, p.stderr
    acc = accuracy(p.stdout)
    assert acc >= 0.95
    e = run("evaluate", str(tmp_path / "run"))
    assert e.returncode == 0, e.stderr
    assert accuracy(e.stdout) == pytest.approx(acc)
    net = lp.Layer.load(lp.backend("native"), str(tmp_path / "run" / "model.leaf"))
    assert [lc.type for lc in net.config.config.layers] == ["Reshape", "LSTM", "Linear", "LogSoftmax"]


def test_leafpy_train_refuses_one_bad_id_in_a_late_batch(tmp_path):
    """Token ids from a file with one id past input_dim in a single sample, which lands in a step that is replayed:
    `leafpy train` stops with the Embedding's error rather than training on the nearest row."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 30, (400, 7)).astype(np.float32)
    y = (x[:, 0] % 3).astype(np.int64)
    x[377, 3] = 35  # (with data seed 0 a training sample that comes after the first two steps: replayed ones)
    np.savez(tmp_path / "tokens.npz", x=x, y=y)
    (tmp_path / "run.yaml").write_text("""name: tokens
data: {dataset: npz, path: tokens.npz, batch_size: 16, test_fraction: 0.2, seed: 0}
train: {epochs: 1}
network:
  type: Sequential
  inputs: [{name: ids, shape: [null, 7]}]
  layers:
    - {name: emb, type: Embedding, input_dim: 30, output_dim: 8}
    - {name: fc, type: Linear, output_size: 3, axis: 1}
    - {name: logsm, type: LogSoftmax}
objective: nll
solver: {solver: adam, base_lr: 0.01}
""")
    p = subprocess.run([sys.executable, "-m", "leafpy.cli", "train", str(tmp_path / "run.yaml"), "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=child_env())
    assert p.returncode != 0
    assert "layer 'emb' (Embedding): the id at sample" in p.stderr
    assert ", position 3 of the batch is 35.0; ids must be integers in [0, 29]" in p.stderr
    assert "Traceback" not in p.stderr


def test_lstm_benchmark_runs_small_on_native(tmp_path):
    """benchmarks/lstm.py still runs (a smoke test, not a timing; without PyTorch)."""
    from test_cli import ROOT

    out = tmp_path / "rows.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lstm.py"), "--backend", "native", "--vs", "none",
                        "--small", "--n", "1", "--rounds", "1", "--warmup", "0", "--settle", "0", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    import json

    row = json.loads(out.read_text())["rows"][0]
    assert row["leafpy_ms"] > 0 and "torch_ms" not in row
    assert 1.5 < row["leafpy_loss10"] < 3.0  # ten steps from random weights on random data: near ln(10)
    assert "lstm2x64" in p.stdout


def test_a_nested_network_starting_with_an_embedding_takes_no_input_gradient(native64):
    inner = lp.SequentialConfig(inputs=[("ids", [2, 3])])
    inner.add_layer(lp.LayerConfig("emb", lp.EmbeddingConfig(input_dim=4, output_dim=2)))
    inner.add_layer(lp.LayerConfig("rnn", lp.RNNConfig(hidden_size=2, return_sequences=False)))
    outer = lp.SequentialConfig(inputs=[("data", [2, 3])], force_backward=True)
    outer.add_layer(lp.LayerConfig("block", inner))
    outer.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=1)))
    net = lp.Layer.from_config(native64, lp.LayerConfig("net", outer))
    net.forward([np.array([[0.0, 1.0, 3.0], [2.0, 2.0, 0.0]])])
    assert net.backward([np.ones((2, 1))]) == [None]
    assert all(np.isfinite(g.to_numpy()).all() for g in net.learnable_weights_gradients())


def _small_binding_webgpu(monkeypatch, limit: int):
    """The webgpu backend believing its storage-binding limit is ``limit`` bytes (restored after the test)."""

    be = backend_or_skip("webgpu", power_preference="low-power")  # a separate instance whose limit we can lower
    monkeypatch.setattr(be, "max_binding", limit)
    return be


@pytest.mark.webgpu
def test_webgpu_embedding_table_over_the_binding_limit(monkeypatch):
    """A table of 50 x 8 (1600 bytes) under a 512-byte limit is bound in windows of rows and the 45 positions
    (1440 bytes of output) in runs; ids hit every window, some repeatedly."""
    be = _small_binding_webgpu(monkeypatch, 512)
    layer = lp.Layer.from_config(be, lp.LayerConfig("emb", lp.EmbeddingConfig(input_dim=50, output_dim=8)))
    rng = np.random.default_rng(5)
    ids = np.concatenate([np.arange(50)[::-3], rng.integers(0, 50, 25), [49, 49, 0]]).astype(np.float32)
    ids = ids.reshape(5, 9)
    table = rng.standard_normal((50, 8)).astype(np.float32)
    layer.forward([ids])
    layer.learnable_weights_data()[0].set(table)
    assert table.nbytes > be.max_binding and ids.size * 8 * 4 > be.max_binding
    dout = rng.standard_normal((5, 9, 8)).astype(np.float32)
    y = layer.forward([ids])[0].to_numpy()
    layer.backward([dout])
    y_ref, g_ref = embedding_reference(ids, table.astype(np.float64), dout.astype(np.float64))
    close(y, y_ref, "lookup")
    close(layer.learnable_weights_gradients()[0].to_numpy(), g_ref, "table gradient")


@pytest.mark.webgpu
@pytest.mark.parametrize("config_class,reference,gates", RECURRENT)
@pytest.mark.parametrize("return_sequences", [True, False])
def test_webgpu_recurrent_sequences_over_the_binding_limit(monkeypatch, config_class, reference, gates,
                                                           return_sequences):
    """6 sequences of 12 steps, hidden 8: every [N, T, G·H] workspace (and for G > 1 one sequence of it less than a
    run) exceeds a 2048-byte limit, so cells run over runs of sequences and the weight gradients' products over
    ranges of N·T; forward, input and weight gradients against the float64 reference."""
    be = _small_binding_webgpu(monkeypatch, 2048)
    n, steps, d, hs = 6, 12, 4, 8
    assert 4 * n * steps * hs > be.max_binding
    layer = lp.Layer.from_config(be, lp.LayerConfig("rec", config_class(
        hidden_size=hs, return_sequences=return_sequences)), seed=3)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((n, steps, d)).astype(np.float32)
    layer.forward([x])
    weights = [(rng.standard_normal(w.shape) * 0.5).astype(np.float32) for w in layer.learnable_weights_data()]
    for w, v in zip(layer.learnable_weights_data(), weights):
        w.set(v)
    dout = rng.standard_normal((n, steps, hs) if return_sequences else (n, hs)).astype(np.float32)
    y = layer.forward([x])[0].to_numpy()
    dx = layer.backward([dout])[0].to_numpy()
    y_ref, dx_ref, g_ref = reference(x.astype(np.float64), *(w.astype(np.float64) for w in weights),
                                     dout.astype(np.float64), return_sequences)
    close(y, y_ref, "output")
    close(dx, dx_ref, "input gradient")
    for name, g, ref in zip(layer.learnable_weights_names(), layer.learnable_weights_gradients(), g_ref):
        close(g.to_numpy(), ref, name)


@pytest.mark.webgpu
@pytest.mark.parametrize("m,n,k,ta,tb,beta", [(20, 30, 500, True, False, 0.5), (24, 8, 300, True, True, 0.0),
                                              (10, 40, 200, False, False, 1.0)])
def test_webgpu_products_long_in_k_over_the_binding_limit(monkeypatch, m, n, k, ta, tb, beta):
    """A weight gradient's shape (K = N·T long): a transposed A or an untransposed B past the limit is bound in
    ranges of K whose products add up in C."""
    from test_backends import _gemm_matches_numpy

    be = _small_binding_webgpu(monkeypatch, 4096)
    assert 4 * k * (m if ta else n) > be.max_binding
    _gemm_matches_numpy(be, m, n, k, ta, tb, 1.5, beta, "gemm in ranges of K")


@pytest.mark.webgpu
@pytest.mark.parametrize("config_class,reference,gates", RECURRENT)
@pytest.mark.parametrize("return_sequences", [True, False])
def test_webgpu_cells_sum_split_recurrent_products(monkeypatch, config_class, reference, gates, return_sequences):
    """With split-K forced on the per-step recurrent products (hidden 40, K from 16), the LSTM's and the RNN's cells
    add up the partial products themselves: one dispatch fewer per step after the first, forward and backward,
    than with the products summed on their own (the GRU's cells, with no binding to spare, leave them to the
    sum); every result against the float64 reference."""

    be = backend_or_skip("webgpu", power_preference="low-power")
    for name, value in (("SPLIT_K_FROM", 16), ("SPLIT_K_MIN", 8), ("SPLIT_K_FINE_MIN", 8)):
        monkeypatch.setattr(be, name, value)
    n, steps, d, hs = 3, 5, 4, 40
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, steps, d)).astype(np.float32)
    dout = rng.standard_normal((n, steps, hs) if return_sequences else (n, hs)).astype(np.float32)
    counts = []
    for fuse in (False, True):
        with monkeypatch.context() as m:
            if not fuse:
                m.setattr(be.enc, "take_sum", lambda out: None)
            layer = lp.Layer.from_config(be, lp.LayerConfig("rec", config_class(
                hidden_size=hs, return_sequences=return_sequences)), seed=3)
            layer.forward([x])
            weights = [(np.random.default_rng(8).standard_normal(w.shape) * 0.3).astype(np.float32)
                       for w in layer.learnable_weights_data()]
            for w, v in zip(layer.learnable_weights_data(), weights):
                w.set(v)
            d0 = be.dispatches
            y = layer.forward([x])[0].to_numpy()
            d1 = be.dispatches
            dx = layer.backward([dout])[0].to_numpy()
            counts.append((d1 - d0, be.dispatches - d1))
        y_ref, dx_ref, g_ref = reference(x.astype(np.float64), *(w.astype(np.float64) for w in weights),
                                         dout.astype(np.float64), return_sequences)
        close(y, y_ref, f"output (fused: {fuse})")
        close(dx, dx_ref, f"input gradient (fused: {fuse})")
        for name, g, ref in zip(layer.learnable_weights_names(), layer.learnable_weights_gradients(), g_ref):
            close(g.to_numpy(), ref, f"{name} (fused: {fuse})")
    saved = 0 if gates == 3 else steps - 1
    assert counts[1] == (counts[0][0] - saved, counts[0][1] - saved), counts


@pytest.mark.webgpu
def test_webgpu_replayed_steps_with_cells_summing_split_products_match_native(monkeypatch):
    """Training steps of an LSTM with split-K forced on its per-step products, recorded and replayed on webgpu (the
    cells summing the partials), end where float64 native does."""

    be = backend_or_skip("webgpu", power_preference="low-power")
    for name, value in (("SPLIT_K_FROM", 16), ("SPLIT_K_MIN", 8), ("SPLIT_K_FINE_MIN", 8)):
        monkeypatch.setattr(be, name, value)
    net = lp.SequentialConfig(inputs=[("data", [8, 5, 6])])
    net.add_layer(lp.LayerConfig("lstm", lp.LSTMConfig(hidden_size=40, return_sequences=False)))
    net.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    net.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    obj = lp.SequentialConfig(inputs=[("network_out", [8, 3]), ("label", [8, 1])])
    obj.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=3)))
    cfg = lp.SolverConfig(network=lp.LayerConfig("net", net), objective=lp.LayerConfig("loss", obj),
                          solver="momentum", base_lr=0.1, momentum=0.9, seed=4)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((8, 5, 6)).astype(np.float32)
    labels = rng.integers(0, 3, (8, 1)).astype(np.float32)
    native64 = lp.backend("native", dtype="float64")
    native = lp.Solver.from_config(native64, native64, cfg)
    webgpu = lp.Solver.from_config(be, be, cfg)
    for w, v in zip(webgpu.network.learnable_weights_data(), native.network.learnable_weights_data()):
        w.set(v.to_numpy().astype(np.float32))
    replays = be.recorder.replays
    tx, ty = lp.SharedTensor.from_numpy(x), lp.SharedTensor.from_numpy(labels)
    for _ in range(6):
        native.train_minibatch(x.astype(np.float64), labels.astype(np.float64))
        webgpu.train_minibatch(tx, ty)
        assert webgpu.loss() == pytest.approx(native.loss(), rel=1e-4, abs=1e-5)
    assert be.recorder.replays - replays >= 3
    for a, b in zip(native.network.learnable_weights_data(), webgpu.network.learnable_weights_data()):
        close(b.to_numpy(), a.to_numpy(), "weights after 6 steps", rtol=1e-3, atol=1e-4)


@pytest.mark.webgpu
def test_dispatch_counts_script_counts_a_replayed_lstm_step():
    """benchmarks/dispatch_counts.py on lstm.py's small LSTM: a replayed step of 2 layers x 16 time steps holds at
    least a recurrent product and a cell per time step, layer and direction."""

    backend_or_skip("webgpu")  # skips where webgpu is unavailable
    root = os.path.join(os.path.dirname(__file__), "..")
    p = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "dispatch_counts.py"), "--nets",
                        "lstm-small"], capture_output=True, text=True, timeout=300, cwd=root)
    assert p.returncode == 0, p.stderr
    row = [line.split() for line in p.stdout.splitlines() if line.startswith("lstm-small")]
    assert len(row) == 1 and row[0][2] == "yes", p.stdout
    assert int(row[0][1]) >= 2 * 16 * 4, p.stdout
