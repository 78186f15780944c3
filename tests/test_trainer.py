"""The training loop as users meet it: lp.Trainer from Python, and the leafpy command in a temporary directory
(run.yaml, evaluate from a run directory, resume with changed settings, interrupted and resumed runs, locks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import numpy as np
import pytest
from conftest import child_env, terminal_signals
from runs import layer, mlp, run_file
from test_cli import ROOT, accuracy, leafpy_cmd, run

import leafpy as lp

MLP = str(ROOT / "configs" / "digits_mlp.yaml")


def _weights(path):
    be = lp.backend("native")
    if str(path).endswith("checkpoint.leaf"):
        net = lp.Solver.load_checkpoint(be, be, str(path)).network
    else:
        net = lp.Layer.load(be, str(path))
    return [w.to_numpy() for w in net.learnable_weights_data()]


def _small_run(solver="adam", batch=32, **data):
    run_cfg = lp.config.load(MLP, [f"solver.solver={solver}", "solver.base_lr=0.01", "solver.lr_policy=step",
                                   "solver.stepsize=7", "solver.gamma=0.7", f"data.batch_size={batch}"])
    run_cfg.data.update(data)
    return run_cfg


# --- run.yaml and evaluate ----------------------------------------------------------------------------------------
def test_evaluate_a_run_directory_reproduces_training_split(tmp_path):
    out = tmp_path / "run"
    p = run("train", MLP, "--epochs", "2", "--seed", "5", "--out", str(out))
    assert p.returncode == 0, p.stderr
    trained_acc = accuracy(p.stdout)
    saved = lp.config.load(str(out / "run.yaml"))
    assert saved.data["seed"] == 5 and saved.solver.seed == 5 and saved.train["backend"] == "native"
    history = json.loads((out / "history.json").read_text())
    assert history[-1]["test_accuracy"] == pytest.approx(trained_acc, abs=1e-4)
    e = run("evaluate", str(out))
    assert e.returncode == 0, e.stderr
    assert accuracy(e.stdout) == pytest.approx(trained_acc, abs=1e-4)
    # the model file alone finds its run.yaml beside it
    e2 = run("evaluate", str(out / "model.leaf"))
    assert e2.returncode == 0 and accuracy(e2.stdout) == pytest.approx(trained_acc, abs=1e-4)
    # the run file (seed 0) with these weights would score on training samples: refused, naming the split
    e3 = run("evaluate", MLP, "--weights", str(out / "model.leaf"))
    assert e3.returncode == 1 and "another data split" in e3.stderr and "data.seed" in e3.stderr, e3.stderr
    # independent check of the held-out accuracy: NumPy forward pass of the saved weights on the seed-5 split
    ds = lp.data.digits(0.2, 5)
    w1, b1, w2, b2 = (w.astype(np.float64) for w in _weights(out / "model.leaf"))
    h = np.maximum(ds.x_test.reshape(len(ds.x_test), -1) @ w1.T + b1, 0)
    pred = np.argmax(h @ w2.T + b2, axis=1)
    assert np.mean(pred == ds.y_test.reshape(-1)) == pytest.approx(trained_acc, abs=1e-4)


def test_weights_of_another_architecture_are_refused(tmp_path):
    out = tmp_path / "run"
    assert run("train", MLP, "--epochs", "1", "--out", str(out)).returncode == 0
    changed = tmp_path / "sigmoid.yaml"
    changed.write_text(open(MLP).read().replace("type: ReLU", "type: Sigmoid"))
    e = run("evaluate", str(changed), "--weights", str(out / "checkpoint.leaf"))
    assert e.returncode == 1, e.stdout
    assert "another network" in e.stderr and "relu1" in e.stderr and "Sigmoid" in e.stderr, e.stderr
    s = run("summary", str(out / "model.leaf"))
    assert s.returncode == 0 and "fc1" in s.stdout and "9,610 (9,610 trained)" in s.stdout, s.stdout


def test_summary_shows_untrained_running_statistics(tmp_path):
    s = run("summary", str(ROOT / "configs" / "digits_bn.yaml"))
    assert s.returncode == 0, s.stderr
    assert "untrained" in s.stdout


def test_labels_that_do_not_reach_the_last_class(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((120, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 6, 120)  # classes 6..9 never occur
    np.savez(tmp_path / "few.npz", x=x, y=y)
    p = run("train", MLP, "--epochs", "1", "--out", str(tmp_path / "out"), "--set", "data.dataset=npz",
            "--set", f"data.path={tmp_path / 'few.npz'}")
    assert p.returncode == 0, p.stderr
    assert "confusion matrix" in p.stdout


# --- resume -------------------------------------------------------------------------------------------------------
def test_resume_trains_with_the_run_files_settings(tmp_path):
    out = tmp_path / "run"
    assert run("train", MLP, "--epochs", "2", "--out", str(out)).returncode == 0
    before = _weights(out / "checkpoint.leaf")
    p = run("train", MLP, "--epochs", "3", "--out", str(out), "--resume", str(out / "checkpoint.leaf"),
            "--set", "solver.base_lr=1e-9", "--set", "solver.momentum=0.0", "--set", "solver.weight_decay=0")
    assert p.returncode == 0, p.stderr
    assert "lr 1e-09" in p.stdout
    after = _weights(out / "model.leaf")
    # at a rate of 1e-9 (no momentum history carried into the step) the weights barely move
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(after, before))
    assert moved < 1e-6, moved
    history = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in history] == [1, 2, 3] and history[-1]["learning_rate"] == pytest.approx(1e-9)
    bad = run("train", MLP, "--epochs", "4", "--out", str(out), "--resume", str(out / "checkpoint.leaf"),
              "--set", "solver.solver=adam")
    assert bad.returncode == 1 and "solver.solver" in bad.stderr and "cannot change" in bad.stderr, bad.stderr
    split = run("train", MLP, "--epochs", "4", "--out", str(out), "--resume", str(out / "checkpoint.leaf"),
                "--seed", "3")
    assert split.returncode == 1 and "data.seed" in split.stderr, split.stderr


class _StopAt(lp.Callback):
    """Simulates a signal arriving after ``batches`` batches."""

    def __init__(self, batches):
        self.batches = batches
        self.seen = 0

    def on_batch_end(self, trainer, epoch, batch, loss):
        self.seen += 1
        if self.seen == self.batches:
            trainer.interrupted = True


@pytest.mark.parametrize("batch,stop_after", [(32, 50), (20, 23)])
def test_interrupted_anywhere_and_resumed_equals_uninterrupted(tmp_path, batch, stop_after):
    be = lp.backend("native")
    whole = lp.Trainer(_small_run(batch=batch), be, out_dir=str(tmp_path / "a"), log=lambda m: None)
    whole.fit(3)
    parted = lp.Trainer(_small_run(batch=batch), be, out_dir=str(tmp_path / "b"), callbacks=[_StopAt(stop_after)],
                        log=lambda m: None)
    with pytest.raises(lp.train.TrainingInterrupted):
        parted.fit(3)
    assert 0 < parted.solver.trainer_state["sample"] < len(parted.dataset.x_train)  # stopped mid-epoch
    resumed = lp.Trainer(_small_run(batch=batch), be, out_dir=str(tmp_path / "b"),
                         resume=str(tmp_path / "b" / "checkpoint.leaf"), log=lambda m: None)
    resumed.fit(3)
    assert resumed.solver.iteration == whole.solver.iteration
    for a, b in zip(whole.solver.network.learnable_weights_data(), resumed.solver.network.learnable_weights_data()):
        np.testing.assert_array_equal(a.to_numpy(), b.to_numpy())  # bit for bit: the promise of a resume
    assert [h["epoch"] for h in resumed.history] == [1, 2, 3]
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in whole.history]  # (bit for bit too)


def _frozen_run(tmp_path, batch):
    """A run of 80 training samples (3 classes) whose weights never move (base_lr 0)."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(100, 4)).astype(np.float32), y=np.arange(100) % 3)
    data = {"dataset": "npz", "path": str(tmp_path / "d.npz"), "batch_size": batch, "test_fraction": 0.2, "seed": 0}
    (tmp_path / "frozen.yaml").write_text(run_file(mlp(3), [4], data=data, solver={
        "solver": "momentum", "base_lr": 0.0, "momentum": 0.0, "seed": 0}))
    return lp.config.load(str(tmp_path / "frozen.yaml"))


