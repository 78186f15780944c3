"""Trainer: the training loop of a run file (epochs over a dataset, held-out evaluation, checkpoints, history),
as a library with callbacks. ``leafpy train`` is a thin wrapper over it.

    run = lp.config.load("configs/digits_lenet.yaml")
    trainer = lp.Trainer(run, backend=lp.backend("native"), out_dir="runs/digits",
                         callbacks=[lp.train.EarlyStopping(monitor="test_loss", patience=3)])
    history = trainer.fit()                       # one record per epoch (loss, held-out loss and accuracy, lr...)
    trainer.evaluate().loss                       # held-out scores of the current weights

Checkpoints record where in an epoch training stopped (the position in that epoch's shuffled order, which is a
function of the data seed and the epoch), so a run interrupted anywhere and resumed with ``resume=`` makes the
same updates as one that was never interrupted. Resuming takes the solver's settings from the run (Caffe's rule:
the learning-rate schedule, momentum, weight decay and clipping may change; the network, the objective, the
update rule and minibatch_size may not) and its state from the checkpoint.

Under ``mpiexec -n N`` (see :mod:`leafpy.distributed`) every rank trains its share of each global batch of N x
``data.batch_size`` samples; rank 0 alone prints and writes files.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import functools
import io
import itertools
import json
import math
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any

import numpy as np

from . import _checks
from . import config as run_config
from . import data as datasets
from .backends.base import Backend
from .distributed.data_parallel import shard
from .errors import ConfigError, LeafpyError
from .layers.container.sequential import Sequential
from .layers.layer import Layer
from .layers.loss.negative_log_likelihood import label_weight, loss_configs, summed_losses
from .layers.network import Network
from .metrics import ConfusionMatrix, class_scores, predictions, roc_auc, top_k_hits
from .serialization.atomic import atomic_write
from .solvers.solver import Solver
from .sources import augment, mapped, prepare


class TrainingDiverged(LeafpyError):
    """The loss became NaN or infinite."""


class TrainingInterrupted(LeafpyError):
    """Training stopped on a signal (Ctrl-C, SIGTERM, SIGHUP) after saving a checkpoint."""


@dataclasses.dataclass
class Scores:
    """A network on held-out data: the objective's mean over the samples and, for classes, the confusion matrix."""

    loss: float
    matrix: ConfusionMatrix | None
    top_k: tuple[int, float] | None = None
    """(k, the fraction of samples whose class is among their k most likely): k = 5 with more than 5 classes."""
    regression: dict[str, float] | None = None
    """A regression's mse, mae and r2, in the targets' units."""
    roc_auc: float | None = None
    """Two classes: the area under the ROC curve of the positive class's (class 1's) probability."""
    roc_auc_note: str = ""
    """Two classes without ``roc_auc``: why it was not computed."""

    @property
    def accuracy(self) -> float | None:
        return None if self.matrix is None else self.matrix.accuracy()

    def metrics(self) -> dict[str, float]:
        """The held-out metrics an epoch record keeps (``test_...``), besides the loss and accuracy."""
        out: dict[str, float] = {}
        if self.matrix is not None:
            out.update(test_macro_f1=self.matrix.macro_f1(), test_weighted_f1=self.matrix.weighted_f1())
        if self.top_k is not None:
            out[f"test_top{self.top_k[0]}_accuracy"] = self.top_k[1]
        if self.roc_auc is not None:
            out["test_roc_auc"] = self.roc_auc
        for k, v in (self.regression or {}).items():
            out[f"test_{k}"] = v
        return out


def resolve_data(run: run_config.RunConfig) -> None:
    """Write the data section's defaults out (dataset, seed, digits' split, an absolute path), so that the
    run.yaml a training run leaves behind reproduces its split from anywhere. A relative path is relative to the
    working directory, or to the run directory whose run.yaml it comes from (see :func:`config.data_base`)."""
    data = run.data
    data.setdefault("dataset", "digits")
    data.setdefault("seed", 0)
    if data["dataset"] == "digits":
        data.setdefault("test_fraction", 0.2)
    aug = augment.from_dict(data.pop("augment", None))
    if aug is not None:  # written out whole: a resumed run compares it with the checkpoint's
        data["augment"] = aug.to_dict()
    paths = data.get("path")  # one path, or {train: DIR, test: DIR}
    for key, p in (paths.items() if isinstance(paths, dict) else [(None, paths)]):
        if isinstance(p, str) and not os.path.isabs(p):
            p = os.path.abspath(os.path.join(run_config.data_base(run), p))
            data["path"] = dict(data["path"], **{key: p}) if key else p
            run.data_relative = True


def portable(run: run_config.RunConfig, directory: str) -> run_config.RunConfig:
    """The run as its run directory records it: a data path that was given relative is written relative to the
    directory, so that the run directory and its data move together."""
    if not run.data_relative:
        return run
    paths, base = run.data["path"], os.path.abspath(directory)
    relative = ({k: os.path.relpath(p, base) for k, p in paths.items()} if isinstance(paths, dict) else
                os.path.relpath(paths, base))
    return dataclasses.replace(run, data=dict(run.data, path=relative))


def ignored_label(run: run_config.RunConfig) -> int | None:
    """The label the objective does not count (its loss layer's ``ignore_index``), or None."""
    return next((cfg.ignore_index for cfg in loss_configs(run.objective) if cfg.ignore_index is not None), None)


def counted(labels: Any, ignore_index: int | None) -> np.ndarray | None:
    """Which of ``labels`` the objective counts (those other than ``ignore_index``); None: all of them."""
    if ignore_index is None:
        return None
    return np.asarray(labels).reshape(-1) != ignore_index


def num_classes(run: run_config.RunConfig) -> int:
    """The classes the run's objective scores (the largest num_classes of its layers); 0 for a regression."""
    return max((getattr(layer.config, "num_classes", None) or 0 for layer in run.objective.config.layers), default=0)


def evaluate(net: Layer | Network[Layer], objective: Layer | Network[Layer], x: np.ndarray, y: np.ndarray,
             classes: int, batch_size: int, group: Any = None, preparation: Any = None,
             ignore_index: int | None = None) -> Scores:
    """The objective's mean and (with classes) the confusion matrix and top-5 accuracy (more than 5 classes) of
    ``net`` on (x, y), in inference mode; for a regression its MSE, MAE and R² in the targets' units
    (``preparation``: how they were normalised); for two classes the ROC AUC (scikit-learn). With a process group
    of several ranks each scores its share and the results are summed; for the ROC AUC, which ranks every sample's
    score at once, each rank puts its share's scores in place in a vector of all of them, summed too (exactly: the
    other ranks add zeros), so every rank scores them all as one process does. Samples labelled ``ignore_index``
    (the objective's) are left out of every score, the loss a mean over the others (weighted by their class
    weights, as the objective weighs them). Outputs [N, C, d1, ...] with labels [N, d1, ...] (a class at every
    position, as NegativeLogLikelihood scores them) are scored at every position: each position is a sample of the
    confusion matrix, the top-5 accuracy and the ROC AUC."""
    net.set_training(False)
    cm = ConfusionMatrix(classes) if classes else None
    total, top, scored, divisor = 0.0, 0, 0, 0.0
    sums: np.ndarray | None = None  # a regression's per-output sums: squared and absolute errors, targets, squares
    ranked: list[np.ndarray] | None = [] if classes == 2 else None  # two classes: each sample's class-1 scores
    n, targets = len(x), y
    positions = np.asarray(y).size // max(n, 1)  # the labels of a sample: 1, or d1 * ... for outputs [N, C, d1, ...]
    share = np.arange(n)
    if group is not None and group.size > 1:
        share = np.array_split(share, group.size)[group.rank]
        x, y = mapped.take(x, share), y[share]
    for xb, yb in datasets.batches(x, y, batch_size, seed=None):
        out = net.forward([xb])[0]
        keep = counted(yb, ignore_index)
        summed = summed_losses(objective.config, yb)  # an objective that sums: what its mean would divide by
        weight = label_weight(objective.config, yb)  # what the batch's mean divided by (None: its samples)
        weight = (len(xb) if weight is None else weight) if summed is None else summed
        if weight:  # (a batch of ignored samples alone has a NaN mean: none of them counts)
            value = float(objective.forward([out, yb])[0].to_numpy().reshape(-1)[0])
            total += value if summed is not None else value * weight
        divisor += weight
        if cm is not None:  # (outputs [N, C, d1, ...]: every position's class counts, as the objective scores it)
            outputs = out.to_numpy()
            scores, labels = class_scores(outputs), np.asarray(yb).reshape(-1)
            if keep is not None:
                scores, labels = scores[keep], labels[keep]
            scored += len(labels)
            cm.add(predictions(scores), labels)
            top += top_k_hits(scores, labels, 5) if classes > 5 else 0
            if ranked is not None:
                ranked.append(_positive_score(outputs))
        else:
            part = _regression_sums(out.to_numpy(), yb, preparation)
            sums = part if sums is None else sums + part
    net.set_training(True)
    if group is not None and group.size > 1:
        total = group.allreduce_sum(total)
        top = int(round(group.allreduce_sum(float(top))))
        scored = int(round(group.allreduce_sum(float(scored))))
        divisor = group.allreduce_sum(divisor)
        if cm is None:  # a rank with no held-out sample adds zeros: every rank joins the sum
            sums = group.allreduce_(np.zeros((2, math.prod(net.outputs[0].shape[1:]))) if sums is None else sums)
        if cm is not None:
            counts = group.allreduce_(cm.matrix.astype(np.float64))
            cm.reset()
            cm.add_counts(np.rint(counts).astype(np.int64))
    top_k = (5, top / max(scored, 1)) if cm is not None and classes > 5 else None
    auc, why = None, ""
    if ranked is not None and n:
        every = _all_scores(ranked, share, (n, positions), group)
        labels, keep = np.asarray(targets).reshape(-1), counted(targets, ignore_index)
        auc, why = roc_auc(labels, every) if keep is None else roc_auc(labels[keep], every[keep])
    loss = total / divisor if divisor else float("nan")
    regression = _regression_scores(sums, targets, preparation) if sums is not None else None
    return Scores(loss, cm, top_k, regression, auc, why)


