"""NegativeLogLikelihood's and SoftmaxCrossEntropy's options (reduction, ignore_index, class weights, [N, C, d...]
inputs) against a float64 NumPy reference written with loops, in files and through the command."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from test_user_paths import ROOT, _mlp_log_probabilities, failed_cleanly, leafpy

import leafpy as lp
from leafpy.errors import ConfigError, ShapeError
from leafpy.layers.loss.negative_log_likelihood import SoftmaxCrossEntropyConfig

C = 4
WEIGHTS = (0.5, 2.0, 1.0, 3.0)


def reference(logp: np.ndarray, labels: np.ndarray, weight, ignore_index, reduction) -> np.ndarray:
    """ONNX's and PyTorch's definition, one sample and position at a time."""
    n = logp.shape[0]
    lp3 = logp.reshape(n, C, -1)
    lab = labels.reshape(n, -1).astype(int)
    losses, total = np.zeros(lab.shape), 0.0
    for i, j in itertools.product(range(n), range(lab.shape[1])):
        k = lab[i, j]
        if k == ignore_index:
            continue
        w = weight[k] if weight else 1.0
        losses[i, j] = -w * lp3[i, k, j]
        total += w
    if reduction == "none":
        return losses.reshape(n, *logp.shape[2:])
    return np.array([losses.sum() / (total if reduction == "mean" else 1.0)])


def log_softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


OPTIONS = [dict(reduction=r, weight=w, ignore_index=i, shape=s)
           for r in ("mean", "sum", "none") for w in ((), WEIGHTS) for i in (None, 2, -1) for s in ((6, C), (3, C, 5))]


def _inputs(shape, ignore_index, seed=0):
    rng = np.random.default_rng(seed)
    scores = 3 * rng.standard_normal(shape)
    labels = rng.integers(0, C, (shape[0], *shape[2:])).astype(np.float64)
    if ignore_index is not None:
        labels.reshape(-1)[::4] = ignore_index
    return scores, labels


@pytest.mark.parametrize("o", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()).replace(" ", ""))
@pytest.mark.parametrize("loss", ["NegativeLogLikelihood", "SoftmaxCrossEntropy"])
def test_every_option_combination_matches_the_float64_reference(native64, loss, o):
    scores, labels = _inputs(o["shape"], o["ignore_index"])
    config_class = lp.NegativeLogLikelihoodConfig if loss == "NegativeLogLikelihood" else SoftmaxCrossEntropyConfig
    config = config_class(num_classes=C, reduction=o["reduction"], weight=o["weight"], ignore_index=o["ignore_index"])
    layer = lp.Layer.from_config(native64, lp.LayerConfig("loss", config))
    logp = log_softmax(scores) if loss == "SoftmaxCrossEntropy" else scores
    got = layer.forward([scores, labels])[0].to_numpy()
    np.testing.assert_allclose(got, reference(logp, labels, o["weight"], o["ignore_index"], o["reduction"]),
                               rtol=1e-12, atol=1e-12)
    if loss == "SoftmaxCrossEntropy":  # the gradient: (softmax - onehot) times the sample's weight over the divisor
        dloss = np.random.default_rng(1).standard_normal(got.shape)
        dx = layer.backward([dloss])[0].to_numpy()
        n, inner = scores.shape[0], int(np.prod(scores.shape[2:]))
        lab = labels.reshape(n, inner).astype(int)
        keep = lab != (o["ignore_index"] if o["ignore_index"] is not None else -99)
        w = np.where(keep, np.asarray(o["weight"] or (1.0,) * C)[np.where(keep, lab, 0)], 0.0)
        scale = dloss.reshape(n, inner) if o["reduction"] == "none" else dloss[0] / (
            w.sum() if o["reduction"] == "mean" else 1.0)
        onehot = np.zeros((n, C, inner))
        onehot[np.arange(n)[:, None], np.where(keep, lab, 0), np.arange(inner)[None, :]] = 1.0
        want = (np.exp(logp).reshape(n, C, inner) - onehot) * (w * scale)[:, None, :]
        np.testing.assert_allclose(dx.reshape(n, C, inner), want, rtol=1e-10, atol=1e-12)


def test_the_default_is_the_mean_over_the_batch_as_before(native64):
    scores, labels = _inputs((5, C), None)
    layer = lp.Layer.from_config(native64, lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=C)))
    got = layer.forward([scores, labels])[0].to_numpy()
    assert got.shape == (1,)
    assert got[0] == pytest.approx(-scores[np.arange(5), labels.astype(int)].mean(), rel=1e-12)


def test_softmax_cross_entropy_is_stable_for_large_scores(native64):
    scores = np.array([[1000.0, 0.0, -1000.0, 999.0]])
    layer = lp.Layer.from_config(native64, lp.LayerConfig("sce", SoftmaxCrossEntropyConfig(num_classes=C)))
    got = layer.forward([scores, np.array([[3.0]])])[0].to_numpy()
    assert got[0] == pytest.approx(1.0 + np.log1p(np.exp(-1.0)), rel=1e-12)
    assert np.isfinite(layer.backward([np.ones(1)])[0].to_numpy()).all()


@pytest.mark.parametrize("fields,words", [
    (dict(reduction="average"), ["reduction", "'mean', 'sum', 'none'", "average"]),
    (dict(weight=(1.0, 2.0)), ["weight", "one weight per class (4)", "got 2"]),
    (dict(weight=(1.0, -2.0, 1.0, 1.0)), ["weight[1]", "[0"]),
    (dict(ignore_index=1.5), ["ignore_index", "integer", "1.5"]),
])
def test_bad_options_are_config_errors_naming_the_field(fields, words):
    with pytest.raises(ConfigError) as e:
        lp.NegativeLogLikelihoodConfig(num_classes=C, **fields)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_label_out_of_range_is_refused_but_the_ignored_one_is_not(native64):
    config = lp.NegativeLogLikelihoodConfig(num_classes=C, ignore_index=-100)
    layer = lp.Layer.from_config(native64, lp.LayerConfig("nll", config))
    scores = np.zeros((2, C))
    assert np.isfinite(layer.forward([scores, np.array([1.0, -100.0])])[0].to_numpy()).all()
    with pytest.raises(ShapeError, match=r"label 1 is -1.0.*\[0, 3\] or ignore_index -100"):
        layer.forward([scores, np.array([1.0, -1.0])])


def test_labels_must_match_the_positions(native64):
    layer = lp.Layer.from_config(native64, lp.LayerConfig("nll", lp.NegativeLogLikelihoodConfig(num_classes=C)))
    with pytest.raises(ShapeError, match=r"labels of shape \[3, 5\] or \[3, 1, 5\]"):
        layer.forward([np.zeros((3, C, 5)), np.zeros((3, 4))])


@pytest.mark.parametrize("config", [
    lp.NegativeLogLikelihoodConfig(num_classes=C, reduction="none", ignore_index=-1, weight=WEIGHTS),
    SoftmaxCrossEntropyConfig(num_classes=C, reduction="sum", ignore_index=3, log_prob=True),
    lp.NegativeLogLikelihoodConfig(num_classes=C)])
def test_the_options_survive_a_model_file(tmp_path, config):
    net = lp.LayerConfig("net", lp.SequentialConfig(inputs=[("x", (2, C)), ("label", (2, 1))]))
    net.config.add_layer(lp.LayerConfig("loss", config))
    layer = lp.Layer.from_config(lp.backend("native"), net)
    layer.save(str(tmp_path / "m.leaf"))
    back = lp.Layer.load(lp.backend("native"), str(tmp_path / "m.leaf"))
    assert back.config.config.layers[0].config == config


def test_a_leaf_file_refuses_the_options_leaf_did_not_have(tmp_path):
    net = lp.LayerConfig("net", lp.SequentialConfig(inputs=[("x", (2, C)), ("label", (2, 1))]))
    net.config.add_layer(lp.LayerConfig("loss", lp.NegativeLogLikelihoodConfig(num_classes=C, reduction="sum")))
    layer = lp.Layer.from_config(lp.backend("native"), net)
    with pytest.raises(ConfigError, match="reduction 'sum'.*Leaf's NegativeLogLikelihood had no reduction"):
        layer.save(str(tmp_path / "m.leaf"), format="leaf")


def test_train_with_an_objective_that_ignores_a_class_and_weighs_another(tmp_path):
    run = (ROOT / "leafpy" / "configs" / "digits_mlp.yaml").read_text().replace(
        "objective: nll", "objective: {type: NegativeLogLikelihood, ignore_index: 3, weight: [1, 1, 1, 1, 1, 1, 1, "
        "1, 1, 2]}")
    (tmp_path / "run.yaml").write_text(run)
    p = leafpy(tmp_path, "train", "run.yaml", "--epochs", "1", "--out", "run")
    assert p.returncode == 0, p.stderr
    ds = lp.data.digits(0.2, 0)
    logp = _mlp_log_probabilities(tmp_path / "run" / "model.leaf", ds.x_test)
    y = ds.y_test.astype(int)
    picked = logp[np.arange(len(y)), y]
    w = np.where(y == 3, 0.0, np.where(y == 9, 2.0, 1.0))
    weighted, plain = -(w * picked).sum() / w.sum(), -picked.mean()
    test_loss = json.loads((tmp_path / "run" / "history.json").read_text())[0]["test_loss"]
    # the held-out loss is the weighted one (batch by batch, so not to the last digit), not the plain mean
    assert test_loss == pytest.approx(weighted, rel=2e-2)
    assert abs(test_loss - plain) > 10 * abs(test_loss - weighted)


def test_train_with_the_softmax_cross_entropy_objective_on_scores(tmp_path):
    run = (ROOT / "leafpy" / "configs" / "digits_mlp.yaml").read_text()
    run = run.replace("    - {name: logsm, type: LogSoftmax}\n", "").replace(
        "objective: nll", "objective: softmax_cross_entropy")
    (tmp_path / "run.yaml").write_text(run)
    p = leafpy(tmp_path, "train", "run.yaml", "--epochs", "2", "--out", "run")
    assert p.returncode == 0, p.stderr
    record = json.loads((tmp_path / "run" / "history.json").read_text())[-1]
    assert record["test_accuracy"] > 0.8, record


def test_an_objective_with_reduction_none_is_refused_before_training(tmp_path):
    run = (ROOT / "leafpy" / "configs" / "digits_mlp.yaml").read_text().replace(
        "objective: nll", "objective: {type: NegativeLogLikelihood, reduction: none}")
    (tmp_path / "run.yaml").write_text(run)
    p = leafpy(tmp_path, "train", "run.yaml", "--epochs", "1", "--out", "run")
    failed_cleanly(p, "reduction 'none'", "one loss per sample", "use reduction mean")


@pytest.mark.parametrize("backend", ["native", pytest.param("cuda", marks=pytest.mark.cuda),
                                     pytest.param("webgpu", marks=pytest.mark.webgpu)])
@pytest.mark.parametrize("loss", ["NegativeLogLikelihood", "SoftmaxCrossEntropy"])
def test_a_batch_whose_every_label_is_ignored_has_a_nan_mean_and_a_zero_gradient(backend, loss):
    """Every label ignore_index, reduction mean: the loss is NaN (0 / 0, as in PyTorch and ONNX) and the input
    gradient is 0, as PyTorch gives it (before: NaN in class 0 for NegativeLogLikelihood, a label the samples never
    had, and NaN everywhere for SoftmaxCrossEntropy). A counted label whose class weight is 0 still gives NaN at that
    label, as PyTorch's does."""
    from conftest import backend_or_skip

    be = backend_or_skip(backend)
    config_class = lp.NegativeLogLikelihoodConfig if loss == "NegativeLogLikelihood" else SoftmaxCrossEntropyConfig
    scores = np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)
    layer = lp.Layer.from_config(be, lp.LayerConfig("loss", config_class(num_classes=3, ignore_index=2)))
    assert np.isnan(layer.forward([scores, np.array([[2.0], [2.0]], np.float32)])[0].to_numpy()).all()
    np.testing.assert_array_equal(layer.backward([np.ones(1, np.float32)])[0].to_numpy(), np.zeros((2, 3)))
    weighted = lp.Layer.from_config(be, lp.LayerConfig("loss", config_class(num_classes=3, weight=[1.0, 1.0, 0.0])))
    weighted.forward([scores, np.array([[2.0], [2.0]], np.float32)])
    dx = weighted.backward([np.ones(1, np.float32)])[0].to_numpy()
    assert np.isnan(dx[:, 2]).all()


