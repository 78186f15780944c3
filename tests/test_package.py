"""The distribution as users get it: a wheel built from the source tree, installed into a fresh environment, whose
``leafpy`` command trains a shipped run file by its bare name from another directory."""

from __future__ import annotations

import email.parser
import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import child_env

import leafpy as lp

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomllib (3.11+) or tomli")

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "leafpy", "configs", "capnp")


def _setuptools_version() -> tuple[int, ...] | None:
    try:
        from importlib.metadata import version

        return tuple(int(p) for p in version("setuptools").split(".")[:2])
    except Exception:  # noqa: BLE001 - not installed or an unusual version string: the caller skips
        return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built by pip from a copy of the source tree (symlinks kept, as a clone has them)."""
    found = _setuptools_version()
    if found is None or found < (77,):
        pytest.skip(f"building the wheel needs setuptools >= 77 (SPDX license), found {found}: "
                    "pip install 'setuptools>=77'")
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        here = ROOT / name
        if here.is_dir():
            shutil.copytree(here, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(here, src / name)
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                        "--no-index", "-q", "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    (whl,) = out.glob("*.whl")
    return whl


def test_distribution_name_is_not_the_unrelated_leafpy_and_readme_installs_it():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = meta["name"]
    assert name != "leafpy"  # that name on the package index is another project
    assert meta["scripts"]["leafpy"] == "leafpy.cli:main"
    assert meta["license"] == "MIT"
    readme = (ROOT / "README.md").read_text()
    # not on the package index yet: the README installs from a clone or from the wheel `make dist` builds
    assert f"`{name}`" in readme and 'pip install ".[cuda]"' in readme and "make dist" in readme
    wheel_name = name.replace("-", "_")
    assert f"dist/{wheel_name}-{meta['version']}-py3-none-any.whl" in readme
    assert "pip install leafpy" not in readme
    assert '"leafpy[' not in readme and "'leafpy[" not in readme
    for source in (ROOT / "leafpy").rglob("*.py"):  # install hints in error messages name the distribution too
        assert "install leafpy" not in source.read_text() and "'leafpy[" not in source.read_text(), source


def test_wheel_holds_run_files_types_marker_main_module_and_license(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
        (ep_name,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = z.read(ep_name).decode()
    shipped = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert shipped and all(f"leafpy/configs/{f}" in names for f in shipped)
    for needed in ("leafpy/py.typed", "leafpy/__main__.py", "leafpy/leaf.capnp", "leafpy/cli.py",
                   "leafpy/web/leafpy.js", "leafpy/web/index.html"):
        assert needed in names
    assert any(n.startswith("leafpy/backends/webgpu/") and n.endswith(".wgsl") for n in names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert meta["Name"] == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    assert meta["License-Expression"] == "MIT"
    assert "leafpy = leafpy.cli:main" in entry_points
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_installed_wheel_trains_a_shipped_run_file_by_name_from_another_directory(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    # the dependencies (numpy, pycapnp, PyYAML, scikit-learn) come from this interpreter's environment, after the
    # fresh one's own site-packages, so `import leafpy` finds the installed wheel, not the source tree
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    deps = {str(Path(importlib.import_module(m).__file__).parent.parent)
            for m in ("numpy", "yaml", "capnp", "sklearn")}
    Path(purelib, "_deps.pth").write_text("".join(d + "\n" for d in sorted(deps)))
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    where = subprocess.run([str(python), "-c", "import leafpy; print(leafpy.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv)
    t = subprocess.run([str(venv / "bin" / "leafpy"), "train", "digits_lenet", "--epochs", "1", "--out", "tmp"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert t.returncode == 0, t.stderr
    assert "held-out accuracy" in t.stdout
    assert (work / "tmp" / "model.leaf").is_file() and (work / "tmp" / "checkpoint.leaf").is_file()
    m = subprocess.run([str(python), "-m", "leafpy", "--version"], cwd=work, env=env, capture_output=True,
                       text=True, timeout=60)
    assert m.returncode == 0 and m.stdout.strip() == f"leafpy {lp.__version__}", m.stderr


def test_python_m_leafpy_runs_the_command(tmp_path):
    env = child_env()
    p = subprocess.run([sys.executable, "-m", "leafpy", "summary", "digits_mlp"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "fc1" in p.stdout


def test_a_bare_name_loads_the_shipped_run_file_and_a_local_file_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "digits_lenet" in lp.config.shipped()
    by_name = lp.config.load("digits_lenet")
    by_path = lp.config.load(ROOT / "configs" / "digits_lenet.yaml")
    assert lp.config.to_dict(by_name) == lp.config.to_dict(by_path)
    assert lp.config.to_dict(lp.config.load("digits_lenet.yaml")) == lp.config.to_dict(by_path)
    (tmp_path / "digits_lenet").write_text((ROOT / "configs" / "digits_mlp.yaml").read_text())
    assert lp.config.to_dict(lp.config.load("digits_lenet")) == lp.config.to_dict(
        lp.config.load(ROOT / "configs" / "digits_mlp.yaml"))
    with pytest.raises(lp.LeafpyError, match="shipped with leafpy: .*digits_lenet"):
        lp.config.load("no_such_run")
