"""Data-parallel scaling: training throughput from 1 to N ranks (per-rank batch fixed), scaling efficiency, and
the bandwidth leafpy's gradient all-reduce reaches against the transport's own all-reduce of the same bytes;
with ``--vs ddp``, PyTorch's DistributedDataParallel on the same networks, weights, batches and rule beside it.

    python benchmarks/scaling.py --backend native --ranks 1,2 [--nets mlp128,lenet64] [--steps 20] [--vs ddp]
    python benchmarks/scaling.py --backend cuda --ranks 1,2,4,8 --nets alexnet128,lenet1024 --vs ddp

Each rank count runs as ``mpiexec -n N`` (the mpich wheel's, or the one on PATH); DDP's ranks are N processes with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): NCCL on GPUs, gloo on the CPU.
Each framework's per-rank batch is put on its device once and reused, so the steps time training, not uploads.
The table is printed by the parent. On GPUs use --backend cuda (one GPU per local rank; NCCL between them;
NCCL_NVLS_ENABLE=0 in every rank's environment).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def seconds_per_call(call, n: int, settle=lambda: None) -> float:
    """Seconds per call of ``call`` over ``n`` calls, ``settle`` (a synchronisation, a barrier) run before and after
    the timed calls."""
    settle()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    settle()
    return (time.perf_counter() - t0) / n


def worker(args: argparse.Namespace) -> None:
    from train_step import solver_and_batch

    import leafpy as lp
    from leafpy import distributed as dist

    group = dist.init()
    options = {"device": group.local_rank} if args.backend == "cuda" else {}
    be = lp.backend(args.backend, **options)
    results = {}
    for name in args.nets.split(","):
        solver, x, y = solver_and_batch(be, name)
        dp = dist.DataParallel(solver, group)
        for _ in range(3):  # the batch goes to the device once and stays there, as DDP's (and train_step.py's)
            dp.train_minibatch(x, y)
        settle = lambda: (be.synchronize(), group.barrier())  # noqa: E731
        step = seconds_per_call(lambda: dp.train_minibatch(x, y), args.steps, settle)
        grads = solver.network.learnable_weights_gradients()
        nbytes = sum(g.size for g in grads) * 4
        reduce = lambda: dp.transport.allreduce_weighted(list(grads), 1.0)  # noqa: E731
        reduce()  # (a first call may compile its kernels: 0.5 s on cuda, timed once it was a 112 ms "all-reduce")
        reduce_leafpy = seconds_per_call(reduce, 5, settle)
        raw = np.ones(nbytes // 4 + 1, np.float64 if dp.transport.name == "mpi" else np.float32)
        group.allreduce_(raw)
        reduce_raw = seconds_per_call(lambda: group.allreduce_(raw), 5, settle)
        results[name] = {"batch": x.shape[0], "step_s": step, "bytes": nbytes, "reduce_s": reduce_leafpy,
                         "raw_reduce_s": reduce_raw, "transport": dp.transport.name}
    if group.is_root:
        print("RESULT " + json.dumps(results), flush=True)


def ddp_worker(args: argparse.Namespace) -> None:
    """One rank of PyTorch's DistributedDataParallel: the networks of train_step.py with leafpy's initial weights
    (the native backend builds them), momentum SGD, the per-rank batch of the leafpy run."""
    import torch
    import torch.distributed as tdist
    from train_step import TorchTrainer, solver_and_batch

    import leafpy as lp

    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = args.backend == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    tdist.init_process_group("nccl" if cuda else "gloo")
    rank = tdist.get_rank()
    device = "cuda" if cuda else "cpu"
    results = {}
    for name in args.nets.split(","):
        solver, x, y = solver_and_batch(lp.backend("native"), name)
        initial = [w.to_numpy() for w in solver.network.learnable_weights_data()]
        trainer = TorchTrainer.of_network(torch, solver.network.layer, initial, device, False, "momentum")
        local_model = trainer.model
        trainer.model = torch.nn.parallel.DistributedDataParallel(
            local_model, device_ids=[local] if cuda else None)
        xb, yb = trainer.to_device(x.to_numpy(), y.to_numpy())
        for _ in range(3):
            trainer.step(xb, yb)
        step = seconds_per_call(lambda: trainer.step(xb, yb), args.steps, lambda: (trainer.sync(), tdist.barrier()))
        nbytes = sum(p.numel() for p in local_model.parameters()) * 4
        raw = torch.ones(nbytes // 4, device=device)
        tdist.all_reduce(raw)
        results[name] = {"batch": int(xb.shape[0]), "step_s": step, "bytes": nbytes,
                         "raw_reduce_s": seconds_per_call(lambda: tdist.all_reduce(raw), 5, trainer.sync),
                         "loss": trainer.loss()}
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    tdist.destroy_process_group()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp(n: int, args: argparse.Namespace, env: dict) -> dict:
    """DDP at ``n`` ranks: rank 0's results."""
    port = str(_free_port())
    procs = []
    for rank in range(n):
        rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, __file__, "--ddp-worker", "--backend", args.backend, "--nets", args.nets,
               "--steps", str(args.steps)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rank_env))
    outs = [p.communicate(timeout=1800) for p in procs]
    result = result_of(outs[0][0])
    if result is None or any(p.returncode for p in procs):
        sys.exit(f"DDP at {n} ranks failed:\n{''.join(err[-2000:] for _, err in outs)}")
    return result


