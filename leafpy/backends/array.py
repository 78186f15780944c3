"""Primitives written once against an array module (``xp``): NumPy for native, CuPy for cuda.

Subclasses set ``xp`` and the memory contract, and override only the hot paths they can do better.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from . import pointwise, updates
from .base import MEMORY, PRECISIONS, PRIMITIVES, SHORTHANDS, Backend, Pair, emulated, plain_conv

Array = Any
"""An ``xp`` array (NumPy or CuPy): the buffers of the array backends."""

DROPOUT_HASH_ROUNDS = ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, 0))
"""The murmur3 finaliser: h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16."""


DROPOUT_KEY_MULTIPLIER = 0x9E3779B9
"""A draw's seed times this (modulo 2**32) is the offset added to the element index before hashing."""


def dropout_threshold(ratio: float) -> int:
    """An element is kept when its 32-bit hash is at least this."""
    return min(int(ratio * 2**32), 2**32 - 1)


CHANNELS_LAST = (0, 2, 3, 1)
"""The memory order of a 4-D [N, C, H, W] tensor on a channels-last backend: N, H, W, C (NHWC)."""


class ArrayBackend(Backend):
    """A backend whose buffers are ``xp`` arrays.

    With ``channels_last`` every 4-D tensor is stored NHWC and handed to primitives as a strided [N, C, H, W] view
    of that memory, so the primitives written against ``xp`` serve both orders; a primitive that needs row-major
    memory takes it through :meth:`_row_major`."""

    xp: Any = np

    def __init__(self, dtype: Any = np.float32, precision: str = "fp32", channels_last: bool | None = False) -> None:
        from ..errors import ConfigError

        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise ConfigError(f"backend '{self.name}': dtype must be float32 or float64, got {dtype}")
        if precision not in PRECISIONS:
            raise ConfigError(f"backend '{self.name}': unknown precision {precision!r}; valid precisions: "
                              f"{', '.join(PRECISIONS)}")
        if channels_last is None:
            channels_last = precision in self.CHANNELS_LAST_PRECISIONS
        if not isinstance(channels_last, (bool, np.bool_)):
            raise ConfigError(f"backend '{self.name}': channels_last must be true or false, got {channels_last!r}")
        self.dtype = dtype
        self.precision = precision
        self.channels_last = bool(channels_last)
        self._options: dict[str, Any] = {"dtype": dtype, "channels_last": self.channels_last}
        self._twin: Backend | None = None
        if self.mixed:
            self._emulate_low_precision()

    # --- bf16 and fp16 by emulation: low-precision storage, float32 arithmetic ---------------------------------
    EMULATED = tuple(name for name in PRIMITIVES + SHORTHANDS if name not in MEMORY + ("copy",))
    """The primitives that, under bf16 and fp16, read their bfloat16 and float16 operands as float32 copies,
    compute in float32 and round what they write back into the operands' own dtype."""

    def _emulate_low_precision(self) -> None:
        low = (np.dtype(np.float16), self.compute_dtype)

        def is_low(a: Any) -> bool:
            return getattr(a, "dtype", None) in low

        def widen(operands: dict[str, Array]) -> dict[str, Array]:
            return {k: a.astype(np.float32) for k, a in operands.items()}

        def narrow(copy: Array, operand: Array) -> None:
            operand[...] = copy

        # inf beyond the format's range and nan from it, as on a GPU: loss scaling looks for them. Nothing is
        # compared or read back, so a recorded step (a CUDA graph) can hold an emulated primitive.
        errstate = functools.partial(np.errstate, over="ignore", invalid="ignore")
        for name in self.EMULATED:
            setattr(self, name, emulated(name, getattr(self, name), is_low, widen, narrow, errstate))

    def cast(self, x, out):
        if x.dtype == out.dtype:  # a copy (a batch staged every step: no error state to set up)
            out[...] = x.reshape(out.shape)
            return
        with np.errstate(over="ignore"):  # beyond float16's range is inf (loss scaling looks for it)
            out[...] = x.reshape(out.shape)

    def full_precision(self):
        if not self.mixed:
            return self
        if self._twin is None:
            self._twin = type(self)(**self._options)
        return self._twin

    def memory_order(self, shape):
        return CHANNELS_LAST if self.channels_last and len(shape) == 4 else None

    def view(self, buf: Array, shape: tuple[int, ...]) -> Array:
        if self.channels_last and len(shape) == 4:
            n, c, h, w = shape
            return buf.reshape(n, h, w, c).transpose(0, 3, 1, 2)
        return buf.reshape(shape)

    def relayout(self, buf, old, new):
        values = self.xp.ascontiguousarray(self.view(buf, old))  # row-major: the order both shapes share
        self.view(buf, new)[...] = values.reshape(new)

    @staticmethod
    def flat(a: Array) -> Array:
        """The elements of ``a`` (a buffer as :meth:`view` hands it out, or a row-major array) as a 1-D view, in
        memory order: arrays of one shape share that order, so elementwise work over several of them (solver
        updates, packing gradients) may run on these views."""
        if a.flags.c_contiguous:
            return a.reshape(-1)
        if a.ndim == 4:
            t = a.transpose(CHANNELS_LAST)
            if t.flags.c_contiguous:
                return t.reshape(-1)
        from ..errors import BackendError

        raise BackendError(f"{a.shape} array with strides {a.strides} is not one block of memory")

    @contextmanager
    def _row_major(self, a: Array, read: bool = True) -> Iterator[Array]:
        """``a`` as a row-major array for code that reshapes it: ``a`` itself when it is one, else a row-major
        copy (of its values when ``read``) whose values are written back into ``a`` afterwards."""
        if a.flags.c_contiguous:
            yield a
            return
        t = self.xp.ascontiguousarray(a) if read else self.xp.empty(a.shape, a.dtype)
        yield t
        a[...] = t

    # --- BLAS ---------------------------------------------------------------------------------------------
    def gemm(self, a, trans_a, b, trans_b, out, alpha=1.0, beta=0.0):
        xp = self.xp
        a2 = a.T if trans_a else a
        b2 = b.T if trans_b else b
        if beta == 0.0:
            xp.matmul(a2, b2, out=out)
            if alpha != 1.0:
                out *= alpha
        else:
            prod = xp.matmul(a2, b2)
            if beta != 1.0:
                out *= beta
            if alpha != 1.0:
                prod *= alpha
            out += prod

    def axpby(self, alpha, x, beta, y):
        if beta == 0.0:
            self.xp.multiply(x, alpha, out=y)
            return
        if beta != 1.0:
            y *= beta
        if alpha == 1.0:
            y += x
        elif alpha == -1.0:
            y -= x
        else:
            y += alpha * x

    def scal(self, alpha, x):
        x *= alpha

    def copy(self, x, out):
        if x is out:
            return
        out[...] = x.reshape(out.shape)

    def fill(self, value, out):
        out.fill(value)

    def mul(self, x, y, out):
        self.xp.multiply(x, y, out=out)

    def maximum(self, x, y, out):
        self.xp.maximum(x, y, out=out)

    def dot(self, x, y, out):
        if x.shape == y.shape and x.strides == y.strides and not x.flags.c_contiguous and x.ndim == 4:
            out[...] = self.xp.dot(self.flat(x), self.flat(y))  # channels-last: over the memory, no copies
            return
        out[...] = self.xp.dot(x.reshape(-1), y.reshape(-1))

    # --- activations: evaluated from their formulas in pointwise.TABLE ---------------------------------------------
    def activation(self, kind, x, out, params=()):
        line = pointwise.TABLE.get(kind) or pointwise.line(kind)
        pointwise.evaluate(self.xp, line.forward, ("x",), (x,), line.params, params, out)

    def activation_grad(self, kind, src, dy, dx, params=()):
        line = pointwise.TABLE.get(kind) or pointwise.line(kind)
        pointwise.evaluate(self.xp, line.gradient, (line.reads, "dy"), (src, dy), line.params, params, dx)

    @staticmethod
    def _classes(a: Array) -> Array:
        return a.reshape(a.shape[0], a.shape[1], -1)

    def softmax(self, x, out):
        xp = self.xp
        x3, o3 = self._classes(x), self._classes(out)
        xp.subtract(x3, x3.max(axis=1, keepdims=True), out=o3)
        xp.exp(o3, out=o3)
        o3 /= o3.sum(axis=1, keepdims=True)

    def softmax_grad(self, y, dy, dx):
        y3, dy3, dx3 = self._classes(y), self._classes(dy), self._classes(dx)
        s = (dy3 * y3).sum(axis=1, keepdims=True)
        self.xp.subtract(dy3, s, out=dx3)
        dx3 *= y3

    def log_softmax(self, x, out):
        xp = self.xp
        x3, o3 = self._classes(x), self._classes(out)
        xp.subtract(x3, x3.max(axis=1, keepdims=True), out=o3)
        o3 -= xp.log(xp.exp(o3).sum(axis=1, keepdims=True))

    def log_softmax_grad(self, y, dy, dx):
        xp = self.xp
        y3, dy3, dx3 = self._classes(y), self._classes(dy), self._classes(dx)
        s = dy3.sum(axis=1, keepdims=True)
        xp.subtract(dy3, xp.exp(y3) * s, out=dx3)

    # --- losses -------------------------------------------------------------------------------------------
    def _label_index(self, labels):
        return labels.reshape(-1).astype(self.xp.intp)

    def nll(self, logp, labels, out, weight=(), ignore_index=None, reduction="mean"):
        nll_forward(self.xp, logp, labels, out, self._class_weights(weight), ignore_index, reduction)

    def nll_grad(self, labels, dloss, dx, weight=(), ignore_index=None, reduction="mean"):
        nll_backward(self.xp, labels, dloss, dx, self._class_weights(weight), ignore_index, reduction)

    def _class_weights(self, weight: tuple[float, ...]) -> Any:
        """The class weights as a device array, uploaded once (a recorded CUDA graph step copies nothing from
        the host); () as it is."""
        if not weight:
            return ()
        cache = self.__dict__.setdefault("_class_weight_arrays", {})
        if weight not in cache:
            cache[weight] = self.xp.asarray(weight, dtype=self.xp.float64)
        return cache[weight]

    def mse(self, x, t, diff, out):
        xp = self.xp
        xp.subtract(x, t.reshape(x.shape), out=diff)
        f = diff.reshape(-1)
        out[...] = xp.dot(f, f) / f.size

    def mse_grad(self, diff, dloss, dx):
        self.xp.multiply(diff, dloss.reshape(()) * (2.0 / diff.size), out=dx)

    # --- bias ---------------------------------------------------------------------------------------------
    def bias_add(self, y, b):
        y3 = y.reshape(y.shape[0], y.shape[1], -1)
        y3 += b.reshape(1, -1, 1)

    def bias_grad(self, dy, db, beta=0.0):
        dy3 = dy.reshape(dy.shape[0], dy.shape[1], -1)
        s = dy3.sum(axis=2).sum(axis=0) if dy3.shape[2] > 1 else dy3[:, :, 0].sum(axis=0)  # contiguous first
        if beta == 0.0:
            db[...] = s
        else:
            db *= beta
            db += s

    # --- batch normalisation ---------------------------------------------------------------------------------
    @staticmethod
    def _per_channel(x: Array) -> Array:
        return x.reshape(x.shape[0], x.shape[1], -1)

    @staticmethod
    def _channel(v: Array) -> Array:
        return v.reshape(1, -1, 1)

    def _bn_work(self, x3: Array) -> Array:
        """One pass's worth of per-call scratch (shared across layers on native: no array per call)."""
        return self._work({}, "bn_values", x3.shape)

    def batch_norm_stats(self, x, mean, var):
        xp, x3 = self.xp, self._per_channel(x)
        count = x3.shape[0] * x3.shape[2]
        mean[...] = x3.sum(axis=(0, 2)) / count
        t = self._bn_work(x3)
        xp.subtract(x3, self._channel(mean), out=t)  # two passes: no cancellation when |mean| >> std
        # the corrected two-pass form: the first mean's rounding (a float32 sum of values of |mean|: 1e-4 at 1e3,
        # a percent of a 1e-2 spread) comes back as the deviations' mean, small and exact enough to add
        correction = t.sum(axis=(0, 2)) / count
        t *= t
        var[...] = xp.maximum(t.sum(axis=(0, 2)) / count - correction * correction, 0)
        mean += correction

    def _bn_scale(self, var, gamma, eps):
        a = 1.0 / self.xp.sqrt(var + eps)
        return a * gamma if gamma is not None else a

    def batch_norm(self, x, mean, var, gamma, beta, y, eps):
        # (x - mean) scale + beta, centred first: x scale + (beta - mean scale) adds two terms of |mean| scale that
        # cancel, losing float32's precision where |mean| >> std (1e3 + 1e-2 noise: errors 3x PyTorch's)
        scale = self._bn_scale(var, gamma, eps)
        y3 = self._per_channel(y)
        self.xp.subtract(self._per_channel(x), self._channel(mean), out=y3)
        y3 *= self._channel(scale)
        if beta is not None:
            y3 += self._channel(beta)

    def batch_norm_grad_sums(self, x, dy, mean, var, sum_dy, sum_dy_xhat, eps):
        xp, dy3 = self.xp, self._per_channel(dy)
        sum_dy[...] = dy3.sum(axis=(0, 2))
        t = self._bn_work(dy3)
        xp.subtract(self._per_channel(x), self._channel(mean), out=t)
        t *= dy3
        sum_dy_xhat[...] = t.sum(axis=(0, 2)) / xp.sqrt(var + eps)

    def batch_norm_grad(self, x, dy, mean, var, gamma, sum_dy, sum_dy_xhat, dx, eps, batch_stats):
        xp = self.xp
        a = self._bn_scale(var, gamma, eps)
        dx3, dy3 = self._per_channel(dx), self._per_channel(dy)
        if not batch_stats:
            xp.multiply(dy3, self._channel(a), out=dx3)
            return
        # dx = a dy + b (x - mean) + k, with b = -a sum_dy_xhat / (m sqrt(var + eps)) and k = -a sum_dy / m (x
        # centred first, as in the forward pass: b x and b mean cancel where |mean| >> std)
        m = dx3.shape[0] * dx3.shape[2]
        b = -a * sum_dy_xhat / (m * xp.sqrt(var + eps))
        k = -a * sum_dy / m
        t = self._bn_work(dx3)
        xp.subtract(self._per_channel(x), self._channel(mean), out=t)
        t *= self._channel(b)
        xp.multiply(dy3, self._channel(a), out=dx3)
        dx3 += t
        dx3 += self._channel(k)

    # --- convolution: im2col in (C, kh, kw, oh, ow, N) order, then one GEMM ------------------------------------
    # The batch is the innermost axis of the columns, so every window copy and every col2im addition runs over
    # long contiguous rows (ow * N values) instead of short image rows.
    def _scratch(self, ws: dict, name: str, shape: tuple[int, ...], dtype: Any = None) -> Array:
        a = ws.get(name)
        if a is None or a.shape != shape or (dtype is not None and a.dtype != dtype):
            a = self.xp.empty(shape, dtype or self.dtype)
            ws[name] = a
        return a

    def _zeroed_once(self, ws: dict, name: str, shape: tuple[int, ...], dtype: Any = None) -> Array:
        """The layer's scratch ``name``, zero filled when it is (re)allocated: a padded copy whose border stays zero
        while only its interior is written."""
        t = self._scratch(ws, name, shape, dtype)
        if ws.get(name + "_zeroed") is not t:
            t.fill(0)
            ws[name + "_zeroed"] = t
        return t

    @staticmethod
    def _pieces(count: int, item_bytes: int, piece_bytes: int) -> list[tuple[int, int]]:
        """Ranges [a, b) of ``count`` items of ``item_bytes`` each, about ``piece_bytes`` per range (at least one
        item)."""
        per = max(1, piece_bytes // max(1, item_bytes))
        return [(a, min(count, a + per)) for a in range(0, count, per)]

    def _filter_with_bias(self, w: Array, bias: Array | None, ws: dict) -> Array:
        """w as [O, C * kh * kw], with the bias as one more column when there is one: multiplied against columns
        that end in a row of ones, the product then includes the bias (no pass over the output for it)."""
        o = w.shape[0]
        if bias is None:
            return w.reshape(o, -1)
        k = w.size // o
        filt = self._work(ws, "filter_and_bias", (o, k + 1), w.dtype)
        filt[:, :k] = w.reshape(o, k)
        filt[:, k] = bias
        return filt

    def _work(self, ws: dict, name: str, shape: tuple[int, ...], dtype: Any = None) -> Array:
        """Scratch that lives for one primitive call only (nothing reads it afterwards): kept per layer here; the
        native backend shares one buffer per name across layers."""
        return self._scratch(ws, name, shape, dtype)

    @staticmethod
    def _windows(kh: int, kw: int, oh: int, ow: int, stride: Pair):
        sh, sw = stride
        for i in range(kh):
            for j in range(kw):
                yield i, j, slice(i, i + sh * (oh - 1) + 1, sh), slice(j, j + sw * (ow - 1) + 1, sw)

    def _to_chwn(self, x: Array, padding: Pair, ws: dict, name: str) -> Array:
        """x [N, C, H, W] as [C, H + 2ph, W + 2pw, N], zero padded."""
        n, c, h, w = x.shape
        ph, pw = padding
        shape = (c, h + 2 * ph, w + 2 * pw, n)
        t = self._zeroed_once(ws, name, shape, x.dtype) if ph or pw else self._scratch(ws, name, shape, x.dtype)
        t[:, ph:ph + h, pw:pw + w, :] = x.transpose(1, 2, 3, 0)
        ws[name + "_of"] = self._identity(x)
        return t

    def _im2col(self, x: Array, kh: int, kw: int, oh: int, ow: int, stride: Pair, padding: Pair,
                ws: dict) -> Array:
        xt = self._to_chwn(x, padding, ws, "x_chwn")
        cols = self._cols_of_rows(xt, kh, kw, 0, oh, ow, stride, ws, oh, keep=True)
        ws["cols_of"] = self._identity(x)
        return cols

    def _cols_of_rows(self, xt: Array, kh: int, kw: int, a: int, b: int, ow: int, stride: Pair, ws: dict,
                      rows: int, keep: bool = False) -> Array:
        """The columns [C * kh * kw + 1, (b - a) * ow * N] of output rows a..b, gathered from xt [C, H, W, N], with a
        last row of ones (the bias's column), into scratch sized for ``rows`` output rows: the layer's own ("cols",
        kept for the filter gradient) or a piece that lives for this call."""
        c, n = xt.shape[0], xt.shape[3]
        k = c * kh * kw
        size = ((k + 1) * rows * ow * n,)
        buf = self._scratch(ws, "cols", size, xt.dtype) if keep else self._work(ws, "cols_piece", size, xt.dtype)
        cols = buf[:(k + 1) * (b - a) * ow * n].reshape(k + 1, -1)
        self._gather_windows(xt, cols[:k].reshape(c, kh, kw, b - a, ow, n), a, stride)
        cols[k] = 1
        return cols

    def _gather_windows(self, xt: Array, windows: Array, a: int, stride: Pair) -> None:
        """windows [C, kh, kw, R, ow, N] = the taps of xt [C, H, W, N] for output rows a..a + R."""
        sh = stride[0]
        _, kh, kw, rows, ow, _ = windows.shape
        for i, j, _, columns in self._windows(kh, kw, rows, ow, stride):
            windows[:, i, j] = xt[:, i + sh * a:i + sh * (a + rows - 1) + 1:sh, columns, :]

    def _scatter_windows(self, windows: Array, dxt: Array, a: int, stride: Pair) -> None:
        """dxt [C, H, W, N] += windows [C, kh, kw, R, ow, N] at their taps for output rows a..a + R, window position
        by window position."""
        sh = stride[0]
        _, kh, kw, rows, ow, _ = windows.shape
        for i, j, _, columns in self._windows(kh, kw, rows, ow, stride):
            dxt[:, i + sh * a:i + sh * (a + rows - 1) + 1:sh, columns, :] += windows[:, i, j]

    def _row_spans(self, oh: int, row_bytes: int) -> list[tuple[int, int]]:
        """Output rows per piece of a convolution's columns (row_bytes: the columns of one output row): all at once
        here; the native backend cuts large columns into pieces that stay in cache."""
        return [(0, oh)]

    @staticmethod
    def _identity(a: Array) -> tuple:
        """What a cached derived buffer was computed from (data pointer and shape)."""
        ptr = a.__array_interface__["data"][0] if hasattr(a, "__array_interface__") else a.data.ptr
        return ptr, a.shape

    def _dy_t(self, dy: Array, ws: dict) -> Array:
        """dy [N, O, oh, ow] as [O, oh * ow * N] (computed once per backward pass: kept for the next call only
        within a backward pass that follows a forward :meth:`conv2d` in the same ``ws``, which marks the pass)."""
        n, o, oh, ow = dy.shape
        t = self._scratch(ws, "dy_t", (o, oh, ow, n), dy.dtype)
        key = self._identity(dy)
        if ws.get("dy_t_of") != key or ws.get("dy_t_fresh") is not True:
            t[...] = dy.transpose(1, 2, 3, 0)
            ws["dy_t_of"] = key
            ws["dy_t_fresh"] = ws.pop("in_pass", False)
        return t.reshape(o, -1)

    def _to_batch_first(self, dst: Array, src: Array) -> None:
        """dst [N, R] = src [R, N] transposed (a batch-innermost layout back to NCHW)."""
        dst[...] = src.T

    # --- grouped, dilated or asymmetrically padded convolution: per-group GEMMs over tap-by-tap columns ----------
    _plain_conv = staticmethod(plain_conv)

    def _padded_input(self, x: Array, y_shape, kernel, stride, padding, dilation, ws: dict, name: str) -> Array:
        """x [N, C, H, W] zero padded before by ``padding`` and after as far as the windows reach."""
        n, c, h, w = x.shape
        ph, pw = padding
        hp, wp = (max(size + p, (o - 1) * s + (k - 1) * d + 1) for size, o, k, s, p, d in
                  zip((h, w), y_shape[2:], kernel, stride, padding, dilation))
        t = self._zeroed_once(ws, name, (n, c, hp, wp), x.dtype)
        t[:, :, ph:ph + h, pw:pw + w] = x
        return t

    @staticmethod
    def _dilated_windows(kh: int, kw: int, oh: int, ow: int, stride: Pair, dilation: Pair):
        sh, sw = stride
        dh, dw = dilation
        for i in range(kh):
            for j in range(kw):
                yield i, j, slice(i * dh, i * dh + sh * (oh - 1) + 1, sh), slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)

    def _group_cols(self, x, w_shape, y_shape, stride, padding, dilation, groups, ws) -> Array:
        """Columns [G, C/G * kh * kw, N * oh * ow] of x (the group's channels, taps, then batch and position)."""
        _, cg, kh, kw = w_shape
        n, _, oh, ow = y_shape
        src = self._padded_input(x, y_shape, (kh, kw), stride, padding, dilation, ws, "x_general")
        cols = self._work(ws, "cols_general", (x.shape[1], kh, kw, n, oh, ow), x.dtype)
        for i, j, rows, columns in self._dilated_windows(kh, kw, oh, ow, stride, dilation):
            cols[:, i, j] = src[:, :, rows, columns].transpose(1, 0, 2, 3)
        return cols.reshape(groups, cg * kh * kw, n * oh * ow)

    def _conv_general(self, x, w, out, stride, padding, ws, bias, dilation, groups) -> None:
        o = w.shape[0]
        og = o // groups
        n, _, oh, ow = out.shape
        cols = self._group_cols(x, w.shape, out.shape, stride, padding, dilation, groups, ws)
        y = self._work(ws, "y_general", (o, n * oh * ow), x.dtype)
        w3 = w.reshape(groups, og, -1)
        for g in range(groups):
            self.xp.matmul(w3[g], cols[g], out=y[g * og:(g + 1) * og])
        out[...] = y.reshape(o, n, oh, ow).transpose(1, 0, 2, 3)
        if bias is not None:
            self.bias_add(out, bias)

    def _grad_filter_general(self, x, dy, dw, stride, padding, ws, beta, dilation, groups) -> None:
        o = dw.shape[0]
        og = o // groups
        cols = self._group_cols(x, dw.shape, dy.shape, stride, padding, dilation, groups, ws)
        dy_t = self.xp.ascontiguousarray(dy.transpose(1, 0, 2, 3)).reshape(groups, og, -1)
        with self._row_major(dw, read=beta != 0.0) as d:
            d3 = d.reshape(groups, og, -1)
            for g in range(groups):
                self.gemm(dy_t[g], False, cols[g], True, d3[g], 1.0, beta)

    def _grad_data_general(self, dy, w, dx, stride, padding, ws, dilation, groups) -> None:
        o, cg, kh, kw = w.shape
        og = o // groups
        n, c, h, wd = dx.shape
        oh, ow = dy.shape[2], dy.shape[3]
        ph, pw = padding
        dy_t = self.xp.ascontiguousarray(dy.transpose(1, 0, 2, 3)).reshape(groups, og, -1)
        dcols = self._work(ws, "dcols_general", (c, kh, kw, n, oh, ow), dy.dtype)
        d3 = dcols.reshape(groups, cg * kh * kw, -1)
        w3 = w.reshape(groups, og, -1)
        for g in range(groups):
            self.xp.matmul(w3[g].T, dy_t[g], out=d3[g])
        dxp = self._padded_input(dx, dy.shape, (kh, kw), stride, padding, dilation, ws, "dx_general")
        dxp.fill(0)
        for i, j, rows, columns in self._dilated_windows(kh, kw, oh, ow, stride, dilation):
            dxp[:, :, rows, columns] += dcols[:, i, j].transpose(1, 0, 2, 3)
        dx[...] = dxp[:, :, ph:ph + h, pw:pw + wd]

    def conv2d(self, x, w, out, stride, padding, ws, bias=None, dilation=(1, 1), groups=1):
        if not self._plain_conv(x.shape, w.shape, out.shape, stride, padding, dilation, groups):
            return self._conv_general(x, w, out, stride, padding, ws, bias, dilation, groups)
        o, c, kh, kw = w.shape
        n, _, oh, ow = out.shape
        k = c * kh * kw
        y = self._work(ws, "y_t", (o, oh * ow * n), x.dtype)
        filt = self._filter_with_bias(w, bias, ws)
        rows_used = filt.shape[1]
        row = ow * n
        spans = self._row_spans(oh, k * row * x.itemsize)
        if len(spans) == 1:
            cols = self._im2col(x, kh, kw, oh, ow, stride, padding, ws)
            self.xp.matmul(filt, cols[:rows_used], out=y)
        else:  # columns too large to keep: gathered and multiplied a piece at a time, while in cache
            ws.pop("cols_of", None)
            xt = self._to_chwn(x, padding, ws, "x_chwn")
            rows = max(b - a for a, b in spans)
            for a, b in spans:
                cols = self._cols_of_rows(xt, kh, kw, a, b, ow, stride, ws, rows)
                self.xp.matmul(filt, cols[:rows_used], out=y[:, a * row:b * row])
        if out.flags.c_contiguous:
            self._to_batch_first(out.reshape(n, -1), y.reshape(-1, n))
        else:
            out[...] = y.reshape(o, oh, ow, n).transpose(3, 0, 1, 2)
        ws["dy_t_fresh"] = False  # a new forward pass: the next backward brings a new dy
        ws["in_pass"] = True

    def conv2d_grad_filter(self, x, dy, dw, stride, padding, ws, beta=0.0, dilation=(1, 1), groups=1):
        if not self._plain_conv(x.shape, dw.shape, dy.shape, stride, padding, dilation, groups):
            return self._grad_filter_general(x, dy, dw, stride, padding, ws, beta, dilation, groups)
        if not dw.flags.c_contiguous:
            with self._row_major(dw, read=beta != 0.0) as d:
                return self.conv2d_grad_filter(x, dy, d, stride, padding, ws, beta)
        try:
            self._grad_filter_plain(x, dy, dw, stride, padding, ws, beta)
        finally:  # the forward pass's columns serve one filter gradient: a later call may see new values at x
            ws.pop("cols_of", None)
            ws.pop("x_chwn_of", None)

    def _grad_filter_plain(self, x, dy, dw, stride, padding, ws, beta) -> None:
        o, c, kh, kw = dw.shape
        oh, ow = dy.shape[2], dy.shape[3]
        k = c * kh * kw
        dy_t, dw2 = self._dy_t(dy, ws), dw.reshape(o, -1)
        if ws.get("cols_of") == self._identity(x) and "cols" in ws:  # the forward pass's columns of this x
            return self._filter_product(dy_t, ws["cols"].reshape(k + 1, -1)[:k], dw2, beta, ws)
        row = ow * dy.shape[0]
        spans = self._row_spans(oh, k * row * x.itemsize)
        if len(spans) == 1:
            cols = self._im2col(x, kh, kw, oh, ow, stride, padding, ws)
            return self._filter_product(dy_t, cols[:k], dw2, beta, ws)
        xt = ws["x_chwn"] if ws.get("x_chwn_of") == self._identity(x) else self._to_chwn(x, padding, ws, "x_chwn")
        rows = max(b - a for a, b in spans)
        for a, b in spans:  # gathered again a piece at a time, the pieces' products summed into dw
            cols = self._cols_of_rows(xt, kh, kw, a, b, ow, stride, ws, rows)
            self._filter_product(dy_t[:, a * row:b * row], cols[:k], dw2, beta if a == 0 else 1.0, ws)

    def _spent(self, ws: dict, name: str, size: int, dtype: Any, otherwise: str) -> Array:
        """``size`` values of scratch for the data gradient: the forward pass's buffer ``name`` (its columns, its
        input as [C, H, W, N]) when it is large enough, else the scratch ``otherwise``. The filter gradient, run
        first, has read it: one buffer, warm in cache, instead of two. A later call computes it again. LeNet-64's
        second convolution on a 2-core machine (native, forward + both gradients, interleaved calls, minimum of
        300): 7.14 -> 6.36 ms and 7.58 -> 6.44 in two runs (medians 8.47 -> 7.86 and 8.66 -> 7.92); the same with
        one BLAS thread, in CPU time, the columns alone: 11.9 -> 11.2 ms."""
        buf = ws.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            return self._work(ws, otherwise, (size,), dtype)
        for mark in ("_of", "_zeroed"):
            ws.pop(name + mark, None)
        return buf.reshape(-1)[:size]

    def _filter_product(self, dy_t: Array, cols: Array, dw: Array, beta: float, ws: dict) -> None:
        """dw [O, K] = dy_t [O, L] @ cols [K, L]^T + beta * dw (the filter gradient's GEMM)."""
        self.gemm(dy_t, False, cols, True, dw, 1.0, beta)

    def conv2d_grad_data(self, dy, w, dx, stride, padding, ws, dilation=(1, 1), groups=1):
        if not self._plain_conv(dx.shape, w.shape, dy.shape, stride, padding, dilation, groups):
            return self._grad_data_general(dy, w, dx, stride, padding, ws, dilation, groups)
        o, c, kh, kw = w.shape
        n, _, h, wd = dx.shape
        oh, ow = dy.shape[2], dy.shape[3]
        ph, pw = padding
        dy_t = self._dy_t(dy, ws)
        ws["dy_t_fresh"] = False  # the data gradient is the last to read it: a later call may bring new dy values
        shape = (c, h + 2 * ph, wd + 2 * pw, n)
        dxt = self._spent(ws, "x_chwn", math.prod(shape), dx.dtype, "dx_chwn").reshape(shape)
        dxt.fill(0)
        k, row = c * kh * kw, ow * n
        spans = self._row_spans(oh, k * row * dy.itemsize)
        piece = self._spent(ws, "cols", k * max(b - a for a, b in spans) * row, dy.dtype, "dcols")
        for a, b in spans:  # each piece's scatter while it is in cache
            dcols = piece[:k * (b - a) * row].reshape(k, -1)
            self.xp.matmul(w.reshape(o, -1).T, dy_t[:, a * row:b * row], out=dcols)
            self._scatter_windows(dcols.reshape(c, kh, kw, b - a, ow, n), dxt, a, stride)
        if ph or pw or not dx.flags.c_contiguous:
            dx[...] = dxt[:, ph:ph + h, pw:pw + wd, :].transpose(3, 0, 1, 2)
        else:
            self._to_batch_first(dx.reshape(n, -1), dxt.reshape(-1, n))

    # --- pooling: one pass per window offset over strided views ----------------------------------------------
    @staticmethod
    def _pool_extent(x_shape, y_shape, kernel, stride, padding) -> tuple[int, int]:
        """The padded input's size: the padding before, the input, and as far after as the windows reach."""
        return tuple(max(size + p, (o - 1) * s + k) for size, o, k, s, p in
                     zip(x_shape[2:], y_shape[2:], kernel, stride, padding))

    def _pool_input(self, x: Array, padding: Pair, extent: tuple[int, int], value: float) -> Array:
        ph, pw = padding
        n, c, h, w = x.shape
        if not ph and not pw and extent == (h, w):
            return x
        xp_ = self.xp.full((n, c, *extent), value, x.dtype)
        xp_[:, :, ph:ph + h, pw:pw + w] = x
        return xp_

    def _pool_scale(self, x_shape, y_shape, kernel, stride, padding, pad_end, count_pad, dtype) -> Any:
        """1 / each average window's divisor: a number where every window counts kh * kw positions, else an
        [oh, ow] array (windows clipped at the input, or at its padding with ``count_pad``)."""
        counts = []
        for size, o, k, s, p, e in zip(x_shape[2:], y_shape[2:], kernel, stride, padding, pad_end or padding):
            starts = np.arange(o) * s - p
            lo, hi = (-p, size + e) if count_pad else (0, size)
            counts.append(np.minimum(starts + k, hi) - np.maximum(starts, lo))
        if all((c == k).all() for c, k in zip(counts, kernel)):
            return 1.0 / (kernel[0] * kernel[1])
        return self.xp.asarray(1.0 / np.maximum(np.outer(counts[0], counts[1]), 1), dtype=dtype)

    def pool2d(self, x, out, mask, mode, kernel, stride, padding, pad_end=None, count_pad=True):
        kh, kw = kernel
        oh, ow = out.shape[2], out.shape[3]
        xp = self.xp
        extent = self._pool_extent(x.shape, out.shape, kernel, stride, padding)
        src = self._pool_input(x, padding, extent, -np.inf if mode == "max" else 0.0)
        first = True
        if mode == "max":
            better = xp.empty(out.shape, dtype=bool)
            step = xp.empty(out.shape, dtype=mask.dtype)
        for i, j, rows, columns in self._windows(kh, kw, oh, ow, stride):
            s = src[:, :, rows, columns]
            if first:
                out[...] = s
                if mode == "max":
                    mask.fill(0)
                first = False
            elif mode == "max":
                # ties keep the first position; offsets t only grow, so mask = max(mask, t * better)
                xp.greater(s, out, out=better)
                xp.maximum(out, s, out=out)
                xp.multiply(better, mask.dtype.type(i * kw + j), out=step)  # an int32 scalar: the int32 loop
                xp.maximum(mask, step, out=mask)
            else:
                out += s
        if mode != "max":
            out *= self._pool_scale(x.shape, out.shape, kernel, stride, padding, pad_end, count_pad, out.dtype)
        elif src is not x:
            self._real_mask(mask, x.shape, kernel, stride, padding)

    def _real_mask(self, mask, x_shape, kernel, stride, padding) -> None:
        """Masks left on a padding position (a window whose input positions are all -inf, or NaN from the first)
        moved to the window's first input position, so that its gradient reaches the input as in a window without
        padding. Only the windows that reach the padding (the border rows and columns of the output) are looked at."""
        xp = self.xp
        axes = []
        for size, o, k, s, p in zip(x_shape[2:], mask.shape[2:], kernel, stride, padding):
            starts = np.arange(o) * s - p  # each window's first position, in input coordinates
            offsets = starts[:, None] + np.arange(k)[None, :]
            inside = (offsets >= 0) & (offsets < size)  # [o, k]: which of each window's positions are input
            axes.append((inside, np.clip(-starts, 0, k - 1), np.flatnonzero(~inside.all(axis=1))))
        (row_inside, row_first, edge_rows), (column_inside, column_first, edge_columns) = axes
        kw = kernel[1]
        inner_rows = np.setdiff1d(np.arange(mask.shape[2]), edge_rows)
        for rows, columns in ((edge_rows, np.arange(mask.shape[3])), (inner_rows, edge_columns)):
            if not len(rows) or not len(columns):
                continue
            at = (slice(None), slice(None), xp.asarray(rows)[:, None], xp.asarray(columns)[None, :])
            part = mask[at]  # [N, C, rows, columns]
            real = (xp.asarray(row_inside[rows])[xp.arange(len(rows))[:, None], part // kw]
                    & xp.asarray(column_inside[columns])[xp.arange(len(columns))[None, :], part % kw])
            first = xp.asarray((row_first[rows][:, None] * kw + column_first[columns][None, :]).astype(mask.dtype))
            mask[at] = xp.where(real, part, first)

    def pool2d_grad(self, dy, dx, mask, mode, kernel, stride, padding, pad_end=None, count_pad=True):
        kh, kw = kernel
        ph, pw = padding
        n, c, h, w = dx.shape
        oh, ow = dy.shape[2], dy.shape[3]
        extent = self._pool_extent(dx.shape, dy.shape, kernel, stride, padding)
        overlap = stride[0] < kh or stride[1] < kw or ph or pw or extent != (h, w)
        dxp = self.xp.zeros((n, c, *extent), dx.dtype) if overlap else dx
        if not overlap and (stride[0] > kh or stride[1] > kw or h > oh * kh or w > ow * kw):
            dx.fill(0)  # inputs no window covers (windows that tile the input write every element)
        scale = 0.0 if mode == "max" else self._pool_scale(dx.shape, dy.shape, kernel, stride, padding, pad_end,
                                                           count_pad, dy.dtype)
        for i, j, rows, columns in self._windows(kh, kw, oh, ow, stride):
            target = dxp[:, :, rows, columns]
            if mode == "max":  # dy where the window's maximum was, 0 elsewhere (not dy * 0: an inf or NaN dy)
                hit = mask == i * kw + j
                if overlap:
                    target += self.xp.where(hit, dy, dy.dtype.type(0))
                else:
                    self.xp.copyto(target, dy.dtype.type(0))
                    self.xp.copyto(target, dy, where=hit)
            elif overlap:
                target += dy * scale
            else:
                self.xp.multiply(dy, scale, out=target)
        if overlap:
            dx[...] = dxp[:, :, ph:ph + h, pw:pw + w]

    # --- blocks along an axis -------------------------------------------------------------------------------
    def copy_block(self, part, whole, part_inner, whole_inner, offset, into_whole):
        if not (part.flags.c_contiguous and whole.flags.c_contiguous):
            block = self._block_of(part, whole, part_inner, whole_inner, offset)
            if block is not None:  # a slice of whole along the one axis where the shapes differ: strides as they are
                if into_whole:
                    whole[block] = part
                else:
                    part[...] = whole[block]
                return
            with self._row_major(part, read=into_whole) as p, self._row_major(whole) as w:
                return self.copy_block(p, w, part_inner, whole_inner, offset, into_whole)
        outer = part.size // part_inner if part_inner else 0
        p = part.reshape(outer, part_inner)
        block = whole.reshape(outer, whole_inner)[:, offset:offset + part_inner]
        if into_whole:
            block[...] = p
        else:
            p[...] = block

    def permute(self, x, out, perm):
        permute(self.xp, x, out, perm)

    def broadcast(self, x, out):
        broadcast(self.xp, x, out)

    def reduce_to(self, x, out):
        reduce_to(self.xp, x, out)

    def matmul(self, a, trans_a, b, trans_b, out):
        matmul(self.xp, a, b, out, trans_a, trans_b)

    @staticmethod
    def _block_of(part, whole, part_inner, whole_inner, offset) -> tuple | None:
        """The index of whole that copy_block's flattened block (``part_inner`` of every ``whole_inner`` elements,
        from ``offset``) is, where part and whole differ in one axis only (Concat's and Slice's blocks); None
        otherwise."""
        if part.ndim != whole.ndim:
            return None
        axes = [k for k in range(part.ndim) if part.shape[k] != whole.shape[k]]
        if len(axes) != 1:
            return None
        k = axes[0]
        inner = int(np.prod(part.shape[k + 1:], dtype=np.int64))
        if (inner == 0 or part_inner != part.shape[k] * inner or whole_inner != whole.shape[k] * inner
                or offset % inner):
            return None
        start = offset // inner
        return (slice(None),) * k + (slice(start, start + part.shape[k]),)

    # --- local response normalisation -----------------------------------------------------------------------
    def _channel_window_sum(self, v, size):
        """Sum over the ``size`` channels centred on each channel of v [N, C, S] (zeros past the edges)."""
        pre = (size - 1) // 2
        c = v.shape[1]
        total = self.xp.zeros_like(v)
        # window position o reads channel j + o - pre: only shifts within (-c, c) read a channel (a window wider
        # than 2c - 1 adds nothing but zeros past the edges), in the order of the positions, as a padded sum would
        for shift in range(max(-pre, 1 - c), min(size - 1 - pre, c - 1) + 1):
            if shift >= 0:
                total[:, :c - shift] += v[:, shift:]
            else:
                total[:, -shift:] += v[:, :c + shift]
        return total

    def lrn(self, x, scale, out, size, alpha, beta, k):
        xp = self.xp
        shape3 = (x.shape[0], x.shape[1], x.size // max(x.shape[0] * x.shape[1], 1))
        x3 = x.reshape(shape3)
        s = self._channel_window_sum(x3 * x3, size)
        s *= alpha / size
        s += k
        scale.reshape(shape3)[...] = s
        xp.multiply(x3, s ** -beta, out=out.reshape(shape3))

    def lrn_grad(self, x, y, scale, dy, dx, size, alpha, beta):
        shape3 = (x.shape[0], x.shape[1], x.size // max(x.shape[0] * x.shape[1], 1))
        x3, y3, s3, dy3 = (a.reshape(shape3) for a in (x, y, scale, dy))
        # the window of channels whose scale reads channel c is the window centred on c, mirrored
        ratio = self._channel_window_sum((dy3 * y3 / s3)[:, ::-1], size)[:, ::-1]
        dx.reshape(shape3)[...] = dy3 * s3 ** -beta - (2.0 * alpha * beta / size) * x3 * ratio

    # --- randomness -----------------------------------------------------------------------------------------
    def dropout_mask(self, mask, ratio, seed):
        # a counter-based hash of (seed, index), the same on every backend: masks agree across backends
        xp = self.xp
        h = xp.arange(mask.size, dtype=xp.uint32)
        h += seed.astype(xp.uint32) * xp.uint32(DROPOUT_KEY_MULTIPLIER)  # wraps at 2**32, as on the device
        for shift, mult in DROPOUT_HASH_ROUNDS:
            h ^= h >> xp.uint32(shift)
            if mult:
                h *= xp.uint32(mult)
        keep = h >= xp.uint32(dropout_threshold(ratio))
        xp.multiply(keep.reshape(mask.shape), 1.0 / (1.0 - ratio), out=mask)

    # --- solver updates: generated from updates.TABLE, each weight in pieces that stay in cache --------------------
    UPDATE_PIECE = 1 << 16
    """Elements per piece of a solver update: all of a rule's passes over a piece of w, g and the rule's state run
    while it is in cache, and a piece of shared scratch replaces the temporary arrays of the whole-array
    formulas (the native backend shares that scratch between calls). The weights of MLP 784-512-512-10 on native,
    2-core machine: momentum 0.49 -> 0.40 ms, RMSprop 2.23 -> 0.95, Adam 2.69 -> 1.70 (cuda runs fused kernels
    instead)."""

    def solver_update(self, kind, w, g, rate, lr_mult, params=(), s1=None, s2=None, s3=None, copy=None):
        run, scratch, states = updates.numpy_function(updates.TABLE.get(kind) or updates.rule(kind))
        step = self.UPDATE_PIECE
        work = []  # a piece of shared scratch per array the rule's code needs besides its operands
        for k in range(scratch):
            work.append(self._work({}, f"update_piece{k or ''}", (min(w.size, step),), w.dtype))
        state = map(self.flat, (s1, s2, s3)[:states])
        run(self.xp, rate, lr_mult, params, work, step, self.flat(w), self.flat(g), *state)
        if copy is not None:
            self.cast(w, copy)

    def clip_to_norm(self, x, sumsq, threshold):
        xp = self.xp
        norm = xp.sqrt(sumsq.reshape(-1)[:1])
        factor = threshold / xp.maximum(norm, threshold)  # never a division by zero; NaN norms scale by 1, as on GPUs
        x *= xp.where(norm > threshold, factor, 1.0).astype(x.dtype)

    def unscale(self, x, scale):
        x *= 1 / scale.reshape(-1)[:1]  # a product: twice as fast as a division on the CPU

    def loss_scale_update(self, sumsq, scale, counts, rate, growth_factor, backoff_factor, growth_interval, dynamic):
        # array operations on one-element slices: nothing is read back (CuPy queues them on the device)
        xp = self.xp
        s, c, r = scale.reshape(-1)[:1], counts.reshape(-1), rate.reshape(-1)
        ok = xp.isfinite(sumsq.reshape(-1)[:1])
        r[1:2] = ok
        c[1:2] += (~ok).astype(c.dtype)
        if dynamic:
            good = xp.where(ok, c[:1] + 1, 0).astype(c.dtype)
            grow = good >= growth_interval
            with np.errstate(over="ignore"):
                grown = s * growth_factor
            s[...] = xp.where(ok, xp.where(grow & xp.isfinite(grown), grown, s), s * backoff_factor)
            c[:1] = xp.where(grow, 0, good)

    # --- sequences: embeddings and recurrent cells ----------------------------------------------------------
    def _ids(self, ids: Array, rows: int) -> Array:
        """Float ids as row indices, clamped into [0, rows)."""
        return self.xp.clip(ids.reshape(-1).astype(self.xp.intp), 0, rows - 1)

    def embedding(self, ids, table, out):
        self.xp.take(table, self._ids(ids, table.shape[0]), axis=0, out=out)

    def embedding_grad(self, ids, dy, dtable, beta=0.0):
        if beta == 0.0:
            dtable.fill(0)
        elif beta != 1.0:
            dtable *= beta
        self.xp.add.at(dtable, self._ids(ids, dtable.shape[0]), dy)

    def _sigmoid_in_place(self, a: Array) -> None:
        a *= 0.5  # sigmoid(a) = 0.5 (1 + tanh(a / 2)): no overflow
        self.xp.tanh(a, out=a)
        a += 1.0
        a *= 0.5

    @staticmethod
    def _emit_hidden(h: Array, hprev: Array, y: Array, t: int, sequence: bool) -> None:
        """Where a recurrent step's h_t goes besides ``h``: the next step's slot of hprev, and the output."""
        steps = hprev.shape[1]
        if t == 0:
            hprev[:, 0] = 0
        if t + 1 < steps:
            hprev[:, t + 1] = h
        if sequence:
            y[:, t] = h
        elif t == steps - 1:
            y[...] = h

    @staticmethod
    def _add_output_grad(dh: Array, dy: Array, t: int, steps: int, sequence: bool) -> None:
        if sequence:
            dh += dy[:, t]
        elif t == steps - 1:
            dh += dy

    def lstm_cell(self, gates, hw, bias, c, h, hprev, y, t, sequence):
        xp = self.xp
        hs = c.shape[2]
        a = gates[:, t]
        a += hw
        a += bias
        self._sigmoid_in_place(a[:, :2 * hs])
        xp.tanh(a[:, 2 * hs:3 * hs], out=a[:, 2 * hs:3 * hs])
        self._sigmoid_in_place(a[:, 3 * hs:])
        i, f, g, o = a[:, :hs], a[:, hs:2 * hs], a[:, 2 * hs:3 * hs], a[:, 3 * hs:]
        ct = c[:, t]
        xp.multiply(i, g, out=ct)
        if t > 0:
            ct += f * c[:, t - 1]
        xp.tanh(ct, out=h)
        h *= o
        self._emit_hidden(h, hprev, y, t, sequence)

    def lstm_cell_grad(self, gates, c, dh, dy, dc, dgates, dgates_t, t, sequence):
        xp = self.xp
        hs = c.shape[2]
        self._add_output_grad(dh, dy, t, gates.shape[1], sequence)
        a = gates[:, t]
        i, f, g, o = a[:, :hs], a[:, hs:2 * hs], a[:, 2 * hs:3 * hs], a[:, 3 * hs:]
        tc = xp.tanh(c[:, t])
        d = dgates_t
        xp.multiply(dh, tc, out=d[:, 3 * hs:])  # do, then through the sigmoid
        d[:, 3 * hs:] *= o * (1.0 - o)
        dh *= o
        dh *= 1.0 - tc * tc
        dh += dc  # dh is now dL/dc_t
        xp.multiply(dh, g, out=d[:, :hs])
        d[:, :hs] *= i * (1.0 - i)
        if t > 0:
            xp.multiply(dh, c[:, t - 1], out=d[:, hs:2 * hs])
            d[:, hs:2 * hs] *= f * (1.0 - f)
        else:
            d[:, hs:2 * hs] = 0
        xp.multiply(dh, i, out=d[:, 2 * hs:3 * hs])
        d[:, 2 * hs:3 * hs] *= 1.0 - g * g
        xp.multiply(dh, f, out=dc)
        dgates[:, t] = d

    def rnn_cell(self, pre, hw, bias, h, hprev, y, t, sequence):
        a = pre[:, t]
        a += hw
        a += bias
        self.xp.tanh(a, out=a)
        h[...] = a
        self._emit_hidden(h, hprev, y, t, sequence)

    def rnn_cell_grad(self, pre, dh, dy, dpre, dpre_t, t, sequence):
        self._add_output_grad(dh, dy, t, pre.shape[1], sequence)
        ht = pre[:, t]
        self.xp.multiply(dh, 1.0 - ht * ht, out=dpre_t)
        dpre[:, t] = dpre_t

    def gru_cell(self, pre, hw, bias_ih, bias_hh, hn, h, hprev, y, t, sequence, w_hh=None):
        xp = self.xp
        hs = hn.shape[2]
        a = pre[:, t]
        a += bias_ih
        b = hn[:, t]
        if w_hh is None:
            xp.add(hw[:, 2 * hs:], bias_hh[2 * hs:], out=b)
        rz = a[:, :2 * hs]
        rz += hw[:, :2 * hs]
        rz += bias_hh[:2 * hs]
        self._sigmoid_in_place(rz)
        n = a[:, 2 * hs:]
        if w_hh is None:
            n += a[:, :hs] * b
        else:  # the reset gate before the product: b = r h_{t-1}
            b[...] = a[:, :hs] * hprev[:, t] if t > 0 else 0
            n += xp.matmul(b, w_hh[2 * hs:].T)
            n += bias_hh[2 * hs:]
        xp.tanh(n, out=n)
        z = a[:, hs:2 * hs]
        xp.subtract(1.0, z, out=h)
        h *= n
        if t > 0:
            h += z * hprev[:, t]
        self._emit_hidden(h, hprev, y, t, sequence)

    def gru_cell_grad(self, pre, hn, hprev, dh, dy, dpre, dpre_h, dpre_h_t, t, sequence, w_hh=None):
        xp = self.xp
        hs = hn.shape[2]
        self._add_output_grad(dh, dy, t, pre.shape[1], sequence)
        a = pre[:, t]
        r, z, n = a[:, :hs], a[:, hs:2 * hs], a[:, 2 * hs:]
        h_prev = hprev[:, t]  # zero at step 0
        da, db = dpre[:, t], dpre_h_t
        xp.multiply(dh, 1.0 - z, out=da[:, 2 * hs:])  # dn, then through the tanh
        da[:, 2 * hs:] *= 1.0 - n * n
        xp.multiply(dh, h_prev - n, out=da[:, hs:2 * hs])  # dz, then through the sigmoid
        da[:, hs:2 * hs] *= z * (1.0 - z)
        if w_hh is None:
            xp.multiply(da[:, 2 * hs:], hn[:, t], out=da[:, :hs])  # dr, then through the sigmoid
        else:
            q = xp.matmul(da[:, 2 * hs:], w_hh[2 * hs:])  # dL/d(r h_{t-1})
            xp.multiply(q, h_prev, out=da[:, :hs])
        da[:, :hs] *= r * (1.0 - r)
        db[:, :2 * hs] = da[:, :2 * hs]
        if w_hh is None:
            xp.multiply(da[:, 2 * hs:], r, out=db[:, 2 * hs:])
        else:
            db[:, 2 * hs:] = 0
        dpre_h[:, t] = db
        dh *= z
        if w_hh is not None:
            dh += q * r


# --- the negative log-likelihood, on NumPy or CuPy arrays (the webgpu backend runs it on host copies) ---------------
def _nll_picks(xp: Any, labels: Any, shape: tuple[int, ...], weight: Any, ignore_index: int | None,
               dtype: Any) -> tuple[tuple, Any]:
    """The index of each sample's (and position's) labelled entry in ``[N, C, inner]`` and its weight: the class
    weight of its label (1 without class weights), 0 where the label is ``ignore_index``."""
    n, inner = shape[0], math.prod(shape[2:])
    idx = labels.reshape(-1).astype(xp.intp)
    keep = None if ignore_index is None else idx != ignore_index  # None: every label counts (three calls fewer)
    safe = idx if keep is None else xp.where(keep, idx, 0)
    w = xp.asarray(weight).astype(dtype)[safe] if len(weight) else xp.ones(idx.shape, dtype)
    if keep is not None:
        w = xp.where(keep, w, xp.zeros((), dtype))
    rows = xp.arange(n)[:, None], safe.reshape(n, inner), xp.arange(inner)[None, :]
    return rows, w.reshape(n, inner)


def _nll_scale(xp: Any, w: Any, reduction: str) -> Any:
    """What the weighted losses are divided by: the sum of the counted samples' weights (mean), else 1."""
    return w.sum() if reduction == "mean" else xp.ones((), w.dtype)


def nll_forward(xp: Any, logp: Any, labels: Any, out: Any, weight: Any = (),
                ignore_index: int | None = None, reduction: str = "mean") -> None:
    """``out`` = the weighted losses ``-w_i logp[i, label_i]`` (reduction none), their sum, or their sum over the
    sum of the weights (mean; NaN when every label is ignored, as in ONNX and PyTorch)."""
    n, c = logp.shape[:2]
    acc = xp.float64 if logp.dtype == xp.float64 else xp.float32
    rows, w = _nll_picks(xp, labels, logp.shape, weight, ignore_index, acc)
    with np.errstate(invalid="ignore"):  # (an ignored label's 0 * -inf: set to 0 below)
        losses = -w * logp.reshape(n, c, -1)[rows].astype(acc, copy=False)
    if ignore_index is not None:  # an ignored label's loss is 0 whatever its row holds (0 * -inf is NaN)
        losses = xp.where(labels.reshape(w.shape) != ignore_index, losses, xp.zeros((), acc))
    if reduction == "none":
        out[...] = losses.reshape(out.shape)
        return
    with np.errstate(invalid="ignore", divide="ignore"):
        out[...] = losses.sum() / _nll_scale(xp, w, reduction)


def nll_backward(xp: Any, labels: Any, dloss: Any, dx: Any, weight: Any = (),
                 ignore_index: int | None = None, reduction: str = "mean") -> None:
    """``dx = 0; dx[i, label_i] = -w_i * dloss`` (dloss per sample for reduction none, else the one loss's,
    divided by the sum of the weights for mean); an ignored sample's gradient is 0 whatever the loss was (with
    every label ignored the mean is NaN, its gradient 0: PyTorch's)."""
    n, c = dx.shape[:2]
    acc = xp.float64 if dx.dtype == xp.float64 else xp.float32
    rows, w = _nll_picks(xp, labels, dx.shape, weight, ignore_index, acc)
    d3 = dx.reshape(n, c, -1)
    d3.fill(0)
    if reduction == "none":
        g = -w * dloss.reshape(w.shape).astype(acc)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            g = -w * (dloss.reshape(()).astype(acc) / _nll_scale(xp, w, reduction))
    if ignore_index is not None:
        g = xp.where(labels.reshape(w.shape) != ignore_index, g, xp.zeros((), acc))
    d3[rows] = g.astype(dx.dtype)



def permute(xp: Any, x: Any, out: Any, perm: tuple[int, ...]) -> None:
    out[...] = xp.transpose(x, perm)


def broadcast(xp: Any, x: Any, out: Any) -> None:
    out[...] = xp.broadcast_to(x, out.shape)


def reduce_to(xp: Any, x: Any, out: Any) -> None:
    """The sum of ``x`` over the axes ``out`` (aligned at the last axis) is broadcast along."""
    lead = x.ndim - out.ndim
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(out.shape) if d == 1 and x.shape[lead + i] != 1)
    out[...] = x.sum(axis=axes).reshape(out.shape) if axes else x


def matmul(xp: Any, a: Any, b: Any, out: Any, trans_a: bool = False, trans_b: bool = False) -> None:
    a2 = xp.swapaxes(a, -1, -2) if trans_a else a
    b2 = xp.swapaxes(b, -1, -2) if trans_b else b
    out[...] = xp.matmul(a2, b2)
