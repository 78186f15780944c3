"""cuDNN's candidate plans for each convolution pass of a shipped network: time, workspace, difference from the
candidates' median, and which plan leafpy keeps (fp32 mode, or --tf32).

    python benchmarks/cudnn_plans.py [--config alexnet.yaml] [--batch 128] [--tf32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_cudnn_accuracy import conv_shapes  # noqa: E402

import leafpy as lp  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="alexnet.yaml")
    p.add_argument("--tf32", action="store_true")
    args = p.parse_args()
    import cupy as cp

    be = lp.backend("cuda", tf32=args.tf32)
    rng = np.random.default_rng(0)
    for layer, x_shape, w_shape, stride, padding in conv_shapes(args.config):
        n, _, h, wd = x_shape
        oh = (h + 2 * padding[0] - w_shape[2]) // stride[0] + 1
        ow = (wd + 2 * padding[1] - w_shape[3]) // stride[1] + 1
        x = cp.asarray(rng.standard_normal(x_shape, dtype=np.float32))
        w = cp.asarray(rng.standard_normal(w_shape, dtype=np.float32))
        dy = cp.asarray(rng.standard_normal((n, w_shape[0], oh, ow), dtype=np.float32))
        y, dx, dw = (cp.empty(s, cp.float32) for s in ((n, w_shape[0], oh, ow), x_shape, w_shape))
        be.conv2d(x, w, y, stride, padding, {})
        be.conv2d_grad_data(dy, w, dx, stride, padding, {})
        be.conv2d_grad_filter(x, dy, dw, stride, padding, {})
        conv = be._cudnn
        for key, timings in conv.timings.items():
            if key[1] != tuple(x_shape) or key[2] != tuple(w_shape):
                continue
            kept = conv.graphs[key][2]
            errors = conv.errors.get(key, {})
            print(f"{layer} {key[0]} {list(x_shape)} * {list(w_shape)}: {len(timings)} plans")
            for ms, size, i in sorted(timings):
                mark = "*" if i == kept else " "
                err = errors.get(i)
                print(f"  {mark} plan {i:2d}: {ms:7.3f} ms, workspace {size / 2**20:8.1f} MB, "
                      f"vs median {err:.1e}" if err is not None else f"  {mark} plan {i:2d}: {ms:7.3f} ms")


if __name__ == "__main__":
    main()
