"""Convolution through cuDNN frontend graphs: one graph per pass, shape and operand formats (float32, bfloat16,
float16; float32 accumulation throughout), its plan autotuned among the accurate ones."""

from __future__ import annotations

import atexit
from typing import Any

import numpy as np

from ...errors import BackendError
from ..base import padding_end


def _strides(array: Any) -> tuple[int, ...]:
    """An array's strides in elements: row-major NCHW, or channels-last (NHWC memory seen as NCHW)."""
    return tuple(s // array.itemsize for s in array.strides)


def geometry(x_shape, w_shape, y_shape, padding, stride, dilation) -> tuple:
    """What a graph takes as its padding: ``padding`` itself for a plain convolution (the graphs cached before
    grouped and dilated convolutions existed keep their keys), else (padding before, padding after, dilation), the
    padding after implied by the output's size. Groups need nothing: cuDNN reads them from the filter's channels."""
    dims = list(zip(x_shape[2:], y_shape[2:], w_shape[2:], stride, padding, dilation))
    if tuple(dilation) == (1, 1) and all((size + 2 * p - k) // s + 1 == o for size, o, k, s, p, _ in dims):
        return tuple(padding)
    after = tuple(padding_end(size, o, k, s, p, d) for size, o, k, s, p, d in dims)
    return tuple(padding), after, tuple(dilation)


class _CudnnConv:
    """cuDNN frontend graphs for the three convolution passes, one graph per (pass, shapes, stride, padding)."""

    MAX_WORKSPACE = 1 << 30
    """Plans that need more scratch memory than this are not considered."""
    PLAN_TOLERANCE = 0.03
    """Among plans at most this fraction slower than the fastest, the one with the smallest workspace is kept."""
    ARITHMETIC_EXCLUDED_NOTES = ("TENSOR_CORE", "DOWN_CONVERT_INPUTS", "REDUCED_PRECISION_REDUCTION")
    """cuDNN's numerical notes of engines that do not do fp32 arithmetic (TF32 tensor cores, inputs or reductions
    in 16 bits): excluded for float32 operands unless tf32=True, whatever the tolerance."""
    ANY_FP32_EXCLUDED_NOTES = ("TENSOR_CORE", "DOWN_CONVERT_INPUTS")
    """Excluded with tolerance=None: the notes PyTorch's cudnn.benchmark excludes in fp32 without TF32 (its plans are
    otherwise the same FFT, Winograd and implicit-GEMM engines, whatever their error)."""
    LOW_PRECISION_EXCLUDED_NOTES = ("REDUCED_PRECISION_REDUCTION", "FFT", "WINOGRAD", "WINOGRAD_TILE_4x4",
                                    "WINOGRAD_TILE_6x6", "WINOGRAD_TILE_13x13")
    """Excluded for bfloat16 and float16 operands: engines that accumulate in 16 bits, and FFT and Winograd
    transforms (their error is not bounded by the format's roundoff); tensor cores, which read 16-bit operands
    and accumulate in float32, are what these graphs are for."""
    AGREEMENT_SAMPLE = 1 << 16
    """Output elements compared between candidate plans."""
    FP32_TOLERANCE = 2.0 ** -12
    """The default fp32 tolerance: a plan is kept only if its output agrees with the median of every candidate
    plan's output to this relative error (max |difference| / max |median|, on the first batch's own data). Half of
    TF32's unit roundoff (2^-11): an fp32 convolution stays at least twice as accurate as TF32 inputs alone would
    make it. Measured on an H200 it keeps the Winograd filter gradients of ResNet's 3x3 convolutions (1.7e-5 to
    9.2e-5, 1.7 ms of a ResNet-18 step) and rejects the FFT and large-tile transforms (1e-3 to 1.3e-2 on LeNet's
    and AlexNet's); implicit-GEMM plans agree to ~1e-6."""

    def __init__(self, cp: Any, tf32: bool, tolerance: float | None = FP32_TOLERANCE) -> None:
        import cudnn

        self.cudnn = cudnn
        self.cp = cp
        self.tf32 = tf32
        self.tolerance = None if tf32 else tolerance
        self.handle = cudnn.create_handle()
        self.graphs: dict = {}
        self.workspace = cp.empty(0, dtype=cp.uint8)
        self._trials: list[int] = []
        self.timings: dict = {}  # graph key -> [(ms, workspace bytes, plan index)] of every plan that ran
        self.errors: dict = {}  # graph key -> {plan index: relative difference from the plans' median} (fp32)
        atexit.register(self.graphs.clear)  # release the graphs while their library is still loaded

    def _build(self, kind: str, x_shape, w_shape, y_shape, stride, padding, formats, strides) -> tuple:
        """The graph of one pass; ``formats``: the storage formats of the operands run() takes as x, w, y, bias;
        ``strides``: the element strides of x, w and y (cuDNN reads and writes either memory order)."""
        cudnn = self.cudnn
        f32 = cudnn.data_type.FLOAT
        types = {"f32": f32, "bf16": cudnn.data_type.BFLOAT16, "f16": cudnn.data_type.HALF}
        tx, tw, ty, tb = (types[f] for f in formats)
        low = [types[f] for f in formats if f != "f32"]
        g = cudnn.pygraph(io_data_type=low[0] if low else f32, intermediate_data_type=f32, compute_data_type=f32,
                          handle=self.handle)
        # padding: the symmetric (ph, pw) of a plain convolution, or (before, after, dilation) pairs (see geometry)
        pre, post, dil = (list(p) for p in padding) if len(padding) == 3 else (list(padding),) * 2 + ([1, 1],)
        st = list(stride)
        sx, sw, sy = (list(s) for s in strides)
        if kind in ("fprop", "fprop_bias"):
            X = g.tensor(name="X", dim=list(x_shape), stride=sx, data_type=tx)
            W = g.tensor(name="W", dim=list(w_shape), stride=sw, data_type=tw)
            Y = g.conv_fprop(image=X, weight=W, pre_padding=pre, post_padding=post, stride=st, dilation=dil,
                             compute_data_type=f32)
            if kind == "fprop_bias":
                o = w_shape[0]
                Bt = g.tensor(name="B", dim=[1, o, 1, 1], stride=[o, 1, 1, 1], data_type=tb)
                Y = g.bias(name="bias", input=Y, bias=Bt)
            Y.set_output(True).set_dim(list(y_shape)).set_stride(sy).set_data_type(ty)
            names = (X, W, Y) if kind == "fprop" else (X, W, Y, Bt)
        elif kind == "dgrad":
            DY = g.tensor(name="DY", dim=list(y_shape), stride=sy, data_type=ty)
            W = g.tensor(name="W", dim=list(w_shape), stride=sw, data_type=tw)
            DX = g.conv_dgrad(loss=DY, filter=W, pre_padding=pre, post_padding=post, stride=st, dilation=dil,
                              compute_data_type=f32)
            DX.set_output(True).set_dim(list(x_shape)).set_stride(sx).set_data_type(tx)
            names = (DX, W, DY)
        else:
            X = g.tensor(name="X", dim=list(x_shape), stride=sx, data_type=tx)
            DY = g.tensor(name="DY", dim=list(y_shape), stride=sy, data_type=ty)
            DW = g.conv_wgrad(image=X, loss=DY, pre_padding=pre, post_padding=post, stride=st, dilation=dil,
                              compute_data_type=f32)
            DW.set_output(True).set_dim(list(w_shape)).set_stride(sw).set_data_type(tw)
            names = (X, DW, DY)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
        if low or not self.tf32:
            excluded = (self.LOW_PRECISION_EXCLUDED_NOTES if low else self.ANY_FP32_EXCLUDED_NOTES
                        if self.tolerance is None else self.ARITHMETIC_EXCLUDED_NOTES)
            g.deselect_numeric_notes([getattr(cudnn.numerical_note, n) for n in excluded
                                      if hasattr(cudnn.numerical_note, n)])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
        return g, names

    def _autotune(self, g: Any, pack: dict, key: tuple, out: Any, compare: bool) -> int:
        """Time every built plan on the real buffers and keep the fastest (as cudnn.benchmark does), preferring a
        smaller workspace where the difference in time is within :attr:`PLAN_TOLERANCE`; with ``compare``, only among
        plans whose result agrees with the others' to :attr:`tolerance` (see :attr:`FP32_TOLERANCE`)."""
        cp = self.cp
        timings = self.timings[key] = []
        results: list[Any] = []
        # the agreement check looks at a fixed sample of the output's elements: an inexact transform is off
        # everywhere, and a sample keeps the candidates' copies small
        flat = out.reshape(-1) if out.flags.c_contiguous else out.transpose(0, 2, 3, 1).reshape(-1)  # memory order
        sample = cp.arange(flat.size) if flat.size <= self.AGREEMENT_SAMPLE else cp.asarray(
            np.random.default_rng(0).choice(flat.size, self.AGREEMENT_SAMPLE, replace=False))
        for i in range(g.get_execution_plan_count()):
            try:
                size = g.get_workspace_size_plan_at_index(i)
                if size > self.MAX_WORKSPACE:
                    continue
                # trial workspaces bypass the memory pool, so they are really freed afterwards
                trial = cp.cuda.runtime.malloc(max(size, 1))
                self._trials.append(trial)
                g.execute_plan_at_index(pack, trial, i, handle=self.handle)
                runs = []
                for _ in range(5):  # the fastest of five runs: one slow run must not decide
                    start, stop = cp.cuda.Event(), cp.cuda.Event()
                    start.record()
                    g.execute_plan_at_index(pack, trial, i, handle=self.handle)
                    stop.record()
                    stop.synchronize()
                    runs.append(cp.cuda.get_elapsed_time(start, stop))
                ms = min(runs)
                if compare:
                    results.append(flat[sample])
            except Exception:
                continue  # a plan that cannot run here
            timings.append((ms, size, i))
        cp.cuda.runtime.deviceSynchronize()
        for trial in self._trials:
            cp.cuda.runtime.free(trial)
        self._trials.clear()
        if not timings:
            raise BackendError("no cuDNN plan could run")
        if len(results) >= 3 and self.tolerance is not None:
            median = cp.median(cp.stack(results), axis=0)
            scale = float(cp.abs(median).max()) or 1.0
            errors = [float(cp.abs(r - median).max()) / scale for r in results]
            self.errors[key] = dict(zip((i for _, _, i in timings), errors))
            agreeing = [t for t, e in zip(timings, errors) if e <= self.tolerance]
            # no plan near the median (candidates all off in their own ways): the one nearest it
            timings = agreeing or [min(zip(errors, timings))[1]]
            del median
        results.clear()
        limit = min(ms for ms, _, _ in timings) * (1.0 + self.PLAN_TOLERANCE)
        size, _, best = min((size, ms, i) for ms, size, i in timings if ms <= limit)
        if size > self.workspace.size:
            self.workspace = cp.empty(size, dtype=cp.uint8)
        return best

    @staticmethod
    def _key(kind, x_shape, w_shape, y_shape, stride, padding, formats, strides) -> tuple:
        return (kind, tuple(x_shape), tuple(w_shape), tuple(y_shape), tuple(stride), tuple(padding), tuple(formats),
                tuple(strides))

    def plan_ms(self, kind, x_shape, w_shape, y_shape, stride, padding, formats, strides) -> float:
        """The autotuned time of the plan a pass runs (inf where none was tuned: unsupported, or not yet run);
        ``strides``: the element strides of x, w and y, as :meth:`run` saw them."""
        key = self._key(kind, x_shape, w_shape, y_shape, stride, padding, formats, strides)
        entry = self.graphs.get(key)
        if not isinstance(entry, tuple) or entry[2] is None:
            return float("inf")
        return next((ms for ms, _, i in self.timings.get(key, ()) if i == entry[2]), float("inf"))

    def run(self, kind, x_shape, w_shape, y_shape, stride, padding, x, w, y, beta, bias=None,
            formats=("f32",) * 4, optional=False) -> bool:
        """Run one pass; False when cuDNN has no engine for it (only asked of optional fusions and of
        ``optional`` passes). ``formats``: the storage formats of x, w, y and bias."""
        strides = (_strides(x), _strides(w), _strides(y))
        key = self._key(kind, x_shape, w_shape, y_shape, stride, padding, formats, strides)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = (*self._build(kind, x_shape, w_shape, y_shape, stride, padding, formats, strides), None)
            except Exception as e:
                if kind == "fprop_bias" or optional:
                    self.graphs[key] = "unsupported"
                    return False
                raise BackendError(f"cuDNN could not build a {kind} graph for input {tuple(x_shape)}, filter "
                                   f"{tuple(w_shape)} (formats {', '.join(formats)}): {e}") from e
            self.graphs[key] = entry
        if entry == "unsupported":
            return False
        self.cudnn.set_stream(handle=self.handle, stream=self.cp.cuda.get_current_stream().ptr)
        g, tensors, plan = entry
        pack = {t: arr.data.ptr for t, arr in zip(tensors, (x, w, y, bias))}
        if plan is None:
            # the first run on real buffers picks the plan (outputs are overwritten, so timing them is harmless)
            out = {"dgrad": x, "wgrad": w}.get(kind, y)
            compare = self.tolerance is not None and all(f == "f32" for f in formats)
            plan = self._autotune(g, pack, key, out, compare)
            g.build_plan_at_index(plan)  # selected: execute() runs it without re-checking the plan list per call
            self.graphs[key] = (g, tensors, plan)
        g.execute(pack, self.workspace.data.ptr, handle=self.handle)
        return True
