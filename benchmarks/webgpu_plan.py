"""The kernels one webgpu training step dispatches, with their workgroup grids and the bytes they bind, without
running them: encoding is skipped, so a GPU-sized network at its real batch is listed in seconds on any adapter
(lavapipe included). Grids and bindings do not depend on the adapter beyond its limits, so this shows where a step's
work goes and how parallel each kernel is (a product on a few dozen workgroups stands out) before a GPU is at hand.

    python benchmarks/webgpu_plan.py --net alexnet128 --precision fp16 [--batch 128] [--set NAME=VALUE] [--each]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step  # noqa: E402

import leafpy as lp  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--net", default="alexnet128", choices=sorted(train_step.NETWORKS))
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16"])
    p.add_argument("--batch", type=int, default=0, help="default: the network's benchmark batch")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="set one of the backend's tuning attributes first (as profile_layers.py's --set)")
    p.add_argument("--each", action="store_true", help="list every dispatch in order, not totals per kernel")
    args = p.parse_args()
    be = lp.backend("webgpu", **({"precision": args.precision} if args.precision != "fp32" else {}))
    train_step.set_attributes(be, args.set, p.error)
    be.replay = False  # every step encodes its dispatches (and none runs)
    listed: list[tuple[str, str, tuple, int]] = []

    def encode(d):
        ranges = d.ranges or [None] * len(d.buffers)
        bound = sum((r[1] if r is not None else b.raw.size) for b, r in zip(d.buffers, ranges))
        listed.append((d.module, d.entry, tuple(d.grid), bound))

    be._encode = encode
    make, batch, shape, classes = train_step.NETWORKS[args.net]
    batch = args.batch or batch
    solver = train_step.leafpy_solver(be, make(), batch, classes)  # a network takes any batch size
    rng = np.random.default_rng(0)
    x = lp.SharedTensor.from_numpy(rng.random((batch, *shape), dtype=np.float32))
    y = lp.SharedTensor.from_numpy(rng.integers(0, classes, batch).astype(np.float32))
    solver.train_minibatch(x, y)  # the first step allocates and casts what later steps reuse
    listed.clear()
    solver.train_minibatch(x, y)
    print(f"# {args.net} at batch {batch}, webgpu {args.precision} on {be.adapter_name}: {len(listed)} dispatches, "
          f"{sum(b for *_, b in listed) / 1e9:.2f} GB bound")
    if args.each:
        for module, entry, groups, bound in listed:
            print(f"{module:<16}{entry:<28}{str(groups):<18}{groups[0] * groups[1] * groups[2]:>9}{bound / 1e6:>10.1f}")
        return 0
    count, workgroups, smallest, bound = (collections.Counter(), collections.Counter(), {}, collections.Counter())
    for module, entry, groups, b in listed:
        key = (module, entry)
        n = groups[0] * groups[1] * groups[2]
        count[key] += 1
        workgroups[key] += n
        smallest[key] = min(smallest.get(key, n), n)
        bound[key] += b
    print(f"{'module':<16}{'entry':<28}{'calls':>6}{'workgroups':>11}{'fewest':>8}{'MB bound':>10}")
    for key in sorted(count, key=lambda k: -bound[k]):
        print(f"{key[0]:<16}{key[1]:<28}{count[key]:>6}{workgroups[key]:>11}{smallest[key]:>8}"
              f"{bound[key] / 1e6:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
