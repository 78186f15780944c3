"""The activations LeakyReLU, ELU, GELU (erf and tanh forms), Softplus and SiLU on every backend, against float64
references written here from their definitions; their webgpu fusion into the preceding GEMM; configs, files and
a run of the leafpy command. (Central-difference gradient checks of every layer: test_gradients.py.)"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import backend_or_skip, child_env

import leafpy as lp

ROOT = Path(__file__).resolve().parent.parent

BACKENDS = [
    pytest.param(("native", {}), id="native"),
    pytest.param(("cuda", {}), id="cuda", marks=pytest.mark.cuda),
    pytest.param(("webgpu", {}), id="webgpu", marks=pytest.mark.webgpu),
]


@pytest.fixture(params=BACKENDS)
def be(request):
    name, options = request.param
    return backend_or_skip(name, **options)


# --- float64 references: (f(x), f'(x)) ---------------------------------------------------------------------------
_erf = np.vectorize(math.erf)


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def leaky_relu(x, negative_slope=0.01):
    return np.where(x > 0, x, negative_slope * x), np.where(x > 0, 1.0, negative_slope)


def elu(x, alpha=1.0):
    neg = np.minimum(x, 0.0)
    return np.where(x > 0, x, alpha * (np.exp(neg) - 1.0)), np.where(x > 0, 1.0, alpha * np.exp(neg))


def gelu(x):
    pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2)))
    return x * cdf, cdf + x * pdf


def gelu_tanh(x):
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    du = math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x ** 2)
    with np.errstate(over="ignore"):  # cosh(u) = inf: sech^2 = 0
        sech2 = 1.0 / np.cosh(u) ** 2
    return 0.5 * x * (1 + np.tanh(u)), 0.5 * (1 + np.tanh(u)) + 0.5 * x * du * sech2


def softplus(x, beta=1.0, threshold=20.0):
    bx = beta * x
    with np.errstate(over="ignore"):
        soft = np.log1p(np.exp(np.minimum(bx, 700))) / beta
    return np.where(bx > threshold, x, soft), np.where(bx > threshold, 1.0, _sig(bx))


def silu(x):
    e = np.exp(-x)
    return x / (1 + e), (1 + e + x * e) / (1 + e) ** 2


# (layer config, reference, inputs: a spread of values including large ones)
def _spread(rng, n=600, scale=3.0):
    x = np.concatenate([rng.standard_normal(n) * scale, np.linspace(-30, 30, 61), [-1e-3, 1e-3, 0.5, -0.5]])
    return x.reshape(-1, 1)


CASES = {
    "LeakyReLU": (lp.LeakyReLUConfig(), leaky_relu),
    "LeakyReLU-0.3": (lp.LeakyReLUConfig(negative_slope=0.3), lambda x: leaky_relu(x, 0.3)),
    "ELU": (lp.ELUConfig(), elu),
    "ELU-0.5": (lp.ELUConfig(alpha=0.5), lambda x: elu(x, 0.5)),
    "GELU": (lp.GELUConfig(), gelu),
    "GELU-tanh": (lp.GELUConfig(approximate="tanh"), gelu_tanh),
    "Softplus": (lp.SoftplusConfig(), softplus),
    "Softplus-2-3": (lp.SoftplusConfig(beta=2.0, threshold=3.0), lambda x: softplus(x, 2.0, 3.0)),
    "SiLU": ("SiLU", silu),
    "Clip": (lp.ClipConfig(), lambda x: (np.clip(x, 0.0, 6.0), ((x > 0.0) & (x < 6.0)).astype(float))),
    "Clip-hardtanh": (lp.ClipConfig(lower=-1.0, upper=1.0),
                      lambda x: (np.clip(x, -1.0, 1.0), ((x > -1.0) & (x < 1.0)).astype(float))),
    "Swish": ("Swish", silu),  # SiLU's other name
}


def close(a, b, what, rtol=1e-5, atol=2e-6):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_gradient_match_the_definition(be, name):
    config, reference = CASES[name]
    rng = np.random.default_rng(0)
    x = _spread(rng)
    dy = rng.standard_normal(x.shape)
    layer = lp.Layer.from_config(be, lp.LayerConfig("act", config))
    y = layer.forward([x.astype(np.float32)])[0].to_numpy()
    dx = layer.backward([dy.astype(np.float32)])[0].to_numpy()
    ref_y, ref_grad = reference(x)
    close(y, ref_y, f"{name} forward")
    close(dx, dy * ref_grad, f"{name} gradient", atol=1e-5)  # 1 - tanh^2 and the like lose digits in float32


def test_softplus_is_linear_above_its_threshold(be):
    # beta x just below and just above the threshold: log(1 + exp(beta x)) / beta below, x above
    layer = lp.Layer.from_config(be, lp.LayerConfig("sp", lp.SoftplusConfig(beta=2.0, threshold=1.0)))
    x = np.array([[0.45, 0.499, 0.501, 0.55, 40.0, -40.0]], np.float32)
    y = layer.forward([x])[0].to_numpy()
    expected = [math.log1p(math.exp(0.9)) / 2, math.log1p(math.exp(0.998)) / 2, 0.501, 0.55, 40.0,
                math.log1p(math.exp(-80.0)) / 2]
    close(y[0], expected, "softplus around the threshold")
    dx = layer.backward([np.ones_like(x)])[0].to_numpy()
    close(dx[0], [1 / (1 + math.exp(-0.9)), 1 / (1 + math.exp(-0.998)), 1.0, 1.0, 1.0, 0.0], "its gradient")


@pytest.mark.parametrize("layer", ["Sigmoid", "SiLU"])
def test_sigmoid_and_silu_keep_their_relative_precision_in_the_negative_tail(be, layer):
    """Where sigmoid(x) is tiny (x down to -80, near float32's smallest normal numbers) each value within a few
    units in the last place of float64's: 0.5 (1 + tanh(x / 2)) cancels to nothing by x = -17 in float32. (WGSL
    lets exp be off by 3 + 2 |x| units in the last place: webgpu within 2e-5.)"""
    x = np.linspace(-80, 30, 2201).reshape(-1, 1)
    config = lp.LayerConfig("s", layer)
    net = lp.Layer.from_config(be, config)
    y = net.forward([x.astype(np.float32)])[0].to_numpy().astype(np.float64)
    sig = 1.0 / (1.0 + np.exp(-x))
    ref = sig if layer == "Sigmoid" else x * sig
    bound = 2e-5 if be.name == "webgpu" else 5e-6
    err = np.abs(y - ref) / np.maximum(np.abs(ref), 1e-30)  # (SiLU(0) = 0)
    assert err.max() < bound, f"worst relative error {err.max():.3g} at x = {x.flat[int(np.argmax(err))]}"
    dx = net.backward([np.ones_like(x, np.float32)])[0].to_numpy().astype(np.float64)
    ref_grad = sig * (1 - sig) if layer == "Sigmoid" else sig * (1 + x * (1 - sig))
    tail = x < -2  # (where the gradient is no difference of nearly equal values)
    err = np.abs(dx - ref_grad)[tail] / np.abs(ref_grad)[tail]
    assert err.max() < bound, f"worst relative error of the gradient {err.max():.3g}"


def test_gelu_erf_is_accurate_to_a_millionth(be):
    """The erf form against math.erf on a dense grid: within 1e-6 absolute (relative beyond |GELU| = 1). WGSL has
    no erf: webgpu runs Numerical Recipes' erfc fit."""
    x = np.linspace(-8, 8, 32001).reshape(-1, 1)
    layer = lp.Layer.from_config(be, lp.LayerConfig("g", lp.GELUConfig()))
    y = layer.forward([x.astype(np.float32)])[0].to_numpy().astype(np.float64)
    ref = x * 0.5 * (1 + _erf(x / math.sqrt(2)))
    err = np.abs(y - ref) / np.maximum(1.0, np.abs(ref))
    assert err.max() < 1e-6, f"worst error {err.max():.3g} at x = {x.flat[int(np.argmax(err))]}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_in_a_network_between_linear_layers(be, name):
    """Linear -> activation -> Linear, forward and backward, against NumPy float64 with the network's weights:
    the in-place activations (LeakyReLU, ELU) overwrite the product, the others must leave it for their
    gradient."""
    config, reference = CASES[name]
    cfg = lp.SequentialConfig(inputs=[("data", [5, 7])], force_backward=True)
    cfg.add_layer(lp.LayerConfig("fc1", lp.LinearConfig(output_size=6)))
    cfg.add_layer(lp.LayerConfig("act", config))
    cfg.add_layer(lp.LayerConfig("fc2", lp.LinearConfig(output_size=3)))
    net = lp.Layer.from_config(be, lp.LayerConfig("net", cfg), seed=2)
    rng = np.random.default_rng(1)
    w1, b1, w2, b2 = (w.to_numpy().astype(np.float64) for w in net.learnable_weights_data())
    b1 = b1 + rng.standard_normal(b1.shape)  # nonzero biases: the bias add takes part
    net.learnable_weights_data()[1].set(b1.astype(np.float32))
    x = rng.standard_normal((5, 7)) * 2
    dout = rng.standard_normal((5, 3))
    out = net.forward([x.astype(np.float32)])[0].to_numpy()
    dx = net.backward([dout.astype(np.float32)])[0].to_numpy()
    grads = [g.to_numpy() for g in net.learnable_weights_gradients()]
    h = x @ w1.T + b1
    a, da = reference(h)
    dh = (dout @ w2) * da
    close(out, a @ w2.T + b2, f"{name}: output", rtol=1e-4, atol=1e-5)
    close(dx, dh @ w1, f"{name}: input gradient", rtol=1e-4, atol=1e-5)
    close(grads[0], dh.T @ x, f"{name}: fc1 weight gradient", rtol=1e-4, atol=1e-5)
    close(grads[2], dout.T @ a, f"{name}: fc2 weight gradient", rtol=1e-4, atol=1e-5)


