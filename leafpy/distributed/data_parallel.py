"""DataParallel: a Solver whose updates use the whole global batch of every rank, and the sharding of batches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..layers.container.sequential import Sequential
from ..layers.layer import Layer
from ..layers.loss.negative_log_likelihood import label_weight, loss_configs, loss_layers
from ..layers.network import Network
from ..solvers.solver import Solver
from ..tensor import SharedTensor
from .group import ProcessGroup
from .transports import Transport, default_transport

BUCKET_BYTES = 16 << 20
"""Gradients are summed across ranks in buckets of about this many bytes (one collective each): large enough
that a collective's latency is paid rarely, small enough that the host staging buffers stay modest."""


def shard_indices(order: np.ndarray, batch_size: int, group: ProcessGroup) -> Iterator[np.ndarray]:
    """This rank's sample indices for each global batch of ``order``: the global batch is ``group.size`` x
    ``batch_size`` samples, rank r takes the r-th share. The last, partial global batch is split as evenly as
    possible; when it has fewer samples than there are ranks, the last ranks' shares are empty
    (:meth:`DataParallel.train_minibatch` takes an empty share: that rank adds nothing to the update)."""
    if batch_size <= 0:
        raise ConfigError(f"data.batch_size: expected a positive integer, got {batch_size!r}")
    step = batch_size * group.size
    for start in range(0, len(order), step):
        yield shard(order[start:start + step], batch_size, group)


def shard(chunk: np.ndarray, batch_size: int, group: ProcessGroup) -> np.ndarray:
    """This rank's share of one global batch (see :func:`shard_indices`); empty for the last ranks when the
    batch has fewer samples than there are ranks."""
    if len(chunk) == batch_size * group.size:
        return chunk[group.rank * batch_size:(group.rank + 1) * batch_size]
    return np.array_split(chunk, group.size)[group.rank]


