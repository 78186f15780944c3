"""AlexNet training steps on the cuda backend under its options (bias fusion, workspace cap), one process.

    python benchmarks/cuda_options.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train_step import solver_and_batch  # noqa: E402

import leafpy as lp  # noqa: E402
from leafpy.backends import cuda  # noqa: E402


def step_ms(be, name: str, steps: int = 20) -> float:
    s, x, y = solver_and_batch(be, name)
    for _ in range(5):
        s.train_minibatch(x, y)
    be.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        s.train_minibatch(x, y)
    be.synchronize()
    return (time.perf_counter() - t) / steps * 1000


def main() -> int:
    net = sys.argv[1] if len(sys.argv) > 1 else "alexnet128"
    for fuse in (False, True):
        for cap in (64 << 20, 256 << 20):
            cuda._CudnnConv.MAX_WORKSPACE = cap
            be = lp.backend("cuda", fuse_bias=fuse)
            print(f"{net}: fuse_bias={fuse} workspace cap {cap >> 20} MB: {step_ms(be, net):.2f} ms/step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
