"""A network's input batches are uploaded with Backend.upload_batch (a backend may overlap them with the step still
running: cuda's pinned staging), every other upload (weights, a solver's rate) with Backend.upload."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import backend_or_skip
from test_replay import _config

import leafpy as lp


@pytest.mark.parametrize("device", [pytest.param("webgpu", marks=pytest.mark.webgpu),
                                    pytest.param("cuda", marks=pytest.mark.cuda)])
def test_batches_go_through_upload_batch_and_weights_do_not(device, monkeypatch):
    be = backend_or_skip(device)
    batches: list[tuple[int, ...]] = []
    real = type(be).upload_batch

    def counted(backend, host, out):
        batches.append(host.nbytes)
        return real(backend, host, out)

    monkeypatch.setattr(type(be), "upload_batch", counted)
    solver = lp.Solver.from_config(be, be, _config("momentum", "step", 1))
    ds = lp.data.digits()
    x, y = ds.x_train[:32].astype(np.float32), ds.y_train[:32]
    for _ in range(3):
        solver.train_minibatch(x, y)
    name = solver.network.learnable_weights_names()[0]
    weight = solver.network.named_weights()[name]
    solver.network.load_weights({name: np.zeros_like(weight)}, strict=False)
    solver.train_minibatch(x, y)
    assert batches.count(x.nbytes) == 4  # the batch, every step
    assert weight.nbytes not in batches  # a weight set from the host is a plain upload
