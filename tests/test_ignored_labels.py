"""Labels the objective does not count (NegativeLogLikelihood's ignore_index, class weights of 0) in a user's npz
file, through the leafpy command: accepted among the labels whatever their value, left out of the classes, of the
held-out scores (checked against the predictions, counted in NumPy) and named when a batch counts none of its
samples."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_user_paths import failed_cleanly, leafpy

RUN = """
name: ignored
data: {{dataset: npz, path: blobs.npz, batch_size: {batch}}}
network:
  type: Sequential
  inputs: [{{name: data, shape: [{batch}, 4]}}]
  layers:
    - {{name: fc, type: Linear, output_size: 3}}
    - {{name: logsm, type: LogSoftmax}}
objective:
  type: Sequential
  inputs: [{{name: network_out, shape: [{batch}, 3]}}, {{name: label, shape: [{batch}, 1]}}]
  layers:
    - {{name: nll, type: NegativeLogLikelihood, num_classes: 3{options}}}
solver: {{solver: adam, base_lr: 0.05, seed: 0}}
train: {{epochs: 3}}
"""


def _blobs(tmp_path, ignored: int | None, every: int = 7) -> dict:
    """Three separable classes of four features, a fixed split; every ``every``-th label replaced by ``ignored``."""
    rng = np.random.default_rng(3)
    centres = np.array([[4, 0, 0, 0], [0, 4, 0, 0], [0, 0, 4, 0]], np.float32)
    arrays = {}
    for part, n in (("train", 300), ("test", 90)):
        y = rng.integers(0, 3, n)
        arrays[f"x_{part}"] = (centres[y] + rng.standard_normal((n, 4))).astype(np.float32)
        if ignored is not None:
            y[::every] = ignored
        arrays[f"y_{part}"] = y
    np.savez(tmp_path / "blobs.npz", **arrays)
    return arrays


@pytest.mark.parametrize("ignored", [3, -1, 255])
def test_labels_equal_to_ignore_index_train_and_are_left_out_of_the_scores(tmp_path, ignored):
    arrays = _blobs(tmp_path, ignored)
    (tmp_path / "run.yaml").write_text(RUN.format(batch=16, options=f", ignore_index: {ignored}"))
    p = leafpy(tmp_path, "train", "run.yaml", "--out", "run")
    assert p.returncode == 0, p.stderr
    reported = float(re.findall(r"held-out accuracy: ([\d.]+)%", p.stdout)[-1]) / 100
    # the held-out accuracy over the counted labels only, from the model's own predictions
    np.savez(tmp_path / "x_test.npz", x=arrays["x_test"])
    q = leafpy(tmp_path, "predict", "run", "--input", "x_test.npz", "--out", "p.npz")
    assert q.returncode == 0, q.stderr
    with np.load(tmp_path / "p.npz") as f:
        predicted = f["classes"]
    y = arrays["y_test"]
    keep = y != ignored
    assert keep.sum() < len(y)
    assert reported == pytest.approx(float((predicted[keep] == y[keep]).mean()), abs=1e-4)
    assert reported > 0.9
    e = leafpy(tmp_path, "evaluate", "run")
    assert e.returncode == 0, e.stderr
    assert f"held-out accuracy: {reported:.2%}" in e.stdout, e.stdout
    m = re.search(r"held-out loss: ([\d.]+)", e.stdout)
    assert m and 0 < float(m.group(1)) < 0.5, e.stdout  # a mean over the counted samples: finite


def test_labels_past_the_classes_without_ignore_index_are_still_refused(tmp_path):
    _blobs(tmp_path, 3)
    (tmp_path / "run.yaml").write_text(RUN.format(batch=16, options=""))
    failed_cleanly(leafpy(tmp_path, "train", "run.yaml", "--out", "run"), "labels go up to 3", "num_classes 3")
    _blobs(tmp_path, -1)
    failed_cleanly(leafpy(tmp_path, "train", "run.yaml", "--out", "run"), "is -1", "labels must be class indices")


@pytest.mark.parametrize("options,says", [(", ignore_index: 3", "every label of this batch is ignore_index 3"),
                                          (", weight: [1, 0, 0]", "of a class whose weight is 0")])
def test_a_batch_that_counts_no_sample_is_named_as_the_cause_of_its_nan_loss(tmp_path, options, says):
    _blobs(tmp_path, 3 if "ignore" in options else None, every=1)  # every label ignored
    (tmp_path / "run.yaml").write_text(RUN.format(batch=1, options=options))
    failed_cleanly(leafpy(tmp_path, "train", "run.yaml", "--out", "run"), "the loss became nan", says,
                   "reduction: sum")


@pytest.mark.parametrize("options", [", ignore_index: -1", ", ignore_index: -1, weight: [1, 3, 0.5]"])
def test_two_ranks_with_ignored_labels_train_as_one_process_at_twice_the_batch(tmp_path, options):
    """Each rank's mean divides by its own counted labels' weights: the ranks weigh their gradients and losses by
    those, so two ranks at batch 4 equal one process at 8, shares that count no label included."""
    import os
    import shutil
    import subprocess
    import sys

    from conftest import child_env

    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("needs mpiexec (pip install 'leafpy-dl[dist]': mpi4py, mpich)")
    pytest.importorskip("mpi4py")
    arrays = _blobs(tmp_path, None)
    rng = np.random.default_rng(11)
    y = arrays["y_train"]
    y[rng.random(len(y)) < 0.45] = -1
    np.savez(tmp_path / "blobs.npz", **{**arrays, "y_train": y})
    # (the shuffled order of epoch 0: some rank's share of 4 counts no label, no global batch of 8 is all ignored)
    shares = y[np.random.default_rng([0, 0]).permutation(len(y))][:len(y) // 8 * 8].reshape(-1, 2, 4)
    assert ((shares == -1).all(axis=2)).any() and not (shares == -1).all(axis=(1, 2)).any()
    (tmp_path / "run.yaml").write_text(RUN.format(batch=8, options=options).replace("adam", "momentum")
                                       .replace("base_lr: 0.05", "base_lr: 0.05, momentum: 0.9"))
    env = child_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    one = leafpy(tmp_path, "train", "run.yaml", "--epochs", "1", "--out", "one")
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "leafpy", "train", "run.yaml", "--epochs", "1", "--out", "two",
                          "--set", "data.batch_size=4", "--nproc", "2"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert two.returncode == 0, two.stderr
    import leafpy as lp

    a, b = (lp.Layer.load(lp.backend("native"), str(tmp_path / d / "model.leaf")) for d in ("one", "two"))
    for wa, wb in zip(a.learnable_weights_data(), b.learnable_weights_data()):
        np.testing.assert_allclose(wb.to_numpy(), wa.to_numpy(), rtol=1e-4, atol=1e-5)
    import json

    h1, h2 = (json.loads((tmp_path / d / "history.json").read_text())[0] for d in ("one", "two"))
    assert h2["loss"] == pytest.approx(h1["loss"], rel=1e-4) and h2["test_loss"] == pytest.approx(h1["test_loss"])


def test_a_summed_objective_on_two_ranks_is_refused_naming_the_layer(tmp_path):
    """The ranks average their gradients (each a mean over its share): a sum-reduced loss would train with 1/N of
    its gradient, so the run is refused before training, on every rank, with one clear message."""
    import os
    import shutil
    import subprocess
    import sys

    from conftest import child_env

    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("needs mpiexec (pip install 'leafpy-dl[dist]': mpi4py, mpich)")
    pytest.importorskip("mpi4py")
    _blobs(tmp_path, None)
    (tmp_path / "run.yaml").write_text(RUN.format(batch=8, options=", reduction: sum"))
    two = subprocess.run([sys.executable, "-m", "leafpy", "train", "run.yaml", "--epochs", "1", "--out", "two",
                          "--nproc", "2"], cwd=tmp_path, env=child_env(OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, timeout=300)
    assert two.returncode != 0 and "Traceback" not in two.stderr, two.stderr
    assert "objective layer 'nll': reduction 'sum' on 2 ranks" in two.stderr, two.stderr
    assert not (tmp_path / "two" / "model.leaf").exists()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_an_ignored_label_whose_row_holds_minus_infinity_counts_nothing(reduction):
    """The ignored label's loss was the weight 0 times the row's entry at class 0, and 0 * -inf is NaN: one masked
    row (log-probability -inf) made the batch's loss NaN, which a run takes for divergence. An ignored label counts
    nothing whatever its row holds: the loss is log 2 from the other row (PyTorch's value), its gradient 0."""
    import leafpy as lp

    cfg = lp.SequentialConfig(inputs=[("logp", [2, 2]), ("label", [2, 1])])
    cfg.add_layer(lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=2, ignore_index=-1,
                                                                       reduction=reduction)))
    net = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("objective", cfg), seed=0)
    net.require_input_gradients([True, False])
    logp = np.array([[-np.inf, 0.0], [np.log(0.5), np.log(0.5)]], np.float32)
    loss = net.forward([logp, np.array([[-1], [0]], np.float32)])[0].to_numpy()
    want = {"mean": [np.log(2)], "sum": [np.log(2)], "none": [0.0, np.log(2)]}[reduction]
    np.testing.assert_allclose(loss.reshape(-1), want, rtol=1e-6)
    dx = net.backward([np.ones(loss.shape, np.float32)])[0].to_numpy()
    np.testing.assert_array_equal(dx[0], [0.0, 0.0])
    assert np.isfinite(dx).all()
