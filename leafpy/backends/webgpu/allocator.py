"""The webgpu backend's memory: allocation from a pool of buffers by size, uploads, downloads through one reused
MAP_READ staging buffer, and scratch buffers kept per use. Uses the device part, the encoder (a transfer submits
the work queued before it) and the backend's step recorder (a scratch buffer that grows invalidates recordings).

Buffers hold 4-byte elements (float32, and integers such as dropout's seed) or, on a device opened with the
shader-f16 feature, float16; WebGPU copies and buffer sizes are 4-byte multiples, so a float16 buffer of an odd
length is padded by one element and its transfers move the padded byte count."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ...errors import BackendError
from ..recorder import StepRecorder
from .device import Device
from .encoder import Encoder
from .view import WView, pad4

F16 = np.dtype(np.float16)


class Allocator:
    """Allocation, transfers and scratch (the backend's memory contract)."""

    def __init__(self, gpu: Device, enc: Encoder, recorder: StepRecorder) -> None:
        self.gpu = gpu
        self.enc = enc
        self.recorder = recorder
        self.free: dict[int, list] = {}  # buffer pool: byte size -> buffers no tensor holds
        self.scratches: dict[str, WView] = {}  # tag -> the scratch buffer of that use
        self._staging: Any = None

    def allocate(self, size: int, dtype: Any) -> WView:
        dtype = np.dtype(dtype)
        if dtype == F16:
            if not self.gpu.has_f16:
                raise BackendError(f"webgpu: float16 buffers need the adapter's shader-f16 feature, which this device "
                                   f"was not opened with; use lp.backend('webgpu', precision='fp16') on an adapter "
                                   f"that offers it (this one: {self.gpu.adapter_name})")
        elif dtype.itemsize != 4:
            raise BackendError(f"webgpu: buffers hold 4-byte elements or float16, got {dtype}")
        nbytes = pad4(size * dtype.itemsize)  # WebGPU buffers: non-empty, 4-byte multiples
        self.enc.allocations += 1
        free = self.free.get(nbytes)
        if free:
            raw = free.pop()
        else:
            u = self.gpu.wgpu.BufferUsage
            raw = self.gpu.device.create_buffer(size=nbytes, usage=u.STORAGE | u.COPY_SRC | u.COPY_DST)
        view = WView(raw, (size,), dtype)
        # when the tensor that owns this buffer lets it go, the buffer returns to the pool for its size (work
        # still recorded against it runs before any later use, as dispatches execute in order)
        weakref.finalize(view, self.free.setdefault(nbytes, []).append, raw)
        return view

    def upload(self, host: np.ndarray, out: Any) -> None:
        self.enc.flush()  # a queued write lands before unsubmitted work: submit that work first
        data = np.ascontiguousarray(host, dtype=out.dtype).tobytes()
        if self.enc.tracer is not None:
            self.enc.tracer.upload(data, out)
        if data:  # write_buffer moves 4-byte multiples: an odd float16 count takes one padding element along
            self.gpu.queue.write_buffer(out.raw, 0, data + bytes(-len(data) % 4))

    def download(self, buf: Any, host: np.ndarray) -> None:
        nbytes = -(-buf.size * buf.dtype.itemsize // 4) * 4
        if nbytes == 0:
            return
        if self.enc.tracer is not None:
            self.enc.tracer.download(buf)
        self.enc.flush()
        gpu = self.gpu
        if self._staging is None or self._staging.size < nbytes:
            size = max(nbytes, 1 << 16)
            self._staging = gpu.device.create_buffer(size=size, usage=gpu.wgpu.BufferUsage.MAP_READ |
                                                     gpu.wgpu.BufferUsage.COPY_DST)
        enc = gpu.device.create_command_encoder()
        enc.copy_buffer_to_buffer(buf.raw, 0, self._staging, 0, nbytes)
        gpu.queue.submit([enc.finish()])
        self.enc.submissions += 1
        # wgpu-py's on_submitted_work_done is unreliable: mapping waits for the copy
        self._staging.map_sync(gpu.wgpu.MapMode.READ, 0, nbytes)
        try:
            data = self._staging.read_mapped(0, nbytes, copy=True)
        finally:
            self._staging.unmap()
        host.reshape(-1)[...] = np.frombuffer(data, dtype=buf.dtype, count=buf.size)

    def view(self, buf: Any, shape: tuple[int, ...]) -> WView:
        return WView(buf.raw, shape, buf.dtype, buf.owner or buf)

    def synchronize(self) -> None:
        self.enc.flush()
        # a tiny read waits for everything submitted before it
        probe = self.scratch(1, "sync")
        self.download(probe, np.empty(1, np.float32))

    def scratch(self, size: int, tag: str, dtype: Any = np.float32) -> WView:
        """A prefix of the one scratch buffer kept per use (``tag``), grown to the largest size asked for: the
        layers of a network share it (dispatches run in order), and a work-in-progress value never outlives the
        primitive that wrote it. ``dtype`` float16: ``size`` float16 elements in that buffer's first bytes."""
        if dtype is not np.float32 and np.dtype(dtype) == F16:
            words = self.scratch(-(-size // 2), tag)
            return WView(words.raw, (size,), F16, words.owner or words)
        b = self.scratches.get(tag)
        if b is None or b.size < size:
            if b is not None:
                # recorded steps bind the old buffer, which returns to the pool for other tensors: forget them
                self.recorder.forget()
            b = self.scratches[tag] = self.allocate(size, np.float32)
        return b if b.size == size else WView(b.raw, (size,), b.dtype, b.owner or b)
