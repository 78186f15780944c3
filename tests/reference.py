"""Plain NumPy references computed another way than the backends do (explicit loops over output positions, float64
formulas)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


def conv2d(x, w, b, stride=(1, 1), pad=(0, 0)):
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    oh = (h + 2 * pad[0] - kh) // stride[0] + 1
    ow = (wd + 2 * pad[1] - kw) // stride[1] + 1
    y = np.zeros((n, o, oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, :, i * stride[0]:i * stride[0] + kh, j * stride[1]:j * stride[1] + kw]
            y[:, :, i, j] = np.tensordot(patch, w, axes=([1, 2, 3], [1, 2, 3]))
    return y + (0 if b is None else b.reshape(1, -1, 1, 1))


def conv2d_grouped(x, w, b, stride, pad, pad_end, dilation, groups):
    """Convolution by explicit loops over output positions and groups: zero padding ``pad`` before and ``pad_end``
    after each spatial dimension, filter taps ``dilation`` apart, output group g reading input group g only."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    og = o // groups
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad_end[0]), (pad[1], pad_end[1])))
    oh = (h + pad[0] + pad_end[0] - (kh - 1) * dilation[0] - 1) // stride[0] + 1
    ow = (wd + pad[1] + pad_end[1] - (kw - 1) * dilation[1] - 1) // stride[1] + 1
    y = np.zeros((n, o, oh, ow))
    for g in range(groups):
        wg = w[g * og:(g + 1) * og]
        for i in range(oh):
            for j in range(ow):
                hs, ws = i * stride[0], j * stride[1]
                patch = xp[:, g * cg:(g + 1) * cg, hs:hs + (kh - 1) * dilation[0] + 1:dilation[0],
                           ws:ws + (kw - 1) * dilation[1] + 1:dilation[1]]
                y[:, g * og:(g + 1) * og, i, j] = np.tensordot(patch, wg, axes=([1, 2, 3], [1, 2, 3]))
    return y + (0 if b is None else b.reshape(1, -1, 1, 1))


def deconv2d(x, w, b, stride, pad, pad_end, output_padding, dilation, groups):
    """Transposed convolution by scattering each input value through the filter (PyTorch's ConvTranspose2d):
    ``w`` [C, O / groups, kh, kw]; every input position (i, j) adds x * w at output (i * stride + tap * dilation -
    pad); the output is cropped by ``pad`` before and ``pad_end`` after and grown by ``output_padding``."""
    n, c, h, wd = x.shape
    _, og, kh, kw = w.shape
    cg = c // groups
    full = [(size - 1) * s + (k - 1) * d + 1 + op for size, s, k, d, op in
            zip((h, wd), stride, (kh, kw), dilation, output_padding)]
    y = np.zeros((n, og * groups, *full))
    for ch in range(c):
        g = ch // cg
        for i in range(h):
            for j in range(wd):
                for a in range(kh):
                    for bb in range(kw):
                        r, q = i * stride[0] + a * dilation[0], j * stride[1] + bb * dilation[1]
                        y[:, g * og:(g + 1) * og, r, q] += x[:, ch, i, j, None] * w[ch, :, a, bb]
    y = y[:, :, pad[0]:full[0] - pad_end[0], pad[1]:full[1] - pad_end[1]]
    return y + (0 if b is None else b.reshape(1, -1, 1, 1))


def conv2d_backward(x, w, dy, stride=(1, 1), pad=(0, 0)):
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w, dtype=np.float64)
    for i in range(dy.shape[2]):
        for j in range(dy.shape[3]):
            hs, ws = i * stride[0], j * stride[1]
            patch = xp[:, :, hs:hs + kh, ws:ws + kw]
            dw += np.tensordot(dy[:, :, i, j], patch, axes=([0], [0]))
            dxp[:, :, hs:hs + kh, ws:ws + kw] += np.tensordot(dy[:, :, i, j], w, axes=([1], [0]))
    dx = dxp[:, :, pad[0]:pad[0] + h, pad[1]:pad[1] + wd]
    return dx, dw, dy.sum(axis=(0, 2, 3))


