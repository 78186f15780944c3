"""The webgpu backend's other kernels: BLAS level 1, activations (generated from pointwise.TABLE), softmax,
losses, bias, batch normalisation, Concat/Slice blocks, LRN, dropout, solver updates, embeddings and recurrent
cells, and casts between float32 and float16 (half.wgsl). Uses the reductions family (sums, losses, batch
statistics) and the binding family below it."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import BackendError
from .. import pointwise, updates
from ..array import (
    DROPOUT_KEY_MULTIPLIER,
    broadcast,
    dropout_threshold,
    matmul,
    nll_backward,
    nll_forward,
    permute,
    reduce_to,
)
from .binding import ElementwiseHalfParams, Family
from .encoder import workgroup_each
from .params import (
    PER_THREAD,
    BatchNormParams,
    ClassesParams,
    ElementwiseParams,
    HalfParams,
    LrnParams,
    ParamStruct,
    ScatterParams,
    SequenceParams,
    UpdateParams,
)
from .reduce import Reductions
from .view import WView, pad4

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
UpdateRuleParams = UpdateParams.feeding("update", PER_THREAD)
"""UpdateParams, feeding the rules' entry points (``NAME_update``: PER_THREAD elements a thread)."""
UpdateHalfParams = UpdateParams.feeding("update16", PER_THREAD)
"""UpdateParams, feeding update16 (the update rules' twins that also write a weight's float16 copy)."""


def _act(params: tuple) -> dict[str, float]:
    """An activation's parameters (in its pointwise.TABLE line's order) as ElementwiseParams fields."""
    return {f"act{i}": v for i, v in enumerate(params)}


def _cell(steps: int, hidden: int, t: int, sequence: bool) -> dict[str, int]:
    """A recurrent cell's SequenceParams fields."""
    return {"steps": steps, "hidden": hidden, "step": t, "every_step": int(sequence)}


