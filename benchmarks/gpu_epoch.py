"""A training epoch fed from an image folder against the same epoch fed from arrays already in memory: ResNet-18
(configs/resnet18_cifar.yaml) on CIFAR-sized 32x32 PNG files (data_pipeline.py's generated folder), with random
crop (pad 4), horizontal flip and per-channel normalisation in both runs, ``data.workers`` threads preparing
batches ahead, on the given backend and precision (default: cuda, bf16, channels-last).

* folder: ``dataset: image_folder`` with a fresh cache: epoch 1 decodes the files as it trains; later epochs read
  the decoded uint8 images.
* arrays: the same images decoded once by Pillow here, written with np.savez and loaded whole (``dataset: npz``).

An untimed epoch of the arrays' run first compiles the kernels and chooses the plans (on a fresh machine that takes
longer than an epoch), so neither run pays for it. Each run trains ``--epochs`` epochs; the table gives each
epoch's seconds and images per second (the Trainer's own records: training only) and, for the epochs after the
first, the folder's time per image over the arrays'.

    python benchmarks/gpu_epoch.py [--backend cuda] [--precision bf16] [--images 50000] [--workers 4]
        [--epochs 3] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import data_pipeline  # noqa: E402
import train_step  # noqa: E402

import leafpy as lp  # noqa: E402


def arrays_of(folder: Path, out: Path) -> Path:
    """The folder's images as uint8 [N, 3, 32, 32] and class indices (sorted class folder names), in out.npz."""
    from PIL import Image

    if out.exists():
        return out
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    files = [(k, f) for k, c in enumerate(classes) for f in sorted((folder / c).iterdir())]
    x = np.stack([np.asarray(Image.open(f).convert("RGB")).transpose(2, 0, 1) for _, f in files])
    np.savez(out, x=x, y=np.array([k for k, _ in files]))
    return out


def run_text(data: dict, workers: int, batch: int) -> str:
    run = yaml.safe_load((HERE.parent / "configs" / "resnet18_cifar.yaml").read_text())
    run["data"] = {**data, "batch_size": batch, "workers": workers, "seed": 0, "normalize": "auto",
                   "augment": {"random_crop": 4, "horizontal_flip": True}}
    run["train"] = {"epochs": 1}
    return yaml.safe_dump(run)


def epochs(text: str, backend: lp.Backend, n: int) -> list[dict]:
    trainer = lp.Trainer(lp.config.loads(text), backend, log=lambda msg: None)
    return [{"epoch": r["epoch"], "seconds": r["seconds"], "images_per_s": r["samples_per_second"]}
            for r in trainer.fit(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cuda", choices=["native", "cuda", "webgpu"])
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--no-channels-last", action="store_true")
    p.add_argument("--images", type=int, default=50000)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the generated folder is kept (default: a temporary one)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a backend tuning attribute (as train_step.py's --set)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="leafpy-gpu-epoch-"))
    train, test = data_pipeline.generate(directory, args.images)
    npz = arrays_of(train, directory / f"arrays{args.images}.npz")
    options: dict = {"precision": args.precision} if args.precision != "fp32" else {}
    if not args.no_channels_last and args.backend != "webgpu":
        options["channels_last"] = True
    backend = lp.backend(args.backend, **options)
    train_step.set_attributes(backend, args.set, p.error)
    cache = tempfile.mkdtemp(prefix="leafpy-gpu-epoch-cache-")
    arrays_run = run_text({"dataset": "npz", "path": str(npz), "test_fraction": 0.01}, args.workers, args.batch)
    try:
        epochs(arrays_run, backend, 1)  # untimed: the kernels compiled and the plans chosen before either run
        folder = epochs(run_text({"dataset": "image_folder", "path": {"train": str(train), "test": str(test)},
                                  "cache_dir": cache}, args.workers, args.batch), backend, args.epochs)
        arrays = epochs(arrays_run, backend, args.epochs)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"# ResNet-18, {args.images} 32x32 images, batch {args.batch}, {args.workers} workers, {backend.name} "
          f"{args.precision}{'' if args.no_channels_last else ' channels-last'}")
    print(f"{'epoch':>5}  {'folder s':>9} {'img/s':>8}  {'arrays s':>9} {'img/s':>8}  {'folder/arrays':>13}")
    for f, a in zip(folder, arrays):  # time per image (the arrays' run holds out 1% of the images)
        print(f"{f['epoch']:>5}  {f['seconds']:>9.2f} {f['images_per_s']:>8.0f}  {a['seconds']:>9.2f} "
              f"{a['images_per_s']:>8.0f}  {a['images_per_s'] / f['images_per_s']:>13.3f}")
    later = [a["images_per_s"] / f["images_per_s"] for f, a in zip(folder[1:], arrays[1:])]
    if later:
        print(f"after the first epoch the folder's epoch takes {np.mean(later):.3f}x the arrays' (target: <= 1.10)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"folder": folder, "arrays": arrays, "images": args.images, "workers": args.workers,
                       "backend": backend.name, "precision": args.precision}, f, indent=1)
    if not args.dir:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
