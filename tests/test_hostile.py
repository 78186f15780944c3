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
                                 "IDX file", "npz file", "crafted model weights", "crafted checkpoint state",
                                 "npz oddity"])
def test_other_hostile_inputs_give_clear_errors(outcomes, cls):
    c = outcomes[cls]
    assert sum(c.values()) > 0 and set(c) == {"clear error"}, c


def test_data_bombs_are_refused_before_their_arrays_are_allocated(outcomes):
    """An npz of 10 million images in 0.6 MB, a gzipped IDX of 5 million in 4 MB and a sparse 3.9 GB IDX, opened
    in a child limited to 1 GiB: each a LeafpyError naming the bytes needed and available (before: MemoryError)."""
    for cls in ("npz data bomb", "IDX data bomb"):
        c = outcomes[cls]
        assert sum(c.values()) > 0 and set(c) == {"clear error"}, (cls, c)


@pytest.mark.parametrize("cls", ["ONNX truncation", "ONNX crafted"])
def test_damaged_and_crafted_onnx_files_give_clear_errors(outcomes, cls):
    pytest.importorskip("onnx", reason="the ONNX cases need the onnx package (pip install 'leafpy-dl[onnx]')")
    c = outcomes[cls]
    assert sum(c.values()) > 0 and set(c) == {"clear error"}, c


def test_damaged_leaf_files_never_end_the_process(outcomes):
    """A Leaf 0.2.1 file has no checksum: a flipped bit in a weight loads as another weight, as it did in Leaf; but
    no cut or flip may crash the process, hang or raise a raw exception (a second segment cut off once ended it
    in Cap'n Proto's packed reader)."""
    c = outcomes["Leaf model damage"]
    assert sum(c.values()) > 0 and set(c) <= {"clear error", "silently accepted"}, c
    assert c["clear error"] > 0, c


def test_segment_tables_that_promise_more_than_the_file_holds_give_clear_errors(outcomes):
    c = outcomes["crafted segment table"]
    assert sum(c.values()) == 10 and set(c) == {"clear error"}, c
