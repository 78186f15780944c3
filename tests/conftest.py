import os
import signal
from pathlib import Path

import numpy as np
import pytest

import leafpy as lp

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process the tests start (``leafpy`` commands, MPI ranks): this checkout first on
    PYTHONPATH, ahead of what is already there (a machine may keep its packages on it), unbuffered output,
    matplotlib without a display, then ``extra``."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg", **extra}


def terminal_signals() -> None:
    """``preexec_fn`` of a child process a test stops with SIGINT or SIGHUP: both at their defaults, as a command
    typed at a terminal has them, whatever the test process inherited. A test run started in the background
    (``make test &``) or under ``nohup`` ignores them, and leafpy rightly keeps an ignored stop signal ignored, so
    the signal would not stop the run the test waits for."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


@pytest.fixture
def native():
    return lp.backend("native")


@pytest.fixture
def native64():
    return lp.backend("native", dtype="float64")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def backend_or_skip(name: str, **options) -> lp.Backend:
    """``lp.backend(name, **options)``, or the test skipped saying why the backend is unavailable here: the one
    way every test asks for a backend that may be missing (CI has no GPU)."""
    try:
        return lp.backend(name, **options)
    except lp.BackendUnavailable as e:
        pytest.skip(f"{name} backend unavailable: {e}")


def webgpu_offering(*features: str):
    """The shared webgpu backend, where its adapter offers every one of ``features``; the test is skipped (saying
    what is missing) where there is no webgpu adapter or it lacks one of them."""
    plain = backend_or_skip("webgpu")
    for feature in features:
        if feature not in plain.adapter.features:
            pytest.skip(f"webgpu adapter {plain.adapter_name} does not offer {feature}")
    return plain
