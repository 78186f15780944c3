"""Hostile inputs: every corrupted model file must end in a LeafpyError, never a crash, hang or silent load."""
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
