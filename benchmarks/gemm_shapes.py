"""GEMM rates of one backend over square, linear-layer and convolution-shaped products, in TFLOP/s.

    python benchmarks/gemm_shapes.py --backend webgpu [--tile 64|64x128|128x64|128] [--set BIG_64=0]

The shapes are AlexNet-128's: its fully connected layers' three products each, conv2's implicit GEMMs, and the
batched products of Winograd's tile points for conv2-5 (forward, data gradient, filter gradient; one product per
point of the transformed tile, in one dispatch), as the webgpu backend runs them. On webgpu every kernel is timed
on the GPU (timestamp queries; split-K's partial sums included); elsewhere the wall clock over ``--reps`` calls.
``--tile`` forces the webgpu kernel's tile; ``--set`` sets a backend attribute (as train_step.py's).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train_step import set_attributes  # noqa: E402

import leafpy as lp  # noqa: E402

SHAPES = [  # name, m, n, k, trans_a, trans_b, batch
    ("square 4096", 4096, 4096, 4096, False, False, 1),
    ("square 4096, A^T", 4096, 4096, 4096, True, False, 1),
    ("square 4096, B^T", 4096, 4096, 4096, False, True, 1),
    ("fc6 forward", 128, 4096, 9216, False, True, 1),
    ("fc6 data gradient", 128, 9216, 4096, False, False, 1),
    ("fc6 weight gradient", 4096, 9216, 128, True, False, 1),
    ("conv2 im2col forward", 192, 93312, 1600, False, False, 1),
    ("conv2 im2col filter gradient", 192, 1600, 93312, False, True, 1),
    ("LeNet-1024 conv2 data gradient", 500, 65536, 50, True, False, 1),
    ("conv2 Winograd forward", 192, 25088, 64, False, False, 36),
    ("conv2 Winograd data gradient", 64, 25088, 192, False, False, 36),
    ("conv2 Winograd filter gradient", 192, 64, 25088, False, True, 36),
    ("conv3 Winograd forward", 384, 6272, 192, False, False, 16),
    ("conv3 Winograd data gradient", 192, 6272, 384, False, False, 16),
    ("conv3 Winograd filter gradient", 384, 192, 6272, False, True, 16),
    ("conv4 Winograd forward", 256, 6272, 384, False, False, 16),
    ("conv4 Winograd data gradient", 384, 6272, 256, False, False, 16),
    ("conv4 Winograd filter gradient", 256, 384, 6272, False, True, 16),
    ("conv5 Winograd forward", 256, 6272, 256, False, False, 16),
    ("conv5 Winograd filter gradient", 256, 256, 6272, False, True, 16),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="webgpu")
    p.add_argument("--tile", choices=["64", "64x128", "128x64", "128"])
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a backend tuning attribute, e.g. BIG_64=0")
    p.add_argument("--only", default="", help="run the shapes whose name contains this text")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of products before the first timed shape")
    args = p.parse_args()
    be = lp.backend(args.backend)
    set_attributes(be, args.set, p.error)
    webgpu = args.backend == "webgpu"
    if args.tile:
        fixed = be.gemms.tile_kernel(*{"64": (64, 64), "64x128": (64, 128), "128x64": (128, 64),
                                       "128": (128, 128)}[args.tile])
        be.gemms.tile = lambda m, n, k=0, batch=1: fixed
    timed = webgpu and be.gpu.can_profile
    rng = np.random.default_rng(0)
    print(f"{'product':<32} {'m':>5} {'n':>6} {'k':>6} ta tb batch   ms    TFLOP/s  kernels"
          + ("" if timed else " (wall clock)"))
    if args.warmup:  # a GPU's clocks rise under load: the first shapes read slow without this
        a = lp.SharedTensor.from_numpy(rng.random((2048, 2048), dtype=np.float32))
        c = lp.SharedTensor((2048, 2048))
        ab, cb = a.read(be), c.write(be)
        until = time.perf_counter() + args.warmup
        while time.perf_counter() < until:
            for _ in range(10):
                be.gemm(ab, False, ab, False, cb)
            be.synchronize()
    total = 0.0
    for name, m, n, k, ta, tb, batch in SHAPES:
        if args.only not in name:
            continue
        shape_a, shape_b = ((k, m) if ta else (m, k)), ((n, k) if tb else (k, n))
        a = lp.SharedTensor.from_numpy(rng.random((batch, *shape_a), dtype=np.float32) - 0.5)
        b = lp.SharedTensor.from_numpy(rng.random((batch, *shape_b), dtype=np.float32) - 0.5)
        c = lp.SharedTensor((batch, m, n))
        ab, bb, cb = a.read(be), b.read(be), c.write(be)

        def run() -> None:
            if batch == 1:
                be.gemm(ab.reshape(shape_a), ta, bb.reshape(shape_b), tb, cb.reshape((m, n)))
            else:
                be.gemms.product(ab, ta, bb, tb, cb, m, n, k, 1.0, 0.0, batch=batch)

        run()
        be.synchronize()
        kernels = ""
        if timed:
            be.profile()
            for _ in range(args.reps):
                run()
            be.synchronize()
            times = be.kernel_times
            be.profile(False)
            ms = sum(t for t, _ in times.values()) / args.reps * 1000
            kernels = "; ".join(f"{label.split()[0]} {t / args.reps * 1000:.3f}" for label, (t, _) in
                                sorted(times.items(), key=lambda kv: -kv[1][0]))
            kernels += "  [" + next(iter(sorted(times, key=lambda x: -times[x][0]))) + "]"
        else:
            t = time.perf_counter()
            for _ in range(args.reps):
                run()
            be.synchronize()
            ms = (time.perf_counter() - t) / args.reps * 1000
        total += ms
        flops = 2.0 * m * n * k * batch
        print(f"{name:<32} {m:>5} {n:>6} {k:>6} {int(ta):>2} {int(tb):>2} {batch:>5} {ms:7.3f} {flops / ms / 1e9:8.2f}"
              f"  {kernels}", flush=True)
    print(f"total {total:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