def _training_nll(trainer):
    """The mean NLL of the trainer's network over its training samples, in float64 NumPy."""
    w = trainer.solver.network.named_weights()
    x, y = np.asarray(trainer.dataset.x_train, np.float64), np.asarray(trainer.dataset.y_train).reshape(-1)
    z = x @ w["fc1/weight"].astype(np.float64).T + w["fc1/bias"]
    log_p = z - z.max(axis=1, keepdims=True)
    log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
    return float(-log_p[np.arange(len(y)), y].mean())


def test_the_epochs_training_loss_is_a_mean_over_its_samples(tmp_path):
    """80 training samples at batch 79: a batch of 79 and one of 1. The epoch's loss weighs each batch by its
    samples, as the held-out loss does: with weights that do not move, it is the NLL over the training samples
    (the mean of the two batches' means was 1.4749 here, the samples' 1.2104)."""
    t = lp.Trainer(_frozen_run(tmp_path, 79), lp.backend("native"), log=lambda m: None)
    history = t.fit(2)
    assert [r["loss"] for r in history] == pytest.approx([_training_nll(t)] * 2, rel=1e-6)


def test_a_checkpoint_inside_an_epoch_from_before_loss_weight_resumes_to_the_mean_over_samples(tmp_path):
    """A checkpoint saved inside an epoch by a leafpy that summed the batches' means (loss_sum, loss_count, no
    loss_weight) resumes to the epoch's mean over its samples: its batches were full ones (30 of 80 samples here;
    the epoch's last batch, 20, is short). A checkpoint of this leafpy resumes to the same loss."""
    losses = []

    class StopAfterOne(lp.Callback):
        def on_batch_end(self, trainer, epoch, batch, loss):
            losses.append(loss)
            trainer.interrupted = True

    t = lp.Trainer(_frozen_run(tmp_path, 30), lp.backend("native"), out_dir=str(tmp_path / "run"),
                   callbacks=[StopAfterOne()], log=lambda m: None)
    with pytest.raises(lp.train.TrainingInterrupted):
        t.fit(1)
    path = str(tmp_path / "run" / "checkpoint.leaf")
    be = lp.backend("native")
    for older in (False, True):
        if older:
            solver = lp.Solver.load_checkpoint(be, be, path)
            state = {k: v for k, v in solver.trainer_state.items() if k != "loss_weight"}
            solver.trainer_state = {**state, "loss_sum": losses[0], "loss_count": 1}
            solver.save_checkpoint(path)
        assert ("loss_weight" in lp.Solver.load_checkpoint(be, be, path).trainer_state) is not older
        resumed = lp.Trainer(_frozen_run(tmp_path, 30), be, resume=path, log=lambda m: None)
        assert resumed.start_sample == 30
        assert resumed.fit(1)[-1]["loss"] == pytest.approx(_training_nll(resumed), rel=1e-6)


