"""The leafpy command as a new user meets it: `python -m leafpy` in an empty directory, with data files made by
NumPy or by hand, output directories that are not what leafpy expects, resumed runs and piped output. Each test
checks what the user sees (exit code, message, files) against an expectation worked out independently."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env
from runs import mlp, run_file

ROOT = Path(__file__).resolve().parent.parent


def leafpy(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m leafpy ARGS`` in ``cwd`` with this checkout's leafpy, as a user at a prompt would run it."""
    env = child_env()
    return subprocess.run([sys.executable, "-m", "leafpy", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def failed_cleanly(p: subprocess.CompletedProcess, *words: str) -> None:
    """Exit code 1, one `leafpy: error:` line naming ``words``, and no traceback."""
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("leafpy: error: "), p.stderr
    for w in words:
        assert w in p.stderr, (w, p.stderr)


# --- data files made by NumPy -------------------------------------------------------------------------------------
@pytest.mark.parametrize("test_fraction", ["null", "0.2"])
def test_a_fixed_split_whose_halves_differ_in_sample_shape_is_refused_before_training(tmp_path, test_fraction):
    rng = np.random.default_rng(0)
    x = rng.random((60, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 60)
    np.savez(tmp_path / "mine.npz", x_train=x[:40], y_train=y[:40], x_test=x[40:, :, :4], y_test=y[40:])
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run", "--set", "data.dataset=npz",
               "--set", "data.path=mine.npz", "--set", f"data.test_fraction={test_fraction}")
    failed_cleanly(p, "mine.npz", "x_test", "[1, 4, 8]", "x_train", "[1, 8, 8]")
    assert "epoch 1" not in p.stdout and not (tmp_path / "run" / "checkpoint.leaf").exists()


# --- evaluate and predict after training with another seed -------------------------------------------------------
def _mlp_log_probabilities(model: Path, x: np.ndarray) -> np.ndarray:
    """digits_mlp's forward pass (Flatten, Linear, ReLU, Linear, LogSoftmax) in float64 NumPy from the saved
    weights."""
    import leafpy as lp

    w = {k: v.astype(np.float64) for k, v in lp.Layer.load(lp.backend("native"), str(model)).named_weights().items()}
    h = np.maximum(x.reshape(len(x), -1) @ w["fc1/weight"].T + w["fc1/bias"], 0.0)
    z = h @ w["fc2/weight"].T + w["fc2/bias"]
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def test_predict_with_the_run_file_and_weights_trained_with_another_seed(tmp_path):
    assert leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--seed", "5", "--out", "run").returncode == 0
    x = np.random.default_rng(1).random((7, 1, 8, 8))
    np.savez(tmp_path / "new.npz", x=x)
    # new samples do not depend on the training split: the shipped run file and the weights are enough
    p = leafpy(tmp_path, "predict", "digits_mlp", "--weights", "run/model.leaf", "--input", "new.npz", "--out",
               "pred.npz")
    assert p.returncode == 0, p.stderr
    with np.load(tmp_path / "pred.npz") as f:
        outputs, classes = f["outputs"], f["classes"]
    expected = _mlp_log_probabilities(tmp_path / "run" / "model.leaf", x)
    np.testing.assert_allclose(outputs, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(classes, expected.argmax(axis=1))
    # scoring the held-out split still needs the split the weights were trained on, and says which command to run
    e = leafpy(tmp_path, "evaluate", "digits_mlp", "--weights", "run/model.leaf")
    failed_cleanly(e, "another data split", "data.seed", "leafpy evaluate ")
    assert "COMMAND" not in e.stderr


# --- run files by name and by run directory ------------------------------------------------------------------------
def test_train_a_shipped_name_beside_a_folder_of_that_name_and_continue_from_the_run_directory(tmp_path):
    """A run trained with --seed 7 continues from its run directory, whose run.yaml has the seed."""
    (tmp_path / "digits_mlp").mkdir()  # e.g. where the user keeps notes on it: holds no run file
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run", "--seed", "7")
    assert p.returncode == 0, p.stderr
    # the shipped file (seed 0) would resume on another split: refused, naming the command that continues the run
    s = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "2", "--resume", "run/checkpoint.leaf")
    failed_cleanly(s, "data.seed", "leafpy train run --resume run/checkpoint.leaf")
    # `leafpy train --help`: the config may be a run directory that leafpy train wrote
    r = leafpy(tmp_path, "train", "run", "--epochs", "2", "--out", "run", "--resume", "run/checkpoint.leaf")
    assert r.returncode == 0, r.stderr
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert [h["epoch"] for h in history] == [1, 2]
    assert history[-1]["iteration"] == 2 * -(-1438 // 32)  # digits: 1797 samples, 20% held out, batches of 32


# --- output directories ---------------------------------------------------------------------------------------------
def _read_only_directory(tmp_path: Path, kind: str) -> str:
    if kind == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes into a directory without write permission")
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
        return str(d)
    d = Path("/sys/kernel")  # sysfs: no process writes a new file there
    if not d.is_dir():
        pytest.skip("no /sys/kernel on this system")
    return str(d)


@pytest.mark.parametrize("kind", ["chmod", "sysfs"])
def test_an_output_directory_that_cannot_be_written_is_named(tmp_path, kind):
    out = _read_only_directory(tmp_path, kind)
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", out)
    failed_cleanly(p, f"--out {out}", "cannot write")


def test_an_output_path_that_is_a_file_is_named_as_one(tmp_path):
    (tmp_path / "notes").write_text("mine\n")
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "notes")
    failed_cleanly(p, "--out notes", "a file, not a directory, is there")
    assert (tmp_path / "notes").read_text() == "mine\n"


def test_an_output_path_that_is_a_dangling_link_is_named_as_one(tmp_path):
    os.symlink("gone", tmp_path / "runs")
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "runs")
    failed_cleanly(p, "--out runs: a symbolic link to gone, which does not exist; create the directory it points to")


def test_a_directory_where_the_run_writes_its_history_is_named_without_a_nonsense_file_name(tmp_path):
    """A Trainer writing into a directory where history.json is a directory: the message says to move it, not to
    write history.json/model.leaf."""
    import leafpy as lp
    from leafpy import config as run_config

    (tmp_path / "run" / "history.json").mkdir(parents=True)
    run = run_config.load(str(ROOT / "configs" / "digits_mlp.yaml"))
    trainer = lp.Trainer(run, lp.backend("native"), out_dir=str(tmp_path / "run"), log=lambda m: None)
    with pytest.raises(lp.SerializationError, match=r"history\.json: cannot write: a directory is there; move it "
                                                    r"away") as e:
        trainer.fit(epochs=1)
    assert "history.json/" not in str(e.value)


# --- the train section ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting,words", [
    ("train.log_every=often", ["train.log_every", "'often'"]),
    ("train.keep_best=two", ["train.keep_best", "'two'"]),
    ("train.keep_best=-1", ["train.keep_best", "-1"]),
    ("train.monitor=val_acc", ["train.monitor", "test_loss, test_accuracy", "'val_acc'"]),
])
def test_train_settings_of_the_wrong_kind_are_named_before_training(tmp_path, setting, words):
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run", "--set", setting)
    failed_cleanly(p, *words)
    assert "epoch 1" not in p.stdout


