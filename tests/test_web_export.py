"""leafpy in the browser, as a user gets there: ``lp.web.export`` / ``leafpy export --web`` write a folder, headless
Chromium (WebGPU on SwiftShader here) loads leafpy.js from a loopback server, and its predictions are compared with
the native backend's on the same weights; the demo page runs on an image; broken set-ups fail with clear errors.

Plans are recorded on the webgpu backend (lavapipe here), so these tests need it as well as /usr/bin/chromium."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from browser import Browser, find_chromium
from browser import BrowserError as PageError

import leafpy as lp
from tests.conftest import webgpu_offering
from tests.test_user_paths import leafpy
from tests.web_replay import CASES, network

pytestmark = [pytest.mark.browser, pytest.mark.skipif(find_chromium() is None, reason=(
    "no Chromium: apt-get install chromium (headless Chromium runs leafpy.js on WebGPU)"))]



def browser_predict(b: Browser, folder: str, x: np.ndarray, *, normalize: bool = False) -> tuple[np.ndarray, dict]:
    """load() the folder's model in the page, predict x; the output and what the model says of itself."""
    shape = list(x.shape)
    r = b.evaluate(f"""(async () => {{
        const {{load}} = await import("/{folder}/leafpy.js");
        const m = await load("/{folder}/model/");
        try {{
            let x = new Float32Array({json.dumps(x.reshape(-1).tolist())});
            if ({json.dumps(normalize)}) x = m.normalize(x, {shape});
            const y = await m.predict(x, {shape});
            return {{data: Array.from(y.data), shape: y.shape, adapter: m.adapterName, classes: m.classes}};
        }} finally {{ m.destroy(); }}
    }})()""")
    return np.asarray(r["data"], np.float32).reshape(r["shape"]), r


def page_error(b: Browser, script: str) -> str:
    """The message of the Error that ``script`` (the body of an async function) throws in the page."""
    try:
        b.evaluate(f"(async () => {{ {script} }})()")
    except PageError as e:
        return str(e)
    raise AssertionError(f"no error from {script}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    webgpu_offering()
    root = tmp_path_factory.mktemp("served")
    (root / "blank.html").write_text("<!doctype html><title>leafpy tests</title>")
    with Browser(root, timeout=120.0) as b:
        b.goto("blank.html")  # an http page: modules resolve from the served folder
        yield root, b


@pytest.fixture(scope="module")
def small_export(served):
    root, _ = served
    lp.web.export(network("small", *CASES["sigmoid_tanh"]), root / "small", batch_sizes=[4])
    return root / "small"


@pytest.mark.parametrize("case", list(CASES))
def test_each_layer_type_predicts_in_the_browser_as_native(served, case):
    root, b = served
    sample, layers = CASES[case]
    net = network(case, sample, layers)
    lp.web.export(net, root / case, batch_sizes=[1, 8, 32])
    worst = 0.0
    for n in (1, 5, 40):  # one plan; padded into the plan of 8; split 32 + 8
        x = np.random.default_rng(n).normal(0, 1, (n, *sample)).astype(np.float32)
        want = net.forward([x])[0].to_numpy()
        got, info = browser_predict(b, case, x)
        assert got.shape == want.shape
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)
        worst = max(worst, float(np.abs(got - want).max()))
    print(f"{case}: max |browser - native| = {worst:.3g} on {info['adapter']}")


def test_the_plan_names_buffers_by_what_they_hold_and_checks_its_files(small_export):
    doc = json.loads((small_export / "model" / "plan.json").read_text())
    assert [p["batch"] for p in doc["plans"]] == [1, 4]
    assert set(doc["weights"]["tensors"]) == {"fc1/weight", "fc1/bias", "fc2/weight", "fc2/bias"}
    bound = {b[0] for p in doc["plans"] for s in p["steps"] if "entry" in s for b in s["bindings"]}
    assert {"input", "output", "w:fc1/weight", "w:fc2/bias"} <= bound
    assert len(doc["weights"]["sha256"]) == 64 and all(len(m["sha256"]) == 64 for m in doc["modules"].values())
    assert (small_export / "model" / "weights.bin").stat().st_size == doc["weights"]["bytes"]


