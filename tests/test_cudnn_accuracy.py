"""fp32 convolutions are as accurate as promised: every pass of every convolution shape the shipped networks use,
run through cuDNN's autotuned plans, within the backend's ``conv_tolerance`` (relative to the largest value; plus
1e-5 for the candidates' median itself) of a float64 reference computed without cuDNN — at the default tolerance
(2^-12) and at 1e-5 (implicit-GEMM accuracy). Runs on the GPU machine; ``LEAFPY_ACCURACY_TABLE=FILE`` writes the
table of errors there."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import leafpy as lp

ROOT = Path(__file__).resolve().parent.parent
MEDIAN_ERROR = 1e-5
"""How far the candidates' median (what a plan is compared with) may itself be from float64."""
TOLERANCES = {"default": 2.0 ** -12, "1e-5": 1e-5}
_backends: dict = {}


def _cuda(tolerance: float):
    try:
        be = _backends.get(tolerance) or lp.backend("cuda", tf32=False, conv_tolerance=tolerance)
    except lp.BackendUnavailable as e:
        pytest.skip(f"cuda backend unavailable: {e}")
    _backends[tolerance] = be
    if not be.uses_cudnn:
        pytest.skip("the cuDNN frontend is not installed: nothing of cuDNN's to check")
    return be


def conv_shapes(run_file: str):
    """(input shape, filter shape, stride, padding) of every Convolution in a shipped network."""
    net = lp.Layer.from_config(lp.backend("native"), lp.config.load(ROOT / "configs" / run_file).network)
    found = []

    def walk(layer):
        for child in getattr(layer, "layers", []):
            if child.config.type == "Convolution":
                w = child.learnable_weights_data()[0]
                cfg = child.config.config
                found.append((child.name, tuple(child.inputs[0].shape), tuple(w.shape), tuple(cfg.stride),
                              tuple(cfg.padding)))
            walk(child)

    walk(net)
    return found


def _windows(cp, x, kh, kw, stride, padding):
    n, c, h, w = x.shape
    xp = cp.pad(x, ((0, 0), (0, 0), (padding[0], padding[0]), (padding[1], padding[1])))
    oh = (h + 2 * padding[0] - kh) // stride[0] + 1
    ow = (w + 2 * padding[1] - kw) // stride[1] + 1
    s = xp.strides
    win = cp.lib.stride_tricks.as_strided(xp, (n, c, oh, ow, kh, kw),
                                          (s[0], s[1], s[2] * stride[0], s[3] * stride[1], s[2], s[3]))
    return xp, win, oh, ow


def reference(cp, x, w, dy, stride, padding):
    """float64 forward, data gradient and filter gradient by explicit windows (no cuDNN)."""
    x, w, dy = (a.astype(cp.float64) for a in (x, w, dy))
    o, c, kh, kw = w.shape
    xp, win, oh, ow = _windows(cp, x, kh, kw, stride, padding)
    y = cp.tensordot(win, w, axes=([1, 4, 5], [1, 2, 3])).transpose(0, 3, 1, 2)
    dw = cp.tensordot(dy, win, axes=([0, 2, 3], [0, 2, 3]))
    dxp = cp.zeros_like(xp)
    for i in range(kh):
        for j in range(kw):
            part = cp.tensordot(dy, w[:, :, i, j], axes=([1], [0])).transpose(0, 3, 1, 2)
            dxp[:, :, i:i + stride[0] * oh:stride[0], j:j + stride[1] * ow:stride[1]] += part
    h, wd = x.shape[2:]
    dx = dxp[:, :, padding[0]:padding[0] + h, padding[1]:padding[1] + wd]
    return y, dx, dw


def _cases() -> list[tuple]:
    """(run file, layer, shapes...) of every distinct convolution shape in the shipped convolutional networks."""
    seen, cases = set(), []
    for f in ("digits_lenet.yaml", "mnist_lenet.yaml", "alexnet.yaml", "digits_bn.yaml", "resnet18_cifar.yaml"):
        for name, *shape in conv_shapes(f) if (ROOT / "configs" / f).exists() else []:
            if tuple(shape) not in seen:
                seen.add(tuple(shape))
                cases.append((f, name, *shape))
    return cases


CASES = _cases()


@pytest.mark.cuda
@pytest.mark.parametrize("tolerance", list(TOLERANCES))
@pytest.mark.parametrize("run_file,layer,x_shape,w_shape,stride,padding", CASES,
                         ids=[f"{c[0].split('.')[0]}-{c[1]}" for c in CASES])
def test_every_cudnn_pass_is_fp32_accurate(run_file, layer, x_shape, w_shape, stride, padding, tolerance):
    bound = TOLERANCES[tolerance] + MEDIAN_ERROR
    be = _cuda(TOLERANCES[tolerance])
    import cupy as cp

    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal(x_shape, dtype=np.float32))
    w = cp.asarray((rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32))
    n, _, h, wd = x_shape
    oh = (h + 2 * padding[0] - w_shape[2]) // stride[0] + 1
    ow = (wd + 2 * padding[1] - w_shape[3]) // stride[1] + 1
    dy = cp.asarray(rng.standard_normal((n, w_shape[0], oh, ow), dtype=np.float32))
    y = cp.empty((n, w_shape[0], oh, ow), cp.float32)
    dx = cp.empty(x_shape, cp.float32)
    dw = cp.empty(w_shape, cp.float32)
    be.conv2d(x, w, y, stride, padding, {})
    be.conv2d_grad_data(dy, w, dx, stride, padding, {})
    be.conv2d_grad_filter(x, dy, dw, stride, padding, {})
    y_ref, dx_ref, dw_ref = reference(cp, x, w, dy, stride, padding)
    rows = []
    for name, got, ref, kind in (("forward", y, y_ref, "fprop"), ("data gradient", dx, dx_ref, "dgrad"),
                                 ("filter gradient", dw, dw_ref, "wgrad")):
        err = float(cp.abs(got - ref).max() / cp.abs(ref).max())
        # every candidate plan's difference from the candidates' median (what the autotuner filtered on)
        spread = next((v for k, v in be._cudnn.errors.items() if k[:3] == (kind, tuple(x_shape), tuple(w_shape))),
                      {})
        rows.append((name, err, max(spread.values(), default=0.0), len(spread)))
        assert err <= bound, (f"{run_file} {layer} {name}, conv_tolerance {tolerance}: relative error {err:.2e} "
                              f"against float64")
    table = os.environ.get("LEAFPY_ACCURACY_TABLE")
    if table:
        with open(table, "a") as f:
            for name, err, worst, count in rows:
                f.write(f"| {tolerance} | {run_file.split('.')[0]} {layer} | {list(x_shape)} * {list(w_shape)} "
                        f"s{stride[0]} p{padding[0]} | {name} | {err:.1e} | {worst:.1e} | {count} |\n")
