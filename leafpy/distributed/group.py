"""The process group: this process's rank among the job's ranks, and the collectives leafpy needs over MPI."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from ..errors import BackendUnavailable, LeafpyError

_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS")
"""Environment variables by which MPICH (Hydra), Open MPI, PMIx and Slurm tell a process the job's size."""


def launched_size() -> int:
    """How many ranks the launcher started (1 when this process was not started by mpiexec, srun...)."""
    for name in _SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            if name == "SLURM_NTASKS" and "SLURM_PROCID" not in os.environ:
                continue  # inside an allocation (sbatch) but not a task started by srun
            return int(value)
    return 1


class ProcessGroup:
    """The ranks of one job. A world of one (no MPI) is a valid group whose collectives are no-ops."""

    def __init__(self, comm: Any = None) -> None:
        self.comm = comm
        if comm is None:
            self.rank, self.size, self.local_rank, self.local_size = 0, 1, 0, 1
            return
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node.Free()

    @property
    def is_root(self) -> bool:
        """Rank 0: the one that prints and writes files."""
        return self.rank == 0

    def allreduce_(self, array: np.ndarray) -> np.ndarray:
        """Sum a contiguous host array across ranks, in place."""
        if self.comm is not None and self.size > 1:
            from mpi4py import MPI

            self.comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        return array

    def broadcast_(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Overwrite a contiguous host array on every rank with ``root``'s."""
        if self.comm is not None and self.size > 1:
            self.comm.Bcast(array, root=root)
        return array

    def allreduce_sum(self, value: float) -> float:
        """A number summed across ranks."""
        if self.comm is None or self.size == 1:
            return float(value)
        buf = np.array([float(value)])  # a buffer, not mpi4py's pickled objects
        return float(self.allreduce_(buf)[0])

    def allgather_text(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order (one collective)."""
        if self.comm is None or self.size == 1:
            return [text]
        return [str(t) for t in self.comm.allgather(str(text))]

    def barrier(self) -> None:
        if self.comm is not None and self.size > 1:
            self.comm.Barrier()

    def abort(self, code: int = 1) -> None:
        """End every rank of the job (a failing rank calls this so no other rank waits in a collective)."""
        if self.comm is not None and self.size > 1:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                self.comm.Abort(code)

    def __repr__(self) -> str:
        return f"ProcessGroup(rank={self.rank}, size={self.size}, local_rank={self.local_rank})"


class failing_rank_ends_the_job:  # noqa: N801 (used as a context manager, read as a sentence)
    """A context manager: an exception on one rank is printed (by that rank) and ends every rank of the job, so
    none waits forever in a collective for it. Without MPI, or in a world of one, the exception propagates."""

    REPORT_DELAY_S = 2.0
    """How long a rank other than 0 waits before reporting its error and ending the job: an error every rank meets
    (a bad data file, a bad setting) is then printed once, by rank 0, whose abort ends the others first; an error
    of one rank alone is printed by that rank, this much later."""
    FORWARD_S = 0.5
    """How long a rank waits between printing its error and ending the job, so that the launcher forwards the
    message before it stops the ranks (without it the message was lost now and then)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def __enter__(self) -> ProcessGroup:
        return self.group

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        if error is None or self.group.size == 1 or isinstance(error, SystemExit) and not error.code:
            return
        import time
        import traceback

        if self.group.rank != 0 and not isinstance(error, KeyboardInterrupt):
            time.sleep(self.REPORT_DELAY_S)
        if isinstance(error, LeafpyError):
            print(f"leafpy: rank {self.group.rank}: error: {error}", file=sys.stderr, flush=True)
        elif isinstance(error, SystemExit):  # (argparse's, its message printed)
            print(f"leafpy: rank {self.group.rank}: stopped (exit status {error.code})", file=sys.stderr, flush=True)
        elif isinstance(error, KeyboardInterrupt):
            print(f"leafpy: rank {self.group.rank}: interrupted", file=sys.stderr, flush=True)
        else:
            print(f"leafpy: rank {self.group.rank}: unexpected error:", file=sys.stderr)
            traceback.print_exception(kind, error, tb, file=sys.stderr)
        sys.stderr.flush()
        time.sleep(self.FORWARD_S)
        code = error.code if isinstance(error, SystemExit) and isinstance(error.code, int) else 1
        self.group.abort(code)
        os._exit(code)  # MPI_Abort may return before the launcher ends this process


_GROUP: ProcessGroup | None = None


def init() -> ProcessGroup:
    """Join the job's process group (once; later calls return the same group). Without a launcher this is a
    world of one and MPI is not imported."""
    global _GROUP
    if _GROUP is not None:
        return _GROUP
    if launched_size() == 1:
        _GROUP = ProcessGroup()
        return _GROUP
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise BackendUnavailable(
            f"distributed: this process was started as one of {launched_size()} ranks, but mpi4py cannot be "
            f"imported ({e}); install it with pip install mpi4py mpich (the dist extra; mpich's "
            "wheel provides mpiexec)") from e
    _GROUP = ProcessGroup(MPI.COMM_WORLD)
    if _GROUP.size != launched_size():
        raise LeafpyError(f"distributed: the launcher started {launched_size()} ranks but MPI sees "
                          f"{_GROUP.size}; mpi4py was built against another MPI than the one running mpiexec "
                          "(use the mpiexec of the same MPI, e.g. the mpich wheel's)")
    return _GROUP
