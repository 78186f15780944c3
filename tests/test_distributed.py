"""Data-parallel training under ``mpiexec -n 2`` (the mpich wheel's): two ranks at batch B make the same updates
as one process at batch 2B, for every update rule, with clipping, weight decay, accumulation and a partial last
batch; a failing rank ends the job."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import leafpy as lp
from leafpy import data as datasets
from leafpy import distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import distributed_worker as worker  # noqa: E402
from conftest import backend_or_skip, child_env, terminal_signals  # noqa: E402

MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
                               reason="needs mpi4py and mpiexec (pip install 'leafpy-dl[dist]': mpi4py, mpich)")


ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
"""Open MPI's mpiexec (where it is the one on the path) refuses to start as root, as tests in a container run."""


def mpirun(n: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **ROOT_OK)
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, os.path.join(HERE, "distributed_worker.py"),
                           *args], env=env, capture_output=True, text=True, timeout=timeout)


def single_process(rule: str, batch: int, steps: int, accumulate: int, clip: float | None,
                   batch_norm: bool = False, precision: str = "fp32", frozen: bool = False) -> list[np.ndarray]:
    be = lp.backend("native", **({"precision": precision} if precision != "fp32" else {}))
    solver = lp.Solver.from_config(be, be, worker.solver_config(rule, batch, accumulate, clip, batch_norm, frozen))
    x, y = worker.problem()
    done, epoch = 0, 0
    while done < steps * accumulate:
        for xb, yb in datasets.batches(x, y, batch, seed=7, epoch=epoch):
            solver.train_minibatch(xb, yb)
            done += 1
            if done == steps * accumulate:
                break
        epoch += 1
    assert solver.iteration == steps
    return [w.to_numpy() for w in solver.network.learnable_weights_data()]


CASES = [("momentum", 1, None), ("nesterov", 1, 0.5), ("adam", 2, None), ("rmsprop", 1, None),
         ("adagrad", 1, 0.3), ("adadelta", 2, None)]


@needs_mpi
@pytest.mark.parametrize("rule,accumulate,clip", CASES)
def test_two_ranks_at_batch_b_equal_one_process_at_2b(tmp_path, rule, accumulate, clip):
    # batch 5 per rank: each epoch of 97 samples ends with a partial global batch of 7, split 4 and 3
    steps = 20
    args = ["equivalence", str(tmp_path / "w"), rule, "5", str(steps), "--accumulate", str(accumulate)]
    if clip is not None:
        args += ["--clip", str(clip)]
    run = mpirun(2, *args)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [np.load(tmp_path / f"w.rank{r}.npz") for r in (0, 1)]
    reference = single_process(rule, 10, steps, accumulate, clip)
    start = single_process(rule, 10, 0, accumulate, clip)
    for r in ranks:
        assert int(r["iteration"]) == steps
        for i, ref in enumerate(reference):
            np.testing.assert_allclose(r[f"w{i}"], ref, rtol=2e-4, atol=2e-5, err_msg=f"{rule}: weight {i}")
            assert not np.allclose(ref, start[i]), "training moved no weight: the comparison would prove nothing"
    for i in range(len(reference)):  # every rank applied the same updates
        np.testing.assert_array_equal(ranks[0][f"w{i}"], ranks[1][f"w{i}"])
    if accumulate == 1:  # buckets summed while the backward pass went on
        assert int(ranks[0]["overlapped"]) > 0


@needs_mpi
@pytest.mark.parametrize("accumulate", [1, 2])
def test_two_ranks_fine_tuning_past_a_frozen_layer_equal_one_process_at_2b(tmp_path, accumulate):
    """fc1 frozen (lr_mult 0): it runs no backward pass and its gradients are summed across no ranks; the trained
    layer's updates equal one process's at batch 2B, with clipping, and fc1 keeps rank 0's weights on both."""
    steps = 12
    run = mpirun(2, "equivalence", str(tmp_path / "w"), "momentum", "5", str(steps), "--accumulate", str(accumulate),
                 "--clip", "0.5", "--frozen")
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [np.load(tmp_path / f"w.rank{r}.npz") for r in (0, 1)]
    reference = single_process("momentum", 10, steps, accumulate, 0.5, frozen=True)
    start = single_process("momentum", 10, 0, accumulate, 0.5, frozen=True)
    for r in ranks:
        for i, ref in enumerate(reference):
            np.testing.assert_allclose(r[f"w{i}"], ref, rtol=2e-4, atol=2e-5, err_msg=f"weight {i}")
        for i in (0, 1):  # fc1's weight and bias: rank 0's initial values, on both ranks
            np.testing.assert_array_equal(r[f"w{i}"], start[i])
        assert not np.allclose(r["w2"], start[2])
    if accumulate == 1:
        assert int(ranks[0]["overlapped"]) > 0


