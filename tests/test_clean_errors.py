"""What once ended in a raw traceback (or a silent kill) now ends in one clear message and a non-zero exit: crafted
trainer states in checksummed checkpoints, `leafpy summary` of what is not a model file, null settings in a run
file, a damaged history, a full disk while the plot is written, wrong arguments to the Python API, and a SIGTERM
while the command starts up."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env

import leafpy as lp
from tests.hostile.corpus import CRAFTED_TRAINER_STATES, edited_checkpoint, make_checkpoint
from tests.test_user_paths import ROOT, failed_cleanly, leafpy


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A digits MLP trained for one epoch: its run directory (run.yaml, model.leaf, checkpoint.leaf)."""
    work = tmp_path_factory.mktemp("trained")
    p = leafpy(work, "train", "digits_mlp", "--epochs", "1", "--out", "run")
    assert p.returncode == 0, p.stderr
    return work / "run"


# --- crafted trainer state in a checksummed checkpoint ------------------------------------------------------------
@pytest.mark.parametrize("name", [*CRAFTED_TRAINER_STATES, "sample-past-the-epoch"])
def test_resuming_a_checkpoint_with_an_impossible_trainer_state_is_refused(trained, tmp_path, name):
    state = CRAFTED_TRAINER_STATES.get(name, {"sample": 10**9})
    edited_checkpoint(trained / "checkpoint.leaf", tmp_path / "ckpt.leaf", state)
    p = leafpy(tmp_path, "train", "digits_mlp", "--resume", "ckpt.leaf", "--epochs", "3", "--out", "again")
    key = next(iter(state)) if name != "more-correct-than-scored" else "correct predictions"
    failed_cleanly(p, "ckpt.leaf", key)
    assert "training accuracy" not in p.stdout and "epoch 2/3" not in p.stdout


def test_a_random_layer_count_past_its_range_is_refused_when_loaded(tmp_path):
    good = tmp_path / "good.leaf"
    make_checkpoint(good, dropout=True)
    bad = edited_checkpoint(good, tmp_path / "bad.leaf", rngCalls=[2**64 - 1])
    be = lp.backend("native")
    with pytest.raises(lp.SerializationError, match="bad.leaf: .*random must be a list"):
        lp.Solver.load_checkpoint(be, be, str(bad))


# --- summary of what is not a model ---------------------------------------------------------------------------
def test_summary_of_a_missing_file_a_fifo_or_a_symlink_loop_is_a_clear_error(tmp_path):
    os.mkfifo(tmp_path / "fifo.leaf")
    os.symlink("loop.leaf", tmp_path / "loop.leaf")
    for name, words in (("missing.leaf", "No such file"), ("fifo.leaf", "not a regular file"),
                        ("loop.leaf", "symbolic links")):
        p = leafpy(tmp_path, "summary", name, timeout=30)
        failed_cleanly(p, name, words)


def test_summary_of_a_bare_linear_layer_prints_its_row(tmp_path):
    layer = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    layer.forward([np.ones((2, 4), np.float32)])
    layer.save(str(tmp_path / "bare.leaf"))
    p = leafpy(tmp_path, "summary", "bare.leaf")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert [line.split()[:2] for line in p.stdout.splitlines() if line.startswith("fc ")] == [["fc", "Linear"]]
    assert "first forward pass" in p.stdout


# --- run files and the run directory ----------------------------------------------------------------------------
def test_null_batch_size_or_epochs_is_refused_naming_the_key(tmp_path):
    p = leafpy(tmp_path, "train", "digits_mlp", "--set", "data.batch_size=null", "--out", "run")
    failed_cleanly(p, "data.batch_size", "null")
    text = (ROOT / "configs" / "digits_mlp.yaml").read_text().replace("epochs: 20", "epochs: null")
    assert "epochs: null" in text
    (tmp_path / "run.yaml").write_text(text)
    failed_cleanly(leafpy(tmp_path, "train", "run.yaml", "--out", "run"), "train.epochs", "null")


