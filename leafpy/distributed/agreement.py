"""The ranks of a data-parallel job agree on what they train before they train it.

Ranks started with different run files, ``--set`` options or data would otherwise hang in a collective (a
different epoch count or batch size), fail in MPI (a different layer size) or train silently apart (a different
learning rate or data: only rank 0's weights are saved). At start, before any other collective, every rank
gathers every other rank's description of its run (the resolved run, the backend, the precision, where training
starts) and a fingerprint of its data, in one collective, and every rank stops with the first difference.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..data import hash_array
from ..errors import LeafpyError
from .group import ProcessGroup

PER_RANK = ("data.path",)
"""Fields that may differ between ranks: the data may lie at another path on each node (its contents, compared
through their fingerprint, may not differ)."""

ABSENT = "(not set)"


def fingerprint(array: np.ndarray) -> str:
    """An array's dtype, shape and a hash of its bytes (read once; a few seconds for gigabytes)."""
    digest = hashlib.blake2b(digest_size=12)
    hash_array(digest, array)
    return f"{array.dtype} {list(array.shape)} blake2b {digest.hexdigest()}"


def flatten(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted path, leaf value)`` of nested mappings and lists, as ``network.layers[0].output_size``."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)) and value:
        for i, item in enumerate(value):
            yield from flatten(item, f"{path}[{i}]")
    else:
        yield path, value


def describe(run: dict, data: dict[str, np.ndarray], extra: dict[str, Any]) -> dict[str, Any]:
    """What must be the same on every rank (but :data:`PER_RANK`), as ``{field: value}``: the run's fields,
    ``extra`` (the backend, the precision, where training starts) and the data's fingerprints."""
    fields = dict(flatten(run))
    fields.update(extra)
    fields.update({f"data file {name}": fingerprint(a) for name, a in data.items()})
    return json.loads(json.dumps(fields, default=str))  # plain values, as the other ranks will see them


def check_same_run(group: ProcessGroup, fields: dict[str, Any]) -> None:
    """Gather every rank's :func:`describe` (one collective) and raise on every rank, naming the first field in
    which a rank differs from rank 0, when any does. Does nothing in a world of one."""
    if group.size == 1:
        return
    everyone = [json.loads(text) for text in group.allgather_text(json.dumps(fields))]
    first = everyone[0]
    for rank, other in enumerate(everyone[1:], start=1):
        for key in [*first, *(k for k in other if k not in first)]:
            mine, theirs = first.get(key, ABSENT), other.get(key, ABSENT)
            if mine != theirs and not _per_rank(key):
                raise LeafpyError(_difference(rank, key, mine, theirs, first, other))


def _per_rank(key: str) -> bool:
    """A field of PER_RANK, or an entry of one (data.path.x of an npy dataset's {x: ..., y: ...} paths)."""
    return any(key == name or key.startswith(name + ".") for name in PER_RANK)


def _difference(rank: int, key: str, mine: Any, theirs: Any, first: dict, other: dict) -> str:
    data = key.startswith("data file")
    mine, theirs = (v if v == ABSENT or data else json.dumps(v) for v in (mine, theirs))
    if data:
        paths = first.get("data.path"), other.get("data.path")
        read = f" (read from {paths[0]} and {paths[1]})" if any(paths) else ""
        fix = f"give every rank the same data{read}; data.path may differ between nodes, the contents may not"
    elif key.startswith("start"):
        fix = "give every rank the same --resume checkpoint"
    else:
        fix = "start every rank with the same run file and --set options (and the same --backend, --precision)"
    return (f"distributed: rank {rank}'s run differs from rank 0's at {key}: {mine} on rank 0, {theirs} on rank "
            f"{rank}; {fix}")