def test_a_browser_without_webgpu_or_without_an_adapter_gets_a_clear_error(served, small_export):
    _, b = served
    b.goto("small/index.html")
    no_gpu = page_error(b, """Object.defineProperty(navigator, "gpu", {value: undefined, configurable: true});
        const {load} = await import("/small/leafpy.js"); await load("/small/model/");""")
    assert "no WebGPU" in no_gpu and "navigator.gpu is missing" in no_gpu
    b.goto("small/index.html")
    no_adapter = page_error(b, """navigator.gpu.requestAdapter = async () => null;
        const {load} = await import("/small/leafpy.js"); await load("/small/model/");""")
    assert "found no GPU adapter" in no_adapter


def test_missing_or_damaged_model_files_are_named(served, small_export):
    root, b = served
    b.goto("small/index.html")
    broken = root / "broken"
    load = 'const {load} = await import("/broken/leafpy.js"); await load("/broken/model/");'
    for damage, words in [("flip", ["weights.bin", "damaged", "SHA-256"]), ("cut", ["weights.bin", "damaged",
                                                                                    "bytes"]),
                          ("no_wgsl", ["gemm.wgsl", "missing", "404"]), ("no_plan", ["plan.json", "missing"]),
                          ("bad_plan", ["plan.json", "damaged", "not JSON"])]:
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(small_export, broken)
        weights = broken / "model" / "weights.bin"
        data = bytearray(weights.read_bytes())
        if damage == "flip":
            data[5] ^= 0x40
            weights.write_bytes(bytes(data))
        elif damage == "cut":
            weights.write_bytes(bytes(data[:-4]))
        elif damage == "no_wgsl":
            (broken / "model" / "wgsl" / "gemm.wgsl").unlink()
        elif damage == "no_plan":
            (broken / "model" / "plan.json").unlink()
        else:
            (broken / "model" / "plan.json").write_text('{"format": "leafpy-web", "plans": [')
        message = page_error(b, load)
        for w in words:
            assert w in message, (damage, message)


def test_predict_refuses_a_shape_that_is_not_the_networks(served, small_export):
    _, b = served
    b.goto("small/index.html")
    message = page_error(b, """const {load} = await import("/small/leafpy.js"); const m = await load("/small/model/");
        await m.predict(new Float32Array(6), [1, 6]);""")
    assert "shape must be [N, 7]" in message and "[1,6]" in message


def test_an_export_with_fp16_plans_picks_what_the_adapter_runs_and_names_shader_f16(served):
    """SwiftShader offers no shader-f16: "auto" takes the float32 plans, and asking for fp16 is a clear error."""
    webgpu_offering("shader-f16")  # the fp16 plans are recorded on this machine's adapter
    root, b = served
    net = network("both", *CASES["sigmoid_tanh"])
    assert lp.web.export(net, root / "both", batch_sizes=[2], precision="both") == ["fp32", "fp16"]
    x = np.random.default_rng(0).normal(0, 1, (3, 7)).astype(np.float32)
    b.goto("blank.html")
    r = b.evaluate(f"""(async () => {{
        const has = (await navigator.gpu.requestAdapter({{powerPreference: "high-performance"}})).features
            .has("shader-f16");
        const {{load}} = await import("/both/leafpy.js");
        const m = await load("/both/model/");
        try {{
            const y = await m.predict(new Float32Array({json.dumps(x.reshape(-1).tolist())}), [3, 7]);
            return {{has, precision: m.precision, float32: y.data instanceof Float32Array, data: Array.from(y.data)}};
        }} finally {{ m.destroy(); }}
    }})()""")
    want = net.forward([x])[0].to_numpy()
    assert r["float32"] and r["precision"] == ("fp16" if r["has"] else "fp32"), r
    tol = 1e-2 if r["has"] else 1e-5
    np.testing.assert_allclose(np.asarray(r["data"], np.float32).reshape(want.shape), want, rtol=tol, atol=tol)
    if r["has"]:
        pytest.skip("this browser's adapter offers shader-f16: the error where it lacks it is not reachable here")
    message = page_error(b, """const {load} = await import("/both/leafpy.js");
        await load("/both/model/", {precision: "fp16"});""")
    assert '"shader-f16" feature' in message and 'precision: "auto"' in message, message
    message = page_error(b, """const {load} = await import("/both/leafpy.js");
        await load("/both/model/", {precision: "half"});""")
    assert 'precision must be one of "auto", "fp32", "fp16"' in message, message


