"""Resident memory of an epoch over a dataset larger than memory: a ``.npy`` file of uint8 images (3x64x64, a
marked corner that gives the class) written a chunk at a time, trained for one epoch by ``leafpy train`` with
``dataset: npy`` (read through a memory map), and the peak resident set of that process (VmHWM, read by the
process itself as it exits) reported beside the file's size, with the epoch's samples per second and held-out
accuracy.

    python benchmarks/mapped_memory.py [--gb 8] [--dir DIR] [--keep] [--json FILE]

The file is written to ``--dir`` (kept there, and reused when it has the right size) or to a temporary directory
(removed afterwards unless ``--keep``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = (3, 64, 64)
RUN = textwrap.dedent("""\
    name: mapped_memory
    data: {dataset: npy, path: {x: x.npy, y: y.npy}, batch_size: 256, test_fraction: 0.02, seed: 0}
    network:
      type: Sequential
      inputs: [{name: data, shape: [null, 3, 64, 64]}]
      layers:
        - {name: pool, type: Pooling, mode: average, filter_shape: [8, 8], stride: 8}
        - {name: flat, type: Flatten}
        - {name: head, type: Linear, output_size: 5}
        - {name: logsm, type: LogSoftmax}
    objective: nll
    solver: {solver: momentum, base_lr: 0.05, momentum: 0.9, seed: 3}
    train: {epochs: 1}
    """)
CHILD = textwrap.dedent("""\
    import atexit, runpy, sys

    def peak():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                print("peak resident", line.split(":")[1].strip(), file=sys.stderr)

    atexit.register(peak)
    sys.argv = ["leafpy"] + sys.argv[1:]
    runpy.run_module("leafpy", run_name="__main__")
    """)


def write(folder: str, n: int) -> None:
    """x.npy (n images) and y.npy in ``folder``, a chunk at a time, unless files of that size are there."""
    path = os.path.join(folder, "x.npy")
    rng = np.random.default_rng(0)
    y = rng.integers(0, 5, n)
    if os.path.exists(path) and np.load(path, mmap_mode="r").shape == (n, *SAMPLE):
        return
    x = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(n, *SAMPLE))
    chunk = 8192
    for start in range(0, n, chunk):
        part = rng.integers(0, 255, (min(chunk, n - start), *SAMPLE), dtype=np.uint8)
        part[:, 0, :8, :8] = y[start:start + len(part), None, None] * 50
        x[start:start + len(part)] = part
        x.flush()
    del x
    np.save(os.path.join(folder, "y.npy"), y)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=8.0, help="size of the image file in GB (10^9 bytes)")
    p.add_argument("--dir", default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    n = max(1000, int(args.gb * 1e9) // int(np.prod(SAMPLE)))
    folder = args.dir or tempfile.mkdtemp(prefix="leafpy-mapped-")
    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    write(folder, n)
    written = time.perf_counter() - t0
    with open(os.path.join(folder, "run.yaml"), "w") as f:
        f.write(RUN)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), MPLBACKEND="Agg")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, "train", "run.yaml", "--out", "run", "--overwrite"],
                          cwd=folder, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        return 1
    peak = int(proc.stderr.split("peak resident")[1].split()[0]) * 1024  # kB
    size = os.path.getsize(os.path.join(folder, "x.npy"))
    accuracy = float(proc.stdout.split("held-out accuracy: ")[1].split("%")[0])
    row = {"file_bytes": size, "samples": n, "peak_resident_bytes": peak, "seconds": round(seconds, 1),
           "samples_per_s": round(n / seconds), "accuracy_percent": accuracy, "write_seconds": round(written, 1)}
    print(f"file {size / 1e9:.2f} GB ({n} samples), peak resident {peak / 2**20:.0f} MiB, epoch {seconds:.1f} s "
          f"({n / seconds:.0f} samples/s, file written in {written:.1f} s), held-out accuracy {accuracy:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    if not args.keep and not args.dir:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
