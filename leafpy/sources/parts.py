"""What a dataset source reads, before ``lp.data`` makes a Dataset of it (splitting it where it has no split)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Parts(NamedTuple):
    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int
    test: tuple[np.ndarray, np.ndarray] | None = None
    """A held-out split given with the data (x_test, y_test); None: split at random."""
    class_names: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    feature_names: tuple[str, ...] = ()