@pytest.mark.parametrize("name", ["digits_resnet", "digits_lstm"])
def test_shipped_digits_networks_predict_in_the_browser_as_native(served, name):
    root, b = served
    run = lp.config.load(name)
    net = lp.Layer.from_config(lp.backend("native"), run.network, seed=0)
    net.set_training(False)
    lp.web.export(net, root / name, batch_sizes=[4])
    x = lp.data.digits().x_test[:6]
    want = net.forward([x])[0].to_numpy()
    got, _ = browser_predict(b, name, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


# --- the shipped digits LeNet, through the command line ----------------------------------------------------------
@pytest.fixture(scope="module")
def lenet_run(tmp_path_factory):
    webgpu_offering()
    cwd = tmp_path_factory.mktemp("lenet")
    p = leafpy(cwd, "train", "digits_lenet", "--epochs", "1", "--out", "run", timeout=300)
    assert p.returncode == 0, p.stderr
    return cwd


def test_digits_lenet_trained_exported_and_run_in_the_browser_predicts_as_leafpy_predict(served, lenet_run):
    root, b = served
    cwd = lenet_run
    x = lp.data.digits().x_test[:12]
    np.savez(cwd / "x.npz", x=x)
    p = leafpy(cwd, "predict", "run", "--input", "x.npz", "--out", "pred.npz")
    assert p.returncode == 0, p.stderr
    p = leafpy(cwd, "export", "--web", str(root / "lenet"), "run", "--batch-sizes", "8")
    assert p.returncode == 0, p.stderr
    want = np.load(cwd / "pred.npz")["outputs"]
    got, _ = browser_predict(b, "lenet", x, normalize=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))
    print(f"digits LeNet: max |browser - leafpy predict| = {float(np.abs(got - want).max()):.3g}")


