"""What a trained model needs to read new data as it read its training data: class names and the normalisation of
its inputs (and, for a regression, of its targets). Recorded in run.yaml (``data.class_names``,
``data.normalize``) and in the model file, so ``evaluate``, ``predict`` and ``lp.Layer.load`` apply it."""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, SerializationError
from .mapped import Mapped

MAX_TEXT = 1 << 20
"""The largest preparation record (bytes of JSON) a model file may carry."""


@dataclass(frozen=True)
class Preparation:
    """Class names (empty: numbered classes or a regression) and the normalisation ``(x - mean) / std`` per input
    channel or feature (``mean``/``std`` empty: none), and per target channel (axis 1) for a regression
    (``target_mean``, ``target_std``): predictions are given back as ``y * target_std + target_mean``."""

    class_names: tuple[str, ...] = ()
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    target_mean: tuple[float, ...] = ()
    target_std: tuple[float, ...] = ()

    def inputs(self, x: np.ndarray) -> np.ndarray:
        """Samples [N, C, ...] (or [N, features]) normalised as the model was trained (memory-mapped samples stay
        mapped, normalised a batch at a time as they are taken)."""
        if isinstance(x, Mapped):
            return x.normalized(self) if self.mean else x
        return _scale(x, self.mean, self.std)

    def targets(self, y: np.ndarray) -> np.ndarray:
        """Regression targets in the units the network was trained on."""
        return _scale(y, self.target_mean, self.target_std)

    def outputs(self, y: np.ndarray) -> np.ndarray:
        """A regression network's outputs back in the targets' units."""
        if not self.target_mean:
            return y
        return (y * _per_axis(self.target_std, y) + _per_axis(self.target_mean, y)).astype(y.dtype)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.class_names:
            d["class_names"] = list(self.class_names)
        if self.mean:
            d["normalize"] = normalize_dict(self)
        return d

    def to_text(self) -> str:
        """The JSON a model file keeps ("" when there is nothing to keep)."""
        d = self.to_dict()
        return json.dumps(d, sort_keys=True) if d else ""


def normalize_dict(p: Preparation) -> dict[str, list[float]]:
    d = {"mean": list(p.mean), "std": list(p.std)}
    if p.target_mean:
        d.update(target_mean=list(p.target_mean), target_std=list(p.target_std))
    return d


def _per_axis(values: Sequence[float], a: np.ndarray) -> np.ndarray:
    """``values`` (one per channel: axis 1) shaped to broadcast over ``a``; one value broadcasts over all."""
    v = np.asarray(values, np.float32)
    if len(v) == 1 or a.ndim < 2:
        return v.reshape(-1)[:1] if len(v) == 1 else v
    return v.reshape((1, len(v)) + (1,) * (a.ndim - 2))


