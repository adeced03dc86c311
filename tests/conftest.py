import pytest
import torch

from trl_longstraw.testing import save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """Returns a function `family -> path` of a saved tiny random model (cached per family)."""
    cache = {}

    def get(family: str = "llama"):
        if family not in cache:
            cache[family] = save_tiny_model(tmp_path_factory.mktemp(family), family)
        return cache[family]

    return get


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