def shard_batches(x: np.ndarray, y: np.ndarray, batch_size: int, group: ProcessGroup, *, seed: int | None = 0,
                  epoch: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """This rank's batches of an epoch: the same shuffled order on every rank (from ``seed`` and ``epoch``, as
    :func:`leafpy.data.batches`), cut into global batches of ``group.size`` x ``batch_size``."""
    n = len(x)
    order = np.arange(n) if seed is None else np.random.default_rng([seed, epoch]).permutation(n)
    for idx in shard_indices(order, batch_size, group):
        yield x[idx], y[idx]


class DataParallel:
    """Makes ``solver`` train as one model across the ranks of ``group``.

    On construction every rank takes rank 0's weights. Each :meth:`train_minibatch` runs this rank's share of the
    global batch; before an update the gradients of all ranks are summed, each weighted by its share of the
    global batch's samples, so the update is the one a single process would make on the global batch (the
    objective averages over the batch). Clipping, accumulation, weight decay and the update rule then run
    identically on every rank. Dropout layers draw each rank's masks from a sequence of their own (so the ranks'
    samples are not all masked alike; the masks are not the ones one process would draw). BatchNorm layers use
    each rank's own batch statistics, or with
    ``sync_batch_norm=True`` the global batch's (every rank then trains as one process on the global batch would,
    at the cost of two small host collectives per BatchNorm layer and step).
    """

    def __init__(self, solver: Solver, group: ProcessGroup, *, transport: Transport | None = None,
                 bucket_bytes: int = BUCKET_BYTES, sync_batch_norm: bool = False) -> None:
        self.solver = solver
        self.group = group
        self.transport = transport or default_transport(solver.network.backend, group)
        self.bucket_bytes = int(bucket_bytes)
        self._samples = 0  # this rank's samples since the last update (or its labels' weights: see label_weight)
        self._weighed = False  # whether the last step's weight was its labels' (varying from batch to batch)
        self.label_weight: float | None = None
        """What the last step's share of the objective's mean divided by, where that is its labels' weights
        (:func:`label_weight`: ignore_index, class weights); None: its samples."""
        summed = [layer.name for layer in loss_layers(solver.config.objective) if layer.config.reduction == "sum"]
        if summed and group.size > 1:  # the ranks' gradients are combined as means of their shares
            raise ConfigError(f"objective layer '{summed[0]}': reduction 'sum' on {group.size} ranks: the ranks "
                              "average their gradients, as a mean-reduced objective needs; use reduction: mean (and "
                              "scale base_lr by the batch size for the same steps)")
        self._sync_batch_norm = sync_batch_norm and group.size > 1
        self._buckets: list[list[int]] | None = None
        self._buckets_of: Any = None  # the network's parameters (one binding) the buckets were planned for
        self._in_flight: dict[int, Any] = {}
        self.overlapped = 0
        """Buckets whose sum started before the backward pass had finished (counted in the steps that ran their
        Python: eager and recorded ones; a replayed step repeats its recording's)."""
        self.broadcast_weights()
        solver.gradient_reducer = self
        for worker in solver.network.workers():
            if hasattr(worker, "stream"):  # dropout: each rank masks its own samples with masks of its own
                worker.stream = group.rank
        self._statistics: BatchStatistics | None = None
        if sync_batch_norm and group.size > 1:
            self._statistics = BatchStatistics(group)
            for worker in solver.network.workers():
                if hasattr(worker, "synchronizer"):
                    worker.synchronizer = self._statistics
        self._plan_overlap()

    @property
    def network(self) -> Network[Layer]:
        """The solver's network."""
        return self.solver.network

    def broadcast_weights(self, root: int = 0) -> None:
        """Every rank takes ``root``'s weights and update-rule state (a fresh start or a loaded checkpoint)."""
        if self.group.size == 1:
            return
        tensors = list(self.solver.network.learnable_weights_data())
        self._broadcast(tensors + [t for state in self.solver.state for t in state], root)

    def _broadcast(self, tensors: list[SharedTensor], root: int) -> None:
        """Every rank takes ``root``'s values of ``tensors`` (through the host)."""
        for t in tensors:
            host = np.ascontiguousarray(t.to_numpy())
            self.group.broadcast_(host, root)
            t.set(host)

    def combine_pending_gradients(self) -> None:
        """With gradient accumulation (minibatch_size > 1) between two updates, each rank holds its own share of the
        gradients summed so far; this gives every rank their combination (the mean of the ranks' sums, which the
        next update would take anyway), so a checkpoint rank 0 writes now holds what one process on the global
        batches would hold, and resumes on any number of ranks. Training goes on as without it (to float32
        rounding). Call it on every rank (a collective) before rank 0 saves a checkpoint; it does nothing when no
        call is pending."""
        solver = self.solver
        if self.group.size == 1 or solver.config.minibatch_size == 1 or not solver._calls:
            return
        self.transport.allreduce_weighted(list(solver._accum), 1.0)

    def broadcast_statistics(self, root: int = 0) -> None:
        """Every rank takes ``root``'s untrained weights (BatchNorm's running statistics: without
        ``sync_batch_norm`` each rank moves its own towards its own batches). Called before held-out evaluation, so
        every rank scores its share with the model rank 0 saves."""
        if self.group.size == 1 or self._sync_batch_norm:  # synchronised statistics are the same everywhere
            return
        net = self.solver.network
        self._broadcast([t for t, cfg in zip(net.learnable_weights_data(), net.learnable_weights_configs())
                         if cfg.lr_mult == 0.0], root)

    def train_minibatch(self, data: Any, target: Any) -> SharedTensor:
        """One step on this rank's share of a global batch; the update (every minibatch_size-th call) uses every
        rank's gradients. A share may be empty (a last global batch with fewer samples than ranks): the rank then
        takes part in the step with a placeholder sample of zeros whose gradient and BatchNorm statistics weigh
        nothing, and the network output returned is that placeholder's."""
        n = len(data) if not isinstance(data, SharedTensor) else data.shape[0]
        if n == 0:
            data, target = (np.zeros((1, *np.shape(a)[1:]), np.asarray(a).dtype) for a in (data, target))
            if self._statistics is not None:
                self._statistics.weightless = True
            try:
                return self._step(0, data, target)
            finally:
                if self._statistics is not None:
                    self._statistics.weightless = False
        return self._step(int(n), data, target)

    def _step(self, n: int, data: Any, target: Any) -> SharedTensor:
        counted = self.label_weight = label_weight(self.solver.config.objective, target) if n else None
        self._weighed = counted is not None
        if counted is not None:  # the objective's mean divides by its labels' weights (ignore_index, class weights)
            if counted == 0:  # a share that counts no label: its mean is NaN, so it trains on a counted label, which
                target = self._counted_label(target)  # weighs nothing
            n = counted  # type: ignore[assignment]
        if self.solver.config.minibatch_size > 1 and self.group.size > 1:
            # accumulated calls may differ in size (a last partial batch): weight each by its share of its own
            # global batch, so the ranks' sums add up to the sum of the global batches' mean gradients
            total = self.group.allreduce_sum(n)
            self.solver.accumulation_scale = self.group.size * n / total if total else 0.0  # (0: no rank counts)
            self._samples = 1
        else:
            self._samples += n
        iteration = self.solver.iteration
        out = self.solver.train_minibatch(data, target)
        if self.solver.iteration != iteration:  # an update: the next step's samples count from zero
            self._samples = 0
        return out

    def _counted_label(self, target: Any) -> np.ndarray:
        """``target``'s shape of labels, each one the objective counts (the first class of a positive weight)."""
        cfg = loss_configs(self.solver.config.objective)[0]  # (label_weight found it)
        label = next((k for k, w in enumerate(cfg.weight) if w > 0), 0)
        if label == cfg.ignore_index:
            label = 1 if label == 0 else 0
        shape = target.shape if hasattr(target, "shape") else np.shape(target)
        return np.full(shape, label, np.float32)

    def replay_key(self) -> Any:
        """What a recorded training step depends on besides the solver's own key (this rank's sample weight, baked
        into the recording), or None where the step must run eagerly: sums that go through the host (the MPI
        transport) and synchronised BatchNorm statistics. With NCCL the bucket sums, their side stream and events
        are recorded with the step and replayed with it."""
        if self.group.size == 1:
            return ("one rank",)
        if not self.transport.capturable or self._sync_batch_norm or self._weighed:  # (weighed: a weight per batch)
            return None
        return (self.transport.name, self._samples)

    def _plan_overlap(self) -> None:
        """Which top-level layer's backward pass completes each gradient (the first layer in network order that
        holds it: backward runs last to first), so a bucket can start as soon as all of its gradients are done."""
        net = self.solver.network.layer
        self._ready_at: list[int] = []
        if self.group.size == 1 or not self.transport.overlaps or not isinstance(net, Sequential):
            return
        grads = net.learnable_weights_gradients()
        owner: dict[int, int] = {}
        for j, child in enumerate(net.layers):
            for g in child.learnable_weights_gradients():
                owner.setdefault(id(g), j)
        self._ready_at = [owner.get(id(g), -1) for g in grads]
        net.backward_hook = self._layer_done

    def _layer_done(self, j: int) -> None:
        solver = self.solver
        k = solver.config.minibatch_size
        if not self._ready_at or k != 1:  # accumulated gradients are summed once, at the update
            return
        grads = solver.network.parameters().gradients  # gathered once per binding, not per layer and step
        for b, bucket in enumerate(self._bucket_plan(grads)):
            if b in self._in_flight or any(self._ready_at[i] < j for i in bucket):
                continue  # started already, or a gradient of it is still to come
            self._in_flight[b] = self.transport.start(b, [grads[i] for i in bucket], float(self._samples))
            self.overlapped += 1

    def _bucket_plan(self, grads: list[SharedTensor]) -> list[list[int]]:
        """Buckets of indices into ``grads``, the solver's gradients: those of the weights that move only (a frozen
        weight's, lr_mult 0, is zero on every rank or unused), last layers first."""
        params = self.solver.network.parameters()
        if self._buckets is None or self._buckets_of is not params:
            self._buckets_of = params
            configs = params.configs
            buckets: list[list[int]] = [[]]
            size = 0
            # last layers first: their gradients are complete first in a backward pass
            for i in reversed(range(len(grads))):
                if configs[i].lr_mult == 0.0:
                    continue
                nbytes = grads[i].size * 4
                if buckets[-1] and size + nbytes > self.bucket_bytes:
                    buckets.append([])
                    size = 0
                buckets[-1].append(i)
                size += nbytes
            self._buckets = [b for b in buckets if b]
        return self._buckets

    def __call__(self, grads: list[SharedTensor]) -> None:
        """The solver's gradient reducer: every rank's gradients summed, weighted by its samples."""
        weight = float(self._samples)
        if self.group.size == 1:
            return
        plan = self._bucket_plan(list(grads))
        # every bucket carries the rank's sample count in one extra slot; the sum of those is the global batch
        in_flight, self._in_flight = self._in_flight, {}
        for b, bucket in enumerate(plan):
            if b in in_flight:
                self.transport.finish(in_flight[b])
            else:
                self.transport.allreduce_weighted([grads[i] for i in bucket], weight)


class BatchStatistics:
    """Synchronised batch normalisation: BatchNorm's per-channel values combined across the ranks (on the host:
    each rank's values are gathered with one all-reduce of a rank-by-value table, then combined in float64)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.weightless = False
        """This rank's values count for nothing (a placeholder sample: the rank has no share of this batch)."""

    def _gather(self, backend: Any, buffers: list[Any], weight: float) -> tuple[np.ndarray, np.ndarray]:
        """Every rank's ``buffers`` ([ranks, len(buffers), channels]) and ``weight`` ([ranks])."""
        c = buffers[0].size
        table = np.zeros((self.group.size, len(buffers) * c + 1))
        host = np.empty(c, dtype=backend.dtype)
        row = table[self.group.rank]
        for i, buf in enumerate(buffers):
            backend.download(buf, host)
            row[i * c:(i + 1) * c] = host
        row[-1] = 0.0 if self.weightless else weight
        self.group.allreduce_(table)
        return table[:, :-1].reshape(self.group.size, len(buffers), c), table[:, -1]

    def statistics(self, backend: Any, mean: Any, var: Any, count: int) -> int:
        """Replace this rank's batch mean and (biased) variance by the global batch's; returns the global count
        of values per channel. The variance combines the ranks' variances around the global mean (no
        cancellation when the mean is large against the spread)."""
        rows, counts = self._gather(backend, [mean, var], count)
        total = counts.sum()
        w = counts[:, None] / total
        m = (w * rows[:, 0]).sum(axis=0)
        v = (w * (rows[:, 1] + (rows[:, 0] - m) ** 2)).sum(axis=0)
        backend.upload(m.astype(backend.dtype), mean)
        backend.upload(v.astype(backend.dtype), var)
        return int(total)

    def sums(self, backend: Any, sum_dy: Any, sum_dy_xhat: Any, samples: int) -> None:
        """Replace this rank's backward sums by the ranks' sums weighted by their shares of the global batch. Each
        rank's gradient is later weighted by its share (n_r / N) before the ranks' gradients are added, so the
        input gradient it needs uses sum_r (n_r / N) sums_r, in the backend's per-rank formula."""
        rows, n = self._gather(backend, [sum_dy, sum_dy_xhat], samples)
        combined = (n[:, None, None] * rows).sum(axis=0) / n.sum()
        backend.upload(combined[0].astype(backend.dtype), sum_dy)
        backend.upload(combined[1].astype(backend.dtype), sum_dy_xhat)