def _all_scores(ranked: list[np.ndarray], share: np.ndarray, shape: tuple[int, int], group: Any) -> np.ndarray:
    """Every held-out sample's scores (``shape``: samples, positions), flattened in the order of their labels, from
    this rank's (its ``share`` of the samples) and, with several ranks, the others' (summed into place: each rank's
    zeros elsewhere leave the others' scores exact)."""
    scores = np.zeros(shape, np.float64)
    if ranked:
        scores[share] = np.concatenate(ranked)
    return (group.allreduce_(scores) if group is not None and group.size > 1 else scores).reshape(-1)


def _positive_score(out: np.ndarray) -> np.ndarray:
    """Two-class outputs [N, 2] or [N, 2, d1, ...] (log-probabilities, probabilities or logits) as a score per
    sample and position, [N, 1] or [N, d1 * ...], that ranks them as class 1's probability does: output 1 less
    output 0 (float64). The ROC AUC ranks every position of every sample together."""
    a = np.asarray(out, np.float64)
    return (a[:, 1] - a[:, 0]).reshape(len(a), -1)


def _in_units(target: Any, preparation: Any) -> np.ndarray:
    """Targets [N, ...] in their own units (float64, [N, outputs])."""
    if preparation is not None:
        target = preparation.outputs(np.asarray(target, np.float32))
    t = np.asarray(target, np.float64)
    return t.reshape(len(t), -1)


def _regression_sums(out: np.ndarray, target: np.ndarray, preparation: Any) -> np.ndarray:
    """Per output: the sums of squared and of absolute errors (float64), in the targets' units."""
    p = np.asarray(preparation.outputs(out) if preparation is not None else out, np.float64).reshape(len(out), -1)
    t = _in_units(target, preparation)
    return np.stack([((t - p) ** 2).sum(0), np.abs(t - p).sum(0)])


def _regression_scores(sums: np.ndarray, targets: np.ndarray, preparation: Any) -> dict[str, float]:
    """MSE, MAE and R² (scikit-learn's, uniform average over outputs) from the summed errors and every held-out
    target (each rank has them all): their spread about their mean in two passes, exact where the targets sit far
    from zero (1e9 + a spread of 300: a one-pass sum of squares cancels to nothing)."""
    squared, absolute = sums
    t = _in_units(targets, preparation)
    n = max(len(t), 1)
    spread = ((t - t.mean(axis=0)) ** 2).sum(axis=0) if len(t) else np.zeros_like(squared)
    r2 = np.where(spread > 0, 1 - squared / np.where(spread > 0, spread, 1), np.where(squared > 0, 0.0, 1.0))
    size = n * len(squared)
    return {"mse": float(squared.sum() / size), "mae": float(absolute.sum() / size), "r2": float(r2.mean())}


def resumed_losses(state: dict[str, Any], summed: bool = False) -> tuple[float, int, float]:
    """The epoch's loss sums a checkpoint's trainer state recorded (zeros at the start of an epoch): the batches'
    losses each times its weight (its samples, or its counted labels' weights; an objective that sums: its sums)
    summed, the batches, and their weights summed. A checkpoint of an older leafpy (no ``loss_weight``) summed the
    batches' losses alone: those were full batches (only an epoch's last batch is short), so their mean times the
    samples consumed stands for their weighted sum (``summed``: an objective that sums, whose sum it is)."""
    loss_sum, loss_count = float(state.get("loss_sum", 0.0)), int(state.get("loss_count", 0))
    if "loss_weight" in state:
        return loss_sum, loss_count, float(state["loss_weight"])
    if not loss_count:
        return 0.0, 0, 0.0
    samples = float(state.get("sample", 0))
    return (loss_sum if summed else loss_sum / loss_count * samples), loss_count, samples


def first_non_finite(net: Layer | Network[Layer], xb: np.ndarray) -> str:
    """The first layer (in network order) whose output is NaN or infinite for this batch (run in inference mode,
    so BatchNorm's running statistics are not moved by the diagnosis)."""
    training = net.training
    net.set_training(False)
    try:
        net.forward([xb])
    finally:
        net.set_training(training)

    def walk(layer: Layer) -> str | None:
        if isinstance(layer, Sequential):
            for child in layer.layers:
                found = walk(child)
                if found:
                    return found
            return None
        for t in layer.outputs:
            if not np.all(np.isfinite(t.to_numpy())):
                return f"layer '{layer.name}' ({layer.config.type})"
        return None

    bad_weights = [n for n, w in zip(net.learnable_weights_names(), net.learnable_weights_data())
                   if not np.all(np.isfinite(w.to_numpy()))]
    found = walk(net.layer if isinstance(net, Network) else net)
    if found:
        return found + (f"; non-finite weights: {', '.join(bad_weights)}" if bad_weights else "")
    if bad_weights:
        return f"non-finite weights: {', '.join(bad_weights)}"
    return "the objective (every network output is finite)"


def weights_finite(net: Layer | Network[Layer]) -> bool:
    """Whether every weight of ``net`` is a finite number."""
    return all(np.all(np.isfinite(w.to_numpy())) for w in net.learnable_weights_data())


# --- callbacks ----------------------------------------------------------------------------------------------------
class Callback:
    """Hooks into :meth:`Trainer.fit`; override those you need. ``trainer.stop_training = True`` ends training
    after the current epoch."""

    def on_train_begin(self, trainer: Trainer) -> None:
        """Before the first epoch of a ``fit``."""
        pass

    def on_epoch_begin(self, trainer: Trainer, epoch: int) -> None:
        """Before epoch ``epoch`` (counted from 0) runs its batches."""
        pass

    def on_batch_end(self, trainer: Trainer, epoch: int, batch: int, loss: float) -> None:
        """After each training batch's update, with its loss."""
        pass

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """After each epoch, with its record (loss, test_loss, test_accuracy, learning_rate, ...), which
        ``trainer.history`` holds too."""
        pass

    def on_train_end(self, trainer: Trainer) -> None:
        """When ``fit`` ends, also after an error or an interruption."""
        pass


