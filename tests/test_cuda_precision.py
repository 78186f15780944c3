"""The cuda backend's primitives on bfloat16 and float16 buffers, against float64 NumPy computed from the same
rounded inputs. Runs on the GPU machine.

Tolerances come from the format's unit roundoff u (bfloat16 2^-8, float16 2^-11): a value computed in float and
rounded once into the format is within u|ref| of the float64 result, plus the float32 arithmetic's own error,
bounded per element by depth * 2^-24 * (the same sum over absolute values) for a reduction of that depth (GEMM,
convolution). The tests allow 2u|ref| + 8 * depth * 2^-24 * sum|a||b| per element."""

from __future__ import annotations

import math

import numpy as np
import pytest
import reference
from conftest import backend_or_skip

import leafpy as lp

ml_dtypes = pytest.importorskip("ml_dtypes")

FORMATS = {"bf16": (np.dtype(ml_dtypes.bfloat16), 2.0**-8), "fp16": (np.dtype(np.float16), 2.0**-11)}
F32_EPS = 2.0**-24


def _rounded(values, dtype):
    """``values`` rounded to ``dtype`` (ml_dtypes' and NumPy's round to nearest even)."""
    return np.asarray(values, np.float64).astype(dtype)


def _dev(host):
    """A device copy of a host array of any of the three formats (16-bit ones moved as their bits)."""
    import cupy as cp

    if host.dtype.itemsize == 2:
        return cp.asarray(np.ascontiguousarray(host).view(np.uint16)).view(host.dtype)
    return cp.asarray(host)


def _host(dev):
    if dev.dtype.itemsize == 2:
        return dev.view(np.uint16).get().view(dev.dtype)
    return dev.get()


def _host_any(dev):
    """A host copy of a device array of any layout (a channels-last view copied out in its logical order)."""
    import cupy as cp

    if dev.dtype.itemsize == 2:
        return cp.ascontiguousarray(dev.view(np.uint16)).get().view(dev.dtype)
    return cp.ascontiguousarray(dev).get()


def _f64(a):
    return np.asarray(a).astype(np.float64)


def _check(got, ref, tol, what):
    got = _f64(got)
    err = np.abs(got - ref)
    tol = np.broadcast_to(tol, err.shape)
    bad = ~(err <= tol)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err / np.maximum(tol, 1e-300), 0)), err.shape)
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} elements off; worst at {i}: got "
                             f"{got[i]:.6g}, reference {ref[i]:.6g}, tolerance {tol[i]:.3g}")


def _empty(shape, dtype):
    import cupy as cp

    return cp.empty(shape, dtype)


# --- GEMM ----------------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("result", ["low", "f32", "f32_accumulate"])
def test_gemm(fmt, trans_a, trans_b, result):
    be = backend_or_skip("cuda")
    dtype, u = FORMATS[fmt]
    rng = np.random.default_rng(1)
    m, k, n = 37, 301, 45  # no dimension a multiple of 8
    a = _rounded(rng.standard_normal((k, m) if trans_a else (m, k)), dtype)
    b = _rounded(rng.standard_normal((n, k) if trans_b else (k, n)), dtype)
    a64, b64 = _f64(a), _f64(b)
    opa, opb = (a64.T if trans_a else a64), (b64.T if trans_b else b64)
    ref = 0.75 * opa @ opb
    scale = 0.75 * np.abs(opa) @ np.abs(opb)
    out_dtype = dtype if result == "low" else np.dtype(np.float32)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    out = _dev(c0.astype(out_dtype))
    beta = 1.0 if result == "f32_accumulate" else 0.0
    be.gemm(_dev(a), trans_a, _dev(b), trans_b, out, 0.75, beta)
    be.synchronize()
    if beta:
        ref = ref + c0.astype(np.float64)
        scale = scale + np.abs(c0)
    rounding = u if result == "low" else F32_EPS
    _check(_host(out), ref, 2 * rounding * np.abs(ref) + 8 * k * F32_EPS * scale, f"{fmt} gemm -> {result}")


@pytest.mark.cuda
def test_gemm_refuses_mixed_operand_formats():
    be = backend_or_skip("cuda")
    a = _dev(_rounded(np.ones((4, 4)), FORMATS["bf16"][0]))
    b = _dev(_rounded(np.ones((4, 4)), FORMATS["fp16"][0]))
    with pytest.raises(lp.LeafpyError, match="gemm"):
        be.gemm(a, False, b, False, _empty((4, 4), np.float32))


# --- convolution (cuDNN) -------------------------------------------------------------------------------------------
def _windows(x, kh, kw, stride, pad):
    """[N, C, OH, OW, kh, kw] windows of x padded by ``pad``."""
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    win = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(2, 3))
    return win[:, :, ::stride[0], ::stride[1]]