@pytest.mark.parametrize("options,weights", [("", None), (", ignore_index: 3, weight: [1, 1, 1, 1, 1, 1, 1, 1, 1, 2]",
                                                          (3, 9, 2.0))])
def test_a_summing_objectives_held_out_loss_is_the_mean_whatever_the_batch_size(tmp_path, options, weights):
    """An objective with reduction sum (the NaN-loss message suggests it): its held-out loss is the (weighted) mean
    over the held-out samples at any evaluation batch size (before, 9.69, 2.12 and 109.03 at batch sizes 32, 7
    and 359: each batch's sum was multiplied by its size), against float64 NumPy from the saved model."""
    run = (ROOT / "leafpy" / "configs" / "digits_mlp.yaml").read_text().replace(
        "objective: nll", f"objective: {{type: NegativeLogLikelihood, reduction: sum{options}}}").replace(
        "base_lr: 0.05", "base_lr: 0.002")
    (tmp_path / "run.yaml").write_text(run)
    p = leafpy(tmp_path, "train", "run.yaml", "--epochs", "1", "--out", "run")
    assert p.returncode == 0, p.stderr
    ds = lp.data.digits(0.2, 0)
    y = ds.y_test.astype(int)
    picked = _mlp_log_probabilities(tmp_path / "run" / "model.leaf", ds.x_test)[np.arange(len(y)), y]
    w = np.ones(len(y)) if weights is None else np.where(y == weights[0], 0.0, np.where(y == weights[1],
                                                                                        weights[2], 1.0))
    want = -(w * picked).sum() / w.sum()
    for batch in ("7", "32", "359"):
        e = leafpy(tmp_path, "evaluate", "run", "--set", f"data.batch_size={batch}")
        assert e.returncode == 0, e.stderr
        got = float(e.stdout.split("held-out loss: ")[1].split()[0])
        assert got == pytest.approx(want, rel=1e-5), (batch, got, want)
