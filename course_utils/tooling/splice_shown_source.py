"""Replace the stored outputs of a chapter's ``show_source`` cells that have gone stale with a CPU run's.

A chapter's committed outputs come from its H100 run. When a later change moves or edits the code a
``show_source`` cell prints, ``tests/test_notebooks_paired.py`` finds the stale lines; re-executing the
chapter on the GPU fixes them, and so does this, for the cells whose output does not depend on the device
(what ``show_source`` prints, and the CPU-side lowering checks or diagrams in the same cell): it copies those
cells' outputs from the CPU run's executed copy (``run_notebooks``, ``workspace/executed/``) into the
committed notebook, keeping its execution counts. Only the cells the test names as stale are touched.

    python -m course_utils.tooling.run_notebooks 07            # the CPU run
    python -m course_utils.tooling.splice_shown_source 07      # then this
"""

import argparse
import importlib.util
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]


def _stale_runs():
    spec = importlib.util.spec_from_file_location("paired", ROOT / "tests" / "test_notebooks_paired.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    library = {path: path.read_text().splitlines() for path in (ROOT / "course_utils").rglob("*.py")}
    return lambda notebook: module.stale_runs(notebook, library)


def splice(prefix):
    """Splice chapter ``prefix``'s stale show_source cells; returns the cell numbers replaced."""
    (committed_path,) = (ROOT / "notebooks").glob(f"{prefix}_*.ipynb")
    executed_path = ROOT / "workspace" / "executed" / committed_path.name
    committed = nbformat.read(committed_path, as_version=4)
    executed = nbformat.read(executed_path, as_version=4)
    if [c.source for c in committed.cells] != [c.source for c in executed.cells]:
        raise ValueError(f"{executed_path} was made from other cells than {committed_path}: run the chapter again")
    stale = _stale_runs()
    cells = sorted({int(line.split(",")[0].split()[1]) for line in stale(committed)})
    for number in cells:
        committed.cells[number].outputs = executed.cells[number].outputs
    if stale(committed):
        raise ValueError(f"{committed_path.name} still shows stale lines after splicing: {stale(committed)}")
    nbformat.write(committed, committed_path)
    return cells


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefixes", nargs="+")
    for prefix in parser.parse_args().prefixes:
        print(prefix, "cells replaced:", splice(prefix))