def _plain(value: Any) -> Any:
    """A NumPy number or array in an epoch record (a callback's) as JSON takes it."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} {value!r:.60} is no number or text")


MAX_HISTORY_BYTES = 64 * 2**20
"""Largest ``history.json`` read when a run resumes (an epoch's record is a few hundred bytes)."""


class History(Callback):
    """The epoch records as ``history.json`` and ``history.csv`` in ``directory`` (written atomically)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if not trainer.is_root:
            return
        history = trainer.history
        try:
            dumped = json.dumps(history, indent=1, default=_plain)
        except TypeError as e:  # (a callback's value that is no number, text, list or mapping)
            raise ConfigError(f"the epoch record of epoch {history[-1].get('epoch')} cannot be written to "
                              f"history.json: {e}; a callback adding to it must add numbers or text") from None
        atomic_write(os.path.join(self.directory, "history.json"), dumped.encode(), example=None)
        keys = list(dict.fromkeys(k for h in history for k in h))
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=keys, lineterminator="\n")
        writer.writeheader()
        writer.writerows(history)
        atomic_write(os.path.join(self.directory, "history.csv"), text.getvalue().encode(), example=None)


class Checkpoint(Callback):
    """``checkpoint.leaf`` after every epoch (the last), and with ``keep_best`` > 0 the best epochs by the held-out
    ``monitor`` (``test_accuracy``: higher is better; ``test_loss``: lower) as ``best-epoch{E}.leaf``, keeping
    that many. Only finite weights are ever written, and an epoch whose training or held-out loss is not finite
    writes nothing (a warning says so), so the last checkpoint is always a good one."""

    def __init__(self, directory: str, *, keep_best: int = 0, monitor: str = "test_loss") -> None:
        self.directory = directory
        self.path = os.path.join(directory, "checkpoint.leaf")
        self.keep_best = keep_best
        self.monitor = monitor
        self.best: list[tuple[float, int, str]] = []

    def on_train_begin(self, trainer: Trainer) -> None:
        """A resumed run ranks the best epochs it kept before with those it trains now; the best epochs' files
        past its position (from the epochs it trains again, as when it resumes an earlier best epoch) go."""
        if not trainer.is_root:
            return
        if trainer.resumed_from is not None and same_path(os.path.dirname(trainer.resumed_from) or ".",
                                                            self.directory):
            replaced = []
            for name in sorted(os.listdir(self.directory)):
                epoch = name[len("best-epoch"):-len(".leaf")]
                if name.startswith("best-epoch") and name.endswith(".leaf") and epoch.isdigit() \
                        and int(epoch) > trainer.start_epoch:
                    try:
                        os.unlink(os.path.join(self.directory, name))
                    except FileNotFoundError:
                        continue
                    replaced.append(name)
            if replaced:
                trainer.log(f"removed {', '.join(replaced)} from {self.directory}: the run resumes at epoch "
                            f"{trainer.start_epoch}, and trains those epochs again")
        if self.keep_best <= 0:
            return
        for record in trainer.history:
            path = os.path.join(self.directory, f"best-epoch{record['epoch']}.leaf")
            score = self._score(record)
            if score is not None and os.path.exists(path) and all(p != path for _, _, p in self.best):
                self.best.append((score, record["epoch"], path))
        self._keep()

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if not trainer.is_root:
            return
        unsound = non_finite_losses(record)
        if unsound:  # (finite weights that score inf are no good either: the files stay as they were)
            kept = (f"{self.path} keeps the last epoch whose losses were finite" if os.path.exists(self.path) else
                    f"no checkpoint is written ({self.path} is written after an epoch whose losses are finite)")
            trainer.log(f"warning: epoch {record.get('epoch')}'s {unsound}: {kept}" + ", and no best epoch is kept"
                        * (self.keep_best > 0) + "; the run is diverging: try a smaller base_lr or clip_gradients")
            return
        trainer.save_checkpoint(self.path)
        score = self._score(record)
        if self.keep_best <= 0 or score is None:
            return
        path = os.path.join(self.directory, f"best-epoch{record['epoch']}.leaf")
        if len(self.best) < self.keep_best or score < self.best[-1][0]:
            trainer.save_checkpoint(path)
            self.best = [b for b in self.best if b[2] != path]
            self.best.append((score, record["epoch"], path))
            self._keep()

    def _score(self, record: dict[str, Any]) -> float | None:
        """The record's monitored value, lower is better; None where it has none."""
        value = record.get(self.monitor)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return -value if run_config.higher_is_better(self.monitor) else value

    def _keep(self) -> None:
        """Keep the ``keep_best`` best epochs' files; remove the others."""
        self.best.sort()
        for _, _, old in self.best[self.keep_best:]:
            try:
                os.unlink(old)
            except OSError:
                pass
        del self.best[self.keep_best:]


def non_finite_losses(record: dict[str, Any]) -> str:
    """The epoch record's losses (training, held-out) that are not finite numbers, as words ("held-out loss inf"),
    or "" where both are finite."""
    words = {"loss": "training loss", "test_loss": "held-out loss"}
    return " and ".join(f"{words[k]} {record[k]}" for k in words
                        if isinstance(record.get(k), (int, float)) and not math.isfinite(record[k]))


def same_path(a: str, b: str) -> bool:
    """Whether two paths name one existing file or directory."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


class EarlyStopping(Callback):
    """Stop when the held-out ``monitor`` has not improved by more than ``min_delta`` for ``patience`` epochs."""

    SCORES = (*run_config.MONITORS, "loss", "train_accuracy")
    """What it may watch: the epoch record's losses and (in a run with classes) accuracies."""

    def __init__(self, *, monitor: str = "test_loss", patience: int = 5, min_delta: float = 0.0) -> None:
        self.monitor = _checks.choice("EarlyStopping monitor", monitor, self.SCORES)
        self.patience = _checks.positive_int("EarlyStopping patience", patience)
        self.min_delta = _checks.number("EarlyStopping min_delta", min_delta, minimum=0.0)
        self.best: float | None = None
        self.waited = 0

    def on_train_begin(self, trainer: Trainer) -> None:
        """Refuse an accuracy to watch in a run without classes before any training, not after the first epoch;
        then take the epochs the run has trained already (a resumed run's, an earlier fit's) as if it had watched
        them, so a resumed run stops where the uninterrupted one stops."""
        why = unrecorded(self.monitor, trainer.classes)
        if why:
            raise ConfigError(f"EarlyStopping monitor: {why}; watch test_loss or loss")
        self.best, self.waited = None, 0
        for record in trainer.history:
            if self._watch(record) and not trainer.stop_training:
                trainer.stop_training = True
                trainer.log(f"early stopping: {self.monitor} had not improved by more than {self.min_delta} for "
                            f"{self.patience} epochs by epoch {record.get('epoch')}; nothing more to train")

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self._watch(record):
            trainer.stop_training = True
            trainer.log(f"early stopping: {self.monitor} has not improved by more than {self.min_delta} for "
                        f"{self.patience} epochs")

    def _watch(self, record: dict[str, Any]) -> bool:
        """Take one epoch's record; whether the run should stop after it."""
        value = record.get(self.monitor)
        if value is None:
            raise ConfigError(f"EarlyStopping: the epoch records have no {self.monitor!r}; choose one of "
                              f"{', '.join(k for k in record if k.startswith('test_'))}")
        score = -value if run_config.higher_is_better(self.monitor) else value
        if self.best is None or score < self.best - self.min_delta:
            self.best, self.waited = score, 0
            return False
        self.waited += 1
        return self.waited >= self.patience


def unrecorded(monitor: str, classes: int) -> str | None:
    """Why the epochs of a run whose objective scores ``classes`` classes (0: a regression) record no ``monitor``,
    or None where they do (see :meth:`Scores.metrics`)."""
    if not classes and (monitor in run_config.CLASS_MONITORS or monitor == "train_accuracy"):
        return f"{monitor} needs classes, and this run's objective has none (a regression)"
    if classes and monitor in run_config.REGRESSION_MONITORS:
        return f"{monitor} scores a regression, and this run's objective has {classes} classes"
    if monitor == "test_roc_auc" and classes != 2:
        return f"test_roc_auc scores two classes, and this run's objective has {classes}"
    if monitor == "test_top5_accuracy" and classes <= 5:
        return f"test_top5_accuracy is kept with more than 5 classes, and this run's objective has {classes}"
    return None


class Progress(Callback):
    """A progress bar on a terminal (tqdm: loss, accuracy, samples/s); elsewhere a line every ``log_every``
    iterations (0: none) through :meth:`Trainer.progress`."""

    def __init__(self, log_every: int = 100) -> None:
        self.log_every = run_config.check_log_every(log_every, "Progress log_every")
        self.bar: Any = None
        self.seen: int | None = None  # the iteration after the last call: a line only where a call updated (with
        # minibatch_size > 1, calls that accumulate leave the iteration as it was)

    def on_epoch_begin(self, trainer: Trainer, epoch: int) -> None:
        self.seen = trainer.solver.iteration
        if not trainer.is_root or not sys.stderr.isatty():
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        try:
            sized = os.get_terminal_size(sys.stderr.fileno()).columns > 0
        except (OSError, ValueError):
            sized = False
        # a terminal that reports no size (a pty nobody sized) would hide the bar: give it 80 columns and 24 rows
        size: dict[str, Any] = {"dynamic_ncols": True} if sized else {"ncols": 80, "nrows": 24}
        self.bar = tqdm(total=trainer.batches_per_epoch, initial=trainer.position_batches,
                        desc=f"epoch {epoch + 1}/{trainer.epochs}", unit="batch", leave=False, mininterval=0.25,
                        file=sys.stderr, **size)

    def on_batch_end(self, trainer: Trainer, epoch: int, batch: int, loss: float) -> None:
        if not trainer.is_root:
            return
        if self.bar is not None:
            acc = trainer.running.accuracy() if trainer.running is not None else None
            acc_text = f" acc {acc:.1%}" if acc is not None else ""
            self.bar.set_postfix_str(f"loss {loss:.4f}{acc_text} {trainer.samples_per_second:,.0f} samples/s",
                                     refresh=False)
            self.bar.update(1)
            return
        updated, self.seen = trainer.solver.iteration != self.seen, trainer.solver.iteration
        if self.log_every and updated and trainer.solver.iteration % self.log_every == 0:
            solver = trainer.solver  # (the rate its last update used, as the epoch line's: the next one's may differ)
            trainer.progress(f"iteration {solver.iteration}: loss {loss:.4f}, "
                             f"lr {solver.config.learning_rate(solver.iteration - 1):.3g}{_scaling_text(solver)}")

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.close()

    def on_train_end(self, trainer: Trainer) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class TensorBoard(Callback):
    """Each epoch's numbers as TensorBoard scalars in ``log_dir`` (needs tensorboardX: pip install tensorboardX)."""

    def __init__(self, log_dir: str) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise ConfigError(f"TensorBoard: tensorboardX is not installed ({e}); pip install tensorboardX") from e
        self.writer = SummaryWriter(log_dir)

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if trainer.is_root:
            for key, value in record.items():
                if key != "epoch" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["epoch"])
            self.writer.flush()

    def on_train_end(self, trainer: Trainer) -> None:
        self.writer.close()


