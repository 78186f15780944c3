"""NegativeLogLikelihood: the loss of log-probabilities [N, C] (or [N, C, d1, ...]) at class-index labels [N] or
[N, 1] (or [N, d1, ...]; integer or float): each sample's (and position's) -logp[i, label_i], weighted by the class
weight of its label (``weight``; all 1 when empty) and left out where the label is ``ignore_index``; ``reduction``
mean (the weighted sum over the sum of the weights counted: today's mean over the batch without options), sum, or
none (the losses themselves, [N] or [N, d1, ...]). ONNX's NegativeLogLikelihoodLoss and PyTorch's NLLLoss."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import _checks
from ...errors import ConfigError, ShapeError
from ..layer import Worker, register_layer

REDUCTIONS = ("mean", "sum", "none")
"""The loss layers' reductions over samples (and positions)."""


MAX_LABELS = 2**24
"""Labels travel as float32, which holds every integer up to this exactly."""


@dataclass(frozen=True, kw_only=True)
class NegativeLogLikelihoodConfig:
    num_classes: int
    reduction: str = "mean"
    ignore_index: int | None = None
    """A label whose samples contribute nothing and are not counted (any integer; None: every label counts)."""
    weight: tuple[float, ...] = ()
    """One non-negative weight per class (empty: all 1)."""

    def __post_init__(self) -> None:
        where = type(self).__name__
        object.__setattr__(self, "num_classes", _checks.positive_int(f"{where}.num_classes", self.num_classes))
        if self.num_classes > MAX_LABELS:
            raise ConfigError(f"{where}.num_classes: at most {MAX_LABELS} classes (labels travel as float32, exact up "
                              f"to 2**24), got {self.num_classes}")
        _checks.choice(f"{where}.reduction", self.reduction, REDUCTIONS)
        object.__setattr__(self, "ignore_index", _ignore_index(f"{where}.ignore_index", self.ignore_index))
        object.__setattr__(self, "weight", _class_weights(f"{where}.weight", self.weight, self.num_classes))


def _ignore_index(where: str, value: object) -> int | None:
    if isinstance(value, (tuple, list)) and len(value) <= 1:  # the schema's list of at most one
        value = value[0] if value else None
    if value is None:
        return None
    index = _checks._integer(value)
    if index is None or abs(index) > MAX_LABELS:
        raise ConfigError(f"{where}: expected an integer label to ignore from -2**24 to 2**24 (labels travel as "
                          f"float32, exact within them), or none, got {value!r}")
    return index


def _class_weights(where: str, value: object, num_classes: int) -> tuple[float, ...]:
    if not isinstance(value, (tuple, list)):
        raise ConfigError(f"{where}: expected a list of {num_classes} class weights (or an empty list), got {value!r}")
    weights = tuple(_checks.number(f"{where}[{i}]", v, minimum=0.0) for i, v in enumerate(value))
    if weights and len(weights) != num_classes:
        raise ConfigError(f"{where}: expected one weight per class ({num_classes}), got {len(weights)}; leave it "
                          "empty for all 1")
    return weights


def check_labels(where: str, labels: np.ndarray | None, num_classes: int, ignore_index: int | None = None) -> None:
    """Raise ShapeError when a host label array holds a value that is not a class index in [0, num_classes) (nor
    ``ignore_index``)."""
    if labels is None:
        return
    if ignore_index is not None:
        labels = np.where(labels == ignore_index, 0, labels)
    i = _checks.first_non_index(labels, num_classes)
    if i is not None:
        ignored = "" if ignore_index is None else f" or ignore_index {ignore_index}"
        raise ShapeError(f"{where}: label {i} is {float(labels.reshape(-1)[i])!r}; labels must be class indices in "
                         f"[0, {num_classes - 1}]{ignored}")


def loss_layers(objective: Any) -> list[Any]:
    """The LayerConfigs of an objective's (a LayerConfig, or None) class-label losses: NegativeLogLikelihood and
    SoftmaxCrossEntropy, in order."""
    if objective is None:
        return []
    layers = objective.config.layers if objective.type == "Sequential" else [objective]
    return [layer for layer in layers if isinstance(layer.config, NegativeLogLikelihoodConfig)]


def loss_configs(objective: Any) -> list[NegativeLogLikelihoodConfig]:
    """The configs of :func:`loss_layers`."""
    return [layer.config for layer in loss_layers(objective)]


def label_weight(objective: Any, labels: Any) -> float | None:
    """What a classification objective's mean divides by over ``labels``: the summed class weights of the labels it
    counts (those other than ``ignore_index``), as its loss layer computes it; None where that is the number of
    samples (no ignore_index, no class weights, or no such layer). Data-parallel ranks weigh their gradients and
    losses by it, so that their means combine into the global batch's."""
    for cfg in loss_configs(objective):
        if cfg.reduction != "mean":
            continue
        return _counted_weight(cfg, labels)
    return None


def summed_losses(objective: Any, labels: Any) -> float | None:
    """For an objective that sums its losses (reduction sum): what its mean would divide by over ``labels`` (the
    counted labels' class weights, or their number), so that a sum over batches, divided by the sum of these, is
    the mean over all samples; None for an objective that does not sum."""
    for cfg in loss_configs(objective):
        if cfg.reduction == "sum":
            weight = _counted_weight(cfg, labels)
            return float(np.asarray(labels).reshape(-1).size) if weight is None else weight
    return None


