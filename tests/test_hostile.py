"""Hostile inputs: every corrupted or crafted file (models, checkpoints, Cap'n Proto messages, run files, IDX and
npz data) must end in a LeafpyError, never a crash, a raw exception, a hang, a memory blow-up or a silent load.
The full corpus: ``python -m tests.hostile.corpus --full --table``."""
from __future__ import annotations

import pytest

from tests.hostile import corpus  # noqa: E402


@pytest.fixture(scope="module")
def outcomes():
    return corpus.run(seed=0, n=8)


def test_truncated_model_files_give_clear_errors(outcomes):
    c = outcomes["model truncation"]
    assert set(c) == {"clear error"}, c


def test_flipped_model_bytes_give_clear_errors(outcomes):
    c = outcomes["model byte flip"]
    assert set(c) == {"clear error"}, c


@pytest.mark.parametrize("cls", ["checkpoint truncation", "checkpoint byte flip", "crafted message", "run file",
                                 "IDX file", "npz file"])
def test_other_hostile_inputs_give_clear_errors(outcomes, cls):
    c = outcomes[cls]
    assert sum(c.values()) > 0 and set(c) == {"clear error"}, c


@pytest.mark.parametrize("cls", ["ONNX truncation", "ONNX crafted"])
def test_damaged_and_crafted_onnx_files_give_clear_errors(outcomes, cls):
    pytest.importorskip("onnx", reason="the ONNX cases need the onnx package (pip install 'leafpy-dl[onnx]')")
    c = outcomes[cls]
    assert sum(c.values()) > 0 and set(c) == {"clear error"}, c
