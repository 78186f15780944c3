"""NegativeLogLikelihood: the mean over the batch of -logp[i, label_i], for log-probabilities [N, num_classes]
and class-index labels of shape [N] or [N, 1] (integer or float)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import _checks
from ...errors import ShapeError
from ..layer import Worker, register_layer


@dataclass(frozen=True, kw_only=True)
class NegativeLogLikelihoodConfig:
    num_classes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_classes",
                           _checks.positive_int("NegativeLogLikelihoodConfig.num_classes", self.num_classes))


def check_labels(where: str, labels: np.ndarray | None, num_classes: int) -> None:
    """Raise ShapeError when a host label array holds a value that is not a class index in [0, num_classes)."""
    if labels is None:
        return
    i = _checks.first_non_index(labels, num_classes)
    if i is not None:
        raise ShapeError(f"{where}: label {i} is {float(labels.reshape(-1)[i])!r}; labels must be class indices in "
                         f"[0, {num_classes - 1}]")


@register_layer("NegativeLogLikelihood", NegativeLogLikelihoodConfig)
class NegativeLogLikelihood(Worker):
    num_inputs = 2
    differentiable = (True, False)

    def output_shapes(self, input_shapes):
        probs, labels = (tuple(s) for s in input_shapes)
        k = self.config.num_classes
        if len(probs) != 2 or probs[1] != k:
            raise ShapeError(f"{self.where}: expected log-probabilities of shape [N, {k}] (num_classes={k}), "
                             f"got {probs}")
        if labels not in ((probs[0],), (probs[0], 1)):
            raise ShapeError(f"{self.where}: expected labels of shape [{probs[0]}] or [{probs[0]}, 1] for "
                             f"{probs[0]} samples, got {labels}")
        return [(1,)]

    def validate(self, host_inputs: list[np.ndarray | None]) -> None:
        check_labels(self.where, host_inputs[1], self.config.num_classes)

    def forward(self, backend, x, w, y):
        backend.nll(x[0], x[1], y[0])

    def backward_input(self, backend, x, y, dy, w, dx):
        if dx[0] is not None:
            backend.nll_grad(x[1], dy[0], dx[0])