def test_demo_page_classifies_a_dropped_digit_and_shows_the_time(served, lenet_run):
    """The trained LeNet without its LogSoftmax (the page takes the softmax of scores), on a digit drawn large."""
    from PIL import Image

    root, b = served
    trained = lp.Layer.load(lp.backend("native"), str(lenet_run / "run" / "model.leaf"))
    cfg = lp.config.load(str(lenet_run / "run" / "run.yaml")).network
    layers = cfg.config.layers[:-1]
    scores_cfg = lp.LayerConfig(cfg.name, lp.SequentialConfig(inputs=[("data", [1, 1, 8, 8])]))
    for layer in layers:
        scores_cfg.config.add_layer(layer)
    net = lp.Layer.from_config(lp.backend("native"), scores_cfg)
    net.load_weights(trained.named_weights())
    net.set_training(False)  # the network has a Dropout layer; the page runs in inference mode
    lp.web.export(net, root / "demo")
    digit = lp.data.digits().x_test[0]
    Image.fromarray((digit.reshape(8, 8) * 255).astype(np.uint8), "L").resize((96, 96), Image.NEAREST).save(
        root / "demo" / "digit.png")
    b.goto("demo/index.html?image=digit.png")
    state = b.wait_for("(window.leafpyDemo && (window.leafpyDemo.top || window.leafpyDemo.error)) ? "
                       "window.leafpyDemo : null")
    assert "top" in state, state
    assert len(state["top"]) == 5 and sum(p for _, p in state["top"]) <= 1.0 + 1e-5
    assert state["ms"] > 0
    # the page reads the image as leafpy reads an image file: Pillow's BILINEAR resize of its 8-bit gray, / 255
    with Image.open(root / "demo" / "digit.png") as img:
        seen = np.asarray(img.convert("L").resize((8, 8), Image.Resampling.BILINEAR), np.float64) / 255
    np.testing.assert_allclose(np.asarray(state["input"]).reshape(8, 8), seen, atol=1e-6)
    scores = net.forward([seen.astype(np.float32)[None, None]])[0].to_numpy()[0].astype(np.float64)
    want = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
    first, second = np.sort(want)[-2:][::-1]
    if first - second > 1e-3:  # the class named first is the reference's, unless two are level within rounding
        assert state["top"][0][0] == str(int(np.argmax(want))), (state["top"], want)
    for name, p in state["top"]:
        assert abs(p - want[int(name)]) < 1e-4, (state["top"], want)
    text = b.evaluate("document.body.innerText")
    assert "ms per prediction" in text and "%" in text
    shot = Path(os.environ.get("LEAFPY_DEMO_PNG", str(root / "demo.png")))
    b.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_page_reads_a_photo_as_leafpy_does_and_shows_class_names_as_text(served, lenet_run):
    """A 20 x 13 colour image (another shape, another aspect): the page's input is what leafpy's image loading
    makes of the file (Pillow's L, then its BILINEAR resize; before: means of whole-pixel boxes, which could change
    the top class); class names holding markup are shown as text, never run (before: inserted as HTML)."""
    from PIL import Image

    from leafpy.sources.prepare import Preparation

    root, b = served
    net = lp.Layer.load(lp.backend("native"), str(lenet_run / "run" / "model.leaf"))
    net.set_training(False)
    names = [f'<img src=x onerror="window.injected=1">{k}' if k == 0 else f"a<b{k}" for k in range(10)]
    net.preparation = Preparation(class_names=tuple(names))
    lp.web.export(net, root / "photo")
    rgb = np.random.default_rng(3).integers(0, 256, (13, 20, 3), dtype=np.uint8)
    Image.fromarray(rgb, "RGB").save(root / "photo" / "odd.png")
    b.goto("photo/index.html?image=odd.png")
    state = b.wait_for("(window.leafpyDemo && (window.leafpyDemo.top || window.leafpyDemo.error)) ? "
                       "window.leafpyDemo : null")
    assert "top" in state, state
    with Image.open(root / "photo" / "odd.png") as img:
        seen = np.asarray(img.convert("L").resize((8, 8), Image.Resampling.BILINEAR), np.float64) / 255
    np.testing.assert_allclose(np.asarray(state["input"]).reshape(8, 8), seen, atol=1e-6)
    shown = b.evaluate("Array.from(document.querySelectorAll('#top tr td:first-child'), (td) => td.textContent)")
    assert shown == [name for name, _ in state["top"]] and set(shown) <= set(names)
    assert b.evaluate("document.querySelectorAll('#top img').length") == 0
    assert b.evaluate("window.injected === undefined")



def test_a_regressions_outputs_come_back_in_its_targets_units_in_the_page(served):
    """A regression trained with normalize: auto records its targets' mean and spread: the export carries them
    (plan.json) and m.inUnits gives the outputs as `leafpy predict` does, y * std + mean per output (before: the
    export dropped them, and the page's numbers were in standard units)."""
    from leafpy.sources.prepare import Preparation

    root, b = served
    cfg = lp.SequentialConfig(inputs=[("data", [1, 3])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=2)))
    net = lp.Layer.from_config(lp.backend("native"), lp.LayerConfig("reg", cfg), seed=0)
    net.preparation = Preparation(target_mean=(159.17, -3.0), target_std=(61.23, 0.5))
    lp.web.export(net, root / "reg")
    assert json.loads((root / "reg" / "model" / "plan.json").read_text())["target"] == {
        "mean": [159.17, -3.0], "std": [61.23, 0.5]}
    x = np.array([[5, 5, 5], [10, 2, 1]], np.float32)
    r = b.evaluate(f"""(async () => {{
        const {{load}} = await import("/reg/leafpy.js");
        const m = await load("/reg/model/");
        try {{
            const y = m.inUnits(await m.predict(new Float32Array({json.dumps(x.reshape(-1).tolist())}), [2, 3]));
            return Array.from(y.data);
        }} finally {{ m.destroy(); }}
    }})()""")
    w, bias = (t.astype(np.float64) for t in net.named_weights().values())
    want = (x.astype(np.float64) @ w.T + bias) * np.array([61.23, 0.5]) + np.array([159.17, -3.0])
    np.testing.assert_allclose(np.asarray(r).reshape(2, 2), want, rtol=1e-5, atol=1e-4)
