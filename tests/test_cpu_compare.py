"""benchmarks/cpu_compare.py's bookkeeping: which rounds are kept, and the statistics over them (no timing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cpu_compare  # noqa: E402


def pair(leafpy: float, torch: float, others: float) -> dict:
    return {"leafpy": leafpy, "torch": torch, "others": others}


def test_only_quiet_pairs_count():
    # the two noisy pairs are far off; kept, they would move every median
    pairs = [pair(2.0, 3.0, 0.0), pair(2.2, 3.0, 0.1), pair(50.0, 4.0, 0.9), pair(1.8, 3.6, 0.15),
             pair(2.0, 90.0, 0.5)]
    row = cpu_compare.summarize(pairs, quiet=0.15)
    assert (row["pairs"], row["kept"], row["all_noisy"]) == (5, 3, False)
    assert row["leafpy_ms"] == pytest.approx(2.0)
    assert row["torch_ms"] == pytest.approx(3.0)
    assert (row["leafpy_q1"], row["leafpy_q3"]) == (pytest.approx(1.9), pytest.approx(2.1))
    # the median of per-pair ratios (1.5, 1.3636, 2.0), not the ratio of the medians
    assert row["ratio"] == pytest.approx(1.5)


def test_paired_ratio_is_not_the_ratio_of_medians():
    pairs = [pair(1.0, 1.0, 0.0), pair(2.0, 4.0, 0.0), pair(4.0, 2.0, 0.0)]
    row = cpu_compare.summarize(pairs, quiet=0.15)
    assert row["ratio"] == pytest.approx(1.0)
    assert row["torch_ms"] / row["leafpy_ms"] == pytest.approx(1.0)
    pairs = [pair(1.0, 3.0, 0.0), pair(2.0, 3.0, 0.0), pair(4.0, 3.0, 0.0)]
    assert cpu_compare.summarize(pairs, quiet=0.15)["ratio"] == pytest.approx(1.5)


def test_no_quiet_pair_reports_all_with_a_flag():
    pairs = [pair(2.0, 3.0, 0.5), pair(4.0, 5.0, 1.0)]
    row = cpu_compare.summarize(pairs, quiet=0.15)
    assert (row["kept"], row["all_noisy"]) == (0, True)
    assert row["leafpy_ms"] == pytest.approx(3.0)
    assert row["others_median"] == pytest.approx(0.75)


def test_the_products_rows_give_the_rest_of_each_step_and_the_ceiling():
    pairs = [{**pair(3.0, 3.3, 0.0), "leafpy_products": 2.5, "torch_products": 2.4},
             {**pair(3.2, 3.6, 0.0), "leafpy_products": 2.4, "torch_products": 2.6},
             {**pair(9.0, 9.0, 0.9), "leafpy_products": 1.0, "torch_products": 1.0}]  # noisy: not kept
    row = cpu_compare.summarize(pairs, quiet=0.15)
    assert row["leafpy_products_ms"] == pytest.approx(2.45) and row["torch_products_ms"] == pytest.approx(2.5)
    assert row["leafpy_rest_ms"] == pytest.approx((0.5 + 0.8) / 2)
    assert row["torch_rest_ms"] == pytest.approx((0.9 + 1.0) / 2)
    assert row["products_ratio"] == pytest.approx((2.4 / 2.5 + 2.6 / 2.4) / 2)
    assert row["ceiling"] == pytest.approx((3.3 / 2.5 + 3.6 / 2.4) / 2)
    assert "ceiling" not in cpu_compare.summarize([pair(2.0, 3.0, 0.0)], quiet=0.15)


def test_the_products_of_a_linear_network_are_counted_by_hand():
    # MLP 784-512-512-10 at batch 128: three forward products, three weight gradients, two data gradients (the
    # first layer's input needs none); biases take no product
    shapes = cpu_compare.product_shapes([(512, 784), (512,), (512, 512), (512,), (10, 512), (10,)], 128)
    assert len(shapes) == 8
    flops = sum(2 * m * n * k for m, n, k, _, _ in shapes)
    assert flops == 2 * 128 * (784 * 512 + 512 * 512 + 512 * 10) * 3 - 2 * 128 * 784 * 512
    assert (128, 512, 784, False, True) in shapes and (512, 784, 128, True, False) in shapes
    assert cpu_compare.product_shapes([(6, 1, 5, 5), (6,)], 64) is None  # a convolution's: not plain GEMMs


def test_others_cores_is_the_machine_minus_the_workers():
    tick = cpu_compare.TICK
    assert cpu_compare.others_cores(3 * tick, 2 * tick, 2.0) == pytest.approx(0.5)
    # counters read a moment apart may show the workers ahead of the machine: never negative
    assert cpu_compare.others_cores(tick, 2 * tick, 1.0) == 0.0


def test_proc_counters_advance_with_work():
    import os
    import time
    before, machine = cpu_compare.cpu_ticks(os.getpid()), cpu_compare.busy_ticks()
    end = time.process_time() + 0.1
    while time.process_time() < end:
        pass
    assert cpu_compare.cpu_ticks(os.getpid()) > before
    assert cpu_compare.busy_ticks() > machine


def test_a_short_run_writes_rows_with_matching_losses(tmp_path):
    """The whole script once, on the smallest network: both workers start, rounds alternate, the row and the
    machine come back (a smoke test: the timings themselves are not checked)."""
    pytest.importorskip("torch", reason="the comparison needs PyTorch (pip install torch)")
    pytest.importorskip("threadpoolctl", reason="the workers set their threads with threadpoolctl")
    import json
    import subprocess

    out = tmp_path / "rows.json"
    script = Path(cpu_compare.__file__)
    p = subprocess.run([sys.executable, str(script), "--nets", "mlp128", "--rules", "inv", "--pairs", "2",
                        "--round-s", "0.02", "--wait-quiet", "0", "--products", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=script.parent.parent)
    assert p.returncode == 0, p.stderr
    saved = json.loads(out.read_text())
    assert saved["machine"]["threads"] == 2 and saved["machine"]["cpu"]
    (row,) = saved["rows"]
    assert (row["network"], row["rule"], row["pairs"], len(row["rounds"])) == ("mlp128", "inv", 2, 2)
    assert row["leafpy_loss10"] == pytest.approx(row["torch_loss10"], rel=1e-4)
    assert row["leafpy_ms"] > 0 and row["torch_ms"] > 0 and row["ratio"] > 0
    assert 0 < row["leafpy_products_ms"] and 0 < row["torch_products_ms"] and row["ceiling"] > 0
    assert "mlp128" in p.stdout and "ceiling" in p.stdout
