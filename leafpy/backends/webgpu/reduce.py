"""The webgpu backend's reductions (reduce.wgsl): dot products and norms as partial sums of blocks, sums of rows or
columns with a workgroup per output, and per-channel sums. Uses the binding family below it."""

from __future__ import annotations

from ...errors import BackendError
from .binding import Family
from .encoder import workgroup_each
from .params import ReduceParams
from .view import WView


def _module(entry: str, buffers: list) -> str:
    """The sums' module: "reduce16" (its first array float16) where the summed tensor is float16, "reduce16b" (its
    second array float16) where sum_rows writes a float16 result (split-K's partials summed into a float16
    product)."""
    if buffers[0].dtype.itemsize == 2:
        return "reduce16"
    return "reduce16b" if entry == "sum_rows" and buffers[1].dtype.itemsize == 2 else "reduce"


class Reductions(Family):
    """Sums."""

    PARTS_BLOCK = 16384
    """Elements per workgroup in the first pass of a long reduction."""

    def _reduce(self, entry: str, buffers: list, groups: tuple[int, int, int], **values: float) -> None:
        for v in buffers:
            if v.raw.size > self.gpu.max_binding:
                raise BackendError(f"webgpu: a {v.raw.size}-byte operand of {entry} exceeds the storage binding limit")
        self._dispatch(_module(entry, buffers), entry, ReduceParams(**values), buffers, groups)

    def dot(self, x, y, out):
        if x.raw is y.raw:
            return self.sum_parts("square_parts", [x], x.size, [1], out)
        self.sum_parts("dot_parts", [x, y], x.size, [1, 1], out)

    def sum_parts(self, entry: str, inputs: list, count: int, per_item: list, out: WView, alpha: float = 1.0,
                  classes: int = 0) -> None:
        """out[0] = alpha * (sum of the entry's terms over ``count`` items): partial
        sums of blocks, a workgroup each, over runs of items whose bindings fit, then one sum of the partials."""
        runs, blocks, length = self._blocks(count, per_item)
        parts = self._scratch_buffer(blocks * len(runs), "parts")
        for i, (i0, i1, binds, offsets) in enumerate(runs):
            params = ReduceParams(count=i1 - i0, classes=classes, block=length, first_block=i * blocks,
                                  **dict(zip(("a_offset", "b_offset"), offsets)))
            self._dispatch("reduce", entry, params, [*inputs, parts], (blocks, 1, 1), [*binds, None])
        self._reduce("sum_rows", [parts, out], (1, 1, 1), length=blocks * len(runs), rows=1, alpha=alpha)

    def _blocks(self, count: int, per_item: list) -> tuple[list, int, int]:
        """A long reduction's runs (item_chunks), workgroups per run and items per workgroup."""
        runs = self._item_chunks(count, per_item)
        longest = max(run[1] - run[0] for run in runs)
        blocks = max(1, min(self.gpu.max_groups, -(-longest // self.PARTS_BLOCK)))
        return runs, blocks, -(-longest // blocks)

    def square_sums(self, xs: list, out: WView, scale: WView | None) -> None:
        """out[0] = the sum of the squares of every element of the float32 tensors ``xs``, each first unscaled in
        place where ``scale`` is given (Backend.sum_squares): a dispatch per tensor (per run of it that fits a
        binding) writing its partial sums beside the others', then one sum of them all."""
        plans = [(x, *self._blocks(x.size, [1])) for x in xs]
        parts = self._scratch_buffer(sum(blocks * len(runs) for _, runs, blocks, _ in plans), "parts")
        entry, extra = ("square_parts", []) if scale is None else ("unscale_square_parts", [scale])
        first = 0
        for x, runs, blocks, length in plans:
            for i0, i1, binds, offsets in runs:
                params = ReduceParams(count=i1 - i0, block=length, first_block=first, a_offset=offsets[0])
                self._dispatch("reduce", entry, params, [x, parts, *extra], (blocks, 1, 1),
                               [*binds, None, *(None for _ in extra)])
                first += blocks
        self._reduce("sum_rows", [parts, out], (1, 1, 1), length=first, rows=1, alpha=1.0)

    def channel_sums(self, dy, db, alpha: float, beta: float) -> None:
        """db = alpha * (sums of dy over all axes but 1) + beta * db: per channel, partial sums over blocks of the
        batch in parallel, then one sum of the partials each."""
        n, c = dy.shape[0], dy.shape[1]
        inner = dy.size // (n * c)
        if inner == 1 and dy.raw.size <= self.gpu.max_binding:  # [N, C] (linear layers): column sums, one pass
            return self.sum_rows(dy, db, n, c, alpha, beta, columns=True)
        runs = self._item_chunks(n, [c * inner])  # runs of samples whose binding fits
        per = max(run[1] - run[0] for run in runs) * inner
        blocks = max(1, min(256, -(-per // 4096), self.gpu.max_groups))  # per run
        length = -(-per // blocks)
        total = blocks * len(runs)
        part = self._scratch_buffer(c * total, "bias_part")
        for i, (n0, n1, (bind,), (offset,)) in enumerate(runs):
            params = ReduceParams(count=n1 - n0, channels=c, inner=inner, blocks=total, block=length,
                                  first_block=i * blocks, a_offset=offset)
            self._dispatch(_module("bias_grad_part", [dy]), "bias_grad_part", params, [dy, part], (c, blocks, 1),
                              [bind, None])
        self.sum_rows(part, db, total, c, alpha, beta)

    def sum_rows(self, a, out, length: int, rows: int, alpha: float, beta: float, columns: bool = False) -> None:
        """out[r] = alpha * (sum of row r of a [rows x length], or of column r of a [length x rows]) + beta * out[r],
        one workgroup per output."""
        self._reduce("sum_rows", [a, out], workgroup_each(rows), length=length, rows=rows, columns=int(columns),
                     alpha=alpha, beta=beta)