def throughput(table: dict, name: str) -> dict[int, tuple[float, float]]:
    """Per rank count: (samples/s of all ranks, efficiency against the smallest rank count's samples/s per rank)."""
    first = min(table)
    base = table[first][name]["batch"] / table[first][name]["step_s"] / first
    rates = {n: n * res[name]["batch"] / res[name]["step_s"] for n, res in table.items()}
    return {n: (rate, rate / (n * base)) for n, rate in rates.items()}


def result_of(stdout: str) -> dict | None:
    """The root rank's results: its RESULT line's JSON."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith("RESULT ")), None)
    return None if line is None else json.loads(line[7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="native")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--nets", default="mlp128,lenet64")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--vs", choices=["none", "ddp"], default="none",
                   help="ddp: PyTorch's DistributedDataParallel beside leafpy (the bench extra)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.ddp_worker:
        ddp_worker(args)
        return
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        sys.exit("mpiexec not found: pip install 'leafpy-dl[dist]'")
    table, ddp = {}, {}
    for n in map(int, args.ranks.split(",")):
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   NCCL_NVLS_ENABLE="0")
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI's mpiexec refuses root (a container) without
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # its documented override
        if args.vs == "ddp":
            ddp[n] = run_ddp(n, args, env)
        cmd = [mpiexec, "-n", str(n), sys.executable, __file__, "--worker", "--backend", args.backend, "--nets",
               args.nets, "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        table[n] = result_of(out.stdout)
        if table[n] is None:
            sys.exit(f"{n} ranks failed:\n{out.stderr[-2000:]}")
    print(f"# leafpy data-parallel scaling on {args.backend}, per-rank batch fixed, 1 BLAS thread per rank")
    print("network   ranks  step ms  samples/s  efficiency  grad MB  all-reduce ms (leafpy / raw)  transport")
    for name in args.nets.split(","):
        for n, (rate, eff) in throughput(table, name).items():
            r = table[n][name]
            print(f"{name:9s} {n:5d} {r['step_s'] * 1e3:8.2f} {rate:10.0f} {eff:11.0%} {r['bytes'] / 2**20:8.2f} "
                  f"{r['reduce_s'] * 1e3:13.2f} / {r['raw_reduce_s'] * 1e3:.2f}      {r['transport']}")
    if ddp:
        print("# PyTorch DistributedDataParallel, same networks, weights, per-rank batch and rule; ratio = leafpy's "
              "samples/s / DDP's")
        print("network   ranks  step ms  samples/s  efficiency  all-reduce ms (raw)  ratio  loss")
        for name in args.nets.split(","):
            ours = throughput(table, name)
            for n, (rate, eff) in throughput(ddp, name).items():
                r = ddp[n][name]
                print(f"{name:9s} {n:5d} {r['step_s'] * 1e3:8.2f} {rate:10.0f} {eff:11.0%} "
                      f"{r['raw_reduce_s'] * 1e3:20.2f} {ours[n][0] / rate:6.2f}  {r['loss']:.5f}")


if __name__ == "__main__":
    main()
