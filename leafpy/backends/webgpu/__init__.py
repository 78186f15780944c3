"""The webgpu backend: WGSL compute shaders through wgpu-py, on any GPU WebGPU reaches (Vulkan, Metal, DX12).

How it stays fast: every dispatch is recorded into one command encoder (one compute pass) that is submitted once
per training step, or earlier when the host needs data (a download) or new data goes up (an upload), so a step has
no readback inside it; pipelines are cached per entry point, with sizes in uniform buffers (cached by content);
bind groups are cached; buffers are pooled by size and padded to 4 bytes; reads go through one reused MAP_READ
staging buffer; elementwise work larger than the device's storage-binding limit is split into bindable pieces, and
large launches use a 2-D grid to stay under the per-dimension workgroup limit.

The backend is built in layers, one module each, every layer using the ones below it: encoder.py (the command
stream, pipelines, bind groups, pending GEMM fusion, recorded steps, profiling), buffers.py (WView, the buffer
pool, transfers, scratch), binding.py (splitting under the binding limit), reduce.py (sums), gemm.py (tiles,
split-K), elementwise.py (activations, updates, losses, batch norm, sequences, the rest), conv.py (implicit
GEMM, Winograd, pooling) and half.py (float16: conversions, emulated primitives); WebGPUBackend adds the device
set-up. Each kernel family's parameters are a named struct in its .wgsl file, packed by keyword through params.py;
sources.py puts each shader module's WGSL together (the same text compiles in browsers).

Importing this module does not import wgpu; constructing the backend does.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from ...errors import BackendError, BackendUnavailable, ConfigError
from .. import pointwise
from ..base import PRECISIONS
from ..recorder import StepRecorder
from .half import Half
from .sources import BASE, lanes
from .view import WView

__all__ = ["WView", "WebGPUBackend", "adapters"]


class WebGPUBackend(Half):
    """WGSL compute shaders on one WebGPU adapter.

    ``power_preference``: "high-performance" or "low-power"; ``adapter``: a substring of the adapter's name to
    pick one explicitly (see :func:`adapters`); ``precision``: "fp32", or "fp16" (float16 activations and weight
    copies, float32 master weights) on an adapter that offers the shader-f16 feature; ``subgroups``: combine a
    workgroup's values in the reductions (sums, softmax rows) with subgroup operations — None (default) where the
    adapter offers the "subgroup" feature, True to require it, False for workgroup-memory trees everywhere.
    """

    name = "webgpu"

    def __init__(self, dtype: Any = np.float32, power_preference: str = "high-performance",
                 adapter: str | None = None, precision: str = "fp32", subgroups: bool | None = None) -> None:
        if np.dtype(dtype) != np.float32:
            raise ConfigError(f"backend 'webgpu': WGSL computes in float32 only, got dtype {np.dtype(dtype)}")
        if precision not in PRECISIONS:
            raise ConfigError(f"backend 'webgpu': unknown precision {precision!r}; valid precisions: "
                              f"{', '.join(PRECISIONS)}")
        if precision in _REFUSED:
            raise BackendError(f"backend 'webgpu': precision {precision!r} is not available: {_REFUSED[precision]}")
        self.precision = precision
        if power_preference not in ("high-performance", "low-power"):
            raise ConfigError(f"backend 'webgpu': power_preference must be 'high-performance' or 'low-power', "
                              f"got {power_preference!r}")
        self.dtype = np.dtype(np.float32)
        try:
            import wgpu
        except ImportError as e:
            raise BackendUnavailable("backend 'webgpu' needs wgpu-py, which is not installed: "
                                     "pip install wgpu (the webgpu extra)") from e
        self.wgpu = wgpu
        _runtime_dir()
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
        self.emulated = chosen.info.get("adapter_type") == "CPU"
        """Whether the adapter is a CPU emulation of a GPU (Mesa's lavapipe or llvmpipe): correct, but far slower
        than the native backend."""
        limits = chosen.limits
        want = {k: limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size",
                                       "max-compute-workgroup-storage-size") if k in limits}
        offered = set(chosen.features)
        if precision == "fp16" and "shader-f16" not in offered:
            raise BackendError(f"backend 'webgpu': precision 'fp16' needs the adapter's shader-f16 feature, which "
                               f"{self.adapter_name} does not offer; use precision='fp32' here, or another adapter "
                               f"(lp.backend('webgpu', adapter=...); see leafpy.backends.webgpu.adapters())")
        if subgroups and "subgroup" not in offered:
            raise BackendError(f"backend 'webgpu': subgroups=True needs the adapter's subgroup feature, which "
                               f"{self.adapter_name} does not offer; leave subgroups=None (used where offered)")
        self.subgroups = subgroups is not False and "subgroup" in offered
        """Whether the reductions use subgroup operations (lanes_subgroup.wgsl) on this device."""
        features = [f for f in ("timestamp-query",) if f in offered]
        if precision == "fp16":
            features.append("shader-f16")
        if self.subgroups:
            features.append("subgroup")
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
        self._inplace = pointwise.wgsl_inplace()  # entry -> (output position, the input position it may overwrite)
        self.lanes = lanes(self.subgroups)
        self._modules = {m: self._shader(m) for m in BASE}
        self._pipelines: dict = {}
        self._uniforms: dict = {}
        self._bind_groups: dict = {}
        self._scratch: dict = {}
        self._free: dict[int, list] = {}  # buffer pool: byte size -> buffers no tensor holds
        self._encoder: Any = None
        self._pending: dict | None = None  # the last GEMM, not yet encoded: a bias or activation may join its store
        self._pending_sum: dict | None = None  # a split-K product's sum, not yet encoded: a recurrent cell may do it
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
        self.has_f16 = precision == "fp16"
        if self.has_f16:
            self._enable_f16()


_REFUSED = {
    "bf16": "WGSL has no bfloat16 type; use precision='fp16' (where the adapter offers shader-f16) or 'fp32'",
    "tf32": "WebGPU has no TF32 tensor-core mode; use precision='fp32' (or 'fp16' where the adapter offers "
            "shader-f16)",
}
"""Why the webgpu backend refuses a precision."""


def _runtime_dir() -> None:
    """Give Mesa's drivers a valid XDG_RUNTIME_DIR (a private temporary directory) where the environment has none,
    so that opening an adapter does not print "XDG_RUNTIME_DIR is invalid or not set" lines; nothing is written
    there by a compute device."""
    current = os.environ.get("XDG_RUNTIME_DIR", "")
    if current and os.path.isdir(current) and os.access(current, os.W_OK):
        return
    path = tempfile.mkdtemp(prefix="leafpy-xdg-")  # made with mode 0700, as Mesa wants
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["XDG_RUNTIME_DIR"] = path


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