# --- progress output ------------------------------------------------------------------------------------------------
def test_the_epoch_line_reports_the_training_accuracy_of_the_whole_epoch(tmp_path):
    import leafpy as lp

    # a rate so small that no weight moves: every batch of the epoch is scored by the initial weights
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run", "--set", "data.batch_size=7",
               "--set", "solver.base_lr=1e-30")
    assert p.returncode == 0, p.stderr
    ds = lp.data.digits(0.2, 0)
    expected = float(np.mean(_mlp_log_probabilities(tmp_path / "run" / "model.leaf", ds.x_train).argmax(axis=1)
                             == ds.y_train))
    record = json.loads((tmp_path / "run" / "history.json").read_text())[0]
    assert record["train_accuracy"] == pytest.approx(expected, abs=1e-9)
    assert f"training accuracy {expected:.2%}" in p.stdout, p.stdout


def test_an_epoch_interrupted_late_and_resumed_reports_the_same_training_accuracy(tmp_path):
    import leafpy as lp

    class StopAfter(lp.Callback):
        def on_batch_end(self, trainer, epoch, batch, loss):
            if batch == 40:  # of 45: the last ten batches straddle the interruption
                trainer.interrupted = True

    run = lp.config.load("digits_mlp")
    whole = lp.Trainer(run, out_dir=str(tmp_path / "whole"), log=lambda m: None).fit(1)
    cut = lp.Trainer(lp.config.load("digits_mlp"), out_dir=str(tmp_path / "cut"), callbacks=[StopAfter()],
                     log=lambda m: None)
    with pytest.raises(lp.train.TrainingInterrupted):
        cut.fit(1)
    resumed = lp.Trainer(lp.config.load("digits_mlp"), out_dir=str(tmp_path / "cut"),
                         resume=str(tmp_path / "cut" / "checkpoint.leaf"), log=lambda m: None).fit(1)
    assert resumed[-1]["loss"] == whole[-1]["loss"]  # the resumed run makes the same updates, bit for bit
    assert resumed[-1]["train_accuracy"] == whole[-1]["train_accuracy"]


