import numpy as np
import pytest

import leafpy as lp


@pytest.fixture
def native():
    return lp.backend("native")


@pytest.fixture
def native64():
    return lp.backend("native", dtype="float64")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
