"""Hostile-input corpus: corrupted model files loaded in a memory- and time-limited child process.

Run ``python -m tests.hostile.corpus --table`` from the repository root to print outcome counts per class.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MEMORY_LIMIT = 1 << 30
TIMEOUT_S = 20.0

CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
import leafpy as lp
from leafpy.errors import LeafpyError
backend = lp.backend("native") if hasattr(lp, "backend") else None
out = {}
for path in json.loads(sys.argv[1]):
    try:
        lp.Layer.load(backend, path)
        out[path] = "silently accepted"
    except LeafpyError:
        out[path] = "clear error"
    except MemoryError:
        out[path] = "memory"
    except Exception as e:  # classified, not hidden: the class name is reported
        out[path] = "raw exception:" + type(e).__name__
print("RESULT " + json.dumps(out))
""".replace("MEMORY_LIMIT", str(MEMORY_LIMIT))


def make_model(path: Path) -> None:
    """Save a small real model through the public API."""
    import leafpy as lp
    backend = lp.backend("native")
    layer = lp.Layer.from_config(backend, lp.LayerConfig("fc", lp.LinearConfig(output_size=3)), seed=0)
    layer.forward([np.ones((2, 4), np.float32)])
    layer.save(path)


def generate(work: Path, seed: int = 0, n: int = 20) -> dict[str, list[Path]]:
    """Seeded cases per class: truncations and single-byte flips of a real model file."""
    good = work / "good.leaf"
    make_model(good)
    data = good.read_bytes()
    rng = np.random.default_rng(seed)
    cases: dict[str, list[Path]] = {"model truncation": [], "model byte flip": []}
    for k, off in enumerate(sorted(set(rng.integers(0, len(data), n).tolist()))):
        p = work / f"trunc{k}.leaf"
        p.write_bytes(data[:off])
        cases["model truncation"].append(p)
    for k, off in enumerate(rng.integers(0, len(data), n).tolist()):
        b = bytearray(data)
        b[off] ^= 1 << int(rng.integers(0, 8))
        p = work / f"flip{k}.leaf"
        p.write_bytes(bytes(b))
        cases["model byte flip"].append(p)
    return cases


def run_batch(paths: list[Path]) -> dict[str, str]:
    """Load every path in one child; a crash, hang or memory kill marks every path of the batch."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    arg = json.dumps([str(p) for p in paths])
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True,
                           timeout=TIMEOUT_S, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {str(p): "hang" for p in paths}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    kind = "signal" if r.returncode < 0 else ("memory" if "MemoryError" in r.stderr else "raw exception")
    return {str(p): kind for p in paths}


def run(seed: int = 0, n: int = 20) -> dict[str, Counter]:
    with tempfile.TemporaryDirectory() as d:
        cases = generate(Path(d), seed, n)
        return {cls: Counter(v.split(":")[0] for v in run_batch(paths).values()) for cls, paths in cases.items()}


def table(result: dict[str, Counter]) -> str:
    kinds = ["clear error", "raw exception", "signal", "hang", "memory", "silently accepted"]
    rows = ["| class | cases | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 2) + "|"]
    for cls, c in result.items():
        rows.append(f"| {cls} | {sum(c.values())} | " + " | ".join(str(c.get(k, 0)) for k in kinds) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--full", action="store_true", help="200 cases per class")
    ap.add_argument("--table", action="store_true")
    a = ap.parse_args()
    print(table(run(a.seed, 200 if a.full else a.n)))