def _conv_ref(x, w, stride, pad):
    return np.einsum("nchwij,ocij->nohw", _windows(x, w.shape[2], w.shape[3], stride, pad), w)


def _conv_data_ref(dy, w, x_shape, stride, pad):
    n, c, h, wd = x_shape
    kh, kw = w.shape[2:]
    dxp = np.zeros((n, c, h + 2 * pad[0], wd + 2 * pad[1]))
    oh, ow = dy.shape[2:]
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i:i + stride[0] * oh:stride[0], j:j + stride[1] * ow:stride[1]] += np.einsum(
                "nohw,oc->nchw", dy, w[:, :, i, j])
    return dxp[:, :, pad[0]:pad[0] + h, pad[1]:pad[1] + wd]


def _conv_filter_ref(x, dy, w_shape, stride, pad):
    return np.einsum("nchwij,nohw->ocij", _windows(x, w_shape[2], w_shape[3], stride, pad), dy)


CONV_CASES = [((6, 16, 12, 12), (24, 16, 3, 3), (1, 1), (1, 1)), ((4, 8, 11, 11), (16, 8, 5, 5), (2, 2), (0, 0))]


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CONV_CASES, ids=["3x3s1p1", "5x5s2p0"])
def test_convolution_passes(fmt, case):
    be = backend_or_skip("cuda")
    if not be.uses_cudnn:
        pytest.skip("cuDNN graphs unavailable")
    dtype, u = FORMATS[fmt]
    x_shape, w_shape, stride, pad = case
    rng = np.random.default_rng(2)
    x = _rounded(rng.standard_normal(x_shape), dtype)
    w = _rounded(rng.standard_normal(w_shape) * 0.2, dtype)
    x64, w64 = _f64(x), _f64(w)
    y_ref = _conv_ref(x64, w64, stride, pad)
    y = _empty(y_ref.shape, dtype)
    be.conv2d(_dev(x), _dev(w), y, stride, pad, None)
    depth = w_shape[1] * w_shape[2] * w_shape[3]
    be.synchronize()
    _check(_host(y), y_ref, 2 * u * np.abs(y_ref) + 8 * depth * F32_EPS * _conv_ref(np.abs(x64), np.abs(w64), stride,
                                                                                     pad), f"{fmt} conv forward")

    dy = _rounded(rng.standard_normal(y_ref.shape), dtype)
    dy64 = _f64(dy)
    dx_ref = _conv_data_ref(dy64, w64, x_shape, stride, pad)
    dx = _empty(x_shape, dtype)
    be.conv2d_grad_data(_dev(dy), _dev(w), dx, stride, pad, None)
    depth = w_shape[0] * w_shape[2] * w_shape[3]
    scale = _conv_data_ref(np.abs(dy64), np.abs(w64), x_shape, stride, pad)
    be.synchronize()
    _check(_host(dx), dx_ref, 2 * u * np.abs(dx_ref) + 8 * depth * F32_EPS * scale, f"{fmt} conv data gradient")

    # the filter gradient into a float32 buffer (mixed precision's weight gradients), overwritten then accumulated
    dw_ref = _conv_filter_ref(x64, dy64, w_shape, stride, pad)
    depth = y_ref.shape[0] * y_ref.shape[2] * y_ref.shape[3]
    scale = _conv_filter_ref(np.abs(x64), np.abs(dy64), w_shape, stride, pad)
    tol = 2 * u * np.abs(dw_ref) + 8 * depth * F32_EPS * scale
    dw = _empty(w_shape, np.float32)
    be.conv2d_grad_filter(_dev(x), _dev(dy), dw, stride, pad, None)
    be.synchronize()
    _check(_host(dw), dw_ref, tol, f"{fmt} conv filter gradient (float32)")
    start = rng.standard_normal(w_shape).astype(np.float32)
    dw = _dev(start)
    be.conv2d_grad_filter(_dev(x), _dev(dy), dw, stride, pad, None, beta=1.0)
    be.synchronize()
    _check(_host(dw), dw_ref + start, tol + 2 * u * np.abs(start), f"{fmt} conv filter gradient accumulated")
    # and into a buffer of the activations' own format
    dw = _empty(w_shape, dtype)
    be.conv2d_grad_filter(_dev(x), _dev(dy), dw, stride, pad, None)
    be.synchronize()
    _check(_host(dw), dw_ref, tol, f"{fmt} conv filter gradient ({fmt})")


def _nhwc(host):
    """A device copy of an [N, C, H, W] host array in NHWC memory, seen as NCHW (the channels-last layout)."""
    return _dev(np.ascontiguousarray(host.transpose(0, 2, 3, 1))).transpose(0, 3, 1, 2)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("channels", [1, 3, 12])
