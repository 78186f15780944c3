"""Run files for tests, built rather than pasted: a Sequential over one input ``data`` (batch ``null``, taken from
``data.batch_size``), a short objective, a solver. ``run_file(...)`` gives the YAML text a user would write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml


def layer(name: str, type_: str, **settings: Any) -> dict:
    """One layer entry: ``layer("fc1", "Linear", output_size=16)``."""
    return {"name": name, "type": type_, **settings}


def mlp(*sizes: int, activation: str = "ReLU", log_softmax: bool = True) -> list[dict]:
    """Linear layers of ``sizes`` outputs with ``activation`` between them, ending in a LogSoftmax (for ``nll``)
    unless ``log_softmax`` is False (a regression head)."""
    layers: list[dict] = []
    for i, size in enumerate(sizes, 1):
        if i > 1:
            layers.append(layer(f"act{i - 1}", activation))
        layers.append(layer(f"fc{i}", "Linear", output_size=size))
    if log_softmax:
        layers.append(layer("logsm", "LogSoftmax"))
    return layers


def run_file(layers: Sequence[dict], input_shape: Sequence[int], *, data: dict, objective: str | dict = "nll",
             solver: dict | None = None, train: dict | None = None, name: str = "run") -> str:
    """The YAML text of a run: ``layers`` over an input of ``input_shape`` (without the batch)."""
    run: dict[str, Any] = {
        "name": name,
        "data": dict(data),
        "network": {"type": "Sequential", "inputs": [{"name": "data", "shape": [None, *input_shape]}],
                    "layers": [dict(entry) for entry in layers]},
        "objective": objective,
        "solver": solver or {"solver": "momentum", "base_lr": 0.05, "momentum": 0.9},
    }
    if train is not None:
        run["train"] = dict(train)
    return yaml.safe_dump(run, sort_keys=False)


def brighter_half_npz(path: Path, count: int, size: int, seed: int = 0) -> Path:
    """An npz file (x, y) of ``count`` one-channel ``size`` x ``size`` images, labelled 1 where the top half is the
    brighter: a task a small network learns within an epoch."""
    x = np.random.default_rng(seed).random((count, 1, size, size), dtype=np.float32)
    half = size // 2
    y = (x[:, 0, :half].mean(axis=(1, 2)) > x[:, 0, half:].mean(axis=(1, 2))).astype(np.int64)
    np.savez(path, x=x, y=y)
    return path


def train_history(run_yaml: Path, out: Path, *args: str, env: dict | None = None) -> list[tuple[float, float]]:
    """``leafpy train RUN --backend native --out OUT ARGS`` in a child process (its environment: this one's, with
    ``env`` over it); the (loss, test_loss) of each epoch from the command's own history file."""
    done = subprocess.run([sys.executable, "-m", "leafpy.cli", "train", str(run_yaml), "--backend", "native",
                           "--out", str(out), *args], env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [(e["loss"], e["test_loss"]) for e in json.loads((out / "history.json").read_text())]
