"""Model file benchmark: the time and the memory that saving and loading a network take (native backend).

Each phase runs in a fresh child process, which reports its seconds and its peak resident memory above what it
held before the phase began (the built network, for a save; nothing but Python and leafpy, for a load).

    python benchmarks/save_load.py [--config alexnet.yaml] [--batch 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(phase: str, config: str, batch: int, path: str) -> None:
    sys.path.insert(0, str(ROOT))
    import leafpy as lp

    be = lp.backend("native")
    if phase == "save":
        run = lp.config.load(str(ROOT / "configs" / config))
        net = lp.Layer.from_config(be, run.network, seed=0)
        base = _peak_mb()
        t = time.perf_counter()
        net.save(path)
    else:
        base = _peak_mb()
        t = time.perf_counter()
        net = lp.Layer.load(be, path)
    seconds = time.perf_counter() - t
    weights = sum(w.to_numpy().size for w in net.learnable_weights_data())
    print(json.dumps({"phase": phase, "seconds": seconds, "peak_mb_above": _peak_mb() - base,
                      "weights": weights, "file_mb": os.path.getsize(path) / 2**20}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="alexnet.yaml", help="a run file in configs/")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", nargs=2, metavar=("PHASE", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.config, args.batch, args.child[1])
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.leaf")
        for phase in ("save", "load"):
            out = subprocess.run([sys.executable, __file__, "--config", args.config, "--child", phase, path],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    w = rows[0]["weights"]
    print(f"# {args.config}: {w / 1e6:.1f} M weights, file {rows[0]['file_mb']:.0f} MB")
    for r in rows:
        print(f"{r['phase']:<5} {r['seconds']:8.2f} s   peak memory +{r['peak_mb_above']:8.0f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
