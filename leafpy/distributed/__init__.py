"""Data-parallel training: one model trained by several processes (ranks), each on its share of every batch.

Ranks are launched by the engines clusters already have: ``mpiexec -n N`` (the ``mpich`` wheel gives one from
pip alone), Slurm's ``srun``, or ``leafpy train --nproc N``. :func:`init` joins the job's process group;
:class:`DataParallel` makes a :class:`~leafpy.Solver` train as one: every rank starts from rank 0's weights, and
each update uses the gradients of the whole global batch (every rank's gradients, weighted by its samples,
summed across ranks before clipping, accumulation, weight decay and the update rule), so every rank applies the
same step. Gradients travel in buckets: over NCCL between GPUs (cuda), over MPI in host memory otherwise.

    import leafpy as lp
    from leafpy import distributed as dist

    group = dist.init()                                   # world of 1 when not launched under MPI
    be = lp.backend("cuda", device=group.local_rank) ...  # one device per rank
    solver = lp.Solver.from_config(be, be, cfg)
    dp = dist.DataParallel(solver, group)                 # broadcasts rank 0's weights
    for xb, yb in dist.shard_batches(x, y, batch_size, group, seed=0, epoch=e):
        dp.train_minibatch(xb, yb)

``import leafpy`` does not import mpi4py: :func:`init` does, when the process was launched as one of several.
"""

from __future__ import annotations

from . import transports
from .agreement import check_same_run
from .data_parallel import DataParallel, shard_batches, shard_indices
from .group import ProcessGroup, failing_rank_ends_the_job, init, launched_size

__all__ = ["DataParallel", "ProcessGroup", "check_same_run", "failing_rank_ends_the_job", "init", "launched_size",
           "shard_batches", "shard_indices", "transports"]
