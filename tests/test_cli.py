"""The leafpy command end to end, in subprocesses, on the bundled digits data and small generated arrays."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import backend_or_skip, child_env, terminal_signals

import leafpy as lp

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "configs" / "digits_lenet.yaml")


def leafpy_cmd() -> list[str]:
    """The command, run from this checkout (the tests run it with cwd ROOT): an installed ``leafpy`` script would
    import whichever leafpy is installed, which need not be the code under test."""
    return [sys.executable, "-m", "leafpy"]


def run(*args, timeout=300, **kw):
    env = child_env()
    return subprocess.run(leafpy_cmd() + list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env, **kw)


def accuracy(text: str) -> float:
    m = re.search(r"held-out accuracy: ([\d.]+)%", text)
    assert m, text
    return float(m.group(1)) / 100


@pytest.mark.slow
def test_train_the_default_model_end_to_end(tmp_path):
    out = tmp_path / "run"
    p = run("train", DIGITS, "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "epoch 15/15" in p.stdout and "confusion matrix" in p.stdout
    acc = accuracy(p.stdout)
    assert acc >= 0.97
    assert (out / "checkpoint.leaf").exists() and (out / "model.leaf").exists()
    solver = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"), out / "checkpoint.leaf")
    assert solver.iteration == 15 * 45
    e = run("evaluate", DIGITS, "--weights", str(out / "model.leaf"))
    assert e.returncode == 0, e.stderr
    assert accuracy(e.stdout) == pytest.approx(acc)
    e2 = run("evaluate", DIGITS, "--weights", str(out / "checkpoint.leaf"))
    assert e2.returncode == 0 and accuracy(e2.stdout) == pytest.approx(acc)


def test_batch_norm_run_file_trains_and_evaluates_in_inference_mode(tmp_path):
    run_file = str(ROOT / "configs" / "digits_bn.yaml")
    p = run("train", run_file, "--out", str(tmp_path / "run"))
    assert p.returncode == 0, p.stderr
    acc = accuracy(p.stdout)
    assert acc >= 0.98
    # evaluation normalises with the saved running statistics: the same accuracy from the model file
    e = run("evaluate", run_file, "--weights", str(tmp_path / "run" / "model.leaf"))
    assert e.returncode == 0 and accuracy(e.stdout) == pytest.approx(acc)


def test_resume_continues_where_it_stopped(tmp_path):
    out = tmp_path / "run"
    p = run("train", DIGITS, "--out", str(out), "--epochs", "1")
    assert p.returncode == 0, p.stderr
    p2 = run("train", DIGITS, "--out", str(out), "--epochs", "2", "--resume", str(out / "checkpoint.leaf"))
    assert p2.returncode == 0, p2.stderr
    assert "epochs 2..2" in p2.stdout and "epoch 2/2" in p2.stdout and "epoch 1/2" not in p2.stdout
    assert "changed solver settings" not in p2.stdout
    solver = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"), out / "checkpoint.leaf")
    assert solver.iteration == 2 * 45
    # a setting changed on resume is taken, as Caffe takes the solver file's, and said so
    p3 = run("train", DIGITS, "--out", str(out), "--epochs", "3", "--resume", str(out / "checkpoint.leaf"),
             "--set", "solver.base_lr=0.02", "--set", "solver.momentum=0.8")
    assert p3.returncode == 0, p3.stderr
    assert "resumed with changed solver settings: base_lr 0.05 -> 0.02, momentum 0.9 -> 0.8" in p3.stdout
    solver = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"), out / "checkpoint.leaf")
    assert solver.iteration == 3 * 45 and solver.config.base_lr == 0.02 and solver.config.momentum == 0.8
    refused = run("train", DIGITS, "--out", str(out), "--epochs", "4", "--resume", str(out / "checkpoint.leaf"),
                  "--set", "solver.seed=5")  # a setting that may not change: refused, not announced first
    assert refused.returncode == 1 and "solver.seed: the checkpoint" in refused.stderr
    assert "changed solver settings" not in refused.stdout
    other = run("train", str(ROOT / "configs" / "digits_mlp.yaml"), "--out", str(out), "--epochs", "3",
                "--resume", str(out / "checkpoint.leaf"))
    assert other.returncode == 1 and "network differs" in other.stderr


def test_a_run_too_short_for_one_update_says_so(tmp_path):
    """minibatch_size sums more batches per update than the run trains (45 a digits epoch): the run warns before
    training, and one that reaches an update does not."""
    p = run("train", DIGITS, "--out", str(tmp_path / "a"), "--epochs", "1", "--set", "solver.minibatch_size=50")
    assert p.returncode == 0, p.stderr
    assert ("warning: solver.minibatch_size 50 sums the gradients of 50 batches per update, and this run trains 45 "
            "batches (45 an epoch): it will make no update") in p.stdout
    assert lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"),
                                     tmp_path / "a" / "checkpoint.leaf").iteration == 0
    q = run("train", DIGITS, "--out", str(tmp_path / "b"), "--epochs", "2", "--set", "solver.minibatch_size=50")
    assert q.returncode == 0 and "no update" not in q.stdout


def test_a_run_resumed_into_another_directory_keeps_the_epochs_it_trained_before(tmp_path):
    first = run("train", DIGITS, "--out", str(tmp_path / "a"), "--epochs", "2")
    assert first.returncode == 0, first.stderr
    (tmp_path / "b").mkdir()  # another run's files there, replaced with --overwrite: their history is not this run's
    (tmp_path / "b" / "history.json").write_text(json.dumps([{"epoch": k, "loss": 9.0} for k in (1, 2, 3)]))
    (tmp_path / "b" / "run.yaml").write_text("network: {}\n")
    p = run("train", DIGITS, "--out", str(tmp_path / "b"), "--epochs", "3", "--overwrite",
            "--resume", str(tmp_path / "a" / "checkpoint.leaf"))
    assert p.returncode == 0, p.stderr
    a = json.loads((tmp_path / "a" / "history.json").read_text())
    b = json.loads((tmp_path / "b" / "history.json").read_text())
    assert [h["epoch"] for h in b] == [1, 2, 3] and b[:2] == a
    csv_rows = (tmp_path / "b" / "history.csv").read_text().splitlines()
    assert len(csv_rows) == 4 and csv_rows[0].startswith("epoch")
    # with no epoch left to train, the new directory still gets the run's files, which evaluate reads
    c = run("train", DIGITS, "--out", str(tmp_path / "c"), "--epochs", "2", "--resume", str(tmp_path / "a" /
                                                                                             "checkpoint.leaf"))
    assert c.returncode == 0, c.stderr
    assert (tmp_path / "c" / "run.yaml").is_file() and (tmp_path / "c" / "model.leaf").is_file()
    e = run("evaluate", str(tmp_path / "c"))
    assert e.returncode == 0 and accuracy(e.stdout) == accuracy(run("evaluate", str(tmp_path / "a")).stdout)


def test_a_checkpoint_resumed_without_its_history_says_so(tmp_path):
    """A checkpoint copied alone to another directory resumed with no word that the epochs before it had no record
    there, so EarlyStopping and keep_best counted from the resume as if nothing came before (an early-stopped run
    went on five epochs past where the uninterrupted one stopped). The resume says which epochs have no record."""
    import shutil

    first = run("train", DIGITS, "--out", str(tmp_path / "a"), "--epochs", "2")
    assert first.returncode == 0, first.stderr
    (tmp_path / "moved").mkdir()
    shutil.copy(tmp_path / "a" / "checkpoint.leaf", tmp_path / "moved")
    p = run("train", DIGITS, "--out", str(tmp_path / "b"), "--epochs", "3",
            "--resume", str(tmp_path / "moved" / "checkpoint.leaf"))
    assert p.returncode == 0, p.stderr
    assert "moved/history.json is missing: the checkpoint is after epoch 2, and EarlyStopping and keep_best see " \
           "only the epochs recorded" in p.stdout + p.stderr
    history = json.loads((tmp_path / "a" / "history.json").read_text())
    (tmp_path / "moved" / "history.json").write_text(json.dumps(history[1:]))  # epoch 2's record alone
    q = run("train", DIGITS, "--out", str(tmp_path / "c"), "--epochs", "3",
            "--resume", str(tmp_path / "moved" / "checkpoint.leaf"))
    assert q.returncode == 0, q.stderr
    assert "moved/history.json has no record of epoch 1: the checkpoint is after epoch 2" in q.stdout + q.stderr
    shutil.copy(tmp_path / "a" / "history.json", tmp_path / "moved")
    r = run("train", DIGITS, "--out", str(tmp_path / "d"), "--epochs", "3",
            "--resume", str(tmp_path / "moved" / "checkpoint.leaf"))
    assert r.returncode == 0 and "history.json" not in r.stdout + r.stderr


def test_a_run_without_a_solver_seed_records_the_one_it_drew_and_its_run_yaml_trains_it_again(tmp_path):
    text = (ROOT / "configs" / "digits_mlp.yaml").read_text()
    assert ", seed: 0}" in text
    (tmp_path / "noseed.yaml").write_text(text.replace(", seed: 0}", "}"))
    for out in ("a", "b"):
        done = run("train", str(tmp_path / "noseed.yaml"), "--epochs", "1", "--out", str(tmp_path / out))
        assert done.returncode == 0, done.stderr
    seeds = [lp.config.load(str(tmp_path / out / "run.yaml")).solver.seed for out in ("a", "b")]
    assert all(isinstance(s, int) for s in seeds) and seeds[0] != seeds[1]
    assert (tmp_path / "a" / "model.leaf").read_bytes() != (tmp_path / "b" / "model.leaf").read_bytes()
    # resumed from the run file without a seed: run.yaml keeps the drawn one
    resumed = run("train", str(tmp_path / "noseed.yaml"), "--epochs", "2", "--out", str(tmp_path / "b"), "--resume",
                  str(tmp_path / "b" / "checkpoint.leaf"))
    assert resumed.returncode == 0, resumed.stderr
    assert lp.config.load(str(tmp_path / "b" / "run.yaml")).solver.seed == seeds[1]
    again = run("train", str(tmp_path / "a" / "run.yaml"), "--epochs", "1", "--out", str(tmp_path / "again"))
    assert again.returncode == 0, again.stderr
    first, second = (lp.Layer.load(lp.backend("native"), str(tmp_path / d / "model.leaf")) for d in ("a", "again"))
    for w1, w2 in zip(first.learnable_weights_data(), second.learnable_weights_data()):
        np.testing.assert_array_equal(w1.to_numpy(), w2.to_numpy())


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    env = child_env()
    proc = subprocess.Popen(leafpy_cmd() + ["train", DIGITS, "--out", str(out), "--epochs", "500"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=terminal_signals)
    assert proc.stdout is not None
    try:
        deadline = time.time() + 120
        for line in proc.stdout:
            if line.startswith("epoch 1/500"):
                break
            assert time.time() < deadline
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()  # not left training for 500 epochs after a failure
    assert proc.returncode == 130, err
    assert "checkpoint saved to" in rest and "Traceback" not in err
    solver = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"), out / "checkpoint.leaf")
    assert solver.iteration >= 45


def test_diverging_loss_names_iteration_and_layer(tmp_path):
    text = Path(DIGITS).read_text().replace("base_lr: 0.05", "base_lr: 1.0e+12")
    cfg = tmp_path / "diverge.yaml"
    cfg.write_text(text)
    p = run("train", str(cfg), "--out", str(tmp_path / "run"), "--epochs", "2")
    assert p.returncode == 1
    assert re.search(r"the loss became (nan|inf) at iteration \d+; "
                     r"first non-finite output: (layer '\w+'|the objective)",
                     p.stderr), p.stderr
    assert "Traceback" not in p.stderr


def test_summary_and_help():
    p = run("summary", DIGITS)
    assert p.returncode == 0, p.stderr
    assert "conv1" in p.stdout and "32x20x8x8" in p.stdout and "total parameters: 24,550" in p.stdout
    for args in (["--help"], ["train", "--help"], ["evaluate", "--help"], ["predict", "--help"], ["summary", "--help"]):
        h = run(*args)
        assert h.returncode == 0 and "usage: leafpy" in h.stdout
    p = run("summary", DIGITS, "--set", "network.layers.conv1.num_output=8",
            "--set", "network.layers.fc1.output_size=10")
    assert p.returncode == 0 and "32x8x8x8" in p.stdout and "total parameters: 4,720" in p.stdout, p.stdout
    p = run("summary", DIGITS, "--set", "network.layers.conv9.num_output=8")
    assert p.returncode == 1 and "no entry named 'conv9'" in p.stderr
    v = run("--version")
    assert v.returncode == 0 and v.stdout.strip() == f"leafpy {lp.__version__}"


def test_bad_input_gives_a_clear_error(tmp_path):
    p = run("train", str(tmp_path / "missing.yaml"))
    assert p.returncode == 1 and "leafpy: error:" in p.stderr and "cannot read" in p.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(DIGITS).read_text().replace("num_output: 20", "num_output: -20"))
    p = run("summary", str(bad))
    assert p.returncode == 1 and "network.layers[0].num_output" in p.stderr
    p = run("evaluate", DIGITS, "--weights", str(bad))
    assert p.returncode == 1 and "leafpy: error:" in p.stderr and "Traceback" not in p.stderr
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    p = run("train", DIGITS, "--out", str(a_file))
    assert p.returncode == 1 and f"--out {a_file}: cannot create the output directory" in p.stderr, p.stderr
    model = tmp_path / "model.leaf"
    lp.Layer.from_config(lp.backend("native"), lp.config.load(DIGITS).network).save(model)
    p = run("train", DIGITS, "--out", str(tmp_path / "run"), "--resume", str(model))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"{model}: holds a Layer, not a SolverCheckpoint" in p.stderr and "needs a checkpoint" in p.stderr


NPZ_RUN = """
name: blobs
data: {dataset: npz, path: DATA, batch_size: 20, test_fraction: 0.25}
network:
  type: Sequential
  inputs: [{name: data, shape: [20, 16]}]
  layers:
    - {name: fc1, type: Linear, output_size: 16}
    - {name: relu1, type: ReLU}
    - {name: fc2, type: Linear, output_size: 3}
    - {name: logsm, type: LogSoftmax}