def test_channels_last_convolutions_of_few_channels(fmt, channels):
    """16-bit channels-last convolutions whose input channels are not a multiple of 8 (an RGB batch's 3) run on
    zero-padded copies of input and filter (CudaBackend.PAD_CHANNELS): the forward pass, then the filter gradient
    from the padded input the forward pass left in the workspace (overwritten, then accumulated), then for another
    input of the same shape (padded anew, not the held copy), each against float64."""
    be = backend_or_skip("cuda")
    if not be.uses_cudnn:
        pytest.skip("cuDNN graphs unavailable")
    assert be.PAD_CHANNELS
    dtype, u = FORMATS[fmt]
    x_shape, w_shape, stride, pad = (4, channels, 23, 23), (16, channels, 5, 5), (2, 2), (2, 2)
    rng = np.random.default_rng(channels)
    x, other = (_rounded(rng.standard_normal(x_shape), dtype) for _ in range(2))
    w = _rounded(rng.standard_normal(w_shape) * 0.2, dtype)
    ws: dict = {}
    y_ref = _conv_ref(_f64(x), _f64(w), stride, pad)
    y = _nhwc(np.zeros(y_ref.shape, dtype))
    dx, dw_dev = _nhwc(x), _nhwc(w)
    be.conv2d(dx, dw_dev, y, stride, pad, ws)
    assert "padded_input" in ws and ws["padded_input"].shape[1] == 8 * -(-channels // 8)
    depth = channels * 25
    be.synchronize()
    _check(_host(y), y_ref, 2 * u * np.abs(y_ref) + 8 * depth * F32_EPS * _conv_ref(np.abs(_f64(x)), np.abs(_f64(w)),
                                                                                     stride, pad), f"{fmt} forward")
    dy = _rounded(rng.standard_normal(y_ref.shape), dtype)
    for given, label in ((dx, "the forward's input"), (_nhwc(other), "another input")):
        host = x if given is dx else other
        dw_ref = _conv_filter_ref(_f64(host), _f64(dy), w_shape, stride, pad)
        scale = _conv_filter_ref(np.abs(_f64(host)), np.abs(_f64(dy)), w_shape, stride, pad)
        tol = 2 * u * np.abs(dw_ref) + 8 * y_ref[0, 0].size * x_shape[0] * F32_EPS * scale
        dw = _nhwc(np.zeros(w_shape, np.float32))
        be.conv2d_grad_filter(given, _nhwc(dy), dw, stride, pad, ws)
        be.synchronize()
        _check(_host(dw), dw_ref, tol, f"{fmt} filter gradient of {label}")
        start = rng.standard_normal(w_shape).astype(np.float32)
        dw = _nhwc(start)
        be.conv2d_grad_filter(given, _nhwc(dy), dw, stride, pad, ws, beta=1.0)
        be.synchronize()
        _check(_host(dw), dw_ref + start, tol + 2 * u * np.abs(start), f"{fmt} accumulated filter gradient of {label}")


# --- elementwise ---------------------------------------------------------------------------------------------------
def _erf(v):
    return np.vectorize(math.erf)(v)


PARAMS = {"leaky_relu": (0.1,), "elu": (0.7,), "softplus": (1.5, 20.0), "clip": (-1.0, 2.0)}


def _sig(v):
    return 1.0 / (1.0 + np.exp(-v))


def _gelu_tanh(v):
    return 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))


ACTIVATIONS = {  # name: (forward(x, *params), gradient(src, dy, *params), whether the gradient reads y)
    "relu": (lambda x: np.maximum(x, 0.0), lambda y, g: np.where(y > 0, g, 0.0), True),
    "sigmoid": (_sig, lambda y, g: g * y * (1 - y), True),
    "tanh": (np.tanh, lambda y, g: g * (1 - y * y), True),
    "leaky_relu": (lambda x, s: np.where(x > 0, x, s * x), lambda y, g, s: np.where(y > 0, g, s * g), True),
    "elu": (lambda x, a: np.where(x > 0, x, a * np.expm1(np.minimum(x, 0))),
            lambda y, g, a: np.where(y > 0, g, g * (y + a)), True),
    "softplus": (lambda x, b, t: np.where(b * x > t, x, np.log1p(np.exp(np.minimum(b * x, t))) / b),
                 lambda x, g, b, t: np.where(b * x > t, g, g * _sig(b * x)), False),
    "gelu": (lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
             lambda x, g: g * (0.5 * (1 + _erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)),
             False),
    "gelu_tanh": (_gelu_tanh, lambda x, g: g * _gelu_tanh_grad(x), False),
    "silu": (lambda x: x * _sig(x), lambda x, g: g * _sig(x) * (1 + x * (1 - _sig(x))), False),
    "clip": (lambda x, lo, hi: np.clip(x, lo, hi), lambda y, g, lo, hi: np.where((y > lo) & (y < hi), g, 0.0), True),
}


