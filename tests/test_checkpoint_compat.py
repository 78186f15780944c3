"""A checkpoint written by an earlier leafpy (the code of commit 9305875, before a step's learning rate and dropout
seed moved into device buffers) resumes in this one and continues exactly as that code continued.

tests/data/v0_1_checkpoint.leaf holds an MLP with dropout after 4 Nesterov steps under Caffe's inv schedule;
tests/data/v0_1_continued.npz the batches and the weights that code reached after 4 more steps
(tests/data/make_v0_1_fixture.py wrote both, run with that commit's leafpy on the native backend)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import backend_or_skip

import leafpy as lp

DATA = os.path.join(os.path.dirname(__file__), "data")

BACKENDS = ["native", pytest.param("webgpu", marks=pytest.mark.webgpu), pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("name", BACKENDS)
def test_a_checkpoint_of_an_earlier_leafpy_continues_as_that_leafpy_did(name):
    be = backend_or_skip(name)
    solver = lp.Solver.load_checkpoint(be, be, os.path.join(DATA, "v0_1_checkpoint.leaf"))
    assert solver.iteration == 4 and solver.config.lr_policy == "inv" and solver.config.solver == "nesterov"
    expected = np.load(os.path.join(DATA, "v0_1_continued.npz"))
    x, y = expected["x"], expected["y"]
    start = [w.to_numpy() for w in solver.network.learnable_weights_data()]
    for i in range(4, 8):
        solver.train_minibatch(x[i], y[i])
    assert solver.iteration == 8
    for i, (w, w0) in enumerate(zip(solver.network.learnable_weights_data(), start)):
        want = expected[f"w{i}"]
        np.testing.assert_allclose(w.to_numpy(), want, rtol=1e-5, atol=1e-6, err_msg=f"weight {i}")
        assert not np.allclose(want, w0), "the continued steps moved no weight: the comparison would prove nothing"
