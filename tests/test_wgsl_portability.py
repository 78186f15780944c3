"""Every WGSL module the webgpu backend ships compiles, and makes a compute pipeline of each entry point, under both
WebGPU compilers leafpy meets: wgpu's naga (the Python backend) and Chrome's Tint, in headless Chromium on
SwiftShader (tests/browser.py). Tint follows the WGSL specification more strictly (uniformity analysis,
``enable subgroups;``), so a module that naga accepts may still fail in a browser. The sources come from
leafpy.backends.webgpu.sources, as the backend builds them: fp32, fp16 and subgroup variants."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from browser import Browser, BrowserError, find_chromium

from leafpy.backends.webgpu import sources
from leafpy.errors import BackendError

WEB = Path(__file__).parent / "web"


def shipped_modules(browser: bool = True) -> list[dict]:
    """Every shader module the backend may build, once per variant whose WGSL differs: fp32, fp32+subgroups,
    fp16, fp16+subgroups (``f16``, ``subgroups``: the device features a variant needs)."""
    fp32 = sources.module_names(False)
    found = []
    for f16 in (False, True):
        for subgroups in (False, True):
            for name in sources.module_names(f16):
                if f16 and name in fp32:
                    continue
                code = sources.module_source(name, subgroups, browser=browser)
                if subgroups and code == sources.module_source(name, False, browser=browser):
                    continue
                found.append({"name": name, "variant": ("fp16" if f16 else "fp32") + ("+subgroups" * subgroups),
                              "code": code, "entries": sources.entry_points(code), "f16": f16,
                              "subgroups": subgroups})
    return found


def _report(failures: list[dict]) -> str:
    return "\n".join(f"module {f['module']} ({f['variant']}), entry point {f['entry'] or '(module)'}: {f['message']}"
                     for f in failures)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """A headless Chromium showing a served folder with compile_wgsl.js in it (skipped where there is none)."""
    if find_chromium() is None:
        pytest.skip("no Chromium for the browser tests: apt-get install chromium (make test does, as root)")
    folder = tmp_path_factory.mktemp("web")
    shutil.copy(WEB / "compile_wgsl.js", folder)
    (folder / "index.html").write_text("<!doctype html><title>leafpy WGSL</title>\n")
    try:
        b = Browser(folder, timeout=60)
    except BrowserError as e:
        pytest.skip(f"Chromium did not start: {e}")
    with b:
        b.goto("index.html")
        if not b.evaluate("navigator.gpu ? navigator.gpu.requestAdapter().then(a => a !== null) : false"):
            pytest.skip(f"Chromium offers no WebGPU adapter here; its log: {' | '.join(b.log[-3:])}")
        yield b


def _compile(page: Browser, modules: list[dict], name: str = "modules.json") -> dict:
    (page.folder / name).write_text(json.dumps(modules))
    return page.evaluate(f'import("./compile_wgsl.js").then(m => m.compileAll("./{name}"))', timeout=120)


@pytest.mark.browser
def test_every_shipped_wgsl_module_compiles_and_makes_its_pipelines_in_chromium(page):
    modules = shipped_modules()
    result = _compile(page, modules)
    assert not result["failures"], "Chrome's WGSL compiler refused:\n" + _report(result["failures"])
    entries: dict[str, int] = {}
    for m in modules:
        entries[m["variant"]] = entries.get(m["variant"], 0) + len(m["entries"])
    checked = {v: result["compiled"].get(v, 0) + result["parsedOnly"].get(v, 0) + result["skipped"].get(v, 0)
               for v in entries}
    assert checked == entries
    assert result["compiled"]["fp32"] == entries["fp32"] > 90  # every float32 entry point made a pipeline
    if "subgroups" in result["features"]:
        assert result["compiled"]["fp32+subgroups"] == entries["fp32+subgroups"]
    if "shader-f16" in result["features"]:
        assert result["compiled"]["fp16"] == entries["fp16"]
    else:  # no shader-f16 (SwiftShader): parsed, refused only for the f16 extension
        assert result["parsedOnly"]["fp16"] == entries["fp16"]


@pytest.mark.browser
def test_a_module_the_specification_refuses_is_reported_with_its_name_entry_and_message(page):
    # the shape of the reductions before they were made portable: a barrier after an early return on a value
    # taken from a struct that holds a per-thread builtin
    code = """struct Lane { @builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>, }
var<workgroup> parts: array<f32, 64>;
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(64)
fn rows(lane: Lane) {
    if (lane.wid.x >= arrayLength(&out)) { return; }
    parts[lane.lid.x] = 1.0;
    workgroupBarrier();
    out[lane.wid.x] = parts[0];
}
@compute @workgroup_size(64)
fn fine(@builtin(global_invocation_id) gid: vec3<u32>) { out[gid.x] = 2.0; }
"""
    bad = {"name": "old_reduce", "variant": "fp32", "code": code, "entries": ["rows", "fine"], "f16": False,
           "subgroups": False}
    typo = dict(bad, name="typo", code="fn oops( {")
    result = _compile(page, [bad, typo], "bad.json")
    report = _report(result["failures"])
    assert "module old_reduce (fp32)" in report and "uniform control flow" in report, report
    assert "module typo (fp32)" in report and "fn oops" in report, report


@pytest.mark.browser
def test_the_page_driver_reports_a_throw_and_a_hung_promise_instead_of_hanging(page):
    assert page.evaluate("Promise.resolve(6 * 7)") == 42
    with pytest.raises(BrowserError, match="the page threw: Error: no model here"):
        page.evaluate("(async () => { throw new Error('no model here'); })()")
    with pytest.raises(BrowserError, match="no reply in 1"):
        page.evaluate("new Promise(() => {})", timeout=1)
    assert page.evaluate("1 + 1") == 2  # the page still answers
    png = page.screenshot()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_module_sources_are_named_as_the_backend_builds_them_and_unknown_names_are_refused():
    assert sources.module_source("gemm16AC").startswith("enable f16;")
    assert "ActOut: array<f16>" in sources.module_source("gemm16AC")  # C's epilogue arrays follow C
    assert "enable subgroups;" in sources.module_source("reduce", subgroups=True, browser=True)
    assert "enable subgroups;" not in sources.module_source("reduce", subgroups=True)  # naga refuses it
    assert sources.module_source("conv", subgroups=True, browser=True) == sources.module_source("conv")
    assert sources.entry_points(sources.module_source("classes"))[-2:] == ["softmax_rows", "softmax_grad_rows"]
    for name in ("gemm16Q", "winograd16", "nothing"):
        with pytest.raises(BackendError, match=f"no shader module '{name}'; modules: elementwise, "):
            sources.module_source(name)


@pytest.mark.webgpu
def test_every_shipped_wgsl_module_compiles_and_makes_its_pipelines_under_wgpu():
    import leafpy as lp

    try:
        be = lp.backend("webgpu")
    except lp.BackendUnavailable as e:
        pytest.skip(f"webgpu backend unavailable: {e}")
    f16 = "shader-f16" in be.adapter.features
    device = be.adapter.request_device_sync(required_features=["shader-f16"] * f16 + ["subgroup"] * be.subgroups)
    failures = []
    for m in shipped_modules(browser=False):
        if (m["f16"] and not f16) or (m["subgroups"] and not be.subgroups):
            continue
        try:
            module = device.create_shader_module(code=m["code"])
            for entry in m["entries"]:
                device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": entry})
        except Exception as e:  # wgpu raises its GPUValidationError with naga's message
            failures.append(f"{m['name']} ({m['variant']}): {e}")
    assert not failures, "\n".join(failures)
