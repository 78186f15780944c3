"""GEMM rates of one backend over square and convolution-like shapes, each transpose combination, in TFLOP/s.

    python benchmarks/gemm_shapes.py --backend webgpu [--tile 64|64x128|128]

``--tile`` forces the webgpu kernel's tile size (default: the backend's own choice per shape).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import leafpy as lp  # noqa: E402

SHAPES = [  # m, n, k, trans_a, trans_b: squares, then AlexNet/LeNet convolution and linear passes
    (4096, 4096, 4096, False, False), (4096, 4096, 4096, True, False), (4096, 4096, 4096, False, True),
    (192, 93312, 1600, False, False),   # AlexNet conv2 forward, whole batch
    (1600, 93312, 192, True, False),    # its data gradient
    (192, 1600, 93312, False, True),    # its filter gradient
    (128, 4096, 9216, False, True),     # fc6 forward
    (500, 65536, 50, True, False),      # LeNet-1024 conv2 data gradient
    (1024, 500, 800, False, True),      # LeNet-1024 fc1 forward
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="webgpu")
    p.add_argument("--tile", choices=["64", "64x128", "128"])
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    be = lp.backend(args.backend)
    if args.tile:
        fixed = {"64": ("gemm", 64, 64, ()), "64x128": ("gemm_big", 64, 128, (("BIG_ROWS", 64),)),
                 "128": ("gemm_big", 128, 128, ())}[args.tile]
        be.gemms.tile = lambda m, n, k=0, batch=1: fixed
    rng = np.random.default_rng(0)
    print(f"{'m':>6} {'n':>6} {'k':>6} ta tb   TFLOP/s")
    for m, n, k, ta, tb in SHAPES:
        a = lp.SharedTensor.from_numpy(rng.random((k, m) if ta else (m, k), dtype=np.float32))
        b = lp.SharedTensor.from_numpy(rng.random((n, k) if tb else (k, n), dtype=np.float32))
        c = lp.SharedTensor((m, n))
        ab, bb, cb = a.read(be), b.read(be), c.write(be)
        be.gemm(ab, ta, bb, tb, cb)
        be.synchronize()
        t = time.perf_counter()
        for _ in range(args.reps):
            be.gemm(ab, ta, bb, tb, cb)
        be.synchronize()
        ms = (time.perf_counter() - t) / args.reps * 1000
        print(f"{m:>6} {n:>6} {k:>6} {int(ta):>2} {int(tb):>2} {2 * m * n * k / ms / 1e9:9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
