"""Python calls per training step inside leafpy, by file: the host-side cost that a backend's structure adds.

The traced step is one ``Solver.train_minibatch`` of a four-layer MLP (784-256-128-64-10, ReLU, LogSoftmax, NLL,
SGD with momentum, batch 32), after three warm-up steps; ``sys.setprofile`` counts each Python function entered
whose code lives under ``leafpy/`` (calls into NumPy, CuPy or wgpu-py are not counted, their Python callers are).
Eager: the backend's step replay off (``backend.replay = False``); replayed: on, so the step runs from its
recording where the backend records steps.

    python benchmarks/python_calls.py [--backends native,webgpu] [--top 12] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_step  # noqa: E402

import leafpy as lp  # noqa: E402

PACKAGE = str(ROOT / "leafpy")


def mlp_solver(backend: lp.backends.Backend, batch: int = 32) -> lp.Solver:
    net = lp.SequentialConfig(inputs=[("data", [batch, 784])])
    for i, width in enumerate((256, 128, 64)):
        net.add_layer(lp.LayerConfig(f"fc{i}", lp.LinearConfig(output_size=width)))
        net.add_layer(lp.LayerConfig(f"relu{i}", "ReLU"))
    net.add_layer(lp.LayerConfig("out", lp.LinearConfig(output_size=10)))
    net.add_layer(lp.LayerConfig("logsm", "LogSoftmax"))
    return train_step.leafpy_solver(backend, lp.LayerConfig("mlp", net), batch, 10)  # NLL, momentum


def traced_step(backend_name: str, replay: bool) -> collections.Counter:
    """The leafpy functions entered during one step, counted by (file, function)."""
    backend = lp.backend(backend_name)
    backend.replay = replay
    solver = mlp_solver(backend)
    rng = np.random.default_rng(0)
    x = rng.random((32, 784), dtype=np.float32)
    y = rng.integers(0, 10, (32, 1)).astype(np.float32)
    for _ in range(3):
        solver.train_minibatch(x, y)
    solver.loss()
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg):  # noqa: ARG001 - the setprofile signature
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(PACKAGE):
                counts[(code.co_filename[len(PACKAGE) + 1:], code.co_name)] += 1

    sys.setprofile(profile)
    try:
        solver.train_minibatch(x, y)
    finally:
        sys.setprofile(None)
    solver.loss()
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="native,webgpu")
    p.add_argument("--top", type=int, default=12, help="files listed per backend and mode")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    print("| backend | step | Python calls in leafpy | files with the most calls |")
    print("|---|---|---:|---|")
    for name in args.backends.split(","):
        for replay in (False, True):
            counts = traced_step(name, replay)
            files: collections.Counter = collections.Counter()
            for (f, _), n in counts.items():
                files[f] += n
            total = sum(counts.values())
            top = ", ".join(f"{f} {n}" for f, n in files.most_common(args.top))
            mode = "replayed" if replay else "eager"
            print(f"| {name} | {mode} | {total} | {top} |")
            rows.append({"backend": name, "step": mode, "calls": total, "files": dict(files),
                         "functions": {f"{f}:{fn}": n for (f, fn), n in counts.most_common(40)}})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