def test_every_activation_of_the_formula_table_has_a_reference_here():
    """A new line in leafpy.backends.pointwise.TABLE cannot be left out of the 16-bit kernel tests above."""
    from leafpy.backends import pointwise

    assert set(ACTIVATIONS) == set(pointwise.TABLE), "give each formula-table activation a float64 reference here"


def _gelu_tanh_grad(x):
    c = math.sqrt(2.0 / math.pi)
    t = np.tanh(c * (x + 0.044715 * x**3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)


def _elementwise_tol(ref, u, src=None, dy=None):
    """2u|ref|, plus float32's own error where terms of the formula cancel (the gradients' tails: their terms grow
    up to |x|^3 times |dy| while their sum falls to 0)."""
    tol = 2 * u * np.abs(ref) + 1e-6
    if src is not None:
        tol = tol + 2 * F32_EPS * (1 + np.abs(dy)) * (1 + np.abs(src)) ** 3
    return tol


SIZES = [1003, 1024]
"""1024: eight values per thread (16-byte loads); 1003: one per thread."""


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("size", SIZES)
def test_activation_and_gradient(fmt, kind, size):
    be = backend_or_skip("cuda")
    dtype, u = FORMATS[fmt]
    forward, gradient, reads_y = ACTIVATIONS[kind]
    params = PARAMS.get(kind, ())
    rng = np.random.default_rng(3)
    x = _rounded(rng.standard_normal(size) * 3, dtype)
    y_ref = forward(_f64(x), *params)
    y = _empty(x.shape, dtype)
    be.activation(kind, _dev(x), y, params)
    be.synchronize()
    _check(_host(y), y_ref, _elementwise_tol(y_ref, u), f"{fmt} {kind}")
    src = _rounded(y_ref, dtype) if reads_y else x
    dy = _rounded(rng.standard_normal(x.shape), dtype)
    dx_ref = gradient(_f64(src), _f64(dy), *params)
    dx = _empty(x.shape, dtype)
    be.activation_grad(kind, _dev(src), _dev(dy), dx, params)
    be.synchronize()
    _check(_host(dx), dx_ref, _elementwise_tol(dx_ref, u, _f64(src), _f64(dy)), f"{fmt} {kind} gradient")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(5, 7, 3, 3), (4, 7, 4, 4)], ids=["one-per-thread", "eight-per-thread"])
def test_axpby_mul_bias(fmt, shape):
    be = backend_or_skip("cuda")
    dtype, u = FORMATS[fmt]
    rng = np.random.default_rng(4)
    x = _rounded(rng.standard_normal(shape), dtype)
    depth = x.size // 7
    y0 = _rounded(rng.standard_normal(x.shape), dtype)
    y = _dev(y0)
    be.axpby(0.5, _dev(x), -1.25, y)
    be.synchronize()
    ref = 0.5 * _f64(x) - 1.25 * _f64(y0)
    _check(_host(y), ref, _elementwise_tol(ref, u), f"{fmt} axpby")
    # a 16-bit gradient added into a float32 accumulator
    acc0 = rng.standard_normal(x.shape).astype(np.float32)
    acc = _dev(acc0)
    be.axpby(1.0, _dev(x), 1.0, acc)
    be.synchronize()
    ref = _f64(x) + acc0
    _check(_host(acc), ref, 4 * F32_EPS * np.abs(ref) + 1e-7, f"{fmt} axpby into float32")
    # a 16-bit activation times a float32 dropout mask
    mask = (rng.random(x.shape) < 0.5).astype(np.float32) * np.float32(1 / 0.7)
    out = _empty(x.shape, dtype)
    be.mul(_dev(x), _dev(mask), out)
    be.synchronize()
    ref = _f64(x) * mask
    _check(_host(out), ref, _elementwise_tol(ref, u), f"{fmt} mul")
    # bias over channels, and its gradient into float32 (overwritten, then accumulated)
    b = _rounded(rng.standard_normal(7), dtype)
    yb = _dev(y0)
    be.bias_add(yb, _dev(b))
    be.synchronize()
    ref = _f64(y0) + _f64(b).reshape(1, 7, 1, 1)
    _check(_host(yb), ref, _elementwise_tol(ref, u), f"{fmt} bias_add")
    db = _empty(7, np.float32)
    be.bias_grad(_dev(x), db)
    be.synchronize()
    ref = _f64(x).sum(axis=(0, 2, 3))
    scale = np.abs(_f64(x)).sum(axis=(0, 2, 3))
    _check(_host(db), ref, 8 * depth * F32_EPS * scale, f"{fmt} bias_grad")
    start = rng.standard_normal(7).astype(np.float32)
    db = _dev(start)
    be.bias_grad(_dev(x), db, beta=1.0)
    be.synchronize()
    _check(_host(db), ref + start, 8 * depth * F32_EPS * (scale + np.abs(start)), f"{fmt} bias_grad accumulated")
    # a Linear layer's bias: [N, C]
    flat = x.reshape(shape[0], -1)
    db = _empty(flat.shape[1], np.float32)
    be.bias_grad(_dev(flat), db)
    be.synchronize()
    _check(_host(db), _f64(flat).sum(axis=0), 8 * shape[0] * F32_EPS * np.abs(_f64(flat)).sum(axis=0),
           f"{fmt} bias_grad [N, C]")