@needs_mpi
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_two_ranks_in_mixed_precision_equal_one_process_at_2b(tmp_path, precision):
    """bf16 and fp16 (with its loss scaling) train data-parallel as in one process: two ranks at batch 5 against
    one process at batch 10 in the same precision, to within one unit of that precision's roundoff (observed:
    1.5e-4 in bf16, 2e-5 in fp16: the ranks' float32 sums split differently); a rank training on its own half of
    each batch ends 0.39 away."""
    steps, u = 20, {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}[precision]
    run = mpirun(2, "equivalence", str(tmp_path / "w"), "momentum", "5", str(steps), "--precision", precision)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [np.load(tmp_path / f"w.rank{r}.npz") for r in (0, 1)]
    reference = single_process("momentum", 10, steps, 1, None, precision=precision)
    half = single_process("momentum", 5, steps, 1, None, precision=precision)  # one rank's samples alone
    for r in ranks:
        assert int(r["iteration"]) == steps
        worst = max(float(np.abs(r[f"w{i}"] - ref).max()) for i, ref in enumerate(reference))
        apart = max(float(np.abs(h - ref).max()) for h, ref in zip(half, reference))
        assert worst <= u, f"{precision}: two ranks are {worst:.2e} from one process"
        assert apart > 4 * worst, f"{precision}: the bound cannot tell combined from uncombined gradients"
    for i in range(len(reference)):
        np.testing.assert_array_equal(ranks[0][f"w{i}"], ranks[1][f"w{i}"])


@needs_mpi
@pytest.mark.parametrize("rule", ["momentum", "adam"])
def test_synchronised_batch_norm_on_two_ranks_equals_one_process_at_2b(tmp_path, rule):
    """With sync_batch_norm every rank normalises with the global batch's statistics (uneven last batches
    included: 7 samples split 4 and 3), so two ranks at batch 5 train, running statistics included, as one
    process at batch 10; with each rank's own statistics they do not."""
    steps = 20
    reference = single_process(rule, 10, steps, 1, None, batch_norm=True)
    for sync in (True, False):
        out = tmp_path / f"sync{sync}"
        args = ["equivalence", str(out), rule, "5", str(steps), "--batch-norm"] + ["--sync-batch-norm"] * sync
        run = mpirun(2, *args)
        assert run.returncode == 0, run.stderr[-3000:]
        ranks = [np.load(f"{out}.rank{r}.npz") for r in (0, 1)]
        same = all(np.allclose(r[f"w{i}"], ref, rtol=2e-4, atol=2e-5) for r in ranks
                   for i, ref in enumerate(reference))
        assert same == sync, f"sync_batch_norm={sync}: the ranks' weights {'differ from' if sync else 'equal'} " \
                             "the single process's"
        if sync:  # the ranks' running statistics are the same too
            for i in range(len(reference)):
                np.testing.assert_array_equal(ranks[0][f"w{i}"], ranks[1][f"w{i}"])


@needs_mpi
def test_ranks_draw_dropout_masks_of_their_own(tmp_path):
    run = mpirun(2, "dropout", str(tmp_path / "m"))
    assert run.returncode == 0, run.stderr[-3000:]
    a, b = (np.load(tmp_path / f"m.rank{r}.npy") for r in (0, 1))
    assert a.shape == b.shape and set(np.unique(a)) <= {0.0, 2.0}
    assert 0.3 < (a == 0).mean() < 0.7 and 0.3 < (b == 0).mean() < 0.7  # ratio 0.5
    assert (a != b).mean() > 0.3, "the two ranks masked their samples alike"


@needs_mpi
def test_a_failing_rank_ends_the_job(tmp_path):
    t0 = time.monotonic()
    run = mpirun(2, "fail", str(tmp_path), timeout=60)
    elapsed = time.monotonic() - t0
    assert run.returncode != 0
    assert "a deliberate failure on rank 1" in run.stderr
    assert run.stderr.count("a deliberate failure on rank 1") == 1
    assert not (tmp_path / "finished.rank0").exists()  # rank 0 did not train on alone
    assert elapsed < 30


