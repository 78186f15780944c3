"""A new user's first hour with the leafpy command: run names that are paths, flat data for an image network, a
diverging run, a Softmax before NegativeLogLikelihood, the Trainer's log, webgpu on a CPU adapter, and a run
directory moved together with its data. Each runs `python -m leafpy` in a temporary directory, as at a prompt."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml
from conftest import backend_or_skip, child_env
from runs import mlp, run_file
from test_user_paths import ROOT, failed_cleanly, leafpy

import leafpy as lp


def _run_file(path, **changes) -> str:
    """The shipped digits_mlp run file, with top-level sections changed, written to ``path``."""
    with open(lp.config.resolve("digits_mlp")) as f:
        doc = yaml.safe_load(f)
    doc.update(changes)
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("name", ["../../escape", "ABSOLUTE", "..", "a\\b"])
def test_a_run_name_that_is_a_path_is_refused_and_writes_nothing(tmp_path, name):
    absolute = tmp_path / "absolute-escape"  # this test's own: a path in /tmp may be another run's, or a user's
    name = str(absolute) if name == "ABSOLUTE" else name
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    run = _run_file(cwd / "run.yaml", name=name)
    p = leafpy(cwd, "train", run, "--epochs", "1")
    failed_cleanly(p, "name:", "is a path", "--out")
    assert not (tmp_path / "escape").exists() and not absolute.exists()
    assert sorted(os.listdir(cwd)) == ["run.yaml"]


def test_flat_samples_for_an_image_network_get_a_reshape_hint_for_any_number_of_samples(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "flat.npz", x=rng.random((1000, 64), dtype=np.float32), y=rng.integers(0, 10, 1000))
    p = leafpy(tmp_path, "train", "digits_lenet", "--set", "data.dataset=npz", "--set", "data.path=flat.npz",
               "--epochs", "1")
    failed_cleanly(p, "x.reshape(-1, 1, 8, 8)")
    assert "reshape(64" not in p.stderr and "reshape(1000" not in p.stderr


def test_a_diverging_run_reports_once_without_numpy_warnings(tmp_path):
    p = leafpy(tmp_path, "train", "digits_mlp", "--set", "solver.base_lr=1e4", "--epochs", "1", "--out", "run")
    failed_cleanly(p, "the loss became", "try a smaller base_lr")
    assert "RuntimeWarning" not in p.stderr and "site-packages" not in p.stderr, p.stderr


def test_a_softmax_before_negative_log_likelihood_is_refused_naming_log_softmax(tmp_path):
    with open(lp.config.resolve("digits_mlp")) as f:
        doc = yaml.safe_load(f)
    last = doc["network"]["layers"][-1]
    assert last["type"] == "LogSoftmax"
    last["type"] = "Softmax"
    (tmp_path / "softmax.yaml").write_text(yaml.safe_dump(doc))
    p = leafpy(tmp_path, "train", "softmax.yaml", "--epochs", "1")
    failed_cleanly(p, "NegativeLogLikelihood", "log-probabilities", "Softmax", "LogSoftmax")


@pytest.mark.parametrize("k", [1, 3])
def test_the_trainers_log_receives_the_progress_lines(tmp_path, k):
    """A line each log_every updates, once each: with minibatch_size k, k calls make an update."""
    import dataclasses

    run = lp.config.load("digits_mlp")
    run.solver = dataclasses.replace(run.solver, minibatch_size=k)
    lines: list[str] = []
    trainer = lp.Trainer(run, lp.backend("native"), log=lines.append, log_every=10)
    trainer.fit(epochs=2)
    iterations = [line for line in lines if line.startswith("iteration ")]
    updates = 2 * trainer.batches_per_epoch // k
    assert [int(line.split()[1].rstrip(":")) for line in iterations] == list(range(10, updates + 1, 10))
    assert any(line.startswith("epoch 2/2") for line in lines)


def test_a_progress_line_reports_the_rate_its_last_update_used(tmp_path):
    """A step policy that halves the rate every 10 updates, and a progress line every 10: the line after update 10
    reports the rate of updates 1-10 (0.1), as the epoch line and the history do, not the next one's (0.05)."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(100, 4)).astype(np.float32), y=np.arange(100) % 3)
    (tmp_path / "step.yaml").write_text(run_file(
        mlp(3), [4], data={"dataset": "npz", "path": str(tmp_path / "d.npz"), "batch_size": 8, "test_fraction": 0.2,
                           "seed": 0},
        solver={"solver": "momentum", "base_lr": 0.1, "momentum": 0.0, "lr_policy": "step", "stepsize": 10,
                "gamma": 0.5, "seed": 0}))
    run = lp.config.load(str(tmp_path / "step.yaml"))
    lines: list[str] = []
    history = lp.Trainer(run, lp.backend("native"), log=lines.append, log_every=5).fit(epochs=2)  # 10 updates an epoch
    used = {it: 0.1 * 0.5 ** ((it - 1) // 10) for it in (5, 10, 15, 20)}  # the rate of update `it` (iteration it - 1)
    reported = {int(line.split()[1].rstrip(":")): float(line.split("lr ")[1]) for line in lines
                if line.startswith("iteration ")}
    assert reported == pytest.approx(used)
    assert [r["learning_rate"] for r in history] == pytest.approx([used[10], used[20]])


def test_progress_lines_go_to_stderr_without_a_log(capsys):
    run = lp.config.load("digits_mlp")
    trainer = lp.Trainer(run, lp.backend("native"), log_every=20)
    trainer.fit(epochs=1)
    out, err = capsys.readouterr()
    assert "iteration 20:" in err and "iteration 20:" not in out
    assert "epoch 1/1" in out


def test_webgpu_names_its_adapter_and_says_when_it_is_a_cpu_emulator(tmp_path):
    be = backend_or_skip("webgpu")
    env = {k: v for k, v in child_env().items() if k != "XDG_RUNTIME_DIR"}  # as in a container or over ssh
    p = subprocess.run([sys.executable, "-m", "leafpy", "train", "digits_mlp", "--backend", "webgpu", "--epochs",
                        "1", "--out", "run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert f"on webgpu [{be.adapter_name}]" in p.stdout
    assert ("a CPU emulation of a GPU" in p.stdout) == (be.adapter.info.get("adapter_type") == "CPU")
    assert "XDG_RUNTIME_DIR" not in p.stderr, p.stderr


def test_a_run_directory_moves_with_its_data(tmp_path):
    rng = np.random.default_rng(0)
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    x = rng.random((120, 1, 8, 8), dtype=np.float32)
    np.savez(project / "data" / "blobs.npz", x=x, y=(x.mean(axis=(1, 2, 3)) > 0.5).astype(np.int64))
    p = leafpy(project, "train", "digits_mlp", "--set", "data.dataset=npz", "--set", "data.path=data/blobs.npz",
               "--set", "data.test_fraction=0.25", "--epochs", "1", "--out", "runs/a")
    assert p.returncode == 0, p.stderr
    recorded = yaml.safe_load((project / "runs" / "a" / "run.yaml").read_text())["data"]["path"]
    assert recorded == os.path.join("..", "..", "data", "blobs.npz")
    trained = leafpy(project, "evaluate", "runs/a")
    moved = tmp_path / "elsewhere" / "project2"
    shutil.move(str(project), str(moved))
    for cwd, target in ((tmp_path, str(moved / "runs" / "a")), (moved / "runs", "a/model.leaf")):
        p = leafpy(cwd, "evaluate", target)
        assert p.returncode == 0, p.stderr
        assert p.stdout.splitlines()[-2:] == trained.stdout.splitlines()[-2:]  # the same held-out scores


def test_an_absolute_data_path_stays_absolute(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.random((80, 1, 8, 8), dtype=np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=rng.integers(0, 10, 80))
    p = leafpy(tmp_path, "train", "digits_mlp", "--set", "data.dataset=npz", "--set",
               f"data.path={tmp_path / 'd.npz'}", "--set", "data.test_fraction=0.25", "--epochs", "1", "--out", "r")
    assert p.returncode == 0, p.stderr
    assert yaml.safe_load((tmp_path / "r" / "run.yaml").read_text())["data"]["path"] == str(tmp_path / "d.npz")


def test_messages_name_installable_packages():
    """Install hints name packages on the package index (leafpy's own distribution is installed from a clone)."""
    for path in ("leafpy/backends/cuda/__init__.py", "leafpy/backends/webgpu/__init__.py", "leafpy/data.py",
                 "leafpy/cli.py", "leafpy/distributed/group.py"):
        text = (ROOT / path).read_text()
        assert "pip install 'leafpy-dl" not in text and 'pip install \\"leafpy-dl' not in text, path