# --- resuming -------------------------------------------------------------------------------------------------------
def test_resuming_a_finished_run_with_no_more_epochs_says_so(tmp_path):
    assert leafpy(tmp_path, "train", "digits_mlp", "--epochs", "2", "--out", "run").returncode == 0
    run_yaml = (tmp_path / "run" / "run.yaml").read_text()
    fewer = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run", "--resume", "run/checkpoint.leaf")
    failed_cleanly(fewer, "ends epoch 2", "--epochs 3")
    assert (tmp_path / "run" / "run.yaml").read_text() == run_yaml  # the run's record is left as it was
    same = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "2", "--out", "run", "--resume", "run/checkpoint.leaf")
    assert same.returncode == 0, same.stderr
    assert "nothing left to train" in same.stdout and "--epochs 3" in same.stdout and "epoch 3" not in same.stdout
    assert len(json.loads((tmp_path / "run" / "history.json").read_text())) == 2


# --- output into a pipe ---------------------------------------------------------------------------------------------
def test_output_into_a_pipe_whose_reader_has_gone_stops_quietly(tmp_path):
    """`leafpy summary RUN | head -1`: head exits after its line; leafpy stops without a traceback."""
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "leafpy", "summary", "digits_mlp"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before leafpy writes anything
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 128 + 13  # as a process ended by SIGPIPE reports in a shell


def test_resume_as_the_interrupt_message_says_continues_in_the_checkpoints_directory(tmp_path):
    """`continue with --resume DIR/checkpoint.leaf` and no --out: the run continues in DIR, and the default
    directory runs/NAME, holding another run, is left alone."""
    other = tmp_path / "runs" / "digits-mlp"
    other.mkdir(parents=True)
    for name in ("checkpoint.leaf", "model.leaf", "history.json"):
        (other / name).write_bytes(b"another run's " + name.encode())
    assert leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "mine").returncode == 0
    r = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "2", "--resume", "mine/checkpoint.leaf")
    assert r.returncode == 0, r.stderr
    history = json.loads((tmp_path / "mine" / "history.json").read_text())
    assert [h["iteration"] for h in history] == [45, 90]  # 1438 training samples in batches of 32
    # an explicit --out that holds another run is refused unless --overwrite, as for a new run
    o = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "3", "--resume", "mine/checkpoint.leaf", "--out",
               str(other))
    failed_cleanly(o, "another run's files", "--overwrite")
    for name in ("checkpoint.leaf", "model.leaf", "history.json"):
        assert (other / name).read_bytes() == b"another run's " + name.encode()


@pytest.mark.parametrize("left", [("history.json",), ("best-epoch5.leaf", "best-epoch9.leaf"), ("training.png",)])
def test_an_out_directory_holding_some_of_another_runs_files_is_refused_and_kept(tmp_path, left):
    """A history, best epochs or a plot alone (copied, or what a run left after its model was moved) are another
    run's files too: refused unless --overwrite, which removes them."""
    other = tmp_path / "other"
    other.mkdir()
    for name in left:
        (other / name).write_bytes(b"another run's " + name.encode())
    (other / "notes.txt").write_text("the user's own")
    r = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", str(other))
    failed_cleanly(r, "another run's files", left[0], "--overwrite")
    assert all((other / name).read_bytes() == b"another run's " + name.encode() for name in left)
    w = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", str(other), "--overwrite")
    assert w.returncode == 0, w.stderr
    assert not any((other / name).exists() for name in left if name.startswith("best-epoch"))
    assert (other / "notes.txt").read_text() == "the user's own" and (other / "model.leaf").is_file()


