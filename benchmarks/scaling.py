"""Data-parallel scaling: training throughput from 1 to N ranks (per-rank batch fixed), scaling efficiency, and
the bandwidth leafpy's gradient all-reduce reaches against the transport's own all-reduce of the same bytes.

    python benchmarks/scaling.py --backend native --ranks 1,2 [--nets mlp128,lenet64] [--steps 20]

Each rank count runs as ``mpiexec -n N`` (the mpich wheel's, or the one on PATH); the table is printed by the
parent. On GPUs use --backend cuda (one GPU per local rank; NCCL between them).
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
        xb, yb = x.to_numpy(), y.to_numpy()
        for _ in range(3):
            dp.train_minibatch(xb, yb)
        be.synchronize()
        group.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            dp.train_minibatch(xb, yb)
        be.synchronize()
        group.barrier()
        step = (time.perf_counter() - t0) / args.steps
        grads = solver.network.learnable_weights_gradients()
        nbytes = sum(g.size for g in grads) * 4
        t0 = time.perf_counter()
        for _ in range(5):
            dp.transport.allreduce_weighted(list(grads), 1.0)
        reduce_leafpy = (time.perf_counter() - t0) / 5
        raw = np.ones(nbytes // 4 + 1, np.float64 if dp.transport.name == "mpi" else np.float32)
        t0 = time.perf_counter()
        for _ in range(5):
            group.allreduce_(raw)
        reduce_raw = (time.perf_counter() - t0) / 5
        results[name] = {"batch": len(xb), "step_s": step, "bytes": nbytes, "reduce_s": reduce_leafpy,
                         "raw_reduce_s": reduce_raw, "transport": dp.transport.name}
    if group.is_root:
        print("RESULT " + json.dumps(results), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="native")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--nets", default="mlp128,lenet64")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        sys.exit("mpiexec not found: pip install 'leafpy-dl[dist]'")
    table = {}
    for n in map(int, args.ranks.split(",")):
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
        cmd = [mpiexec, "-n", str(n), sys.executable, __file__, "--worker", "--backend", args.backend, "--nets",
               args.nets, "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{n} ranks failed:\n{out.stderr[-2000:]}")
        table[n] = json.loads(line[7:])
    print(f"# leafpy data-parallel scaling on {args.backend}, per-rank batch fixed, 1 BLAS thread per rank")
    print("network   ranks  step ms  samples/s  efficiency  grad MB  all-reduce ms (leafpy / raw)  transport")
    for name in args.nets.split(","):
        base = table[min(table)][name]
        base_rate = base["batch"] / base["step_s"]
        for n, res in table.items():
            r = res[name]
            rate = n * r["batch"] / r["step_s"]
            eff = rate / (n * base_rate) * min(table)
            print(f"{name:9s} {n:5d} {r['step_s'] * 1e3:8.2f} {rate:10.0f} {eff:11.0%} {r['bytes'] / 2**20:8.2f} "
                  f"{r['reduce_s'] * 1e3:13.2f} / {r['raw_reduce_s'] * 1e3:.2f}      {r['transport']}")


if __name__ == "__main__":
    main()
