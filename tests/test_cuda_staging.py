"""Uploads through pinned memory on a copy stream (cuda backend, leafpy/backends/cuda/staging.py): every batch
arrives whole and in the order the step reads it, whatever the caller does with its array after the call, and a
network trained with every batch staged (recorded steps replayed) follows the float64 native reference."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import backend_or_skip
from test_replay import _config, assert_same_weights, twins

import leafpy as lp

pytestmark = pytest.mark.cuda


def test_staged_uploads_arrive_in_the_order_the_device_reads_them(monkeypatch):
    be = backend_or_skip("cuda")
    monkeypatch.setattr(be, "PINNED_UPLOAD_BYTES", 1 << 20)
    monkeypatch.setattr(be, "_staging", None)
    cp = be.xp
    rng = np.random.default_rng(0)
    n = 3 << 20  # 12 MB of float32: staged
    buf = cp.empty(n, np.float32)
    sent, doubled = [], []
    host = np.empty(n, np.float32)
    for _ in range(6):
        host[:] = rng.normal(size=n)
        sent.append(host.copy())
        be.upload_batch(host, buf)
        doubled.append(buf * 2)  # queued behind the upload on the step's stream
        for _ in range(3):
            doubled[-1] = doubled[-1] + 0  # GPU work that keeps the stream busy while the next batch is sent
        host[:] = np.nan  # the caller reuses its array at once
    for i, (want, got) in enumerate(zip(sent, doubled)):
        np.testing.assert_array_equal(cp.asnumpy(got), 2 * want, err_msg=f"upload {i}")
    assert be._staging is not None  # the uploads went through the pinned path


def test_batches_are_staged_by_default_and_other_uploads_are_not(monkeypatch):
    """Out of the box a network's input batches of 1 MiB or more travel through pinned staging; a weight set from
    the host (once, of any size) is copied directly, so the staging buffers stay the size of a batch."""
    be = backend_or_skip("cuda")
    assert be.PINNED_UPLOAD_BYTES == 1 << 20
    staged: list[int] = []
    monkeypatch.setattr(be, "_staging", None)
    real = type(be).upload_batch

    def counted(backend, host, out):
        staged.append(host.nbytes)
        return real(backend, host, out)

    monkeypatch.setattr(type(be), "upload_batch", counted)
    layer = lp.Layer.from_config(be, lp.LayerConfig("fc", lp.LinearConfig(output_size=10)))
    x = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    for _ in range(3):
        layer.forward([x])
    layer.load_weights({"fc/weight": np.zeros((10, 1024), np.float32)}, strict=False)
    layer.forward([x])
    assert staged == [x.nbytes] * 4
    assert be._staging is not None and all(s.pinned.nbytes == x.nbytes for s in be._staging.slots if s)


def test_a_network_trained_on_staged_batches_follows_the_float64_reference(monkeypatch):
    be = backend_or_skip("cuda")
    monkeypatch.setattr(be, "PINNED_UPLOAD_BYTES", 0)  # digits batches are small: stage every one
    monkeypatch.setattr(be, "_staging", None)
    solver, reference = twins(be, _config("momentum", "step", 1))
    ds = lp.data.digits()
    for i in range(8):
        x, y = ds.x_train[i * 32:(i + 1) * 32].copy(), ds.y_train[i * 32:(i + 1) * 32]
        solver.train_minibatch(x, y)
        reference.train_minibatch(x, y)
        x[:] = np.nan  # the batch's array is the caller's again after the step
    assert_same_weights(solver, reference)
    assert be._staging is not None