@needs_mpi
def test_a_killed_rank_ends_the_job(tmp_path):
    """A rank killed outright (SIGKILL: nothing of it left to report) while the other waits for it in the
    gradients' all-reduce: the launcher ends the job, with a failing exit status, within a bounded time."""
    t0 = time.monotonic()
    run = mpirun(2, "fail", str(tmp_path), "kill", timeout=60)
    elapsed = time.monotonic() - t0
    assert run.returncode != 0, run.stdout + run.stderr
    assert not (tmp_path / "finished.rank0").exists()
    assert elapsed < 30, elapsed


@needs_mpi
def test_leafpy_train_on_two_ranks_with_a_corrupted_data_file_fails_once_and_clearly(tmp_path):
    """A data file cut short: `leafpy train --nproc 2` ends with a failing status, no traceback, and one line
    naming the file, rank 0's (the ranks' identical errors are not printed once per rank)."""
    data = tmp_path / "broken.npz"
    x = np.random.default_rng(0).standard_normal((64, 6)).astype(np.float32)
    np.savez(data, x=x, y=(x[:, 0] > 0).astype(np.float32))
    data.write_bytes(data.read_bytes()[:200])
    run_file = tmp_path / "run.yaml"
    run_file.write_text(f"""
name: broken
data: {{dataset: npz, path: {data}, batch_size: 8}}
network:
  type: Sequential
  inputs: [{{name: data, shape: [8, 6]}}]
  layers:
    - {{name: fc, type: Linear, output_size: 2}}
    - {{name: logsm, type: LogSoftmax}}
objective:
  type: Sequential
  inputs: [{{name: out, shape: [8, 2]}}, {{name: label, shape: [8, 1]}}]
  layers: [{{name: nll, type: NegativeLogLikelihood, num_classes: 2}}]
solver: {{base_lr: 0.1}}
train: {{epochs: 1}}
""")
    env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "leafpy", "train", str(run_file), "--out", str(tmp_path / "out"),
                        "--nproc", "2"], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.count("broken.npz") == 1, p.stderr
    assert "rank 0: error:" in p.stderr and "not a NumPy .npz file" in p.stderr, p.stderr
    assert elapsed < 60, elapsed


def test_shards_cover_each_global_batch_once():
    order = np.random.default_rng(0).permutation(23)
    groups = [dist.ProcessGroup() for _ in range(3)]
    for r, g in enumerate(groups):
        g.rank, g.size = r, 3
    shards = [list(dist.shard_indices(order, 4, g)) for g in groups]
    # 23 = 12 + 11: the second global batch is split 4/4/3
    assert [len(s) for s in shards] == [2, 2, 2]
    assert [len(b) for b in shards[2]] == [4, 3]
    for j in range(2):
        joined = np.concatenate([shards[r][j] for r in range(3)])
        np.testing.assert_array_equal(joined, order[12 * j:12 * j + 12])
    g = dist.ProcessGroup()
    g.rank, g.size = 1, 3
    # 2 left over, fewer than the ranks: ranks 0 and 1 take one each, rank 2 none (it adds nothing to that update)
    assert [len(b) for b in dist.shard_indices(np.arange(14), 4, g)] == [4, 1]
    g.rank = 2
    assert [len(b) for b in dist.shard_indices(np.arange(14), 4, g)] == [4, 0]


def test_world_of_one_trains_as_a_plain_solver():
    be = lp.backend("native")
    cfg = worker.solver_config("momentum", 8)
    a, b = lp.Solver.from_config(be, be, cfg), lp.Solver.from_config(be, be, cfg)
    dp = dist.DataParallel(b, dist.ProcessGroup())
    x, y = worker.problem()
    for xb, yb in datasets.batches(x, y, 8, seed=1):
        a.train_minibatch(xb, yb)
        dp.train_minibatch(xb, yb)
    for wa, wb in zip(a.network.learnable_weights_data(), b.network.learnable_weights_data()):
        np.testing.assert_array_equal(wa.to_numpy(), wb.to_numpy())