def _same_bits(got, expect, what):
    """Equal bits, NaN for NaN (a NaN's payload is the device's own)."""
    nan = np.isnan(expect.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=what)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], expect.view(np.uint16)[~nan], err_msg=what)


@pytest.mark.cuda
def test_cast_rounds_to_nearest_even():
    """Conversions are exactly specified (round to nearest even, NaN kept, beyond the range infinity): the bits
    must equal ml_dtypes' and NumPy's conversions."""
    be = backend_or_skip("cuda")
    bf16, f16 = FORMATS["bf16"][0], FORMATS["fp16"][0]
    rng = np.random.default_rng(5)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e30, -7e4, 65519.0, 65520.0, 6e-8, 3e-39, 1.00390625,
               1.01171875, 1.0 + 2**-11, 1.0 + 3 * 2**-11]
    values = np.concatenate([special, rng.standard_normal(2000) * 10.0 ** rng.integers(-8, 8, 2000)])
    values = values.astype(np.float32)
    for n in (values.size, 2008):  # 2015 elements: one per thread; 2008: eight per thread
        src = values[:n]
        for target in (bf16, f16):
            out = _empty(src.shape, target)
            be.cast(_dev(src), out)
            be.synchronize()
            expect = src.astype(target)
            _same_bits(_host(out), expect, str(target))
            back = _empty(src.shape, np.float32)
            be.cast(out, back)
            be.synchronize()
            np.testing.assert_array_equal(_host(back), expect.astype(np.float32))
        for a, b in ((bf16, f16), (f16, bf16)):  # between the two formats: one rounding from the exact value
            low = src.astype(a)
            out = _empty(src.shape, b)
            be.cast(_dev(low), out)
            be.synchronize()
            _same_bits(_host(out), low.astype(np.float32).astype(b), f"{a} -> {b}")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_fill_copy_and_copy_block(fmt):
    be = backend_or_skip("cuda")
    dtype, _ = FORMATS[fmt]
    buf = _empty((3, 10), dtype)
    be.fill(1.5, buf)
    be.synchronize()
    assert np.all(_f64(_host(buf)) == 1.5)
    src = _rounded(np.arange(30).reshape(3, 10) / 8, dtype)
    be.copy(_dev(src), buf)
    be.synchronize()
    np.testing.assert_array_equal(_host(buf).view(np.uint16), src.view(np.uint16))
    part = _empty((3, 4), dtype)
    be.copy_block(part, buf, 4, 10, 3, False)
    be.synchronize()
    np.testing.assert_array_equal(_host(part).view(np.uint16), src[:, 3:7].view(np.uint16))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", [*FORMATS, "fp32"])
def test_copy_between_channels_last_views(fmt):
    """A copy between views of NHWC memory (a channels-last backend's 4-D tensors) keeps every value at its
    [n, c, h, w], whether the other operand is channels-last too (copied as bytes) or row-major."""
    be = backend_or_skip("cuda")
    import cupy as cp

    dtype = FORMATS[fmt][0] if fmt in FORMATS else np.dtype(np.float32)
    shape = (3, 5, 4, 6)
    src = _rounded(np.arange(np.prod(shape)).reshape(shape) / 16, dtype)

    def nhwc(host):  # an [N, C, H, W] view of NHWC memory holding host's values
        n, c, h, w = host.shape
        return _dev(np.ascontiguousarray(host.transpose(0, 2, 3, 1))).transpose(0, 3, 1, 2)

    for out in (nhwc(np.zeros(shape, dtype)), _dev(np.zeros(shape, dtype))):
        be.copy(nhwc(src), out)
        be.synchronize()
        got = cp.ascontiguousarray(out.view(np.uint16) if dtype.itemsize == 2 else out).get()
        np.testing.assert_array_equal(got, src.view(np.uint16) if dtype.itemsize == 2 else src)
    row_major_into_nhwc = nhwc(np.zeros(shape, dtype))
    be.copy(_dev(src), row_major_into_nhwc)
    be.synchronize()
    got = cp.ascontiguousarray(row_major_into_nhwc.view(np.uint16) if dtype.itemsize == 2 else row_major_into_nhwc)
    np.testing.assert_array_equal(got.get(), src.view(np.uint16) if dtype.itemsize == 2 else src)


