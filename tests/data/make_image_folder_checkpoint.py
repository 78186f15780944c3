"""Writes image_folder_checkpoint_v2.leaf: a checkpoint of a run on an image folder, by the leafpy of the
checkout given (run once, by hand, with a leafpy from before image folders kept their images as bytes and
fingerprinted them so):

    python tests/data/make_image_folder_checkpoint.py /path/to/that/leafpy/checkout

The images come from ``write_images`` (seeded; tests/test_data_sources.py writes the same ones), so a test can
resume the checkpoint on them with today's leafpy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RUN = ["digits_mlp", "--set", "data.dataset=image_folder", "--set", "data.path=images", "--set",
       "data.batch_size=4", "--set", "network.layers.fc2.output_size=3"]
"""The run, as the command takes it (the images in ./images)."""


def write_images(root: Path) -> None:
    """Three classes of eight 8x8 grayscale PNGs, the same pixels on every call."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(3):
        folder = root / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(8):
            pixels = (rng.random((8, 8)) * 255 + 40 * c).clip(0, 255).astype(np.uint8)
            Image.fromarray(pixels, "L").save(folder / f"{i}.png")


def main(checkout: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        write_images(Path(tmp) / "images")
        env = {**os.environ, "PYTHONPATH": checkout}
        subprocess.run([sys.executable, "-m", "leafpy", "train", *RUN, "--epochs", "1", "--out", "run"], cwd=tmp,
                       env=env, check=True)
        shutil.copy(Path(tmp) / "run" / "checkpoint.leaf", HERE / "image_folder_checkpoint_v2.leaf")


if __name__ == "__main__":
    main(sys.argv[1])