# --- the trainer --------------------------------------------------------------------------------------------------
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
"""Signals after which training saves a checkpoint and stops (each only where it was not ignored at start)."""


def load_weights(layer: Any, path: str, *, strict: bool = True) -> Any:
    """Set a network's weights by name from a model or checkpoint file (serialization.load_weights) or from an
    ONNX model (its weights as lp.onnx.load names them: "conv1/weight" for a node named conv1)."""
    from . import serialization

    if os.fspath(path).endswith(".onnx"):
        from .onnx import read_weights

        with serialization.reading(os.fspath(path)):
            return layer.load_weights(read_weights(path), strict=strict)
    return serialization.load_weights(layer, path, strict=strict)


class Trainer:
    """Trains the run's network (see the module docstring). ``out_dir`` (None: write nothing) receives ``run.yaml``
    when :meth:`fit` starts (the resolved run, as ``leafpy train`` writes it, which ``leafpy evaluate``, ``predict``
    and ``summary`` read; not with ``dataset``, data the run does not describe), ``checkpoint.leaf`` each epoch,
    ``history.json``/``history.csv`` and, from :meth:`save_model`, ``model.leaf``; ``callbacks`` run after the
    progress bar and before the history and checkpoint writers, so what they add to an epoch's record is written
    with that epoch."""

    def __init__(self, run: run_config.RunConfig, backend: Backend | None = None, *, out_dir: str | None = None,
                 callbacks: Iterable[Callback] = (), resume: str | None = None, group: Any = None,
                 dataset: datasets.Dataset | None = None, log: Callable[[str], None] | None = None,
                 log_every: int | None = None, keep_best: int | None = None, monitor: str | None = None,
                 weights: str | None = None) -> None:
        from .backends import run_backend

        if not isinstance(run, run_config.RunConfig):
            raise ConfigError(f"Trainer: expected a RunConfig (lp.config.load(path)), got {type(run).__name__}")
        self.run = run = dataclasses.replace(run, data=dict(run.data), train=dict(run.train))
        resolve_data(run)  # what run.yaml and the checkpoints record: the split, reproducible from anywhere
        self.backend = backend if backend is not None else run_backend(run.train)
        if group is not None and not all(hasattr(group, k) for k in ("size", "rank", "is_root")):
            raise ConfigError(f"Trainer: group: expected a process group (lp.distributed.group()), got "
                              f"{type(group).__name__} {group!r:.60}")
        if log is not None and not callable(log):
            raise ConfigError(f"Trainer: log: expected a function taking a line of text (print), got "
                              f"{type(log).__name__} {log!r:.60}")
        if callbacks is None or isinstance(callbacks, (str, bytes)) or not hasattr(callbacks, "__iter__"):
            raise ConfigError(f"Trainer: callbacks: expected a list of lp.Callback instances, got "
                              f"{type(callbacks).__name__} {callbacks!r:.60}")
        self.group = group
        self.is_root = group is None or group.is_root
        self._log = log if log is not None else (lambda msg: print(msg, flush=True))
        self._progress = log if log is not None else (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.out_dir = out_dir if out_dir is None else _checks.path("Trainer: out_dir", out_dir)
        resume = resume if resume is None else _checks.path("Trainer: resume", resume)
        weights = weights if weights is None else _checks.path("Trainer: weights", weights)
        if out_dir is not None and self.is_root:
            try:
                os.makedirs(out_dir, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"Trainer: cannot create the output directory {out_dir}: {e.strerror or e}") from e
        if dataset is not None and not isinstance(dataset, datasets.Dataset):
            raise ConfigError(f"Trainer: dataset: expected an lp.data.Dataset (lp.data.Dataset(name, x_train, y_train, "
                              f"x_test, y_test, num_classes)), got {type(dataset).__name__}")
        if dataset is not None:
            dataset.check()  # (as when it was made: its arrays may have been replaced since)
        self.dataset = dataset if dataset is not None else load_data(run)
        self._describes_data = dataset is None
        self.preparation = prepare.from_dict(run.data)
        """How the data was prepared (class names, normalisation), as the model file records it."""
        prepare.check_distinct(self.preparation.class_names)
        if len(self.dataset.x_test) == 0:
            raise ConfigError(f"data: the held-out split of {self.dataset.name} is empty, and the Trainer scores it "
                              "after every epoch; give held-out samples (x_test, y_test)")
        self.classes = num_classes(run)
        self.ignore_index = ignored_label(run)
        """The label the objective does not count (its ignore_index): left out of the accuracies too."""
        self.batch_size = run.batch_size
        self.world = group.size if group is not None else 1
        n = len(self.dataset.x_train)
        if n < self.world:
            raise ConfigError(f"data: {n} training samples cannot be shared by {self.world} ranks")
        self.global_batch = self.batch_size * self.world
        self.batches_per_epoch = math.ceil(n / self.global_batch)
        self.seed = int(run.data.get("seed", 0))
        self.workers = _checks.non_negative_int("data.workers", run.data.get("workers", 0))
        """Threads preparing the next training batches (0: on the training thread)."""
        self.augment = augment.from_dict(run.data.get("augment"))
        """The training batches' augmentation (``data.augment``; none at evaluation), or None."""
        if self.augment is not None:
            augment.check_shape(self.augment, self.dataset.input_shape, f"the {self.dataset.name} samples")
        if resume and weights:
            raise ConfigError(f"Trainer: resume ({resume}) continues a run with its own weights and weights "
                              f"({weights}) starts a new one from a file's; give one of them")
        self.loaded: Any = None
        """With ``weights``: what the file did not set (``missing``: the network's weights it lacks, which keep
        their initial values; ``unexpected``: its weights the network does not have)."""
        self._draw_seed(group, resume is None)
        self.solver = self._make_solver(resume, weights)
        if group is not None and group.size > 1:
            from .distributed import DataParallel

            self._check_ranks_agree(group)
            self.parallel: Any = DataParallel(self.solver, group,
                                              sync_batch_norm=bool(run.train.get("sync_batch_norm", False)))
        else:
            self.parallel = None
        # scores held-out data
        self.objective = Layer.from_config(self.backend.full_precision(), run.objective).network
        self.history: list[dict[str, Any]] = []
        self.epochs = run.epochs
        self.stop_training = False
        self.interrupted = False
        self._stop_asked = False  # stop() was called, before the fit that it ends began, or during it
        self.running = ConfusionMatrix(self.classes, capacity=10 * self.batch_size) if self.classes else None
        self.samples_per_second = 0.0
        self.position_batches = 0
        state = self.solver.trainer_state
        self.start_epoch = int(state.get("epoch", self._epoch_of_iteration()))
        self.start_sample = int(state.get("sample", 0))
        if self.start_sample > n:
            raise ConfigError(f"--resume {resume}: the checkpoint stopped at sample {self.start_sample} of an epoch "
                              f"of {n} training samples; it belongs to another run (or the file is damaged)")
        self._resumed_losses = resumed_losses(state, any(c.reduction == "sum" for c in loss_configs(run.objective)))
        self._resumed_hits = (int(state.get("correct", 0)), int(state.get("scored", 0)))
        self._live: tuple | None = None  # inside an epoch: (epoch, sample, losses, hits) of the last step
        self._recorded: tuple | None = None  # the position the solver's trainer_state last recorded
        built_in: list[Callback] = [Progress(log_every if log_every is not None else int(run.train.get("log_every",
                                                                                                         100)))]
        names = ("train.keep_best" if keep_best is None else "Trainer keep_best",
                 "train.monitor" if monitor is None else "Trainer monitor")
        keep_best = run.train.get("keep_best", 0) if keep_best is None else keep_best
        monitor = run.train.get("monitor", "test_loss") if monitor is None else monitor
        run_config.check_best_epochs(keep_best, monitor, *names)
        why = unrecorded(monitor, self.classes) if keep_best else None
        if why:
            raise ConfigError(f"{names[1]}: {why}; keep the best epochs by test_loss")
        self.resumed_from = resume
        """The checkpoint the run continues from (``resume``), if any."""
        files: list[Callback] = []  # after the user's callbacks: what they add to an epoch's record is written with it
        if out_dir is not None:
            files = [History(out_dir), Checkpoint(out_dir, keep_best=keep_best, monitor=monitor)]
        if resume:
            self.history = self._read_history(resume)
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise ConfigError(f"Trainer: callbacks: expected lp.Callback instances (subclass lp.Callback and "
                                  f"override its on_... methods), got {type(cb).__name__} {cb!r}"[:300])
        self.callbacks = built_in + list(callbacks) + files

    # --- set-up -----------------------------------------------------------------------------------------------
    def _check_ranks_agree(self, group: Any) -> None:
        """Stop every rank when one was started with another run, backend, precision, data or starting point than
        rank 0 (before the first collective of training, which such ranks would hang in or fail)."""
        from .distributed import agreement

        ds, state, be = self.dataset, self.solver.trainer_state, self.backend
        start = {"start.iteration": self.solver.iteration, "start.epoch": state.get("epoch"),
                 "start.sample": state.get("sample", 0)}
        arrays = {"x_train": ds.x_train, "y_train": ds.y_train, "x_test": ds.x_test, "y_test": ds.y_test}
        run = self.run
        resolved = {**run_config.to_dict(run), "solver": {  # the solver's and train's defaults too
            f.name: getattr(run.solver, f.name) for f in dataclasses.fields(run.solver)
            if f.name not in ("network", "objective")}}
        resolved["data"] = {**run.data, "batch_size": run.batch_size}
        resolved["train"] = {**run.train, "epochs": run.epochs}
        agreement.check_same_run(group, agreement.describe(
            resolved, arrays, {"backend": be.name, "precision": be.precision, "channels_last": be.channels_last,
                               **start}))

    def _draw_seed(self, group: Any, new_run: bool) -> None:
        """A new run without ``solver.seed`` takes a drawn one, which ``run.yaml`` then records: the run's initial
        weights (and Dropout's masks) can be made again from its run file (a resumed run keeps its checkpoint's).
        The ranks of a job take rank 0's; every rank takes part in the exchange, resumed or not, so that the
        collectives after it pair up and the agreement check names a rank whose run differs."""
        run = self.run
        drawn = secrets.randbelow(2**31) if new_run and run.solver.seed is None else None
        if group is not None and group.size > 1:
            texts = group.allgather_text(json.dumps([run.solver.seed, drawn]))
            ranks = [json.loads(t) for t in texts]
            if all(given is None and seed is not None for given, seed in ranks):
                drawn = ranks[0][1]
        if drawn is not None:
            run.solver = dataclasses.replace(run.solver, seed=drawn)

    def _make_solver(self, resume: str | None, weights: str | None = None) -> Solver:
        run = self.run
        if not resume:
            solver = Solver.from_config(self.backend, self.backend, run.solver)
            if weights:
                self._start_from(solver, weights)
            return solver
        solver = Solver.load_checkpoint(self.backend, self.backend, resume)
        if run.solver.seed is None and solver.config.seed is not None:  # the seed the run drew, which run.yaml keeps
            run.solver = dataclasses.replace(run.solver, seed=solver.config.seed)
        trained_seed = solver.config.seed
        before = solver.config
        changed = [n for n in solver.reconfigure(run.solver, "the run file") if n not in ("network", "objective")]
        trained_on = solver.trainer_state.get("data")
        digest = solver.trainer_state.get("data_digest")
        if trained_on is not None:
            for key in sorted(set(trained_on) | set(run.data)):
                if key in ("batch_size", "workers", "decoding"):  # (none changes what is trained)
                    continue
                if key == "path" and digest is not None:  # the data moved: its fingerprint, below, says if it is
                    continue                                # the same
                if trained_on.get(key) != run.data.get(key):
                    run_dir = os.path.dirname(resume) or "."
                    own = (f" (leafpy train {run_dir} --resume {resume} reads the run.yaml beside it)"
                           if os.path.isfile(os.path.join(run_dir, run_config.RUN_FILE)) else "")
                    raise ConfigError(f"data.{key}: the checkpoint {resume} was trained with {trained_on.get(key)!r}, "
                                      f"this run has {run.data.get(key)!r}: resuming would train on another split or "
                                      f"data; resume with the run's own data section{own}, or start a new run")
        if digest is not None and not self.dataset.fingerprinted_by(digest, self.data_digest):
            raise ConfigError(f"data: the {self.dataset.name} samples or targets are not those the checkpoint "
                              f"{resume} was trained on (the files changed since): resuming would not continue that "
                              f"run; restore the data, or start a new run from its weights with --weights {resume}")
        if trained_seed is not None and run.solver.seed != trained_seed:
            raise ConfigError(f"solver.seed: the checkpoint {resume} was trained from seed {trained_seed}, this run "
                              f"has {run.solver.seed}: the seed made its initial weights and the random streams the "
                              "checkpoint carries on, so run.yaml would name a seed the run never used; resume with "
                              f"seed {trained_seed} (or none), or start a new run")
        if changed:  # (allowed, as Caffe's resume takes the solver file's settings: said so, not done silently)
            self.log("resumed with changed solver settings: " + ", ".join(
                f"{n} {getattr(before, n)!r} -> {getattr(run.solver, n)!r}" for n in changed))
        return solver

    def _start_from(self, solver: Solver, path: str) -> None:
        """A new run's network takes the weights of the same names from a model or checkpoint file (fine-tuning,
        as Caffe's ``train --weights``): a weight of the file the network lacks is ignored, a weight of the
        network the file lacks keeps its initial value, a weight of another shape is an error, and so is a file
        none of whose weights the network has."""
        self.loaded = load_weights(solver.network.layer, path, strict=False)
        names = solver.network.learnable_weights_names()
        if len(self.loaded.missing) == len(names):
            raise ConfigError(f"--weights {path}: none of its weights has the name of one of this network's "
                              f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}; the file's: "
                              f"{', '.join(map(str, self.loaded.unexpected[:4]))}"
                              f"{', ...' if len(self.loaded.unexpected) > 4 else ''}): is it a model of another "
                              "network?")

    def _epoch_of_iteration(self) -> int:
        """For a checkpoint without a recorded position: the epochs its iterations complete."""
        updates_per_epoch = max(1, self.batches_per_epoch // self.solver.config.minibatch_size)
        return self.solver.iteration // updates_per_epoch

    def _read_history(self, resume: str) -> list[dict[str, Any]]:
        """The epochs the resumed run trained before its checkpoint: ``history.json`` beside the checkpoint (the run's
        directory, wherever this run writes)."""
        path = os.path.join(os.path.dirname(resume), "history.json")
        try:
            with _checks.open_regular(path, "the run's history (JSON)") as f:
                raw = f.read(MAX_HISTORY_BYTES + 1)
            if len(raw) > MAX_HISTORY_BYTES:
                raise ValueError(f"larger than {MAX_HISTORY_BYTES // 2**20} MB; an epoch's record is a few hundred "
                                 "bytes")
            history = json.loads(raw)
            if not isinstance(history, list) or not all(isinstance(h, dict) and _checks.counter(h.get("epoch"))
                                                        for h in history):
                raise ValueError("not a list of epoch records, each with its epoch number")
        except FileNotFoundError:
            history = []
        # (a FIFO or a directory there: a ConfigError, a ValueError; RecursionError: JSON nested past Python's limit)
        except (OSError, ValueError, RecursionError) as e:
            self.log(f"warning: {path} cannot be read ({str(e)[:200] or type(e).__name__}); the history starts "
                     "again from this epoch")
            return []
        kept = [h for h in history if h["epoch"] <= self.start_epoch]
        missing = sorted(set(range(1, self.start_epoch + 1)) - {h["epoch"] for h in kept})
        if missing:  # (EarlyStopping and keep_best would count from here as if nothing came before)
            which = (f"epoch {missing[0]}" if len(missing) == 1 else
                     f"epochs {missing[0]}-{missing[-1]}" if len(missing) == missing[-1] - missing[0] + 1 else
                     f"{len(missing)} of the epochs 1-{self.start_epoch}")
            self.log(f"warning: {path} " + ("is missing" if not history else f"has no record of {which}")
                     + f": the checkpoint is after epoch {self.start_epoch}, and EarlyStopping and keep_best see "
                     "only the epochs recorded (copy the run's history.json beside the checkpoint to keep them)")
        return kept

    def log(self, msg: str) -> None:
        """Print a line through the Trainer's ``log`` (rank 0 only)."""
        if self.is_root:
            self._log(msg)

    def progress(self, msg: str) -> None:
        """A progress line (rank 0 only): through the Trainer's ``log`` where one was given, else on stderr, apart
        from the results on stdout."""
        if self.is_root:
            self._progress(msg)

    # --- the loop ---------------------------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset.x_train))

    def _batches(self, epoch: int, start: int) -> Generator[tuple[int, np.ndarray, np.ndarray], None, None]:
        """(samples of the epoch's order consumed after this batch, this rank's samples x and targets y) from
        sample ``start``; x augmented as ``data.augment`` says, from (seed, epoch, batch index) alone. With
        ``data.workers`` > 0 that many threads prepare the next batches while the step runs (the same batches, in
        the same order: each is a function of its position alone)."""
        order = self._order(epoch)
        step = self.global_batch
        begins = range(start, len(order), step)
        if not self.workers:
            for begin in begins:
                yield self._batch(order, epoch, begin)
            return
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="leafpy-data")
        try:
            later = iter(begins)
            ahead = collections.deque(pool.submit(self._batch, order, epoch, b)
                                      for b in itertools.islice(later, 2 * self.workers))
            while ahead:
                ready = ahead.popleft().result()
                for b in itertools.islice(later, 1):
                    ahead.append(pool.submit(self._batch, order, epoch, b))
                yield ready
        finally:  # (also when training stops mid-epoch: fit closes the batches)
            pool.shutdown(wait=True, cancel_futures=True)

    def _batch(self, order: np.ndarray, epoch: int, begin: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The batch of the epoch's ``order`` that starts at sample ``begin`` (see :meth:`_batches`)."""
        step, ds = self.global_batch, self.dataset
        chunk = order[begin:begin + step]
        mine = np.arange(len(chunk)) if self.group is None else shard(np.arange(len(chunk)), self.batch_size,
                                                                       self.group)
        idx = chunk[mine]
        xb = ds.x_train[idx]
        if self.augment is not None:
            draws = augment.draw(self.augment, len(chunk), self.seed, epoch, begin // step)
            xb = augment.apply(xb, augment.take(draws, mine))
        return begin + len(chunk), xb, ds.y_train[idx]

    def _train_step(self, xb: np.ndarray, yb: np.ndarray) -> Any:
        if self.parallel is not None:
            return self.parallel.train_minibatch(xb, yb)
        return self.solver.train_minibatch(xb, yb)

    # a diverging run is reported once, by TrainingDiverged with the first non-finite layer, not by NumPy's warnings
    def fit(self, epochs: int | None = None) -> list[dict[str, Any]]:
        """Train up to epoch ``epochs`` (default: the run's train.epochs); returns the history. On a stop signal
        (or :meth:`stop`) a checkpoint is saved and TrainingInterrupted raised; on a NaN or infinite loss,
        TrainingDiverged."""
        try:
            return self._fit(epochs)
        finally:
            self._stop_asked = False  # (a stop asked during this fit is spent: a later fit goes on)

    @np.errstate(over="ignore", invalid="ignore", divide="ignore")
    def _fit(self, epochs: int | None) -> list[dict[str, Any]]:
        self.epochs = self.run.epochs if epochs is None else _checks.non_negative_int("Trainer.fit: epochs", epochs)
        # a later fit after a stop goes on (EarlyStopping decides again), unless stop() came before this fit began
        self.interrupted, self.stop_training = self._stop_asked, False
        if self.epochs <= self.start_epoch:
            trained = f"{self.start_epoch} epoch{'s' * (self.start_epoch != 1)}"
            trained += " and part of the next" * bool(self.start_sample)
            self.log(f"nothing to train: the run has trained {trained}, and fit trains up to epoch {self.epochs} "
                     "(fit(epochs=N) counts the epochs of the whole run; give a larger N to train further)")
        else:
            calls = (self.epochs - self.start_epoch) * self.batches_per_epoch - math.ceil(
                self.start_sample / self.global_batch)
            k = self.solver.config.minibatch_size
            if self.solver.pending_calls + calls < k:
                self.log(f"warning: solver.minibatch_size {k} sums the gradients of {k} batches per update, and this "
                         f"run trains {calls} batch{'es' * (calls != 1)} ({self.batches_per_epoch} an epoch): it "
                         "will make no update; lower minibatch_size or train more epochs")
            self._warn_zero_rate((self.solver.pending_calls + calls) // k)
        progress: tuple | None = None  # (epoch, sample, losses, hits) after the last step counted
        solver = self.solver
        if self.out_dir is not None and self.is_root and self._describes_data:
            run_config.save(portable(self.resolved_run(), self.out_dir), os.path.join(self.out_dir,
                                                                                     run_config.RUN_FILE))
        handlers: list[tuple[int, Any]] = []
        batches: Generator[Any, None, None] = iter_none()
        try:  # (on_train_end runs after an error in an on_train_begin too)
            for cb in self.callbacks:
                cb.on_train_begin(self)
            handlers = self._install_signal_handlers()
            epoch = self.start_epoch
            start = self.start_sample
            for epoch in range(self.start_epoch, self.epochs):
                if self.stop_training:
                    break
                # the epoch's loss is a mean over its samples (as the held-out loss is): each batch's loss weighs
                # what its mean divided by (its samples, or its counted labels' weights); a resumed epoch goes on
                # from the sums it was interrupted with
                loss_sum, loss_count, loss_weight = self._resumed_losses if start else (0.0, 0, 0.0)
                # the epoch's training accuracy counts every sample of the epoch (the progress bar's, the last ten
                # batches); a resumed epoch goes on from the counts it was interrupted with
                correct, scored = self._resumed_hits if start else (0, 0)
                self.position_batches = math.ceil(start / self.global_batch)
                for cb in self.callbacks:
                    cb.on_epoch_begin(self, epoch)
                t0 = time.perf_counter()
                seen = 0
                batches = self._batches(epoch, start)
                for batch, (done, xb, yb) in enumerate(batches, start=self.position_batches):
                    out = self._train_step(xb, yb)
                    hits, labelled = 0, len(xb)
                    if self.running is not None and len(yb):  # (a rank may have no share of a last batch)
                        # (outputs [N, C, d1, ...]: a prediction and a label at every position)
                        predicted, labels = predictions(out).reshape(-1), np.asarray(yb).reshape(-1)
                        keep = counted(labels, self.ignore_index)
                        if keep is not None:
                            predicted, labels = predicted[keep], labels[keep]
                        labelled = len(labels)
                        self.running.add(predicted, labels)
                        hits = int(np.count_nonzero(predicted == labels))
                    loss, weighed, weight, samples, hits, labelled, stop = self._batch_loss(
                        solver.loss(), len(xb), hits, labelled, yb)
                    if not math.isfinite(loss):
                        self._diverged(loss, xb, yb)
                    loss_sum += weighed
                    loss_count += 1
                    loss_weight += weight
                    if self.running is not None:
                        correct += hits
                        scored += labelled
                    seen += samples
                    progress = self._live = (epoch, done, (loss_sum, loss_count, loss_weight), correct, scored)
                    self.samples_per_second = seen / max(time.perf_counter() - t0, 1e-9)
                    for cb in self.callbacks:
                        cb.on_batch_end(self, epoch, batch, loss)
                    if stop if stop is not None else self._stop_requested():
                        self._mark_position(epoch, done, (loss_sum, loss_count, loss_weight), correct, scored)
                        self._stop_on_signal()
                start = 0
                progress = self._live = None
                self._resumed_losses = (0.0, 0, 0.0)
                self._resumed_hits = (0, 0)
                elapsed = time.perf_counter() - t0
                record = self._epoch_record(epoch, loss_sum / loss_weight if loss_weight else 0.0, elapsed, seen,
                                            correct / scored if scored else None)
                self.history.append(record)
                self._mark_position(epoch + 1, 0, (0.0, 0, 0.0))
                self.start_epoch, self.start_sample = epoch + 1, 0  # a later fit goes on from here
                for cb in self.callbacks:
                    cb.on_epoch_end(self, record)
                self.log(self._epoch_line(record))
                if self._stop_requested():
                    self._stop_on_signal()
        finally:
            if progress is not None:  # stopped inside an epoch (a signal, an error): a later fit goes on from there
                self.start_epoch, self.start_sample = progress[0], progress[1]
                self._resumed_losses, self._resumed_hits = progress[2], progress[3:5]
            batches.close()  # (its worker threads end)
            for sig, previous in handlers:
                signal.signal(sig, previous)
            for cb in self.callbacks:
                cb.on_train_end(self)
        return self.history

    def _warn_zero_rate(self, updates: int) -> None:
        """A warning line where the schedule's rate is 0 for the whole of this fit's ``updates`` updates, or from
        an iteration before its last on (max_iter ends no run: those updates change nothing)."""
        first = self.solver.iteration
        found = self.solver.config.zero_rate(first, first + updates - 1)
        if found is None:
            return
        at, why = found
        last = first + updates
        per_epoch = self.batches_per_epoch / self.solver.config.minibatch_size
        if at == first or (at == first + 1 and self.solver.config.learning_rate(first) == 0.0):
            self.log(f"warning: the learning rate is 0 for the whole run (iterations {first}..{last - 1}): {why}")
        else:
            self.log(f"warning: the learning rate is 0 from iteration {at} on, and this run trains to iteration "
                     f"{last} ({per_epoch:g} updates an epoch): its last {last - at} updates are made at rate 0 "
                     f"(max_iter ends no run): {why}")

    def resolved_run(self) -> run_config.RunConfig:
        """The run as this trainer trains it, which ``run.yaml`` records: the data section's defaults written out,
        the backend, precision and layout it runs on, and the epochs it trains to."""
        be = self.backend
        # (the epochs trained to: a fit to an epoch the run has passed does not lower them)
        train = {**self.run.train, "backend": be.name, "precision": be.precision,
                 "epochs": max(self.epochs, self.start_epoch)}
        # the layout when stated or other than the backend's default for the precision (cuda: channels-last for
        # bf16 and fp16); a default one is left to the backend that reads run.yaml (webgpu stores row-major only)
        default = be.precision in be.CHANNELS_LAST_PRECISIONS
        if "channels_last" in train or be.channels_last != default:
            train["channels_last"] = be.channels_last
        return dataclasses.replace(self.run, train=train)

    def _mark_position(self, epoch: int, sample: int, losses: tuple[float, int, float], correct: int = 0,
                       scored: int = 0) -> None:
        if self.parallel is not None:  # (every rank, before rank 0 checkpoints) the ranks' pending gradients
            self.parallel.combine_pending_gradients()
        self._record_position(epoch, sample, losses, correct, scored)

    def _record_position(self, epoch: int, sample: int, losses: tuple[float, int, float], correct: int = 0,
                         scored: int = 0) -> None:
        """Record the position in the epoch in the solver's trainer state, which checkpoints keep: ``losses`` is
        (the batches' losses each times its weight, summed; the batches; their weights, summed)."""
        loss_sum, loss_count, loss_weight = losses
        self.solver.trainer_state = {"epoch": epoch, "sample": sample, "loss_sum": loss_sum,
                                     "loss_count": loss_count, "loss_weight": loss_weight, "correct": correct,
                                     "scored": scored, "data": dict(self.run.data), "data_digest": self.data_digest}
        self._recorded = (epoch, sample, losses, correct, scored)

    @functools.cached_property
    def data_digest(self) -> str:
        """The dataset's fingerprint (:meth:`Dataset.digest`), which checkpoints keep."""
        return self.dataset.digest()

    def _epoch_record(self, epoch: int, loss: float, elapsed: float, seen: int,
                      train_accuracy: float | None = None) -> dict[str, Any]:
        held_out = self.evaluate()
        record: dict[str, Any] = {"epoch": epoch + 1, "iteration": self.solver.iteration, "loss": loss,
                                  "test_loss": held_out.loss,
                                  "learning_rate": self.solver.config.learning_rate(max(self.solver.iteration - 1, 0)),
                                  "seconds": elapsed, "samples_per_second": seen / max(elapsed, 1e-9)}
        if held_out.matrix is not None and self.running is not None:
            record["train_accuracy"] = train_accuracy if train_accuracy is not None else self.running.accuracy()
            record["test_accuracy"] = held_out.matrix.accuracy()
        record.update(held_out.metrics())
        if self.solver.loss_scaling() != "none":
            record["loss_scale"] = self.solver.loss_scale
            record["skipped_steps"] = self.solver.skipped_steps
        return record

    def _epoch_line(self, r: dict[str, Any]) -> str:
        line = f"epoch {r['epoch']}/{self.epochs}: loss {r['loss']:.4f}, held-out loss {r['test_loss']:.4f}"
        if "test_accuracy" in r:
            line += f", training accuracy {r['train_accuracy']:.2%}, held-out accuracy {r['test_accuracy']:.2%}"
        return (f"{line}, lr {r['learning_rate']:.3g}{_scaling_text(self.solver)} ({r['seconds']:.1f} s, "
                f"{r['samples_per_second']:,.0f} samples/s)")

    def evaluate(self) -> Scores:
        """The current weights on the held-out split."""
        ds = self.dataset
        if self.parallel is not None:  # every rank scores with rank 0's running statistics, those it saves
            self.parallel.broadcast_statistics()
        return evaluate(self.solver.network, self.objective, ds.x_test, ds.y_test, self.classes, self.batch_size,
                        self.group, self.preparation, self.ignore_index)

    def _diverged(self, loss: float, xb: np.ndarray, yb: np.ndarray) -> None:
        none_counted = self._counts_none(yb)
        if none_counted:
            summed = ", or the objective's reduction: sum" if self.world == 1 else ""
            raise TrainingDiverged(f"the loss became {loss} at iteration {self.solver.iteration}: {none_counted}, and "
                                   "a mean over no samples is NaN (as in PyTorch); use a larger batch_size, fewer "
                                   f"ignored labels or zero class weights{summed}")
        if not len(xb):  # a rank without a share of a last batch: the other ranks' samples made it
            where = "not found on this rank (it had no samples of this batch)"
        else:
            where = first_non_finite(self.solver.network, xb)
            if self.world > 1:
                where += f" (for rank {self.group.rank}'s share of the batch; the other ranks' may differ)"
        ckpt = os.path.join(self.out_dir, "checkpoint.leaf") if self.out_dir else None
        last = ckpt if ckpt and os.path.exists(ckpt) else "not written yet"
        raise TrainingDiverged(f"the loss became {loss} at iteration {self.solver.iteration}; first non-finite "
                               f"output: {where}. The last good checkpoint is {last}; try a smaller base_lr or "
                               "clip_gradients")

    def _counts_none(self, yb: np.ndarray) -> str:
        """Why the objective counts none of this batch's labels (every one ignore_index, or of a class weighing 0),
        or "" when it counts some (or scores no classes)."""
        if not self.classes or not len(yb):
            return ""
        keep = counted(yb, self.ignore_index)
        if keep is not None and not keep.any():
            share = " (this rank's share)" if self.world > 1 else ""
            return f"every label of this batch{share} is ignore_index {self.ignore_index}"
        if label_weight(self.run.objective, yb) == 0:
            return "every counted label of this batch is of a class whose weight is 0"
        return ""

    # --- files --------------------------------------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """The solver's state and the position in the epoch, atomically; refused (LeafpyError) when a weight is
        not finite, so an existing good checkpoint is never replaced by a diverged one."""
        if not weights_finite(self.solver.network):
            raise TrainingDiverged(f"{path}: not written: the weights are no longer finite (the last checkpoint "
                                   "written is the last good one)")
        if self._live is not None and self._live != self._recorded:  # inside an epoch (a callback's checkpoint, or
            # one after an error), where no stop signal recorded the position: that of the weights as they are
            if self.parallel is not None and self.solver._calls:
                raise LeafpyError(f"{path}: not written: inside an epoch of data-parallel training with gradient "
                                  "accumulation each rank holds its own pending gradients; save checkpoints at the "
                                  "end of an epoch (the Checkpoint callback does) or on a stop signal")
            self._record_position(*self._live)
        self.solver.save_checkpoint(path)

    def save_model(self, path: str) -> None:
        """Save the trained network (its config and weights) as a model file, which ``lp.Layer.load`` and
        ``leafpy evaluate`` read (rank 0 only)."""
        if self.is_root:
            self.solver.network.preparation = self.preparation
            self.solver.network.save(path)

    # --- signals ------------------------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> list[tuple[int, Any]]:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return []
        installed = []
        for sig in STOP_SIGNALS:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:  # nohup, or a parent that wants this process to ignore it
                continue
            signal.signal(sig, self._on_signal)
            installed.append((sig, previous))
        return installed

    def _batch_loss(self, loss: float, samples: int, hits: int, labelled: int, yb: np.ndarray
                    ) -> tuple[float, float, float, int, int, int, bool | None]:
        """The loss of the whole (global) batch, that loss times its weight and its weight (what the epoch's mean
        over its samples sums: the samples, or the counted labels' weights where the objective's mean divides by
        those; for an objective that sums, its sum and the samples it would divide by), its samples, its correct
        predictions (``hits``: this rank's), its
        samples whose labels count (``labelled``: this rank's; not those labelled ignore_index) and, with several
        ranks, whether to stop after it. The ranks' losses are combined weighted by their samples (by their labels'
        weights where the objective's mean divides by those: ignore_index, class weights; one
        all-reduce, which also sums the hits and tells every rank whether any got a stop signal: they agree after
        every batch, so they stop at the same one and none waits alone in a collective); a NaN on any rank is a NaN
        on all, so every rank stops at the same step. None for the stop with one process: it checks its own flag
        after the batch's callbacks."""
        if self.world == 1:
            summed = summed_losses(self.run.objective, yb)
            if summed is not None:
                return loss, loss, summed, samples, hits, labelled, None
            counted_weight = label_weight(self.run.objective, yb)
            weight = float(samples) if counted_weight is None else counted_weight
            return loss, loss * weight, weight, samples, hits, labelled, None
        weight = self.parallel.label_weight  # (the step's own, None: its samples)
        weight = float(samples) if weight is None else weight
        sums = np.array([loss * weight if weight else 0.0, float(samples), float(hits),
                         1.0 if self.interrupted else 0.0, float(labelled), weight])
        self.group.allreduce_(sums)
        return (float(sums[0] / sums[5]) if sums[5] else math.nan, float(sums[0]), float(sums[5]), int(sums[1]),
                int(sums[2]), int(sums[4]), self._agreed_stop(sums[3] > 0))

    def _stop_requested(self) -> bool:
        """Whether to stop here: this process got a stop signal or, with several ranks, any rank did (all ranks
        agree after every batch, so they stop at the same one and none waits alone in a collective)."""
        if self.world > 1:
            return self._agreed_stop(self.group.allreduce_sum(1.0 if self.interrupted else 0.0) > 0)
        return self.interrupted

    def _agreed_stop(self, agreed: Any) -> bool:
        """What the ranks agreed on. A signal handled during or after the all-reduce (Python runs handlers between
        bytecodes: when the collective returns) is kept for the next agreement, neither lost nor acted on alone."""
        if agreed:
            self.interrupted = True
        return bool(agreed)

    def stop(self) -> None:
        """Ask a running :meth:`fit` to stop after its current batch, as a stop signal does (a checkpoint, then
        TrainingInterrupted). For another thread to call: a ``fit`` running in a thread other than the main one gets
        no signal (Python delivers them to the main thread; it installs no handlers there), so Ctrl-C does not reach
        it, and the thread that handles Ctrl-C calls this."""
        self.signal_name = "Trainer.stop"
        self._stop_asked = self.interrupted = True

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.interrupted = True
        self.signal_name = signal.Signals(signum).name

    def _stop_on_signal(self) -> None:
        path = os.path.join(self.out_dir, "checkpoint.leaf") if self.out_dir else None
        if path and self.is_root:
            self.save_checkpoint(path)
        where = f"checkpoint saved to {path}; continue with --resume {path}" if path else "no checkpoint written"
        raise TrainingInterrupted(f"interrupted ({getattr(self, 'signal_name', 'signal')}) at iteration "
                                  f"{self.solver.iteration}: {where}")


def _scaling_text(solver: Solver) -> str:
    """The loss scale and the skipped steps, for progress lines (empty without loss scaling)."""
    if solver.loss_scaling() == "none":
        return ""
    return f", loss scale {solver.loss_scale:g}, {solver.skipped_steps} skipped steps"


def load_data(run: run_config.RunConfig) -> datasets.Dataset:
    """The run's dataset (class labels or regression values, as its objective needs), checked against the
    network's input and the objective before any training."""

    classes = num_classes(run) > 0
    ds = datasets.load(run.data, targets="classes" if classes else "values",
                       input_shape=run.network.config.inputs[0][1][1:], ignore_index=ignored_label(run))
    check_samples(run, ds.input_shape, f"data: the {ds.name} samples")
    if classes:
        _check_labels(run, ds)
        recorded = tuple(run.data.get("class_names") or ())
        if ds.class_names and recorded and tuple(ds.class_names) != recorded:
            relabel(ds, [str(n) for n in recorded])  # (numbered as the run names them, before the check below)
        for layer in run.objective.config.layers:
            n = getattr(layer.config, "num_classes", None)
            if n is not None and ds.num_classes > n:
                given = f" (data.class_names names {ds.num_classes})" if recorded else ""
                raise LeafpyError(f"data: the {ds.name} labels go up to {ds.num_classes - 1}{given}, but objective "
                                  f"layer '{layer.name}' has num_classes {n}; set it (and the network's output size) "
                                  f"to {ds.num_classes}")
        scored = num_classes(run)
        if len(recorded) > scored:  # (data that names its classes was refused above: its count includes these)
            raise ConfigError(f"data.class_names: {len(recorded)} names ({', '.join(map(repr, recorded[:8]))}"
                              f"{' ...' * (len(recorded) > 8)}) for the {scored} classes the objective scores "
                              f"(num_classes {scored}); name each class once (class k the k-th), or set num_classes "
                              f"(and the network's output size) to {len(recorded)}")
    else:
        inputs = run.objective.config.inputs
        target_name, target = inputs[-1]
        if len(inputs) < 2 or math.prod(target[1:]) != math.prod(ds.target_shape):
            raise LeafpyError(f"data: the {ds.name} targets have shape {list(ds.target_shape)} per sample, but the "
                              f"objective's target input {target_name!r} is declared {list(target)}; declare "
                              f"[{target[0]}, {', '.join(map(str, ds.target_shape))}] in objective.inputs")
    prepare_data(run, ds, classes)
    return ds


def _check_labels(run: run_config.RunConfig, ds: datasets.Dataset) -> None:
    """The data's class labels per sample (none: one class index; [d1, ...]: one at every position) are what the
    objective's label input takes, before any training (a batch of another shape is refused in its first step,
    naming no file)."""
    inputs = run.objective.config.inputs
    if len(inputs) < 2:
        return
    name, declared = inputs[-1]
    per_sample = math.prod(declared[1:]) == 1
    given = tuple(ds.target_shape)
    if math.prod(given) == math.prod(declared[1:]) and (per_sample or len(given) == len(declared) - 1):
        return
    if per_sample:
        raise ConfigError(f"data: the {ds.name} labels have shape {list(given)} per sample, but the objective takes "
                          f"one class index per sample (its input {name!r} is declared {list(declared)}); one-hot "
                          "rows? give the class indices (y.argmax(axis=1)); labels at every position need the "
                          f"objective's {name!r} declared [{declared[0]}, {', '.join(map(str, given))}]")
    raise ConfigError(f"data: the {ds.name} labels have shape {list(given)} per sample, but the objective's input "
                      f"{name!r} is declared {list(declared)}; give labels of shape {list(declared[1:])} per sample, "
                      f"or declare [{declared[0]}, {', '.join(map(str, given)) or '1'}] in objective.inputs")


def prepare_data(run: run_config.RunConfig, ds: datasets.Dataset, classes: bool) -> None:
    """Normalise ``ds`` as ``data.normalize`` asks (``auto``: from its training split only; a regression's targets
    too) and record in the run's data section what was used, the class names and an image folder's size and
    CSV table's features, as run.yaml and the model file keep them."""
    data = run.data
    names = ds.class_names or tuple(str(n) for n in data.get("class_names") or ())
    if names and len(names) < ds.num_classes:
        raise ConfigError(f"data.class_names: {len(names)} names for {ds.num_classes} classes; name every class")
    prep = prepare.resolve(data, ds.x_train, None if classes else ds.y_train, names)
    ds.x_train, ds.x_test = prep.inputs(ds.x_train), prep.inputs(ds.x_test)
    if not classes:
        ds.y_train, ds.y_test = prep.targets(ds.y_train), prep.targets(ds.y_test)
    ds.class_names = prep.class_names
    if data.get("dataset") == "image_folder":
        data["channels"], data["image_size"] = int(ds.input_shape[0]), [int(v) for v in ds.input_shape[1:]]
    if ds.feature_names:
        data["features"] = list(ds.feature_names)


def relabel(ds: datasets.Dataset, names: Sequence[str]) -> None:
    """Number the classes of ``ds`` (labels into its ``class_names``, which its data gave) as ``names`` does: the
    run's ``data.class_names``, which a trained run records (run.yaml) and a run file may give. Its data's classes
    may have changed since (a class folder added, a table's labels edited: the names sort anew, and every label
    after a new name would be off by one); a class the data has and ``names`` does not name is refused, as a model
    cannot score a class it was not trained on. Every label of ``ds`` is one of its classes (data that names its
    classes holds no ignored label)."""
    from .sources.csv_table import whole_number

    known = {whole_number(name): k for k, name in enumerate(names)}  # a name recorded as "2.0" is the class "2"
    known.update((name, k) for k, name in enumerate(names))
    unknown = [name for name in ds.class_names if name not in known]
    if unknown:
        raise LeafpyError(
            f"data: the {ds.name} data has class{'es' * (len(unknown) > 1)} {', '.join(map(repr, unknown[:5]))}"
            f"{' ...' * (len(unknown) > 5)}, which data.class_names ({', '.join(map(repr, names[:8]))}"
            f"{' ...' * (len(names) > 8)}) does not name: a trained run's classes are those it was trained on "
            "(its run.yaml records them); evaluate or resume on data of those classes, or train a new run on this "
            "data (leafpy train RUN_FILE --out NEW_DIR); in a run file of your own, name every class of the data")
    table = np.array([known[name] for name in ds.class_names], np.int64)
    ds.y_train, ds.y_test = (table[np.asarray(y)] for y in (ds.y_train, ds.y_test))
    ds.class_names, ds.num_classes = tuple(names), max(ds.num_classes, len(names))


def check_samples(run: run_config.RunConfig, shape: Sequence[int], what: str, *, trained: bool = False) -> None:
    """Samples of this per-sample shape fit the network's input (see :func:`load_data`); ``trained``: for weights
    already trained, whose input cannot be declared again."""
    from .layers.layer import layout_hint, same_layout

    name, declared = run.network.config.inputs[0]
    if tuple(shape) != tuple(declared[1:]) and math.prod(declared[1:]) == math.prod(shape) \
            and not same_layout(tuple(shape), tuple(declared[1:])):
        hint = layout_hint((declared[0], *shape), declared, "x", first=1)
        raise LeafpyError(f"{what} have shape {list(shape)}, but the network's input {name!r} is declared "
                          f"{list(declared)}{hint}; convert the data (or declare [{declared[0]}, "
                          f"{', '.join(map(str, shape))}] if that is the network's real layout)")
    if math.prod(declared[1:]) != math.prod(shape):
        raise LeafpyError(f"{what} have shape {list(shape)}, but the network's input {name!r} is declared "
                          f"{list(declared)}; " + (f"give samples of shape {list(declared[1:])}" if trained else
                          f"declare [{declared[0]}, {', '.join(map(str, shape))}] in network.inputs, or give samples "
                          f"of shape {list(declared[1:])} (data: {{dataset: npz, path: FILE.npz}})"))


def iter_none() -> Generator[Any, None, None]:
    """A generator of nothing (closing it does nothing)."""
    yield from ()
