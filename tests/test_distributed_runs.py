"""Data-parallel runs as users launch them (``leafpy train --nproc N``, ``mpiexec -n N``), each checked against one
process on the global batch, the promise of docs/distributed-training.md: stop signals that reach only the
launcher, a last global batch with fewer samples than ranks, the held-out scores of a run whose BatchNorm
statistics are each rank's own, and checkpoints taken with gradient accumulation pending, resumed on other numbers
of ranks."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env, terminal_signals

import leafpy as lp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
                               reason="needs mpi4py and mpiexec (pip install 'leafpy-dl[dist]': mpi4py, mpich)")
ENV = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1",
           OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # Open MPI refuses root otherwise


def write_run(tmp_path, samples: int, *, batch_norm: bool = False, solver: str = "") -> str:
    """A run file over an npz file of ``samples`` training samples (6 features, 3 classes) and 10 held-out ones."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples + 10, 6)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] * x[:, 2] > 0).astype(np.int64) + (x[:, 3] > 1)
    np.savez(tmp_path / "data.npz", x_train=x[:samples], y_train=y[:samples], x_test=x[samples:], y_test=y[samples:])
    bn = ["    - {name: bn1, type: BatchNorm, momentum: 0.3}"] if batch_norm else []
    text = "\n".join([
        "name: tiny",
        f"data: {{dataset: npz, path: {tmp_path / 'data.npz'}, batch_size: 4, seed: 0}}",
        "network:",
        "  type: Sequential",
        "  inputs: [{name: data, shape: [4, 6]}]",
        "  layers:",
        f"    - {{name: fc1, type: Linear, output_size: 12, bias: {str(not batch_norm).lower()}}}",
        *bn,
        "    - {name: act, type: TanH}",
        "    - {name: fc2, type: Linear, output_size: 3}",
        "    - {name: logsm, type: LogSoftmax}",
        "objective:",
        "  type: Sequential",
        "  inputs: [{name: out, shape: [4, 3]}, {name: label, shape: [4, 1]}]",
        "  layers: [{name: nll, type: NegativeLogLikelihood, num_classes: 3}]",
        "solver: {" + (solver or "solver: momentum, base_lr: 0.05, momentum: 0.9, weight_decay: 0.001, "
                                  "clip_gradients: 0.5, lr_policy: step, gamma: 0.5, stepsize: 7, seed: 0") + "}",
        "train: {log_every: 0}",
        ""])
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def leafpy(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leafpy", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def trained(out_dir) -> list[np.ndarray]:
    net = lp.Layer.load(lp.backend("native"), str(out_dir / "model.leaf"))
    return [w.to_numpy() for w in net.learnable_weights_data()]


def survivors(marker: str) -> list[int]:
    """The processes (launcher, mpiexec, ranks) whose command line names ``marker`` (a test's own directory)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def job(cmd: list[str], marker, timeout: float = 60) -> subprocess.CompletedProcess:
    """``cmd`` (a launcher and its ranks) run to its end; then every process naming ``marker`` (the test's own
    directory) is killed, a launcher's children in sessions of their own too."""
    try:
        return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    finally:
        for _ in range(20):
            found = survivors(str(marker))
            if not found:
                break
            for pid in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)