# --- messages that say what to do -----------------------------------------------------------------------------------
def test_a_network_for_other_images_than_the_bundled_digits_names_the_data_it_needs(tmp_path):
    """alexnet.yaml has no data of its own: the fix is data of its input's shape, not a network for 8x8 digits."""
    p = leafpy(tmp_path, "train", "alexnet", "--epochs", "1", "--out", "run")
    failed_cleanly(p, "[3, 224, 224]", "dataset: npz")
    import leafpy as lp

    run = lp.config.load("digits_mlp")  # a model and its run file, as a training run leaves them
    (tmp_path / "mlp").mkdir()
    lp.config.save(run, tmp_path / "mlp" / "run.yaml")
    lp.Layer.from_config(lp.backend("native"), run.network).save(str(tmp_path / "mlp" / "model.leaf"))
    np.savez(tmp_path / "wrong.npz", x=np.zeros((3, 5)))
    q = leafpy(tmp_path, "predict", "mlp", "--input", "wrong.npz")
    failed_cleanly(q, "wrong.npz", "[5]", "give samples of shape [1, 8, 8]")
    assert "network.inputs" not in q.stderr  # trained weights: their input cannot be declared again


def test_summary_of_a_checkpoint_as_evaluate_and_predict_take_one(tmp_path):
    import leafpy as lp

    be = lp.backend("native")
    lp.Solver.from_config(be, be, lp.config.load("digits_mlp").solver).save_checkpoint(str(tmp_path / "c.leaf"))
    p = leafpy(tmp_path, "summary", "c.leaf")
    assert p.returncode == 0, p.stderr
    # Flatten 64 -> Linear 128 -> ReLU -> Linear 10: weights and biases
    assert "fc1" in p.stdout and f"total parameters: {64 * 128 + 128 + 128 * 10 + 10:,}" in p.stdout, p.stdout


def test_overwrite_leaves_none_of_the_replaced_runs_files_beside_the_new_ones(tmp_path):
    old = tmp_path / "run"
    old.mkdir()
    (old / "run.yaml").write_text("name: an older run\n")
    (old / "best-epoch9.leaf").write_bytes(b"the older run's best epoch")
    (old / "history.json").write_text(json.dumps([{"epoch": e} for e in range(1, 10)]))
    (old / "notes.txt").write_text("mine\n")
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    # a run that cannot start replaces nothing
    f = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run", "--overwrite", "--set",
               "data.dataset=npz", "--set", "data.path=missing.npz")
    failed_cleanly(f, "missing.npz")
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run", "--overwrite")
    assert p.returncode == 0, p.stderr
    assert not (old / "best-epoch9.leaf").exists()  # would pass for this run's best epoch
    assert len(json.loads((old / "history.json").read_text())) == 1
    assert (old / "notes.txt").read_text() == "mine\n"  # not a file of a run: kept


def test_a_resumed_run_keeps_the_best_epochs_of_the_whole_run(tmp_path):
    keep = ["--set", "train.keep_best=2", "--set", "train.monitor=test_loss"]
    assert leafpy(tmp_path, "train", "digits_mlp", "--epochs", "2", "--out", "run", *keep).returncode == 0
    r = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "4", "--out", "run", "--resume", "run/checkpoint.leaf",
               *keep)
    assert r.returncode == 0, r.stderr
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    best = sorted(history, key=lambda h: h["test_loss"])[:2]
    assert sorted(p.name for p in (tmp_path / "run").glob("best-epoch*.leaf")) == sorted(
        f"best-epoch{h['epoch']}.leaf" for h in best)


REGRESSION_RUN = run_file(mlp(1, log_softmax=False), [2], name="line", objective="mse",
                          data={"dataset": "npz", "path": "line.npz", "batch_size": 10})


def test_best_epochs_by_accuracy_in_a_regression_run_are_refused_before_training(tmp_path):
    x = np.random.default_rng(0).standard_normal((50, 2))
    np.savez(tmp_path / "line.npz", x=x, y=x @ np.array([1.0, -2.0]))
    (tmp_path / "line.yaml").write_text(REGRESSION_RUN)
    p = leafpy(tmp_path, "train", "line.yaml", "--out", "run", "--set", "train.keep_best=1", "--set",
               "train.monitor=test_accuracy")
    failed_cleanly(p, "train.monitor", "test_accuracy", "test_loss")
    assert "epoch 1" not in p.stdout


