"""Where a training step's time goes: each layer's forward, backward_input and backward_parameters, timed with
the backend synchronised around every call (so the numbers add up to more than a real step). With ``--repeat R``
each call is issued R times between two synchronisations and the time divided by R, which takes the cost of a
synchronisation (large on webgpu) out of the per-layer figures.

    python benchmarks/profile_layers.py --backend cuda --net alexnet128 [--vs torch]

On cuda it also lists, per convolution pass, the cuDNN plans timed by the autotuner (time and workspace); with
``--vs torch`` it adds PyTorch's own profile of the same network's steps (operators by GPU time).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from train_step import NETWORKS, SETTLE_S, set_attributes, solver_and_batch  # noqa: E402

import leafpy as lp  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="native")
    p.add_argument("--net", default="lenet64", choices=sorted(NETWORKS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--vs", choices=["torch", "none"], default="none")
    p.add_argument("--repeat", type=int, default=1, help="issue each call this many times per synchronisation")
    p.add_argument("--kernels", action="store_true",
                   help="webgpu: GPU time per kernel (timestamp queries) instead of per layer")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="set a backend attribute first (an integer or float), e.g. SPLIT_K_TILES=512")
    p.add_argument("--tf32", action="store_true", help="TF32 convolutions and GEMMs in both frameworks (cuda)")
    p.add_argument("--precision", default="fp32", help="the backend's precision setting (fp32, bf16, fp16...)")
    p.add_argument("--channels-last", action="store_true", help="4-D tensors stored NHWC (native, cuda)")
    args = p.parse_args()
    options: dict = {"graphs": False, "tf32": args.tf32} if args.backend == "cuda" else {}
    if args.precision != "fp32":
        options["precision"] = args.precision
    if args.backend != "webgpu":  # stated either way: the cuda backend's default depends on the precision
        options["channels_last"] = args.channels_last
    be = lp.backend(args.backend, **options)
    set_attributes(be, args.set, p.error)
    if args.backend == "native":
        be.replay = False  # a replayed step runs none of the layers' Python, which is what this profile times
    solver, x, y = solver_and_batch(be, args.net)
    for _ in range(3):
        solver.train_minibatch(x, y)
    if args.kernels:
        profile_kernels(be, solver, x, y, args)
        return 0
    times: collections.Counter = collections.Counter()
    for net in (solver.network, solver.objective):
        for layer in net.layer.layers:
            for method in ("forward", "backward_input", "backward_parameters"):
                original = getattr(layer.worker, method)

                def timed(*a, _f=original, _k=(layer.name, method), **kw):
                    be.synchronize()
                    t = time.perf_counter()
                    for _ in range(args.repeat):
                        result = _f(*a, **kw)
                    be.synchronize()
                    times[_k] += (time.perf_counter() - t) / args.repeat
                    return result

                setattr(layer.worker, method, timed)
    be.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        solver.train_minibatch(x, y)
    be.synchronize()
    total = (time.perf_counter() - t0) / args.steps * 1000
    layers = sum(times.values()) / args.steps * 1000
    if args.repeat == 1:
        print(f"{args.net} on {args.backend}: {total:.2f} ms/step synchronised per call; layers {layers:.2f} ms, "
              f"rest (update, bookkeeping) {total - layers:.2f} ms")
    else:
        print(f"{args.net} on {args.backend}: layers {layers:.2f} ms per step, each call issued {args.repeat} times "
              "per synchronisation")
    for (name, method), t in times.most_common():
        print(f"  {name:>8} {method:<20} {t / args.steps * 1000:8.3f} ms")
    cudnn = getattr(be, "_cudnn", None)
    if cudnn is not None:
        print("cuDNN plans per pass (ms, workspace MB), fastest first; * = chosen")
        for key, timings in cudnn.timings.items():
            chosen = cudnn.graphs[key][2]
            plans = sorted(timings)[:6]
            text = ", ".join(f"{'*' if i == chosen else ''}{ms:.3f}/{ws / 2**20:.0f}" for ms, ws, i in plans)
            print(f"  {key[0]:<6} x{key[1]} w{key[2]}: {text}")
    if args.vs == "torch":
        profile_torch(solver, x, y, args)
    return 0


def profile_kernels(be, solver, x, y, args) -> None:
    """Each kernel's GPU time per step, every dispatch timed in its own pass (webgpu)."""
    be.profile()
    for _ in range(args.steps):
        solver.train_minibatch(x, y)
    be.synchronize()
    times = be.kernel_times
    be.profile(False)
    total = sum(t for t, _ in times.values()) / args.steps * 1000
    print(f"{args.net} on {args.backend}: {total:.2f} ms of GPU time per step in "
          f"{sum(n for _, n in times.values()) // args.steps} dispatches")
    for name, (t, n) in sorted(times.items(), key=lambda kv: -kv[1][0]):
        print(f"  {t / args.steps * 1000:8.3f} ms  {n // args.steps:4d}x  {name}")


def profile_torch(solver, x, y, args) -> None:
    """PyTorch's profile of the same network and batch, by operator, GPU time per step."""
    import torch
    from train_step import TorchTrainer

    initial = [w.to_numpy() for w in solver.network.learnable_weights_data()]
    device = "cuda" if args.backend == "cuda" else "cpu"
    trainer = TorchTrainer.of_network(torch, solver.network.layer, initial, device, tf32=args.tf32)
    xt, yt = trainer.to_device(x.to_numpy(), y.to_numpy().reshape(-1).astype(np.int64))
    for _ in range(5):
        trainer.step(xt, yt)
    trainer.sync()
    if device == "cpu":
        time.sleep(SETTLE_S)  # numpy's idle threads go to sleep first (see train_step.SETTLE_S)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            trainer.step(xt, yt)
        trainer.sync()
    sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=30))


if __name__ == "__main__":
    sys.exit(main())
