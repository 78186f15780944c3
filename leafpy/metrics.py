"""Metrics: predictions from network outputs, a confusion matrix with accuracy, per-class precision, recall and F1
(macro and weighted F1), top-k accuracy, and regression scores (MSE, MAE, R²), in NumPy; a two-class ROC AUC
through scikit-learn (imported when asked for)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _checks
from .errors import ShapeError
from .tensor import SharedTensor


def _outputs(where: str, output: Any) -> np.ndarray:
    """Network outputs [N, C] or [N, C, d1, ...] (SharedTensor or array) as an array."""
    a = output.to_numpy() if isinstance(output, SharedTensor) else np.asarray(output)
    if a.ndim < 2:
        raise ShapeError(f"{where}: expected network outputs of shape [N, C] (or [N, C, d1, ...]: classes at every "
                         f"position), got {a.shape}")
    return a


def predictions(output: Any) -> np.ndarray:
    """Class predictions (argmax over axis 1) of network outputs (SharedTensor or array): [N] of outputs [N, C],
    [N, d1, ...] of outputs [N, C, d1, ...] (a class at every position, as NegativeLogLikelihood scores them)."""
    return _outputs("predictions", output).argmax(axis=1)


def class_scores(output: Any) -> np.ndarray:
    """Network outputs [N, C] or [N, C, d1, ...] as one row of C scores per sample and position, [N * d1 * ...,
    C], in the order of their targets [N, d1, ...] flattened."""
    a = _outputs("class_scores", output)
    return np.moveaxis(a, 1, -1).reshape(-1, a.shape[1])


def _flat_numbers(where: str, name: str, given: Any) -> np.ndarray:
    """``given`` (``name``s: class indices, as an array or SharedTensor) flattened, refused where not numbers."""
    v = np.asarray(given.to_numpy() if isinstance(given, SharedTensor) else given)
    if v.dtype.kind not in "biuf":
        raise ShapeError(f"{where}: {name}s must be class indices (numbers), got an array of dtype {v.dtype}")
    return v.reshape(-1)


def _refuse_non_index(where: str, name: str, v: np.ndarray, k: int, hint: str = "") -> None:
    """Refuse flat ``v`` (``name``s) where a value is not a class index in [0, k)."""
    bad = _checks.first_non_index(v, k)
    if bad is not None:
        raise ShapeError(f"{where}: {name} {bad} is {v[bad].item()!r}; {name}s must be class indices in [0, "
                         f"{k - 1}]{hint}")


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
        p, t = (_flat_numbers("ConfusionMatrix.add", name, given)
                for name, given in (("prediction", predictions), ("target", targets)))
        if p.size != t.size:
            raise ShapeError(f"ConfusionMatrix.add: {p.size} predictions but {t.size} targets")
        k = self.num_classes
        for name, v in (("prediction", p), ("target", t)):
            _refuse_non_index("ConfusionMatrix.add", name, v, k, " (for network outputs [N, C] use add_outputs)")
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
        """Add network outputs [N, C] and targets [N], or [N, C, d1, ...] and [N, d1, ...] (their argmax over axis
        1 is the prediction)."""
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

    def _rates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per class: precision, recall, F1 (0 where undefined, as scikit-learn's zero_division default) and
        support (targets of the class)."""
        m = self._matrix.astype(np.float64)
        hits, predicted, support = np.diag(m), m.sum(axis=0), m.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            precision = np.where(predicted > 0, hits / predicted, 0.0)
            recall = np.where(support > 0, hits / support, 0.0)
            f1 = np.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
        return precision, recall, f1, support

    def precision(self) -> np.ndarray:
        """Per class: the fraction of its predictions that were right (0 for a class never predicted)."""
        return self._rates()[0]

    def recall(self) -> np.ndarray:
        """Per class: the fraction of its samples predicted as it (0 for a class without samples)."""
        return self._rates()[1]

    def f1(self) -> np.ndarray:
        """Per class: the harmonic mean of precision and recall."""
        return self._rates()[2]

    def macro_f1(self) -> float:
        """The mean F1 of the classes that occur as targets or predictions (scikit-learn's ``average="macro"``)."""
        _, _, f1, support = self._rates()
        seen = (support > 0) | (self._matrix.sum(axis=0) > 0)
        return float(f1[seen].mean()) if seen.any() else 0.0

    def weighted_f1(self) -> float:
        """The classes' F1 weighted by their number of targets (scikit-learn's ``average="weighted"``)."""
        _, _, f1, support = self._rates()
        return float((f1 * support).sum() / support.sum()) if support.sum() else 0.0

    def report(self, class_names: Sequence[str] = ()) -> str:
        """Per class precision, recall, F1 and support, then macro and weighted F1, as a table."""
        precision, recall, f1, support = self._rates()
        names = self.names(class_names)
        w = max(11, *(len(n) for n in names))
        lines = [f"{'class':>{w}} {'precision':>10} {'recall':>8} {'f1':>8} {'support':>8}"]
        for k in range(self.num_classes):
            lines.append(f"{names[k]:>{w}} {precision[k]:>10.3f} {recall[k]:>8.3f} {f1[k]:>8.3f} "
                         f"{int(support[k]):>8}")
        lines.append(f"macro F1 {self.macro_f1():.4f}, weighted F1 {self.weighted_f1():.4f}")
        return "\n".join(lines)

    def confusions(self, count: int = 10) -> list[tuple[int, int, int]]:
        """The ``count`` most frequent confusions, as (target, prediction, samples), most samples first (ties by
        target, then prediction); pairs with no sample are left out."""
        count = _checks.non_negative_int("ConfusionMatrix.confusions: count", count)
        off = self._matrix.copy()
        np.fill_diagonal(off, 0)
        flat = off.reshape(-1)
        found = np.flatnonzero(flat)
        top = found[np.lexsort((found, -flat[found]))][:count]
        k = self.num_classes
        return [(int(i // k), int(i % k), int(flat[i])) for i in top]

    def csv(self, class_names: Sequence[str] = ()) -> str:
        """The matrix as CSV text: a header ``target\\pred`` and the classes, then a row per target class with its
        counts per prediction; classes named by ``class_names`` (those past the names by their numbers)."""
        import csv
        import io

        names = self.names(class_names)
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(["target\\pred", *names])
        writer.writerows([name, *map(int, row)] for name, row in zip(names, self._matrix))
        return text.getvalue()

    def names(self, class_names: Sequence[str] = ()) -> list[str]:
        """Each class's name from ``class_names``; the classes past them (a network scoring more classes than the
        data names) by their numbers."""
        names = [str(n) for n in class_names][:self.num_classes]
        return names + [str(k) for k in range(len(names), self.num_classes)]

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
        return self.table()

    def table(self, class_names: Sequence[str] = ()) -> str:
        """The matrix (rows: targets, columns: predictions) with each class's recall, its classes named by
        ``class_names`` where given (the classes past them numbered), and the accuracy of the predictions counted
        (one a sample, or one at every position of a sample)."""
        k = self.num_classes
        names = self.names(class_names)
        width = max(5, len(str(int(self._matrix.max(initial=0)))) + 1, *(len(n) + 1 for n in names))
        left = max(11, *(len(n) for n in names))
        corner = "target\\pred"
        lines = [f"{corner:<{left}} " + "".join(f"{n:>{width}}" for n in names) + f"{'recall':>8}"]
        for t in range(k):
            row = self._matrix[t]
            # a class with no samples has no recall: a dash, not 0%
            recall = f"{row[t] / row.sum():>8.1%}" if row.sum() else f"{'-':>8}"
            lines.append(f"{names[t]:>{left}} " + "".join(f"{v:>{width}}" for v in row) + recall)
        lines.append(f"accuracy {self.accuracy():.2%} of {self.samples} predictions")
        return "\n".join(lines)


def top_k_hits(outputs: Any, targets: Any, k: int) -> int:
    """How many targets are among the ``k`` largest of their outputs: outputs [N, C] and targets [N], or [N, C, d1,
    ...] and [N, d1, ...] (every position counts)."""
    k = _checks.positive_int("top_k_hits: k", k)
    a = class_scores(outputs)
    t = _flat_numbers("top_k_hits", "target", targets)
    if t.size != len(a):
        raise ShapeError(f"top_k_hits: {len(a)} outputs (samples and positions) but {t.size} targets")
    _refuse_non_index("top_k_hits", "target", t, a.shape[1])
    top = np.argpartition(-a, min(k, a.shape[1]) - 1, axis=1)[:, :k]
    return int((top == t.astype(np.int64)[:, None]).any(axis=1).sum())


def roc_auc(targets: Any, scores: Any) -> tuple[float | None, str]:
    """(scikit-learn's ``roc_auc_score`` of two-class ``targets`` (0 and 1) ranked by ``scores``, the positive
    class's probability or anything that orders samples as it does; "") or (None, why it was not computed:
    scikit-learn missing, or one class alone among the targets)."""
    t = np.asarray(targets).reshape(-1)
    if len(np.unique(t)) < 2:
        return None, "the held-out samples are all of one class"
    try:
        from sklearn.metrics import roc_auc_score
    except ImportError:
        return None, "it needs scikit-learn: pip install scikit-learn (or the data extra)"
    return float(roc_auc_score(t, np.asarray(scores, np.float64).reshape(-1))), ""


def regression_scores(predicted: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """Mean squared error, mean absolute error and R² (per output, averaged, as scikit-learn's
    ``uniform_average``; an output whose targets are constant scores 1 when predicted exactly, else 0) of
    ``predicted`` and ``target`` [N, ...], one sample per row in the same layout ([N] and [N, 1] are one)."""
    p, t = np.asarray(predicted, np.float64), np.asarray(target, np.float64)
    if p.ndim == 0 or t.ndim == 0 or len(p) != len(t) or \
            _checks._strip_trailing_ones(t.shape[1:]) != _checks._strip_trailing_ones(p.shape[1:]):
        hint = _checks.layout_hint(t.shape, p.shape, "target", first=1) if p.ndim and t.ndim else ""
        raise ShapeError(f"regression_scores: expected predicted and target values of one layout, [N, ...] each "
                         f"(targets [N] for predictions [N, 1]), got predicted of shape {p.shape} and target of shape "
                         f"{t.shape}{hint}")
    p, t = p.reshape(len(p), -1), t.reshape(len(t), -1)
    residual = ((t - p) ** 2).sum(axis=0)
    total = ((t - t.mean(axis=0)) ** 2).sum(axis=0)
    r2 = np.where(total > 0, 1 - residual / np.where(total > 0, total, 1), np.where(residual > 0, 0.0, 1.0))
    return {"mse": float(((t - p) ** 2).mean()), "mae": float(np.abs(t - p).mean()), "r2": float(r2.mean())}
