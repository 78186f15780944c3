"""Embedding: integer ids -> learned vectors. Ids [N] or [N, T] (integers stored as floats, as labels are) give
[N, output_dim] or [N, T, output_dim]; the weight is the table [input_dim, output_dim] (PyTorch's layout).

The ids take no gradient (the container never asks for one). The table's gradient adds up the output gradients
of every position holding an id, so repeated ids accumulate. Ids outside [0, input_dim) are refused with an error
when the ids are on the host (data fed to a network); ids that reach the layer only on a device (computed by an
earlier layer) are clamped into range there, never read or written out of bounds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import _checks
from ...errors import ConfigError, ShapeError
from ..layer import FillerConfig, Worker, register_layer

MAX_IDS = 2**24
"""Ids travel as float32, which holds every integer up to this exactly."""


@dataclass(frozen=True, kw_only=True)
class EmbeddingConfig:
    input_dim: int
    output_dim: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_dim", _checks.positive_int("EmbeddingConfig.input_dim", self.input_dim))
        object.__setattr__(self, "output_dim", _checks.positive_int("EmbeddingConfig.output_dim", self.output_dim))
        if self.input_dim > MAX_IDS:
            raise ConfigError(f"EmbeddingConfig.input_dim: at most {MAX_IDS} ids (they travel as float32, exact up "
                              f"to 2**24), got {self.input_dim}")


def check_ids(where: str, ids: np.ndarray | None, count: int) -> None:
    """Raise ShapeError when a host id array holds a value that is not an integer in [0, count)."""
    if ids is None:
        return
    i = _checks.first_non_index(ids, count)
    if i is not None:
        at = f"sample {i // ids.shape[1]}, position {i % ids.shape[1]}" if ids.ndim == 2 else f"sample {i}"
        raise ShapeError(f"{where}: the id at {at} of the batch is {float(ids.reshape(-1)[i])!r}; ids must be "
                         f"integers in [0, {count - 1}] (input_dim={count}): raise input_dim or map the ids into range")


@register_layer("Embedding", EmbeddingConfig)
class Embedding(Worker):
    weight_names = ("weight",)
    differentiable = (False,)
    checked_inputs = (0,)

    def check_inputs(self, input_shapes):
        super().check_inputs(input_shapes)
        if len(input_shapes[0]) not in (1, 2):
            raise ShapeError(f"{self.where}: expected ids of shape [N] or [N, T], got {tuple(input_shapes[0])}; "
                             "reshape the ids to [N, T]")

    def output_shapes(self, input_shapes):
        return [(*input_shapes[0], self.config.output_dim)]

    def weight_shapes(self, input_shapes):
        return [(self.config.input_dim, self.config.output_dim)]

    def default_filler(self, index):
        return FillerConfig(type="gaussian", std=1.0)  # PyTorch's N(0, 1)

    def validate(self, host_inputs):
        check_ids(self.where, host_inputs[0], self.config.input_dim)

    def forward(self, backend, x, w, y):
        backend.embedding(x[0].reshape(-1), w[0], y[0].reshape(x[0].size, -1))

    def backward_input(self, backend, x, y, dy, w, dx):
        """The ids take no gradient."""

    def backward_parameters(self, backend, x, y, dy, dw, beta):
        backend.embedding_grad(x[0].reshape(-1), dy[0].reshape(x[0].size, -1), dw[0], beta[0])
