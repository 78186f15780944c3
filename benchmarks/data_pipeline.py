"""Data pipeline benchmark: training images per second from a folder of CIFAR-sized (32x32 RGB) PNG files, one
subfolder per class, with random crop (pad 4), horizontal flip and per-channel normalisation, side by side with
PyTorch written the usual way (a ``torch.utils.data.Dataset`` that decodes each file with Pillow and transforms it
with torch ops, a ``DataLoader`` of batch 128 with the same number of workers; torchvision is not used).

What is timed, for each number of workers (0 and 2 by default), with no network step:

* leafpy, epoch 1: ``lp.Trainer(run)`` with an empty image cache (listing; ``normalize: auto`` sums every training
  image, so the training folder is decoded here, by ``data.workers`` threads, where without it the images would
  be decoded as the batches take them) and then one pass over ``Trainer._batches``: the batch assembly
  ``leafpy train`` runs (the shuffled gather, the augmentation drawn from (seed, epoch, batch), ``data.workers``
  threads preparing batches ahead).
* leafpy, epoch 2: another pass over ``Trainer._batches`` (the samples already decoded).
* leafpy, a second run's epoch 1: ``lp.Trainer(run)`` again, the folder read from the cache, plus one pass.
* PyTorch, epochs 1 and 2: one pass over the DataLoader each (it decodes every file in every epoch).

Images per second = training images / seconds. The folder is generated once into ``--dir`` and reused.

With ``--memory-map`` the leafpy run sets ``data.memory_map: true``: its images are decoded into, and read from,
the uint8 cache file through a memory map instead of held in memory (uint8 either way, converted to float32 a batch
at a time).

    python benchmarks/data_pipeline.py [--images 50000] [--dir DIR] [--workers 0 2] [--memory-map] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CLASSES = 10
BATCH = 128
PAD = 4
RUN = """
name: data-pipeline
data: {{dataset: image_folder, path: {{train: {train}, test: {test}}}, cache_dir: {cache}, batch_size: {batch},
       workers: {workers}, memory_map: {memory_map}, seed: 0, normalize: auto,
       augment: {{random_crop: {pad}, horizontal_flip: true}}}}
network:
  type: Sequential
  inputs: [{{name: data, shape: [null, 3, 32, 32]}}]
  layers:
    - {{name: flat, type: Flatten}}
    - {{name: fc, type: Linear, output_size: {classes}}}
    - {{name: logsm, type: LogSoftmax}}