FIRST_LAYERS = {  # (the layer before the activation, input shape)
    "linear": (lp.LinearConfig(output_size=13), (9, 11)),
    "conv": (lp.ConvolutionConfig(num_output=3, filter_shape=[3], padding=[1]), (2, 2, 5, 5)),
    "winograd": (lp.ConvolutionConfig(num_output=4, filter_shape=[3], padding=[1]), (2, 4, 5, 5)),
}


@pytest.mark.webgpu
@pytest.mark.parametrize("first", sorted(FIRST_LAYERS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_webgpu_activation_joins_the_gemm_store(name, first):
    """On webgpu a Linear layer's or a convolution's product, its bias and the activation are one kernel (the
    activation computed in the implicit GEMM's store, in place or beside the product; after a Winograd output
    transform, in place only), and equal native's."""
    config = CASES[name][0]
    layer, shape = FIRST_LAYERS[first]
    wg = backend_or_skip("webgpu", power_preference="low-power")
    wg.WINOGRAD_MIN_CHANNELS = 4 if first == "winograd" else 64
    cfg = lp.SequentialConfig(inputs=[("data", list(shape))], force_backward=True)
    cfg.add_layer(lp.LayerConfig("first", layer))
    cfg.add_layer(lp.LayerConfig("act", config))
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    results = []
    for be in (lp.backend("native"), wg):
        net = lp.Layer.from_config(be, lp.LayerConfig("net", cfg), seed=4)
        bias = net.learnable_weights_data()[1]
        bias.set(np.linspace(-1, 1, bias.shape[0], dtype=np.float32))
        dy = np.random.default_rng(5).standard_normal(net.forward([x])[0].shape).astype(np.float32)
        net.backward([dy])  # first runs: uploads and scratch
        encoded = []
        if be is wg:
            wg.flush()
            real = wg._encode
            wg._encode = lambda d: (encoded.append(d.entry), real(d))
        try:
            out = net.forward([x])[0]
            if be is wg:
                wg.flush()
        finally:
            if be is wg:
                del wg._encode
        dx = net.backward([dy])[0].to_numpy()
        results.append((out.to_numpy(), dx, [g.to_numpy() for g in net.learnable_weights_gradients()]))
    if first == "winograd":  # an activation that keeps the product runs on its own
        separate = [e for e in encoded if not e.startswith(("winograd", "gemm")) and e != "copy"]
        assert "winograd_output" in encoded and len(separate) == (0 if _in_place(config) else 1), encoded
    else:
        assert [e for e in encoded if e != "copy"] == ["gemm"], encoded
    (y1, dx1, g1), (y2, dx2, g2) = results
    close(y2, y1, f"{name}: output", rtol=1e-4, atol=1e-5)
    close(dx2, dx1, f"{name}: input gradient", rtol=1e-4, atol=1e-5)
    for a, b in zip(g2, g1):
        # Winograd's filter gradient rounds relative to the gradient's largest terms, not to each element: on an
        # H100, F(4x4, 3x3)'s was 3e-6 of the largest value off in a small element (the cuda backend admits 2^-12)
        atol = 2.0**-16 * float(np.abs(b).max()) if first == "winograd" else 0.0
        close(a, b, f"{name}: weight gradient", rtol=1e-4, atol=max(1e-5, atol))


def _in_place(config) -> bool:
    """Whether the activation runs in place (its gradient reads its output)."""
    layer = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("a", config))
    return layer.worker.in_place


@pytest.mark.parametrize("spec", BACKENDS)
def test_a_new_formula_is_one_table_line(spec, monkeypatch):
    """A line added to the pointwise table runs on a backend made afterwards, in and out of place, and (webgpu)
    in the GEMM's store, with nothing else written for it: f(x) = a x^2 with its gradient 2 a x dy."""
    from leafpy.backends import pointwise as pw

    name, options = spec

    a = pw.param("a")
    monkeypatch.setitem(pw.TABLE, "scaled_square", pw.Pointwise("scaled_square", a * pw.X * pw.X,
                                                                 pw.DY * (2.0 * a) * pw.X, ("a",)))
    fresh = {"native": {"dtype": "float32"}, "cuda": {"device": 0}, "webgpu": {"power_preference": "low-power"}}
    be = backend_or_skip(name, **options, **fresh[name])  # with options: a new instance, not the shared one
    rng = np.random.default_rng(6)
    x, dy = rng.standard_normal((2, 37)).astype(np.float32)
    tx, ty, tdy = lp.SharedTensor.from_numpy(x), lp.SharedTensor((37,)), lp.SharedTensor.from_numpy(dy)
    be.activation("scaled_square", tx.read(be), ty.write(be), (1.5,))
    close(ty.to_numpy(), 1.5 * x * x, "out of place")
    be.activation_grad("scaled_square", tx.read(be), tdy.read(be), tdy.read_write(be), (1.5,))
    close(tdy.to_numpy(), 3.0 * x * dy, "gradient in place")
    be.activation("scaled_square", tx.read(be), tx.read_write(be), (-2.0,))
    close(tx.to_numpy(), -2.0 * x * x, "in place")
    if name == "webgpu":  # joins the store of the GEMM that wrote its input
        w = rng.standard_normal((5, 37)).astype(np.float32)
        prod, out = lp.SharedTensor((1, 5)), lp.SharedTensor((1, 5))
        be.gemm(lp.SharedTensor.from_numpy(x.reshape(1, 37)).read(be), False, lp.SharedTensor.from_numpy(w).read(be),
                True, prod.write(be))
        before = be.dispatches
        be.activation("scaled_square", prod.read(be), out.write(be), (0.5,))
        assert be.dispatches == before
        close(out.to_numpy(), 0.5 * (x.reshape(1, 37) @ w.T) ** 2, "fused", rtol=1e-4, atol=1e-5)
        close(prod.to_numpy(), x.reshape(1, 37) @ w.T, "the product kept", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make,field", [
    (lambda: lp.LeakyReLUConfig(negative_slope=-0.1), "LeakyReLUConfig.negative_slope"),
    (lambda: lp.LeakyReLUConfig(negative_slope="a"), "LeakyReLUConfig.negative_slope"),
    (lambda: lp.ELUConfig(alpha=-1.0), "ELUConfig.alpha"),
    (lambda: lp.ELUConfig(alpha=float("nan")), "ELUConfig.alpha"),
    (lambda: lp.GELUConfig(approximate="erf"), "GELUConfig.approximate"),
    (lambda: lp.SoftplusConfig(beta=0.0), "SoftplusConfig.beta"),
    (lambda: lp.SoftplusConfig(threshold=float("inf")), "SoftplusConfig.threshold"),
])
def test_bad_parameters_name_the_field(make, field):
    with pytest.raises(lp.ConfigError, match=re.escape(field)):
        make()


