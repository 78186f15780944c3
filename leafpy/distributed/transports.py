"""How gradients travel between ranks: NCCL between GPUs (cuda), MPI over host memory otherwise."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..backends.base import Backend
from ..errors import BackendUnavailable
from ..tensor import SharedTensor
from .group import ProcessGroup


class Transport:
    """Sums a bucket of gradients across ranks, each rank's scaled by its weight, and divides by the summed
    weights: afterwards every rank holds sum_r(w_r g_r) / sum_r(w_r)."""

    name = "none"
    overlaps = False
    """Whether start/finish let a bucket's sum run during the rest of the backward pass."""
    capturable = False
    """Whether its sums are device work only (no host round trip), so a backend may record them inside a training
    step and replay them."""

    def allreduce_weighted(self, tensors: list[SharedTensor], weight: float) -> None:
        raise NotImplementedError

    def start(self, key: int, tensors: list[SharedTensor], weight: float) -> Any:
        """Begin summing a bucket (transports that overlap); :meth:`finish` completes it."""
        raise NotImplementedError

    def finish(self, handle: Any) -> None:
        raise NotImplementedError


class HostTransport(Transport):
    """MPI Allreduce over a host staging buffer (float64 sums, so the result does not depend on rank order
    beyond float32 rounding of the inputs). :meth:`start` and :meth:`finish` split one bucket's all-reduce so that
    it runs (MPI_Iallreduce) while the backward pass goes on."""

    name = "mpi"
    overlaps = True

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self._buckets: dict[int, np.ndarray] = {}

    def start(self, key: int, tensors: list[SharedTensor], weight: float) -> Any:
        """Begin summing a bucket (``key`` names its staging buffer); returns what :meth:`finish` takes."""
        total = sum(t.size for t in tensors)
        flat = self._buckets.get(key)
        if flat is None or flat.size != total + 1:
            flat = self._buckets[key] = np.empty(total + 1, np.float64)
        offset = 0
        for t in tensors:
            flat[offset:offset + t.size] = t.to_numpy().reshape(-1)
            flat[offset:offset + t.size] *= weight
            offset += t.size
        flat[total] = weight
        request = None
        if self.group.comm is not None and self.group.size > 1:
            from mpi4py import MPI

            request = self.group.comm.Iallreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
        return (request, flat, tensors)

    def finish(self, handle: Any) -> None:
        request, flat, tensors = handle
        if request is not None:
            request.Wait()
        total = flat.size - 1
        scale = 1.0 / flat[total] if flat[total] > 0 else 0.0
        offset = 0
        for t in tensors:
            t.set((flat[offset:offset + t.size] * scale).reshape(t.shape))
            offset += t.size

    def allreduce_weighted(self, tensors: list[SharedTensor], weight: float) -> None:
        # a staging buffer per size, apart from the buckets' (keys >= 0)
        self.finish(self.start(-1 - sum(t.size for t in tensors), tensors, weight))


class NcclTransport(Transport):
    """NCCL all-reduce on the GPU (CuPy's NCCL bindings), its unique id broadcast from rank 0 over MPI.

    :meth:`start` runs a bucket's sum on a stream of its own, after an event that marks the bucket's gradients
    complete on the backend's stream, so the rest of the backward pass runs while NCCL sums; :meth:`finish` makes
    the backend's stream wait for the sum (no host synchronisation)."""

    name = "nccl"
    overlaps = True
    capturable = True  # NCCL's collectives may be captured in CUDA graphs (NCCL >= 2.9)

    def __init__(self, backend: Backend, group: ProcessGroup) -> None:
        try:
            import cupy
            from cupy.cuda import nccl
        except ImportError as e:
            raise BackendUnavailable(f"distributed: NCCL is not available through CuPy ({e}); install "
                                     "nvidia-nccl-cu12 (or -cu13) or use the MPI transport") from e
        self.cupy, self.nccl = cupy, nccl
        self.backend = backend
        self.group = group
        uid = np.frombuffer(bytes(nccl.get_unique_id()), np.uint8).copy() if group.is_root else \
            np.zeros(len(bytes(nccl.get_unique_id())), np.uint8)
        group.broadcast_(uid)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        self.comm = nccl.NcclCommunicator(group.size, uid.tobytes(), group.rank)
        self._flat: dict[int, Any] = {}
        self._side = cupy.cuda.Stream(non_blocking=True)

    def _sum(self, key: int, tensors: list[SharedTensor], weight: float, stream: Any) -> None:
        """Enqueue on ``stream``: pack the weighted gradients into the key's flat buffer (the weight in its last
        slot), all-reduce it, and unpack sum / (sum of weights) into the gradients."""
        cp, be = self.cupy, self.backend
        total = sum(t.size for t in tensors)
        flat = self._flat.get(key)
        if flat is None or flat.size != total + 2:
            # the bucket, the weight's slot, and a slot for 1 / (sum of weights): a step allocates nothing, so a
            # captured step's memory is its own
            flat = self._flat[key] = cp.empty(total + 2, cp.float32)
        bufs = [be.flat(t.read_write(be)) for t in tensors]  # type: ignore[attr-defined]  # (CudaBackend)
        with stream:
            offset = 0
            for b in bufs:
                cp.multiply(b, weight, out=flat[offset:offset + b.size])
                offset += b.size
            flat[total] = weight
            self.comm.allReduce(flat.data.ptr, flat.data.ptr, total + 1, self.nccl.NCCL_FLOAT32,
                                self.nccl.NCCL_SUM, stream.ptr)
            scale = flat[total + 1:]  # a device scalar: nothing comes back to the host
            cp.reciprocal(flat[total:total + 1], out=scale)
            offset = 0
            for b in bufs:
                cp.multiply(flat[offset:offset + b.size], scale, out=b)
                offset += b.size

    def start(self, key: int, tensors: list[SharedTensor], weight: float) -> Any:
        cp = self.cupy
        ready = cp.cuda.get_current_stream().record()  # the bucket's gradients are complete here
        self._side.wait_event(ready)
        self._sum(key, tensors, weight, self._side)
        return self._side.record()

    def finish(self, handle: Any) -> None:
        self.cupy.cuda.get_current_stream().wait_event(handle)

    def allreduce_weighted(self, tensors: list[SharedTensor], weight: float) -> None:
        # a flat buffer per size, apart from the buckets' (keys >= 0)
        self._sum(-1 - sum(t.size for t in tensors), tensors, weight, self.cupy.cuda.get_current_stream())


def default_transport(backend: Backend, group: ProcessGroup) -> Transport:
    """NCCL for a cuda backend where CuPy has it (``LEAFPY_TRANSPORT=mpi`` forces MPI), MPI otherwise."""
    if backend.name == "cuda" and os.environ.get("LEAFPY_TRANSPORT", "") != "mpi":
        try:
            return NcclTransport(backend, group)
        except BackendUnavailable:
            pass
    return HostTransport(group)
