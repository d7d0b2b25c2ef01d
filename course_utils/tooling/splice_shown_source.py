"""Replace the stored outputs of a chapter's ``show_source`` cells that have gone stale with a CPU run's.

A chapter's committed outputs come from its H100 run. When a later change moves or edits the code a
``show_source`` cell prints, ``tests/test_notebooks_paired.py`` finds the stale lines; re-executing the
chapter on the GPU fixes them, and so does this, for the cells whose output does not depend on the device
(what ``show_source`` prints, and the CPU-side lowering checks or diagrams in the same cell): it copies those
cells' outputs from the CPU run's executed copy (``run_notebooks``, ``workspace/executed/``) into the
committed notebook, keeping its execution counts. Only the cells the test names as stale are touched.

    python -m course_utils.tooling.run_notebooks 07            # the CPU run
    python -m course_utils.tooling.splice_shown_source 07      # then this

``--record-cells N ...`` also copies the named cells, for a cell whose output is computed from stored records
alone (a claims cell whose prose was corrected after the GPU run, or a cell added since): on the CPU it prints
what the GPU would. The cell must not time or run a kernel; say which in the commit.
"""

import argparse
from pathlib import Path

import nbformat

from course_utils.core.source import shown_runs

ROOT = Path(__file__).resolve().parents[2]


def course_library():
    """Every Python file of ``course_utils`` as it is today: {path: lines}."""
    return {path: path.read_text().splitlines() for path in (ROOT / "course_utils").rglob("*.py")}


def stale_listings(notebook, library):
    """(cell number, run) for each run of lines a ``show_source`` cell of ``notebook`` printed that no file of
    ``library`` holds at those line numbers today (``shown_runs``' runs: [(line number, code), ...])."""
    stale = []
    for number, cell in enumerate(notebook.cells):
        if cell.cell_type != "code" or "show_source" not in cell.source:
            continue
        text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
        for run in shown_runs(text):
            if not any(all(n <= len(lines) and lines[n - 1].strip() == code.strip() for n, code in run)
                       for lines in library.values()):
                stale.append((number, run))
    return stale


def splice(prefix, library=None, record_cells=()):
    """Splice chapter ``prefix``'s stale show_source cells (and ``record_cells``); returns the cell numbers
    replaced."""
    library = course_library() if library is None else library
    (committed_path,) = (ROOT / "notebooks").glob(f"{prefix}_*.ipynb")
    executed_path = ROOT / "workspace" / "executed" / committed_path.name
    committed = nbformat.read(committed_path, as_version=4)
    executed = nbformat.read(executed_path, as_version=4)
    if [c.source for c in committed.cells] != [c.source for c in executed.cells]:
        raise ValueError(f"{executed_path} was made from other cells than {committed_path}: run the chapter again")
    cells = sorted({number for number, _ in stale_listings(committed, library)} | set(record_cells))
    for number in cells:
        committed.cells[number].outputs = executed.cells[number].outputs
        # A cell added since the GPU run has no execution count, and nbval fails a cell with outputs and none.
        if committed.cells[number].get("execution_count") is None:
            committed.cells[number].execution_count = executed.cells[number].execution_count
    still = stale_listings(committed, library)
    if still:
        raise ValueError(f"{committed_path.name} still shows stale lines after splicing, in cells "
                         f"{sorted({number for number, _ in still})}")
    if cells:
        nbformat.write(committed, committed_path)
    return cells


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefixes", nargs="+")
    parser.add_argument("--record-cells", type=int, nargs="*", default=(),
                        help="cells (of the one chapter named) whose output comes from stored records alone")
    args = parser.parse_args()
    if args.record_cells and len(args.prefixes) != 1:
        parser.error("--record-cells names cells of one chapter")
    library = course_library()
    for prefix in args.prefixes:
        print(prefix, "cells replaced:", splice(prefix, library, args.record_cells))
