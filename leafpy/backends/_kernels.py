"""numba kernels of the native backend (imported through leafpy.backends.compiled, which says what they take).

Each runs serially. The pooling kernels work over NCHW planes; every window visits its positions in row-major order
and keeps NumPy's rule: a later value replaces the maximum only when it is larger (the first of equal maxima wins),
and a NaN, compared false, still becomes the output as ``maximum`` makes it. The Linear + ReLU kernels work over
[N, C] rows."""

from __future__ import annotations

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)


@_jit
def _better(best, arg, value, position):  # pragma: no cover - compiled
    """(maximum, mask) after ``value`` at ``position``: NumPy's greater for the mask, maximum for the value."""
    if value > best:
        return value, position
    if value != value:
        return value, arg
    return best, arg


@_jit
def _planes(x, out, mask):  # pragma: no cover - compiled
    """x [N, C, H, W], out and mask [N, C, oh, ow] as N·C planes."""
    n, c, h, w = x.shape
    oh, ow = out.shape[2], out.shape[3]
    return x.reshape(n * c, h, w), out.reshape(n * c, oh, ow), mask.reshape(n * c, oh, ow)


@_jit
def max_pool_2x2(x, out, mask):  # pragma: no cover - compiled
    xs, outs, masks = _planes(x, out, mask)
    oh, ow = outs.shape[1], outs.shape[2]
    for p in range(xs.shape[0]):
        for i in range(oh):
            top, bottom = xs[p, 2 * i], xs[p, 2 * i + 1]
            row, row_mask = outs[p, i], masks[p, i]
            for j in range(ow):
                best, arg = top[2 * j], 0
                best, arg = _better(best, arg, top[2 * j + 1], 1)
                best, arg = _better(best, arg, bottom[2 * j], 2)
                best, arg = _better(best, arg, bottom[2 * j + 1], 3)
                row[j] = best
                row_mask[j] = arg


@_jit
def max_pool_2x2_grad(dy, dx, mask):  # pragma: no cover - compiled
    # the top and bottom rows of the windows in loops of their own: each then compiles to vector stores (5x faster
    # than one loop writing both rows)
    n, c, h, w = dx.shape
    oh, ow = dy.shape[2], dy.shape[3]
    dys = dy.reshape(n * c, oh, ow)
    rows = dx.reshape(n * c * h, w)
    masks = mask.reshape(n * c, oh, ow)
    zero = dx.dtype.type(0)
    for p in range(n * c):
        for i in range(oh):
            g, m = dys[p, i], masks[p, i]
            for half in range(2):
                row = rows[p * h + 2 * i + half]
                left = 2 * half
                for j in range(ow):
                    k, v = m[j], g[j]
                    row[2 * j] = v if k == left else zero  # (0 where the window's maximum was not, as on
                    row[2 * j + 1] = v if k == left + 1 else zero  # every backend: an inf or NaN dy goes nowhere else)
                row[2 * ow:] = 0  # a last column no window covers
        rows[p * h + 2 * oh:(p + 1) * h] = 0  # and a last row


@_jit
def max_pool_3x3(x, out, mask, sh, sw):  # pragma: no cover - compiled
    # the window written out: loops over the window's rows and columns cost more than its comparisons
    xs, outs, masks = _planes(x, out, mask)
    oh, ow = outs.shape[1], outs.shape[2]
    for p in range(xs.shape[0]):
        plane = xs[p]
        for i in range(oh):
            r0, r1, r2 = plane[i * sh], plane[i * sh + 1], plane[i * sh + 2]
            row, row_mask = outs[p, i], masks[p, i]
            for j in range(ow):
                q = j * sw
                best, arg = r0[q], 0
                best, arg = _better(best, arg, r0[q + 1], 1)
                best, arg = _better(best, arg, r0[q + 2], 2)
                best, arg = _better(best, arg, r1[q], 3)
                best, arg = _better(best, arg, r1[q + 1], 4)
                best, arg = _better(best, arg, r1[q + 2], 5)
                best, arg = _better(best, arg, r2[q], 6)
                best, arg = _better(best, arg, r2[q + 1], 7)
                best, arg = _better(best, arg, r2[q + 2], 8)
                row[j] = best
                row_mask[j] = arg


@_jit
def max_pool_grad(dy, dx, mask, kh, kw, sh, sw):  # pragma: no cover - compiled
    # window position by window position, as NumPy's passes: overlapping windows add an input's gradients in the
    # same order (the same sums); windows that do not overlap write them
    dxs, dys, masks = _planes(dx, dy, mask)
    oh, ow = dys.shape[1], dys.shape[2]
    zero = dx.dtype.type(0)
    overlap = sh < kh or sw < kw
    dx[...] = 0
    for p in range(dxs.shape[0]):
        plane, g, m = dxs[p], dys[p], masks[p]
        for u in range(kh):
            for v in range(kw):
                position = u * kw + v
                for i in range(oh):
                    row, grad, hit = plane[i * sh + u], g[i], m[i]
                    if overlap:
                        for j in range(ow):
                            value = grad[j]
                            row[j * sw + v] += value if hit[j] == position else zero
                    else:
                        for j in range(ow):
                            value = grad[j]
                            row[j * sw + v] = value if hit[j] == position else zero