@pytest.mark.parametrize("history, words", [
    (json.dumps([{"epoch": "x"}]), "not a list of epoch records"),
    ("[" * 100_000, "maximum recursion depth"),  # (nested past Python's limit)
    (None, "larger than 64 MB"),  # (a sparse file: nothing of it written)
], ids=["a text epoch", "nested lists", "over the size cap"])
def test_a_damaged_history_is_set_aside_when_resuming(trained, tmp_path, history, words):
    """A damaged history.json is not the run's state (the checkpoint is): a warning, and the history starts again,
    as for a history that is not JSON."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("run.yaml", "checkpoint.leaf"):
        (run / name).write_bytes((trained / name).read_bytes())
    if history is None:
        with open(run / "history.json", "wb") as f:
            f.truncate(64 * 2**20 + 1)
    else:
        (run / "history.json").write_text(history)
    p = leafpy(tmp_path, "train", "run", "--resume", "run/checkpoint.leaf", "--epochs", "2")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "history.json cannot be read" in p.stdout + p.stderr and words in p.stdout + p.stderr
    assert [h["epoch"] for h in json.loads((run / "history.json").read_text())] == [2]


def test_resuming_with_another_solver_seed_is_refused_and_the_run_keeps_its_own(trained, tmp_path):
    """The seed made the checkpoint's initial weights and random streams: a resume naming another is refused (the
    run.yaml it would write names a seed the run never used), and the run's files are left as they were."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("run.yaml", "checkpoint.leaf"):
        (run / name).write_bytes((trained / name).read_bytes())
    recorded = (run / "run.yaml").read_text()
    p = leafpy(tmp_path, "train", "run", "--resume", "run/checkpoint.leaf", "--epochs", "2", "--set", "solver.seed=7")
    failed_cleanly(p, "solver.seed", "checkpoint.leaf", "seed 0", "7")
    assert (run / "run.yaml").read_text() == recorded
    q = leafpy(tmp_path, "train", "run", "--resume", "run/checkpoint.leaf", "--epochs", "2")
    assert q.returncode == 0, q.stderr
    import yaml

    assert yaml.safe_load((run / "run.yaml").read_text())["solver"]["seed"] == 0


def test_a_full_disk_while_the_plot_is_written_keeps_the_run(tmp_path, monkeypatch, capsys):
    figure = pytest.importorskip("matplotlib.figure", reason="the plot needs matplotlib (the cli extra)")
    from leafpy import cli

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(figure.Figure, "savefig", no_space)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "digits_mlp", "--epochs", "1", "--out", "run"]) == 0
    err = capsys.readouterr().err
    assert "training.png was not written (No space left on device)" in err and "model" in err
    assert not (tmp_path / "run" / "training.png").exists()
    assert [f for f in os.listdir(tmp_path / "run") if f.startswith(".")] == []
    lp.Layer.load(lp.backend("native"), str(tmp_path / "run" / "model.leaf"))


# --- the Python API -----------------------------------------------------------------------------------------------
def _calls():
    be = lp.backend("native")
    run = lp.config.load("digits_mlp")
    net = lp.Layer.from_config(be, run.network)
    net.forward([np.zeros((2, 1, 8, 8), np.float32)])
    t = lp.SharedTensor.from_numpy(np.zeros(3, np.float32))
    return {"Trainer(out_dir=5)": (lambda: lp.Trainer(run, out_dir=5), "out_dir"),
            "backward(None)": (lambda: net.backward(None), "list of output gradients"),
            "SharedTensor.read(None)": (lambda: t.read(None), "expected a backend"),
            "npz(None)": (lambda: lp.data.npz(None), "npz: path"),
            "read_idx(5)": (lambda: lp.data.read_idx(5), "read_idx: path")}


@pytest.mark.parametrize("call", list(_calls()))
def test_wrong_arguments_to_the_python_api_are_leafpy_errors(call):
    fn, words = _calls()[call]
    with pytest.raises(lp.LeafpyError, match=words):
        fn()


# --- a stop signal while the command starts up ----------------------------------------------------------------
def _catches(pid: int, sig: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (sig - 1)))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc to see the handler in place")
def test_sigterm_during_start_up_ends_with_a_message_and_code_130(tmp_path):
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-m", "leafpy", "train", "digits_mlp", "--epochs", "1", "--out", "run"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while proc.poll() is None and not _catches(proc.pid, signal.SIGTERM) and time.time() < deadline:
        time.sleep(0.001)  # until the first handler of SIGTERM is in place: the command is starting up
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert "leafpy: interrupted (SIGTERM)" in err and "Traceback" not in err
    assert "training digits-mlp" not in out, "the signal came after start-up"
