"""Host-to-device copies that overlap the step: a batch is copied into pinned (page-locked) host memory, sent to a
device staging buffer on a copy stream of its own, and moved into its destination on the stream that runs the
step, after that stream's earlier work. The step still queued on the GPU (the previous batch's) keeps running
while the next batch travels; a copy from pageable memory would wait for it first, then stop the GPU while it
copies. The destination is written in stream order, so a recorded step that reads it replays unchanged."""

from __future__ import annotations

from typing import Any

import numpy as np

_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


class _Slot:
    """One pinned buffer and one device buffer of ``nbytes``, with the events that say when each is free again."""

    def __init__(self, cp: Any, nbytes: int) -> None:
        import cupyx

        self.pinned = cupyx.empty_pinned(nbytes, np.uint8)
        self.device = cp.empty(nbytes, np.uint8)
        self.copied = cp.cuda.Event(disable_timing=True)  # the pinned buffer has reached the device buffer
        self.moved = cp.cuda.Event(disable_timing=True)  # the device buffer has reached its destination
        self.used = False


class PinnedStaging:
    """Uploads through :data:`SLOTS` alternating pinned and device buffers (grown to the largest batch seen)."""

    SLOTS = 2

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.slots: list[_Slot | None] = [None] * self.SLOTS
        self.turn = 0

    def _slot(self, nbytes: int) -> _Slot:
        i, self.turn = self.turn, (self.turn + 1) % self.SLOTS
        slot = self.slots[i]
        if slot is not None and slot.used:
            slot.copied.synchronize()  # the host may overwrite the pinned buffer once its last copy has left it
            self.stream.wait_event(slot.moved)  # and the device buffer once its last batch has moved on
        if slot is None or slot.pinned.nbytes < nbytes:
            if slot is not None:
                slot.moved.synchronize()
            slot = self.slots[i] = _Slot(self.cp, nbytes)
        return slot

    def upload(self, host: np.ndarray, out: Any) -> None:
        """``out`` (a C-contiguous device array of host's dtype and size) = ``host``, in the current stream's order."""
        cp = self.cp
        n = host.nbytes
        slot = self._slot(n)
        np.copyto(slot.pinned[:n], host.reshape(-1).view(np.uint8))
        slot.device[:n].set(slot.pinned[:n], stream=self.stream)
        slot.copied.record(self.stream)
        step = cp.cuda.get_current_stream()
        step.wait_event(slot.copied)
        cp.cuda.runtime.memcpyAsync(out.data.ptr, slot.device.data.ptr, n, _DEVICE_TO_DEVICE, step.ptr)
        slot.moved.record(step)
        slot.used = True