def test_the_readmes_configs_path_outside_the_source_tree_names_the_shipped_run_file(tmp_path):
    p = leafpy(tmp_path, "summary", "configs/digits_lenet.yaml")  # as the README writes it, in an empty directory
    failed_cleanly(p, "configs/digits_lenet.yaml", "No such file", "digits_lenet")
    assert "by its name alone" in p.stderr
    assert leafpy(tmp_path, "summary", "digits_lenet").returncode == 0  # and that name works here


def test_evaluate_scores_only_the_split_the_weights_were_trained_on(tmp_path):
    import leafpy as lp

    assert leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run", "--set",
                  "data.batch_size=7").returncode == 0
    # another seed's held-out samples are mostly this run's training samples: refused
    moved = leafpy(tmp_path, "evaluate", "run", "--set", "data.seed=3")
    failed_cleanly(moved, "another data split", "data.seed", "--set")
    # the shipped run file differs from the run only in its batch size, which does not change the split
    e = leafpy(tmp_path, "evaluate", "digits_mlp", "--weights", "run/model.leaf")
    assert e.returncode == 0, e.stderr
    ds = lp.data.digits(0.2, 0)
    predicted = _mlp_log_probabilities(tmp_path / "run" / "model.leaf", ds.x_test).argmax(axis=1)
    assert f"held-out accuracy: {np.mean(predicted == ds.y_test):.2%}" in e.stdout, e.stdout


def test_evaluating_a_run_stopped_before_its_model_was_written_names_its_checkpoint(tmp_path):
    import leafpy as lp

    be = lp.backend("native")
    run = lp.config.load("digits_mlp")
    (tmp_path / "run").mkdir()  # what an interrupted first epoch leaves: run.yaml and checkpoint.leaf
    lp.config.save(run, tmp_path / "run" / "run.yaml")
    lp.Solver.from_config(be, be, run.solver).save_checkpoint(str(tmp_path / "run" / "checkpoint.leaf"))
    p = leafpy(tmp_path, "evaluate", "run")
    failed_cleanly(p, "no model.leaf yet", "--weights run/checkpoint.leaf", "--resume run/checkpoint.leaf")
    assert leafpy(tmp_path, "evaluate", "run", "--weights", "run/checkpoint.leaf").returncode == 0


def test_a_terminal_that_reports_no_size_still_shows_the_progress_bar(tmp_path):
    """A pseudo-terminal nobody sized (0 columns, 0 rows), as some terminals in editors and CI runners give."""
    pty = pytest.importorskip("pty")
    master, slave = pty.openpty()
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "leafpy", "train", "digits_mlp", "--epochs", "1", "--out", "run"],
                            cwd=tmp_path, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    seen, deadline = b"", time.monotonic() + 120
    while time.monotonic() < deadline:
        if not select.select([master], [], [], 1.0)[0]:
            continue
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert proc.wait(timeout=120) == 0, seen.decode(errors="replace")
    text = seen.decode(errors="replace")
    assert "epoch 1/1" in text and f"/{-(-1438 // 32)} [" in text, text  # the bar: batches done / 45


# --- starting from another run's weights, and data that changed under a checkpoint -----------------------------
FIVE_CLASS_RUN = """
name: five
data: {dataset: npz, path: five.npz, batch_size: 16, test_fraction: 0.25, seed: 0}
train: {epochs: 1}
network:
  type: Sequential
  inputs: [{name: data, shape: [16, 1, 8, 8]}]
  layers:
    - {name: flat, type: Flatten}
    - {name: fc1, type: Linear, output_size: 128}
    - {name: relu1, type: ReLU}
    - {name: head, type: Linear, output_size: 5}
    - {name: logsm, type: LogSoftmax}
objective:
  type: Sequential
  inputs: [{name: network_out, shape: [16, 5]}, {name: label, shape: [16, 1]}]
  layers:
    - {name: nll, type: NegativeLogLikelihood, num_classes: 5}
solver: {solver: momentum, base_lr: 0.0, momentum: 0.9, seed: 3}
"""


def _weights(model: Path) -> dict[str, np.ndarray]:
    import leafpy as lp

    return lp.Layer.load(lp.backend("native"), str(model)).named_weights()