def test_yaml_names_and_bad_fields():
    layer = lp.config.layer_from_dict({"name": "g", "type": "GELU", "approximate": "tanh"})
    assert layer.config == lp.GELUConfig(approximate="tanh")
    assert lp.config.layer_from_dict({"name": "s", "type": "SiLU"}).type == "SiLU"
    for d in ({"name": "l", "type": "LeakyReLU", "negative_slope": 0.2}, {"name": "e", "type": "ELU", "alpha": 2},
              {"name": "p", "type": "Softplus", "beta": 2, "threshold": 10}):
        assert lp.config.layer_to_dict(lp.config.layer_from_dict(d)) == d
    with pytest.raises(lp.ConfigError, match=r"approximate: expected one of 'none', 'tanh', got 'fast'"):
        lp.config.layer_from_dict({"name": "g", "type": "GELU", "approximate": "fast"})
    with pytest.raises(lp.ConfigError, match="unknown key 'slope' for a LeakyReLU layer"):
        lp.config.layer_from_dict({"name": "l", "type": "LeakyReLU", "slope": 0.2})


def test_a_network_with_all_five_saves_and_loads(tmp_path):
    native = lp.backend("native")
    cfg = lp.SequentialConfig(inputs=[("data", [4, 6])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=8)))
    for name, config in (("leaky", lp.LeakyReLUConfig(negative_slope=0.2)), ("elu", lp.ELUConfig(alpha=0.5)),
                         ("gelu", lp.GELUConfig(approximate="tanh")), ("erf", lp.GELUConfig()),
                         ("soft", lp.SoftplusConfig(beta=2.0, threshold=5.0)), ("silu", "SiLU"),
                         ("swish", "Swish")):
        cfg.add_layer(lp.LayerConfig(name, config))
    net = lp.Layer.from_config(native, lp.LayerConfig("net", cfg), seed=1)
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    y = net.forward([x])[0].to_numpy()
    net.save(tmp_path / "net.leaf")
    loaded = lp.Layer.load(native, tmp_path / "net.leaf")
    assert loaded.config == net.config
    assert [lc.config for lc in loaded.config.config.layers[1:]] == [lc.config for lc in cfg.layers[1:]]
    close(loaded.forward([x])[0].to_numpy(), y, "loaded network", rtol=0, atol=0)