@_jit
def bias_relu(y, b, z):  # pragma: no cover - compiled
    """y += b (per column), z = max(y, 0): a Linear layer's bias and the ReLU after it in one pass (z may be y).
    A row's sums go to a private row first: where z is y, a loop that writes both cannot be vectorised."""
    n, c = y.shape
    zero = z.dtype.type(0)
    same = y.ctypes.data == z.ctypes.data
    sums = np.empty(c, y.dtype)
    for i in range(n):
        row, out = y[i], z[i]
        for j in range(c):
            sums[j] = row[j] + b[j]
        if same:
            for j in range(c):
                v = sums[j]
                row[j] = v if (v >= zero or v != v) else zero
        else:
            for j in range(c):
                v = sums[j]
                row[j] = v
                out[j] = v if (v >= zero or v != v) else zero


@_jit
def relu_grad_bias(y, dy, dx, db, beta, accumulate):  # pragma: no cover - compiled
    """dx = dy * (y > 0) and the bias gradient of the layer before, db = sum over rows of dx (beta * db + that
    where ``accumulate``), in one pass; the rows added in order, as NumPy's sum over the first axis adds them."""
    n, c = y.shape
    zero = dx.dtype.type(0)
    total = np.zeros(c, dx.dtype)
    if dx.ctypes.data == dy.ctypes.data:  # in place: a row into a private row first, so both loops vectorise
        row = np.empty(c, dx.dtype)
        for i in range(n):
            src, grad, out = y[i], dy[i], dx[i]
            for j in range(c):
                g = grad[j]
                row[j] = g if src[j] > zero else g * zero
            for j in range(c):
                v = row[j]
                out[j] = v
                total[j] += v
    else:
        for i in range(n):
            src, grad, out = y[i], dy[i], dx[i]
            for j in range(c):
                g = grad[j]
                v = g if src[j] > zero else g * zero
                out[j] = v
                total[j] += v
    if accumulate:
        for j in range(c):
            db[j] = db[j] * beta + total[j]
    else:
        for j in range(c):
            db[j] = total[j]


@_jit
def move_windows(cols, x, sh, sw, row0, add):  # pragma: no cover - compiled
    """Between a convolution's batch-innermost columns cols [C, kh, kw, R, ow, N] of output rows row0..row0 + R and
    x [C, H, W, N] at (c, i + sh * (row0 + r), j + sw * q): ``add`` False gathers (cols = x, each run of N values
    one contiguous copy); True adds the data gradient's columns back into x, window position by window position,
    as NumPy's passes add them (the same sums)."""
    c, kh, kw, rows, ow, n = cols.shape
    for ch in range(c):
        for i in range(kh):
            for j in range(kw):
                for r in range(rows):
                    for q in range(ow):
                        part, whole = cols[ch, i, j, r, q], x[ch, i + sh * (row0 + r), j + sw * q]
                        if add:
                            for k in range(n):
                                whole[k] += part[k]
                        else:
                            for k in range(n):
                                part[k] = whole[k]


@_jit
def gather_image_windows(x, cols, kh, kw, oh, ow, sh, sw):  # pragma: no cover - compiled
    """cols [N, >= C·kh·kw, oh·ow]: row (c·kh + i)·kw + j of image m at r·ow + q = x [N, C, H, W] at
    (m, c, i + sh·r, j + sw·q): a convolution's columns per image (the rows past C·kh·kw are left alone)."""
    n, c = x.shape[0], x.shape[1]
    for m in range(n):
        for ch in range(c):
            for i in range(kh):
                for j in range(kw):
                    row = cols[m, (ch * kh + i) * kw + j]
                    for r in range(oh):
                        src, base = x[m, ch, i + sh * r], r * ow
                        if sw == 1:  # a contiguous run: vector copies
                            for q in range(ow):
                                row[base + q] = src[j + q]
                        else:
                            for q in range(ow):
                                row[base + q] = src[j + sw * q]


@_jit
def scatter_image_windows(cols, x, sh, sw):  # pragma: no cover - compiled
    """x [N, C, H, W] at (m, c, i + sh·r, j + sw·q) += cols [N, C, kh, kw, oh, ow], window position by window
    position, as NumPy's passes add them."""
    n, c, kh, kw, oh, ow = cols.shape
    for m in range(n):
        for ch in range(c):
            for i in range(kh):
                for j in range(kw):
                    for r in range(oh):
                        src, dst = cols[m, ch, i, j, r], x[m, ch, i + sh * r]
                        if sw == 1:
                            for q in range(ow):
                                dst[j + q] += src[q]
                        else:
                            for q in range(ow):
                                dst[j + sw * q] += src[q]


