"""float16 on the webgpu backend (precision "fp16", on adapters with the shader-f16 feature): a layer over the
composed backend, never a part the others call. :class:`HalfPrecision` replaces each primitive of the backend by
one that offers float16 operands to its float16 kernels first and emulates the call otherwise.

float16 kernels (float16 loads and stores, float32 arithmetic and sums, one rounding per store): the float32
kernels' WGSL rebuilt with their float16 arrays declared so (sources._halve) for GEMMs, convolutions (implicit
GEMMs, and Winograd transforms around float32 tiles), pooling, softmax, sums, batch normalisation, LRN, embeddings
and recurrent cells, and generated elementwise kernels (activations from pointwise.TABLE, bias, products, copies,
axpby, Concat/Slice blocks); see :attr:`HalfPrecision.NATIVE_F16` and :attr:`HalfPrecision.SEQUENCE_F16`. Which
float16 build of a module a call needs is decided where the call is made (device.Device.typed and epilogue_module,
gemm.py, conv.py, reduce.py), so the float32 code paths take float16 operands as they come. Every other call with
float16 operands (those primitives on operands they do not take, such as tensors past the binding limit, and the
rest: losses, dot, clipping, dropout masks, solver updates) runs by emulation on the device: its float16 operands
converted into float32 scratch buffers (half.wgsl, elementwise.Elementwise.convert), its float32 kernels run, and the
operands it writes (declared in base.WRITES) converted back.
Operands that share a buffer (an in-place activation's input and output) share one scratch buffer, so the float32
kernel sees the same aliasing the caller asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import BackendError
from .. import pointwise
from ..base import MEMORY, PRIMITIVES, WRITES, Backend, emulated, plain_conv
from .binding import ElementwiseHalfParams, Family
from .conv import Convolution
from .elementwise import _act
from .view import WView

F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)


def _is_half(v: Any) -> bool:
    """Whether a primitive's argument is a float16 device buffer."""
    return isinstance(v, WView) and v.dtype == F16


