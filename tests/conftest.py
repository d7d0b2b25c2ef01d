import re
from pathlib import Path

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


# ./course test runs on two workers with --dist loadfile: a worker takes a whole file at a time (a notebook's cells
# share one kernel; a test file's tests may share module state). The tests of these files stand alone, so the workers
# take them one at a time instead, and a file of several minutes keeps both busy, not one. The test named beside a file
# uses a module-scoped fixture (the mutants' verdicts, computed once for all its cases): its cases stay together.
SPREAD_OVER_WORKERS = {
    "test_exercises_ch02_03_05_06.py": "test_mutant_gets_its_diagnosis",
    "test_exercises_ch04_07_to_10.py": "test_mutant_gets_its_diagnosis",
    "test_exercises_ch12.py": "test_mutant_gets_its_diagnosis",
    "test_learner_edition.py": None,
}


def work_unit(nodeid):
    """What a worker takes at once under ``--dist loadfile``: the file, or the test alone (SPREAD_OVER_WORKERS)."""
    file, _, test = nodeid.partition("::")
    if Path(file).name not in SPREAD_OVER_WORKERS:
        return file
    together = SPREAD_OVER_WORKERS[Path(file).name]
    return f"{file}::{together}" if together and re.fullmatch(rf"{together}(\[.*\])?", test) else nodeid


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's loadfile scheduling, with the work units of ``work_unit`` (the controller sees node ids only)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndSpreadTests(LoadFileScheduling):
        def _split_scope(self, nodeid):
            return work_unit(nodeid)

    return FilesAndSpreadTests(config, log)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# The ten modifiers of test_flex_dropin as PyTorch's FlexAttention documentation writes them, unchanged, for the GPU
# tests of the flex Hopper kernels: their module globals (the tables they close over) sized for a problem of
# GPU_DROPIN_HEADS heads and GPU_DROPIN_SEQ tokens.
GPU_DROPIN_HEADS, GPU_DROPIN_SEQ = 4, 300


@pytest.fixture
def gpu_dropin(monkeypatch):
    """``test_flex_dropin``'s modifiers, unchanged, reading tables sized for the GPU problem (its module globals)."""
    import test_flex_dropin as dropin

    heads = GPU_DROPIN_HEADS
    monkeypatch.setattr(dropin, "alibi_bias",
                        torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device="cuda"))
    monkeypatch.setattr(dropin, "head_bias_table", torch.linspace(-1.5, 0.75, heads, device="cuda"))
    monkeypatch.setattr(dropin, "document_id", torch.tensor([0] * 90 + [1] * 130 + [2] * 80, dtype=torch.int32,
                                                            device="cuda"))
    monkeypatch.setattr(dropin, "prefix_length", torch.tensor([37, 200], device="cuda"))
    monkeypatch.setattr(dropin, "SLIDING_WINDOW", 150)
    return dropin