def pool2d(x, mode, k, s, pad, pad_end, ceil_mode=False, count_pad=True):
    """Max or average pooling by explicit loops, as PyTorch and Caffe define it: output sizes rounded down (or up with
    ``ceil_mode``, a last window starting in the end padding dropped); a window's max over its positions inside the
    input; its average divided by its positions inside the padded input (``count_pad``) or inside the input."""
    n, c, h, w = x.shape
    out = []
    for size, kk, ss, p, e in zip((h, w), k, s, pad, pad_end):
        o = -(-(size + p + e - kk) // ss) + 1 if ceil_mode else (size + p + e - kk) // ss + 1
        if ceil_mode and (o - 1) * ss >= size + p:
            o -= 1
        out.append(o)
    y = np.zeros((n, c, *out))
    for i in range(out[0]):
        for j in range(out[1]):
            h0, w0 = i * s[0] - pad[0], j * s[1] - pad[1]
            win = x[:, :, max(h0, 0):min(h0 + k[0], h), max(w0, 0):min(w0 + k[1], w)]
            if mode == "max":
                y[:, :, i, j] = win.max(axis=(2, 3))
            else:
                lo, hi = ((-pad[0], -pad[1]), (h + pad_end[0], w + pad_end[1])) if count_pad else ((0, 0), (h, w))
                count = ((min(h0 + k[0], hi[0]) - max(h0, lo[0])) * (min(w0 + k[1], hi[1]) - max(w0, lo[1])))
                y[:, :, i, j] = win.sum(axis=(2, 3)) / count
    return y


def maxpool(x, k, s):
    n, c, h, w = x.shape
    oh, ow = (h - k) // s + 1, (w - k) // s + 1
    y = np.zeros((n, c, oh, ow))
    arg = np.zeros((n, c, oh, ow, 2), dtype=int)
    for i in range(oh):
        for j in range(ow):
            win = x[:, :, i * s:i * s + k, j * s:j * s + k].reshape(n, c, -1)
            idx = win.argmax(axis=2)
            y[:, :, i, j] = win.max(axis=2)
            arg[:, :, i, j, 0] = i * s + idx // k
            arg[:, :, i, j, 1] = j * s + idx % k
    return y, arg


def maxpool_backward(x_shape, arg, dy):
    dx = np.zeros(x_shape)
    n, c, oh, ow = dy.shape
    for a in range(n):
        for b in range(c):
            for i in range(oh):
                for j in range(ow):
                    dx[a, b, arg[a, b, i, j, 0], arg[a, b, i, j, 1]] += dy[a, b, i, j]
    return dx


def log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


class BatchNorm(NamedTuple):
    """Per-channel statistics ([C]), the normalised input, the output, the backward pass's sums ([C]) and the input
    gradient of :func:`batch_norm` (float64)."""

    mean: np.ndarray
    var: np.ndarray
    invstd: np.ndarray
    xhat: np.ndarray
    y: np.ndarray
    sum_dy: np.ndarray
    sum_dy_xhat: np.ndarray
    dx: np.ndarray


def batch_norm(x, dy, gamma, beta, eps) -> BatchNorm:
    """Batch normalisation in float64 over every axis but 1 (the channels), with the batch's statistics (biased
    variance): y = gamma * xhat + beta, and dx, the gradient through the statistics too."""
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    axes = tuple(i for i in range(x64.ndim) if i != 1)
    per = (1, x64.shape[1]) + (1,) * (x64.ndim - 2)
    mean = x64.mean(axis=axes)
    var = ((x64 - mean.reshape(per)) ** 2).mean(axis=axes)
    invstd = 1.0 / np.sqrt(var + eps)
    xhat = (x64 - mean.reshape(per)) * invstd.reshape(per)
    g, b = np.asarray(gamma, np.float64).reshape(per), np.asarray(beta, np.float64).reshape(per)
    sum_dy = dy64.sum(axis=axes)
    sum_dy_xhat = (dy64 * xhat).sum(axis=axes)
    m = x64.size // x64.shape[1]
    dx = g * invstd.reshape(per) * (dy64 - (sum_dy.reshape(per) + xhat * sum_dy_xhat.reshape(per)) / m)
    return BatchNorm(mean, var, invstd, xhat, g * xhat + b, sum_dy, sum_dy_xhat, dx)