@needs_mpi
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the job's processes through /proc")
@pytest.mark.parametrize("signum,resume_ranks", [(signal.SIGTERM, 3), (signal.SIGINT, 1)])
def test_a_stop_signal_to_the_nproc_launcher_alone_stops_every_rank_with_one_checkpoint(tmp_path, signum,
                                                                                       resume_ranks):
    """`kill PID` (a scheduler, `timeout`) reaches the `leafpy train --nproc 2` process only, not mpiexec or the
    ranks: the launcher passes it on, every rank stops at the same step, rank 0 writes one checkpoint, the job ends
    with 130 and no process of it is left; the checkpoint, taken mid-epoch, continues on ``resume_ranks`` ranks at
    the same global batch to the weights one process makes on that global batch. (Before, a SIGTERM ended the
    launcher at once and left mpiexec and the ranks training on; a SIGINT was not passed on for 60 s, then mpiexec
    was killed, with no checkpoint.)"""
    run = write_run(tmp_path, 60)
    epochs = 400  # far more than the run reaches before the signal
    proc = subprocess.Popen([sys.executable, "-m", "leafpy", "train", run, "--out", str(tmp_path / "cut"),
                             "--epochs", str(epochs), "--nproc", "2", "--set", "data.batch_size=6"], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=terminal_signals)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("epoch 3/"):
                proc.send_signal(signum)  # the launcher alone
                break
        sent = time.monotonic()
        out, err = proc.communicate(timeout=90)
        took = time.monotonic() - sent
        time.sleep(0.5)
        left = survivors(str(tmp_path))
    finally:
        for pid in [proc.pid] * (proc.poll() is None) + survivors(str(tmp_path)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    out = "".join(lines) + out
    assert proc.returncode == 130, (proc.returncode, out[-2000:], err[-2000:])
    assert took < 30, took
    assert not left, f"processes of the job still running: {left}"
    assert (out + err).count("checkpoint saved to") == 1, (out[-2000:], err[-2000:])
    ckpt = tmp_path / "cut" / "checkpoint.leaf"
    state = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"), str(ckpt)).trainer_state
    stopped_in = int(state["epoch"]) + 1  # the epoch it stopped in (1-based)
    assert 3 <= stopped_in < epochs, state
    # finish that epoch on another number of ranks at the same global batch (12), and in one process
    per_rank = str(12 // resume_ranks)
    resumed = leafpy("train", run, "--out", str(tmp_path / "cut"), "--resume", str(ckpt), "--epochs",
                     str(stopped_in), "--set", f"data.batch_size={per_rank}",
                     *(["--nproc", str(resume_ranks)] if resume_ranks > 1 else []))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    one = leafpy("train", run, "--out", str(tmp_path / "one"), "--epochs", str(stopped_in), "--set",
                 "data.batch_size=12")
    assert one.returncode == 0, one.stderr[-3000:]
    start = trained(tmp_path / "one")
    for got, want in zip(trained(tmp_path / "cut"), start):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


class _Rank:
    """Rank ``rank`` of ``size``, for the sharding functions (which read only these two)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size


@pytest.mark.parametrize("samples,batch,size", [(97, 4, 3), (97, 3, 2), (25, 4, 2), (2, 4, 3), (30, 5, 3)])
def test_every_sample_of_an_epoch_goes_to_exactly_one_rank(samples, batch, size):
    """Each global batch of size x batch samples (in the epoch's order) is split among the ranks, the last one too,
    even when it has fewer samples than there are ranks (some ranks' shares are then empty): nothing is left out,
    as one process on the global batch leaves nothing out. (Before, a last batch of fewer samples than ranks was
    dropped from the epoch.)"""
    from leafpy import distributed as dist

    order = np.random.default_rng(0).permutation(samples)
    shares = [list(dist.shard_indices(order, batch, _Rank(r, size))) for r in range(size)]
    step = batch * size
    expected = [order[i:i + step] for i in range(0, samples, step)]
    for r in range(size):
        assert len(shares[r]) == len(expected), f"rank {r}: {len(shares[r])} batches, one process: {len(expected)}"
    for b, chunk in enumerate(expected):
        parts = [shares[r][b] for r in range(size)]
        np.testing.assert_array_equal(np.concatenate(parts), chunk)  # in order: rank 0 first
        assert max(map(len, parts)) - min(map(len, parts)) <= 1 or len(chunk) == step
        assert len(parts[0]) > 0  # rank 0, which reports the loss, always has samples


@needs_mpi
def test_three_ranks_train_a_last_batch_smaller_than_the_ranks_as_one_process(tmp_path):
    """50 samples at 3 ranks x 4: each epoch ends with a global batch of 2 samples, fewer than the ranks; with
    minibatch_size 2 (5 batches an epoch, an odd number) and synchronised BatchNorm, 3 epochs of `leafpy train
    --nproc 3` make the updates, running statistics included, of one process at batch 12, the 2-sample batch
    included. (Before, that batch was dropped: one update fewer and an accumulation phase shifted each epoch; the
    weights ended 7e-3 away.) The epochs' training losses and accuracies in the history are the one process's too."""
    run = write_run(tmp_path, 50, batch_norm=True,
                    solver="solver: adam, base_lr: 0.01, weight_decay: 0.001, clip_gradients: 1.0, "
                           "minibatch_size: 2, lr_policy: multistep, stepvalues: [3, 5], gamma: 0.5, seed: 0")
    three = leafpy("train", run, "--out", str(tmp_path / "three"), "--epochs", "3", "--nproc", "3",
                   "--set", "train.sync_batch_norm=true")
    assert three.returncode == 0, three.stderr[-3000:]
    one = leafpy("train", run, "--out", str(tmp_path / "one"), "--epochs", "3", "--set", "data.batch_size=12")
    assert one.returncode == 0, one.stderr[-3000:]
    for got, want in zip(trained(tmp_path / "three"), trained(tmp_path / "one")):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    state = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"),
                                      str(tmp_path / "three" / "checkpoint.leaf"))
    assert state.iteration == 7  # 15 batches, 2 per update (the last call stays pending)
    # the training loss and accuracy of each epoch are the global batches' (rank 0's own share's before)
    got, want = (json.loads((tmp_path / d / "history.json").read_text()) for d in ("three", "one"))
    assert [h["loss"] for h in got] == pytest.approx([h["loss"] for h in want], rel=1e-5)
    assert [h["train_accuracy"] for h in got] == pytest.approx([h["train_accuracy"] for h in want], abs=1e-9)


def held_out_loss(out_dir, data) -> float:
    """The NLL mean of the saved model (Linear without bias, BatchNorm on its running statistics, TanH, Linear,
    LogSoftmax) on the held-out samples, in NumPy float64."""
    net = lp.Layer.load(lp.backend("native"), str(out_dir / "model.leaf"))
    w = {k: v.astype(np.float64) for k, v in net.named_weights().items()}
    h = data["x_test"].astype(np.float64) @ w["fc1/weight"].T
    h = (h - w["bn1/running_mean"]) / np.sqrt(w["bn1/running_var"] + 1e-5) * w["bn1/weight"] + w["bn1/bias"]
    z = np.tanh(h) @ w["fc2/weight"].T + w["fc2/bias"]
    z -= z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(z)), data["y_test"]].mean())


@needs_mpi
def test_held_out_scores_of_a_run_with_per_rank_batch_norm_are_those_of_the_saved_model(tmp_path):
    """Without sync_batch_norm each rank moves BatchNorm's running statistics towards its own batches; the model
    saved is rank 0's. The held-out loss `leafpy train --nproc 2` reports (and writes in its history) is that
    model's, as `leafpy evaluate` and a NumPy forward pass of model.leaf give it. (Before, every rank scored its
    share of the held-out set with its own statistics: a loss of no saved model, here 0.04 away.)"""
    run = write_run(tmp_path, 60, batch_norm=True)
    two = leafpy("train", run, "--out", str(tmp_path / "two"), "--epochs", "3", "--nproc", "2")
    assert two.returncode == 0, two.stderr[-3000:]
    reported = float(two.stdout.split("held-out loss:")[1].split()[0])
    want = held_out_loss(tmp_path / "two", np.load(tmp_path / "data.npz"))
    assert reported == pytest.approx(want, abs=2e-6)
    history = json.loads((tmp_path / "two" / "history.json").read_text())
    assert history[-1]["test_loss"] == pytest.approx(want, rel=1e-5)
    evaluated = leafpy("evaluate", str(tmp_path / "two"))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert float(evaluated.stdout.split("held-out loss:")[1].split()[0]) == pytest.approx(want, abs=2e-6)


ACCUMULATING = ("solver: adam, base_lr: 0.01, weight_decay: 0.001, clip_gradients: 1.0, minibatch_size: 2, "
                "lr_policy: multistep, stepvalues: [3, 5], gamma: 0.5, seed: 0")


@needs_mpi
def test_a_checkpoint_with_pending_accumulation_resumes_on_other_numbers_of_ranks(tmp_path):
    """minibatch_size 2 and 5 global batches an epoch (50 samples, 12 a batch): the checkpoint after epoch 1 has one
    accumulated call pending. Written by 3 ranks, it resumes on 3, 2 and 1 ranks (12 samples a global batch each
    time) to the weights of one process trained 3 epochs without a stop. (Before, the checkpoint held rank 0's
    share of the pending gradients only, and every resumed run ended 1e-2 away.)"""
    run = write_run(tmp_path, 50, batch_norm=True, solver=ACCUMULATING)

    def train(out: str, epochs: int, ranks: int, *extra: str) -> None:
        p = leafpy("train", run, "--out", str(tmp_path / out), "--epochs", str(epochs), "--set",
                   f"data.batch_size={12 // ranks}", "--set", "train.sync_batch_norm=true",
                   *(["--nproc", str(ranks)] if ranks > 1 else []), *extra)
        assert p.returncode == 0, p.stderr[-3000:]

    train("one", 3, 1)
    train("cut", 1, 3)
    ckpt = tmp_path / "cut" / "checkpoint.leaf"
    assert lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"), str(ckpt)).snapshot()[
        "pending_calls"] == 1
    want = trained(tmp_path / "one")
    for ranks in (3, 2, 1):
        shutil.copytree(tmp_path / "cut", tmp_path / f"resumed{ranks}")
        train(f"resumed{ranks}", 3, ranks, "--resume", str(tmp_path / f"resumed{ranks}" / "checkpoint.leaf"))
        for got, w in zip(trained(tmp_path / f"resumed{ranks}"), want):
            np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5, err_msg=f"resumed on {ranks} ranks")


def _differently(tmp_path, change: str) -> tuple[str, str]:
    """Two run files (each in its own directory, over its own copy of the data): rank 1's differs by ``change``."""
    runs = []
    for rank in (0, 1):
        (tmp_path / f"rank{rank}").mkdir()
        runs.append(write_run(tmp_path / f"rank{rank}", 40))
    path = tmp_path / "rank1" / "run.yaml"
    text = path.read_text()
    if change == "data":
        data = dict(np.load(tmp_path / "rank1" / "data.npz"))
        data["x_train"][5, 2] += 1.0  # one sample, same shape and dtype
        np.savez(tmp_path / "rank1" / "data.npz", **data)
    else:
        old, new = change.split(" -> ")
        assert old in text
        path.write_text(text.replace(old, new))
    return runs[0], runs[1]


@needs_mpi
@pytest.mark.parametrize("change,named", [
    ("train: {log_every: 0} -> train: {log_every: 0, epochs: 5}", "at train.epochs: 10 on rank 0, 5 on rank 1"),
    ("batch_size: 4 -> batch_size: 5", "at data.batch_size: 4 on rank 0, 5 on rank 1"),
    ("base_lr: 0.05 -> base_lr: 0.1", "at solver.base_lr: 0.05 on rank 0, 0.1 on rank 1"),
    ("output_size: 12 -> output_size: 16", "at network.layers[0].output_size: 12 on rank 0, 16 on rank 1"),
    ("solver: momentum -> solver: nesterov", 'at solver.solver: "momentum" on rank 0, "nesterov" on rank 1'),
    ("data", "at data file x_train: float32 [40, 6] blake2b "),
])
def test_ranks_started_with_different_runs_or_data_stop_at_once_naming_the_difference(tmp_path, change, named):
    """`mpiexec -n 1 leafpy train a.yaml : -n 1 leafpy train b.yaml`, the two run files (or their npz data)
    differing in one thing: every rank stops within seconds, non-zero, with a message naming the field and both
    values. (Before, other epochs or batch sizes hung, another learning rate or other data trained silently, another
    layer size or update rule ended in a raw mpi4py exception.) The data may lie at another path on each rank."""
    runs = _differently(tmp_path, change)
    epochs = [] if "epochs" in change else ["--epochs", "2"]
    cmd = [MPIEXEC]
    for rank, run in enumerate(runs):
        cmd += [":"] * rank + ["-n", "1", sys.executable, "-m", "leafpy", "train", run, "--out",
                               str(tmp_path / f"out{rank}"), *epochs]
    began = time.monotonic()
    done = job(cmd, tmp_path)
    assert done.returncode != 0, done.stdout[-2000:]
    assert time.monotonic() - began < 40
    assert f"rank 1's run differs from rank 0's {named}" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "out0" / "model.leaf").exists()


@needs_mpi
def test_the_roc_auc_of_a_run_on_two_ranks_ranks_every_held_out_sample_as_one_process_does(tmp_path):
    """`mpiexec -n 2 leafpy train` of a two-class run: each epoch's `test_roc_auc` is the ROC AUC of all held-out
    samples (23, shared 12 and 11 by the ranks), that of scikit-learn's roc_auc_score on the saved model's outputs
    and the one `leafpy evaluate` prints in one process. (Before, a run of several ranks left it out.)"""
    pytest.importorskip("sklearn", reason="scikit-learn's roc_auc_score is the independent reference")
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(3)
    x = rng.standard_normal((63, 6)).astype(np.float32)
    y = (x[:, 0] + 0.8 * rng.standard_normal(63) > 0).astype(np.int64)  # noisy: an AUC well inside (0.5, 1)
    run = Path(write_run(tmp_path, 40))  # its three-class run, made two-class, over these samples
    run.write_text(run.read_text().replace("output_size: 3", "output_size: 2").replace("[4, 3]", "[4, 2]")
                   .replace("num_classes: 3", "num_classes: 2"))
    np.savez(tmp_path / "data.npz", x_train=x[:40], y_train=y[:40], x_test=x[40:], y_test=y[40:])
    done = job([MPIEXEC, "-n", "2", sys.executable, "-m", "leafpy", "train", str(run), "--out", str(tmp_path / "two"),
                "--epochs", "3"], tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    history = json.loads((tmp_path / "two" / "history.json").read_text())
    history = history["epochs"] if isinstance(history, dict) else history
    assert all("test_roc_auc" in h for h in history), history[-1]
    net = lp.Layer.load(lp.backend("native"), str(tmp_path / "two" / "model.leaf"))
    out = net.forward([x[40:]])[0].to_numpy()
    reference = roc_auc_score(y[40:], out[:, 1] - out[:, 0])
    assert 0.5 < reference < 1.0, reference  # (a score where the order of every sample counts)
    assert abs(history[-1]["test_roc_auc"] - reference) < 1e-9, (history[-1]["test_roc_auc"], reference)
    single = leafpy("evaluate", str(tmp_path / "two"))
    assert single.returncode == 0, single.stderr
    assert f"held-out ROC AUC: {reference:.4f}" in single.stdout, single.stdout


@needs_mpi
@pytest.mark.parametrize("broken", ["not yaml", "missing", "epochs 0"])
def test_a_rank_that_fails_before_training_starts_ends_the_job(tmp_path, broken):
    """`mpiexec -n 1 leafpy train a.yaml : -n 1 leafpy train b.yaml`, rank 1's run file unreadable (a node's copy
    damaged or missing) or its --epochs refused: every rank ends within seconds with rank 1's message (before, rank
    0 waited at start forever and ignored SIGTERM: rank 1 had stopped before it joined the job)."""
    good = write_run(tmp_path, 40)
    bad, extra = str(tmp_path / "other.yaml"), []
    if broken == "not yaml":
        (tmp_path / "other.yaml").write_text("name: [tiny\n")
    elif broken == "epochs 0":
        bad, extra = good, ["--epochs", "0"]
    cmd = [MPIEXEC, "-n", "1", sys.executable, "-m", "leafpy", "train", good, "--out", str(tmp_path / "out"), ":",
           "-n", "1", sys.executable, "-m", "leafpy", "train", bad, "--out", str(tmp_path / "out"), *extra]
    began = time.monotonic()
    done = job(cmd, tmp_path)
    assert done.returncode != 0
    assert time.monotonic() - began < 30
    named = {"not yaml": "other.yaml: not valid YAML", "missing": "other.yaml",
             "epochs 0": "argument --epochs: expected a"}
    assert "leafpy: rank 1: error: " in done.stderr and named[broken] in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@needs_mpi
def test_nproc_abbreviated_starts_one_job_and_is_refused_inside_a_launched_one(tmp_path):
    """`leafpy train RUN --np 2` (argparse takes the abbreviation) is one job of two ranks (before, each rank got
    `--np 2` again and launched a job of its own, without end); under mpiexec, --nproc is refused by name."""
    run = write_run(tmp_path, 40)
    # (were the ranks to launch jobs of their own again, each in a session of its own: job ends every one)
    p = job([sys.executable, "-m", "leafpy", "train", run, "--out", str(tmp_path / "a"), "--np", "2", "--epochs", "1"],
            tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("on 2 ranks") == 1, p.stdout[:500]
    assert (tmp_path / "a" / "model.leaf").exists()
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "leafpy", "train", run, "--out", str(tmp_path / "b"),
           "--nproc=2"]
    done = job(cmd, tmp_path)
    assert done.returncode != 0 and "--nproc 2: this process is already one of 2 ranks" in done.stderr
    assert not (tmp_path / "b").exists()


@needs_mpi
def test_a_regression_with_fewer_held_out_samples_than_ranks_scores_as_one_process(tmp_path):
    """Two ranks, one held-out sample: the rank without a share still joins the sum of the regression's scores
    (before, it skipped that all-reduce and the job ended in an MPI 'Message truncated' error). The MSE and MAE it
    prints are those `leafpy evaluate` gives for the saved model in one process."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((41, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32))[:, None]
    np.savez(tmp_path / "reg.npz", x_train=x[:40], y_train=y[:40], x_test=x[40:], y_test=y[40:])
    (tmp_path / "reg.yaml").write_text(
        f"name: reg\ndata: {{dataset: npz, path: {tmp_path / 'reg.npz'}, batch_size: 4}}\n"
        "train: {epochs: 2, log_every: 0}\n"
        "network: {type: Sequential, inputs: [{name: data, shape: [null, 4]}], "
        "layers: [{name: fc, type: Linear, output_size: 1}]}\n"
        "objective: mse\nsolver: {solver: momentum, base_lr: 0.01, momentum: 0.9, seed: 0}\n")
    p = leafpy("train", str(tmp_path / "reg.yaml"), "--out", str(tmp_path / "run"), "--nproc", "2")
    assert p.returncode == 0, p.stderr[-2000:]
    e = leafpy("evaluate", str(tmp_path / "run"))
    assert e.returncode == 0, e.stderr[-2000:]
    scores = [re.search(r"held-out MSE ([\d.]+), MAE ([\d.]+)", out).groups() for out in (p.stdout, e.stdout)]
    assert scores[0] == scores[1], (p.stdout[-800:], e.stdout[-800:])


@needs_mpi
def test_npy_data_at_another_path_on_each_rank_trains(tmp_path):
    """`data.path` may differ between ranks (a node-local copy): also the npy dataset's {x: ..., y: ...} form of it
    (before, its entries were compared as fields of their own and the job refused to start)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    runs = []
    for rank in (0, 1):
        node = tmp_path / f"node{rank}"
        node.mkdir()
        np.save(node / "x.npy", x)
        np.save(node / "y.npy", y)
        (node / "run.yaml").write_text(
            f"name: npy\ndata: {{dataset: npy, path: {{x: {node / 'x.npy'}, y: {node / 'y.npy'}}}, batch_size: 4, "
            "test_fraction: 0.2, seed: 0}\ntrain: {epochs: 1, log_every: 0}\n"
            "network: {type: Sequential, inputs: [{name: data, shape: [null, 6]}], "
            "layers: [{name: fc, type: Linear, output_size: 2}, {name: logsm, type: LogSoftmax}]}\n"
            "objective: nll\nsolver: {solver: momentum, base_lr: 0.05, momentum: 0.9, seed: 0}\n")
        runs.append(str(node / "run.yaml"))

    def train(out: str) -> subprocess.CompletedProcess:
        cmd = [MPIEXEC]
        for rank, run in enumerate(runs):
            cmd += [":"] * rank + ["-n", "1", sys.executable, "-m", "leafpy", "train", run,
                                   "--out", str(tmp_path / out)]
        return job(cmd, tmp_path)

    done = train("out")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "on 2 ranks" in done.stdout and (tmp_path / "out" / "model.leaf").exists()
    np.save(tmp_path / "node1" / "y.npy", 1 - y)  # the contents still may not differ
    done = train("again")
    assert done.returncode != 0 and "rank 1's run differs from rank 0's at data file" in done.stderr, done.stderr


@needs_mpi
def test_a_stop_inside_an_epoch_with_an_accumulated_call_pending_writes_its_checkpoint(tmp_path):
    """Two ranks, minibatch_size 2, a stop after the third call of an epoch (one call pending, each rank holding its
    own share of it): rank 0 writes the checkpoint a stop signal writes, with the ranks' pending gradients combined
    and the position of the stop. (A refusal meant for callbacks' own checkpoints inside such an epoch must not
    refuse this one.)"""
    run = write_run(tmp_path, 48, solver=ACCUMULATING)
    done = job([MPIEXEC, "-n", "2", sys.executable, os.path.join(HERE, "distributed_worker.py"), "stop", run,
                str(tmp_path / "out")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    state = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"),
                                      str(tmp_path / "out" / "checkpoint.leaf")).snapshot()
    assert state["pending_calls"] == 1 and state["iteration"] == 1
    assert (state["trainer_state"]["epoch"], state["trainer_state"]["sample"]) == (0, 3 * 4 * 2)
