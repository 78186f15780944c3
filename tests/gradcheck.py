"""Finite-difference gradient checking (Caffe's checker: central differences, a tolerance floored at 1)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import leafpy as lp


def _close(analytic: np.ndarray, numeric: np.ndarray, tol: float, what: str) -> None:
    scale = np.maximum(1.0, np.maximum(np.abs(analytic), np.abs(numeric)))
    err = np.abs(analytic - numeric) / scale
    worst = int(np.argmax(err))
    assert err.flat[worst] <= tol, (
        f"{what}: analytic {analytic.flat[worst]!r} vs numeric {numeric.flat[worst]!r} at flat index {worst} "
        f"(relative error {err.flat[worst]:.3g} > {tol})")


def check_layer_gradients(layer: lp.Layer, inputs: list[np.ndarray], *, eps: float = 1e-6, tol: float = 1e-6,
                          before_forward: Callable[[], None] = lambda: None, seed: int = 0,
                          untrained: tuple[str, ...] = ()) -> int:
    """Check input and weight gradients of ``layer`` (on a float64 backend) against central differences of
    ``sum(R * output)`` for a fixed random R. Returns how many values were checked. Weights named in
    ``untrained`` (running statistics, which get no gradient by design) are left out."""
    rng = np.random.default_rng(seed)

    def run() -> list[np.ndarray]:
        before_forward()
        return [o.to_numpy() for o in layer.forward([x.copy() for x in inputs])]

    outs = run()
    proj = [rng.standard_normal(o.shape) for o in outs]

    def objective() -> float:
        return float(sum(np.sum(r * o) for r, o in zip(proj, run())))

    objective()
    grads_in = layer.backward(proj)
    analytic_in = [g.to_numpy() if g is not None else None for g in grads_in]
    analytic_w = [g.to_numpy() for g in layer.learnable_weights_gradients()]
    checked = 0
    for i, x in enumerate(inputs):
        if analytic_in[i] is None:
            continue
        num = np.zeros_like(x)
        for k in range(x.size):
            orig = x.flat[k]
            x.flat[k] = orig + eps
            fp = objective()
            x.flat[k] = orig - eps
            fm = objective()
            x.flat[k] = orig
            num.flat[k] = (fp - fm) / (2 * eps)
        _close(analytic_in[i], num, tol, f"{layer.name}: input {i}")
        checked += x.size
    for j, w in enumerate(layer.learnable_weights_data()):
        if layer.learnable_weights_names()[j] in untrained:
            continue
        base = w.to_numpy()
        num = np.zeros_like(base)
        for k in range(base.size):
            orig = base.flat[k]
            base.flat[k] = orig + eps
            w.set(base)
            fp = objective()
            base.flat[k] = orig - eps
            w.set(base)
            fm = objective()
            base.flat[k] = orig
            w.set(base)
            num.flat[k] = (fp - fm) / (2 * eps)
        _close(analytic_w[j], num, tol, f"{layer.learnable_weights_names()[j]}")
        checked += base.size
    return checked
