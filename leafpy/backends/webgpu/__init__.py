"""The webgpu backend: WGSL compute shaders through wgpu-py, on any GPU WebGPU reaches (Vulkan, Metal, DX12).

How it stays fast: every dispatch is recorded into one command encoder (one compute pass) that is submitted once
per training step, or earlier when the host needs data (a download) or new data goes up (an upload), so a step has
no readback inside it; pipelines are cached per entry point, with sizes in uniform buffers (cached by content);
bind groups are cached; buffers are pooled by size and padded to 4 bytes; reads go through one reused MAP_READ
staging buffer; elementwise work larger than the device's storage-binding limit is split into bindable pieces, and
large launches use a 2-D grid to stay under the per-dimension workgroup limit.

Importing this module does not import wgpu; constructing the backend does.
"""

from __future__ import annotations

import functools
import math
import struct
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import BackendError, BackendUnavailable, ConfigError
from .. import pointwise
from ..array import DROPOUT_KEY_MULTIPLIER, dropout_threshold
from ..base import Backend
from ..recorder import StepRecorder

_HERE = Path(__file__).parent
_MODULES = ("elementwise", "update", "reduce", "classes", "gemm", "conv", "pool", "winograd", "batchnorm", "lrn")
_WINDOWED = ("gemm", "conv", "pool", "winograd")  # modules that include window.wgsl
WG = 256