@needs_mpi
def test_leafpy_train_on_two_ranks_equals_one_process_at_twice_the_batch(tmp_path):
    mlp = os.path.join(ROOT, "configs", "digits_mlp.yaml")
    env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "-m", "leafpy", "train", mlp, "--epochs", "2", "--out",
                          str(tmp_path / "one"), "--set", "data.batch_size=32"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "leafpy", "train", mlp, "--epochs", "2", "--out", str(tmp_path / "two"),
                          "--set", "data.batch_size=16", "--nproc", "2"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert two.returncode == 0, two.stderr
    assert "on 2 ranks (global batch 32)" in two.stdout
    assert two.stdout.count("epoch 2/2") == 1  # rank 0 alone prints
    be = lp.backend("native")
    a, b = (lp.Layer.load(be, str(tmp_path / d / "model.leaf")) for d in ("one", "two"))
    for wa, wb in zip(a.learnable_weights_data(), b.learnable_weights_data()):
        np.testing.assert_allclose(wb.to_numpy(), wa.to_numpy(), rtol=1e-4, atol=1e-5)
    acc = [float(line.split()[-1].rstrip("%")) for line in (one.stdout + two.stdout).splitlines()
           if line.startswith("held-out accuracy")]
    assert len(acc) == 2 and abs(acc[0] - acc[1]) < 0.3  # held-out evaluation sharded and summed
    # each epoch's training loss and accuracy are the global batches', as one process counts them
    histories = [json.loads((tmp_path / d / "history.json").read_text()) for d in ("one", "two")]
    for r1, r2 in zip(*histories):
        assert abs(r1["loss"] - r2["loss"]) < 1e-4 * max(1.0, r1["loss"]), (r1, r2)
        assert abs(r1["train_accuracy"] - r2["train_accuracy"]) < 0.003, (r1, r2)