class Elementwise(Family):
    """Elementwise, per-row and per-channel kernels."""

    def __init__(self, sums: Reductions) -> None:
        super().__init__(sums.binding)
        self.sums = sums

    _update_rules: frozenset = frozenset(updates.TABLE.values())
    """The lines of updates.TABLE the update module was built with (at least the table's own)."""

    def axpby(self, alpha, x, beta, y):
        if beta == 0.0 and alpha == 1.0:
            return self.copy(x, y)
        self._elementwise("axpby", y.size, [x, y], ElementwiseParams, alpha=alpha, beta=beta)

    def scal(self, alpha, x):
        self._elementwise("scal", x.size, [x], ElementwiseParams, alpha=alpha)

    def copy(self, x, out):
        if x.raw is out.raw:
            return
        if x.dtype == F16 and out.dtype == F16:  # the elementwise16 module's (a cast between float16 buffers)
            return self._elementwise("copy_h", out.size, [x, out], ElementwiseHalfParams)
        self._elementwise("copy", out.size, [x, out], ElementwiseParams)

    def fill(self, value, out):
        self._elementwise("fill", out.size, [out], ElementwiseParams, value=value)

    def mul(self, x, y, out):
        self._elementwise("mul", out.size, [x, y, out], ElementwiseParams)

    def maximum(self, x, y, out):
        self._elementwise("maximum", out.size, [x, y, out], ElementwiseParams)

    # --- activations: entry points generated from pointwise.TABLE ----------------------------------------------------
    def activation(self, kind, x, out, params=()):
        line = pointwise.line(kind)
        if x.raw is out.raw:
            if self.enc.fuse(out, kind, params=params):
                return
        elif line.reads == "x" and self.enc.fuse(x, kind, params=params, into=out):
            # an activation whose gradient reads x never runs in place: it joins the GEMM's store beside the product
            return
        self._elementwise(line.entry, out.size, [x, out], ElementwiseParams, **_act(params))

    def activation_grad(self, kind, src, dy, dx, params=()):
        self._elementwise(pointwise.line(kind).name + "_grad", dx.size, [src, dy, dx], ElementwiseParams,
                          **_act(params))

    def rows(self, a: WView) -> tuple[int, int, int]:
        n, c = a.shape[0], a.shape[1]
        inner = a.size // (n * c) if n * c else 1
        return n * inner, c, inner

    LONG_ROWS = 64
    """Rows of at least this many classes are reduced by a workgroup each, shorter ones by a thread each."""

    def class_dispatch(self, entry: str, rows: int, c: int, inner: int, log: bool, buffers: list,
                       module: str = "classes") -> None:
        """Over runs of samples whose bindings fit the device's limit (``module``: a float16 build, classes16a or
        classes16c)."""
        n = rows // inner
        for n0, n1, binds, offsets in self._item_chunks(n, [c * inner] * len(buffers)):
            count = (n1 - n0) * inner
            params = ClassesParams(count=count, classes=c, inner=inner, is_log=int(log),
                                   **dict(zip(("a_offset", "b_offset", "c_offset"), offsets)))
            if c >= self.LONG_ROWS:
                self._dispatch(module, entry + "_rows", params, buffers, workgroup_each(count), binds)
            else:
                self._dispatch(module, entry, params, buffers, self._grid(count), binds)

    def softmax(self, x, out):
        self.class_dispatch("softmax", *self.rows(x), False, [x, out])

    def log_softmax(self, x, out):
        self.class_dispatch("softmax", *self.rows(x), True, [x, out])

    def softmax_grad(self, y, dy, dx):
        self._class_grad(y, dy, dx, log=False)

    def log_softmax_grad(self, y, dy, dx):
        self._class_grad(y, dy, dx, log=True)

    def _class_grad(self, y, dy, dx, log: bool) -> None:
        self.class_dispatch("softmax_grad", *self.rows(y), log, self._no_alias([y, dy, dx]))
        self._copy_back([y, dy, dx])

    def _no_alias(self, buffers: list) -> list:
        out = list(buffers)
        if out[-1].raw in [b.raw for b in out[:-1]]:
            out[-1] = self._scratch_buffer(out[-1].size, "alias_out")
        return out

    def _copy_back(self, buffers: list) -> None:
        if buffers[-1].raw in [b.raw for b in buffers[:-1]]:
            self._elementwise("copy", buffers[-1].size, [self._scratch_buffer(buffers[-1].size, "alias_out"),
                                                         buffers[-1]], ElementwiseParams)

    # --- losses -----------------------------------------------------------------------------------------------
    def nll(self, logp, labels, out, weight=(), ignore_index=None, reduction="mean"):
        if weight or ignore_index is not None or reduction != "mean" or len(logp.shape) > 2:
            self._on_host(nll_forward, [logp, labels], out, weight, ignore_index, reduction)
            return
        n = logp.shape[0]
        c = logp.size // n
        self.sums.sum_parts("nll_parts", [logp, labels], n, [c, 1], out, alpha=-1.0 / n, classes=c)

    def nll_grad(self, labels, dloss, dx, weight=(), ignore_index=None, reduction="mean"):
        if weight or ignore_index is not None or reduction != "mean" or len(dx.shape) > 2:
            self._on_host(nll_backward, [labels, dloss], dx, weight, ignore_index, reduction)
            return
        n = dx.shape[0]
        c = dx.size // n
        for n0, n1, (bl, bx), (ol, ox) in self._item_chunks(n, [1, c]):
            count = (n1 - n0) * c
            params = ClassesParams(count=count, classes=c, batch=n, a_offset=ol, c_offset=ox)
            self._dispatch("classes", "nll_grad", params, [labels, dloss, dx], self._grid(count), [bl, None, bx])

    def _on_host(self, fn, inputs: list, out, *args) -> None:
        """Run the NumPy form ``fn(np, *inputs, out, *args)`` of a primitive on host copies (in float32) and upload
        its result: the loss options (class weights, ignore_index, reductions, positions) that have no kernel."""
        host = [np.empty(b.shape, np.float32) for b in inputs]
        for b, h in zip(inputs, host):
            self.mem.download(b, h)
        result = np.empty(out.shape, np.float32)
        fn(np, *host, result, *args)
        self.mem.upload(result, out)

    def _native_on_host(self, name: str, arguments: dict[str, Any]) -> None:
        """Primitive ``name`` as the native backend computes it, on float32 host copies of its buffers, the operands
        it writes (base.WRITES) uploaded back: a read-back per call, for what has no kernel here yet."""
        from ..base import written
        from ..native import NativeBackend

        arguments = {k: v for k, v in arguments.items() if k not in ("self", "__class__")}
        native = self.__dict__.setdefault("_host_native", NativeBackend())
        host = {}
        for k, v in arguments.items():
            if isinstance(v, WView):
                host[k] = np.empty(v.shape, np.float32)
                self.mem.download(v, host[k])
            else:
                host[k] = v
        getattr(native, name)(**host)
        for k in written(name, arguments):
            self.mem.upload(host[k], arguments[k])

    def mse(self, x, t, diff, out):
        self._elementwise("sub", x.size, [x, t, diff], ElementwiseParams)
        self.sums.sum_parts("square_parts", [diff], diff.size, [1], out, alpha=1.0 / diff.size)

    def mse_grad(self, diff, dloss, dx):
        self._elementwise("scale_by_scalar", dx.size, [diff, dloss, dx], ElementwiseParams, whole=(1,),
                          scale=2.0 / diff.size)

    # --- bias ---------------------------------------------------------------------------------------------------
    def bias_add(self, y, b):
        n, c = y.shape[0], y.shape[1]
        inner = y.size // (n * c)
        if inner == 1 and self.enc.fuse(y, "bias", b):  # [N, C]: a linear layer's product
            return
        self._elementwise("bias_add", y.size, [y, b], ElementwiseParams, whole=(1,), channels=c, inner=inner)

    def bias_grad(self, dy, db, beta=0.0):
        self.sums.channel_sums(dy, db, 1.0, beta)

    # --- batch normalisation: per-channel sums through bias_grad's reduction, the rest elementwise -------------
    def _bn(self, entry: str, x, buffers: list, whole: tuple[int, ...]) -> None:
        """A per-element batchnorm kernel over x's elements (channel = axis 1)."""
        n, c = x.shape[0], x.shape[1]
        self._elementwise(entry, x.size, buffers, self._typed(BatchNormParams, buffers, "abcdef"), whole=whole,
                          channels=c, inner=x.size // (n * c))

    def _bn_channels(self, entry: str, c: int, buffers: list, **values: float) -> None:
        self._elementwise(entry, c, buffers, BatchNormParams, whole=tuple(range(len(buffers))), **values)

    def _or_dummy(self, v, c: int, tag: str):
        return v if v is not None else self._scratch_buffer(c, tag)

    def batch_norm_stats(self, x, mean, var):
        count = x.size // x.shape[1]
        self.sums.channel_sums(x, mean, 1.0 / count, 0.0)
        t = self.mem.view(self._scratch_buffer(x.size, "bn_values"), x.shape)
        self._bn("bn_centered_square", x, [x, mean, t], whole=(1,))
        self.sums.channel_sums(t, var, 1.0 / count, 0.0)

    def batch_norm(self, x, mean, var, gamma, beta, y, eps):
        c = x.shape[1]
        coef = self._scratch_buffer(2 * c, "bn_coefficients")
        self._bn_channels("bn_coefficients", c, [mean, var, self._or_dummy(gamma, c, "bn_gamma"),
                                                 self._or_dummy(beta, c, "bn_beta"), coef],
                          has_gamma=int(gamma is not None), has_beta=int(beta is not None), eps=eps)
        self._bn("bn_affine", x, [x, coef, y], whole=(1,))

    def batch_norm_grad_sums(self, x, dy, mean, var, sum_dy, sum_dy_xhat, eps):
        self.bias_grad(dy, sum_dy)
        t = self.mem.view(self._scratch_buffer(x.size, "bn_values"), x.shape)
        self._bn("bn_dy_centered", x, [dy, x, mean, t], whole=(2,))
        self.bias_grad(t, sum_dy_xhat)
        self._bn_channels("bn_times_invstd", x.shape[1], [sum_dy_xhat, var], eps=eps)

    def batch_norm_grad(self, x, dy, mean, var, gamma, sum_dy, sum_dy_xhat, dx, eps, batch_stats):
        c = x.shape[1]
        coef = self._scratch_buffer(3 * c, "bn_coefficients")
        self._bn_channels("bn_grad_coefficients", c,
                          [mean, var, self._or_dummy(gamma, c, "bn_gamma"), sum_dy, sum_dy_xhat, coef],
                          has_gamma=int(gamma is not None), batch_stats=int(batch_stats), eps=eps, inv_count=c / x.size)
        self._bn("bn_grad_apply", x, [dy, x, coef, dx], whole=(2,))

    # --- randomness and solver updates -----------------------------------------------------------------------
    def copy_block(self, part, whole, part_inner, whole_inner, offset, into_whole):
        self._elementwise("block_into" if into_whole else "block_from", part.size, [part, whole],
                          ElementwiseParams, whole=(1,), part_inner=part_inner, whole_inner=whole_inner, column=offset)

    # axes moved, broadcast and batched products: on the host (no kernels yet), as the loss options
    def permute(self, x, out, perm):
        self._on_host(permute, [x], out, perm)

    def broadcast(self, x, out):
        self._on_host(broadcast, [x], out)

    def reduce_to(self, x, out):
        self._on_host(reduce_to, [x], out)

    def matmul(self, a, trans_a, b, trans_b, out):
        self._on_host(matmul, [a, b], out, trans_a, trans_b)

    def lrn(self, x, scale, out, size, alpha, beta, k):
        c = x.shape[1]
        inner = x.size // (x.shape[0] * c)
        buffers = [x, scale, out]
        self._elementwise("lrn", x.size, buffers, self._typed(LrnParams, buffers, "abc"), whole=(0, 1, 2), channels=c,
                          inner=inner, size=size, alpha=alpha / size, beta=beta, k=k)

    def lrn_grad(self, x, y, scale, dy, dx, size, alpha, beta):
        c = x.shape[1]
        inner = x.size // (x.shape[0] * c)
        buffers = [x, y, scale, dy, dx]
        self._elementwise("lrn_grad", x.size, buffers, self._typed(LrnParams, buffers, "abcde"), whole=(0, 1, 2, 3, 4),
                          channels=c, inner=inner, size=size, alpha=2.0 * alpha * beta / size, beta=beta)

    def dropout_mask(self, mask, ratio, seed):
        self._elementwise("dropout_mask", mask.size, [mask, seed], ElementwiseParams, whole=(1,),
                          key_multiplier=DROPOUT_KEY_MULTIPLIER, threshold=dropout_threshold(ratio),
                          scale=1.0 / (1.0 - ratio))

    def clip_to_norm(self, x, sumsq, threshold):
        self._elementwise("clip_to_norm", x.size, [sumsq, x], UpdateParams, whole=(0,), threshold=threshold)

    def unscale(self, x, scale):
        self._elementwise("unscale", x.size, [scale, x], UpdateParams, whole=(0,))

    def loss_scale_update(self, sumsq, scale, counts, rate, growth_factor, backoff_factor, growth_interval, dynamic):
        self._elementwise("loss_scale_update", 1, [sumsq, scale, counts, rate], UpdateParams, whole=(0, 1, 2, 3),
                          growth=growth_factor, backoff=backoff_factor, interval=growth_interval,
                          dynamic=int(bool(dynamic)))

    def solver_update(self, kind, w, g, rate, lr_mult, params=(), s1=None, s2=None, s3=None, copy=None):
        rule = updates.TABLE.get(kind) or updates.rule(kind)
        if rule not in self._update_rules:  # a line added to (or replaced in) the table since the module was built
            self.gpu.rebuild("update")
            if "update16" in self.gpu.modules:
                self.gpu.rebuild("update16")
            self._update_rules = frozenset(updates.TABLE.values())
        state = [s1, s2, s3][:len(rule.state)]
        values = dict(lr_mult=lr_mult, **dict(zip(updates.WGSL_PARAMS, params)))
        if copy is not None and copy.dtype == F16 and w.dtype == F32 and self.gpu.has_f16 and copy.size == w.size:
            # the rule's twin in update16 stores the float16 copy as it stores the weight: no second pass
            self._elementwise(kind + "_update_h", w.size, [rate, w, g, *state, copy], UpdateHalfParams, whole=(0,),
                              **values)
            return
        self._elementwise(kind + "_update", w.size, [rate, w, g, *state], UpdateRuleParams, whole=(0,), **values)
        if copy is not None:
            self.cast(w, copy)

    # --- sequences: embeddings and recurrent cells (sequence.wgsl, scatter.wgsl) -----------------------------
    def _seq_dispatch(self, params: ParamStruct, entry: str, items: int, threads: int, buffers: list,
                      per_item: list[int | None], table: tuple | None = None, product: int | None = None,
                      **values: float) -> None:
        """A thread per element over ``items`` items (sequences, or an embedding's positions) of ``threads``
        elements each. ``per_item[i]``: the elements buffer i holds per item, or None for a buffer bound whole (a
        bias). Past the binding limit the items run in runs whose bindings fit, each buffer bound from its run's
        first item. ``table``: (position, window) for an embedding table, bound as the window (see
        :meth:`_table_windows`) says. ``product``: the position of a recurrent cell's recurrent product, whose
        split-K sum, where it is still held (see Encoder.take_sum), the cell does itself from the partials bound
        after its last buffer (a dummy there otherwise)."""
        self.gpu.module(params.module)  # built on first use
        if not items or not threads:
            return
        split = {i: e for i, e in enumerate(per_item) if e is not None}
        runs = list(self._item_chunks(items, list(split.values())))
        if product is not None:
            whole = len(runs) == 1 and all(r is None for r in runs[0][2])
            held = self.enc.take_sum(buffers[product]) if whole else None
            if held is None:
                buffers = [*buffers, self._scratch_buffer(1, "noparts")]
            else:
                buffers = [*buffers, held["partial"]]
                values.update(parts=held["slices"], part_stride=buffers[product].size, alpha=held["alpha"],
                              beta=held["beta"])
        params = self._typed(params, buffers, [f"s{i + 1}" for i in range(len(buffers))])
        module = params.module
        for i0, i1, binds, offsets in runs:
            ranges: list = [None] * len(buffers)
            offs = [0] * len(buffers)
            for k, i in enumerate(split):
                ranges[i], offs[i] = binds[k], offsets[k]
            fields: dict[str, int] = {}
            if table is not None:
                at, (first_row, rows, binding, offset) = table
                ranges[at], offs[at] = binding, offset
                fields.update(first_row=first_row, rows=rows)
            fields.update({f"off{i + 1}": o for i, o in enumerate(offs)})
            count = (i1 - i0) * threads
            self._dispatch(module, entry, params(count=count, **fields, **values), buffers, self._grid(count),
                           ranges if any(r is not None for r in ranges) else None)

    def _table_windows(self, table) -> list[tuple[int, int, tuple[int, int] | None, int]]:
        """Windows of an embedding table's rows that each fit one binding, as (first row, rows, binding range,
        element offset of the first row in it); one window of the whole table (range None) where it fits."""
        v, d = table.shape
        if table.raw.size <= self.gpu.max_binding:
            return [(0, v, None, 0)]
        step = (self.gpu.max_binding - self.gpu.offset_align) // (4 * d)
        if step < 1:
            raise BackendError(f"webgpu: one embedding row of {4 * d} bytes exceeds the storage binding limit of "
                               f"{self.gpu.max_binding} bytes")
        windows: list[tuple[int, int, tuple[int, int] | None, int]] = []
        for r0 in range(0, v, step):
            r1 = min(v, r0 + step)
            base, size, offset = self._span(r0 * d * 4, r1 * d * 4)
            windows.append((r0, r1 - r0, (base, size), offset))
        return windows

    def embedding(self, ids, table, out):
        v, d = table.shape
        for window in self._table_windows(table):
            self._seq_dispatch(SequenceParams, "embedding", ids.size, d, [ids, table, out], [1, None, d],
                               (1, window), dim=d, vocab=v)

    def embedding_grad(self, ids, dy, dtable, beta=0.0):
        if beta == 0.0:
            self.fill(0.0, dtable)
        elif beta != 1.0:
            self.scal(beta, dtable)
        v, d = dtable.shape
        for window in self._table_windows(dtable):
            self._seq_dispatch(ScatterParams, "embedding_grad", ids.size, d, [ids, dy, dtable], [1, d, None],
                               (2, window), dim=d, vocab=v)

    def lstm_cell(self, gates, hw, bias, c, h, hprev, y, t, sequence):
        n, steps, hs = c.shape
        self._seq_dispatch(SequenceParams, "lstm_cell", n, hs, [gates, hw, bias, c, h, hprev, y],
                           [steps * 4 * hs, 4 * hs, None, steps * hs, hs, steps * hs, y.size // n], product=1,
                           **_cell(steps, hs, t, sequence))

    def lstm_cell_grad(self, gates, c, dh, dy, dc, dgates, dgates_t, t, sequence):
        n, steps, hs = c.shape
        self._seq_dispatch(SequenceParams, "lstm_cell_grad", n, hs, [gates, c, dh, dy, dc, dgates, dgates_t],
                           [steps * 4 * hs, steps * hs, hs, dy.size // n, hs, steps * 4 * hs, 4 * hs], product=2,
                           **_cell(steps, hs, t, sequence))

    def gru_cell(self, pre, hw, bias_ih, bias_hh, hn, h, hprev, y, t, sequence, w_hh=None):
        if w_hh is not None:  # the reset gate before the product (linear_before_reset false): no kernel yet
            self._native_on_host("gru_cell", locals())
            return
        n, steps, hs = hn.shape
        self._seq_dispatch(SequenceParams, "gru_cell", n, hs, [pre, hw, bias_ih, bias_hh, hn, h, hprev, y],
                           [steps * 3 * hs, 3 * hs, None, None, steps * hs, hs, steps * hs, y.size // n],
                           **_cell(steps, hs, t, sequence))

    def gru_cell_grad(self, pre, hn, hprev, dh, dy, dpre, dpre_h, dpre_h_t, t, sequence, w_hh=None):
        if w_hh is not None:
            self._native_on_host("gru_cell_grad", locals())
            return
        n, steps, hs = hn.shape
        self._seq_dispatch(SequenceParams, "gru_cell_grad", n, hs, [pre, hn, hprev, dh, dy, dpre, dpre_h, dpre_h_t],
                           [steps * 3 * hs, steps * hs, steps * hs, hs, dy.size // n, steps * 3 * hs,
                            steps * 3 * hs, 3 * hs], **_cell(steps, hs, t, sequence))

    def rnn_cell(self, pre, hw, bias, h, hprev, y, t, sequence):
        n, steps, hs = pre.shape
        self._seq_dispatch(SequenceParams, "rnn_cell", n, hs, [pre, hw, bias, h, hprev, y],
                           [steps * hs, hs, None, hs, steps * hs, y.size // n], product=1,
                           **_cell(steps, hs, t, sequence))

    def rnn_cell_grad(self, pre, dh, dy, dpre, dpre_t, t, sequence):
        n, steps, hs = pre.shape
        self._seq_dispatch(SequenceParams, "rnn_cell_grad", n, hs, [pre, dh, dy, dpre, dpre_t],
                           [steps * hs, hs, dy.size // n, steps * hs, hs], product=1,
                           **_cell(steps, hs, t, sequence))


    # --- casts between float32 and float16 (half.wgsl) ------------------------------------------------------------
    def cast(self, x, out):
        if x.size != out.size:
            raise BackendError(f"webgpu: cast from {x.shape} to {out.shape}: the element counts differ")
        dtypes = {np.dtype(x.dtype), np.dtype(out.dtype)}
        if dtypes == {F32}:
            return self.copy(x, out)
        has_f16 = self.gpu.has_f16
        if not dtypes <= {F16, F32} or not has_f16:
            raise BackendError(f"webgpu: cannot convert {x.dtype} to {out.dtype}: this device holds float32"
                               f"{' and float16' if has_f16 else ''} buffers (float16 needs precision='fp16')")
        if dtypes == {F16}:
            return self.copy(x, out)
        self.convert(x, out)

    def convert(self, x: WView, out: WView) -> None:
        """``out = x`` between a float16 and a float32 buffer (either way), in pieces under the binding limit."""
        n = x.size
        entry = "to_f32" if x.dtype == F16 else "to_f16"
        limit, align = self.gpu.max_binding, self.gpu.offset_align
        piece = (limit // 4 // align) * align
        whole = max(x.raw.size, out.raw.size) <= limit
        for start in range(0, n, piece if not whole else max(n, 1)):
            count = min(piece if not whole else n, n - start)
            ranges = None if whole else [(start * v.dtype.itemsize, pad4(count * v.dtype.itemsize)) for v in (x, out)]
            self._dispatch("half", entry, HalfParams(count=count), [x, out], self._grid(count), ranges)