objective:
  type: Sequential
  inputs: [{name: network_out, shape: [20, 3]}, {name: label, shape: [20, 1]}]
  layers: [{name: nll, type: NegativeLogLikelihood, num_classes: 3}]
solver: {solver: momentum, base_lr: 0.05, momentum: 0.9}
train: {epochs: 4}
"""


def test_train_on_your_own_arrays_and_data_that_does_not_fit(tmp_path):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 400)
    x = (rng.standard_normal((3, 16)) * 3)[y] + rng.standard_normal((400, 16))
    np.savez(tmp_path / "blobs.npz", x=x.reshape(400, 4, 4), y=y)  # [4, 4] samples into a [N, 16] input
    run_file = tmp_path / "blobs.yaml"
    run_file.write_text(NPZ_RUN.replace("DATA", str(tmp_path / "blobs.npz")))
    p = run("train", str(run_file), "--out", str(tmp_path / "run"))
    assert p.returncode == 0, p.stderr
    assert "300 training and 100 held-out samples (blobs.npz)" in p.stdout and "epoch 4/4" in p.stdout
    assert accuracy(p.stdout) >= 0.95
    e = run("evaluate", str(run_file), "--weights", str(tmp_path / "run" / "model.leaf"))
    assert e.returncode == 0 and accuracy(e.stdout) == pytest.approx(accuracy(p.stdout))
    # the data is checked against the network before training starts
    wide = tmp_path / "wide.yaml"
    wide.write_text(run_file.read_text().replace("shape: [20, 16]", "shape: [20, 1, 8, 8]"))
    p = run("train", str(wide), "--out", str(tmp_path / "wide"))
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert ("data: the blobs.npz samples have shape [4, 4], but the network's input 'data' is declared "
            "[20, 1, 8, 8]; declare [20, 4, 4] in network.inputs") in p.stderr
    two = tmp_path / "two.yaml"
    two.write_text(run_file.read_text().replace("num_classes: 3", "num_classes: 2"))
    p = run("evaluate", str(two), "--weights", str(tmp_path / "run" / "model.leaf"))
    assert p.returncode == 1 and "labels go up to 2, but objective layer 'nll' has num_classes 2" in p.stderr


def test_predict_writes_classes_and_outputs(tmp_path):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 400)
    x = (rng.standard_normal((3, 16)) * 3)[y] + rng.standard_normal((400, 16))
    np.savez(tmp_path / "blobs.npz", x=x, y=y)
    run_file = tmp_path / "blobs.yaml"
    run_file.write_text(NPZ_RUN.replace("DATA", str(tmp_path / "blobs.npz")))
    assert run("train", str(run_file), "--out", str(tmp_path / "run"), "--epochs", "2").returncode == 0
    model = tmp_path / "run" / "model.leaf"
    new = rng.standard_normal((45, 4, 4))  # 45 samples: two full batches of 20 and a partial one
    np.savez(tmp_path / "new.npz", x=new)
    net = lp.Layer.load(lp.backend("native"), model)
    want = net.forward([new.reshape(45, 16).astype(np.float32)])[0].to_numpy()
    p = run("predict", str(run_file), "--weights", str(model), "--input", str(tmp_path / "new.npz"),
            "--out", str(tmp_path / "p.npz"))
    assert p.returncode == 0, p.stderr
    assert "45 samples" in p.stdout and "predicted classes: " in p.stdout
    with np.load(tmp_path / "p.npz") as f:
        np.testing.assert_allclose(f["outputs"], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(f["classes"], want.argmax(axis=1))
    p = run("predict", str(run_file), "--weights", str(model), "--input", str(tmp_path / "new.npz"),
            "--out", str(tmp_path / "p.csv"))
    table = np.loadtxt(tmp_path / "p.csv", delimiter=",", skiprows=1)
    assert (tmp_path / "p.csv").read_text().startswith("class,output_0,output_1,output_2\n")
    np.testing.assert_array_equal(table[:, 0], want.argmax(axis=1))
    np.testing.assert_allclose(table[:, 1:], want, rtol=1e-5, atol=1e-5)
    # the suffix in capitals, as --input takes them (they were refused: 'written as .npz or .csv')
    for out in ("P.NPZ", "P.Csv"):
        p = run("predict", str(run_file), "--weights", str(model), "--input", str(tmp_path / "new.npz"),
                "--out", str(tmp_path / out))
        assert p.returncode == 0, p.stderr
    with np.load(tmp_path / "P.NPZ") as f:
        np.testing.assert_allclose(f["outputs"], want, rtol=1e-5, atol=1e-5)
    assert (tmp_path / "P.Csv").read_text().startswith("class,output_0,output_1,output_2\n")
    np.testing.assert_allclose(np.loadtxt(tmp_path / "P.Csv", delimiter=",", skiprows=1), table, atol=1e-6)
    p = run("predict", str(run_file), "--weights", str(model), "--input", str(tmp_path / "new.npz"),
            "--out", str(tmp_path / "p.txt"))
    assert p.returncode == 1 and "predictions are written as .npz or .csv" in p.stderr
    (tmp_path / "taken.csv").mkdir()  # an --out that is a directory: the message suggests a predictions file in it
    p = run("predict", str(run_file), "--weights", str(model), "--input", str(tmp_path / "new.npz"),
            "--out", str(tmp_path / "taken.csv"))
    assert p.returncode == 1 and "it is a directory" in p.stderr and "predictions.csv" in p.stderr, p.stderr
    np.savez(tmp_path / "wide.npz", x=np.zeros((3, 5, 5)))
    p = run("predict", str(run_file), "--weights", str(model), "--input", str(tmp_path / "wide.npz"))
    assert p.returncode == 1 and "wide.npz: the samples have shape [5, 5]" in p.stderr and "Traceback" not in p.stderr


REGRESSION_RUN = """
name: curve
data: {dataset: npz, path: DATA, batch_size: 25}
network:
  type: Sequential
  inputs: [{name: data, shape: [25, 4]}]
  layers:
    - {name: fc1, type: Linear, output_size: 16}
    - {name: act, type: TanH}
    - {name: fc2, type: Linear, output_size: 2}
