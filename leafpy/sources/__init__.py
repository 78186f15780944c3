"""Datasets as users have them (folders of images, CSV tables) and the preparation a trained model keeps with it
(class names, normalisation). ``lp.data`` re-exports what users call; nothing here imports Pillow until an image is
read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _checks
from ..errors import ConfigError, LeafpyError
from .parts import Parts

KINDS = ("image_folder", "csv")


def load(kind: str, spec: dict, targets: str, input_shape: Sequence[int] | None) -> Parts:
    """What a run file's ``data: {dataset: image_folder | csv, ...}`` reads; an image folder's ``image_size`` and
    ``channels`` default to the network's input ([channels, H, W])."""
    from . import csv_table, image_folder

    path = spec.get("path")
    if not path:
        what = "the CSV file" if kind == "csv" else "the folder of class folders (or {train: DIR, test: DIR})"
        raise ConfigError(f"data.path: the {kind} dataset needs {what}")
    if kind == "csv":
        if "target" not in spec:
            raise ConfigError("data.target: the csv dataset needs the name of its label (or value) column")
        return csv_table.read(path, spec["target"], features=spec.get("features"),
                              delimiter=spec.get("delimiter", ","), targets=targets)
    if targets == "values":
        raise ConfigError("data.dataset: an image folder holds classes, and this objective needs values to regress "
                          "on; use an objective with classes (NegativeLogLikelihood)")
    shape = list(input_shape) if input_shape is not None and len(input_shape) == 3 else None
    skip, memory_map = spec.get("skip_unreadable", False), spec.get("memory_map", False)
    for key, value in (("skip_unreadable", skip), ("memory_map", memory_map)):
        if not isinstance(value, bool):
            raise ConfigError(f"data.{key}: expected true or false, got {value!r}")
    return image_folder.read(path, image_size=spec.get("image_size") or (shape[1:] if shape else None),
                             channels=spec.get("channels") or (shape[0] if shape else 3), skip_unreadable=skip,
                             cache_dir=spec.get("cache_dir", "default"), memory_map=memory_map,
                             workers=_checks.non_negative_int("data.workers", spec.get("workers", 0)),
                             decoding_in=spec.get("decoding", "auto"))


def samples_for_prediction(data: dict, path: str, input_shape: Sequence[int]
                           ) -> tuple[Any, list[str], list[str]] | None:
    """New samples for a trained model, read as its training data was (before normalisation): an image file or
    a folder of images (decoded to the run's ``image_size`` and ``channels``; with ``data.skip_unreadable``, files
    that do not decode left out) or a CSV table (the run's feature columns, by name); with a label for each (its
    file, its line), and the files left out. None for other files."""
    import os

    import numpy as np

    from . import csv_table, decoding, image_folder

    lower = path.lower()
    if os.path.isdir(path) or image_folder.is_image(os.path.basename(lower)):
        files = image_folder.image_files(path) if os.path.isdir(path) else [path]
        if not files:
            raise ConfigError(f"--input {path}: no images in the folder ({', '.join(image_folder.EXTENSIONS)})")
        shape = list(input_shape)
        if not data.get("image_size") and len(shape) != 3:
            what = f"a table's columns ({', '.join(data['features'])})" if data.get("features") else \
                f"samples of shape {shape}"
            raise ConfigError(f"--input {path}: images, where this run's network reads {what}, not images; give "
                              + ("a CSV table with those columns" if data.get("features") else
                                 "the samples as an .npz file (x: [N, ...])"))
        size = data.get("image_size") or shape[1:]
        channels = data.get("channels") or shape[0]
        (size, channels) = image_folder.check_size(list(size), channels)
        skip = data.get("skip_unreadable", False)
        if not isinstance(skip, bool):
            raise ConfigError(f"data.skip_unreadable: expected true or false, got {skip!r}")
        images, skipped = image_folder.decode_all(
            files, size, channels, skip, workers=_checks.non_negative_int("data.workers", data.get("workers", 0)),
            mode=decoding.check_mode(data.get("decoding", "auto")))
        base = path if os.path.isdir(path) else os.path.dirname(path)
        names = [os.path.relpath(f, base or ".") for f in files]
        if len(skipped) == len(files):
            raise LeafpyError(f"--input {path}: none of its {len(files)} images could be decoded")
        left_out = set(skipped)
        return (images.astype(np.float32) / np.float32(255.0), [n for i, n in enumerate(names) if i not in left_out],
                [names[i] for i in skipped])
    if lower.endswith((".csv", ".tsv", ".txt")):  # a table (as training read it, with the run's delimiter)
        features = data.get("features")
        if not features:
            raise ConfigError(f"--input {path}: the run records no CSV feature columns (data.features); it was "
                              "not trained on a CSV table, give an .npz file")
        table = csv_table.scan(path, data.get("delimiter", ","), features)
        return table.x, [f"line {line}" for line in table.lines.tolist()], []
    return None
