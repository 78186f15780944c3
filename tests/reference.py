"""Plain NumPy references computed another way than the backends do (explicit loops over output positions)."""

from __future__ import annotations

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