# --- batch normalisation, pooling, dropout -------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(16, 8, 6, 6), (5, 3, 5, 5)], ids=["eight-per-thread", "one-per-thread"])
def test_batch_norm(fmt, shape):
    be = backend_or_skip("cuda")
    import cupy as cp

    dtype, u = FORMATS[fmt]
    eps = 1e-5
    c = shape[1]
    rng = np.random.default_rng(6)
    x = _rounded(3.0 + rng.standard_normal(shape), dtype)
    dy = _rounded(rng.standard_normal(shape), dtype)
    gamma = rng.uniform(0.5, 1.5, c).astype(np.float32)
    beta = rng.standard_normal(c).astype(np.float32)
    want = reference.batch_norm(_f64(x), _f64(dy), gamma, beta, eps)

    xd, dyd = _dev(x), _dev(dy)
    mean_d, var_d, sdy, sdx = (cp.empty(c, cp.float32) for _ in range(4))
    be.batch_norm_stats(xd, mean_d, var_d)
    be.synchronize()
    _check(mean_d.get(), want.mean, 1e-5 * np.abs(want.mean), f"{fmt} batch-norm mean")
    _check(var_d.get(), want.var, 1e-4 * want.var, f"{fmt} batch-norm variance")
    y = _empty(shape, dtype)
    be.batch_norm(xd, mean_d, var_d, _dev(gamma), _dev(beta), y, eps)
    be.synchronize()
    _check(_host(y), want.y, 2 * u * np.abs(want.y) + 1e-4, f"{fmt} batch-norm output")
    be.batch_norm_grad_sums(xd, dyd, mean_d, var_d, sdy, sdx, eps)
    be.synchronize()
    scale = np.abs(_f64(dy)).sum(axis=(0, 2, 3))
    _check(sdy.get(), want.sum_dy, 1e-5 * scale, f"{fmt} batch-norm sum dy")
    _check(sdx.get(), want.sum_dy_xhat, 1e-4 * scale, f"{fmt} batch-norm sum dy xhat")
    dx = _empty(shape, dtype)
    be.batch_norm_grad(xd, dyd, mean_d, var_d, _dev(gamma), sdy, sdx, dx, eps, True)
    be.synchronize()
    _check(_host(dx), want.dx, 2 * u * np.abs(want.dx) + 1e-4, f"{fmt} batch-norm input gradient")
    with pytest.raises(lp.LeafpyError, match="batch_norm"):  # statistics stay float32
        be.batch_norm(xd, mean_d.astype(cp.float16), var_d, None, None, y, eps)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("layout,channels,kernels", [("nchw", 2, {"pool_fwd", "pool_bwd"}),
                                                     ("channels-last", 2, {"pool_fwd", "pool_bwd"}),
                                                     ("channels-last", 16, {"pool_fwd8", "pool_bwd8"})],
                         ids=["nchw", "channels-last", "channels-last-8"])
