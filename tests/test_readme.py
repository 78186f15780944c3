"""The README's Python examples run as written, and so do those of the docs pages that continue them."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import backend_or_skip

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def run_blocks(path: Path, namespace: dict, edit=lambda source: source) -> dict:
    exec(compile(edit("\n".join(python_blocks(path))), str(path), "exec"), namespace)
    return namespace


def test_readme_examples_run(tmp_path, monkeypatch):
    assert len(python_blocks(README)) >= 2
    monkeypatch.chdir(tmp_path)  # the examples write checkpoint files
    namespace = run_blocks(README, {})
    assert namespace["solver"].iteration == 1
    assert (tmp_path / "ckpt.leaf").exists()


# pages whose examples go on from the README's (its `be`, `cfg`, `net`, `x`, `sol_cfg`), with what each must leave
CONTINUING = {
    "api.md": lambda ns, tmp: (ns["res_out"].to_numpy().shape == (8, 16) and ns["tags"].to_numpy().shape == (4, 10, 5)
                               and np.isfinite(ns["model"].parameters().gradients[0].to_numpy()).all()),
    "training.md": lambda ns, tmp: len(ns["history"]) >= 1 and (tmp / "runs/mlp/run.yaml").exists(),
    "distributed-training.md": lambda ns, tmp: ns["dp"].solver.iteration >= 1,
}


@pytest.mark.parametrize("page", sorted(CONTINUING))
def test_docs_examples_run_after_the_readmes(page, tmp_path, monkeypatch):
    path = ROOT / "docs" / page
    assert python_blocks(path), f"{path} has no Python example"
    monkeypatch.chdir(tmp_path)
    namespace = run_blocks(path, run_blocks(README, {}))
    assert CONTINUING[page](namespace, tmp_path)


def _trained_run(ns: dict, tmp: Path) -> None:
    """A model trained with `normalize: auto` at runs/mine/model.leaf, and a few digits as `x`."""
    import leafpy as lp

    run = lp.config.load("digits_mlp", ["data.normalize=auto"])
    trainer = lp.Trainer(run, backend=lp.backend("native"), out_dir=str(tmp / "runs/mine"))
    trainer.fit(epochs=1)
    trainer.save_model(str(tmp / "runs/mine/model.leaf"))
    ns["x"] = lp.data.digits().x_test[:5]


# the other pages with examples: what each needs first (beyond the README's names), and what it must leave
PRELUDES = {
    "threads.md": (lambda ns, tmp: (exec("import threading", ns), ns.update(trainer=ns["lp"].Trainer(
                       ns["lp"].config.load("digits_mlp", ["train.epochs=1"]), backend=ns["lp"].backend("native"),
                       log=lambda m: None))),
                   lambda ns, tmp: ns["y"].shape == (64, 10) and ns["trainer"].solver.iteration > 0),
    "distributed.md": (lambda ns, tmp: (run_blocks(ROOT / "docs/distributed-training.md", ns),
                                        ns.update(run=ns["lp"].config.load("digits_mlp"), y=ns["labels"])),
                       lambda ns, tmp: ns["group"].size == 1),
    "onnx.md": (lambda ns, tmp: ns["lp"].onnx.export(ns["net"], "model.onnx"),
                lambda ns, tmp: (tmp / "out.onnx").exists() and "conv1/weight" in ns["weights"]),
    "web.md": (lambda ns, tmp: (backend_or_skip("webgpu"), _trained_run(ns, tmp),  # plans record on webgpu
                                shutil.copytree(tmp / "runs/mine", tmp / "run")),
               lambda ns, tmp: all((tmp / "site" / f).exists() for f in ("leafpy.js", "model/plan.json"))),
    "data.md": (_trained_run,
                lambda ns, tmp: ns["y"].shape == (5, 10) and ns["prep"] is not None),
}


@pytest.mark.parametrize("page", sorted(PRELUDES))
def test_the_other_docs_examples_run(page, tmp_path, monkeypatch):
    path = ROOT / "docs" / page
    assert python_blocks(path), f"{path} has no Python example"
    monkeypatch.chdir(tmp_path)
    prelude, check = PRELUDES[page]
    namespace = run_blocks(README, {})
    prelude(namespace, tmp_path)
    import leafpy as lp

    # an example that names the cuda backend runs on native where there is none (CI)
    on = "cuda" if "cuda" in lp.available_backends() else "native"
    run_blocks(path, namespace, lambda source: source.replace('backend="cuda"', f'backend="{on}"'))
    assert check(namespace, tmp_path)


def test_every_docs_page_with_examples_is_run():
    pages = {p.name for p in (ROOT / "docs").glob("*.md") if python_blocks(p)}
    unrun = pages - set(CONTINUING) - set(PRELUDES)
    assert not unrun, f"docs pages whose examples no test runs: {sorted(unrun)}"


def test_the_documentation_site_builds_strictly(tmp_path):
    """`mkdocs build --strict` (the README as home page, every page in the nav, the API reference from the
    docstrings): a broken link, a page left out of the nav or a reference to a missing name fails."""
    import os
    import subprocess
    import sys

    missing = "the docs extra (mkdocs, mkdocs-material, mkdocstrings) is not installed"
    pytest.importorskip("mkdocs", reason=missing)
    pytest.importorskip("mkdocstrings", reason=missing)

    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "A short example" in (site / "index.html").read_text()
    assert "train_minibatch" in (site / "reference/index.html").read_text()


def test_every_page_of_the_docs_is_in_the_site_navigation():
    """Without mkdocs installed (the strict build above then skips): a page left out of mkdocs.yml's nav fails
    `make docs`."""
    import yaml

    def pages(entries) -> set[str]:
        found: set[str] = set()
        for e in entries:
            for v in (e.values() if isinstance(e, dict) else [e]):
                found |= pages(v) if isinstance(v, list) else {v}
        return found

    nav = pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    on_disk = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert on_disk - nav == set(), "pages missing from mkdocs.yml's nav"
    assert {p for p in nav if p != "index.md"} <= on_disk


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub and MkDocs make them."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_readme_and_docs_relative_links_reach_their_files_and_headings():
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            linked = page.parent / target if target else page
            assert linked.exists(), f"{page.relative_to(ROOT)} links to {target}, which is not there"
            if anchor and linked.suffix == ".md":
                where = f"{page.relative_to(ROOT)} links to {target}#{anchor}"
                assert anchor in anchors(linked), f"{where}: no such heading"
