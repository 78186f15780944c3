"""The webgpu backend: WGSL compute shaders through wgpu-py, on any GPU WebGPU reaches (Vulkan, Metal, DX12).

How it stays fast: every dispatch is recorded into one command encoder (one compute pass) that is submitted once
per training step, or earlier when the host needs data (a download) or new data goes up (an upload), so a step has
no readback inside it; pipelines are cached per entry point, with sizes in uniform buffers (cached by content);
bind groups are cached; buffers are pooled by size and padded to 4 bytes; reads go through one reused MAP_READ
staging buffer; elementwise work larger than the device's storage-binding limit is split into bindable pieces, and
large launches use a 2-D grid to stay under the per-dimension workgroup limit.

The backend is composed of parts, one module each, every part given the parts below it and never reaching up
(tests/test_imports.py checks the order): view.py (WView, the array type), device.py (:class:`Device`: adapter,
device, limits, shader modules, pipeline, uniform and bind-group caches), encoder.py (:class:`Encoder`: the
command stream run as :class:`Dispatch` records, the held GEMM and split-K sum that later kernels may join,
recorded steps, profiling), allocator.py (:class:`Allocator`: the buffer pool, transfers, scratch), then the kernel
families — binding.py (splitting under the binding limit), reduce.py (sums), gemm.py (tiles, split-K),
elementwise.py (activations, updates, losses, batch norm, sequences, casts, the rest), conv.py (implicit GEMM,
Winograd, pooling) — and half.py (:class:`HalfPrecision`: at precision "fp16", a layer that wraps the backend's
primitives with float16 kernels and emulation). WebGPUBackend builds the parts and binds each family's methods as
its primitives. Each kernel family's parameters are a named struct in its .wgsl file, packed by keyword through
params.py; sources.py puts each shader module's WGSL together (the same text compiles in browsers).

Importing this module does not import wgpu; constructing the backend does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import BackendError, ConfigError
from ..base import OPTIONAL_HOOKS, PRECISIONS, PRIMITIVES, Backend
from ..recorder import StepRecorder
from .allocator import Allocator
from .binding import Binding
from .conv import Convolution
from .device import Device, adapters
from .elementwise import Elementwise
from .encoder import Encoder
from .gemm import Gemms
from .half import FullPrecision, HalfPrecision
from .reduce import Reductions
from .view import WView

__all__ = ["WView", "WebGPUBackend", "adapters"]

PARTS = ("gpu", "enc", "mem", "binding", "sums", "gemms", "elementwise", "convs")
"""The backend's parts, lowest first, by attribute name."""

_OWNERS = {"mem": Allocator, "sums": Reductions, "gemms": Gemms, "elementwise": Elementwise, "convs": Convolution}
"""The parts whose methods are the backend's primitives (and the optional hooks they define)."""


class _Primitive:
    """A primitive as the backend class shows it: the owning family's function (for signatures and the interface
    test). Each backend binds the family's method in its own ``__dict__``, which a call finds first, so a primitive
    call is the family's method with no call in between."""

    def __init__(self, part: str, function: Any) -> None:
        self.part = part
        self.function = function

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self.function
        return getattr(getattr(obj, self.part), self.function.__name__)


