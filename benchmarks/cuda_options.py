"""Training steps on the cuda backend under its cuDNN plan options (workspace cap, plan tolerance, TF32), one
process, with the peak GPU memory in use for each.

    python benchmarks/cuda_options.py [alexnet128]
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train_step import solver_and_batch  # noqa: E402

import leafpy as lp  # noqa: E402
from leafpy.backends import cuda  # noqa: E402


def step_ms(be, name: str, steps: int = 20) -> tuple[float, float]:
    be.track_memory()
    s, x, y = solver_and_batch(be, name)
    for _ in range(5):
        s.train_minibatch(x, y)
    be.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        s.train_minibatch(x, y)
    be.synchronize()
    ms = (time.perf_counter() - t) / steps * 1000
    return ms, be.peak_memory() / 2**20


def main() -> int:
    net = sys.argv[1] if len(sys.argv) > 1 else "alexnet128"
    for tf32 in (False, True):
        for cap in (256 << 20, 1 << 30):
            for tol in (0.0, 0.03, 0.1):
                cuda._CudnnConv.MAX_WORKSPACE, cuda._CudnnConv.PLAN_TOLERANCE = cap, tol
                be = lp.backend("cuda", tf32=tf32)
                ms, mb = step_ms(be, net)
                ws = be._cudnn.workspace.nbytes >> 20 if be._cudnn else 0
                print(f"{net}: tf32={tf32} workspace cap {cap >> 20} MB tolerance {tol:.2f}: {ms:.2f} ms/step, "
                      f"peak {mb:.0f} MB (cuDNN workspace {ws} MB)", flush=True)
                del be
                gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