class WView:
    """A WebGPU buffer seen with a shape (the webgpu backend's array type)."""

    __slots__ = ("raw", "shape", "dtype", "owner", "__weakref__")

    def __init__(self, raw: Any, shape: tuple[int, ...], dtype: np.dtype, owner: WView | None = None) -> None:
        self.raw = raw
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.owner = owner  # the allocation this view was made from: alive while any view of it is

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: slice) -> WView:
        """A prefix of a flat buffer (``buf[:n]``), the only slicing SharedTensor needs."""
        if not isinstance(index, slice) or index.start not in (None, 0) or index.step not in (None, 1):
            raise BackendError("webgpu: a buffer view can only be cut to a prefix")
        return WView(self.raw, (min(index.stop, self.size),), self.dtype, self.owner or self)

    def reshape(self, *shape: Any) -> WView:
        dims = list(shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
        if -1 in dims:
            known = math.prod(d for d in dims if d != -1)
            dims[dims.index(-1)] = self.size // known if known else 0
        if math.prod(dims) != self.size:
            raise BackendError(f"webgpu: cannot view {self.shape} as {tuple(dims)}")
        return WView(self.raw, tuple(dims), self.dtype, self.owner or self)

    def __repr__(self) -> str:
        return f"WView(shape={self.shape}, dtype={self.dtype})"


@functools.lru_cache(maxsize=8192)
def _pack(u: tuple = (), f: tuple = ()) -> bytes:
    """Kernel parameters as the Params struct's bytes (memoised: a training step packs the same values each time)."""
    ints = list(u) + [0] * (12 - len(u))
    floats = list(f) + [0.0] * (8 - len(f))
    return struct.pack("<12I8f", *[int(v) & 0xFFFFFFFF for v in ints], *[float(v) for v in floats])


class WebGPUBackend(Backend):
    """WGSL compute shaders on one WebGPU adapter.

    ``power_preference``: "high-performance" or "low-power"; ``adapter``: a substring of the adapter's name to
    pick one explicitly (see :func:`adapters`).
    """

    name = "webgpu"

    def __init__(self, dtype: Any = np.float32, power_preference: str = "high-performance",
                 adapter: str | None = None) -> None:
        if np.dtype(dtype) != np.float32:
            raise ConfigError(f"backend 'webgpu': WGSL computes in float32 only, got dtype {np.dtype(dtype)}")
        if power_preference not in ("high-performance", "low-power"):
            raise ConfigError(f"backend 'webgpu': power_preference must be 'high-performance' or 'low-power', "
                              f"got {power_preference!r}")
        self.dtype = np.dtype(np.float32)
        try:
            import wgpu
        except ImportError as e:
            raise BackendUnavailable("backend 'webgpu' needs wgpu-py, which is not installed: "
                                     "pip install 'leafpy-dl[webgpu]'") from e
        self.wgpu = wgpu
        try:
            if adapter is not None:
                found = [a for a in wgpu.gpu.enumerate_adapters_sync() if adapter.lower() in _describe(a).lower()]
                if not found:
                    names = ", ".join(_describe(a) for a in wgpu.gpu.enumerate_adapters_sync()) or "none"
                    raise BackendUnavailable(f"backend 'webgpu': no adapter matches {adapter!r}; adapters: {names}")
                chosen = found[0]
            else:
                chosen = wgpu.gpu.request_adapter_sync(power_preference=power_preference)
        except BackendUnavailable:
            raise
        except Exception as e:
            raise BackendUnavailable(f"backend 'webgpu': no WebGPU adapter ({e}); on Linux install a Vulkan "
                                     "driver (e.g. Debian's mesa-vulkan-drivers and libvulkan1)") from e
        if chosen is None:
            raise BackendUnavailable("backend 'webgpu': no WebGPU adapter found; on Linux install a Vulkan driver "
                                     "(e.g. Debian's mesa-vulkan-drivers and libvulkan1)")
        self.adapter = chosen
        self.adapter_name = _describe(chosen)
        limits = chosen.limits
        want = {k: limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size",
                                       "max-compute-workgroup-storage-size") if k in limits}
        features = [f for f in ("timestamp-query",) if f in chosen.features]
        try:
            self.device = chosen.request_device_sync(required_limits=want, required_features=features)
        except Exception as e:
            raise BackendUnavailable(f"backend 'webgpu': could not open {self.adapter_name}: {e}") from e
        self.key = f"webgpu:{id(self.device):x}"
        lim = self.device.limits
        self.max_binding = int(lim["max-storage-buffer-binding-size"])
        self.max_groups = int(lim["max-compute-workgroups-per-dimension"])
        self.offset_align = int(lim["min-storage-buffer-offset-alignment"])
        self.queue = self.device.queue
        common = (_HERE / "params.wgsl").read_text()
        window = (_HERE / "window.wgsl").read_text()
        # the activations' entry points and the GEMM's epilogue are generated from their formulas (pointwise.TABLE)
        generated = {"elementwise": pointwise.wgsl_functions() + pointwise.wgsl_entry_points(),
                     "gemm": pointwise.wgsl_functions() + pointwise.wgsl_epilogue(),
                     "winograd": pointwise.wgsl_functions() + pointwise.wgsl_epilogue()}
        self._inplace = pointwise.wgsl_inplace()  # entry -> (output position, the input position it may overwrite)
        self._modules = {m: self.device.create_shader_module(
            code=common + (window if m in _WINDOWED else "") + (_HERE / f"{m}.wgsl").read_text() + generated.get(m, ""))
            for m in _MODULES}
        self._pipelines: dict = {}
        self._uniforms: dict = {}
        self._bind_groups: dict = {}
        self._scratch: dict = {}
        self._free: dict[int, list] = {}  # buffer pool: byte size -> buffers no tensor holds
        self._encoder: Any = None
        self._pending: dict | None = None  # the last GEMM, not yet encoded: a bias or activation may join its store
        self.recorder = StepRecorder(self, self.MAX_RECORDED_STEPS)
        self._recording: list | None = None  # (pipeline, bind group, grid) of each dispatch while recording
        self.allocations = 0
        self._pass: Any = None
        self._pass_pipeline: Any = None
        self._staging: Any = None
        self.dispatches = 0
        self.submissions = 0
        self.kernel_times: dict | None = None  # entry point -> [GPU seconds, dispatches] while profiling
        self._stamps: list = []  # entry points of this command buffer's timed passes
        self._query_set: Any = None
        self.can_profile = "timestamp-query" in features

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

    # --- memory contract ------------------------------------------------------------------------------------
    def allocate(self, size: int, dtype: Any) -> WView:
        dtype = np.dtype(dtype)
        if dtype.itemsize != 4:
            raise BackendError(f"webgpu: buffers hold 4-byte elements, got {dtype}")
        nbytes = max(4, size * 4)  # WebGPU buffers: non-empty, 4-byte multiples
        self.allocations += 1
        free = self._free.get(nbytes)
        if free:
            raw = free.pop()
        else:
            u = self.wgpu.BufferUsage
            raw = self.device.create_buffer(size=nbytes, usage=u.STORAGE | u.COPY_SRC | u.COPY_DST)
        view = WView(raw, (size,), dtype)
        # when the tensor that owns this buffer lets it go, the buffer returns to the pool for its size (work
        # still recorded against it runs before any later use, as dispatches execute in order)
        weakref.finalize(view, self._free.setdefault(nbytes, []).append, raw)
        return view

    def upload(self, host: np.ndarray, out: WView) -> None:
        self.flush()  # a queued write lands before unsubmitted work: submit that work first
        data = np.ascontiguousarray(host, dtype=out.dtype)
        if data.nbytes:
            self.queue.write_buffer(out.raw, 0, data.tobytes())

    def download(self, buf: WView, host: np.ndarray) -> None:
        nbytes = buf.size * 4
        if nbytes == 0:
            return
        self.flush()
        u = self.wgpu.BufferUsage
        if self._staging is None or self._staging.size < nbytes:
            size = max(nbytes, 1 << 16)
            self._staging = self.device.create_buffer(size=size, usage=u.MAP_READ | u.COPY_DST)
        enc = self.device.create_command_encoder()
        enc.copy_buffer_to_buffer(buf.raw, 0, self._staging, 0, nbytes)
        self.queue.submit([enc.finish()])
        self.submissions += 1
        # wgpu-py's on_submitted_work_done is unreliable: mapping waits for the copy
        self._staging.map_sync(self.wgpu.MapMode.READ, 0, nbytes)
        try:
            data = self._staging.read_mapped(0, nbytes, copy=True)
        finally:
            self._staging.unmap()
        host.reshape(-1)[...] = np.frombuffer(data, dtype=buf.dtype, count=buf.size)

    def view(self, buf: WView, shape: tuple[int, ...]) -> WView:
        return WView(buf.raw, shape, buf.dtype, buf.owner or buf)

    def synchronize(self) -> None:
        self.flush()
        # a tiny read waits for everything submitted before it
        probe = self._scratch_buffer(1, "sync")
        self.download(probe, np.empty(1, np.float32))

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
        self._emit_pending()
        allocations, submissions = self.allocations, self.submissions
        self._recording = []
        try:
            step()
            self._emit_pending()
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
                    raise BackendError(f"webgpu: {entry} would bind {size} bytes, over this device's storage binding "
                                       f"limit of {self.max_binding} bytes; use a smaller batch")
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

    def _fuse(self, out: WView, kind: str, bias: WView | None = None, params: tuple = (),
              into: WView | None = None) -> bool:
        """Join a bias add (``kind`` "bias") or an activation (a line of pointwise.TABLE) on ``out`` to the epilogue of
        the GEMM that is about to write all of ``out`` (recorded, not yet encoded), saving a dispatch and a pass over
        the product. The activation runs in place on ``out``, or (``into``) is stored into another buffer beside the
        product, which its gradient reads. False where it cannot: no such GEMM, another buffer, a bias already added
        or an activation already applied, or (``into``) a Winograd transform or an operand of the GEMM."""
        g = self._pending
        if g is None or out.raw is not g["out"].raw or out.size != math.prod(g["shape"]):
            return False
        consts = dict(g["consts"])
        if "ACT" in consts or (kind == "bias" and ("HAS_BIAS" in consts or g["module"] != "gemm")):
            return False
        if kind == "bias":
            # the store adds Bias[column], or Bias[row] where it writes a convolution's channels (C_MODE 1)
            if bias is None or bias.size != g["shape"][1 if consts.get("C_MODE", 0) == 0 else 0]:
                return False
            g["operands"][3] = bias
            g["consts"] += (("HAS_BIAS", 1),)
        elif into is not None:
            if (g["module"] != "gemm" or into.size != out.size
                    or any(into.raw is operand.raw for operand in g["operands"][:4])):
                return False
            g["operands"][4] = into
            g["consts"] += pointwise.epilogue_constants(kind, params) + (("ACT_OUT", 1),)
        else:
            g["consts"] += pointwise.epilogue_constants(kind, params)
        return True

    def _span(self, start: int, end: int) -> tuple[int, int, int]:
        """A binding of bytes [start, end) of a buffer: (offset aligned down, size, elements from there to start)."""
        base = start // self.offset_align * self.offset_align
        return base, _pad4(end - base), (start - base) // 4

    def _item_chunks(self, count: int, per_item: list[int]):
        """Split ``count`` items (samples, planes), each of ``per_item[i]`` elements in bound tensor i, into runs
        whose bindings fit the device's limit. Yields (first, last + 1, binding ranges, element offsets) with a
        (byte offset, size) range and the run's element offset in it per tensor; one run of whole bindings (None
        ranges) and zero offsets where everything fits."""
        biggest = 4 * count * max(per_item)
        if biggest <= self.max_binding:
            yield 0, count, [None] * len(per_item), [0] * len(per_item)
            return
        step = (self.max_binding - self.offset_align) // (4 * max(per_item))
        if step < 1:
            raise BackendError(f"webgpu: one item of {4 * max(per_item)} bytes exceeds the storage binding limit "
                               f"of {self.max_binding} bytes")
        for i0 in range(0, count, step):
            i1 = min(count, i0 + step)
            spans = [self._span(i0 * e * 4, i1 * e * 4) for e in per_item]
            yield i0, i1, [sp[:2] for sp in spans], [sp[2] for sp in spans]

    def _grid(self, n: int) -> tuple[int, int, int]:
        groups = max(1, -(-n // WG))
        x = min(groups, self.max_groups)
        return x, -(-groups // x), 1

    def _scratch_buffer(self, size: int, tag: str) -> WView:
        """A prefix of the one scratch buffer kept per use (``tag``), grown to the largest size asked for: the
        layers of a network share it (dispatches run in order), and a work-in-progress value never outlives the
        primitive that wrote it."""
        b = self._scratch.get(tag)
        if b is None or b.size < size:
            if b is not None:
                # recorded steps bind the old buffer, which returns to the pool for other tensors: forget them
                self.recorder.forget()
            b = self._scratch[tag] = self.allocate(size, np.float32)
        return b if b.size == size else b[:size]

    def _elementwise(self, entry: str, n: int, buffers: list, u: tuple = (), f: tuple = (),
                     whole: tuple[int, ...] = (), base_slot: int | None = None, module: str = "elementwise") -> None:
        """Run an elementwise entry point over n elements. Buffers at positions in ``whole`` are bound entirely;
        the others are per-element and, past the binding limit, bound piece by piece. An output that aliases an
        input (an in-place layer) runs the entry's in-place variant where one exists; otherwise it is computed into
        scratch and copied back, as WebGPU forbids aliased writable bindings."""
        if n == 0:
            return
        raws = [b.raw for b in buffers]
        alias = {i for i in range(len(buffers)) if raws[i] in raws[:i]}
        inplace = self._inplace.get(entry)
        if inplace and alias == {inplace[0]} and raws[inplace[0]] is raws[inplace[1]]:
            # a kernel that overwrites its input: bind the buffer once
            entry, alias = entry + "_inplace", set()
            buffers = [b for i, b in enumerate(buffers) if i != inplace[0]]
        real = list(buffers)
        if alias:
            for i in alias:
                buffers = list(buffers)
                buffers[i] = self._scratch_buffer(n, f"alias{i}")
        piece = (self.max_binding // 4 // self.offset_align) * self.offset_align
        for start in range(0, n, piece):
            count = min(piece, n - start)
            ranges = [None if i in whole else (start * 4, _pad4(count * 4)) for i in range(len(buffers))]
            uu = list(u) + [0] * (8 - len(u))
            uu[0] = count
            if base_slot is not None:
                uu[base_slot] = start
            self._dispatch(module, entry, _pack(tuple(uu), f), buffers, self._grid(count), ranges)
        for i in alias:
            self._elementwise("copy", n, [buffers[i], real[i]])

    # --- BLAS ---------------------------------------------------------------------------------------------------
    def gemm(self, a, trans_a, b, trans_b, out, alpha=1.0, beta=0.0):
        m, n = out.shape
        k = a.shape[0] if trans_a else a.shape[1]
        self._gemm(a, trans_a, b, trans_b, out, m, n, k, alpha, beta)

    SPLIT_K_TILES = 1024
    """Split K across the grid when C has fewer tiles than this and K is long (weight gradients): a large GPU
    holds several 256-thread workgroups per multiprocessor, so a grid needs about this many to fill it."""

    SPLIT_K_FROM = 512
    """Products with at least this long a K may be split (2048 -> 512: LeNet-1024's fc1 filter gradient and
    forward fill an H200 in 2.11 instead of 2.18 ms of GPU time per step)."""
    SPLIT_K_MIN = 256
    """The shortest K range of one split (its partial product is written out and summed)."""

    SPLIT_SUM_ROWS = 16384
    """Split-K products with at most this many outputs sum their partials with a workgroup per output."""

    SMALL_TILES = True
    """Products with a side of at most 32 use 32x32 tiles."""
    BIG_TILES_SPLIT_K = True
    """Whether products too small for 128x128 tiles take them anyway when split-K will fill the GPU (the filter
    gradients of AlexNet's conv3-5 ran 1.15-1.2x faster so on an H200)."""

    WIDE_TILE_RATE = 1.1
    BIG_TILE_RATE = 1.2
    """Speeds of 64x128 and 128x128 tiles relative to 64x64 on products large enough for them: the choice weighs a
    tile's rate against the padding it adds to m and n."""

    def _gemm_tile(self, m: int, n: int, k: int = 0, batch: int = 1) -> tuple[str, int, int, tuple]:
        """The kernel for an m x n product as (entry point, tile rows, tile columns, its pipeline constants): 32x32
        tiles where a side is that short; otherwise, of 64x64, 64x128 and 128x128 tiles, the one with the least
        padded area per unit of speed among those with enough tiles to fill the GPU (256, or fewer where split-K
        will fill it); 64x64 always qualifies."""
        if self.SMALL_TILES and min(m, n) <= 32:
            return "gemm", 32, 32, (("TS", 8), ("TILES", 128))
        best: float | None = None
        choice: tuple[str, int, int, tuple] = ("gemm", 64, 64, ())
        for tm, tn, rate in ((64, 64, 1.0), (64, 128, self.WIDE_TILE_RATE), (128, 128, self.BIG_TILE_RATE)):
            tiles = -(-m // tm) * -(-n // tn) * batch
            if (tm, tn) != (64, 64) and not (tiles >= 256 or (self.BIG_TILES_SPLIT_K and k >= self.SPLIT_K_FROM)):
                continue
            cost = tiles * tm * tn / rate
            if best is None or cost < best:
                best = cost
                choice = ("gemm", 64, 64, ()) if tm == tn == 64 else \
                    ("gemm_big", tm, tn, (("BIG_ROWS", tm),) if tm != 128 else ())
        return choice

    def _gemm(self, a, trans_a, b, trans_b, out, m, n, k, alpha, beta, conv: tuple = (), n0: int = 0,
              bias: WView | None = None, batch: int = 1) -> None:
        """``conv``: convolution geometry and operand modes as pipeline constants (see gemm.wgsl), with ``n0`` the
        first sample; the caller makes sure every operand fits one binding. ``bias``: added per row of C (a
        convolution's output channel; C_MODE 1 only). ``batch``: that many products of this shape, stored one
        after another in a, b and out (plain operands), in one dispatch."""
        lds = (m if trans_a else k, k if trans_b else n, n)
        consts = (("TRANS_A", int(trans_a)), ("TRANS_B", int(trans_b))) + conv
        if bias is not None:
            consts += (("HAS_BIAS", 1),)
        operands = [a, b, out, bias if bias is not None else self._scratch_buffer(1, "nobias"),
                    self._scratch_buffer(1, "noact")]
        if not conv and max(a.raw.size, b.raw.size, out.raw.size) > self.max_binding:
            return self._gemm_blocks(operands, trans_a, trans_b, m, n, k, alpha, beta, consts, lds)
        entry, tm, tn, tile_consts = self._gemm_tile(m, n, k, batch)
        consts += tile_consts
        gx, gy = -(-n // tn), -(-m // tm)
        if gy > self.max_groups:
            raise BackendError(f"webgpu: a GEMM of {m} rows needs {gy} workgroups in a grid dimension; this device "
                               f"allows {self.max_groups}: use a smaller batch")
        if batch > 1:  # z = split * batch + product: u3 holds the batch size
            consts += (("BATCHED", 1),)
            n0 = batch
        tiles = gx * gy * batch
        outputs = batch * m * n
        splits = 1
        fill = self.SPLIT_K_TILES * (4 if tm == 32 else 1)  # 32x32 tiles run 64 threads, the others 256
        if tiles < fill and k >= self.SPLIT_K_FROM and not any(name == "C_MODE" for name, _ in conv):
            splits = max(1, min(-(-fill // tiles), k // self.SPLIT_K_MIN, self.max_groups // batch))
            while splits > 1 and splits * outputs * 4 > self.max_binding:
                splits //= 2
        # columns past the device's grid width run as several dispatches, each from its first column (u11)
        spans = [(c0, min(gx - c0, self.max_groups)) for c0 in range(0, gx, self.max_groups)]
        if splits == 1 and len(spans) == 1 and batch == 1:  # encoded at the next dispatch: a bias or ReLU may join
            self._defer("gemm", entry, _pack((m, n, k, n0, 0, 0, 0, k, *lds, 0), (alpha, beta)), operands,
                        (gx, gy, 1), consts, (m, n), out)
            return
        if splits == 1:
            for c0, cx in spans:
                self._dispatch("gemm", entry, _pack((m, n, k, n0, 0, 0, 0, k, *lds, c0 * tn), (alpha, beta)),
                               operands, (cx, gy, batch), constants=consts)
            return
        chunk = -(-k // splits)
        chunk = -(-chunk // 16) * 16  # whole K slices of either kernel
        splits = -(-k // chunk)
        partial = self._scratch_buffer(splits * outputs, "splitk")
        for c0, cx in spans:
            self._dispatch("gemm", entry, _pack((m, n, k, n0, 0, 0, 0, chunk, *lds, c0 * tn), (1.0, 0.0)),
                           [a, b, partial, *operands[3:]], (cx, gy, splits * batch), constants=consts)
        if outputs <= self.SPLIT_SUM_ROWS:  # few outputs, many partials each: one workgroup per output
            self._sum_rows(partial, out, splits, outputs, alpha, beta, columns=True)
        else:
            self._elementwise("split_sum", outputs, [partial, out], u=(0, splits), f=(alpha, beta), whole=(0,))

    def _gemm_blocks(self, operands, trans_a, trans_b, m, n, k, alpha, beta, consts, lds) -> None:
        """A product whose operands exceed the storage-binding limit, in blocks of C whose rows of A, rows of B^T
        and rows of C can each be bound (A transposed or B untransposed must fit whole)."""
        a, b, out = operands[:3]
        limit = self.max_binding - self.offset_align  # room for aligning each binding's start down

        def a_bytes(mb: int) -> int:
            return a.raw.size if trans_a else mb * k * 4

        def b_bytes(nb: int) -> int:
            return nb * k * 4 if trans_b else b.raw.size

        mb, nb = min(m, 32 * self.max_groups), min(n, 32 * self.max_groups)  # any tile's grid fits the device's
        while mb > 1 and (a_bytes(mb) > limit or mb * n * 4 > limit):
            mb = -(-mb // 2)
        while nb > 1 and b_bytes(nb) > limit:
            nb = -(-nb // 2)
        if a_bytes(mb) > limit or b_bytes(nb) > limit or mb * n * 4 > limit:
            raise BackendError(f"webgpu: a {m}x{k} by {k}x{n} GEMM cannot be split under the device's storage "
                               f"binding limit ({self.max_binding} bytes): a transposed A or an untransposed B "
                               "must fit in one binding")

        for m0 in range(0, m, mb):
            mm = min(mb, m - m0)
            for n0 in range(0, n, nb):
                nn = min(nb, n - n0)
                ra = (0, a.raw.size, 0) if trans_a else self._span(m0 * k * 4, (m0 + mm) * k * 4)
                rb = self._span(n0 * k * 4, (n0 + nn) * k * 4) if trans_b else (0, b.raw.size, 0)
                rc = self._span((m0 * n + n0) * 4, ((m0 + mm - 1) * n + n0 + nn) * 4)
                a_off = ra[2] + (m0 if trans_a else 0)
                b_off = rb[2] + (0 if trans_b else n0)
                params = _pack((mm, nn, k, 0, a_off, b_off, rc[2], k, *lds), (alpha, beta))
                entry, tm, tn, tile_consts = self._gemm_tile(mm, nn, k)
                self._dispatch("gemm", entry, params, operands, (-(-nn // tn), -(-mm // tm), 1),
                               [ra[:2], rb[:2], rc[:2], None, None], constants=consts + tile_consts)

    def axpby(self, alpha, x, beta, y):
        if beta == 0.0 and alpha == 1.0:
            return self.copy(x, y)
        self._elementwise("axpby", y.size, [x, y], f=(alpha, beta))

    def scal(self, alpha, x):
        self._elementwise("scal", x.size, [x], f=(alpha,))

    def copy(self, x, out):
        if x.raw is out.raw:
            return
        self._elementwise("copy", out.size, [x, out])

    def fill(self, value, out):
        self._elementwise("fill", out.size, [out], f=(value,))

    def mul(self, x, y, out):
        self._elementwise("mul", out.size, [x, y, out])

    def _reduce(self, entry: str, buffers: list, u: tuple, f: tuple = (), groups: int | tuple = 1) -> None:
        for v in buffers:
            if v.raw.size > self.max_binding:
                raise BackendError(f"webgpu: a {v.raw.size}-byte operand of {entry} exceeds the storage binding limit")
        self._dispatch("reduce", entry, _pack(u, f), buffers, groups if isinstance(groups, tuple) else (groups, 1, 1))

    def dot(self, x, y, out):
        if x.raw is y.raw:
            return self._sum_parts("square_parts", [x], x.size, [1], out)
        self._sum_parts("dot_parts", [x, y], x.size, [1, 1], out)

    def nrm2(self, x, out):
        self._sum_parts("square_parts", [x], x.size, [1], out, root=True)

    PARTS_BLOCK = 16384
    """Elements per workgroup in the first pass of a long reduction."""

    def _sum_parts(self, entry: str, inputs: list, count: int, per_item: list, out: WView, alpha: float = 1.0,
                   root: bool = False, u1: int = 0) -> None:
        """out[0] = alpha * (sum of the entry's terms over ``count`` items) (its square root with ``root``): partial
        sums of blocks, a workgroup each, over runs of items whose bindings fit, then one sum of the partials."""
        runs = list(self._item_chunks(count, per_item))
        longest = max(run[1] - run[0] for run in runs)
        blocks = max(1, min(self.max_groups, -(-longest // self.PARTS_BLOCK)))
        length = -(-longest // blocks)
        parts = self._scratch_buffer(blocks * len(runs), "parts")
        for i, (i0, i1, binds, offsets) in enumerate(runs):
            params = _pack((i1 - i0, u1, 0, length, i * blocks, *offsets))
            self._dispatch("reduce", entry, params, [*inputs, parts], (blocks, 1, 1), [*binds, None])
        self._reduce("sum_rows", [parts, out], (blocks * len(runs), 0, 1, int(root)), (alpha, 0.0))

    def read_scalar(self, buf):
        host = np.empty(1, np.float32)
        self.download(WView(buf.raw, (1,), buf.dtype, buf.owner or buf), host)
        return float(host[0])

    # --- activations: entry points generated from pointwise.TABLE ----------------------------------------------------
    def activation(self, kind, x, out, params=()):
        line = pointwise.line(kind)
        if x.raw is out.raw:
            if self._fuse(out, kind, params=params):
                return
        elif line.reads == "x" and self._fuse(x, kind, params=params, into=out):
            # an activation whose gradient reads x never runs in place: it joins the GEMM's store beside the product
            return
        self._elementwise(line.entry, out.size, [x, out], f=params)

    def activation_grad(self, kind, src, dy, dx, params=()):
        self._elementwise(pointwise.line(kind).name + "_grad", dx.size, [src, dy, dx], f=params)

    def _rows(self, a: WView) -> tuple[int, int, int]:
        n, c = a.shape[0], a.shape[1]
        inner = a.size // (n * c) if n * c else 1
        return n * inner, c, inner

    LONG_ROWS = 64
    """Rows of at least this many classes are reduced by a workgroup each, shorter ones by a thread each."""

    def _class_dispatch(self, entry: str, rows: int, c: int, inner: int, log: bool, buffers: list) -> None:
        """Over runs of samples whose bindings fit the device's limit."""
        n = rows // inner
        for n0, n1, binds, offsets in self._item_chunks(n, [c * inner] * len(buffers)):
            count = (n1 - n0) * inner
            params = _pack((count, c, inner, int(log), *offsets))
            if c >= self.LONG_ROWS:
                self._dispatch("classes", entry + "_rows", params, buffers, _workgroup_each(count), binds)
            else:
                self._dispatch("classes", entry, params, buffers, self._grid(count), binds)

    def softmax(self, x, out):
        self._class_dispatch("softmax", *self._rows(x), False, [x, out])

    def log_softmax(self, x, out):
        self._class_dispatch("softmax", *self._rows(x), True, [x, out])

    def softmax_grad(self, y, dy, dx):
        self._class_grad(y, dy, dx, log=False)

    def log_softmax_grad(self, y, dy, dx):
        self._class_grad(y, dy, dx, log=True)

    def _class_grad(self, y, dy, dx, log: bool) -> None:
        self._class_dispatch("softmax_grad", *self._rows(y), log, self._no_alias([y, dy, dx]))
        self._copy_back([y, dy, dx])

    def _no_alias(self, buffers: list) -> list:
        out = list(buffers)
        if out[-1].raw in [b.raw for b in out[:-1]]:
            out[-1] = self._scratch_buffer(out[-1].size, "alias_out")
        return out

    def _copy_back(self, buffers: list) -> None:
        if buffers[-1].raw in [b.raw for b in buffers[:-1]]:
            self._elementwise("copy", buffers[-1].size, [self._scratch_buffer(buffers[-1].size, "alias_out"),
                                                         buffers[-1]])

    # --- losses -----------------------------------------------------------------------------------------------
    def nll(self, logp, labels, out):
        n = logp.shape[0]
        c = logp.size // n
        self._sum_parts("nll_parts", [logp, labels], n, [c, 1], out, alpha=-1.0 / n, u1=c)

    def nll_grad(self, labels, dloss, dx):
        n = dx.shape[0]
        c = dx.size // n
        for n0, n1, (bl, bx), (ol, ox) in self._item_chunks(n, [1, c]):
            count = (n1 - n0) * c
            self._dispatch("classes", "nll_grad", _pack((count, c, n, ol, ox)), [labels, dloss, dx], self._grid(count),
                           [bl, None, bx])

    def mse(self, x, t, diff, out):
        self._elementwise("sub", x.size, [x, t, diff])
        self._sum_parts("square_parts", [diff], diff.size, [1], out, alpha=1.0 / diff.size)

    def mse_grad(self, diff, dloss, dx):
        self._elementwise("scale_by_scalar", dx.size, [diff, dloss, dx], f=(2.0 / diff.size,), whole=(1,))

    # --- bias ---------------------------------------------------------------------------------------------------
    def bias_add(self, y, b):
        n, c = y.shape[0], y.shape[1]
        inner = y.size // (n * c)
        if inner == 1 and self._fuse(y, "bias", b):  # [N, C]: a linear layer's product
            return
        self._elementwise("bias_add", y.size, [y, b], u=(0, c, inner), whole=(1,), base_slot=3)

    def bias_grad(self, dy, db, beta=0.0):
        self._channel_sums(dy, db, 1.0, beta)

    def _channel_sums(self, dy, db, alpha: float, beta: float) -> None:
        """db = alpha * (sums of dy over all axes but 1) + beta * db: per channel, partial sums over blocks of the
        batch in parallel, then one sum of the partials each."""
        n, c = dy.shape[0], dy.shape[1]
        inner = dy.size // (n * c)
        if inner == 1 and dy.raw.size <= self.max_binding:  # [N, C] (linear layers): column sums, one pass
            return self._sum_rows(dy, db, n, c, alpha, beta, columns=True)
        runs = list(self._item_chunks(n, [c * inner]))  # runs of samples whose binding fits
        per = max(run[1] - run[0] for run in runs) * inner
        blocks = max(1, min(256, -(-per // 4096), self.max_groups))  # per run
        length = -(-per // blocks)
        total = blocks * len(runs)
        part = self._scratch_buffer(c * total, "bias_part")
        for i, (n0, n1, (bind,), (offset,)) in enumerate(runs):
            params = _pack((n1 - n0, c, inner, total, length, i * blocks, offset))
            self._dispatch("reduce", "bias_grad_part", params, [dy, part], (c, blocks, 1), [bind, None])
        self._sum_rows(part, db, total, c, alpha, beta)

    # --- batch normalisation: per-channel sums through bias_grad's reduction, the rest elementwise -------------
    def _bn(self, entry: str, x, buffers: list, whole: tuple[int, ...], f: tuple = ()) -> None:
        """A per-element batchnorm kernel over x's elements (channel = axis 1)."""
        n, c = x.shape[0], x.shape[1]
        self._elementwise(entry, x.size, buffers, u=(0, c, x.size // (n * c)), f=f, whole=whole, base_slot=3,
                          module="batchnorm")

    def _bn_channels(self, entry: str, c: int, buffers: list, u: tuple = (), f: tuple = ()) -> None:
        self._elementwise(entry, c, buffers, u=(0, *u), f=f, whole=tuple(range(len(buffers))), module="batchnorm")

    def _or_dummy(self, v, c: int, tag: str):
        return v if v is not None else self._scratch_buffer(c, tag)

    def batch_norm_stats(self, x, mean, var):
        count = x.size // x.shape[1]
        self._channel_sums(x, mean, 1.0 / count, 0.0)
        t = self.view(self._scratch_buffer(x.size, "bn_values"), x.shape)
        self._bn("bn_centered_square", x, [x, mean, t], whole=(1,))
        self._channel_sums(t, var, 1.0 / count, 0.0)

    def batch_norm(self, x, mean, var, gamma, beta, y, eps):
        c = x.shape[1]
        coef = self._scratch_buffer(2 * c, "bn_coefficients")
        self._bn_channels("bn_coefficients", c, [mean, var, self._or_dummy(gamma, c, "bn_gamma"),
                                                 self._or_dummy(beta, c, "bn_beta"), coef],
                          u=(int(gamma is not None), int(beta is not None)), f=(eps,))
        self._bn("bn_affine", x, [x, coef, y], whole=(1,))

    def batch_norm_grad_sums(self, x, dy, mean, var, sum_dy, sum_dy_xhat, eps):
        self.bias_grad(dy, sum_dy)
        t = self.view(self._scratch_buffer(x.size, "bn_values"), x.shape)
        self._bn("bn_dy_centered", x, [dy, x, mean, t], whole=(2,))
        self.bias_grad(t, sum_dy_xhat)
        self._bn_channels("bn_times_invstd", x.shape[1], [sum_dy_xhat, var], f=(eps,))

    def batch_norm_grad(self, x, dy, mean, var, gamma, sum_dy, sum_dy_xhat, dx, eps, batch_stats):
        c = x.shape[1]
        coef = self._scratch_buffer(3 * c, "bn_coefficients")
        self._bn_channels("bn_grad_coefficients", c,
                          [mean, var, self._or_dummy(gamma, c, "bn_gamma"), sum_dy, sum_dy_xhat, coef],
                          u=(int(gamma is not None), int(batch_stats)), f=(eps, c / x.size))
        self._bn("bn_grad_apply", x, [dy, x, coef, dx], whole=(2,))

    def _sum_rows(self, a, out, length: int, rows: int, alpha: float, beta: float, columns: bool = False) -> None:
        """out[r] = alpha * (sum of row r of a [rows x length], or of column r of a [length x rows]) + beta * out[r],
        one workgroup per output."""
        self._reduce("sum_rows", [a, out], (length, int(columns), rows), (alpha, beta), groups=_workgroup_each(rows))

    # --- convolution: implicit GEMM (the GEMM kernel reads x and dy and writes y in NCHW itself); the data gradient
    # and tensors past the binding limit go through im2col columns in batch chunks ----------------------------------
    CONV_SCRATCH = 256 << 20
    """Bytes of im2col columns per batch chunk: larger chunks give each GEMM enough tiles to fill a large GPU."""

    def _conv_geometry(self, x_shape, w_shape, y_shape, stride, padding):
        n, c, h, w = x_shape
        o, _, kh, kw = w_shape
        oh, ow = y_shape[2], y_shape[3]
        k = c * kh * kw
        per_sample = k * oh * ow * 4
        limit = min(self.max_binding, self.CONV_SCRATCH)
        chunk = max(1, min(n, limit // max(per_sample, 1)))
        # a chunk's samples of x and y are bound as one range each
        chunk = max(1, min(chunk, (self.max_binding - self.offset_align) // (4 * max(c * h * w, o * oh * ow))))
        geometry = self._conv_constants(x_shape, w_shape, y_shape, stride, padding)
        return n, c, o, k, oh * ow, chunk, tuple(g for g in geometry if g[0] != "CONV_O")

    @staticmethod
    def _conv_constants(x_shape, w_shape, y_shape, stride, padding, **modes) -> tuple:
        _, c, h, w = x_shape
        o, _, kh, kw = w_shape
        geometry = dict(CONV_C=c, IN_H=h, IN_W=w, CONV_O=o, KH=kh, KW=kw, SH=stride[0], SW=stride[1],
                        PH=padding[0], PW=padding[1], OH=y_shape[2], OW=y_shape[3])
        return tuple(modes.items()) + tuple(geometry.items())

    implicit_conv = True
    """Convolutions read x and dy in place (implicit GEMM); False: always through im2col columns."""
    implicit_data_grad = False
    """The data gradient as one implicit GEMM too (stride 1, where it does no more work): it needs no columns (on
    AlexNet-128 600 MB less scratch) but its gathers made it 1.3x slower than GEMM + col2im on an H200."""

    def _fits(self, *buffers: WView) -> bool:
        return self.implicit_conv and max(b.raw.size for b in buffers) <= self.max_binding

    def _conv_scratch(self, k: int, p: int, chunk: int, o: int) -> tuple[WView, WView]:
        return self._scratch_buffer(k * p * chunk, "cols"), self._scratch_buffer(o * p * chunk, "ymat")

    def _conv_launch(self, entry: str, geometry: tuple, count: int, n0: int, nc: int, o: int, src: WView,
                     dst: WView, to_gemm: bool = False):
        """A layout pass over samples [n0, n0 + nc); the NCHW tensor (x or dy read, y or dx written) is bound
        whole where it fits, else just those samples."""
        nchw = 0 if entry == "im2col" or to_gemm else 1
        tensor = (src, dst)[nchw]
        per_sample = tensor.size // tensor.shape[0]
        ranges: list = [None, None]
        offset = n0 * per_sample
        if tensor.raw.size > self.max_binding:
            base, size, offset = self._span(offset * 4, (n0 + nc) * per_sample * 4)
            ranges[nchw] = (base, size)
        self._dispatch("conv", entry, _pack((count, offset), (0.0, nc, o, 1.0 if to_gemm else 0.0)), [src, dst],
                       self._grid(count), ranges, constants=geometry)

    winograd = True
    """Stride-1 convolutions with 3x3 or 5x5 windows and at least WINOGRAD_MIN_CHANNELS channels in and out run
    forward, data gradient and filter gradient as Winograd F(2x2, 3x3) or F(2x2, 5x5) (winograd.wgsl): 16 or 36
    batched GEMMs over 2x2 output blocks, so 4 or 9 multiplications per output instead of 9 or 25 (2.25x and 2.78x
    fewer; 1.94x and 2.58x on AlexNet's 13x13 and 27x27 maps, whose last blocks overhang), between transforms."""
    WINOGRAD_MIN_CHANNELS = 64
    WINOGRAD_SCRATCH = 1 << 30
    """Bytes of transformed tiles per batch chunk (and at most the device's storage-binding limit)."""
    winograd_filter_grad = True
    """Whether the filter gradient takes Winograd too (where ``winograd`` applies)."""

    def _winograd_chunk(self, x_shape, w_shape, y_shape, stride, padding) -> int:
        """Samples per batch chunk where ``y = conv(x, w)`` (and the data and filter gradients of that geometry) can
        run as Winograd on this device; 0 where it cannot."""
        n, c, h, wd = x_shape
        o, oh, ow = y_shape[1], y_shape[2], y_shape[3]
        r = w_shape[2]
        if not (self.winograd and r in (3, 5) and w_shape[3] == r and tuple(stride) == (1, 1)
                and all(0 <= q < r for q in padding) and min(c, o) >= self.WINOGRAD_MIN_CHANNELS):
            return 0
        if 4 * max(n * c * h * wd, n * o * oh * ow) > self.max_binding:
            return 0
        per_sample = -(-max(h, oh) // 2) * -(-max(wd, ow) // 2)  # blocks: the data gradient's tile x
        tile_bytes = 4 * (r + 1) ** 2 * max(c, o) * per_sample
        chunk = min(n, min(self.max_binding, self.WINOGRAD_SCRATCH) // tile_bytes)
        if chunk < 1 or -(-chunk * per_sample // 32) > self.max_groups:
            return 0
        return chunk

    def _winograd_setup(self, x_shape, y_shape, r: int, padding, chunk: int):
        """(geometry constants, blocks per sample, points per tile, scratch for U, V and M) of one Winograd pass,
        x the transform's input and y its output."""
        _, cin, h, wd = x_shape
        cout, oh, ow = y_shape[1], y_shape[2], y_shape[3]
        per_sample = -(-oh // 2) * -(-ow // 2)
        points = (r + 1) ** 2
        geometry = (("CONV_C", cin), ("CONV_O", cout), ("IN_H", h), ("IN_W", wd), ("PH", padding[0]),
                    ("PW", padding[1]), ("OH", oh), ("OW", ow), ("R", r))
        blocks = chunk * per_sample
        scratch = (self._scratch_buffer(points * cout * cin, "winograd_u"),
                   self._scratch_buffer(points * cin * blocks, "winograd_v"),
                   self._scratch_buffer(points * cout * blocks, "winograd_m"))
        return geometry, per_sample, points, scratch

    def _winograd_blocks(self, entry: str, src: WView, dst: WView, channels: int, blocks: int, n0: int,
                         geometry: tuple) -> None:
        """A transform with a thread per (channel, 2x2 block) of the chunk from sample n0."""
        self._dispatch("winograd", entry, _pack((channels * blocks, blocks, n0)), [src, dst],
                       self._grid(channels * blocks), constants=geometry)

    def _winograd(self, x: WView, w: WView, y: WView, padding, flip: bool, chunk: int,
                  bias: WView | None = None) -> None:
        """y = the RxR stride-1 correlation of x with w [O][C][R][R] padded by ``padding``, as Winograd F(2x2, RxR)
        in batch chunks; with ``flip`` the data gradient's: x has w's O channels, y its C, through w rotated 180
        degrees."""
        n, cin = x.shape[:2]
        cout, r = y.shape[1], w.shape[2]
        geometry, per_sample, points, (u, v, m) = self._winograd_setup(x.shape, y.shape, r, padding, chunk)
        self._dispatch("winograd", "winograd_filter", _pack((cout * cin, w.shape[0], w.shape[1])), [w, u],
                       self._grid(cout * cin), constants=(("FLIP", int(flip)), ("R", r)))
        out_consts = geometry + ((("HAS_BIAS", 1),) if bias is not None else ())
        bias_or_none = bias if bias is not None else self._scratch_buffer(1, "nobias")
        for n0 in range(0, n, chunk):
            blocks = min(chunk, n - n0) * per_sample
            self._winograd_blocks("winograd_input", x, v, cin, blocks, n0, geometry)
            self._gemm(u, False, v, False, m, cout, blocks, cin, 1.0, 0.0, batch=points)
            self._defer("winograd", "winograd_output", _pack((cout * blocks, blocks, n0)), [m, y, bias_or_none],
                        self._grid(cout * blocks), out_consts, tuple(y.shape), y)  # an in-place ReLU may join
        if chunk < n:
            self._emit_pending()  # a ReLU over all of y cannot join the last chunk's store

    def _winograd_filter_grad(self, x: WView, dy: WView, dw: WView, padding, beta: float, chunk: int) -> None:
        """dw = the filter gradient of an RxR stride-1 convolution (+ beta dw) through Winograd F(2x2, RxR): the
        transformed x and dy blocks multiplied per point of the tile (K = the blocks: split-K), chunk by chunk."""
        n, c = x.shape[:2]
        o, r = dy.shape[1], dw.shape[2]
        geometry, per_sample, points, (du, v, z) = self._winograd_setup(x.shape, dy.shape, r, padding, chunk)
        for n0 in range(0, n, chunk):
            blocks = min(chunk, n - n0) * per_sample
            self._winograd_blocks("winograd_input", x, v, c, blocks, n0, geometry)
            self._winograd_blocks("winograd_dy", dy, z, o, blocks, n0, geometry)
            self._gemm(z, False, v, True, du, o, c, blocks, 1.0, 0.0 if n0 == 0 else 1.0, batch=points)
        self._dispatch("winograd", "winograd_filter_grad", _pack((o * c,), (beta,)), [du, dw], self._grid(o * c),
                       constants=(("R", r),))

    def conv2d(self, x, w, out, stride, padding, ws, bias=None):
        chunk = self._winograd_chunk(x.shape, w.shape, out.shape, stride, padding)
        if chunk:
            return self._winograd(x, w, out, padding, False, chunk, bias)
        n, c, o, k, p, chunk, u = self._conv_geometry(x.shape, w.shape, out.shape, stride, padding)
        if self._fits(x, w, out):
            conv = self._conv_constants(x.shape, w.shape, out.shape, stride, padding, B_MODE=1, C_MODE=1)
            self._gemm(w, False, x, False, out, o, n * p, k, 1.0, 0.0, conv, bias=bias)  # bias in the store
            return
        cols, ymat = self._conv_scratch(k, p, chunk, o)
        for n0 in range(0, n, chunk):
            nc = min(chunk, n - n0)
            self._conv_launch("im2col", u, k * nc * p, n0, nc, o, x, cols)
            self._gemm(w, False, cols, False, ymat, o, nc * p, k, 1.0, 0.0)
            self._conv_launch("relayout", u, nc * o * p, n0, nc, o, ymat, out)
        if bias is not None:
            self.bias_add(out, bias)

    def conv2d_grad_data(self, dy, w, dx, stride, padding, ws):
        chunk = self._winograd_chunk(dx.shape, w.shape, dy.shape, stride, padding)
        if chunk:  # dx = dy correlated with w rotated 180 degrees (channels swapped), padded by R - 1 - padding
            r = w.shape[2]
            return self._winograd(dy, w, dx, (r - 1 - padding[0], r - 1 - padding[1]), True, chunk)
        n, c, o, k, p, chunk, u = self._conv_geometry(dx.shape, w.shape, dy.shape, stride, padding)
        h, wd = dx.shape[2], dx.shape[3]
        # implicit: dx [C x N*H*W] = w as [C x O*KH*KW] times dy gathered per (o, i, j) and x position, with no
        # columns or col2im; it multiplies every x position by every window offset, so it does more work than the
        # columns where the stride or a smaller output leaves many of those terms zero, or C is far below a tile
        implicit = -(-c // 64) * 64 * n * h * wd * o * w.shape[2] * w.shape[3]
        columns = -(-k // 64) * 64 * n * p * o
        if self.implicit_data_grad and tuple(stride) == (1, 1) and implicit <= 1.1 * columns and self._fits(dy, w, dx):
            conv = self._conv_constants(dx.shape, w.shape, dy.shape, stride, padding, A_MODE=2, B_MODE=4, C_MODE=2)
            self._gemm(w, False, dy, False, dx, c, n * h * wd, o * w.shape[2] * w.shape[3], 1.0, 0.0, conv)
            return
        cols, ymat = self._conv_scratch(k, p, chunk, o)
        direct = self._fits(dy)
        conv = self._conv_constants(dx.shape, w.shape, dy.shape, stride, padding, B_MODE=3)
        for n0 in range(0, n, chunk):
            nc = min(chunk, n - n0)
            if direct:  # dy read in NCHW by the GEMM
                self._gemm(w, True, dy, False, cols, k, nc * p, o, 1.0, 0.0, conv, n0)
            else:
                self._conv_launch("relayout", u, nc * o * p, n0, nc, o, dy, ymat, to_gemm=True)
                self._gemm(w, True, ymat, False, cols, k, nc * p, o, 1.0, 0.0)
            self._conv_launch("col2im", u, nc * c * h * wd, n0, nc, o, cols, dx)

    def conv2d_grad_filter(self, x, dy, dw, stride, padding, ws, beta=0.0):
        chunk = self.winograd_filter_grad and self._winograd_chunk(x.shape, dw.shape, dy.shape, stride, padding)
        if chunk:
            return self._winograd_filter_grad(x, dy, dw, padding, beta, chunk)
        n, c, o, k, p, chunk, u = self._conv_geometry(x.shape, dw.shape, dy.shape, stride, padding)
        if self._fits(x, dy):
            # dw [O x CKK] = dy [O x N*P] times the im2col columns transposed [N*P x CKK], both read in place
            conv = self._conv_constants(x.shape, dw.shape, dy.shape, stride, padding, A_MODE=1, B_MODE=2)
            self._gemm(dy, False, x, True, dw, o, k, n * p, 1.0, beta, conv)
            return
        cols, ymat = self._conv_scratch(k, p, chunk, o)
        for n0 in range(0, n, chunk):
            nc = min(chunk, n - n0)
            self._conv_launch("im2col", u, k * nc * p, n0, nc, o, x, cols)
            self._conv_launch("relayout", u, nc * o * p, n0, nc, o, dy, ymat, to_gemm=True)
            self._gemm(ymat, False, cols, True, dw, o, k, nc * p, 1.0, beta if n0 == 0 else 1.0)

    # --- pooling ------------------------------------------------------------------------------------------------
    @staticmethod
    def _pool_constants(x_shape, y_shape, kernel, stride, padding, is_max) -> tuple:
        return (("IS_MAX", int(is_max)), ("IN_H", x_shape[2]), ("IN_W", x_shape[3]), ("KH", kernel[0]),
                ("KW", kernel[1]), ("SH", stride[0]), ("SW", stride[1]), ("PH", padding[0]), ("PW", padding[1]),
                ("OH", y_shape[2]), ("OW", y_shape[3]))

    def pool2d(self, x, out, mask, mode, kernel, stride, padding):
        m = mask if mask is not None else self._scratch_buffer(out.size, "nomask")
        consts = self._pool_constants(x.shape, out.shape, kernel, stride, padding, mode == "max")
        self._pool("pool_fwd", [x, out, m], x.shape, out.shape, out.shape, consts)

    def pool2d_grad(self, dy, dx, mask, mode, kernel, stride, padding):
        m = mask if mask is not None else self._scratch_buffer(dy.size, "nomask")
        consts = self._pool_constants(dx.shape, dy.shape, kernel, stride, padding, mode == "max")
        tiled = (tuple(kernel) == tuple(stride) and tuple(padding) == (0, 0)
                 and (dx.shape[2], dx.shape[3]) == (dy.shape[2] * stride[0], dy.shape[3] * stride[1]))
        if tiled:  # each input in exactly one window: a thread per output writes its window
            self._pool("pool_bwd_tiled", [dy, dx, m], dy.shape, dx.shape, dy.shape, consts, per_thread=0)
        else:  # a thread per input sums over the windows that hold it
            self._pool("pool_bwd", [dy, dx, m], dy.shape, dx.shape, dy.shape, consts)

    def _pool(self, entry: str, buffers: list, src_shape, dst_shape, mask_shape, consts: tuple,
              per_thread: int = 1) -> None:
        """One thread per dst element (per src element with ``per_thread=0``), over runs of (n, c) planes whose
        bindings fit the device's limit."""
        planes = dst_shape[0] * dst_shape[1]
        sizes = [s[2] * s[3] for s in (src_shape, dst_shape, mask_shape)]
        for p0, p1, binds, offsets in self._item_chunks(planes, sizes):
            count = (p1 - p0) * sizes[per_thread]
            self._dispatch("pool", entry, _pack((count, *offsets)), buffers, self._grid(count), binds, constants=consts)

    # --- randomness and solver updates -----------------------------------------------------------------------
    def copy_block(self, part, whole, part_inner, whole_inner, offset, into_whole):
        self._elementwise("block_into" if into_whole else "block_from", part.size, [part, whole],
                          u=(0, part_inner, whole_inner, offset), whole=(1,), base_slot=4)

    def lrn(self, x, scale, out, size, alpha, beta, k):
        c = x.shape[1]
        inner = x.size // (x.shape[0] * c)
        self._elementwise("lrn", x.size, [x, scale, out], u=(0, c, inner, size), f=(alpha / size, beta, k),
                          whole=(0, 1, 2), base_slot=4, module="lrn")

    def lrn_grad(self, x, y, scale, dy, dx, size, alpha, beta):
        c = x.shape[1]
        inner = x.size // (x.shape[0] * c)
        self._elementwise("lrn_grad", x.size, [x, y, scale, dy, dx], u=(0, c, inner, size),
                          f=(2.0 * alpha * beta / size, beta), whole=(0, 1, 2, 3, 4), base_slot=4, module="lrn")

    def dropout_mask(self, mask, ratio, seed):
        self._elementwise("dropout_mask", mask.size, [mask, seed], u=(0, DROPOUT_KEY_MULTIPLIER,
                                                                       dropout_threshold(ratio)),
                          f=(1.0 / (1.0 - ratio),), whole=(1,), base_slot=3)

    def _update(self, entry: str, buffers: list, rate: Any, f: tuple) -> None:
        """A solver update over the per-element ``buffers`` (w, g, history...), reading the rate from ``rate``."""
        self._elementwise(entry, buffers[0].size, [rate, *buffers], f=f, whole=(0,), module="update")

    def clip_to_norm(self, x, sumsq, threshold):
        self._elementwise("clip_to_norm", x.size, [sumsq, x], f=(threshold,), whole=(0,), module="update")

    def momentum_update(self, w, g, h, rate, lr_mult, momentum):
        self._update("momentum_update", [w, g, h], rate, (lr_mult, momentum))

    def nesterov_update(self, w, g, h, prev, rate, lr_mult, momentum):
        self._update("nesterov_update", [w, g, h, prev], rate, (lr_mult, momentum))

    def adam_update(self, w, g, m, v, rate, lr_mult, beta1, beta2, eps):
        self._update("adam_update", [w, g, m, v], rate, (lr_mult, beta1, beta2, eps))

    def rmsprop_update(self, w, g, h, rate, lr_mult, decay, eps):
        self._update("rmsprop_update", [w, g, h], rate, (lr_mult, decay, 0.0, eps))

    def adagrad_update(self, w, g, h, rate, lr_mult, eps):
        self._update("adagrad_update", [w, g, h], rate, (lr_mult, 0.0, 0.0, eps))

    def adadelta_update(self, w, g, h, u, rate, lr_mult, decay, eps):
        self._update("adadelta_update", [w, g, h, u], rate, (lr_mult, decay, 0.0, eps))

    # --- sequences: embeddings and recurrent cells (sequence.wgsl, scatter.wgsl) -----------------------------
    def _seq_dispatch(self, module: str, entry: str, count: int, buffers: list, u: tuple = ()) -> None:
        """One dispatch of a thread per element over ``count`` elements, every buffer bound whole."""
        if module not in self._modules:  # built on first use
            self._modules[module] = self.device.create_shader_module(
                code=(_HERE / "params.wgsl").read_text() + (_HERE / f"{module}.wgsl").read_text())
        if count:
            self._dispatch(module, entry, _pack((count, *u)), buffers, self._grid(count))

    def embedding(self, ids, table, out):
        v, d = table.shape
        self._seq_dispatch("sequence", "embedding", out.size, [ids, table, out], (d, v))

    def embedding_grad(self, ids, dy, dtable, beta=0.0):
        if beta == 0.0:
            self.fill(0.0, dtable)
        elif beta != 1.0:
            self.scal(beta, dtable)
        v, d = dtable.shape
        self._seq_dispatch("scatter", "embedding_grad", dy.size, [ids, dy, dtable], (d, v))

    def lstm_cell(self, gates, hw, bias, c, h, hprev, y, t, sequence):
        n, steps, hs = c.shape
        self._seq_dispatch("sequence", "lstm_cell", n * hs, [gates, hw, bias, c, h, hprev, y],
                           (steps, hs, t, int(sequence)))

    def lstm_cell_grad(self, gates, c, dh, dy, dc, dgates, dgates_t, t, sequence):
        n, steps, hs = c.shape
        self._seq_dispatch("sequence", "lstm_cell_grad", n * hs, [gates, c, dh, dy, dc, dgates, dgates_t],
                           (steps, hs, t, int(sequence)))

    def gru_cell(self, pre, hw, bias_ih, bias_hh, hn, h, hprev, y, t, sequence):
        n, steps, hs = hn.shape
        self._seq_dispatch("sequence", "gru_cell", n * hs, [pre, hw, bias_ih, bias_hh, hn, h, hprev, y],
                           (steps, hs, t, int(sequence)))

    def gru_cell_grad(self, pre, hn, hprev, dh, dy, dpre, dpre_h, dpre_h_t, t, sequence):
        n, steps, hs = hn.shape
        self._seq_dispatch("sequence", "gru_cell_grad", n * hs, [pre, hn, hprev, dh, dy, dpre, dpre_h, dpre_h_t],
                           (steps, hs, t, int(sequence)))

    def rnn_cell(self, pre, hw, bias, h, hprev, y, t, sequence):
        n, steps, hs = pre.shape
        self._seq_dispatch("sequence", "rnn_cell", n * hs, [pre, hw, bias, h, hprev, y], (steps, hs, t, int(sequence)))

    def rnn_cell_grad(self, pre, dh, dy, dpre, dpre_t, t, sequence):
        n, steps, hs = pre.shape
        self._seq_dispatch("sequence", "rnn_cell_grad", n * hs, [pre, dh, dy, dpre, dpre_t],
                           (steps, hs, t, int(sequence)))



def _workgroup_each(count: int) -> tuple[int, int, int]:
    """A grid of one workgroup per item: item x + 65535 * y (a dimension holds at most 65535 workgroups)."""
    gx = min(count, 65535)
    return gx, -(-count // gx), 1


def _pad4(n: int) -> int:
    return max(4, (n + 3) // 4 * 4)


def _describe(adapter: Any) -> str:
    info = adapter.info
    return f"{info.get('device', '?')} ({info.get('backend_type', '?')})"


def adapters() -> list[str]:
    """Names of the WebGPU adapters on this machine (for ``lp.backend('webgpu', adapter=...)``)."""
    try:
        import wgpu
    except ImportError:
        return []
    return [_describe(a) for a in wgpu.gpu.enumerate_adapters_sync()]
