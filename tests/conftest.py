import pytest
import torch

try:  # the browser test (tests/browser) needs playwright, which .ci/run installs; without it, skip the folder
    import playwright  # noqa: F401
except ImportError:
    collect_ignore = ["browser"]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip where there is no CUDA GPU, with the reason said once for all of them."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
