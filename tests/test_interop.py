"""SharedTensor with NumPy's array protocol and DLPack: NumPy on the host (here), CuPy and PyTorch on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import backend_or_skip

import leafpy as lp


def _net(be):
    cfg = lp.SequentialConfig(inputs=[("data", [4, 5])])
    cfg.add_layer(lp.LayerConfig("fc", lp.LinearConfig(output_size=3)))
    cfg.add_layer(lp.LayerConfig("act", "TanH"))
    return lp.Layer.from_config(be, lp.LayerConfig("net", cfg), seed=0)


def _reference(net, x):
    w, b = (t.to_numpy().astype(np.float64) for t in net.learnable_weights_data())
    return np.tanh(x.astype(np.float64) @ w.T + b)


def test_numpy_reads_a_tensor_as_its_numbers():
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    net = _net(lp.backend("native"))
    out = net.forward([x])[0]
    a = np.asarray(out)
    assert a.dtype == np.float32 and a.shape == (4, 3)  # not a 0-d object array
    np.testing.assert_allclose(a, _reference(net, x), rtol=1e-5, atol=1e-6)
    assert not a.flags.writeable  # a view: writing through it would bypass the tensor's bookkeeping
    c = np.array(out)
    c[0, 0] = 99.0  # a copy is the caller's own
    assert out.to_numpy()[0, 0] != 99.0
    assert np.asarray(out, dtype=np.float64).dtype == np.float64
    with pytest.raises(ValueError):
        np.asarray(out, dtype=np.float64, copy=False)


def test_dlpack_round_trip_on_the_host_shares_memory():
    x = np.random.default_rng(1).standard_normal((4, 5)).astype(np.float32)
    t = lp.SharedTensor.from_dlpack(x)
    assert t.__dlpack_device__() == (1, 0)
    assert np.shares_memory(np.from_dlpack(t), x)  # no copy either way
    net = _net(lp.backend("native"))
    np.testing.assert_allclose(net.forward([t])[0].to_numpy(), _reference(net, x), rtol=1e-5, atol=1e-6)
    # other dtypes and layouts are taken as float32 copies
    u = lp.SharedTensor.from_dlpack(np.arange(20, dtype=np.int64).reshape(4, 5).T.copy())
    assert u.dtype == np.float32 and u.shape == (5, 4)
    with pytest.raises(lp.ShapeError, match="__dlpack__"):
        lp.SharedTensor.from_dlpack([1.0, 2.0])


class _GradTensor:
    """A stand-in for a PyTorch tensor NumPy cannot take as it is (one that requires grad: its __dlpack__ and
    __array__ refuse), with PyTorch's detach() (its values) and float()."""

    def __init__(self, values: np.ndarray) -> None:
        self.values, self.dtype, self.shape = values, "torch.float32", values.shape

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kwargs):
        raise BufferError("Can't export tensors that require gradient, use tensor.detach()")

    def __array__(self, *args, **kwargs):
        raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")

    def __len__(self):
        return len(self.values)

    def detach(self):
        return self.values

    def float(self):
        return self


def test_a_tensor_that_requires_grad_is_taken_by_its_values():
    """As from_dlpack promises for what it cannot share (a copy as float32), a tensor NumPy refuses (autograd's,
    PyTorch's bfloat16) is taken by its values, in from_dlpack and as a network input; an object without values to
    take is a ShapeError saying what to give."""
    x = np.random.default_rng(2).standard_normal((4, 5)).astype(np.float32)
    t = lp.SharedTensor.from_dlpack(_GradTensor(x))
    assert t.dtype == np.float32
    np.testing.assert_array_equal(t.to_numpy(), x)
    wide = lp.SharedTensor.from_dlpack(_GradTensor(x.astype(np.float64)))  # float64 stays float64, as when shared
    assert wide.dtype == np.float64
    net = _net(lp.backend("native"))
    np.testing.assert_allclose(net.forward([_GradTensor(x)])[0].to_numpy(), _reference(net, x), rtol=1e-5, atol=1e-6)

    class Opaque(_GradTensor):
        detach = None  # type: ignore[assignment]

    with pytest.raises(lp.ShapeError, match=r"cannot take this Opaque.*\.detach\(\)\.float\(\)"):
        lp.SharedTensor.from_dlpack(Opaque(x))


@pytest.mark.cuda
def test_cupy_and_torch_take_gpu_tensors_without_a_copy():
    be = backend_or_skip("cuda")
    import cupy as cp

    x = np.random.default_rng(2).standard_normal((4, 5)).astype(np.float32)
    net = _net(be)
    out = net.forward([x])[0]
    assert out.__dlpack_device__()[0] == 2  # the fresh copy is on the GPU
    before = lp.SharedTensor.transfers_total
    g = cp.from_dlpack(out)
    assert lp.SharedTensor.transfers_total == before  # nothing went through the host
    assert g.data.ptr == out.buffer_on(be.key).data.ptr
    np.testing.assert_allclose(cp.asnumpy(g), _reference(net, x), rtol=1e-5, atol=1e-5)
    back = lp.SharedTensor.from_dlpack(cp.asarray(x))
    assert back.is_fresh_on(be.key)
    np.testing.assert_allclose(net.forward([back])[0].to_numpy(), _reference(net, x), rtol=1e-5, atol=1e-5)
    try:
        import torch
    except ImportError:
        pytest.skip("PyTorch is not installed (the CuPy half passed)")
    tt = torch.from_dlpack(out)
    assert tt.is_cuda and tt.data_ptr() == g.data.ptr
    t2 = lp.SharedTensor.from_dlpack(torch.from_numpy(x).cuda())
    np.testing.assert_allclose(t2.to_numpy(), x)


def test_from_dlpack_copies_a_big_endian_array_as_its_values():
    """DLPack has no byte order: an array read from a big-endian file ('>f4', '>f8') is taken as a copy of its
    values (it was refused as if it were not float32), keeping float64 as float64."""
    for dtype, want in ((">f4", np.float32), (">f8", np.float64)):
        given = (np.arange(6).reshape(2, 3) / 4).astype(dtype)
        assert not given.dtype.isnative
        t = lp.SharedTensor.from_dlpack(given)
        assert t.dtype == want
        np.testing.assert_array_equal(t.to_numpy(), given.astype(np.float64))
