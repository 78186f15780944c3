"""The benchmark scripts still run (on native, without PyTorch): a smoke test, not a timing."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_train_step_prints_and_writes_its_rows(tmp_path):
    out = tmp_path / "rows.json"
    p = script("train_step.py", "--backend", "native", "--vs", "none", "--nets", "mlp128,lenet64", "--steps", "2",
               "--rounds", "1", "--warmup", "0", "--settle", "0", "--no-gemm", "--rules", "momentum,inv,adam",
               "--json", str(out))
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["network"], r["rule"]) for r in rows] == [(n, r) for n in ("mlp128", "lenet64")
                                                         for r in ("momentum", "inv", "adam")]
    for r in rows:
        assert r["leafpy_ms"] > 0 and r["leafpy_peak_mb"] > 0
        # ten steps of momentum SGD from random weights on a random batch: a finite loss near ln(10)
        assert math.isfinite(r["leafpy_loss10"]) and 1.5 < r["leafpy_loss10"] < 3.0
        assert "torch_ms" not in r
        assert f"{r['network']:<12}{r['rule']:>9}{r['batch']:>6}" in p.stdout


def test_training_flops_count_three_products_per_layer():
    """The FLOP count behind the tensor-core fractions, against the products written out by hand: LeNet's two
    convolutions (20x24x24 outputs of a 1x5x5 window, 50x8x8 of 20x5x5) and two linear layers (800 -> 500 -> 10)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import train_step

    import leafpy as lp

    solver, _, _ = train_step.solver_and_batch(lp.backend("native"), "lenet64")
    macs = 20 * 24 * 24 * 25 + 50 * 8 * 8 * 20 * 25 + 800 * 500 + 500 * 10
    assert train_step.training_flops(solver.network.layer) == 6 * 64 * macs


def test_profile_layers_lists_every_layer():
    p = script("profile_layers.py", "--backend", "native", "--net", "mlp128", "--steps", "2")
    assert p.returncode == 0, p.stderr
    assert "mlp128 on native:" in p.stdout
    for layer in ("fc1", "fc2", "fc3", "relu1", "relu2", "logsm", "nll"):
        assert f"{layer} forward" in p.stdout
    assert "fc1 backward_parameters" in p.stdout


def test_webgpu_plan_lists_a_step_without_running_it():
    """MLP-128's step: its three products' forward, data and filter passes (the first layer's data gradient pruned)
    and the updates of its six weights, listed with their grids (run on lavapipe where no GPU exists)."""
    p = script("webgpu_plan.py", "--net", "mlp128", "--batch", "16")
    if p.returncode != 0 and "BackendUnavailable" in p.stderr:
        import pytest

        pytest.skip(f"webgpu backend unavailable: {p.stderr.strip().splitlines()[-1]}")
    assert p.returncode == 0, p.stderr
    assert "# mlp128 at batch 16, webgpu fp32" in p.stdout
    rows = {line.split()[1]: line.split() for line in p.stdout.splitlines()[2:]}
    assert int(rows["momentum_update"][2]) == 6
    assert int(rows["gemm"][2]) >= 8  # 3 forward + 3 filter gradients + 2 data gradients, some split over K


def test_mapped_memory_trains_an_epoch_and_reports_its_peak(tmp_path):
    out = tmp_path / "row.json"
    p = script("mapped_memory.py", "--gb", "0.02", "--dir", str(tmp_path / "data"), "--json", str(out))
    assert p.returncode == 0, p.stderr
    row = json.loads(out.read_text())
    assert row["samples"] == 20_000_000 // (3 * 64 * 64) and row["file_bytes"] > row["samples"] * 3 * 64 * 64
    assert 50 << 20 < row["peak_resident_bytes"] < 2 << 30 and 0 <= row["accuracy_percent"] <= 100
    assert "peak resident" in p.stdout


def test_web_inference_times_leafpy_js_tfjs_and_onnxruntime_web_in_one_browser(tmp_path):
    """LeNet at batch 1 in headless Chromium: a row per framework, each output within float32 rounding of native's
    (the three rebuild one network from one set of weights: a wrong layout or weight order shows here)."""
    import pytest

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import web_inference

    why = web_inference.missing()
    if why:
        pytest.skip(f"{why} (CI installs no npm packages)")
    from tests.conftest import webgpu_offering

    webgpu_offering()  # the leafpy.js plans are recorded on the webgpu backend
    out = tmp_path / "rows.json"
    p = script("web_inference.py", "--nets", "lenet1", "--repeats", "1", "--warmup", "0", "--json", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert [r["framework"] for r in doc["rows"]] == ["leafpy.js", "tfjs-webgpu", "ort-web-webgpu"]
    for r in doc["rows"]:
        assert r["ms"] > 0 and r["adapter"]
        assert r["diff_native"] < 1e-4 and r["diff_leafpy_js"] < 1e-4
        assert f"lenet1        {r['framework']:<16}" in p.stdout
    assert doc["rows"][0]["ratio"] == 1.0
    assert "adapter: " + doc["adapter"]["name"] in p.stdout
