"""The backend contract: every backend implements every primitive with the base class's signature, and
SharedTensor keeps track of fresh copies and transfers."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import numpy as np
import pytest

import leafpy as lp
from leafpy.backends import _MODULES
from leafpy.backends.base import PRIMITIVES, Backend


def _backend_classes():
    for name, (module, cls) in _MODULES.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            yield pytest.param(None, id=name, marks=pytest.mark.skip(reason=f"no {name} backend module: {e}"))
            continue
        yield pytest.param(getattr(mod, cls), id=name)


@pytest.mark.parametrize("cls", list(_backend_classes()))
def test_every_primitive_implemented_with_the_base_signature(cls):
    for name in PRIMITIVES:
        impl = getattr(cls, name)
        assert impl is not getattr(Backend, name), f"{cls.__name__} does not implement {name}"
        base_params = list(inspect.signature(getattr(Backend, name)).parameters)
        assert list(inspect.signature(impl).parameters) == base_params, f"{cls.__name__}.{name}"


def test_import_leafpy_imports_no_gpu_package():
    code = "import sys, leafpy; print(any(m in sys.modules for m in ('cupy', 'wgpu', 'torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_native_always_available():
    assert "native" in lp.available_backends()


class FakeDevice(Backend):
    """A device backend whose buffers are separate numpy arrays, to exercise SharedTensor's sync logic."""

    name = key = "fake"

    def allocate(self, size, dtype):
        return np.empty(size, dtype)

    def upload(self, host, out):
        out[...] = host

    def download(self, buf, host):
        host[...] = buf

    def view(self, buf, shape):
        return buf.reshape(shape)

    def fill(self, value, out):
        out.fill(value)


def test_shared_tensor_sync_and_transfer_count():
    dev = FakeDevice()
    host = lp.backend("native")
    t = lp.SharedTensor.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    lp.SharedTensor.reset_transfer_count()
    d = t.read(dev)
    assert lp.SharedTensor.transfers_total == 1 and d.shape == (2, 3)
    t.read(dev)
    t.read(host)
    assert lp.SharedTensor.transfers_total == 1  # both fresh: no copy
    t.write(dev)[...] = 7
    assert not t.is_fresh_on("host")
    assert np.all(t.to_numpy() == 7) and lp.SharedTensor.transfers_total == 2
    t.set(np.zeros((2, 3)))
    assert not t.is_fresh_on("fake")
    assert np.all(t.read(dev) == 0) and lp.SharedTensor.transfers_total == 3


def test_shared_tensor_reshape_resize_and_alias():
    t = lp.SharedTensor.from_numpy(np.arange(6, dtype=np.float32))
    a = t.alias((2, 3))
    assert a.shares_storage(t) and a.shape == (2, 3)
    t.reshape((3, 2))
    np.testing.assert_array_equal(t.to_numpy(), np.arange(6).reshape(3, 2))
    with pytest.raises(lp.ShapeError, match="resize"):
        t.reshape((4, 2))
    t.resize((4, 2))
    assert t.shape == (4, 2) and np.all(t.to_numpy() == 0)
    with pytest.raises(lp.ShapeError, match=r"expected an array of shape \(4, 2\)"):
        t.set(np.zeros((2, 4)))
    fresh = lp.SharedTensor((3,))
    np.testing.assert_array_equal(fresh.to_numpy(), np.zeros(3))


def test_gemm_transposes_and_beta(native, rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((5, 4)).astype(np.float32)
    c = rng.standard_normal((3, 5)).astype(np.float32)
    out = c.copy()
    native.gemm(a, False, b, True, out, 2.0, 0.5)
    np.testing.assert_allclose(out, 2 * a @ b.T + 0.5 * c, rtol=1e-5, atol=1e-6)
    out2 = np.empty((4, 4), np.float32)
    native.gemm(a, True, a, False, out2)
    np.testing.assert_allclose(out2, a.T @ a, rtol=1e-5, atol=1e-6)