objective: nll
solver: {{solver: momentum, base_lr: 0.01}}
"""


def generate(directory: Path, images: int) -> tuple[Path, Path]:
    """``directory``/train (``images`` PNGs) and /test (10 per class), made once: smooth colour fields with noise,
    which compress like photographs rather than like pure noise."""
    train, test = directory / f"train{images}", directory / "test"
    for root, n in ((train, images), (test, 10 * CLASSES)):
        done = root / ".complete"
        if done.exists():
            continue
        from PIL import Image

        shutil.rmtree(root, ignore_errors=True)
        rng = np.random.default_rng(0)
        for k in range(CLASSES):
            (root / f"class{k}").mkdir(parents=True)
        for i in range(n):
            coarse = rng.integers(0, 256, (4, 4, 3)).astype(np.float32)
            field = np.kron(coarse, np.ones((8, 8, 1), np.float32)) + rng.normal(0, 12, (32, 32, 3))
            Image.fromarray(np.clip(field, 0, 255).astype(np.uint8), "RGB").save(root / f"class{i % CLASSES}" /
                                                                                 f"{i:06d}.png")
        done.touch()
    return train, test


def leafpy_side(train: Path, test: Path, workers: int, memory_map: bool) -> dict[str, float]:
    import leafpy as lp

    cache = tempfile.mkdtemp(prefix="leafpy-bench-cache-")
    try:
        run = lp.config.loads(RUN.format(train=train, test=test, cache=cache, batch=BATCH, workers=workers,
                                         pad=PAD, classes=CLASSES, memory_map=str(memory_map).lower()))
        out: dict[str, float] = {}
        for label in ("epoch 1", "second run"):
            t = time.perf_counter()
            trainer = lp.Trainer(run, lp.backend("native"), log=lambda msg: None)
            n = _pass(trainer, 0)
            out[label] = n / (time.perf_counter() - t)
            if label == "epoch 1":
                t = time.perf_counter()
                n = _pass(trainer, 1)
                out["epoch 2"] = n / (time.perf_counter() - t)
        return out
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _pass(trainer: Any, epoch: int) -> int:
    n = 0
    batches = trainer._batches(epoch, 0)
    for _, xb, _ in batches:
        n += len(xb)
    return n


def torch_side(train: Path, workers: int) -> dict[str, float]:
    from torch.utils.data import DataLoader

    loader = DataLoader(FolderDataset(str(train)), batch_size=BATCH, shuffle=True, num_workers=workers,
                        persistent_workers=False)
    out = {}
    for epoch in (1, 2):
        t = time.perf_counter()
        n = sum(len(xb) for xb, _ in loader)
        out[f"epoch {epoch}"] = n / (time.perf_counter() - t)
    return out


class FolderDataset:
    """ImageFolder written by hand: (files, labels) from sorted class folders; each item decoded with Pillow and
    transformed with torch ops (pad 4 and crop 32x32 at random, flip at random, scale and normalise)."""

    def __init__(self, root: str) -> None:
        import torch

        names = sorted(os.listdir(root))
        self.items = [(os.path.join(root, c, f), k) for k, c in enumerate(n for n in names if not n.startswith("."))
                      for f in sorted(os.listdir(os.path.join(root, c)))]
        self.mean = torch.tensor([0.5, 0.5, 0.5]).view(3, 1, 1)
        self.std = torch.tensor([0.25, 0.25, 0.25]).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        import torch
        import torch.nn.functional as F
        from PIL import Image

        path, label = self.items[i]
        with Image.open(path) as img:
            x = torch.from_numpy(np.asarray(img.convert("RGB"), np.uint8).copy()).permute(2, 0, 1)
        x = F.pad(x, (PAD, PAD, PAD, PAD))
        dy, dx = torch.randint(0, 2 * PAD + 1, (2,)).tolist()
        x = x[:, dy:dy + 32, dx:dx + 32]
        if torch.rand(()) < 0.5:
            x = x.flip(2)
        return (x.float() / 255.0 - self.mean) / self.std, label


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=50_000)
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "leafpy-data-pipeline"))
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--memory-map", action="store_true", help="leafpy: data.memory_map: true (batches converted "
                   "from the uint8 cache)")
    p.add_argument("--json", help="also write the numbers to this file")
    args = p.parse_args()
    t = time.perf_counter()
    train, test = generate(Path(args.dir), args.images)
    print(f"{args.images} 32x32 PNGs in {train} (ready in {time.perf_counter() - t:.1f} s); {os.cpu_count()} CPUs",
          flush=True)
    rows = []
    for w in args.workers:
        lp_rates, torch_rates = leafpy_side(train, test, w, args.memory_map), torch_side(train, w)
        rows.append({"workers": w, "leafpy": lp_rates, "torch": torch_rates})
        print(f"workers {w}: leafpy {lp_rates}, torch {torch_rates}", file=sys.stderr, flush=True)
    print("\n| workers | epoch | leafpy images/s | PyTorch images/s | leafpy / PyTorch |\n|---|---|---|---|---|")
    for r in rows:
        for e in ("epoch 1", "epoch 2"):
            a, b = r["leafpy"][e], r["torch"][e]
            print(f"| {r['workers']} | {e[-1]} | {a:,.0f} | {b:,.0f} | {a / b:.1f}x |")
        print(f"| {r['workers']} | 1, second run (cache) | {r['leafpy']['second run']:,.0f} | | |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
