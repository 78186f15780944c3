"""Model file benchmark: the time and the memory that saving and loading a network take (native backend), beside
NumPy writing and reading the same arrays (``np.save`` into one file, then ``np.load``).

Each phase runs in a fresh child process, which reports its seconds and its peak resident memory above what it
held before the phase began (the built network or the arrays, for a save; nothing but Python and leafpy, for a
load), and the CPU seconds it used (all its threads: on a shared machine, the work itself). The Cap'n Proto
schema and the rest a process's first save or load imports are loaded before the clock starts (a tiny model saved
and loaded, its time printed on its own line).
Every phase runs ``--repeat`` times, alternating; the table gives the median. leafpy's save ends with an fsync (a
saved model is on the disk when ``save`` returns); ``np.save`` does not, so NumPy is timed both ways.

    python benchmarks/save_load.py [--model fc|alexnet] [--repeat 3] [--json FILE]

``--model fc`` (the default) is AlexNet's fully connected layers, Linear 9216->4096->4096->1000 with biases
(58.6 M weights); ``--model alexnet`` the whole of configs/alexnet.yaml.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("leafpy save", "leafpy load", "numpy save", "numpy save+fsync", "numpy load")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _cpu() -> float:
    """Seconds of CPU the process (all its threads) has used: what a phase costs, whatever else the machine runs."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _network(model: str) -> Any:
    import leafpy as lp

    be = lp.backend("native")
    if model == "alexnet":
        return lp.Layer.from_config(be, lp.config.load(str(ROOT / "configs" / "alexnet.yaml")).network, seed=0)
    cfg = lp.SequentialConfig(inputs=[("data", [1, 9216])])
    for i, (name, size) in enumerate((("fc6", 4096), ("fc7", 4096), ("fc8", 1000))):
        cfg.add_layer(lp.LayerConfig(name, lp.LinearConfig(output_size=size)))
        if i < 2:
            cfg.add_layer(lp.LayerConfig(f"relu{i + 6}", "ReLU"))
    net = lp.Layer.from_config(be, lp.LayerConfig("fc", cfg), seed=0)
    import numpy as np

    net.forward([np.zeros((1, 9216), np.float32)])
    return net


def _first_use(lp: Any, path: str) -> None:
    """Save and load a tiny model: what a process pays once (importing pycapnp and parsing leaf.capnp, the layer
    modules, NumPy's random module), whatever the size of its models."""
    cfg = lp.SequentialConfig(inputs=[("data", [1, 4])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("tiny", cfg), seed=0).save(path)
    lp.Layer.load(lp.backend("native"), path)
    os.unlink(path)


def child(phase: str, model: str, path: str) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    import leafpy as lp

    weights = 0
    t = time.perf_counter()
    _first_use(lp, path + ".first")  # what a process's first save and load import: timed on its own
    first_s = time.perf_counter() - t
    if phase == "leafpy load" or phase == "numpy load":
        base = _peak_mb()
        cpu, t = _cpu(), time.perf_counter()
        if phase == "leafpy load":
            net = lp.Layer.load(lp.backend("native"), path)
            weights = net.num_parameters()
        else:
            with open(path, "rb") as f:
                arrays = []
                while f.tell() < os.fstat(f.fileno()).st_size:
                    arrays.append(np.load(f))
    else:
        net = _network(model)
        base = _peak_mb()
        cpu, t = _cpu(), time.perf_counter()
        if phase == "leafpy save":
            net.save(path)
        else:
            with open(path, "wb") as f:
                for a in net.named_weights().values():
                    np.save(f, a)
                if phase.endswith("fsync"):
                    f.flush()
                    os.fsync(f.fileno())
        weights = net.num_parameters()
    seconds, cpu = time.perf_counter() - t, _cpu() - cpu
    return {"phase": phase, "seconds": seconds, "peak_mb_above": _peak_mb() - base, "weights": weights,
            "file_mb": os.path.getsize(path) / 2**20, "first_s": first_s, "cpu_s": cpu}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="fc", choices=("fc", "alexnet"))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", nargs=2, metavar=("PHASE", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.model, args.child[1])))
        return 0
    rows: dict[str, list[dict[str, Any]]] = {ph: [] for ph in PHASES}
    with tempfile.TemporaryDirectory(dir=os.environ.get("LEAFPY_BENCH_DIR")) as tmp:
        for _ in range(args.repeat):
            for phase in PHASES:
                path = str(Path(tmp) / ("model.leaf" if phase.startswith("leafpy") else "arrays.npy"))
                out = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", phase, path],
                                     capture_output=True, text=True, check=True)
                rows[phase].append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = rows["leafpy save"][0]
    print(f"# model {args.model}: {first['weights'] / 1e6:.1f} M weights, leafpy file {first['file_mb']:.0f} MB, "
          f"npy {rows['numpy save'][0]['file_mb']:.0f} MB; medians of {args.repeat}")
    for phase in PHASES:
        secs = [r["seconds"] for r in rows[phase]]
        peak = statistics.median(r["peak_mb_above"] for r in rows[phase])
        cpu = statistics.median(r["cpu_s"] for r in rows[phase])
        print(f"{phase:<17} {statistics.median(secs):7.3f} s  (min {min(secs):.3f}, max {max(secs):.3f})   "
              f"cpu {cpu:6.3f} s   peak memory +{peak:6.0f} MB")
    first_s = statistics.median(r["first_s"] for ph in PHASES for r in rows[ph])
    print(f"(not timed above: a process's first save and load of a tiny model, {first_s:.3f} s: pycapnp and "
          "leaf.capnp, the layer modules, NumPy's random module)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