def test_train_with_weights_fine_tunes_from_another_runs_model(tmp_path):
    """Caffe's `train --weights`: digits_mlp trained for an epoch, then a five-class network with the same fc1 and a
    new head starts from that model. At rate 0 its saved weights are what it started from: fc1 the model's, head
    its own initial values (as a run of the same seed without --weights has them)."""
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "base")
    assert p.returncode == 0, p.stderr
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "five.npz", x=rng.random((64, 1, 8, 8)).astype(np.float32), y=rng.integers(0, 5, 64))
    (tmp_path / "five.yaml").write_text(FIVE_CLASS_RUN)
    tuned = leafpy(tmp_path, "train", "five.yaml", "--out", "tuned", "--weights", "base/model.leaf")
    assert tuned.returncode == 0, tuned.stderr
    assert ("starting from the weights in base/model.leaf; initial values for head/weight, head/bias; not in this "
            "network: fc2/weight, fc2/bias") in tuned.stdout, tuned.stdout
    fresh = leafpy(tmp_path, "train", "five.yaml", "--out", "fresh")
    assert fresh.returncode == 0, fresh.stderr
    base, got, own = (_weights(tmp_path / d / "model.leaf") for d in ("base", "tuned", "fresh"))
    for name in ("fc1/weight", "fc1/bias"):
        np.testing.assert_array_equal(got[name], base[name])
        assert not np.allclose(own[name], base[name])
    for name in ("head/weight", "head/bias"):
        np.testing.assert_array_equal(got[name], own[name])
    # a model of another network, and --weights beside --resume, are refused
    (tmp_path / "other.yaml").write_text(FIVE_CLASS_RUN.replace("fc1", "hidden").replace("head", "out"))
    failed_cleanly(leafpy(tmp_path, "train", "other.yaml", "--out", "o", "--weights", "tuned/model.leaf"),
                   "--weights tuned/model.leaf", "none of its weights", "hidden/weight")
    failed_cleanly(leafpy(tmp_path, "train", "five.yaml", "--out", "tuned", "--resume", "tuned/checkpoint.leaf",
                          "--weights", "base/model.leaf"), "give one of them")
    # a weight of another shape is an error naming it
    (tmp_path / "wide.yaml").write_text(FIVE_CLASS_RUN.replace("output_size: 128", "output_size: 64"))
    failed_cleanly(leafpy(tmp_path, "train", "wide.yaml", "--out", "w", "--weights", "base/model.leaf"),
                   "fc1/weight", "(128, 64)")