objective:
  type: Sequential
  inputs: [{name: network_out, shape: [25, 2]}, {name: target, shape: [25, 2]}]
  layers: [{name: mse, type: MeanSquaredError}]
solver: {solver: adam, base_lr: 0.02}
train: {epochs: 6}
"""


def test_train_a_regression_objective(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((500, 4))
    y = np.tanh(x @ rng.standard_normal((4, 2)))
    np.savez(tmp_path / "curve.npz", x=x, y=y)
    run_file = tmp_path / "curve.yaml"
    run_file.write_text(REGRESSION_RUN.replace("DATA", str(tmp_path / "curve.npz")))
    p = run("train", str(run_file), "--out", str(tmp_path / "run"))
    assert p.returncode == 0, p.stderr
    assert "confusion matrix" not in p.stdout and "accuracy" not in p.stdout
    epochs = re.findall(r"epoch (\d)/6: loss ([\d.]+), held-out loss ([\d.]+), lr 0.02 \(", p.stdout)
    assert [int(e[0]) for e in epochs] == [1, 2, 3, 4, 5, 6], p.stdout
    final = float(re.search(r"held-out loss: ([\d.e-]+)", p.stdout).group(1))
    assert final < 0.2 * float(epochs[0][1])  # it learned
    # the reported held-out loss is the mean squared error of the saved model on the held-out split
    ds = lp.data.npz(str(tmp_path / "curve.npz"), targets="values")
    net = lp.Layer.load(lp.backend("native"), tmp_path / "run" / "model.leaf")
    mse = float(np.mean((net.forward([ds.x_test])[0].to_numpy() - ds.y_test) ** 2))
    assert final == pytest.approx(mse, rel=1e-4)
    e = run("evaluate", str(run_file), "--weights", str(tmp_path / "run" / "model.leaf"))
    assert e.returncode == 0 and f"held-out loss: {final:.6g}" in e.stdout, e.stdout
    # (refused before the held-out split is scored and printed)
    e = run("evaluate", str(run_file), "--weights", str(tmp_path / "run" / "model.leaf"), "--confusion",
            str(tmp_path / "c.csv"))
    assert e.returncode == 1 and "the run has no classes (a regression)" in e.stderr and "held-out" not in e.stdout
    p = run("predict", str(run_file), "--weights", str(tmp_path / "run" / "model.leaf"), "--input",
            str(tmp_path / "curve.npz"), "--out", str(tmp_path / "p.csv"))
    assert p.returncode == 0 and "predicted classes" not in p.stdout, p.stderr
    assert (tmp_path / "p.csv").read_text().startswith("output_0,output_1\n")
    np.testing.assert_allclose(np.loadtxt(tmp_path / "p.csv", delimiter=",", skiprows=1),
                               net.forward([x.astype(np.float32)])[0].to_numpy(), rtol=1e-5, atol=1e-6)
    narrow = tmp_path / "narrow.yaml"
    narrow.write_text(run_file.read_text().replace("{name: target, shape: [25, 2]}", "{name: target, shape: [25, 3]}"))
    p = run("train", str(narrow), "--out", str(tmp_path / "narrow"))
    assert p.returncode == 1 and ("the curve.npz targets have shape [2] per sample, but the objective's target "
                                  "input 'target' is declared [25, 3]; declare [25, 2] in objective.inputs") in p.stderr


@pytest.mark.parametrize("backend", [pytest.param("webgpu", marks=pytest.mark.webgpu),
                                     pytest.param("cuda", marks=pytest.mark.cuda)])
def test_train_on_a_device_backend(tmp_path, backend):
    backend_or_skip(backend)
    out = tmp_path / "run"
    p = run("train", str(ROOT / "configs" / "digits_mlp.yaml"), "--backend", backend, "--epochs", "2",
            "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert accuracy(p.stdout) >= 0.85
    e = run("evaluate", str(ROOT / "configs" / "digits_mlp.yaml"), "--weights", str(out / "model.leaf"))
    assert e.returncode == 0 and accuracy(e.stdout) == pytest.approx(accuracy(p.stdout), abs=0.01)


def test_fine_tuning_a_head_on_a_frozen_layer_from_another_runs_model(tmp_path):
    """The fine-tuning route a user takes: a run trains the digits MLP; a second run file freezes fc1 (lr_mult 0 on
    its weight and bias in YAML) and trains from the first run's model with --weights. fc1 comes out exactly as the
    first run left it, fc2 moves, and the head alone reaches a useful accuracy."""
    mlp = ROOT / "configs" / "digits_mlp.yaml"
    first = run("train", str(mlp), "--epochs", "2", "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    frozen = tmp_path / "frozen.yaml"
    text = mlp.read_text()
    line = "{name: fc1, type: Linear, output_size: 128}"
    assert line in text
    frozen.write_text(text.replace(line, "{name: fc1, type: Linear, output_size: 128, "
                                         "params: [{lr_mult: 0}, {lr_mult: 0}]}"))
    second = run("train", str(frozen), "--epochs", "2", "--weights", str(tmp_path / "a" / "model.leaf"),
                 "--out", str(tmp_path / "b"))
    assert second.returncode == 0, second.stderr
    assert accuracy(second.stdout) >= 0.85
    a, b = (lp.Layer.load(lp.backend("native"), str(tmp_path / d / "model.leaf")).named_weights() for d in "ab")
    for name in ("fc1/weight", "fc1/bias"):
        np.testing.assert_array_equal(b[name], a[name])
    assert not np.allclose(b["fc2/weight"], a["fc2/weight"])


@pytest.mark.parametrize("damage,says", [
    ("wiring", "layer 'relu' (ReLU): input blob 'nonexistent' does not exist"),
    ("preparation", "the model's data preparation is unreadable"),
])
def test_a_model_file_whose_network_or_preparation_is_damaged_is_refused_by_name_in_every_command(tmp_path, damage,
                                                                                                 says):
    """A model file edited by hand (serialization.editable_message and encode: its checksum valid) with a layer
    reading a blob that does not exist, or an unreadable data preparation: `summary`, `convert` and `predict`
    refuse it naming the file, as Layer.load does (before, summary and convert read it as a checkpoint: the
    wiring error lost the file's name, the damaged preparation was accepted)."""
    from leafpy import serialization as s

    cfg = lp.SequentialConfig(inputs=[("data", [2, 4])])
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=3)))
    cfg.add_layer(lp.LayerConfig("relu", "ReLU"))
    lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("net", cfg), seed=0).save(str(tmp_path / "ok.leaf"))
    msg = s.editable_message(tmp_path / "ok.leaf", "Layer")
    if damage == "wiring":
        msg.config.layerType.sequential.layers[1].inputs = ["nonexistent"]
    else:
        msg.preparation = "{not json"
    bad = tmp_path / "bad.leaf"
    bad.write_bytes(s.encode(msg, "Layer"))
    np.savez(tmp_path / "x.npz", x=np.zeros((2, 4), np.float32))
    for args in (["summary", str(bad)], ["convert", str(bad), str(tmp_path / "out.onnx")],
                 ["predict", str(bad), "--input", str(tmp_path / "x.npz")]):
        p = run(*args)
        assert p.returncode == 1 and f"{bad}: " in p.stderr and says in p.stderr, (args, p.stdout, p.stderr)
    assert not (tmp_path / "out.onnx").exists()


