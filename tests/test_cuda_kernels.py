"""The cuda backend's batch-normalisation, activation, axpby and copy primitives against float64 NumPy formulas, on
shapes that take each of its paths: per-channel reductions split over runs of samples or not, four values per
thread (float4) or one (sizes not a multiple of 4, unaligned views). Runs on the GPU machine."""

from __future__ import annotations

import numpy as np
import pytest
import reference
from conftest import backend_or_skip

EPS = 1e-5


BN_SHAPES = [
    (128, 64, 32, 32),  # ResNet-18's first stage: each channel split over runs of samples, float4 passes
    (128, 512, 4, 4),
    (7, 3, 5, 5),  # 25 values per sample and channel: one value per thread
    (33, 300, 2),  # runs of 11 samples (33 is no multiple of the run length chosen for 300 channels)
    (5, 6),  # [N, C]
    (3, 1030, 4, 4),  # more channels than the reductions aim for blocks: one run per channel
]


def _bn_cases():
    for shape in BN_SHAPES:
        name = "x".join(map(str, shape))
        yield pytest.param(shape, False, id=name)
        if len(shape) == 4:  # the same values stored NHWC: the rows kernels and the elementwise passes over rows
            yield pytest.param(shape, True, id=name + "-channels-last")


@pytest.mark.cuda
@pytest.mark.parametrize("shape,channels_last", list(_bn_cases()))
def test_batch_norm_primitives_match_float64(shape, channels_last):
    be = backend_or_skip("cuda")
    import cupy as cp

    def device(a):
        """``a`` on the GPU, as a channels-last view of NHWC memory where asked."""
        if not channels_last:
            return cp.asarray(a)
        return cp.ascontiguousarray(cp.asarray(a).transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)

    rng = np.random.default_rng(0)
    c = shape[1]
    # a mean far from zero beside a unit spread: a one-pass variance would lose most of its digits
    x = (100.0 + rng.standard_normal(shape)).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    gamma = rng.uniform(0.5, 1.5, c).astype(np.float32)
    beta = rng.standard_normal(c).astype(np.float32)
    want = reference.batch_norm(x, dy, gamma, beta, EPS)
    m = x.size // c
    per = (1, c) + (1,) * (len(shape) - 2)

    xd, dyd = device(x), device(dy)
    gd, bd = cp.asarray(gamma), cp.asarray(beta)
    mean_d, var_d, sdy, sdx = (cp.empty(c, cp.float32) for _ in range(4))
    be.batch_norm_stats(xd, mean_d, var_d)
    np.testing.assert_allclose(mean_d.get(), want.mean, rtol=1e-6, err_msg="mean")
    np.testing.assert_allclose(var_d.get(), want.var, rtol=1e-4, err_msg="variance")
    y = device(np.zeros(shape, np.float32))
    be.batch_norm(xd, mean_d, var_d, gd, bd, y, EPS)
    np.testing.assert_allclose(y.get(), want.y, rtol=1e-4, atol=1e-3, err_msg="normalised output")
    be.batch_norm(xd, mean_d, var_d, None, None, y, EPS)
    np.testing.assert_allclose(y.get(), want.xhat, rtol=1e-4, atol=1e-3, err_msg="output without gamma and beta")
    be.batch_norm_grad_sums(xd, dyd, mean_d, var_d, sdy, sdx, EPS)
    scale = np.sqrt(m)  # the sums of m terms of unit size
    np.testing.assert_allclose(sdy.get(), want.sum_dy, atol=1e-4 * scale, err_msg="sum of dy")
    np.testing.assert_allclose(sdx.get(), want.sum_dy_xhat, atol=1e-3 * scale, err_msg="sum of dy * xhat")
    dx = device(np.zeros(shape, np.float32))
    be.batch_norm_grad(xd, dyd, mean_d, var_d, gd, sdy, sdx, dx, EPS, True)
    # a difference of terms of the gradient's own size: float32 leaves ~1e-4 of the largest of them
    np.testing.assert_allclose(dx.get(), want.dx, rtol=1e-3, atol=1e-4 * max(1.0, float(np.abs(want.dx).max())),
                               err_msg="input gradient")
    be.batch_norm_grad(xd, dyd, mean_d, var_d, gd, sdy, sdx, dx, EPS, False)  # the statistics as constants
    fixed = (gamma * want.invstd).reshape(per) * dy.astype(np.float64)
    np.testing.assert_allclose(dx.get(), fixed, rtol=1e-4, atol=1e-6, err_msg="input gradient, fixed statistics")


