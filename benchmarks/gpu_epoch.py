"""A training epoch fed from an image folder against the same epoch fed from arrays already in memory: ResNet-18
(configs/resnet18_cifar.yaml) on CIFAR-sized 32x32 PNG files (data_pipeline.py's generated folder), with random
crop (pad 4), horizontal flip and per-channel normalisation in both runs, ``data.workers`` threads preparing
batches ahead, on the given backend and precision (default: cuda, bf16, channels-last).

* folder: ``dataset: image_folder`` with a fresh cache: epoch 1 decodes the files as it trains; later epochs read
  the decoded uint8 images.
* arrays: the same images (the folder's train and test splits) decoded once by Pillow here, written with np.savez
  as x_train/y_train/x_test/y_test and loaded whole (``dataset: npz``): both runs train on the same batch shapes.

An untimed epoch of the arrays' run first compiles the kernels and chooses the plans for every batch shape (on a
fresh machine that takes longer than an epoch: a last batch of a size not seen before costs seconds), so neither
run pays for it. Each run trains ``--epochs`` epochs; the table gives the seconds each run took to prepare its data
(``lp.Trainer``: for the folder, listing and decoding every file into the cache and summing it for ``normalize:
auto``), each epoch's seconds and images per second (the Trainer's own records: training only) and the folder's
time per image over the arrays'.

    python benchmarks/gpu_epoch.py [--backend cuda] [--precision bf16] [--images 50000] [--workers 4]
        [--epochs 3] [--decoding auto|threads|processes] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import data_pipeline  # noqa: E402
import train_step  # noqa: E402

import leafpy as lp  # noqa: E402


def images_of(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """The folder's images as uint8 [N, 3, 32, 32] and class indices (sorted class folder names)."""
    from PIL import Image

    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    files = [(k, f) for k, c in enumerate(classes) for f in sorted((folder / c).iterdir())]
    x = np.stack([np.asarray(Image.open(f).convert("RGB")).transpose(2, 0, 1) for _, f in files])
    return x, np.array([k for k, _ in files])


def arrays_of(train: Path, test: Path, out: Path) -> Path:
    """Both folders' images and classes as out.npz's x_train, y_train, x_test, y_test."""
    if not out.exists():  # written whole, then renamed: an interrupted run leaves no partial file for the next
        (x, y), (xt, yt) = images_of(train), images_of(test)
        partial = out.with_name(out.name + ".partial")
        with open(partial, "wb") as f:
            np.savez(f, x_train=x, y_train=y, x_test=xt, y_test=yt)
        partial.replace(out)
    return out


def run_text(data: dict, workers: int, batch: int) -> str:
    run = yaml.safe_load((HERE.parent / "configs" / "resnet18_cifar.yaml").read_text())
    run["data"] = {**data, "batch_size": batch, "workers": workers, "seed": 0, "normalize": "auto",
                   "augment": {"random_crop": 4, "horizontal_flip": True}}
    run["train"] = {"epochs": 1}
    return yaml.safe_dump(run)


def epochs(text: str, backend: lp.Backend, n: int) -> tuple[float, list[dict]]:
    """(seconds to prepare the data, the records of ``n`` epochs)."""
    t0 = time.perf_counter()
    trainer = lp.Trainer(lp.config.loads(text), backend, log=lambda msg: None)
    prepared = time.perf_counter() - t0
    return prepared, [{"epoch": r["epoch"], "seconds": r["seconds"], "images_per_s": r["samples_per_second"]}
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
    p.add_argument("--decoding", default="auto", choices=["auto", "threads", "processes"],
                   help="the folder run's data.decoding")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="leafpy-gpu-epoch-"))
    train, test = data_pipeline.generate(directory, args.images)
    npz = arrays_of(train, test, directory / f"arrays{args.images}-split.npz")
    options: dict = {"precision": args.precision} if args.precision != "fp32" else {}
    if args.backend != "webgpu":
        options["channels_last"] = not args.no_channels_last
    backend = lp.backend(args.backend, **options)
    train_step.set_attributes(backend, args.set, p.error)
    cache = tempfile.mkdtemp(prefix="leafpy-gpu-epoch-cache-")
    arrays_run = run_text({"dataset": "npz", "path": str(npz)}, args.workers, args.batch)
    try:
        epochs(arrays_run, backend, 1)  # untimed: the kernels compiled and the plans chosen before either run
        folder_run = run_text({"dataset": "image_folder", "path": {"train": str(train), "test": str(test)},
                               "cache_dir": cache, "decoding": args.decoding}, args.workers, args.batch)
        folder_prepared, folder = epochs(folder_run, backend, args.epochs)
        arrays_prepared, arrays = epochs(arrays_run, backend, args.epochs)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"# ResNet-18, {args.images} 32x32 images, batch {args.batch}, {args.workers} workers (decoding "
          f"{args.decoding}), {backend.name} "
          f"{args.precision}{' channels-last' if backend.channels_last else ' row-major'}")
    print(f"{'epoch':>5}  {'folder s':>9} {'img/s':>8}  {'arrays s':>9} {'img/s':>8}  {'folder/arrays':>13}")
    print(f"{'data':>5}  {folder_prepared:>9.2f} {args.images / folder_prepared:>8.0f}  {arrays_prepared:>9.2f} "
          f"{'':>8}  (preparing: listing, decoding and summing the folder; loading the arrays)")
    for f, a in zip(folder, arrays):
        print(f"{f['epoch']:>5}  {f['seconds']:>9.2f} {f['images_per_s']:>8.0f}  {a['seconds']:>9.2f} "
              f"{a['images_per_s']:>8.0f}  {a['images_per_s'] / f['images_per_s']:>13.3f}")
    later = [a["images_per_s"] / f["images_per_s"] for f, a in zip(folder[1:], arrays[1:])]
    if later:
        print(f"after the first epoch the folder's epoch takes {np.mean(later):.3f}x the arrays' (target: <= 1.10)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"folder": folder, "arrays": arrays, "folder_prepare_s": folder_prepared,
                       "arrays_prepare_s": arrays_prepared, "images": args.images, "workers": args.workers,
                       "backend": backend.name, "precision": args.precision,
                       "channels_last": backend.channels_last}, f, indent=1)
    if not args.dir:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