def test_resuming_after_the_data_files_changed_is_refused(tmp_path):
    """The run file says the same, but the npz file was rewritten since the checkpoint: resuming would not continue
    that run. The message says what to do; --weights starts a new run from the checkpoint."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "five.npz", x=rng.random((64, 1, 8, 8)).astype(np.float32), y=rng.integers(0, 5, 64))
    (tmp_path / "five.yaml").write_text(FIVE_CLASS_RUN.replace("base_lr: 0.0", "base_lr: 0.1"))
    assert leafpy(tmp_path, "train", "five.yaml", "--out", "run").returncode == 0
    resumed = leafpy(tmp_path, "train", "five.yaml", "--out", "run", "--resume", "run/checkpoint.leaf", "--epochs", "2")
    assert resumed.returncode == 0, resumed.stderr  # the same data: it continues
    y = np.load(tmp_path / "five.npz")["y"]
    np.savez(tmp_path / "five.npz", x=np.load(tmp_path / "five.npz")["x"], y=(y + 1) % 5)  # labels fixed since
    p = leafpy(tmp_path, "train", "five.yaml", "--out", "run", "--resume", "run/checkpoint.leaf", "--epochs", "3")
    failed_cleanly(p, "not those the checkpoint run/checkpoint.leaf was trained on", "--weights run/checkpoint.leaf")
    p = leafpy(tmp_path, "train", "five.yaml", "--out", "again", "--weights", "run/checkpoint.leaf")
    assert p.returncode == 0 and "starting from the weights in run/checkpoint.leaf" in p.stdout, p.stderr


def test_a_cosine_schedule_with_warm_up_from_the_run_file(tmp_path):
    """solver: {lr_policy: cosine, max_iter, min_lr, warmup_iter, warmup_factor} in a hand-written run file: each
    epoch's recorded rate is the formula's at its last update, the checkpoint keeps the settings, and a run stopped
    after epoch 1 and resumed ends with the weights of the uninterrupted run."""
    import math

    import leafpy as lp

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "five.npz", x=rng.random((64, 1, 8, 8)).astype(np.float32), y=rng.integers(0, 5, 64))
    sched = "{solver: momentum, base_lr: 0.2, momentum: 0.9, seed: 3, lr_policy: cosine, max_iter: 9, " \
            "min_lr: 0.01, warmup_iter: 2, warmup_factor: 0.5}"
    (tmp_path / "five.yaml").write_text(FIVE_CLASS_RUN.replace(
        "{solver: momentum, base_lr: 0.0, momentum: 0.9, seed: 3}", sched))
    whole = leafpy(tmp_path, "train", "five.yaml", "--out", "whole", "--epochs", "3")
    assert whole.returncode == 0, whole.stderr

    def rate(it):  # 48 training samples at batch 16: 3 updates an epoch
        cos = lambda t: 0.01 + 0.19 * (1 + math.cos(math.pi * min(t, 9) / 9)) / 2  # noqa: E731
        return cos(2) * (0.5 + 0.5 * it / 2) if it < 2 else cos(it)

    history = json.loads((tmp_path / "whole" / "history.json").read_text())
    assert [r["iteration"] for r in history] == [3, 6, 9]
    assert [r["learning_rate"] for r in history] == pytest.approx([rate(2), rate(5), rate(8)])
    saved = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"),
                                      str(tmp_path / "whole" / "checkpoint.leaf")).config
    assert (saved.lr_policy, saved.min_lr, saved.warmup_iter, saved.warmup_factor) == ("cosine", 0.01, 2, 0.5)
    assert leafpy(tmp_path, "train", "five.yaml", "--out", "cut", "--epochs", "1").returncode == 0
    resumed = leafpy(tmp_path, "train", "five.yaml", "--out", "cut", "--resume", "cut/checkpoint.leaf", "--epochs", "3")
    assert resumed.returncode == 0, resumed.stderr
    a, b = _weights(tmp_path / "whole" / "model.leaf"), _weights(tmp_path / "cut" / "model.leaf")
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_adamw_with_a_cosine_schedule_trains_digits_from_the_command_line(tmp_path):
    """The configuration many users start from: AdamW, decoupled weight decay 0.05, a cosine schedule to max_iter
    with a warm-up, set from the command line; two epochs of digits_mlp learn (92% here; momentum SGD reaches 98%
    in 20 epochs), and the run file records the settings."""
    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "2", "--out", "r", "--set", "solver.solver=adamw",
               "--set", "solver.base_lr=0.003", "--set", "solver.weight_decay=0.05", "--set", "solver.lr_policy=cosine",
               "--set", "solver.max_iter=90", "--set", "solver.warmup_iter=10")
    assert p.returncode == 0, p.stderr
    accuracy = float(p.stdout.split("held-out accuracy: ")[1].split("%")[0])
    assert accuracy > 85.0, p.stdout
    saved = (tmp_path / "r" / "run.yaml").read_text()
    for text in ("solver: adamw", "lr_policy: cosine", "warmup_iter: 10", "max_iter: 90"):
        assert text in saved, saved


def test_a_model_file_alone_predicts_as_its_run_directory_does(tmp_path):
    """A model.leaf copied away from its run (no run.yaml beside it) predicts from its own records: the
    normalisation and class names it was trained with, the same outputs as through the run directory."""
    import shutil

    import leafpy as lp

    p = leafpy(tmp_path, "train", "digits_mlp", "--epochs", "1", "--out", "run", "--set", "data.normalize=auto")
    assert p.returncode == 0, p.stderr
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(tmp_path / "run" / "model.leaf", tmp_path / "elsewhere" / "model.leaf")
    x = lp.data.digits().x_test[:30]
    np.savez(tmp_path / "x.npz", x=x)
    via_run = leafpy(tmp_path, "predict", "run", "--input", "x.npz", "--out", "a.npz")
    alone = leafpy(tmp_path, "predict", "elsewhere/model.leaf", "--input", "x.npz", "--out", "b.npz")
    assert via_run.returncode == 0 and alone.returncode == 0, alone.stderr
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    np.testing.assert_allclose(b["outputs"], a["outputs"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(b["classes"], a["classes"])
    # the model's own normalisation was applied: without it the outputs differ
    net = lp.Layer.load(lp.backend("native"), tmp_path / "elsewhere" / "model.leaf")
    raw = net.forward([x.astype(np.float32)])[0].to_numpy()
    assert np.abs(raw - b["outputs"]).max() > 1e-3
