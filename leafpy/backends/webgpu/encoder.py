"""The webgpu backend's command stream: one command encoder and compute pass per step, compute pipelines and
uniform buffers and bind groups cached, the pending GEMM whose store a bias or activation may join, the recorded
steps' hooks (first_run / capture / launch / handle) and per-dispatch GPU timing."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...errors import BackendError
from .. import pointwise
from ..base import Backend
from ..recorder import StepRecorder
from .sources import module_source
from .view import WView

WG = 256


def _workgroup_each(count: int) -> tuple[int, int, int]:
    """A grid of one workgroup per item: item x + 65535 * y (a dimension holds at most 65535 workgroups)."""
    gx = min(count, 65535)
    return gx, -(-count // gx), 1


class Encoder(Backend):
    """Recording dispatches into the step's command buffer and submitting it (the state is set up by
    WebGPUBackend.__init__)."""

    wgpu: Any
    device: Any
    queue: Any
    adapter_name: str
    max_groups: int
    can_profile: bool
    recorder: StepRecorder
    allocations: int
    dispatches: int
    submissions: int
    kernel_times: dict | None
    _modules: dict
    sources: dict  # module -> its WGSL source
    lanes: str  # the WGSL of reduce_workgroup this device's reductions are built with (lanes*.wgsl)
    subgroups: bool
    _pipelines: dict
    _uniforms: dict
    _bind_groups: dict
    _encoder: Any
    _pass: Any
    _pass_pipeline: Any
    _pending: dict | None
    _pending_sum: dict | None
    _recording: list | None
    _stamps: list
    _query_set: Any
    _resolve: Any
    _stamp_read: Any
    max_binding: int
    tracer: Any = None
    """While set (leafpy.web's plan recorder): told of every dispatch encoded, upload and download, so that a
    forward pass can be written down as data and replayed elsewhere (leafpy.js) on the same kernels."""

    # --- profiling ----------------------------------------------------------------------------------------------
    PROFILE_PASSES = 2048  # two timestamps each; a query set holds at most 4096
    """Timed dispatches per command buffer while profiling (a step with more is submitted in parts)."""

    def profile(self, on: bool = True) -> None:
        """Time every dispatch on the GPU (each in its own compute pass, with timestamp queries) and add the times
        to :attr:`kernel_times` by entry point; for finding where a step's GPU time goes, not for training."""
        if on and not self.can_profile:
            raise BackendError(f"webgpu: {self.adapter_name} does not offer timestamp queries")
        self.flush()
        self.kernel_times = {} if on else None
        if on and self._query_set is None:
            u = self.wgpu.BufferUsage
            n = 2 * self.PROFILE_PASSES
            self._query_set = self.device.create_query_set(type="timestamp", count=n)
            self._resolve = self.device.create_buffer(size=8 * n, usage=u.QUERY_RESOLVE | u.COPY_SRC)
            self._stamp_read = self.device.create_buffer(size=8 * n, usage=u.MAP_READ | u.COPY_DST)

    def _timed_pass(self, label: str) -> None:
        """While profiling: end the current pass and begin one whose start and end are timestamped."""
        if len(self._stamps) == self.PROFILE_PASSES:
            self.flush()
            self._encoder = self.device.create_command_encoder()
        elif self._pass is not None:
            self._pass.end()
        i = len(self._stamps)
        self._stamps.append(label)
        self._pass = self._encoder.begin_compute_pass(timestamp_writes={
            "query_set": self._query_set, "beginning_of_pass_write_index": 2 * i,
            "end_of_pass_write_index": 2 * i + 1})

    def _collect_stamps(self) -> None:
        n = len(self._stamps)
        self._stamp_read.map_sync(self.wgpu.MapMode.READ, 0, 16 * n)
        try:
            ticks = np.frombuffer(self._stamp_read.read_mapped(0, 16 * n, copy=True), dtype=np.uint64)
        finally:
            self._stamp_read.unmap()
        period = self.queue.get_timestamp_period() if hasattr(self.queue, "get_timestamp_period") else 1.0
        for label, t0, t1 in zip(self._stamps, ticks[0::2], ticks[1::2]):
            entry = self.kernel_times.setdefault(label, [0.0, 0])  # type: ignore[union-attr]
            entry[0] += float(t1 - t0) * period * 1e-9 if t1 > t0 else 0.0
            entry[1] += 1
        self._stamps = []

    replay = True
    """Replay replayable training steps from their recorded dispatches (see :meth:`run_step`)."""
    MAX_RECORDED_STEPS = 8

    def run_step(self, key: Any, step: Any) -> None:
        """A training step is encoded into one command buffer and submitted once. A replayable step (``key`` not
        None) is recorded on its second sight as the list of its dispatches (pipeline, bind group, grid) and from
        then on encoded straight from that list, without running the layers' Python, while the tensors it touches
        keep their buffers (see recorder.StepRecorder)."""
        if not self.replay or self.kernel_times is not None:
            key = None
        self.recorder.run(key, step)
        self.flush()

    @property
    def replays(self) -> int:
        """Steps encoded from a recording so far."""
        return self.recorder.replays

    def first_run(self, entry: Any, step: Any) -> None:
        step()

    def capture(self, entry: Any, step: Any) -> tuple[Any, bool]:
        self.flush()  # work queued before the step is submitted: a capture that fails leaves nothing half-encoded
        allocations, submissions = self.allocations, self.submissions
        self._recording = []
        try:
            step()
            self._emit_pending()
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
        self._emit_pending()
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

    def flush(self) -> None:
        """Submit the recorded dispatches (one command buffer)."""
        self._emit_pending()
        if self._encoder is None:
            return
        if self._pass is not None:
            self._pass.end()
        stamps = len(self._stamps)
        if stamps:
            self._encoder.resolve_query_set(self._query_set, 0, 2 * stamps, self._resolve, 0)
            self._encoder.copy_buffer_to_buffer(self._resolve, 0, self._stamp_read, 0, 16 * stamps)
        self.queue.submit([self._encoder.finish()])
        self.submissions += 1
        self._encoder = self._pass = None
        if stamps:
            self._collect_stamps()

    # --- dispatch machinery -------------------------------------------------------------------------------------
    def _shader(self, module: str) -> Any:
        """Shader module ``module`` compiled on this device (its WGSL from sources.module_source)."""
        return self.device.create_shader_module(code=module_source(module, self.subgroups))

    def _pipeline(self, module: str, entry: str, constants: tuple = ()) -> Any:
        """The compute pipeline of an entry point, specialised by pipeline-overridable ``constants`` (name, value)
        pairs: a GEMM operand's transpose, a convolution's or pooling's geometry (divisions by constants are cheap);
        sizes that only bound loops travel in uniforms."""
        key = (module, entry, constants)
        p = self._pipelines.get(key)
        if p is None:
            stage = {"module": self._modules[module], "entry_point": entry}
            if constants:
                stage["constants"] = dict(constants)
            p = self.device.create_compute_pipeline(layout="auto", compute=stage)
            self._pipelines[key] = p
        return p

    def _uniform(self, data: bytes) -> Any:
        buf = self._uniforms.get(data)
        if buf is None:
            if len(self._uniforms) > 8192:  # per-step scalars (Adam's rate) must not grow this forever
                self.flush()
                self._uniforms.clear()
                self._bind_groups.clear()
            u = self.wgpu.BufferUsage
            buf = self.device.create_buffer_with_data(data=data, usage=u.UNIFORM)
            self._uniforms[data] = buf
        return buf

    def _dispatch(self, module: str, entry: str, params: bytes, buffers: list, groups: tuple[int, int, int],
                  ranges: list | None = None, constants: tuple = ()) -> None:
        self._emit_pending()
        self._encode(module, entry, params, buffers, groups, ranges, constants)
        self.dispatches += 1

    def _encode(self, module: str, entry: str, params: bytes, buffers: list, groups: tuple[int, int, int],
                ranges: list | None = None, constants: tuple = ()) -> None:
        if self.tracer is not None:
            self.tracer.dispatch(module, entry, params, buffers, groups, ranges, constants)
        pipe = self._pipeline(module, entry, constants)
        ubuf = self._uniform(params)
        raws = tuple(b.raw for b in buffers)
        key = (pipe, ubuf, raws, tuple(ranges) if ranges else None)  # wgpu objects hash by identity
        cached = self._bind_groups.get(key)
        if cached is None:
            entries = [(0, ubuf, 0, ubuf.size)]
            for i, raw in enumerate(raws):
                off, size = ranges[i] if ranges and ranges[i] is not None else (0, raw.size)
                if size > self.max_binding:
                    raise BackendError(f"webgpu: {entry} would bind a buffer of {size} bytes (its operand {i}), over "
                                       f"this device's storage binding limit of {self.max_binding} bytes; a smaller "
                                       "batch or a smaller layer (fewer rows, features or hidden units) fits, or run "
                                       "the network on the cuda or native backend")
                entries.append((i + 1, raw, off, size))
            bg = self.device.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
                {"binding": n, "resource": {"buffer": r, "offset": o, "size": sz}} for n, r, o, sz in entries])
            cached = self._bind_groups[key] = bg  # the key keeps its buffers alive while the group is cached
        self._begin()
        if self._recording is not None:
            self._recording.append((pipe, cached, groups))
        if self.kernel_times is not None:
            self._timed_pass(entry + "".join(f" {k}={v}" for k, v in constants))
            self._pass_pipeline = None
        if pipe is not self._pass_pipeline:  # consecutive dispatches of one kernel set it once
            self._pass.set_pipeline(pipe)
            self._pass_pipeline = pipe
        self._pass.set_bind_group(0, cached)
        self._pass.dispatch_workgroups(*groups)

    def _begin(self) -> None:
        """Open the step's command encoder and compute pass if none is open."""
        if self._encoder is None:
            self._encoder = self.device.create_command_encoder()
            self._pass = None if self.kernel_times is not None else self._encoder.begin_compute_pass()
            self._pass_pipeline = None

    def _defer(self, module: str, entry: str, params: bytes, operands: list, groups: tuple, consts: tuple,
               shape: tuple, out: WView) -> None:
        """Hold a dispatch that writes all of ``out`` (``shape``) until the next one, so that a bias add or an
        in-place ReLU on ``out`` can join its store (see :meth:`_fuse`)."""
        self._emit_pending()
        self._pending = {"module": module, "entry": entry, "params": params, "operands": operands,
                         "groups": groups, "consts": consts, "shape": shape, "out": out}
        self.dispatches += 1

    def _emit_pending(self) -> None:
        if self._pending is not None:
            g, self._pending = self._pending, None
            self._encode(g["module"], g["entry"], g["params"], g["operands"], g["groups"], constants=g["consts"])
        if self._pending_sum is not None:
            s, self._pending_sum = self._pending_sum, None
            self.dispatches -= 1  # counted when held; emit() counts what it dispatches
            s["emit"]()

    def _defer_sum(self, out: WView, partial: WView, slices: int, alpha: float, beta: float, emit: Any) -> None:
        """Hold the sum of a split-K product's partials (``emit`` dispatches it) until the next dispatch, so that
        a recurrent cell reading ``out`` next can add the partials itself (see :meth:`_take_sum`)."""
        self._emit_pending()
        self._pending_sum = {"out": out, "partial": partial, "slices": slices, "alpha": alpha, "beta": beta,
                             "emit": emit}
        self.dispatches += 1

    def _take_sum(self, out: WView) -> dict | None:
        """The held split-K sum whose result is ``out`` (all of its buffer), taken over by the caller's kernel, which
        then stores ``alpha * sum of the partials + beta * out`` into ``out`` itself; None where there is none."""
        s = self._pending_sum
        if s is None or s["out"].raw is not out.raw or s["out"].size != out.size or \
                s["partial"].raw.size > self.max_binding:
            return None
        self._pending_sum = None
        self.dispatches -= 1
        return s

    def _fuse(self, out: WView, kind: str, bias: WView | None = None, params: tuple = (),
              into: WView | None = None) -> bool:
        """Join a bias add (``kind`` "bias") or an activation (a line of pointwise.TABLE) on ``out`` to the epilogue of
        the GEMM that is about to write all of ``out`` (recorded, not yet encoded), saving a dispatch and a pass over
        the product. The activation runs in place on ``out``, or (``into``) is stored into another buffer beside the
        product, which its gradient reads. False where it cannot: no such GEMM, another buffer, a bias already added
        or an activation already applied, (``into``) a Winograd transform or an operand of the GEMM, or a bias or
        ``into`` of another dtype than the product's (a GEMM module's Bias and ActOut have C's dtype)."""
        g = self._pending
        if g is None or out.raw is not g["out"].raw or out.size != math.prod(g["shape"]):
            return False
        consts = dict(g["consts"])
        gemm = g["module"].startswith("gemm")  # gemm.wgsl's modules (half.py's too): the store takes a bias
        if "ACT" in consts or (kind == "bias" and ("HAS_BIAS" in consts or not gemm)):
            return False
        if any(v is not None and v.dtype != g["out"].dtype for v in (bias, into)):
            return False
        if kind == "bias":
            # the store adds Bias[column], or Bias[row] where it writes a convolution's channels (C_MODE 1)
            if bias is None or bias.size != g["shape"][1 if consts.get("C_MODE", 0) == 0 else 0]:
                return False
            g["operands"][3] = bias
            g["consts"] += (("HAS_BIAS", 1),)
        elif into is not None:
            if (not gemm or into.size != out.size
                    or any(into.raw is operand.raw for operand in g["operands"][:4])):
                return False
            g["operands"][4] = into
            g["consts"] += pointwise.epilogue_constants(kind, params) + (("ACT_OUT", 1),)
        else:
            g["consts"] += pointwise.epilogue_constants(kind, params)
        return True

    def _grid(self, n: int) -> tuple[int, int, int]:
        groups = max(1, -(-n // WG))
        x = min(groups, self.max_groups)
        return x, -(-groups // x), 1
