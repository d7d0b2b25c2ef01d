import pytest
import torch

try:  # the browser test (tests/browser) needs playwright, which .ci/run installs; without it, skip the folder
    import playwright  # noqa: F401
except ImportError:
    collect_ignore = ["browser"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