# --- a classifier's loss: log-softmax, negative log-likelihood and their gradients over [N, C] rows -----------------
@_jit
def _pairwise_block(a, first, n):  # pragma: no cover - compiled
    """NumPy's pairwise_sum of at most 128 values: one by one from 0 under 8, else 8 running sums."""
    if n < 8:
        total = a.dtype.type(0)
        for i in range(n):
            total += a[first + i]
        return total
    r0, r1, r2, r3 = a[first], a[first + 1], a[first + 2], a[first + 3]
    r4, r5, r6, r7 = a[first + 4], a[first + 5], a[first + 6], a[first + 7]
    i = 8
    while i < n - n % 8:
        p = first + i
        r0 += a[p]
        r1 += a[p + 1]
        r2 += a[p + 2]
        r3 += a[p + 3]
        r4 += a[p + 4]
        r5 += a[p + 5]
        r6 += a[p + 6]
        r7 += a[p + 7]
        i += 8
    total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        total += a[first + i]
        i += 1
    return total


@_jit
def pairwise_sum(a, first, n):  # pragma: no cover - compiled
    """a[first:first + n] summed as NumPy's ``add.reduce`` sums a contiguous run (0 + its pairwise_sum): blocks of at
    most 128 values (:func:`_pairwise_block`), longer runs as the sum of two halves (the first a multiple of 8),
    the halves walked here with a stack of their own (numba's cache does not link a recursive function)."""
    zero = a.dtype.type(0)  # what NumPy's reduction starts from: a sum of negative zeros is +0
    if n <= 128:
        return zero + _pairwise_block(a, first, n)
    starts, sizes = np.empty(64, np.int64), np.empty(64, np.int64)
    stages, lefts = np.zeros(64, np.int64), np.empty(64, a.dtype)
    result = a.dtype.type(0)
    depth = 0
    starts[0], sizes[0] = first, n
    while depth >= 0:
        f, m = starts[depth], sizes[depth]
        if m <= 128:
            result = _pairwise_block(a, f, m)
            depth -= 1
            continue
        half = m // 2
        half -= half % 8
        if stages[depth] == 0:  # the first half next
            stages[depth] = 1
            depth += 1
            starts[depth], sizes[depth], stages[depth] = f, half, 0
        elif stages[depth] == 1:  # the first half's sum is in: the second half next
            lefts[depth], stages[depth] = result, 2
            depth += 1
            starts[depth], sizes[depth], stages[depth] = f + half, m - half, 0
        else:
            result = lefts[depth] + result
            depth -= 1
    return zero + result


@_jit
def log_softmax_shift(x, o, labels):  # pragma: no cover - compiled
    """o = x - (each row's maximum, NaN where the row has one), after checking that every label is a class index
    0..C-1: the position of the first that is not (nothing written then), else -1."""
    n, c = x.shape
    for i in range(n):
        v = labels[i]
        if not (v >= 0 and v < c):
            return i
    for i in range(n):
        row, out = x[i], o[i]
        top = row[0]
        for j in range(1, c):
            v = row[j]
            if v > top or v != v:
                top = v if top == top else top
        for j in range(c):
            out[j] = row[j] - top
    return -1


@_jit
def row_sums(e, s):  # pragma: no cover - compiled
    """s[i] = the sum of row i of e [N, C], as NumPy sums it."""
    flat = e.reshape(-1)
    c = e.shape[1]
    for i in range(e.shape[0]):
        s[i] = pairwise_sum(flat, i * c, c)


@_jit
def nll_rows(o, logs, labels, loss, dloss, dx, picks, mean):  # pragma: no cover - compiled
    """The rest of the log-softmax (o -= the log of its row's sum of exponentials), the negative log-likelihood
    (loss [1] = the sum of -o[i, label_i], over N where ``mean``) and its gradient (dx = 0 but -dloss (/ N) at each
    label), as NumPy's calls compute them; ``picks`` [N] scratch."""
    n, c = o.shape
    for i in range(n):
        row, shift = o[i], logs[i]
        for j in range(c):
            row[j] -= shift
    for i in range(n):
        picks[i] = -o[i, int(labels[i])]
    total = pairwise_sum(picks, 0, n)
    count = o.dtype.type(n)
    loss[0] = total / count if mean else total
    g = -(dloss[0] / count if mean else dloss[0])
    for i in range(n):
        out = dx[i]
        for j in range(c):
            out[j] = 0
        out[int(labels[i])] = g


@_jit
def log_softmax_grad_rows(e, dy, dx):  # pragma: no cover - compiled
    """dx = dy - e * (each row's sum of dy), e = exp of the log-softmax's output (dx may be dy)."""
    n, c = dy.shape
    flat = dy.reshape(-1)
    for i in range(n):
        total = pairwise_sum(flat, i * c, c)
        src, ex, out = dy[i], e[i], dx[i]
        for j in range(c):
            out[j] = src[j] - ex[j] * total
