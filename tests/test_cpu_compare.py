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
                        "--round-s", "0.02", "--wait-quiet", "0", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=script.parent.parent)
    assert p.returncode == 0, p.stderr
    saved = json.loads(out.read_text())
    assert saved["machine"]["threads"] == 2 and saved["machine"]["cpu"]
    (row,) = saved["rows"]
    assert (row["network"], row["rule"], row["pairs"], len(row["rounds"])) == ("mlp128", "inv", 2, 2)
    assert row["leafpy_loss10"] == pytest.approx(row["torch_loss10"], rel=1e-4)
    assert row["leafpy_ms"] > 0 and row["torch_ms"] > 0 and row["ratio"] > 0
    assert "mlp128" in p.stdout
