"""Using the course never modifies a tracked file; the committed notebooks are the same on every machine.

.ci/run also checks that `git status --porcelain` is empty after the whole test suite.
"""

import hashlib
import json
import re
import subprocess
from pathlib import Path

import nbformat
import pytest

from course_utils.core.device import HAS_GPU
from course_utils.tooling import run_notebooks, workspace

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# Paths that only exist on the machine that ran a notebook.
MACHINE_PATH = re.compile(r"/root/|/home/|/Users/|/work/|/opt/|/tmp/|/private/var/|site-packages|dist-packages"
                          r"|[A-Z]:\\\\Users")


def git_status():
    """``git status --porcelain``, plus a hash of each file it lists: a second change to a file
    that was already modified shows too."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    state = []
    for line in out.splitlines():
        path = ROOT / line[3:].split(" -> ")[-1].strip('"')
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "-"
        state.append(f"{line} {digest}")
    return "\n".join(state)


@pytest.mark.skipif(HAS_GPU, reason="on a GPU the runner is run by hand, --in-place")
def test_runner_and_workspace_leave_tracked_files_alone(tmp_path, capsys):
    before = git_status()
    workspace.main(["--workspace", str(tmp_path / "ws")])
    workspace.main(["--teacher", "--workspace", str(tmp_path / "ws")])
    run_notebooks.main(["00", "--out", str(tmp_path / "executed")])
    assert git_status() == before, "running the course changed files in the repository"
    executed = nbformat.read(tmp_path / "executed" / "00_setup.ipynb", as_version=4)
    outputs = "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    assert "✓ axpy" in outputs, "chapter 00 ran on this machine, exercise included"
    assert "IProgress not found" not in outputs, "install ipywidgets (requirements.txt)"
    assert not MACHINE_PATH.search(json.dumps(executed.dict())), "the runner left a machine path in an output"


@pytest.mark.skipif(HAS_GPU, reason="on a GPU --in-place is allowed")
@pytest.mark.parametrize("flag", ["--in-place", "--refresh"])
def test_runner_refuses_to_overwrite_the_h100_outputs_on_a_cpu(flag):
    before = git_status()
    with pytest.raises(SystemExit, match="GPU only"):
        run_notebooks.main(["00", flag])
    assert git_status() == before


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_is_normalised(notebook):
    nb = nbformat.read(notebook, as_version=4)
    assert nb.metadata.get("kernelspec") == run_notebooks.KERNELSPEC
    assert "version" not in nb.metadata.get("language_info", {}), (
        f"{notebook.name} names the Python of the machine that ran it: "
        "`python -m course_utils.tooling.run_notebooks --normalise`")
    normalised = run_notebooks.normalise(nbformat.read(notebook, as_version=4))
    assert normalised == nb, f"run `python -m course_utils.tooling.run_notebooks --normalise {notebook.name[:2]}`"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_outputs_have_no_machine_paths(notebook):
    nb = nbformat.read(notebook, as_version=4)
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            text = json.dumps({k: v for k, v in output.items() if k != "data"} |
                              {"data": {m: v for m, v in output.get("data", {}).items() if m.startswith("text/")}})
            match = MACHINE_PATH.search(text)
            assert not match, f"{notebook.name}, cell {index}: a machine path in an output: " \
                              f"...{text[max(0, match.start() - 80):match.end() + 40]}..."
            assert "IProgress not found" not in text, f"{notebook.name}, cell {index}: tqdm's warning"


def test_normalise_makes_paths_relative():
    root = Path("/some/checkout")
    text = ("  --> /some/checkout/course_utils/kernels/flash_fwd.py:67:1\n"
            "/opt/venv/lib/python3.12/site-packages/tqdm/auto.py:21: TqdmWarning\n"
            f"{Path.home()}/.tilelang/cache\n")
    assert run_notebooks.scrub_paths(text, root) == (
        "  --> course_utils/kernels/flash_fwd.py:67:1\ntqdm/auto.py:21: TqdmWarning\n~/.tilelang/cache\n")


def test_figures_are_written_only_by_the_run_that_makes_the_committed_notebooks(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from course_utils.pictures import plots

    monkeypatch.setattr(plots, "FIGURES", tmp_path / "figures")
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    monkeypatch.delenv("COURSE_WRITE_FIGURES", raising=False)
    assert plots.save(fig, "demo") == Path("figures/demo.png"), "a relative path: the same output on every machine"
    assert not (tmp_path / "figures").exists(), "a learner's run or a test run rewrote a tracked figure"
    monkeypatch.setenv("COURSE_WRITE_FIGURES", "1")
    plots.save(fig, "demo")
    assert (tmp_path / "figures" / "demo.png").stat().st_size > 0
    plt.close(fig)