def test_labels_at_every_position_in_an_npz_train_evaluate_and_predict(tmp_path):
    """An npz file whose labels are [N, 5], a class at each of 5 positions, for a run whose NegativeLogLikelihood
    scores [N, C, 5] (before: refused, 'y must be class indices of shape [N] or [N, 1]', though Python's Trainer
    trained the same arrays): leafpy train, evaluate and predict take it, and the held-out accuracy printed is
    the fraction of the held-out positions whose class in predict's table equals the label."""
    import yaml

    rng = np.random.default_rng(1)
    x = rng.standard_normal((160, 5, 8)).astype(np.float32)
    y = np.argmax(x[:, :, :3], axis=2).astype(np.int64)
    np.savez(tmp_path / "positions.npz", x_train=x[:120], y_train=y[:120], x_test=x[120:], y_test=y[120:])
    np.savez(tmp_path / "held_out.npz", x=x[120:])

    def layer(name, kind, **options):
        return {"name": name, "type": kind, **options}

    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump({
        "name": "positions",
        "data": {"dataset": "npz", "path": str(tmp_path / "positions.npz"), "batch_size": 16, "seed": 0},
        "network": {"type": "Sequential", "inputs": [{"name": "data", "shape": [None, 5, 8]}],
                    "layers": [layer("fc", "Linear", output_size=3, axis=-1), layer("t", "Transpose", perm=[0, 2, 1]),
                               layer("logsm", "LogSoftmax", axis=1)]},
        "objective": {"type": "Sequential", "inputs": [{"name": "network_out", "shape": [16, 3, 5]},
                                                       {"name": "label", "shape": [16, 5]}],
                      "layers": [layer("nll", "NegativeLogLikelihood", num_classes=3)]},
        "solver": {"solver": "adam", "base_lr": 0.05, "seed": 0},
        "train": {"epochs": 3}}, sort_keys=False))
    out = tmp_path / "out"
    done = run("train", str(run_yaml), "--backend", "native", "--out", str(out))
    assert done.returncode == 0, done.stderr
    done = run("evaluate", str(out))
    assert done.returncode == 0, done.stderr
    printed = float(re.search(r"held-out accuracy: ([\d.]+)%", done.stdout).group(1)) / 100
    # the matrix counts 200 predictions, 5 of each of the 40 held-out samples (it said '200 samples')
    assert "(40 samples" in done.stdout and re.search(r"\naccuracy [\d.]+% of 200 predictions\n", done.stdout)
    done = run("predict", str(out), "--input", str(tmp_path / "held_out.npz"), "--out", str(tmp_path / "p.csv"))
    assert done.returncode == 0, done.stderr
    table = np.loadtxt(tmp_path / "p.csv", delimiter=",", skiprows=1)
    classes = table[:, :5].astype(np.int64)  # class_0 .. class_4, then the outputs
    assert classes.shape == (40, 5)
    assert printed == pytest.approx(np.mean(classes == y[120:]), abs=5e-5)
    assert printed > 0.6