@needs_mpi
def test_two_ranks_of_a_run_without_a_solver_seed_take_rank_0s_drawn_seed(tmp_path):
    """Each rank draws a seed; the job takes rank 0's (the agreement check would stop ranks that disagree), and
    run.yaml records it: one process from that run.yaml at twice the batch trains the same weights."""
    text = open(os.path.join(ROOT, "configs", "digits_mlp.yaml")).read()
    assert ", seed: 0}" in text
    (tmp_path / "noseed.yaml").write_text(text.replace(", seed: 0}", "}"))
    env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    two = subprocess.run([sys.executable, "-m", "leafpy", "train", str(tmp_path / "noseed.yaml"), "--epochs", "1",
                          "--out", str(tmp_path / "two"), "--set", "data.batch_size=16", "--nproc", "2"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr
    seed = lp.config.load(str(tmp_path / "two" / "run.yaml")).solver.seed
    assert isinstance(seed, int)
    one = subprocess.run([sys.executable, "-m", "leafpy", "train", str(tmp_path / "two" / "run.yaml"), "--epochs", "1",
                          "--out", str(tmp_path / "one"), "--set", "data.batch_size=32"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    be = lp.backend("native")
    a, b = (lp.Layer.load(be, str(tmp_path / d / "model.leaf")) for d in ("one", "two"))
    for wa, wb in zip(a.learnable_weights_data(), b.learnable_weights_data()):
        np.testing.assert_allclose(wb.to_numpy(), wa.to_numpy(), rtol=1e-4, atol=1e-5)


BN_RUN = """
name: digits-bn-mlp
data: {dataset: digits, batch_size: 32, test_fraction: 0.2, seed: 0}
network:
  type: Sequential
  inputs: [{name: data, shape: [32, 1, 8, 8]}]
  layers:
    - {name: flat, type: Flatten}
    - {name: fc1, type: Linear, output_size: 64, bias: false}
    - {name: bn1, type: BatchNorm}
    - {name: relu1, type: ReLU}
    - {name: fc2, type: Linear, output_size: 10}
    - {name: logsm, type: LogSoftmax}
objective:
  type: Sequential
  inputs: [{name: network_out, shape: [32, 10]}, {name: label, shape: [32, 1]}]
  layers:
    - {name: nll, type: NegativeLogLikelihood, num_classes: 10}
solver: {solver: momentum, base_lr: 0.05, momentum: 0.9, seed: 0}
"""


@needs_mpi
def test_leafpy_train_with_synchronised_batch_norm_on_two_ranks(tmp_path):
    """The run file's train.sync_batch_norm: two ranks at batch 16 train a BatchNorm model as one process at 32.
    (No max pooling here: in float32 a pooling window's near-ties resolve differently under the last bits of the
    statistics, which the ranks combine in float64; in float64 the digits_bn model agrees to 1e-15 as well.)"""
    run = tmp_path / "bn.yaml"
    run.write_text(BN_RUN)
    env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "-m", "leafpy", "train", str(run), "--epochs", "2", "--out",
                          str(tmp_path / "one")], env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "leafpy", "train", str(run), "--epochs", "2", "--out",
                          str(tmp_path / "two"), "--set", "data.batch_size=16", "--set", "train.sync_batch_norm=true",
                          "--nproc", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr
    be = lp.backend("native")
    a, b = (lp.Layer.load(be, str(tmp_path / d / "model.leaf")) for d in ("one", "two"))
    for wa, wb in zip(a.learnable_weights_data(), b.learnable_weights_data()):  # running statistics included
        np.testing.assert_allclose(wb.to_numpy(), wa.to_numpy(), rtol=1e-4, atol=1e-5)


def _nccl(be):
    """An NCCL transport over a world of one (the test is skipped where CuPy has no NCCL)."""
    try:
        return dist.transports.NcclTransport(be, dist.ProcessGroup())
    except lp.BackendUnavailable as e:
        pytest.skip(str(e))


@needs_mpi
@pytest.mark.cuda
@pytest.mark.parametrize("rule", ["momentum", "adam"])
def test_cuda_ranks_over_the_mpi_transport_share_one_gpu(tmp_path, rule):
    backend_or_skip("cuda")
    os.environ["LEAFPY_TRANSPORT"] = "mpi"
    try:
        run = mpirun(2, "equivalence", str(tmp_path / "w"), rule, "5", "12", "--backend", "cuda", timeout=300)
    finally:
        del os.environ["LEAFPY_TRANSPORT"]
    assert run.returncode == 0, run.stderr[-3000:]
    reference = single_process(rule, 10, 12, 1, None)
    for r in (0, 1):
        got = np.load(tmp_path / f"w.rank{r}.npz")
        assert str(got["transport"]) == "mpi"
        for i, ref in enumerate(reference):
            np.testing.assert_allclose(got[f"w{i}"], ref, rtol=1e-3, atol=1e-4)


@pytest.mark.cuda
def test_nccl_transport_with_a_world_of_one():
    be = backend_or_skip("cuda")
    transport = _nccl(be)
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(s).astype(np.float32) for s in ((3, 4), (7,))]
    tensors = [lp.SharedTensor.from_numpy(v) for v in values]
    for t in tensors:
        t.read_write(be)  # the fresh copy on the GPU, as gradients are
    transport.allreduce_weighted(tensors, 3.0)  # (3 g) / 3 over one rank
    for t, v in zip(tensors, values):
        np.testing.assert_allclose(t.to_numpy(), v, rtol=1e-6)
    assert dist.transports.default_transport(be, dist.ProcessGroup()).name == "nccl"


@pytest.mark.cuda
def test_nccl_bucket_sums_on_their_own_stream_wait_for_the_gradients():
    """start() sums a bucket on a stream of its own: it must wait for the kernels that write the gradients (here a
    long GEMM just launched on the backend's stream) and finish() must make the backend's stream wait for the sum.
    Without the event the side stream packs the gradient before the GEMM has written it."""
    be = backend_or_skip("cuda")
    transport = _nccl(be)
    assert transport.overlaps
    rng = np.random.default_rng(0)
    n = 2048
    a, b = (lp.SharedTensor.from_numpy(rng.standard_normal((n, n)).astype(np.float32)) for _ in range(2))
    grads = [lp.SharedTensor((n, n)), lp.SharedTensor.from_numpy(rng.standard_normal(5).astype(np.float32))]
    small = grads[1].to_numpy()
    for _ in range(3):
        be.fill(0.0, grads[0].write(be))
        grads[1].read_write(be)
        for _ in range(4):  # ~1.5 ms of GPU work queued ahead of the bucket
            be.gemm(a.read(be), False, b.read(be), False, grads[0].write(be))
        handle = transport.start(0, grads, 2.0)
        transport.finish(handle)
        be.scal(1.0, grads[0].read_write(be))  # work after finish() on the backend's stream
        want = a.to_numpy().astype(np.float64) @ b.to_numpy().astype(np.float64)
        np.testing.assert_allclose(grads[0].to_numpy(), want, rtol=1e-3, atol=1e-2)
        np.testing.assert_allclose(grads[1].to_numpy(), small, rtol=1e-6)


@pytest.mark.cuda
def test_nccl_bucket_sums_record_and_replay_inside_a_training_step():
    """A step that packs, sums (NCCL, side stream, events) and unpacks a bucket is recorded as a CUDA graph and
    replayed: each replay packs that step's gradients (the flat buffer holds weight x gradient) and the work after
    finish() sees the unpacked sum. With one rank the all-reduce itself leaves the buffer as it is, so this shows
    that NCCL's call records and replays with its side stream, not a sum across GPUs."""
    be = backend_or_skip("cuda")
    transport = _nccl(be)
    assert transport.capturable
    rng = np.random.default_rng(1)
    src, src_small = lp.SharedTensor((64, 96)), lp.SharedTensor((5,))
    grads = [lp.SharedTensor((64, 96)), lp.SharedTensor((5,))]
    out = lp.SharedTensor((64, 96))
    small = rng.standard_normal(5).astype(np.float32)

    def step():
        be.copy(src.read(be), grads[0].write(be))
        be.copy(src_small.read(be), grads[1].write(be))
        handle = transport.start(0, grads, 3.0)
        transport.finish(handle)
        be.axpby(2.0, grads[0].read(be), 0.0, out.write(be))  # after finish(): must see the unpacked sum

    replays = be.recorder.replays
    for i in range(5):
        values = rng.standard_normal((64, 96)).astype(np.float32)
        be.upload(values, src.write(be))
        be.upload(small * (i + 1), src_small.write(be))
        be.run_step(("nccl bucket replay",), step)
        flat = transport._flat[0].get()
        np.testing.assert_allclose(out.to_numpy(), 2.0 * values, rtol=1e-6)
        np.testing.assert_allclose(grads[1].to_numpy(), small * (i + 1), rtol=1e-6)
        # the bucket, its weight's slot and the reciprocal of the summed weights (a slot, not an allocation)
        np.testing.assert_allclose(flat[:-2], 3.0 * np.concatenate([values.reshape(-1), small * (i + 1)]),
                                   rtol=1e-6)
        assert flat[-2] == pytest.approx(3.0) and flat[-1] == pytest.approx(1 / 3.0)
    assert be.recorder.replays - replays >= 3, be.record_error


@pytest.mark.cuda
def test_a_data_parallel_cuda_step_replays_like_a_plain_one():
    """A data-parallel solver whose reducer can be recorded (here NCCL with one rank) replays its steps as CUDA
    graphs, and trains exactly as the plain solver does."""
    be = backend_or_skip("cuda")
    runs = []
    for parallel in (False, True):
        solver = lp.Solver.from_config(be, be, worker.solver_config("momentum", 16, 1, 0.5, False))
        if parallel:
            dp = dist.DataParallel(solver, dist.ProcessGroup(), transport=_nccl(be))
            assert dp.replay_key() is not None
        x, y = worker.problem(200)
        replays = be.recorder.replays
        for xb, yb in list(datasets.batches(x, y, 16, seed=7, epoch=0))[:10]:
            (dp if parallel else solver).train_minibatch(xb, yb)
        assert be.recorder.replays - replays >= 7, be.record_error
        runs.append([w.to_numpy() for w in solver.network.learnable_weights_data()])
    for a, b in zip(*runs):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


@needs_mpi
def test_a_two_rank_run_resumed_equals_the_uninterrupted_run(tmp_path):
    mlp = os.path.join(ROOT, "configs", "digits_mlp.yaml")
    env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

    def train(out, epochs, *extra):
        p = subprocess.run([sys.executable, "-m", "leafpy", "train", mlp, "--epochs", str(epochs), "--out",
                            str(tmp_path / out), *extra], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return lp.Layer.load(lp.backend("native"), str(tmp_path / out / "model.leaf")).learnable_weights_data()

    two = ["--set", "data.batch_size=16", "--nproc", "2"]
    whole = train("whole", 2, *two)
    train("parted", 1, *two)
    resumed = train("parted", 2, "--resume", str(tmp_path / "parted" / "checkpoint.leaf"), *two)
    for a, b in zip(whole, resumed):
        np.testing.assert_array_equal(a.to_numpy(), b.to_numpy())
    # the checkpoint does not depend on the number of ranks: one process at twice the batch continues it
    train("one", 1, *two)
    single = train("one", 2, "--resume", str(tmp_path / "one" / "checkpoint.leaf"), "--set", "data.batch_size=32")
    for a, b in zip(whole, single):
        np.testing.assert_allclose(b.to_numpy(), a.to_numpy(), rtol=1e-4, atol=1e-5)


def _webgpu_or_skip():
    backend_or_skip("webgpu")


@needs_mpi
@pytest.mark.webgpu
def test_webgpu_ranks_over_mpi_equal_one_native_process(tmp_path):
    _webgpu_or_skip()
    run = mpirun(2, "equivalence", str(tmp_path / "w"), "momentum", "5", "8", "--backend", "webgpu", timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    reference = single_process("momentum", 10, 8, 1, None)
    for r in (0, 1):
        got = np.load(tmp_path / f"w.rank{r}.npz")
        for i, ref in enumerate(reference):
            np.testing.assert_allclose(got[f"w{i}"], ref, rtol=1e-3, atol=1e-4)


@needs_mpi
def test_a_closed_terminal_stops_a_launched_job_with_a_checkpoint(tmp_path):
    """SIGHUP to the launcher's process group (a terminal or an SSH session closed) ends a ``--nproc`` job as Ctrl-C
    does: mpiexec and the ranks live in a session of their own, the launcher passes the stop on, rank 0 writes the
    checkpoint of the position, the job ends with 130 and leaves no lock (mpiexec used to die of it at once, exit
    255, the position lost)."""
    import signal

    mlp = os.path.join(ROOT, "configs", "digits_mlp.yaml")
    env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "leafpy", "train", mlp, "--epochs", "40", "--out",
                             str(tmp_path / "cut"), "--set", "data.batch_size=8", "--nproc", "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=terminal_signals)
    try:
        for line in proc.stdout:
            if line.startswith("epoch 1/40"):
                os.killpg(proc.pid, signal.SIGHUP)
                break
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert (out + err).count("checkpoint saved to") == 1, (out, err)
    state = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"),
                                      str(tmp_path / "cut" / "checkpoint.leaf")).trainer_state
    assert 1 <= state["epoch"] < 40, state
    assert not [f for f in os.listdir(tmp_path / "cut") if f.endswith(".lock")]


@needs_mpi
def test_ctrl_c_on_the_launcher_checkpoints_once_and_the_run_resumes_exactly(tmp_path):
    """Ctrl-C in a terminal reaches the launcher's whole process group (launcher, mpiexec, ranks): every rank stops
    at the same step, rank 0 writes one checkpoint, the job ends with 130 within a bounded time, and resuming it on
    2 ranks makes the updates of the uninterrupted 2-rank run."""
    import signal
    import time

    mlp = os.path.join(ROOT, "configs", "digits_mlp.yaml")
    env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    two = ["--set", "data.batch_size=8", "--nproc", "2"]
    cmd = [sys.executable, "-m", "leafpy", "train", mlp, "--epochs", "4"]
    whole = subprocess.run([*cmd, "--out", str(tmp_path / "whole"), *two], env=env, capture_output=True, text=True,
                           timeout=300)
    assert whole.returncode == 0, whole.stderr
    proc = subprocess.Popen([*cmd, "--out", str(tmp_path / "cut"), *two], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=terminal_signals)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("epoch 1/4"):
                os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
                break
        sent = time.monotonic()
        out, err = proc.communicate(timeout=90)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines) + out
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert took < 60, took
    assert (out + err).count("checkpoint saved to") == 1, (out, err)  # rank 0 alone saves and says so
    state = lp.Solver.load_checkpoint(lp.backend("native"), lp.backend("native"),
                                      str(tmp_path / "cut" / "checkpoint.leaf")).trainer_state
    assert state["epoch"] < 4, state
    resumed = subprocess.run([*cmd, "--out", str(tmp_path / "cut"), "--resume",
                              str(tmp_path / "cut" / "checkpoint.leaf"), *two], env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    be = lp.backend("native")
    a, b = (lp.Layer.load(be, str(tmp_path / d / "model.leaf")) for d in ("whole", "cut"))
    for wa, wb in zip(a.learnable_weights_data(), b.learnable_weights_data()):
        np.testing.assert_array_equal(wa.to_numpy(), wb.to_numpy())
