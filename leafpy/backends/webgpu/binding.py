"""Splitting work whose tensors exceed the device's storage-binding limit: aligned binding ranges, runs of items
that fit, and elementwise kernels bound piece by piece (with in-place variants or scratch where outputs alias).
The lowest kernel family: uses the device part, the encoder and the allocator."""

from __future__ import annotations

from operator import attrgetter

from ...errors import BackendError
from .. import pointwise
from .allocator import Allocator
from .device import Device
from .encoder import Encoder
from .params import PER_THREAD, ElementwiseParams, ParamStruct
from .view import pad4

_raw = attrgetter("raw")
_NONE: frozenset[int] = frozenset()


ElementwiseHalfParams = ElementwiseParams.feeding("elementwise16", PER_THREAD)
"""ElementwiseParams, feeding the float16 elementwise module (elementwise16: copies, blocks and the activations'
float16 twins), whose threads handle PER_THREAD elements each."""
SplitSumHalfParams = ElementwiseParams.feeding("elementwise16")
"""ElementwiseParams feeding elementwise16's split_sum_h, one output a thread."""


def inplace_entries(f16: bool) -> dict[str, tuple[int, int]]:
    """Elementwise entry points with an in-place twin: entry -> (output position, the input position it may
    overwrite), as pointwise.wgsl_inplace() says, with the float16 module's (``f16``)."""
    entries = pointwise.wgsl_inplace()
    if f16:
        entries |= {ln.entry + "_h": (1, 0) for ln in pointwise.TABLE.values()} | \
            {ln.name + "_grad_h": (2, 1) for ln in pointwise.TABLE.values()} | {"mul_h": (2, 0), "mul_hf": (2, 0)}
    return entries


class Binding:
    """Binding-limit splitting."""

    def __init__(self, gpu: Device, enc: Encoder, mem: Allocator) -> None:
        self.gpu = gpu
        self.enc = enc
        self.mem = mem
        self.inplace = inplace_entries(gpu.has_f16)

    def span(self, start: int, end: int) -> tuple[int, int, int]:
        """A binding of bytes [start, end) of a buffer: (offset aligned down, size, elements from there to start)."""
        align = self.gpu.offset_align
        base = start // align * align
        return base, pad4(end - base), (start - base) // 4

    def item_chunks(self, count: int, per_item: list[int]) -> list[tuple[int, int, list, list]]:
        """Split ``count`` items (samples, planes), each of ``per_item[i]`` elements in bound tensor i, into runs
        whose bindings fit the device's limit: (first, last + 1, binding ranges, element offsets) with a (byte
        offset, size) range and the run's element offset in it per tensor; one run of whole bindings (None
        ranges) and zero offsets where everything fits."""
        limit = self.gpu.max_binding
        biggest = 4 * max(per_item)
        if count * biggest <= limit:
            return [(0, count, [None] * len(per_item), [0] * len(per_item))]
        step = (limit - self.gpu.offset_align) // biggest
        if step < 1:
            raise BackendError(f"webgpu: one item of {biggest} bytes exceeds the storage binding limit "
                               f"of {limit} bytes")
        runs = []
        for i0 in range(0, count, step):
            i1 = min(count, i0 + step)
            spans = [self.span(i0 * e * 4, i1 * e * 4) for e in per_item]
            runs.append((i0, i1, [sp[:2] for sp in spans], [sp[2] for sp in spans]))
        return runs

    def elementwise(self, entry: str, n: int, buffers: list, params: ParamStruct, whole: tuple[int, ...] = (),
                    **values: float) -> None:
        """Run an elementwise entry point of ``params``' module over n elements, with the struct's fields ``values``
        and, per dispatch, ``count`` (its elements) and, where the struct has it, ``base`` (the index of its first
        element). Buffers at positions in ``whole`` are bound entirely; the others are per-element and, past the
        binding limit, bound piece by piece. An output that aliases an input (an in-place layer) runs the entry's
        in-place variant where one exists; otherwise it is computed into scratch and copied back, as WebGPU forbids
        aliased writable bindings."""
        if n == 0:
            return
        raws = list(map(_raw, buffers))
        alias = {i for i in range(1, len(raws)) if raws[i] in raws[:i]} if len(set(map(id, raws))) < len(raws) \
            else _NONE
        if alias:
            inplace = self.inplace.get(entry)
            if inplace and alias == {inplace[0]} and raws[inplace[0]] is raws[inplace[1]]:
                # a kernel that overwrites its input: bind the buffer once
                entry, alias = entry + "_inplace", _NONE
                buffers = buffers[:inplace[0]] + buffers[inplace[0] + 1:]
        real = buffers
        if alias:
            buffers = list(buffers)
            for i in alias:
                buffers[i] = self.mem.scratch(n, f"alias{i}")
        align = self.gpu.offset_align
        piece = (self.gpu.max_binding // 4 // align) * align
        based = "base" in params.fields
        for start in range(0, n, piece):
            count = min(piece, n - start)
            ranges: list = []
            for i, b in enumerate(buffers):
                size = b.dtype.itemsize
                ranges.append(None if i in whole else (start * size, pad4(count * size)))
            packed = params(count=count, base=start, **values) if based else params(count=count, **values)
            self.enc.dispatch(params.module, entry, packed, buffers, self.enc.grid(-(-count // params.per_thread)),
                              ranges)
        for i in alias:
            self.elementwise("copy", n, [buffers[i], real[i]], ElementwiseParams)


class Family:
    """A kernel family's hold on the parts below it: the device part, the encoder, the allocator and the binding
    family, with shorthands for the methods every family calls (bound once, not looked up per call)."""

    def __init__(self, binding: Binding) -> None:
        self.gpu, self.enc, self.mem, self.binding = binding.gpu, binding.enc, binding.mem, binding
        self._dispatch = binding.enc.dispatch
        self._grid = binding.enc.grid
        self._scratch_buffer = binding.mem.scratch
        self._elementwise = binding.elementwise
        self._item_chunks = binding.item_chunks
        self._span = binding.span
        self._typed = binding.gpu.typed
