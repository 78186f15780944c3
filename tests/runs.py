"""Run files for tests, built rather than pasted: a Sequential over one input ``data`` (batch ``null``, taken from
``data.batch_size``), a short objective, a solver. ``run_file(...)`` gives the YAML text a user would write."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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
