"""The webgpu backend's Winograd matrices from its Toom-Cook construction (sources.toom_cook), in exact fractions:
A^T [(G g) .* (B^T d)] is the correlation of d with g, sum_k g[k] d[i + k], for every output i, on random
integers, for the algorithms the backend runs and others; and the F(3x3, 5x5) the backend runs is that of its
points."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from leafpy.backends.webgpu.sources import F35_POINTS, toom_cook, winograd_f3x3_5x5


@pytest.mark.parametrize("m,r,points", [
    (2, 3, (0, 1, -1)), (4, 3, (0, 1, -1, 2, -2)), (2, 5, (0, 1, -1, 2, -2)), (3, 5, F35_POINTS),
    (6, 3, (0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2)))])
def test_toom_cook_filters_correlate_exactly(m, r, points):
    bt, g, at = toom_cook(m, r, points)
    n = m + r - 1
    assert (len(bt), len(bt[0]), len(g), len(g[0]), len(at), len(at[0])) == (n, n, n, r, m, n)
    assert all(x.denominator == 1 for row in bt for x in row), "B^T's rows are scaled to integers"
    rng = random.Random(m * 10 + r)
    for _ in range(5):
        d = [Fraction(rng.randint(-50, 50)) for _ in range(n)]
        w = [Fraction(rng.randint(-50, 50)) for _ in range(r)]
        gw = [sum(a * b for a, b in zip(row, w)) for row in g]
        bd = [sum(a * b for a, b in zip(row, d)) for row in bt]
        y = [sum(a * u * v for a, u, v in zip(row, gw, bd)) for row in at]
        assert y == [sum(w[k] * d[i + k] for k in range(r)) for i in range(m)]


def test_the_generated_f3x3_5x5_is_complete():
    """Its five products and the five kernels' bodies are in the generated WGSL."""
    text = winograd_f3x3_5x5()
    for name in ("times_bt7", "times_g7", "times_at7", "times_a7", "times_gt7", "filter35", "input35", "output35",
                 "dy35", "filter_grad35"):
        assert f"fn {name}(" in text, name
