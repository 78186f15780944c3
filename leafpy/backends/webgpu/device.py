"""The webgpu backend's device part: the adapter and the device opened on it (limits, features), and what is
compiled or created once per device and cached — shader modules, compute pipelines, uniform buffers (by content)
and bind groups — with the float16 decisions that are module names (which build of a .wgsl file a call's dtypes
need). Every other part of the backend uses this one; it uses none of them."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

from ...errors import BackendError, BackendUnavailable
from .params import ParamStruct
from .sources import BASE, F16_OPEN, lanes, module_source

_ADAPTERS: dict[tuple, Any] = {}
"""The adapter chosen for each (power_preference, adapter) request in this process."""
_DEVICES: dict[tuple, Any] = {}
"""The wgpu devices opened in this process, by request and features. Every backend asking for the same adapter
with the same features shares one: opening a device costs tens of milliseconds and driver resources (a process
that opened one for each of its ~145 backends, the webgpu test suite, died at exit on NVIDIA's Vulkan driver;
sharing them ended that), and a device holds nothing of a backend's: each backend keeps its own tensors' key,
buffers, encoder and caches, and its buffers go when it goes. A lost device stays lost for all of them."""


class Device:
    """A backend's part on one WebGPU device: the device (shared, see ``_DEVICES``) and this backend's caches (see
    :class:`WebGPUBackend` for the arguments)."""

    def __init__(self, precision: str, power_preference: str, adapter: str | None, subgroups: bool | None) -> None:
        try:
            import wgpu
        except ImportError as e:
            raise BackendUnavailable("backend 'webgpu' needs wgpu-py, which is not installed: "
                                     "pip install wgpu (the webgpu extra)") from e
        self.wgpu = wgpu
        _runtime_dir()
        request = (power_preference, adapter)
        chosen = _ADAPTERS.get(request)
        if chosen is None:
            chosen = _ADAPTERS[request] = _choose(wgpu, power_preference, adapter)
        self.adapter = chosen
        self.adapter_name = _describe(chosen)
        self.emulated = chosen.info.get("adapter_type") == "CPU"
        features = self._features(set(chosen.features), precision, subgroups)
        opened = (request, tuple(features))
        device = _DEVICES.get(opened)
        if device is None:
            limits = chosen.limits
            want = {k: limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size",
                                           "max-compute-workgroup-storage-size") if k in limits}
            try:
                device = chosen.request_device_sync(required_limits=want, required_features=features)
            except Exception as e:
                raise BackendUnavailable(f"backend 'webgpu': could not open {self.adapter_name}: {e}") from e
            _DEVICES[opened] = device
        self.device: Any = device
        self.key = f"webgpu:{id(self):x}"
        """The backend's name in SharedTensor's copies (its ``key``): its own, though the wgpu device may be shared
        (a copy holds its backend, so the name is not reused while a copy lives)."""
        lim = self.device.limits
        self.max_binding = int(lim["max-storage-buffer-binding-size"])
        self.max_groups = int(lim["max-compute-workgroups-per-dimension"])
        self.offset_align = int(lim["min-storage-buffer-offset-alignment"])
        self.queue = self.device.queue
        self.can_profile = "timestamp-query" in features
        self.has_f16 = precision == "fp16"
        """Whether the device was opened with shader-f16 (float16 buffers and WGSL's f16 type)."""
        self.lanes = lanes(self.subgroups)
        """The WGSL of reduce_workgroup this device's reductions are built with (lanes*.wgsl)."""
        self.modules = {m: self.shader(m) for m in (*BASE, *(F16_OPEN if self.has_f16 else ()))}
        self.pipelines: dict = {}
        self.uniforms: dict = {}
        self.bind_groups: dict = {}
        self._typed_params: dict[str, ParamStruct] = {}

    def _features(self, offered: set, precision: str, subgroups: bool | None) -> list[str]:
        """The features to open the device with, checked against what the adapter offers."""
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
        return features

    # --- compiled once, cached ------------------------------------------------------------------------------
    def shader(self, module: str) -> Any:
        """Shader module ``module`` compiled on this device (its WGSL from sources.module_source)."""
        return self.device.create_shader_module(code=module_source(module, self.subgroups))

    def module(self, name: str) -> str:
        """``name``, its shader module built on first use."""
        if name not in self.modules:
            self.modules[name] = self.shader(name)
        return name

    def rebuild(self, module: str) -> None:
        """Compile ``module`` again (its source changed: a line added to updates.TABLE) and drop its pipelines."""
        self.modules[module] = self.shader(module)
        self.pipelines = {k: p for k, p in self.pipelines.items() if k[0] != module}

    def pipeline(self, module: str, entry: str, constants: tuple = ()) -> Any:
        """The compute pipeline of an entry point, specialised by pipeline-overridable ``constants`` (name, value)
        pairs: a GEMM operand's transpose, a convolution's or pooling's geometry (divisions by constants are cheap);
        sizes that only bound loops travel in uniforms."""
        key = (module, entry, constants)
        p = self.pipelines.get(key)
        if p is None:
            stage = {"module": self.modules[module], "entry_point": entry}
            if constants:
                stage["constants"] = dict(constants)
            p = self.pipelines[key] = self.device.create_compute_pipeline(layout="auto", compute=stage)
        return p

    def uniform(self, data: bytes) -> Any:
        """The uniform buffer holding ``data`` (cached by content; the encoder bounds the cache)."""
        buf = self.uniforms[data] = self.device.create_buffer_with_data(data=data, usage=self.wgpu.BufferUsage.UNIFORM)
        return buf

    def bind_group(self, key: tuple, entry: str) -> Any:
        """The bind group of ``key`` = (pipeline, uniform buffer, raw buffers, their (offset, size) ranges or None),
        created and cached (the key keeps its buffers alive while the group is cached)."""
        pipe, ubuf, raws, ranges = key
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
        self.bind_groups[key] = bg
        return bg

    def forget_bindings(self) -> None:
        """Drop the cached uniform buffers and bind groups (the encoder submits the work using them first)."""
        self.uniforms.clear()
        self.bind_groups.clear()

    # --- float16 builds of a module, by the dtypes of a call's operands --------------------------------------
    def epilogue_module(self, base: str, halves: list[str]) -> str:
        """``base``.wgsl (a module with window.wgsl and the pointwise epilogue: gemm, winograd) with the arrays
        named ``halves`` declared float16 (sources names the arrays that follow them), built on first use;
        ``base`` itself where there are none."""
        return self.module(f"{base}16{''.join(halves)}") if halves else base

    def typed(self, params: ParamStruct, buffers: Sequence, arrays: Sequence[str]) -> ParamStruct:
        """The parameter struct, and so the module, of a kernel whose arrays (named ``arrays`` in its .wgsl, in
        binding order) are bound to ``buffers``: ``params`` where all are 4-byte, else its module rebuilt with the
        arrays bound to float16 buffers declared float16 (built on first use, named by those arrays:
        batchnorm16ac is batchnorm.wgsl with a and c float16)."""
        halves = "".join([name for name, b in zip(arrays, buffers) if b.dtype.itemsize == 2])
        if not halves:
            return params
        module = f"{params.module}16{halves}"
        typed = self._typed_params.get(module)
        if typed is None:
            self.module(module)
            typed = self._typed_params[module] = ParamStruct(params.name, module,
                                                             list(zip(params.fields, params.kinds)))
        return typed


def _choose(wgpu: Any, power_preference: str, adapter: str | None) -> Any:
    """The adapter: the first whose name holds ``adapter``, or the one wgpu picks for ``power_preference``."""
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
        raise BackendUnavailable(f"backend 'webgpu': no WebGPU adapter ({e}); on Linux install a Vulkan driver "
                                 "(e.g. Debian's mesa-vulkan-drivers and libvulkan1)") from e
    if chosen is None:
        raise BackendUnavailable("backend 'webgpu': no WebGPU adapter found; on Linux install a Vulkan driver "
                                 "(e.g. Debian's mesa-vulkan-drivers and libvulkan1)")
    return chosen


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
