"""Splitting work whose tensors exceed the device's storage-binding limit: aligned binding ranges, runs of items
that fit, and elementwise kernels bound piece by piece (with in-place variants or scratch where outputs alias)."""

from __future__ import annotations

from ...errors import BackendError
from .buffers import Buffers
from .params import ElementwiseParams, ParamStruct
from .view import pad4


class Binding(Buffers):
    """Binding-limit splitting."""

    offset_align: int
    _inplace: dict

    def _span(self, start: int, end: int) -> tuple[int, int, int]:
        """A binding of bytes [start, end) of a buffer: (offset aligned down, size, elements from there to start)."""
        base = start // self.offset_align * self.offset_align
        return base, pad4(end - base), (start - base) // 4

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

    def _elementwise(self, entry: str, n: int, buffers: list, params: ParamStruct, whole: tuple[int, ...] = (),
                     **values: float) -> None:
        """Run an elementwise entry point of ``params``' module over n elements, with the struct's fields ``values``
        and, per dispatch, ``count`` (its elements) and, where the struct has it, ``base`` (the index of its first
        element). Buffers at positions in ``whole`` are bound entirely; the others are per-element and, past the
        binding limit, bound piece by piece. An output that aliases an input (an in-place layer) runs the entry's
        in-place variant where one exists; otherwise it is computed into scratch and copied back, as WebGPU forbids
        aliased writable bindings."""
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
        based = "base" in params.fields
        for start in range(0, n, piece):
            count = min(piece, n - start)
            ranges = [None if i in whole else (start * b.dtype.itemsize, pad4(count * b.dtype.itemsize))
                      for i, b in enumerate(buffers)]
            packed = params(count=count, base=start, **values) if based else params(count=count, **values)
            self._dispatch(params.module, entry, packed, buffers, self._grid(count), ranges)
        for i in alias:
            self._elementwise("copy", n, [buffers[i], real[i]], ElementwiseParams)
