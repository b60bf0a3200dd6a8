import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def random_input(layer, batch, seq_len, seed=0):
    d_model = layer.inputs[0].attrs["shape"][2]
    return np.random.default_rng(seed).standard_normal((batch, seq_len, d_model)).astype(
        np.float32)