def _scale(a: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    if not mean:
        return a
    if len(mean) != 1 and (a.ndim < 2 or a.shape[1] != len(mean)):
        raise ConfigError(f"data.normalize: {len(mean)} means (one per channel or feature), but the samples have "
                          f"shape {list(a.shape[1:])}; give one value, or one per channel (axis 1)")
    return ((a - _per_axis(mean, a)) / _per_axis(std, a)).astype(np.float32)


def _numbers(value: Any, where: str, positive: bool = False) -> tuple[float, ...]:
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for v in items:
        try:
            number = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
        except OverflowError:  # an int beyond float's range
            number = math.inf
        if not math.isfinite(number) or (positive and number <= 0):
            raise ConfigError(f"{where}: expected {'positive ' if positive else ''}finite numbers (one, or one per "
                              f"channel or feature), got {value!r}"[:300])
        out.append(number)
    if not out:
        raise ConfigError(f"{where}: expected at least one number, got {value!r}")
    return tuple(out)


def from_dict(d: Any, where: str = "data") -> Preparation:
    """A Preparation from run.yaml's data section or a model file's record (``class_names``, ``normalize``)."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(d).__name__}")
    names = d.get("class_names")
    names = () if names is None else names
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where}.class_names: expected a list of names, got {names!r}"[:300])
    norm = d.get("normalize")
    if norm is None or norm is False or norm == "auto":
        return Preparation(tuple(names))
    if not isinstance(norm, dict) or not {"mean", "std"} <= set(norm):
        raise ConfigError(f"{where}.normalize: expected auto or {{mean: [...], std: [...]}}, got {norm!r}"[:300])
    fields = {k: _numbers(norm[k], f"{where}.normalize.{k}", positive=k.endswith("std"))
              for k in ("mean", "std", "target_mean", "target_std") if k in norm}
    for a, b in (("mean", "std"), ("target_mean", "target_std")):
        if (a in fields) != (b in fields) or (a in fields and len(fields[a]) != len(fields[b])):
            raise ConfigError(f"{where}.normalize: {a} and {b} must both be given, with as many values each")
    return Preparation(tuple(names), **fields)


def check_distinct(names: Sequence[str], where: str = "data") -> None:
    """Refuse class names of which one names two classes (for a run to train: a model file or run.yaml written with
    such names still reads)."""
    twice = sorted(name for name, count in collections.Counter(names).items() if count > 1)
    if twice:
        raise ConfigError(f"{where}.class_names: {', '.join(map(repr, twice[:3]))} named more than one class; give "
                          "each class a name of its own"[:300])


def from_text(text: str, path: str) -> Preparation | None:
    """The preparation a model file records (None when it records none: files written before it existed)."""
    if not text:
        return None
    if len(text) > MAX_TEXT:
        raise SerializationError(f"{path}: the model's data preparation is {len(text)} bytes, more than {MAX_TEXT}; "
                                 "the file is damaged")
    try:
        return from_dict(json.loads(text), f"{path}: data preparation")
    except (ValueError, ConfigError, RecursionError) as e:  # (RecursionError: JSON nested past Python's limit)
        raise SerializationError(f"{path}: the model's data preparation is unreadable "
                                 f"({str(e)[:200] or type(e).__name__}); the file is damaged") from None


def channel_statistics(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Mean and standard deviation per channel or feature (axis 1) of ``x`` [N, C, ...], in float64; a constant
    channel gets standard deviation 1 (it is centred, not scaled). Memory-mapped samples are summed a chunk at
    a time."""
    if isinstance(x, Mapped):
        return _streamed_statistics(x)
    axes = (0,) + tuple(range(2, x.ndim))
    return _mean_and_std(x.mean(axis=axes, dtype=np.float64), x.var(axis=axes, dtype=np.float64))


def _streamed_statistics(x: Mapped) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if x.source.dtype == np.uint8 and x.prep is None and x.source.ndim > 1:
        return _byte_statistics(x)
    total = squares = 0.0
    count = 0
    for chunk in x.chunks():
        axes = (0,) + tuple(range(2, chunk.ndim))
        total = total + chunk.sum(axis=axes, dtype=np.float64)
        squares = squares + np.square(chunk, dtype=np.float64).sum(axis=axes)
        count += chunk.size // (chunk.shape[1] if chunk.ndim > 1 else 1)
    mean = np.asarray(total) / count
    return _mean_and_std(mean, np.asarray(squares) / count - mean * mean)


def _byte_statistics(x: Mapped) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The statistics of samples stored as bytes (an image folder's), from integer sums of the bytes and of their
    squares per channel: exact, and without a float copy of the data (20,000 32x32 RGB images: 0.06 s against
    0.64)."""
    sums = np.zeros(x.source.shape[1], np.uint64)
    squares = np.zeros_like(sums)
    n = 0
    for raw in x.raw_chunks():
        r = raw.reshape(len(raw), raw.shape[1], -1)
        sums += r.sum(axis=(0, 2), dtype=np.uint64)
        squares += np.square(r, dtype=np.uint16).sum(axis=(0, 2), dtype=np.uint64)
        n += len(r) * r.shape[2]
    if not n:  # no samples: no statistics (as float sums give them)
        return _mean_and_std(np.full(len(sums), np.nan), np.full(len(sums), np.nan))
    s1, s2 = [int(v) for v in sums], [int(v) for v in squares]  # Python's integers: n * s2 - s1^2 exactly
    return _mean_and_std(np.array([a / (255 * n) for a in s1]),
                         np.array([(n * b - a * a) / (255.0 * n) ** 2 for a, b in zip(s1, s2)]))


def _mean_and_std(mean: np.ndarray, variance: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """From the means and variances per channel; a constant channel's deviation is 1."""
    std = np.sqrt(np.maximum(variance, 0.0))
    std = np.where(std > 1e-12, std, 1.0)
    return tuple(map(float, np.atleast_1d(mean))), tuple(map(float, np.atleast_1d(std)))


def resolve(data: dict, x_train: np.ndarray, y_train: np.ndarray | None, class_names: Sequence[str] = ()
            ) -> Preparation:
    """The run's preparation, its ``normalize: auto`` computed from the training split only (``y_train``: a
    regression's targets, normalised too; None for classes); ``data`` (the run's data section) is updated to
    record it, as run.yaml keeps it."""
    given = from_dict({k: data[k] for k in ("normalize",) if k in data}, "data")
    norm = data.get("normalize")
    if norm == "auto":
        mean, std = channel_statistics(x_train)
        extra: dict[str, Any] = {}
        if y_train is not None:
            # per channel (axis 1), as the samples' and as targets are scaled and given back (targets [N, 2, 3]:
            # two channels; they were six values, which the scaling then refused)
            targets = y_train if y_train.ndim >= 2 else y_train.reshape(len(y_train), -1)
            extra = dict(zip(("target_mean", "target_std"), channel_statistics(targets)))
        given = Preparation((), mean, std, **extra)
    prep = Preparation(tuple(class_names), given.mean, given.std, given.target_mean, given.target_std)
    if prep.mean:
        data["normalize"] = normalize_dict(prep)
    if prep.class_names:
        data["class_names"] = list(prep.class_names)
    return prep