def test_ctrl_c_in_the_command_then_resume_equals_an_uninterrupted_run(tmp_path):
    args = ["--set", "solver.solver=adam", "--set", "solver.base_lr=0.002", "--set", "data.batch_size=4"]
    assert run("train", MLP, "--epochs", "6", "--out", str(tmp_path / "whole"), *args).returncode == 0
    env = child_env()
    proc = subprocess.Popen(leafpy_cmd() + ["train", MLP, "--epochs", "6", "--out", str(tmp_path / "cut"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            preexec_fn=terminal_signals)
    for line in proc.stdout:
        if line.startswith("epoch 1/6"):
            proc.send_signal(signal.SIGINT)  # lands in epoch 2 (most likely mid-epoch: anywhere must resume exactly)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    state = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"),
                                      str(tmp_path / "cut" / "checkpoint.leaf")).trainer_state
    assert state["epoch"] < 6, state
    r = run("train", MLP, "--epochs", "6", "--out", str(tmp_path / "cut"), "--resume",
            str(tmp_path / "cut" / "checkpoint.leaf"), *args)
    assert r.returncode == 0, r.stderr
    for a, b in zip(_weights(tmp_path / "whole" / "model.leaf"), _weights(tmp_path / "cut" / "model.leaf")):
        np.testing.assert_array_equal(a, b)


# --- callbacks ----------------------------------------------------------------------------------------------------
def test_user_callbacks_early_stopping_and_best_checkpoints(tmp_path):
    seen = []

    class Record(lp.Callback):
        def on_epoch_end(self, trainer, record):
            seen.append((record["epoch"], record["test_loss"]))

    # a learning rate so small that the held-out loss cannot improve by min_delta: stops after patience epochs
    r = lp.config.load(MLP, ["solver.base_lr=1e-7"])
    stop = lp.train.EarlyStopping(monitor="test_loss", patience=2, min_delta=0.01)
    t = lp.Trainer(r, out_dir=str(tmp_path), callbacks=[Record(), stop], keep_best=2, monitor="test_accuracy",
                   log=lambda m: None)
    history = t.fit(10)
    assert [e for e, _ in seen] == [1, 2, 3] and len(history) == 3
    best = sorted(f for f in os.listdir(tmp_path) if f.startswith("best-"))
    assert len(best) == 2
    csv_lines = (tmp_path / "history.csv").read_text().splitlines()
    assert csv_lines[0].startswith("epoch,") and len(csv_lines) == 4


# --- the output directory -----------------------------------------------------------------------------------------
def test_an_output_directory_holds_one_run(tmp_path):
    out = tmp_path / "run"
    assert run("train", MLP, "--epochs", "1", "--out", str(out)).returncode == 0
    again = run("train", MLP, "--epochs", "1", "--out", str(out))
    assert again.returncode == 1 and "--overwrite" in again.stderr
    (out / ".lock").write_text("999999999")  # a crashed run's lock: its process is gone
    assert run("train", MLP, "--epochs", "1", "--out", str(out), "--overwrite").returncode == 0
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        (out / ".lock").write_text(str(sleeper.pid))  # a live run holds the directory
        busy = run("train", MLP, "--epochs", "1", "--out", str(out), "--overwrite")
        assert busy.returncode == 1 and "another leafpy run" in busy.stderr, busy.stderr
    finally:
        sleeper.kill()


def test_a_diverged_run_never_replaces_a_good_checkpoint(tmp_path):
    class Poison(lp.Callback):
        """Make the weights non-finite at the end of epoch 2, as a diverging run would."""

        def on_epoch_end(self, trainer, record):
            if record["epoch"] == 2:
                w = trainer.solver.network.learnable_weights_data()[0]
                w.set(np.full(w.shape, np.nan, np.float32))

    t = lp.Trainer(lp.config.load(MLP), out_dir=str(tmp_path), callbacks=[Poison()], log=lambda m: None)
    with pytest.raises(lp.train.TrainingDiverged, match="no longer finite"):  # epoch 2's checkpoint (the callbacks
        t.fit(4)                                                                # run before the checkpoint's turn)
    before = (tmp_path / "checkpoint.leaf").read_bytes()
    with pytest.raises(lp.train.TrainingDiverged, match="no longer finite"):
        t.save_checkpoint(str(tmp_path / "checkpoint.leaf"))  # what a signal or the next epoch would write
    with pytest.raises(lp.train.TrainingDiverged, match="first non-finite"):
        t.fit(4)  # the next step
    assert (tmp_path / "checkpoint.leaf").read_bytes() == before
    good = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"), str(tmp_path / "checkpoint.leaf"))
    assert good.trainer_state["epoch"] == 1
    assert all(np.all(np.isfinite(w.to_numpy())) for w in good.network.learnable_weights_data())


@pytest.mark.parametrize("settings,first_zero", [
    (["lr_policy=poly", "max_iter=10", "power=1"], 10),  # 0.05 * (1 - min(it, 10) / 10)
    (["lr_policy=cosine", "max_iter=30", "warmup_iter=100", "warmup_factor=0.1"], 0),  # warms up to the rate at 100
    (["lr_policy=cosine", "max_iter=135"], None),  # 0 at iteration 135, after the run's last (134)
])
def test_a_schedule_whose_rate_falls_to_0_before_the_runs_end_says_so(tmp_path, settings, first_zero):
    """max_iter ends no run (PyTorch's schedulers do not either): a poly or cosine (min_lr 0) schedule shorter than
    the run, or whose warm-up passes max_iter, trains at rate 0, and a warning line says so when training starts.
    Three epochs of digits_mlp are 135 updates; the first zero is the formula's, computed here in NumPy."""
    p = run("train", MLP, "--epochs", "3", "--out", str(tmp_path / "run"),
            *[a for s in settings for a in ("--set", f"solver.{s}")])
    assert p.returncode == 0, p.stderr
    it = np.arange(135, dtype=np.float64)
    if "lr_policy=poly" in settings:
        rates = 0.05 * (1 - np.minimum(it, 10) / 10)
    else:
        last = 30 if "max_iter=30" in settings else 135
        cos = lambda t: 0.05 * (1 + np.cos(np.pi * np.minimum(t, last) / last)) / 2  # noqa: E731
        rates = np.where(it < 100, cos(100) * (0.1 + 0.9 * it / 100), cos(it)) if last == 30 else cos(it)
    zeros = np.flatnonzero(np.isclose(rates, 0.0, rtol=0, atol=1e-15))
    assert (zeros[0] if len(zeros) else None) == first_zero
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert [r["learning_rate"] for r in history] == pytest.approx(list(rates[[44, 89, 134]]), abs=1e-12)
    if first_zero is None:
        assert "learning rate is 0" not in p.stdout, p.stdout
    elif first_zero == 0:
        assert "warning: the learning rate is 0 for the whole run (iterations 0..134): the cosine policy reaches " \
               "min_lr 0 at max_iter 30, and the warm-up rises to the rate at warmup_iter 100" in p.stdout, p.stdout
    else:
        said = f"warning: the learning rate is 0 from iteration {first_zero} on, and this run trains to iteration " \
               f"135 (45 updates an epoch): its last {135 - first_zero} updates are made at rate 0"
        assert said in p.stdout, p.stdout


def _held_out_nll(run_dir, weights):
    """The MLP's (digits_mlp's) held-out NLL in float64 NumPy, from weights by name, on the run's held-out split."""
    ds = lp.train.load_data(lp.config.load(str(run_dir / "run.yaml")))
    x = np.asarray(ds.x_test, np.float64).reshape(len(ds.x_test), -1)
    h = np.maximum(x @ weights["fc1/weight"].astype(np.float64).T + weights["fc1/bias"], 0.0)
    z = h @ weights["fc2/weight"].astype(np.float64).T + weights["fc2/bias"]
    top = z.max(axis=1, keepdims=True)
    log_p = z - top - np.log(np.exp(z - top).sum(axis=1, keepdims=True))
    return float(-log_p[np.arange(len(z)), np.asarray(ds.y_test).reshape(-1)].mean())


def test_an_epoch_with_an_infinite_held_out_loss_leaves_the_last_checkpoint_as_it_was(tmp_path):
    """A growing rate (exp, gamma 1.15) takes digits_mlp's weights where the held-out loss is inf after epoch 2
    though every training batch's loss is finite; the next step diverges. checkpoint.leaf keeps epoch 1's weights,
    which the divergence message calls the last good checkpoint: their held-out loss (NumPy) is epoch 1's, finite."""
    p = run("train", MLP, "--epochs", "6", "--out", str(tmp_path / "run"), "--set", "solver.lr_policy=exp",
            "--set", "solver.gamma=1.15")
    assert p.returncode == 1, p.stdout + p.stderr
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert [np.isfinite(r["test_loss"]) for r in history] == [True, False], history
    assert "warning: epoch 2's held-out loss inf" in p.stdout and "keeps the last epoch whose losses were finite" \
        in p.stdout, p.stdout
    assert f"The last good checkpoint is {tmp_path / 'run' / 'checkpoint.leaf'}" in p.stderr, p.stderr
    be = lp.backend("native")
    good = lp.Solver.load_checkpoint(be, be, str(tmp_path / "run" / "checkpoint.leaf"))
    assert good.trainer_state["epoch"] == 1 and good.iteration == 45
    weights = {k: np.asarray(v) for k, v in good.network.named_weights().items()}
    assert _held_out_nll(tmp_path / "run", weights) == pytest.approx(history[0]["test_loss"], rel=1e-4)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_save_a_checkpoint_like_ctrl_c(tmp_path, sig):
    env = child_env()
    proc = subprocess.Popen(leafpy_cmd() + ["train", MLP, "--epochs", "50", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            preexec_fn=terminal_signals)
    for line in proc.stdout:
        if line.startswith("epoch 1/50"):
            proc.send_signal(sig)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in out + err and "--resume" in out + err
    lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"), str(tmp_path / "checkpoint.leaf"))


def test_under_nohup_ctrl_c_is_left_ignored(tmp_path):
    """A run started with SIGINT ignored (nohup ... &) keeps it ignored; SIGTERM still checkpoints."""
    env = child_env()
    proc = subprocess.Popen(leafpy_cmd() + ["train", MLP, "--epochs", "50", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    lines = iter(proc.stdout)
    for line in lines:
        if line.startswith("epoch 1/50"):
            proc.send_signal(signal.SIGINT)
            break
    for line in lines:
        if line.startswith("epoch 3/50"):  # still training after the ignored SIGINT
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "SIGTERM" in out + err


@pytest.mark.parametrize("bad", [-1, "10", 2.5, True])
def test_a_log_every_that_is_not_a_count_is_refused_from_python(bad):
    run = lp.config.load("digits_mlp")
    with pytest.raises(lp.ConfigError, match="log_every: expected a non-negative integer"):
        lp.Trainer(run, log_every=bad)


@pytest.mark.parametrize("kw,words", [(dict(monitor="val_acc"), "monitor"), (dict(patience=0), "patience"),
                                      (dict(min_delta=-0.1), "min_delta")])
def test_early_stopping_settings_are_checked_when_made(kw, words):
    with pytest.raises(lp.ConfigError, match=f"EarlyStopping {words}"):
        lp.train.EarlyStopping(**kw)


def test_early_stopping_on_an_accuracy_in_a_regression_run_is_refused_before_training(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "curve.npz", x=rng.random((40, 4)), y=rng.random((40, 2)))
    run = lp.config.load(io_yaml(tmp_path))
    trainer = lp.Trainer(run, callbacks=[lp.train.EarlyStopping(monitor="test_accuracy")], log=lambda m: None)
    with pytest.raises(lp.ConfigError, match="needs classes"):
        trainer.fit(1)
    assert trainer.solver.iteration == 0


def io_yaml(tmp_path):
    """A regression run file over tmp_path/curve.npz (MeanSquaredError: no classes)."""
    path = tmp_path / "curve.yaml"
    path.write_text(run_file(mlp(2, log_softmax=False), [4], name="curve", objective="mse",
                             data={"dataset": "npz", "path": str(tmp_path / "curve.npz"), "batch_size": 10},
                             solver={"solver": "momentum", "base_lr": 0.01, "seed": 0}))
    return str(path)


# --- a fit after a stop, and EarlyStopping across a resume --------------------------------------------------------
class _StopOnce(lp.Callback):
    """Once, after batch ``batch`` of the first epoch: raise ``error`` (a failing logger), or ask to stop as a
    signal handler does."""

    def __init__(self, batch, error=None):
        self.batch, self.error, self.done = batch, error, False

    def on_batch_end(self, trainer, epoch, batch, loss):
        if not self.done and epoch == 0 and batch == self.batch:
            self.done = True
            if self.error is not None:
                raise self.error
            trainer.interrupted = True


def _named(trainer):
    return trainer.solver.network.named_weights()


@pytest.mark.parametrize("stop", ["a callback raises", "a stop signal"])
def test_a_fit_after_a_stop_inside_an_epoch_goes_on_from_there(tmp_path, stop):
    """A notebook's run stopped in its first epoch (a logging callback's error, Ctrl-C), then fit() again: the same
    updates and weights as the run never stopped, and the checkpoint a stop wrote is where the run stood."""
    quiet = lambda m: None  # noqa: E731
    whole = lp.Trainer(lp.config.load(MLP), out_dir=str(tmp_path / "whole"), log=quiet)
    whole.fit(2)
    error = ConnectionError("metrics server unreachable") if stop == "a callback raises" else None
    t = lp.Trainer(lp.config.load(MLP), out_dir=str(tmp_path / "cut"), log=quiet, callbacks=[_StopOnce(9, error)])
    with pytest.raises(ConnectionError if error else lp.train.TrainingInterrupted):
        t.fit(2)
    assert t.solver.iteration == 10
    if error is None:
        state = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"),
                                          str(tmp_path / "cut" / "checkpoint.leaf")).trainer_state
        assert (state["epoch"], state["sample"]) == (0, 10 * 32), state
    history = t.fit(2)
    assert [r["epoch"] for r in history] == [1, 2]
    assert [r["iteration"] for r in history] == [r["iteration"] for r in whole.history]
    a, b = _named(t), _named(whole)
    for k in b:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_early_stopping_stops_a_resumed_run_where_the_whole_run_stopped(tmp_path):
    """EarlyStopping of a resumed run takes the epochs the run trained before it as if it had watched them (a new
    EarlyStopping object, as a resumed script makes): it stops at the same epoch, with the same weights."""
    quiet = lambda m: None  # noqa: E731
    run = lambda: lp.config.load(MLP, ["solver.base_lr=0.002"])  # noqa: E731

    def stopper():
        return lp.train.EarlyStopping(monitor="test_loss", patience=2, min_delta=0.2)

    whole = lp.Trainer(run(), out_dir=str(tmp_path / "whole"), log=quiet, callbacks=[stopper()])
    whole.fit(12)
    stopped = len(whole.history)
    assert 3 <= stopped < 12, stopped  # (min_delta large enough for the patience to run out)

    class StopIn(lp.Callback):
        def on_batch_end(self, trainer, epoch, batch, loss):
            if epoch == stopped - 1 and batch == 3:
                trainer.interrupted = True

    cut = lp.Trainer(run(), out_dir=str(tmp_path / "cut"), log=quiet, callbacks=[stopper(), StopIn()])
    with pytest.raises(lp.train.TrainingInterrupted):
        cut.fit(12)
    resumed = lp.Trainer(run(), out_dir=str(tmp_path / "cut"), log=quiet, callbacks=[stopper()],
                         resume=str(tmp_path / "cut" / "checkpoint.leaf"))
    resumed.fit(12)
    assert len(resumed.history) == stopped
    a, b = _named(resumed), _named(whole)
    for k in b:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_numpy_numbers_a_callback_adds_to_the_record_reach_history_json(tmp_path):
    class Extra(lp.Callback):
        def on_epoch_end(self, trainer, record):
            record["grad_norm"] = np.float32(0.5)
            record["per_class"] = np.array([1, 2], np.int64)

    t = lp.Trainer(lp.config.load(MLP), out_dir=str(tmp_path), log=lambda m: None, callbacks=[Extra()])
    t.fit(2)
    saved = json.loads((tmp_path / "history.json").read_text())  # each epoch's additions with that epoch
    assert [(h["epoch"], h["grad_norm"], h["per_class"]) for h in saved] == [(1, 0.5, [1, 2]), (2, 0.5, [1, 2])]
    lines = (tmp_path / "history.csv").read_text().splitlines()
    assert "grad_norm" in lines[0].split(",") and len(lines) == 3


@pytest.mark.parametrize("given,says", [(dict(callbacks=None), "callbacks"), (dict(log=3), "log"),
                                        (dict(group=3), "group")])
def test_trainer_arguments_of_another_kind_are_refused_by_name(given, says):
    with pytest.raises(lp.errors.ConfigError, match=f"Trainer: {says}"):
        lp.Trainer(lp.config.load(MLP), **given)


def test_early_stopping_on_roc_auc_of_a_ten_class_run_is_refused_before_training(tmp_path):
    stop = lp.train.EarlyStopping(monitor="test_roc_auc")
    t = lp.Trainer(lp.config.load(MLP), out_dir=str(tmp_path), log=lambda m: None, callbacks=[stop])
    with pytest.raises(lp.errors.ConfigError, match="test_roc_auc scores two classes"):
        t.fit(1)
    assert t.solver.iteration == 0


def test_fit_to_an_epoch_the_run_has_passed_says_so_and_trains_nothing(tmp_path):
    said = []
    t = lp.Trainer(lp.config.load(MLP), out_dir=str(tmp_path), log=said.append)
    t.fit(2)
    iteration, checkpoint = t.solver.iteration, (tmp_path / "checkpoint.leaf").read_bytes()
    for epochs in (1, 2):
        said.clear()
        assert len(t.fit(epochs)) == 2
        assert t.solver.iteration == iteration and (tmp_path / "checkpoint.leaf").read_bytes() == checkpoint
        assert any("nothing to train: the run has trained 2 epochs, and fit trains up to epoch "
                   f"{epochs}" in s for s in said), said
    assert len(t.fit(3)) == 3 and t.solver.iteration > iteration

    class StopInside(lp.Callback):  # a stop inside epoch 5 (as Ctrl-C would make it)
        def on_batch_end(self, trainer, epoch, batch, loss):
            if epoch == 4 and batch == 3:
                trainer.interrupted = True

    t.callbacks.append(StopInside())
    with pytest.raises(lp.train.TrainingInterrupted):
        t.fit(6)
    iteration = t.solver.iteration
    said.clear()
    t.fit(4)
    assert t.solver.iteration == iteration
    assert any("trained 4 epochs and part of the next, and fit trains up to epoch 4" in s for s in said), said


def test_a_checkpoint_a_callback_saves_inside_an_epoch_resumes_where_its_weights_are(tmp_path):
    """A callback that checkpoints every ten batches (Trainer.save_checkpoint, documented as saving the position in
    the epoch), and the process ending later in that epoch; and a checkpoint saved after a callback's error: both
    resume at the batch their weights were at and end bit-identical to an uninterrupted run (before, both recorded
    the epoch's start: the resumed run made 101 updates where the whole run makes 90)."""
    def trainer(out, callbacks=(), resume=None):
        return lp.Trainer(lp.config.load("digits_mlp"), backend=lp.backend("native"), out_dir=str(tmp_path / out),
                          callbacks=list(callbacks), resume=resume, log=lambda m: None, log_every=0)

    def weights(t):
        return [w.to_numpy() for w in t.solver.network.learnable_weights_data()]

    whole = trainer("whole")
    whole.fit(epochs=2)

    class Every10(lp.Callback):
        def on_batch_end(self, t, epoch, batch, loss):
            if batch % 10 == 0:
                t.save_checkpoint(str(tmp_path / "mid" / "mine.leaf"))
            if (epoch, batch) == (1, 15):
                raise RuntimeError("the process ends here")

    with pytest.raises(RuntimeError, match="ends here"):
        trainer("mid", [Every10()]).fit(epochs=2)
    after_error = trainer("err", [Every10()])
    with pytest.raises(RuntimeError):
        after_error.fit(epochs=2)
    after_error.save_checkpoint(str(tmp_path / "err" / "after.leaf"))
    for path, sample in ((tmp_path / "mid" / "mine.leaf", 11 * 32), (tmp_path / "err" / "after.leaf", 16 * 32)):
        resumed = trainer(path.parent.name, resume=str(path))
        assert (resumed.start_epoch, resumed.start_sample) == (1, sample)
        resumed.fit(epochs=2)
        assert resumed.solver.iteration == whole.solver.iteration
        for a, b in zip(weights(resumed), weights(whole)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("monitor,classes,says", [
    ("test_mse", 10, "test_mse scores a regression, and this run's objective has 10 classes"),
    ("test_r2", 10, "test_r2 scores a regression"),
    ("test_top5_accuracy", 3, "test_top5_accuracy is kept with more than 5 classes, and this run's objective has 3"),
])
def test_early_stopping_on_a_score_the_run_never_records_is_refused_before_training(tmp_path, monitor, classes,
                                                                                     says):
    """Before, these trained a whole epoch and then failed in on_epoch_end, before the History and Checkpoint
    callbacks ran: nothing of the epoch was kept. keep_best by such a monitor is refused when the Trainer is made."""
    rng = np.random.default_rng(0)
    x = rng.random((60, 4)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=rng.integers(0, classes, 60))
    text = run_file(mlp(8, classes), [4], data={"dataset": "npz", "path": str(tmp_path / "d.npz"), "batch_size": 10,
                                                "test_fraction": 0.2})
    (tmp_path / "run.yaml").write_text(text)
    run = lp.config.load(str(tmp_path / "run.yaml"))
    trainer = lp.Trainer(run, out_dir=str(tmp_path / "out"), log=lambda m: None,
                         callbacks=[lp.train.EarlyStopping(monitor=monitor)])
    with pytest.raises(lp.ConfigError, match=f"EarlyStopping monitor: {says}"):
        trainer.fit(1)
    assert trainer.solver.iteration == 0
    with pytest.raises(lp.ConfigError, match=f"Trainer monitor: {says}"):
        lp.Trainer(run, out_dir=str(tmp_path / "best"), keep_best=2, monitor=monitor)


def test_on_train_end_runs_after_an_error_in_on_train_begin(tmp_path):
    """docs/training.md: on_train_end runs when fit ends, also after an error: a callback that opened something in
    on_train_begin (a writer, a connection) closes it even when another callback's on_train_begin fails."""
    calls = []

    class Opens(lp.Callback):
        def on_train_begin(self, trainer):
            calls.append("open")

        def on_train_end(self, trainer):
            calls.append("close")

    class Fails(lp.Callback):
        def on_train_begin(self, trainer):
            raise RuntimeError("cannot reach the metrics server")

    trainer = lp.Trainer(lp.config.load(MLP), callbacks=[Opens(), Fails()], log=lambda m: None)
    with pytest.raises(RuntimeError, match="metrics server"):
        trainer.fit(1)
    assert calls == ["open", "close"] and trainer.solver.iteration == 0


def test_fit_without_epochs_trains_to_the_runs_epochs_after_an_earlier_fit(tmp_path):
    """fit() trains up to train.epochs, as documented, also after a fit(epochs=1); and a fit(epochs=N) below what
    the run has trained leaves run.yaml's epochs as they were (a later --resume would stop at N)."""
    run = lp.config.load(MLP, ["train.epochs=3"])
    trainer = lp.Trainer(run, out_dir=str(tmp_path), log=lambda m: None)
    trainer.fit(epochs=1)
    trainer.fit()
    assert len(trainer.history) == 3
    trainer.fit(epochs=1)
    assert lp.config.load(str(tmp_path / "run.yaml")).epochs == 3


def test_the_r2_of_targets_far_from_zero_is_scikit_learns(tmp_path):
    """Targets 1e6 + a spread of about 1 (a sensor's offset): the held-out R² is scikit-learn's r2_score of the
    saved model's predictions in the targets' units (before: 0, the one-pass sum of squares cancelled to below its
    threshold), and MSE and MAE are too."""
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    rng = np.random.default_rng(0)
    x = rng.standard_normal((400, 4))
    y = x @ rng.standard_normal((4, 2)) + 0.3 * rng.standard_normal((400, 2)) + 1e6
    np.savez(tmp_path / "reg.npz", x=x.astype(np.float32), y=y)
    text = run_file(mlp(16, 2, log_softmax=False), [4], objective="mse", data={
        "dataset": "npz", "path": str(tmp_path / "reg.npz"), "batch_size": 16, "test_fraction": 0.25,
        "normalize": "auto"}, solver={"solver": "momentum", "base_lr": 0.02, "momentum": 0.9, "seed": 0})
    (tmp_path / "reg.yaml").write_text(text)
    trainer = lp.Trainer(lp.config.load(str(tmp_path / "reg.yaml")), log=lambda m: None)
    trainer.fit(3)
    scores = trainer.evaluate().regression
    net, prep, ds = trainer.solver.network, trainer.preparation, trainer.dataset
    net.set_training(False)
    out = net.forward([ds.x_test])[0].to_numpy()
    predicted = np.asarray(prep.outputs(out), np.float64)
    target = np.asarray(prep.outputs(np.asarray(ds.y_test, np.float32)), np.float64)
    assert r2_score(target, predicted) > 0.5
    assert scores["r2"] == pytest.approx(r2_score(target, predicted), rel=1e-6)
    assert scores["mse"] == pytest.approx(mean_squared_error(target, predicted), rel=1e-6)
    assert scores["mae"] == pytest.approx(mean_absolute_error(target, predicted), rel=1e-6)


# --- a class at every position ------------------------------------------------------------------------------------
def _per_position_run(classes, positions=5, features=8, batch=16):
    """A Linear at every position of [N, positions, features], transposed to scores [N, classes, positions] and
    a LogSoftmax over the classes; NegativeLogLikelihood of labels [N, positions]."""
    layers = [layer("fc", "Linear", output_size=classes, axis=-1), layer("t", "Transpose", perm=[0, 2, 1]),
              layer("logsm", "LogSoftmax", axis=1)]
    text = run_file(layers, [positions, features], data={"batch_size": batch, "seed": 0}, train={"epochs": 2},
                    solver={"solver": "adam", "base_lr": 0.05, "seed": 0}, objective={
                        "type": "Sequential", "inputs": [{"name": "network_out", "shape": [batch, classes, positions]},
                                                         {"name": "label", "shape": [batch, positions]}],
                        "layers": [layer("nll", "NegativeLogLikelihood", num_classes=classes)]})
    return lp.config.loads(text)


@pytest.mark.parametrize("classes", [2, 7])
def test_a_class_at_every_position_is_trained_and_scored_at_every_position(classes):
    """Scores [N, C, 5] and labels [N, 5] (NegativeLogLikelihood's per-position form): lp.Trainer trains and
    evaluates the run, and its held-out accuracy, confusion matrix, top-5 accuracy (7 classes) and ROC AUC (2
    classes) are those of every position, as NumPy and scikit-learn compute them from the network's outputs
    (before: evaluation failed, 'ConfusionMatrix.add: 16 predictions but 80 targets', as lp.predictions took
    position 0 alone)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((120, 5, 8)).astype(np.float32)
    y = np.argmax(x[:, :, :classes], axis=2).astype(np.int64)  # [N, 5]
    ds = lp.data.Dataset("positions", x[:80], y[:80], x[80:], y[80:], classes)
    trainer = lp.Trainer(_per_position_run(classes), backend=lp.backend("native"), dataset=ds, log=lambda m: None)
    history = trainer.fit()
    net = trainer.solver.network
    net.set_training(False)
    out = net.forward([ds.x_test])[0].to_numpy().astype(np.float64)  # [40, C, 5]
    predicted = out.argmax(axis=1)
    assert lp.predictions(out).shape == (40, 5)
    assert history[-1]["test_accuracy"] == pytest.approx(np.mean(predicted == ds.y_test), abs=1e-12)
    assert history[-1]["test_accuracy"] > 0.6 and 0 < history[-1]["train_accuracy"] <= 1
    expected = np.zeros((classes, classes), np.int64)
    np.add.at(expected, (ds.y_test.reshape(-1), predicted.reshape(-1)), 1)
    np.testing.assert_array_equal(trainer.evaluate().matrix.matrix, expected)
    if classes == 7:
        top5 = (np.argsort(-out, axis=1)[:, :5] == ds.y_test[:, None, :]).any(axis=1)
        assert history[-1]["test_top5_accuracy"] == pytest.approx(top5.mean(), abs=1e-12)
    else:
        pytest.importorskip("sklearn", reason="scikit-learn's roc_auc_score is the independent reference")
        from sklearn.metrics import roc_auc_score

        reference = roc_auc_score(ds.y_test.reshape(-1), (out[:, 1] - out[:, 0]).reshape(-1))
        assert history[-1]["test_roc_auc"] == pytest.approx(reference, abs=1e-9)


def test_a_fit_in_another_thread_stops_when_asked_and_resumes_as_the_uninterrupted_run(tmp_path):
    """trainer.fit() in a thread of its own gets no signal (Python delivers them to the main thread): the main
    thread's trainer.stop() ends it after the batch it is in, with a checkpoint, and the resumed run equals the
    uninterrupted one bit for bit."""
    import threading

    be = lp.backend("native")
    whole = lp.Trainer(_small_run(batch=32), be, out_dir=str(tmp_path / "a"), log=lambda m: None)
    whole.fit(2)

    class Pause(lp.Callback):  # the fit waits after its 5th batch until the main thread has asked it to stop
        def __init__(self):
            self.reached, self.asked, self.seen = threading.Event(), threading.Event(), 0

        def on_batch_end(self, trainer, epoch, batch, loss):
            self.seen += 1
            if self.seen == 5:
                self.reached.set()
                assert self.asked.wait(30)

    pause = Pause()
    parted = lp.Trainer(_small_run(batch=32), be, out_dir=str(tmp_path / "b"), callbacks=[pause], log=lambda m: None)
    raised = []

    def fit():
        try:
            parted.fit(2)
        except lp.train.TrainingInterrupted as e:
            raised.append(e)

    t = threading.Thread(target=fit)
    t.start()
    assert pause.reached.wait(60)
    parted.stop()
    pause.asked.set()
    t.join(60)
    assert raised and "interrupted (Trainer.stop)" in str(raised[0]) and parted.solver.iteration == 5
    resumed = lp.Trainer(_small_run(batch=32), be, out_dir=str(tmp_path / "b"),
                         resume=str(tmp_path / "b" / "checkpoint.leaf"), log=lambda m: None)
    resumed.fit(2)
    for a, b in zip(whole.solver.network.learnable_weights_data(), resumed.solver.network.learnable_weights_data()):
        np.testing.assert_array_equal(a.to_numpy(), b.to_numpy())


def test_a_stop_asked_before_fit_begins_is_kept_and_spent_by_that_fit(tmp_path):
    """trainer.stop() from another thread may land before its fit has begun: that fit stops after its first batch
    (a stop landing then was dropped, and the fit trained to the end); the fit after it trains on."""
    trainer = lp.Trainer(_small_run(batch=32), lp.backend("native"), out_dir=str(tmp_path / "a"),
                         log=lambda m: None)
    trainer.stop()
    with pytest.raises(lp.train.TrainingInterrupted, match="interrupted \\(Trainer.stop\\) at iteration 1"):
        trainer.fit(1)
    trainer.fit(1)
    assert trainer.solver.iteration == -(-len(trainer.dataset.x_train) // 32)
