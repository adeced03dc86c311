import os

# The Triton kernels (trl_longstraw/dsa_kernels.py) run on CPU tensors through Triton's interpreter in the tests.
# Triton reads the flag when a kernel is defined, so it is set before anything imports trl_longstraw.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from trl_longstraw.testing import save_tiny_model  # noqa: E402


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