class HalfPrecision(Family):
    """float16 operands on the composed backend's primitives: float16 kernels where a primitive has them for the
    call's operands, emulation on float32 copies otherwise (see :meth:`wrap`)."""

    def __init__(self, convs: Convolution) -> None:
        super().__init__(convs.binding)
        self.convs, self.gemms, self.ew = convs, convs.gemms, convs.ew

    NATIVE_F16 = {"activation": "_activation_h", "activation_grad": "_activation_grad_h", "bias_add": "_bias_add_h",
                  "gemm": "_gemm_h", "conv2d": "_conv2d_h", "conv2d_grad_data": "_conv2d_grad_data_h",
                  "conv2d_grad_filter": "_conv2d_grad_filter_h", "pool2d": "_pool2d_h", "pool2d_grad": "_pool2d_grad_h",
                  "bias_grad": "_bias_grad_h", "mul": "_mul_h",
                  "softmax": "_softmax_h", "log_softmax": "_log_softmax_h", "softmax_grad": "_softmax_grad_h",
                  "log_softmax_grad": "_log_softmax_grad_h", "copy": "_copy_h", "fill": "_fill_h", "scal": "_scal_h",
                  "axpby": "_axpby_h", "copy_block": "_copy_block_h", "batch_norm_stats": "_batch_norm_stats_h",
                  "batch_norm": "_batch_norm_h", "batch_norm_grad_sums": "_batch_norm_grad_sums_h",
                  "batch_norm_grad": "_batch_norm_grad_h", "lrn": "_lrn_h", "lrn_grad": "_lrn_grad_h"}
    """Primitives with float16 kernels of their own, by the method that runs them; it returns False for operands
    it does not take (other dtype mixes, tensors past the binding limit), which are then emulated."""

    SEQUENCE_F16 = ("embedding", "embedding_grad", "lstm_cell", "lstm_cell_grad", "rnn_cell", "rnn_cell_grad",
                    "gru_cell", "gru_cell_grad")
    """Primitives of sequence.wgsl and scatter.wgsl, which take float16 operands in those modules rebuilt (see
    :meth:`_sequence_h`); but a float16 table of embedding_grad, whose atomic adds need float32 bits (emulated)."""

    def wrap(self, backend: Backend) -> None:
        """Replace every primitive of ``backend`` (but the memory contract) by the emulation, which first offers
        float16 operands to the primitive's float16 kernels where it has them."""
        for name in PRIMITIVES:
            if name in MEMORY:
                continue
            if name not in WRITES:
                raise BackendError(f"webgpu: primitive {name!r} declares no written operands (base.WRITES)")
            setattr(backend, name, self._emulated(name, getattr(backend, name)))

    def _emulated(self, name: str, method: Callable) -> Callable:
        """``method`` offered first to primitive ``name``'s float16 kernels, where it has them, then emulated: its
        float16 operands converted into float32 scratch buffers, its float32 kernel run, the operands it writes
        converted back."""
        run = emulated(name, method, _is_half, self._widen, self._narrow)
        native = getattr(self, self.NATIVE_F16[name]) if name in self.NATIVE_F16 else \
            functools.partial(self._sequence_h, name) if name in self.SEQUENCE_F16 else None
        if native is None:
            return run

        @functools.wraps(method)
        def first_native(*args: Any, **kwargs: Any) -> Any:
            return None if native(*args, **kwargs) else run(*args, **kwargs)

        return first_native

    def _widen(self, operands: dict[str, WView]) -> dict[str, WView]:
        """float32 scratch copies of float16 operands; operands that share a buffer share one copy (the size of the
        largest of their views), so the float32 kernel sees the aliasing the caller asked for."""
        largest: dict[int, WView] = {}  # buffer -> its largest view among the operands
        for v in operands.values():
            seen = largest.get(id(v.raw))
            if seen is None or v.size > seen.size:
                largest[id(v.raw)] = v
        scratch: dict[int, WView] = {}
        for j, (key, v) in enumerate(largest.items()):
            scratch[key] = self._scratch_buffer(v.size, f"half{j}")
            self.ew.convert(v, scratch[key])
        return {k: self.mem.view(scratch[id(v.raw)][:v.size], v.shape) for k, v in operands.items()}

    def _narrow(self, copy: WView, operand: WView) -> None:
        """A float32 copy written back into its float16 operand."""
        self.ew.convert(copy, operand)

    # --- float16 kernels: False where the operands are not theirs --------------------------------------------------
    def _halves(self, *buffers: WView) -> bool:
        """Whether every buffer is float16 and each fits one binding (the kernels bind them whole)."""
        return all(b.dtype == F16 and b.raw.size <= self.gpu.max_binding for b in buffers)

    def _elementwise_h(self, entry: str, buffers: list, **values: float) -> bool:
        """An entry point of the float16 elementwise module over the last buffer's elements, every buffer bound
        whole; False where its output aliases an input other than the one its in-place twin overwrites (the
        float32 path's scratch for that is float32)."""
        raws = [b.raw for b in buffers]
        alias = {i for i in range(len(buffers)) if raws[i] in raws[:i]}
        inplace = self.binding.inplace.get(entry)
        if alias and not (inplace and alias == {inplace[0]} and raws[inplace[0]] is raws[inplace[1]]):
            return False
        self._elementwise(entry, buffers[-1].size, buffers, ElementwiseHalfParams, whole=tuple(range(len(buffers))),
                          **values)
        return True

    def _activation_h(self, kind, x, out, params=()) -> bool:
        if not self._halves(x, out):
            return False
        line = pointwise.line(kind)
        if x.raw is out.raw:
            if self.enc.fuse(out, kind, params=params):  # in the store of the float16 GEMM that wrote x
                return True
        elif line.reads == "x" and self.enc.fuse(x, kind, params=params, into=out):
            return True
        return self._elementwise_h(line.entry + "_h", [x, out], **_act(params))

    def _activation_grad_h(self, kind, src, dy, dx, params=()) -> bool:
        return self._halves(src, dy, dx) and self._elementwise_h(pointwise.line(kind).name + "_grad_h",
                                                                 [src, dy, dx], **_act(params))

    def _copy_h(self, x, out) -> bool:
        if not self._halves(x, out):
            return False
        return x.raw is out.raw or self._elementwise_h("copy_h", [x, out])

    def _fill_h(self, value, out) -> bool:
        return self._halves(out) and self._elementwise_h("fill_h", [out], value=value)

    def _scal_h(self, alpha, x) -> bool:
        return self._halves(x) and self._elementwise_h("scal_h", [x], alpha=alpha)

    def _axpby_h(self, alpha, x, beta, y) -> bool:
        return self._halves(x, y) and self._elementwise_h("axpby_h", [x, y], alpha=alpha, beta=beta)

    def _copy_block_h(self, part, whole, part_inner, whole_inner, offset, into_whole) -> bool:
        """Concat's and Slice's blocks; the thread count is the part's elements (the first buffer)."""
        if not self._halves(part, whole) or part.raw is whole.raw:
            return False
        self._elementwise("block_into_h" if into_whole else "block_from_h", part.size, [part, whole],
                          ElementwiseHalfParams, whole=(0, 1), part_inner=part_inner, whole_inner=whole_inner,
                          column=offset)
        return True

    def _mul_h(self, x, y, out) -> bool:
        """float16 x and out, y float16 or float32 (a dropout mask)."""
        if not self._halves(x, out) or y.dtype not in (F16, F32) or y.raw.size > self.gpu.max_binding:
            return False
        return self._elementwise_h("mul_h" if y.dtype == F16 else "mul_hf", [x, y, out])

    def _bias_add_h(self, y, b) -> bool:
        if not self._halves(y) or b.dtype not in (F16, F32) or b.raw.size > self.gpu.max_binding:
            return False
        n, c = y.shape[0], y.shape[1]
        if y.size == n * c and self.enc.fuse(y, "bias", b):  # [N, C]: in the store of the GEMM that wrote y
            return True
        self._elementwise("bias_add_h" if b.dtype == F16 else "bias_add_hf", y.size, [y, b], ElementwiseHalfParams,
                          whole=(0, 1), channels=c, inner=y.size // (n * c))
        return True

    def _gemm_h(self, a, trans_a, b, trans_b, out, alpha=1.0, beta=0.0) -> bool:
        """Any of A, B and C float16, the others float32, each within one binding: the tiled kernels with float16
        loads (and a float16 store)."""
        views = (a, b, out)
        if not any(v.dtype == F16 for v in views) or any(v.dtype not in (F16, F32) or v.raw.size > self.gpu.max_binding
                                                         for v in views):
            return False
        self.gemms.gemm(a, trans_a, b, trans_b, out, alpha, beta)
        return True

    # convolutions, where every tensor fits one binding: as Winograd where the float32 path takes it (the same rule,
    # _winograd_chunk), float16 loads and stores around float32 transforms and tiles; elsewhere as implicit GEMMs
    # (x, dy and dx read and written in NCHW by the GEMM kernels, no float32 columns)
    def _conv2d_h(self, x, w, out, stride, padding, ws, bias=None, dilation=(1, 1), groups=1) -> bool:
        if not plain_conv(x.shape, w.shape, out.shape, stride, padding, dilation, groups):
            return False  # direct.wgsl, on float32 copies
        if not self._halves(x, w, out, *([bias] if bias is not None else [])):
            return False
        if self.convs.winograd_conv(x, w, out, stride, padding, bias):
            return True
        if not self.convs.implicit_conv:
            return False
        n, _, o, k, p, _, _ = self.convs.conv_geometry(x.shape, w.shape, out.shape, stride, padding)
        conv = self.convs.conv_constants(x.shape, w.shape, out.shape, stride, padding, B_MODE=1, C_MODE=1)
        self.gemms.product(w, False, x, False, out, o, n * p, k, 1.0, 0.0, conv, bias=bias)
        return True

    def _conv2d_grad_data_h(self, dy, w, dx, stride, padding, ws, dilation=(1, 1), groups=1) -> bool:
        if not plain_conv(dx.shape, w.shape, dy.shape, stride, padding, dilation, groups):
            return False
        if not self._halves(dy, w, dx):
            return False
        if self.convs.winograd_conv_grad_data(dy, w, dx, stride, padding):
            return True
        if not self.convs.implicit_conv:
            return False
        n, c, h, wd = dx.shape
        o, _, kh, kw = w.shape
        conv = self.convs.conv_constants(dx.shape, w.shape, dy.shape, stride, padding, A_MODE=2, B_MODE=4, C_MODE=2)
        self.gemms.product(w, False, dy, False, dx, c, n * h * wd, o * kh * kw, 1.0, 0.0, conv)
        return True

    def _conv2d_grad_filter_h(self, x, dy, dw, stride, padding, ws, beta=0.0, dilation=(1, 1), groups=1) -> bool:
        if not plain_conv(x.shape, dw.shape, dy.shape, stride, padding, dilation, groups):
            return False
        if not self._halves(x, dy) or dw.dtype not in (F16, F32) or dw.raw.size > self.gpu.max_binding:
            return False
        if self.convs.winograd_conv_grad_filter(x, dy, dw, stride, padding, beta):
            return True
        if not self.convs.implicit_conv:
            return False
        n, _, o, k, p, _, _ = self.convs.conv_geometry(x.shape, dw.shape, dy.shape, stride, padding)
        conv = self.convs.conv_constants(x.shape, dw.shape, dy.shape, stride, padding, A_MODE=1, B_MODE=2)
        self.gemms.product(dy, False, x, True, dw, o, k, n * p, 1.0, beta, conv)
        return True

    def _pool2d_h(self, x, out, mask, mode, kernel, stride, padding, pad_end=None, count_pad=True) -> bool:
        if not self._halves(x, out):
            return False
        self.convs.pool2d(x, out, mask, mode, kernel, stride, padding, pad_end, count_pad)
        return True

    def _pool2d_grad_h(self, dy, dx, mask, mode, kernel, stride, padding, pad_end=None, count_pad=True) -> bool:
        if not self._halves(dy, dx):
            return False
        self.convs.pool2d_grad(dy, dx, mask, mode, kernel, stride, padding, pad_end, count_pad)
        return True

    def _bias_grad_h(self, dy, db, beta=0.0) -> bool:
        """Per-channel sums of a float16 dy (read as float16, summed in float32) into a float32 db."""
        if not self._halves(dy) or db.dtype != F32:
            return False
        self.ew.bias_grad(dy, db, beta)
        return True

    # softmax and log-softmax: a float16 input, the float32 output the objective reads; their gradients from float32
    # into a float16 dx
    def _softmax_h(self, x, out, log: bool = False) -> bool:
        if not self._halves(x) or out.dtype != F32 or out.raw.size > self.gpu.max_binding:
            return False
        self.ew.class_dispatch("softmax", *self.ew.rows(x), log, [x, out], module="classes16a")
        return True

    def _log_softmax_h(self, x, out) -> bool:
        return self._softmax_h(x, out, log=True)

    def _softmax_grad_h(self, y, dy, dx, log: bool = False) -> bool:
        if not self._halves(dx) or y.dtype != F32 or dy.dtype != F32 \
                or max(y.raw.size, dy.raw.size) > self.gpu.max_binding:
            return False
        self.ew.class_dispatch("softmax_grad", *self.ew.rows(y), log, [y, dy, dx], module="classes16c")
        return True

    def _log_softmax_grad_h(self, y, dy, dx) -> bool:
        return self._softmax_grad_h(y, dy, dx, log=True)

    # batch normalisation and LRN: x, y, dy and dx float16 (distinct buffers), the statistics, sums, weights and
    # LRN's scale float32
    def _bn_fits(self, halves: list, singles: list) -> bool:
        raws = [b.raw for b in halves]
        return (self._halves(*halves) and len(set(map(id, raws))) == len(raws)
                and all(b is None or (b.dtype == F32 and b.raw.size <= self.gpu.max_binding) for b in singles))

    def _batch_norm_stats_h(self, x, mean, var) -> bool:
        if not self._bn_fits([x], [mean, var]):
            return False
        self.ew.batch_norm_stats(x, mean, var)
        return True

    def _batch_norm_h(self, x, mean, var, gamma, beta, y, eps) -> bool:
        if not self._bn_fits([x, y], [mean, var, gamma, beta]):
            return False
        self.ew.batch_norm(x, mean, var, gamma, beta, y, eps)
        return True

    def _batch_norm_grad_sums_h(self, x, dy, mean, var, sum_dy, sum_dy_xhat, eps) -> bool:
        if not self._bn_fits([x, dy], [mean, var, sum_dy, sum_dy_xhat]):
            return False
        self.ew.batch_norm_grad_sums(x, dy, mean, var, sum_dy, sum_dy_xhat, eps)
        return True

    def _batch_norm_grad_h(self, x, dy, mean, var, gamma, sum_dy, sum_dy_xhat, dx, eps, batch_stats) -> bool:
        if not self._bn_fits([x, dy, dx], [mean, var, gamma, sum_dy, sum_dy_xhat]):
            return False
        self.ew.batch_norm_grad(x, dy, mean, var, gamma, sum_dy, sum_dy_xhat, dx, eps, batch_stats)
        return True

    def _lrn_h(self, x, scale, out, size, alpha, beta, k) -> bool:
        if not self._bn_fits([x, out], [scale]):
            return False
        self.ew.lrn(x, scale, out, size, alpha, beta, k)
        return True

    def _lrn_grad_h(self, x, y, scale, dy, dx, size, alpha, beta) -> bool:
        if not self._bn_fits([x, y, dy, dx], [scale]):
            return False
        self.ew.lrn_grad(x, y, scale, dy, dx, size, alpha, beta)
        return True

    def _sequence_h(self, name: str, *args: Any, **kwargs: Any) -> bool:
        """Embeddings and recurrent cells with float16 operands, where every tensor fits one binding (counted as if
        float32: the modules' runs past the limit bind 4-byte elements); the arrays bound to float16 buffers are
        declared float16 in their module (see device.Device.typed)."""
        views = [v for v in (*args, *kwargs.values()) if isinstance(v, WView)]
        if not any(v.dtype == F16 for v in views) or any(4 * v.raw.size // v.dtype.itemsize > self.gpu.max_binding
                                                         for v in views):
            return False
        if name == "embedding_grad" and _is_half(args[2] if len(args) > 2 else kwargs.get("dtable")):
            return False  # the scatter adds with atomics on the float32 bits of its table: a float16 one is emulated
        getattr(self.ew, name)(*args, **kwargs)
        return True


class FullPrecision(Backend):
    """A backend's float32 twin on the same device (losses and softmax run there under fp16): everything but the
    precision is the backend's own, the command stream and buffers included, so the two interleave in order and
    share tensors' device copies (the same key)."""

    _OWN = frozenset({"_of", "precision", "compute_dtype", "mixed", "full_precision", "__class__", "__dict__",
                      "__repr__", "__init__"})

    def __init__(self, of: Backend) -> None:
        object.__setattr__(self, "_of", of)

    precision = "fp32"

    def full_precision(self) -> Backend:
        return self

    def __getattribute__(self, name: str) -> Any:
        if name in FullPrecision._OWN:
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "_of"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._of, name, value)

    def __repr__(self) -> str:
        return f"<{type(self._of).__name__} {self._of.key} float32 (the full-precision twin)>"