GELU_RUN = """
name: digits-gelu
data: {dataset: digits, batch_size: 32, test_fraction: 0.2, seed: 0}
train: {epochs: 6}
network:
  type: Sequential
  inputs: [{name: data, shape: [32, 1, 8, 8]}]
  layers:
    - {name: flat, type: Flatten}
    - {name: fc1, type: Linear, output_size: 64}
    - {name: act1, type: GELU}
    - {name: fc2, type: Linear, output_size: 32}
    - {name: act2, type: SiLU}
    - {name: fc3, type: Linear, output_size: 10}
    - {name: logsm, type: LogSoftmax}
objective:
  type: Sequential
  inputs: [{name: network_out, shape: [32, 10]}, {name: label, shape: [32, 1]}]
  layers: [{name: nll, type: NegativeLogLikelihood, num_classes: 10}]
solver: {solver: momentum, base_lr: 0.05, momentum: 0.9, seed: 0}
"""


def test_leafpy_train_with_gelu_and_silu_learns_the_digits(tmp_path):
    pytest.importorskip("sklearn", reason="the digits data set comes with scikit-learn")
    run_file = tmp_path / "gelu.yaml"
    run_file.write_text(GELU_RUN)
    env = child_env()
    p = subprocess.run([sys.executable, "-m", "leafpy.cli", "train", str(run_file), "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr
    m = re.search(r"held-out accuracy: ([\d.]+)%", p.stdout)
    assert m, p.stdout
    assert float(m.group(1)) >= 93.0, p.stdout
    saved = lp.config.load(tmp_path / "run" / "run.yaml")
    assert [lc.type for lc in saved.network.config.layers][2:5] == ["GELU", "Linear", "SiLU"]


@pytest.mark.parametrize("device", [pytest.param("webgpu", marks=pytest.mark.webgpu),
                                    pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kind", ["Softmax", "LogSoftmax"])
def test_rows_of_values_below_minus_3e38_have_their_own_maximum(device, kind):
    """Rows of 100 classes (the long-row kernel) whose values all lie between float32's lowest and -3e38: the
    distribution of the float64 formula (webgpu started each thread's maximum at -3e38, every exp underflowed, and
    the rows came out NaN and inf)."""
    from conftest import backend_or_skip

    be = backend_or_skip(device)
    x = np.full((2, 100), -3.2e38, np.float32)
    x[:, ::2] = -3.3e38
    x[1] = np.linspace(-3.39e38, -3.1e38, 100, dtype=np.float32)
    z = x.astype(np.float64) - x.astype(np.float64).max(1, keepdims=True)
    want = z - np.log(np.exp(z).sum(1, keepdims=True))
    got = lp.Layer.from_config(be, lp.LayerConfig("l", kind)).forward([x])[0].to_numpy()
    assert np.isfinite(got).all()
    if kind == "Softmax":
        np.testing.assert_allclose(got, np.exp(want), atol=1e-6)
    else:  # (the log-probabilities of the values 1e37 below the maximum are -1e37: relative to their size)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
