"""The webgpu backend's command stream: one command encoder and compute pass per step, into which each kernel
family's :class:`Dispatch` records are encoded (pipelines, uniforms and bind groups from the device part's caches);
the held GEMM whose store a bias or activation may join, and the held split-K sum a recurrent cell may take over;
the recorded steps' hooks (first_run / capture / launch / handle, which the backend hands recorder.StepRecorder as
its own); per-dispatch GPU timing. Uses the device part only."""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np

from ...errors import BackendError
from .. import pointwise
from .device import Device
from .view import WView

WG = 256
"""Threads per workgroup of the elementwise kernels (a thread per element)."""

_raw = attrgetter("raw")


class Dispatch(NamedTuple):
    """One kernel launch as data: which WGSL module and entry point (specialised by pipeline ``constants``), the
    packed parameter struct, the bound buffers (binding 1, 2, ... after the uniform at 0) with their (byte offset,
    size) ranges (None: whole), and the workgroup grid. Every kernel family speaks to the encoder in these; the
    browser export (leafpy.web.plan) writes them down."""

    module: str
    entry: str
    params: bytes
    buffers: list
    grid: tuple[int, int, int]
    ranges: list | None = None
    constants: tuple = ()


def workgroup_each(count: int) -> tuple[int, int, int]:
    """A grid of one workgroup per item: item x + 65535 * y (a dimension holds at most 65535 workgroups)."""
    gx = min(count, 65535)
    return gx, -(-count // gx), 1


class Encoder:
    """Recording dispatches into the step's command buffer and submitting it."""

    PROFILE_PASSES = 2048  # two timestamps each; a query set holds at most 4096
    """Timed dispatches per command buffer while profiling (a step with more is submitted in parts)."""
    UNIFORMS = 8192
    """Cached uniform buffers at most: per-step scalars (Adam's rate) must not grow the cache forever."""

    tracer: Any = None
    """While set (leafpy.web's plan recorder): told of every dispatch encoded (its :class:`Dispatch`), upload and
    download, so that a forward pass can be written down as data and replayed elsewhere (leafpy.js) on the same
    kernels."""

    def __init__(self, gpu: Device) -> None:
        self.gpu = gpu
        self.allocations = 0  # counted by the allocator: a step that allocates while captured is never replayed
        self.dispatches = 0
        self.submissions = 0
        self.kernel_times: dict | None = None  # entry point -> [GPU seconds, dispatches] while profiling
        self._encoder: Any = None
        self._pass: Any = None
        self._pass_pipeline: Any = None
        self._pending: tuple[Dispatch, tuple, WView] | None = None  # a GEMM not yet encoded, its C shape and C
        self._pending_sum: dict | None = None  # a split-K product's sum, not yet encoded: a recurrent cell may do it
        self._recording: list | None = None  # (pipeline, bind group, grid) of each dispatch while recording
        self._stamps: list = []  # entry points of this command buffer's timed passes
        self._query_set: Any = None
        self._resolve: Any = None
        self._stamp_read: Any = None

    # --- dispatching ----------------------------------------------------------------------------------------
    def dispatch(self, module: str, entry: str, params: bytes, buffers: list, grid: tuple[int, int, int],
                 ranges: list | None = None, constants: tuple = ()) -> None:
        """Encode the :class:`Dispatch` of these fields, after any held one."""
        if self._pending is not None or self._pending_sum is not None:
            self.emit_pending()
        self._encode(Dispatch(module, entry, params, buffers, grid, ranges, constants))
        self.dispatches += 1

    def _encode(self, d: Dispatch) -> None:
        gpu = self.gpu
        if self.tracer is not None:
            self.tracer.dispatch(d)
        pipe = gpu.pipelines.get((d.module, d.entry, d.constants)) or gpu.pipeline(d.module, d.entry, d.constants)
        ubuf = gpu.uniforms.get(d.params) or self._uniform(d.params)
        key = (pipe, ubuf, tuple(map(_raw, d.buffers)), tuple(d.ranges) if d.ranges else None)
        group = gpu.bind_groups.get(key) or gpu.bind_group(key, d.entry)  # wgpu objects hash by identity
        if self._encoder is None:
            self._begin()
        if self._recording is not None:
            self._recording.append((pipe, group, d.grid))
        if self.kernel_times is not None:
            self._timed_pass(d.entry + "".join(f" {k}={v}" for k, v in d.constants))
            self._pass_pipeline = None
        if pipe is not self._pass_pipeline:  # consecutive dispatches of one kernel set it once
            self._pass.set_pipeline(pipe)
            self._pass_pipeline = pipe
        self._pass.set_bind_group(0, group)
        self._pass.dispatch_workgroups(*d.grid)

    def _uniform(self, data: bytes) -> Any:
        if len(self.gpu.uniforms) > self.UNIFORMS:
            self.flush()  # the work that binds them is submitted before they go
            self.gpu.forget_bindings()
        return self.gpu.uniform(data)

    def _begin(self) -> None:
        """Open the step's command encoder and compute pass."""
        self._encoder = self.gpu.device.create_command_encoder()
        self._pass = None if self.kernel_times is not None else self._encoder.begin_compute_pass()
        self._pass_pipeline = None

    def grid(self, n: int) -> tuple[int, int, int]:
        """The 2-D grid of one thread per element over ``n`` elements, under the per-dimension workgroup limit."""
        groups = max(1, -(-n // WG))
        x = min(groups, self.gpu.max_groups)
        return x, -(-groups // x), 1

    def flush(self) -> None:
        """Submit the recorded dispatches (one command buffer)."""
        if self._pending is not None or self._pending_sum is not None:
            self.emit_pending()
        if self._encoder is None:
            return
        if self._pass is not None:
            self._pass.end()
        stamps = len(self._stamps)
        if stamps:
            self._encoder.resolve_query_set(self._query_set, 0, 2 * stamps, self._resolve, 0)
            self._encoder.copy_buffer_to_buffer(self._resolve, 0, self._stamp_read, 0, 16 * stamps)
        self.gpu.queue.submit([self._encoder.finish()])
        self.submissions += 1
        self._encoder = self._pass = None
        if stamps:
            self._collect_stamps()

    # --- held dispatches: a GEMM's store that a bias or activation joins, a split-K sum a cell takes over ----------
    def defer(self, d: Dispatch, shape: tuple, out: WView) -> None:
        """Hold a dispatch that writes all of ``out`` (``shape``) until the next one, so that a bias add or an
        in-place ReLU on ``out`` can join its store (see :meth:`fuse`)."""
        if self._pending is not None or self._pending_sum is not None:
            self.emit_pending()
        self._pending = (d, shape, out)
        self.dispatches += 1

    def emit_pending(self) -> None:
        """Encode the held dispatches."""
        if self._pending is not None:
            d, self._pending = self._pending[0], None
            self._encode(d)
        if self._pending_sum is not None:
            s, self._pending_sum = self._pending_sum, None
            self.dispatches -= 1  # counted when held; emit() counts what it dispatches
            s["emit"]()

    def defer_sum(self, out: WView, partial: WView, slices: int, alpha: float, beta: float, emit: Any) -> None:
        """Hold the sum of a split-K product's partials (``emit`` dispatches it) until the next dispatch, so that
        a recurrent cell reading ``out`` next can add the partials itself (see :meth:`take_sum`)."""
        if self._pending is not None or self._pending_sum is not None:
            self.emit_pending()
        self._pending_sum = {"out": out, "partial": partial, "slices": slices, "alpha": alpha, "beta": beta,
                             "emit": emit}
        self.dispatches += 1

    def take_sum(self, out: WView) -> dict | None:
        """The held split-K sum whose result is ``out`` (all of its buffer), taken over by the caller's kernel, which
        then stores ``alpha * sum of the partials + beta * out`` into ``out`` itself; None where there is none."""
        s = self._pending_sum
        if s is None or s["out"].raw is not out.raw or s["out"].size != out.size or \
                s["partial"].raw.size > self.gpu.max_binding:
            return None
        self._pending_sum = None
        self.dispatches -= 1
        return s

    def fuse(self, out: WView, kind: str, bias: WView | None = None, params: tuple = (),
             into: WView | None = None) -> bool:
        """Join a bias add (``kind`` "bias") or an activation (a line of pointwise.TABLE) on ``out`` to the epilogue of
        the GEMM that is about to write all of ``out`` (held, not yet encoded), saving a dispatch and a pass over
        the product. The activation runs in place on ``out``, or (``into``) is stored into another buffer beside the
        product, which its gradient reads. False where it cannot: no such GEMM, another buffer, a bias already added
        or an activation already applied, (``into``) a Winograd transform or an operand of the GEMM, or a bias or
        ``into`` of another dtype than the product's (a GEMM module's Bias and ActOut have C's dtype)."""
        if self._pending is None:
            return False
        g, shape, held = self._pending
        if out.raw is not held.raw or out.size != math.prod(shape):
            return False
        consts = dict(g.constants)
        gemm = g.module.startswith("gemm")  # gemm.wgsl's modules (float16 builds too): the store takes a bias
        if "ACT" in consts or (kind == "bias" and ("HAS_BIAS" in consts or not gemm)):
            return False
        if (bias is not None and bias.dtype != held.dtype) or (into is not None and into.dtype != held.dtype):
            return False
        if kind == "bias":
            # the store adds Bias[column], or Bias[row] where it writes a convolution's channels (C_MODE 1)
            if bias is None or bias.size != shape[1 if consts.get("C_MODE", 0) == 0 else 0]:
                return False
            g.buffers[3] = bias
            added: tuple = (("HAS_BIAS", 1),)
        elif into is not None:
            if not gemm or into.size != out.size or any(into.raw is operand.raw for operand in g.buffers[:4]):
                return False
            g.buffers[4] = into
            added = pointwise.epilogue_constants(kind, params) + (("ACT_OUT", 1),)
        else:
            added = pointwise.epilogue_constants(kind, params)
        self._pending = (g._replace(constants=g.constants + added), shape, held)
        return True

    # --- recorded steps: the hooks recorder.StepRecorder calls (the backend binds them as its own) ----------------
    def first_run(self, entry: Any, step: Any) -> None:
        step()

    def capture(self, entry: Any, step: Any) -> tuple[Any, bool]:
        self.flush()  # work queued before the step is submitted: a capture that fails leaves nothing half-encoded
        allocations, submissions = self.allocations, self.submissions
        self._recording = []
        try:
            step()
            self.emit_pending()
        except BaseException:
            # the dispatches this attempt encoded must not run: the recorder runs the step again as it is
            self._encoder = self._pass = self._pass_pipeline = None
            self._pending = self._pending_sum = None
            self._stamps = []
            raise
        finally:
            items, self._recording = self._recording, None
        if self.allocations != allocations or self.submissions != submissions:
            return None, True  # it allocated or submitted midway: its buffers are not fixed, so never replay it
        return items, True

    def launch(self, recording: Any) -> None:
        self.emit_pending()
        if self._encoder is None:
            self._begin()
        for pipe, group, grid in recording:
            if pipe is not self._pass_pipeline:
                self._pass.set_pipeline(pipe)
                self._pass_pipeline = pipe
            self._pass.set_bind_group(0, group)
            self._pass.dispatch_workgroups(*grid)
        self.dispatches += len(recording)

    @staticmethod
    def handle(buffer: Any) -> Any:
        return buffer.raw

    # --- profiling ----------------------------------------------------------------------------------------------
    def profile(self, on: bool = True) -> None:
        """Time every dispatch on the GPU (each in its own compute pass, with timestamp queries) and add the times
        to :attr:`kernel_times` by entry point; for finding where a step's GPU time goes, not for training."""
        if on and not self.gpu.can_profile:
            raise BackendError(f"webgpu: {self.gpu.adapter_name} does not offer timestamp queries")
        self.flush()
        self.kernel_times = {} if on else None
        if on and self._query_set is None:
            u = self.gpu.wgpu.BufferUsage
            n = 2 * self.PROFILE_PASSES
            self._query_set = self.gpu.device.create_query_set(type="timestamp", count=n)
            self._resolve = self.gpu.device.create_buffer(size=8 * n, usage=u.QUERY_RESOLVE | u.COPY_SRC)
            self._stamp_read = self.gpu.device.create_buffer(size=8 * n, usage=u.MAP_READ | u.COPY_DST)

    def _timed_pass(self, label: str) -> None:
        """While profiling: end the current pass and begin one whose start and end are timestamped."""
        if len(self._stamps) == self.PROFILE_PASSES:
            self.flush()
            self._encoder = self.gpu.device.create_command_encoder()
        elif self._pass is not None:
            self._pass.end()
        i = len(self._stamps)
        self._stamps.append(label)
        self._pass = self._encoder.begin_compute_pass(timestamp_writes={
            "query_set": self._query_set, "beginning_of_pass_write_index": 2 * i,
            "end_of_pass_write_index": 2 * i + 1})

    def _collect_stamps(self) -> None:
        n = len(self._stamps)
        self._stamp_read.map_sync(self.gpu.wgpu.MapMode.READ, 0, 16 * n)
        try:
            ticks = np.frombuffer(self._stamp_read.read_mapped(0, 16 * n, copy=True), dtype=np.uint64)
        finally:
            self._stamp_read.unmap()
        queue = self.gpu.queue
        period = queue.get_timestamp_period() if hasattr(queue, "get_timestamp_period") else 1.0
        for label, t0, t1 in zip(self._stamps, ticks[0::2], ticks[1::2]):
            entry = self.kernel_times.setdefault(label, [0.0, 0])  # type: ignore[union-attr]
            entry[0] += float(t1 - t0) * period * 1e-9 if t1 > t0 else 0.0
            entry[1] += 1
        self._stamps = []