ACTIVATIONS = {
    "relu": (lambda x: np.maximum(x, 0), lambda x, y, dy: np.where(y > 0, dy, 0), ()),
    "leaky_relu": (lambda x: np.where(x > 0, x, 0.1 * x), lambda x, y, dy: np.where(y > 0, dy, 0.1 * dy), (0.1,)),
    "tanh": (np.tanh, lambda x, y, dy: dy * (1 - y * y), ()),
}


@pytest.mark.cuda
@pytest.mark.parametrize("kind", sorted(ACTIVATIONS))
@pytest.mark.parametrize("size,offset", [(1 << 16, 0), (4099, 0), (4096, 1)],
                         ids=["float4", "odd-size", "unaligned"])
def test_activations_and_axpby_match_float64(kind, size, offset):
    be = backend_or_skip("cuda")
    import cupy as cp

    forward, gradient, params = ACTIVATIONS[kind]
    rng = np.random.default_rng(1)
    x = rng.standard_normal(size + offset).astype(np.float32)
    dy = rng.standard_normal(size + offset).astype(np.float32)
    xd, dyd = cp.asarray(x)[offset:], cp.asarray(dy)[offset:]  # offset 1: a view 4 bytes into its buffer
    x64, dy64 = x[offset:].astype(np.float64), dy[offset:].astype(np.float64)
    y = cp.zeros(size + offset, cp.float32)[offset:]
    be.activation(kind, xd, y, params)
    y_ref = forward(x64)
    np.testing.assert_allclose(y.get(), y_ref, rtol=1e-6, atol=1e-6, err_msg=f"{kind} forward")
    dx = cp.zeros(size + offset, cp.float32)[offset:]
    be.activation_grad(kind, y, dyd, dx, params)
    np.testing.assert_allclose(dx.get(), gradient(x64, y.get().astype(np.float64), dy64), rtol=1e-5, atol=1e-6,
                               err_msg=f"{kind} gradient")
    out = dyd.copy() if offset == 0 else cp.asarray(dy)[offset:]
    be.axpby(0.5, xd, -2.0, out)
    np.testing.assert_allclose(out.get(), 0.5 * x64 - 2.0 * dy64, rtol=1e-6, atol=1e-6, err_msg="axpby")
    be.activation(kind, xd, xd, params)  # in place
    np.testing.assert_allclose(xd.get(), y_ref, rtol=1e-6, atol=1e-6, err_msg=f"{kind} in place")


@pytest.mark.cuda
@pytest.mark.parametrize("shift", [-3, 5, 1 << 12])
def test_copy_between_overlapping_views_reads_the_source_as_it_was(shift):
    """A copy between two dense views of one buffer whose spans overlap (the same shape and strides, other starts)
    writes what the source held before the copy, as NumPy's assignment does (a device-to-device memcpy of
    overlapping spans is undefined)."""
    be = backend_or_skip("cuda")
    import cupy as cp

    n = 1 << 14
    host = np.arange(n + (1 << 13), dtype=np.float32)
    buf = cp.asarray(host)
    a, b = 4096, 4096 + shift
    be.copy(buf[a:a + n], buf[b:b + n])
    want = host.copy()
    want[b:b + n] = host[a:a + n]
    np.testing.assert_array_equal(buf.get(), want)
