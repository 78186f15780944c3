"""Kernel dispatches per training step on webgpu, for the benchmark networks and lstm.py's LSTM.

A webgpu step costs each dispatch its encoding on the host and a barrier on the GPU, so the count is what a change
to the kernels' fusion or to the split-K rule moves, and it is the same on every adapter: it can be checked where
no GPU is (on lavapipe, where the full LSTM takes about a minute a step). A step is run three times (first run,
recording, replay) and the replayed step is counted.

    python benchmarks/dispatch_counts.py --nets mlp128,lenet64,lstm [--set SPLIT_K_FINE_WORK=1e30]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lstm  # noqa: E402
import train_step  # noqa: E402

import leafpy as lp  # noqa: E402

LSTMS = {"lstm": lstm.FULL, "lstm-small": lstm.SMALL}


def solver_and_batch(be, name: str) -> tuple[lp.Solver, lp.SharedTensor, lp.SharedTensor]:
    if name not in LSTMS:
        return train_step.solver_and_batch(be, name)
    s = LSTMS[name]
    solver = train_step.leafpy_solver(be, lstm.lstm_config(s), s["batch"], s["classes"])
    rng = np.random.default_rng(0)
    x = lp.SharedTensor.from_numpy(rng.standard_normal((s["batch"], s["steps"], s["input"]), dtype=np.float32))
    y = lp.SharedTensor.from_numpy(rng.integers(0, s["classes"], s["batch"]).astype(np.float32))
    return solver, x, y


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nets", default="mlp128,lenet64,lstm",
                   help="comma-separated, of " + ", ".join([*train_step.NETWORKS, *LSTMS]))
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="set a backend attribute first (an integer or float), e.g. SPLIT_K_FINE_WORK=1e30")
    args = p.parse_args()
    be = lp.backend("webgpu")
    train_step.set_attributes(be, args.set, p.error)
    print(f"# webgpu on {be.adapter_name}")
    print(f"{'network':<14}{'dispatches':>11}{'replayed':>10}")
    for name in args.nets.split(","):
        solver, x, y = solver_and_batch(be, name)
        for _ in range(2):
            solver.train_minibatch(x, y)
        be.synchronize()
        dispatches, replays = be.dispatches, be.replays
        solver.train_minibatch(x, y)
        be.synchronize()
        print(f"{name:<14}{be.dispatches - dispatches:>11}{'yes' if be.replays > replays else 'no':>10}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