def test_many_classes_print_a_summary_and_write_the_whole_confusion_matrix(tmp_path):
    """Past 20 classes (30 here) train prints the most frequent confusions, the accuracy and macro and weighted F1
    instead of the matrix and a row per class (1000 classes printed 5 MB), and writes the matrix to the run's
    confusion.csv; evaluate writes it with --confusion. Checked against predictions made in NumPy."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "many.npz", x=rng.normal(size=(600, 4)).astype(np.float32), y=np.arange(600) % 30)
    (tmp_path / "many.yaml").write_text(
        f"name: many\ndata: {{dataset: npz, path: {tmp_path / 'many.npz'}, batch_size: 16, test_fraction: 0.5, "
        "seed: 0}\ntrain: {epochs: 1}\nnetwork:\n  type: Sequential\n  inputs: [{name: data, shape: [null, 4]}]\n"
        "  layers: [{name: fc1, type: Linear, output_size: 30}, {name: logsm, type: LogSoftmax}]\nobjective: nll\n"
        "solver: {solver: momentum, base_lr: 0.1, momentum: 0.9, seed: 0}\n")
    out = tmp_path / "run"
    p = run("train", str(tmp_path / "many.yaml"), "--out", str(out))
    assert p.returncode == 0, p.stderr
    be = lp.backend("native")
    w = lp.Layer.load(be, str(out / "model.leaf")).named_weights()
    ds = lp.train.load_data(lp.config.load(str(out / "run.yaml")))
    x, y = np.asarray(ds.x_test, np.float64), np.asarray(ds.y_test).reshape(-1)
    predicted = (x @ w["fc1/weight"].astype(np.float64).T + w["fc1/bias"]).argmax(axis=1)
    want = np.zeros((30, 30), np.int64)
    np.add.at(want, (y, predicted), 1)
    rows = [line.split(",") for line in (out / "confusion.csv").read_text().splitlines()]
    assert rows[0] == ["target\\pred", *map(str, range(30))] and [r[0] for r in rows[1:]] == list(map(str, range(30)))
    np.testing.assert_array_equal(np.array([r[1:] for r in rows[1:]], np.int64), want)
    off = want - np.diag(np.diag(want))
    pairs = sorted((-off[t, q], t, q) for t in range(30) for q in range(30) if off[t, q])[:10]
    listed = [f"  {t} -> {q}: {-n}" for n, t, q in pairs]
    assert f"30 classes, too many to print; written to {out / 'confusion.csv'}" in p.stdout, p.stdout
    assert "\n".join(listed) in p.stdout, p.stdout
    assert f"accuracy {np.mean(predicted == y):.2%} of {len(y)} predictions" in p.stdout
    assert "target\\pred" not in p.stdout and not re.search(r"^ *class +precision", p.stdout, re.M), p.stdout
    assert len(p.stdout.splitlines()) < 40, p.stdout
    e = run("evaluate", str(out), "--confusion", str(tmp_path / "c.csv"))
    assert e.returncode == 0, e.stderr
    assert (tmp_path / "c.csv").read_text() == (out / "confusion.csv").read_text()
    assert "\n".join(listed) in e.stdout and len(e.stdout.splitlines()) < 30, e.stdout
    plain = run("evaluate", str(out))
    assert "too many to print; write it with --confusion FILE.csv" in plain.stdout, plain.stdout


def test_labels_of_another_shape_than_the_objective_takes_are_refused_naming_the_file(tmp_path):
    """One-hot rows [N, 3] for an objective taking one class index per sample were refused in the first step as
    "input 'label' must have shape [N, 1], got (16, 3)", naming neither the file nor the likely mistake."""
    x = np.random.default_rng(0).random((60, 40), dtype=np.float32)
    np.savez(tmp_path / "onehot.npz", x=x, y=np.eye(3)[np.arange(60) % 3])
    (tmp_path / "run.yaml").write_text(
        f"data: {{dataset: npz, path: {tmp_path / 'onehot.npz'}, batch_size: 16}}\n"
        "network: {type: Sequential, inputs: [{name: data, shape: [16, 40]}], layers: [{name: fc, type: Linear, "
        "output_size: 3}, {name: sm, type: LogSoftmax}]}\nobjective: nll\ntrain: {epochs: 1}\n")
    done = run("train", str(tmp_path / "run.yaml"), "--backend", "native", "--out", str(tmp_path / "out"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "onehot.npz labels have shape [3] per sample, but the objective takes one class index per sample" in \
        done.stderr and "y.argmax(axis=1)" in done.stderr, done.stderr


def test_a_regression_of_targets_with_two_axes_normalises_them_per_channel(tmp_path):
    """Targets [N, 2, 3] under normalize: auto: their statistics were taken per value (six), the scaling then took
    one per channel (two) and refused the run ("6 means ... but the samples have shape [2, 3]"). They are per
    channel (axis 1), as the samples' are and as the web page gives predictions back: the recorded means are
    NumPy's over the training split, and predict gives outputs in the targets' units."""
    import yaml

    rng = np.random.default_rng(3)
    x = rng.standard_normal((90, 4)).astype(np.float32)
    y = (x[:, :1, None] * np.array([1.0, 2.0, 3.0]) + np.array([[100.0], [50.0]])).astype(np.float32)  # [90, 2, 3]
    np.savez(tmp_path / "two_axes.npz", x_train=x[:60], y_train=y[:60], x_test=x[60:], y_test=y[60:])
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "data": {"dataset": "npz", "path": str(tmp_path / "two_axes.npz"), "batch_size": 10, "normalize": "auto"},
        "network": {"type": "Sequential", "inputs": [{"name": "data", "shape": [10, 4]}],
                    "layers": [{"name": "fc", "type": "Linear", "output_size": 6},
                               {"name": "r", "type": "Reshape", "shape": [-1, 2, 3]}]},
        "objective": {"type": "Sequential", "inputs": [{"name": "out", "shape": [10, 2, 3]},
                                                       {"name": "target", "shape": [10, 2, 3]}],
                      "layers": [{"name": "mse", "type": "MeanSquaredError"}]},
        "solver": {"solver": "adam", "base_lr": 0.05, "seed": 0}, "train": {"epochs": 30}}))
    done = run("train", str(tmp_path / "run.yaml"), "--backend", "native", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    recorded = yaml.safe_load((tmp_path / "out" / "run.yaml").read_text())["data"]["normalize"]
    np.testing.assert_allclose(recorded["target_mean"], y[:60].mean(axis=(0, 2)), rtol=1e-5)
    np.testing.assert_allclose(recorded["target_std"], y[:60].std(axis=(0, 2)), rtol=1e-4)
    np.savez(tmp_path / "new.npz", x=x[60:])
    done = run("predict", str(tmp_path / "out"), "--input", str(tmp_path / "new.npz"), "--out", str(tmp_path / "p.npz"))
    assert done.returncode == 0, done.stderr
    with np.load(tmp_path / "p.npz") as p:
        outputs = p["outputs"]
    assert outputs.shape == (30, 2, 3)
    assert np.abs(outputs - y[60:]).mean() < 0.1 * np.abs(y[60:] - y[60:].mean(axis=0)).mean()  # in units, learned