def test_pooling(fmt, mode, layout, channels, kernels, monkeypatch):
    """3x3 windows, stride 2, padding 1 (overlapping: an input's gradient adds up over windows), against float64;
    16-bit channels-last tensors whose channels are a multiple of 8 take the 8-channel kernels."""
    be = backend_or_skip("cuda")

    ran = set()
    pool_kernel = be._pool_kernel
    monkeypatch.setattr(be, "_pool_kernel", lambda name, *a: ran.add(name) or pool_kernel(name, *a))
    dtype, u = FORMATS[fmt]
    rng = np.random.default_rng(7)
    shape, k, s, p = (2, channels, 7, 7), (3, 3), (2, 2), (1, 1)
    place = _nhwc if layout == "channels-last" else _dev
    # ties (values rounded to 16 bits) go to the window's first maximum in the kernels and in argmax alike
    x = _rounded(rng.standard_normal(shape), dtype)
    win = _windows(_f64(x), 3, 3, s, p)
    pad_mask = _windows(np.ones(shape), 3, 3, s, p)
    oh = win.shape[2]
    flat = np.where(pad_mask > 0, win, -np.inf).reshape(*win.shape[:4], 9)
    y_ref = flat.max(axis=-1) if mode == "max" else win.reshape(*win.shape[:4], 9).sum(axis=-1) / 9
    y = place(np.zeros(y_ref.shape, dtype))
    mask = place(np.zeros(y_ref.shape, np.int32)) if mode == "max" else None
    xd = place(x)
    be.pool2d(xd, y, mask, mode, k, s, p)
    be.synchronize()
    _check(_host_any(y), y_ref, 2 * u * np.abs(y_ref) + 1e-7, f"{fmt} {mode} pool")
    dy = _rounded(rng.standard_normal(y_ref.shape), dtype)
    dy64 = _f64(dy)
    dxp = np.zeros((2, channels, 9, 9))
    arg = flat.argmax(axis=-1)
    for i in range(oh):
        for j in range(oh):
            for a in range(3):
                for b in range(3):
                    take = (arg[:, :, i, j] == a * 3 + b) if mode == "max" else np.full((2, channels), True)
                    share = 1.0 if mode == "max" else 1 / 9
                    dxp[:, :, i * 2 + a, j * 2 + b] += np.where(take, dy64[:, :, i, j] * share, 0.0)
    dx_ref = dxp[:, :, 1:8, 1:8]
    dx = place(np.full(shape, np.nan, dtype))  # every element written, none left as it was
    be.pool2d_grad(place(dy), dx, mask, mode, k, s, p)
    be.synchronize()
    _check(_host_any(dx), dx_ref, 2 * u * np.abs(dx_ref) + 8 * 9 * F32_EPS * np.abs(dx_ref) + 1e-7,
           f"{fmt} {mode} pool gradient")
    assert ran == kernels


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_dropout_mask(fmt):
    from leafpy.backends.array import DROPOUT_KEY_MULTIPLIER, dropout_threshold

    be = backend_or_skip("cuda")
    import cupy as cp

    dtype, u = FORMATS[fmt]
    ratio, n, seed = 0.3, 5000, 12345
    mask = _empty((n,), dtype)
    be.dropout_mask(mask, ratio, cp.asarray(np.array([seed], np.uint32)))
    be.synchronize()
    # the kernel's hash, in NumPy's wrapping uint32 arithmetic
    h = (np.arange(n, dtype=np.uint64) + (seed * DROPOUT_KEY_MULTIPLIER) % 2**32) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    ref = np.where(h >= dropout_threshold(ratio), 1 / (1 - ratio), 0.0)
    _check(_host(mask), ref, 2 * u * ref, f"{fmt} dropout mask")


# --- recorded steps and refusals -----------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_recorded_step_replays_16_bit_gemm_and_convolution(fmt):
    """A step of 16-bit GEMMs (one accumulating into float32) and convolution passes, recorded as a CUDA graph and
    replayed on new input values."""
    be = backend_or_skip("cuda")
    dtype, u = FORMATS[fmt]
    rng = np.random.default_rng(8)
    m, k, n = 32, 64, 48
    a_dev = _empty((m, k), dtype)
    b = _rounded(rng.standard_normal((n, k)), dtype)
    b_dev = _dev(b)
    y = _empty((m, n), dtype)
    acc = _dev(np.zeros((k, n), np.float32))
    x_shape, w_shape = (2, 4, 8, 8), (6, 4, 3, 3)
    w = _rounded(rng.standard_normal(w_shape), dtype)
    w_dev, cx = _dev(w), _empty(x_shape, dtype)
    cy, cdw = _empty((2, 6, 8, 8), dtype), _empty(w_shape, np.float32)

    def step():
        be.gemm(a_dev, False, b_dev, True, y)  # y = a b^T
        be.gemm(a_dev, True, y, False, acc, 1.0, 1.0)  # acc += a^T y, in float32
        if be.uses_cudnn:
            be.conv2d(cx, w_dev, cy, (1, 1), (1, 1), None)
            be.conv2d_grad_filter(cx, cy, cdw, (1, 1), (1, 1), None)

    total, scale = np.zeros((k, n)), np.zeros((k, n))
    before = be.recorder.replays
    for it in range(4):
        a = _rounded(rng.standard_normal((m, k)), dtype)
        xc = _rounded(rng.standard_normal(x_shape), dtype)
        a_dev.view(np.uint16)[...] = _dev(a).view(np.uint16)
        cx.view(np.uint16)[...] = _dev(xc).view(np.uint16)
        be.run_step(("16-bit step", fmt), step)
        be.synchronize()
        y_ref = _f64(a) @ _f64(b).T
        _check(_host(y), y_ref, 2 * u * np.abs(y_ref) + 8 * k * F32_EPS * (np.abs(_f64(a)) @ np.abs(_f64(b)).T),
               f"{fmt} recorded gemm, run {it}")
        y_stored = _f64(_host(y))
        total += _f64(a).T @ y_stored
        scale += np.abs(_f64(a)).T @ np.abs(y_stored)
        _check(_host(acc), total, 8 * m * F32_EPS * scale + 4 * (it + 1) * F32_EPS * np.abs(total),
               f"{fmt} recorded float32 accumulation, run {it}")
        if be.uses_cudnn:
            cy_ref = _conv_ref(_f64(xc), _f64(w), (1, 1), (1, 1))
            cscale = _conv_ref(np.abs(_f64(xc)), np.abs(_f64(w)), (1, 1), (1, 1))
            _check(_host(cy), cy_ref, 2 * u * np.abs(cy_ref) + 8 * 36 * F32_EPS * cscale, f"{fmt} recorded conv")
            dw_ref = _conv_filter_ref(_f64(xc), _f64(_host(cy)), w_shape, (1, 1), (1, 1))
            dscale = _conv_filter_ref(np.abs(_f64(xc)), np.abs(_f64(_host(cy))), w_shape, (1, 1), (1, 1))
            _check(_host(cdw), dw_ref, 2 * u * np.abs(dw_ref) + 8 * 128 * F32_EPS * dscale,
                   f"{fmt} recorded filter gradient")
    assert be.record_error is None
    assert be.recorder.replays - before == 2  # first sight runs, second records, the rest replay


