"""Layers against NumPy float64 references written from their documented formulas, for settings the gradient check
table does not reach."""

from __future__ import annotations

import math

import numpy as np
import pytest

import leafpy as lp


@pytest.mark.parametrize("shape,axis", [((3, 2, 4), -2), ((2, 3, 4, 2), -2), ((2, 3, 2, 4), -3),
                                        ((2, 3, 4, 2), 2), ((2, 3, 4), -1)])
def test_linear_axis_counted_from_the_end_keeps_the_axes_before_it(native64, shape, axis):
    """``axis`` counts in the input: the axes before it are kept, the rest flattened into the features, for a
    negative axis as for a positive one (the output has fewer axes than the input when more than one is
    flattened)."""
    rng = np.random.default_rng(11)
    layer = lp.Layer.from_config(native64, lp.LayerConfig("fc", lp.LinearConfig(output_size=3, axis=axis)), seed=0)
    x = rng.standard_normal(shape)
    kept = shape[:axis % len(shape)]
    y = layer.forward([x])[0].to_numpy()
    w, b = (t.to_numpy() for t in layer.learnable_weights_data())
    rows = x.reshape(math.prod(kept), -1)
    assert w.shape == (3, rows.shape[1])
    np.testing.assert_allclose(y, (rows @ w.T + b).reshape(*kept, 3), rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal(y.shape)
    dx = layer.backward([dy])[0].to_numpy()
    dy_rows = dy.reshape(-1, 3)
    np.testing.assert_allclose(dx, (dy_rows @ w).reshape(shape), rtol=1e-12, atol=1e-12)
    dw, db = (t.to_numpy() for t in layer.learnable_weights_gradients())
    np.testing.assert_allclose(dw, dy_rows.T @ rows, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(db, dy_rows.sum(axis=0), rtol=1e-12, atol=1e-12)
