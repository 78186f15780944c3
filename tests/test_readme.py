"""The README's Python examples run as written, and so do those of the docs pages that continue them."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def run_blocks(path: Path, namespace: dict) -> dict:
    exec(compile("\n".join(python_blocks(path)), str(path), "exec"), namespace)
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