class WebGPUBackend(Backend):
    """WGSL compute shaders on one WebGPU adapter.

    ``power_preference``: "high-performance" or "low-power"; ``adapter``: a substring of the adapter's name to
    pick one explicitly (see :func:`adapters`); ``precision``: "fp32", or "fp16" (float16 activations and weight
    copies, float32 master weights) on an adapter that offers the shader-f16 feature; ``subgroups``: combine a
    workgroup's values in the reductions (sums, softmax rows) with subgroup operations — None (default) where the
    adapter offers the "subgroup" feature, True to require it, False for workgroup-memory trees everywhere.

    Attributes of the parts (tuning constants such as ``SPLIT_K_FINE_WORK``, ``replay``, counters such as
    ``dispatches``, limits such as ``max_binding``) read and set through the backend as if they were its own.
    """

    name = "webgpu"

    def __init__(self, dtype: Any = np.float32, power_preference: str = "high-performance",
                 adapter: str | None = None, precision: str = "fp32", subgroups: bool | None = None) -> None:
        _check(dtype, precision, power_preference)
        self.precision = precision
        self.dtype = np.dtype(np.float32)
        self.gpu = gpu = Device(precision, power_preference, adapter, subgroups)
        self.adapter_name = gpu.adapter_name
        self.emulated = gpu.emulated
        """Whether the adapter is a CPU emulation of a GPU (Mesa's lavapipe or llvmpipe): correct, but far slower
        than the native backend."""
        self.key = gpu.key
        self.enc = enc = Encoder(gpu)
        self.recorder = StepRecorder(self, self.MAX_RECORDED_STEPS)
        # the recorder's hooks, as recorder.Replayer names them: the encoder's
        self.__dict__.update(first_run=enc.first_run, capture=enc.capture, launch=enc.launch, handle=enc.handle)
        self.mem = Allocator(gpu, enc, self.recorder)
        self.binding = Binding(gpu, enc, self.mem)
        self.sums = Reductions(self.binding)
        self.gemms = Gemms(self.sums)
        self.elementwise = Elementwise(self.sums)
        self.convs = Convolution(self.gemms, self.elementwise)
        for name, primitive in _PRIMITIVES.items():
            self.__dict__[name] = getattr(getattr(self, primitive.part), name)
        if precision == "fp16":
            HalfPrecision(self.convs).wrap(self)

    # --- the parts' attributes as the backend's own ---------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        """An attribute of one of the parts (called only where the backend has none of its own)."""
        owner = self._part_with(name)
        if owner is None:
            raise AttributeError(f"'WebGPUBackend' object has no attribute {name!r}")
        return getattr(owner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        owner = self._owner(name)
        if owner is None:
            object.__setattr__(self, name, value)
        else:
            setattr(owner, name, value)

    def __delattr__(self, name: str) -> None:
        owner = self._owner(name)
        if owner is None:
            object.__delattr__(self, name)
        else:
            delattr(owner, name)

    def _owner(self, name: str) -> Any:
        """The part that holds attribute ``name``, where the backend itself does not."""
        if name in self.__dict__ or name in PARTS or hasattr(type(self), name):
            return None
        return self._part_with(name)

    def _part_with(self, name: str) -> Any:
        """The lowest part that has attribute ``name``, or None."""
        for part in PARTS:
            owner = self.__dict__.get(part)
            if owner is not None and hasattr(owner, name):
                return owner
        return None

    # --- hooks ------------------------------------------------------------------------------------------------
    replay = True
    """Replay replayable training steps from their recorded dispatches (see :meth:`run_step`)."""
    MAX_RECORDED_STEPS = 8

    def run_step(self, key: Any, step: Any) -> None:
        """A training step is encoded into one command buffer and submitted once. A replayable step (``key`` not
        None) is recorded on its second sight as the list of its dispatches (pipeline, bind group, grid) and from
        then on encoded straight from that list, without running the layers' Python, while the tensors it touches
        keep their buffers (see recorder.StepRecorder)."""
        if not self.replay or self.enc.kernel_times is not None:
            key = None
        self.recorder.run(key, step)
        self.enc.flush()

    def sum_squares(self, xs, out, ws, scale=None):
        # float32 gradients (the master dtype's): a dispatch per gradient, unscaling and squaring in one pass, and one
        # sum of all the partial sums (Backend's: three or four dispatches a gradient)
        if not xs or any(np.dtype(x.dtype) != np.float32 for x in xs):
            return super().sum_squares(xs, out, ws, scale)
        self.sums.square_sums(list(xs), out, scale)

    @property
    def replays(self) -> int:
        """Steps encoded from a recording so far."""
        return self.recorder.replays

    def full_precision(self) -> Backend:
        if self.precision == "fp32":
            return self
        twin = self.__dict__.get("_twin")
        if twin is None:
            twin = self.__dict__["_twin"] = FullPrecision(self)
        return twin


_PRIMITIVES = {name: _Primitive(part, vars(cls)[name]) for part, cls in _OWNERS.items()
               for name in (*PRIMITIVES, *OPTIONAL_HOOKS) if name in vars(cls)}
"""Each primitive (and optional hook) a family defines, as the backend class shows it."""
for _name, _primitive in _PRIMITIVES.items():
    setattr(WebGPUBackend, _name, _primitive)


def _check(dtype: Any, precision: str, power_preference: str) -> None:
    """The constructor's arguments that need no device, checked."""
    if np.dtype(dtype) != np.float32:
        raise ConfigError(f"backend 'webgpu': WGSL computes in float32 only, got dtype {np.dtype(dtype)}")
    if precision not in PRECISIONS:
        raise ConfigError(f"backend 'webgpu': unknown precision {precision!r}; valid precisions: "
                          f"{', '.join(PRECISIONS)}")
    if precision in _REFUSED:
        raise BackendError(f"backend 'webgpu': precision {precision!r} is not available: {_REFUSED[precision]}")
    if power_preference not in ("high-performance", "low-power"):
        raise ConfigError(f"backend 'webgpu': power_preference must be 'high-performance' or 'low-power', "
                          f"got {power_preference!r}")


_REFUSED = {
    "bf16": "WGSL has no bfloat16 type; use precision='fp16' (where the adapter offers shader-f16) or 'fp32'",
    "tf32": "WebGPU has no TF32 tensor-core mode; use precision='fp32' (or 'fp16' where the adapter offers "
            "shader-f16)",
}
"""Why the webgpu backend refuses a precision."""
