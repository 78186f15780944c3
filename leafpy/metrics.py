"""Classification metrics: predictions from network outputs and a confusion matrix with accuracy."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _checks
from .errors import ShapeError
from .tensor import SharedTensor


def predictions(output: Any) -> np.ndarray:
    """Class predictions (argmax over axis 1) of a network output [N, C] (SharedTensor or array)."""
    a = output.to_numpy() if isinstance(output, SharedTensor) else np.asarray(output)
    if a.ndim < 2:
        raise ShapeError(f"predictions: expected network outputs of shape [N, C], got {a.shape}")
    return a.reshape(a.shape[0], a.shape[1], -1)[:, :, 0].argmax(axis=1)


class ConfusionMatrix:
    """Counts (target, prediction) pairs. With ``capacity``, only the last ``capacity`` samples count (a running
    accuracy during training)."""

    def __init__(self, num_classes: int, capacity: int | None = None) -> None:
        self.num_classes = _checks.positive_int("ConfusionMatrix.num_classes", num_classes)
        self.capacity = None if capacity is None else _checks.positive_int("ConfusionMatrix.capacity", capacity)
        self._targets: list[np.ndarray] = []
        self._preds: list[np.ndarray] = []
        self._matrix = np.zeros((self.num_classes, self.num_classes), dtype=np.int64)

    def add(self, predictions: Any, targets: Any) -> None:
        """Add predicted and true class indices (any shapes with the same number of elements)."""
        arrays = []
        for name, given in (("prediction", predictions), ("target", targets)):
            v = np.asarray(given.to_numpy() if isinstance(given, SharedTensor) else given)
            if v.dtype.kind not in "biuf":
                raise ShapeError(f"ConfusionMatrix.add: {name}s must be class indices (numbers), got an array of "
                                 f"dtype {v.dtype}")
            arrays.append(v.reshape(-1))
        p, t = arrays
        if p.size != t.size:
            raise ShapeError(f"ConfusionMatrix.add: {p.size} predictions but {t.size} targets")
        k = self.num_classes
        for name, v in (("prediction", p), ("target", t)):
            bad = _checks.first_non_index(v, k)
            if bad is not None:
                raise ShapeError(f"ConfusionMatrix.add: {name} {bad} is {v[bad].item()!r}; {name}s must be class "
                                 f"indices in [0, {k - 1}] (for network outputs [N, C] use add_outputs)")
        p, t = p.astype(np.int64), t.astype(np.int64)
        np.add.at(self._matrix, (t, p), 1)
        if self.capacity is not None:
            self._targets.append(t)
            self._preds.append(p)
            total = sum(x.size for x in self._targets)
            while total > self.capacity:
                drop = min(total - self.capacity, self._targets[0].size)
                np.add.at(self._matrix, (self._targets[0][:drop], self._preds[0][:drop]), -1)
                self._targets[0], self._preds[0] = self._targets[0][drop:], self._preds[0][drop:]
                if not self._targets[0].size:
                    self._targets.pop(0)
                    self._preds.pop(0)
                total -= drop

    def add_outputs(self, outputs: Any, targets: Any) -> None:
        """Add network outputs [N, C] (their argmax is the prediction) and targets."""
        self.add(predictions(outputs), targets)

    @property
    def matrix(self) -> np.ndarray:
        """Counts: rows are targets, columns predictions."""
        return self._matrix.copy()

    @property
    def samples(self) -> int:
        """The number of (target, prediction) pairs counted."""
        return int(self._matrix.sum())

    def accuracy(self) -> float:
        """The fraction of counted predictions equal to their targets (0.0 before any)."""
        n = self.samples
        return float(np.trace(self._matrix)) / n if n else 0.0

    def add_counts(self, counts: Any) -> None:
        """Add another matrix's counts (rows targets, columns predictions): e.g. the sum of every rank's."""
        c = np.asarray(counts, dtype=np.int64)
        if c.shape != self._matrix.shape:
            raise ShapeError(f"ConfusionMatrix.add_counts: expected counts of shape {self._matrix.shape}, got "
                             f"{c.shape}")
        self._matrix += c

    def reset(self) -> None:
        """Forget every count."""
        self._matrix[...] = 0
        self._targets.clear()
        self._preds.clear()

    def __str__(self) -> str:
        k = self.num_classes
        width = max(5, len(str(int(self._matrix.max(initial=0)))) + 1)
        lines = ["target\\pred " + "".join(f"{c:>{width}}" for c in range(k)) + f"{'recall':>8}"]
        for t in range(k):
            row = self._matrix[t]
            # a class with no samples has no recall: a dash, not 0%
            recall = f"{row[t] / row.sum():>8.1%}" if row.sum() else f"{'-':>8}"
            lines.append(f"{t:>11} " + "".join(f"{v:>{width}}" for v in row) + recall)
        lines.append(f"accuracy {self.accuracy():.2%} of {self.samples} samples")
        return "\n".join(lines)
