"""Primitives written once against an array module (``xp``): NumPy for native, CuPy for cuda.

Subclasses set ``xp`` and the memory contract, and override only the hot paths they can do better.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Backend, Buffer, Pair


class ArrayBackend(Backend):
    """A backend whose buffers are ``xp`` arrays."""

    xp: Any = np

    def __init__(self, dtype: Any = np.float32) -> None:
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            from ..errors import ConfigError
            raise ConfigError(f"backend '{self.name}': dtype must be float32 or float64, got {dtype}")
        self.dtype = dtype

    def view(self, buf: Buffer, shape: tuple[int, ...]) -> Buffer:
        return buf.reshape(shape)

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
        out.reshape(-1)[...] = x.reshape(-1)

    def fill(self, value, out):
        out.fill(value)

    def mul(self, x, y, out):
        self.xp.multiply(x, y, out=out)

    def dot(self, x, y, out):
        out[...] = self.xp.dot(x.reshape(-1), y.reshape(-1))

    def nrm2(self, x, out):
        f = x.reshape(-1)
        out[...] = self.xp.sqrt(self.xp.dot(f, f))

    def read_scalar(self, buf):
        return float(buf.reshape(-1)[0])

    # --- activations --------------------------------------------------------------------------------------
    def relu(self, x, out):
        self.xp.maximum(x, 0, out=out)

    def relu_grad(self, y, dy, dx):
        self.xp.multiply(dy, y > 0, out=dx)

    def sigmoid(self, x, out):
        xp = self.xp
        # 0.5 * (1 + tanh(x / 2)) is sigmoid without overflow for large |x|
        xp.multiply(x, 0.5, out=out)
        xp.tanh(out, out=out)
        out += 1.0
        out *= 0.5

    def sigmoid_grad(self, y, dy, dx):
        self.xp.multiply(dy, y * (1.0 - y), out=dx)

    def tanh(self, x, out):
        self.xp.tanh(x, out=out)

    def tanh_grad(self, y, dy, dx):
        self.xp.multiply(dy, 1.0 - y * y, out=dx)

    @staticmethod
    def _classes(a: Buffer) -> Buffer:
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

    def nll(self, logp, labels, out):
        xp = self.xp
        n = logp.shape[0]
        picked = logp.reshape(n, -1)[xp.arange(n), self._label_index(labels)]
        out[...] = -picked.sum() / n

    def nll_grad(self, labels, dloss, dx):
        xp = self.xp
        n = dx.shape[0]
        d2 = dx.reshape(n, -1)
        d2.fill(0)
        d2[xp.arange(n), self._label_index(labels)] = -dloss.reshape(()) / n

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
        s = dy3.sum(axis=(0, 2))
        if beta == 0.0:
            db[...] = s
        else:
            db *= beta
            db += s

    # --- convolution (im2col in (C, kh, kw, N, oh, ow) order + one GEMM) ----------------------------------
    def _scratch(self, ws: dict, name: str, shape: tuple[int, ...], dtype: Any = None) -> Buffer:
        a = ws.get(name)
        if a is None or a.shape != shape:
            a = self.xp.empty(shape, dtype or self.dtype)
            ws[name] = a
        return a

    @staticmethod
    def _out_hw(h: int, w: int, kh: int, kw: int, stride: Pair, padding: Pair) -> tuple[int, int]:
        return (h + 2 * padding[0] - kh) // stride[0] + 1, (w + 2 * padding[1] - kw) // stride[1] + 1

    def _padded(self, x: Buffer, padding: Pair, ws: dict, name: str, value: float = 0.0) -> Buffer:
        ph, pw = padding
        if ph == 0 and pw == 0:
            return x
        n, c, h, w = x.shape
        xp_ = self._scratch(ws, name, (n, c, h + 2 * ph, w + 2 * pw), x.dtype)
        if ws.get(name + "_fill") != (value, xp_.shape):
            xp_.fill(value)
            ws[name + "_fill"] = (value, xp_.shape)
        xp_[:, :, ph:ph + h, pw:pw + w] = x
        return xp_

    def _im2col(self, x: Buffer, kh: int, kw: int, stride: Pair, padding: Pair, ws: dict) -> Buffer:
        n, c, h, w = x.shape
        oh, ow = self._out_hw(h, w, kh, kw, stride, padding)
        xpad = self._padded(x, padding, ws, "xpad")
        sn, sc, sh, sw = xpad.strides
        win = self.xp.lib.stride_tricks.as_strided(
            xpad, shape=(c, kh, kw, n, oh, ow), strides=(sc, sh, sw, sn, sh * stride[0], sw * stride[1]))
        cols = self._scratch(ws, "cols", (c * kh * kw, n * oh * ow), x.dtype)
        cols.reshape(c, kh, kw, n, oh, ow)[...] = win
        return cols

    def conv2d(self, x, w, out, stride, padding, ws):
        o, c, kh, kw = w.shape
        n = x.shape[0]
        oh, ow = out.shape[2], out.shape[3]
        cols = self._im2col(x, kh, kw, stride, padding, ws)
        y = self._scratch(ws, "y_onp", (o, n * oh * ow), x.dtype)
        self.xp.matmul(w.reshape(o, -1), cols, out=y)
        out[...] = y.reshape(o, n, oh, ow).transpose(1, 0, 2, 3)

    def _dy_onp(self, dy: Buffer, ws: dict) -> Buffer:
        n, o, oh, ow = dy.shape
        t = self._scratch(ws, "dy_onp", (o, n * oh * ow), dy.dtype)
        t.reshape(o, n, oh, ow)[...] = dy.transpose(1, 0, 2, 3)
        return t

    def conv2d_grad_data(self, dy, w, dx, stride, padding, ws):
        o, c, kh, kw = w.shape
        n, _, h, wd = dx.shape
        oh, ow = dy.shape[2], dy.shape[3]
        dyt = self._dy_onp(dy, ws)
        dcols = self._scratch(ws, "dcols", (c * kh * kw, n * oh * ow), dy.dtype)
        self.xp.matmul(w.reshape(o, -1).T, dyt, out=dcols)
        d6 = dcols.reshape(c, kh, kw, n, oh, ow).transpose(3, 0, 1, 2, 4, 5)
        ph, pw = padding
        sh, sw = stride
        dxp = dx if ph == 0 and pw == 0 else self._scratch(ws, "dxpad", (n, c, h + 2 * ph, wd + 2 * pw), dx.dtype)
        dxp.fill(0)
        for i in range(kh):
            for j in range(kw):
                dxp[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw] += d6[:, :, i, j]
        if dxp is not dx:
            dx[...] = dxp[:, :, ph:ph + h, pw:pw + wd]

    def conv2d_grad_filter(self, x, dy, dw, stride, padding, ws, beta=0.0):
        o, c, kh, kw = dw.shape
        cols = self._im2col(x, kh, kw, stride, padding, ws)
        dyt = self._dy_onp(dy, ws)
        self.gemm(dyt, False, cols, True, dw.reshape(o, -1), 1.0, beta)

    # --- pooling --------------------------------------------------------------------------------------------
    def pool2d(self, x, out, mask, mode, kernel, stride, padding):
        kh, kw = kernel
        sh, sw = stride
        oh, ow = out.shape[2], out.shape[3]
        ws: dict = {}
        if mode == "max":
            xpad = self._padded(x, padding, ws, "xpad", -np.inf)
            out.fill(-np.inf)
            mask.fill(0)
            for i in range(kh):
                for j in range(kw):
                    s = xpad[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
                    better = s > out
                    self.xp.copyto(out, s, where=better)
                    self.xp.copyto(mask, i * kw + j, where=better)
        else:
            xpad = self._padded(x, padding, ws, "xpad", 0.0)
            out.fill(0)
            for i in range(kh):
                for j in range(kw):
                    out += xpad[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
            out *= 1.0 / (kh * kw)

    def pool2d_grad(self, dy, dx, mask, mode, kernel, stride, padding):
        kh, kw = kernel
        sh, sw = stride
        ph, pw = padding
        n, c, h, w = dx.shape
        oh, ow = dy.shape[2], dy.shape[3]
        dxp = dx if ph == 0 and pw == 0 else self.xp.zeros((n, c, h + 2 * ph, w + 2 * pw), dx.dtype)
        dxp.fill(0)
        for i in range(kh):
            for j in range(kw):
                sl = dxp[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
                if mode == "max":
                    sl += dy * (mask == i * kw + j)
                else:
                    sl += dy * (1.0 / (kh * kw))
        if dxp is not dx:
            dx[...] = dxp[:, :, ph:ph + h, pw:pw + w]

    # --- randomness -----------------------------------------------------------------------------------------
    def dropout_mask(self, mask, ratio, seed):
        rng = self.xp.random.default_rng(seed)
        keep = rng.random(mask.shape, dtype=np.float32) >= ratio
        self.xp.multiply(keep, 1.0 / (1.0 - ratio), out=mask)

    # --- solver updates -----------------------------------------------------------------------------------
    def adam_update(self, w, g, m, v, lr, beta1, beta2, eps):
        xp = self.xp
        m *= beta1
        m += (1.0 - beta1) * g
        v *= beta2
        v += (1.0 - beta2) * (g * g)
        w -= lr * m / (xp.sqrt(v) + eps)

    def rmsprop_update(self, w, g, h, lr, decay, eps):
        xp = self.xp
        h *= decay
        h += (1.0 - decay) * (g * g)
        w -= lr * g / (xp.sqrt(h) + eps)
