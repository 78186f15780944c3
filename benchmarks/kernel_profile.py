"""GPU time per kernel of one training step, leafpy (cuda) beside PyTorch, from PyTorch's profiler (CUPTI sees
every kernel of the process: CuPy's, cuDNN's, cuBLAS's). leafpy's step runs without CUDA graphs here, so each
kernel is its own record; the kernels are the same ones a recorded step replays.

    python benchmarks/kernel_profile.py --net resnet18-128 [--conv-tolerance any|1e-5] [--precision bf16]
                                        [--channels-last] [--top 40] [--primitives]

--primitives also lists the backend primitives one leafpy step calls, with their operands, largest first: which
layer's call launched a fill, copy or cast that the kernel table shows.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from train_step import NETWORKS, TorchTrainer, conv_tolerance, solver_and_batch  # noqa: E402

import leafpy as lp  # noqa: E402


def kernel_table(torch, step, steps: int) -> tuple[collections.Counter, collections.Counter]:
    """(microseconds, launches) per kernel name over ``steps`` calls of ``step``."""
    times: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] += e.time_range.elapsed_us()
            counts[e.name] += 1
    return times, counts


def show(title: str, times, counts, steps: int, top: int) -> None:
    total = sum(times.values()) / steps / 1000
    print(f"{title}: {total:.3f} ms of kernel time per step, {sum(counts.values()) // steps} kernels")
    for name, t in times.most_common(top):
        print(f"  {t / steps / 1000:8.3f} ms {counts[name] / steps:5.1f}x  {name[:150]}")


def primitive_calls(be, step) -> list[tuple[int, str]]:
    """(bytes of the largest operand, "name shapes") of every backend primitive ``step`` calls."""
    from leafpy.backends.base import PRIMITIVES

    calls: list[tuple[int, str]] = []

    def describe(a) -> str:
        order = "" if getattr(a, "ndim", 0) != 4 or a.flags.c_contiguous else "/NHWC"
        return f"{a.dtype}{list(a.shape)}{order}" if hasattr(a, "shape") else repr(a)[:20]

    def wrap(name, method):
        def traced(*args, **kwargs):
            arrays = [a for a in (*args, *kwargs.values()) if hasattr(a, "nbytes")]
            calls.append((max((a.nbytes for a in arrays), default=0),
                          f"{name}({', '.join(describe(a) for a in (*args, *kwargs.values()))})"))
            return method(*args, **kwargs)
        return traced

    saved = {name: getattr(be, name) for name in (*PRIMITIVES, "cast", "relayout")
             if hasattr(be, name) and name != "view"}
    for name, method in saved.items():
        setattr(be, name, wrap(name, method))
    try:
        step()
    finally:
        for name, method in saved.items():
            setattr(be, name, method)
    return calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--net", default="resnet18-128", choices=sorted(NETWORKS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--conv-tolerance", type=conv_tolerance, default="default",
                   help="the cuda backend's conv_tolerance: a number, or 'any' (default: the backend's)")
    p.add_argument("--vs", choices=["torch", "none"], default="torch")
    p.add_argument("--precision", choices=["fp32", "tf32", "bf16", "fp16"], default="fp32",
                   help="leafpy's precision setting; PyTorch runs the same mode (autocast and channels_last for "
                        "bf16/fp16)")
    p.add_argument("--channels-last", action="store_true", help="leafpy stores 4-D tensors NHWC")
    p.add_argument("--primitives", action="store_true", help="list one step's backend primitive calls")
    args = p.parse_args()
    import torch

    options: dict = {} if args.conv_tolerance == "default" else {"conv_tolerance": args.conv_tolerance}
    be = lp.backend("cuda", graphs=False, precision=args.precision, channels_last=args.channels_last, **options)
    solver, x, y = solver_and_batch(be, args.net)
    for _ in range(3):
        solver.train_minibatch(x, y)
    be.synchronize()
    times, counts = kernel_table(torch, lambda: solver.train_minibatch(x, y), args.steps)
    plans = f"fp32, conv_tolerance {args.conv_tolerance}"
    show(f"leafpy {args.net} ({args.precision if args.precision != 'fp32' else plans})", times, counts,
         args.steps, args.top)
    cudnn = getattr(be, "_cudnn", None)
    if cudnn is not None:
        print("cuDNN passes: chosen plan ms (fastest plan ms), of all timed plans")
        total = 0.0
        for key, timings in cudnn.timings.items():
            chosen = cudnn.graphs[key][2]
            ms = next(m for m, _, i in timings if i == chosen)
            total += ms
            print(f"  {key[0]:<6} x{key[1]} w{key[2]} s{key[4]}: {ms:.3f} ({min(timings)[0]:.3f}) of {len(timings)}")
        print(f"  sum of chosen plans: {total:.3f} ms")
    if args.primitives:
        calls = primitive_calls(be, lambda: solver.train_minibatch(x, y))
        print(f"backend primitives of one step: {len(calls)} calls, in order")
        for nbytes, call in calls:
            print(f"  {nbytes / 2**20:8.1f} MiB  {call[:200]}")
    if args.vs == "torch":
        initial = [w.to_numpy() for w in solver.network.learnable_weights_data()]
        trainer = TorchTrainer.of_network(torch, solver.network.layer, initial, "cuda", tf32=False,
                                          precision=args.precision)
        xt, yt = trainer.to_device(x.to_numpy(), y.to_numpy().reshape(-1).astype(np.int64))
        for _ in range(5):
            trainer.step(xt, yt)
        trainer.sync()
        times, counts = kernel_table(torch, lambda: trainer.step(xt, yt), args.steps)
        show(f"torch {args.net}", times, counts, args.steps, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