def _counted_weight(cfg: NegativeLogLikelihoodConfig, labels: Any) -> float | None:
    """The summed class weights of the labels ``cfg`` counts; None where that is their number (no ignore_index, no
    class weights)."""
    if cfg.ignore_index is None and not cfg.weight:
        return None
    y = np.asarray(labels.to_numpy() if hasattr(labels, "to_numpy") else labels).reshape(-1)
    if cfg.ignore_index is not None:
        y = y[y != cfg.ignore_index]
    if not cfg.weight:
        return float(len(y))
    k = y[(y >= 0) & (y < len(cfg.weight))].astype(np.int64)
    return float(np.asarray(cfg.weight, np.float64)[k].sum())


def loss_shapes(where: str, config: NegativeLogLikelihoodConfig, scores: tuple[int, ...], labels: tuple[int, ...],
                what: str = "log-probabilities") -> list[tuple[int, ...]]:
    """The output shape of a loss over ``scores`` [N, C, d...] and ``labels`` [N, d...] ([N, 1] too for [N, C]),
    or a ShapeError."""
    k = config.num_classes
    if len(scores) < 2 or scores[1] != k:
        raise ShapeError(f"{where}: expected {what} of shape [N, {k}] or [N, {k}, d1, ...] (num_classes={k}), "
                         f"got {scores}")
    per_sample = (scores[0], *scores[2:])
    allowed = [per_sample, (scores[0], 1, *scores[2:])]
    if labels not in allowed:
        raise ShapeError(f"{where}: expected labels of shape {list(allowed[0])} or {list(allowed[1])} for {what} "
                         f"{list(scores)}, got {list(labels)}")
    return [per_sample if config.reduction == "none" else (1,)]


class LossWorker(Worker):
    """A classification loss over scores and labels, with NegativeLogLikelihood's options."""

    num_inputs = 2
    differentiable = (True, False)
    checked_inputs = (1,)

    def validate(self, host_inputs: list[np.ndarray | None]) -> None:
        check_labels(self.where, host_inputs[1], self.config.num_classes, self.config.ignore_index)

    def options(self) -> dict:
        c = self.config
        return {"weight": c.weight, "ignore_index": c.ignore_index, "reduction": c.reduction}


@register_layer("NegativeLogLikelihood", NegativeLogLikelihoodConfig)
class NegativeLogLikelihood(LossWorker):
    def output_shapes(self, input_shapes):
        return loss_shapes(self.where, self.config, *(tuple(s) for s in input_shapes))

    def forward(self, backend, x, w, y):
        backend.nll(x[0], x[1], y[0], **self.options())

    def backward_input(self, backend, x, y, dy, w, dx):
        if dx[0] is not None:
            backend.nll_grad(x[1], dy[0], dx[0], **self.options())


@dataclass(frozen=True, kw_only=True)
class SoftmaxCrossEntropyConfig(NegativeLogLikelihoodConfig):
    """NegativeLogLikelihood of the log-softmax (over axis 1) of scores, in one layer."""

    log_prob: bool = False
    """Also give the log-probabilities [N, C, d...] as a second output (ONNX's log_prob)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "log_prob", _checks.flag(f"{type(self).__name__}.log_prob", self.log_prob))


@register_layer("SoftmaxCrossEntropy", SoftmaxCrossEntropyConfig)
class SoftmaxCrossEntropy(LossWorker):
    """The softmax cross-entropy of scores (Caffe's SoftmaxWithLoss, ONNX's SoftmaxCrossEntropyLoss): the log-softmax
    over the classes (stable: log-sum-exp) kept for the backward pass, whose gradient is (softmax - onehot) times
    each sample's weight over the reduction's divisor."""

    def __init__(self, config, layer_name):
        super().__init__(config, layer_name)
        self.logp = None
        self.num_outputs = 2 if config.log_prob else 1

    def output_shapes(self, input_shapes):
        shapes = [tuple(s) for s in input_shapes]
        return loss_shapes(self.where, self.config, *shapes, what="scores") + shapes[:1] * (self.num_outputs - 1)

    def setup(self, backend, input_shapes):
        shape = tuple(input_shapes[0])
        if self.logp is None or self.logp.shape != shape:
            self.logp = backend.view(backend.allocate(math.prod(shape), backend.dtype), shape)

    def forward(self, backend, x, w, y):
        backend.log_softmax(x[0], self.logp)
        backend.nll(self.logp, x[1], y[0], **self.options())
        if len(y) > 1:
            backend.copy(self.logp, y[1])

    def backward_input(self, backend, x, y, dy, w, dx):
        if dx[0] is not None:
            backend.nll_grad(x[1], dy[0], dx[0], **self.options())
            if len(dy) > 1 and dy[1] is not None:  # the log-probabilities' own gradient joins the loss's
                backend.axpby(1.0, dy[1], 1.0, dx[0])
            backend.log_softmax_grad(self.logp, dx[0], dx[0])