@pytest.mark.cuda
def test_primitive_without_16_bit_kernel_refuses_16_bit_buffers():
    be = backend_or_skip("cuda")
    x = _dev(_rounded(np.ones((2, 5)), FORMATS["bf16"][0]))
    with pytest.raises(lp.BackendError, match="softmax"):
        be.softmax(x, _empty((2, 5), np.float32))


LENET = """
network:
  type: Sequential
  inputs: [{name: data, shape: [16, 1, 8, 8]}]
  layers:
    - {name: conv1, type: Convolution, num_output: 8, filter_shape: [3], stride: [1], padding: [1]}
    - {name: bn1, type: BatchNorm}
    - {name: relu1, type: ReLU}
    - {name: pool1, type: Pooling, mode: max, filter_shape: [2], stride: [2], padding: [0]}
    - {name: flat, type: Flatten}
    - {name: fc1, type: Linear, output_size: 32}
    - {name: relu2, type: ReLU}
    - {name: fc2, type: Linear, output_size: 10}
    - {name: logsm, type: LogSoftmax}
objective:
  type: Sequential
  inputs: [{name: out, shape: [16, 10]}, {name: label, shape: [16, 1]}]
  layers: [{name: nll, type: NegativeLogLikelihood, num_classes: 10}]
"""


@pytest.mark.cuda
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_network_trains_in_low_precision_on_cuda_as_native_emulates_it(precision, channels_last):
    """The same steps from the same weights on cuda (16-bit kernels, cuBLAS/cuDNN in 16 bits with float32
    accumulation, float32 copies for the rest; 4-D tensors NCHW or channels-last) and on native's emulation
    (float32 arithmetic, the same storage rounding, row-major): losses and weights agree within the format's
    tolerance, and cuda's steps replay (fp16's with loss scaling too)."""
    import yaml

    cuda = lp.backend("cuda", precision=precision, channels_last=channels_last) if backend_or_skip("cuda") else None
    native = lp.backend("native", precision=precision)
    spec = yaml.safe_load(LENET)
    net_cfg, obj_cfg = (lp.config.layer_from_dict({"name": k, **spec[k]}) for k in ("network", "objective"))
    cfg = lp.SolverConfig(network=net_cfg, objective=obj_cfg, solver="momentum", base_lr=0.05, momentum=0.9,
                          lr_policy="inv", gamma=0.1, power=0.75, seed=3)
    solvers = [lp.Solver.from_config(be, be, cfg) for be in (native, cuda)]
    start = solvers[0].network.named_weights()
    solvers[1].network.load_weights(start)
    rng = np.random.default_rng(0)
    batches = [(rng.random((16, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 16)) for _ in range(3)]
    before = cuda.recorder.replays
    u = 2.0 ** -8 if precision == "bf16" else 2.0 ** -11
    for step in range(8):
        x, y = batches[step % 3]
        losses = []
        for s in solvers:
            s.train_minibatch(x, y)
            losses.append(s.loss())
        assert abs(losses[1] - losses[0]) <= 16 * u * max(1.0, abs(losses[0])), (step, losses)
    assert solvers[1].network.outputs[0].to_numpy().dtype == np.float32  # log-probabilities stay float32
    want, got = (s.network.named_weights() for s in solvers)
    for name, w in want.items():
        assert got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], w, rtol=0, atol=32 * u * max(1.0, float(np.abs(w).max())),
                                   err_msg=name)
    assert cuda.recorder.replays - before >= 8 - 2, cuda.recorder.error  # fp16 too: its loss scaling on the GPU
