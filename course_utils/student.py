"""Make the student edition of the notebooks: solutions removed, everything else kept.

    python -m course_utils.student            # writes student/NN_*.ipynb

Inside a solution, the lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` are replaced
by ``raise NotImplementedError`` at the same indentation (the nbgrader convention), and outputs
are cleared, so the exercise checkers tell the learner what is left to do.
"""

import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
_SOLUTION = re.compile(r"^([ \t]*)### BEGIN SOLUTION\n.*?^[ \t]*### END SOLUTION[^\n]*\n?", re.M | re.S)


def strip_solutions(source):
    return _SOLUTION.sub(lambda m: f"{m.group(1)}raise NotImplementedError  # your code here\n", source)


def make_student_edition(out_dir=ROOT / "student"):
    out_dir = Path(out_dir)
    out_dir.mkdir(exist_ok=True)
    written = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.source = strip_solutions(cell.source)
                cell.outputs, cell.execution_count = [], None
        nbformat.write(nb, out_dir / path.name)
        written.append(out_dir / path.name)
    return written


if __name__ == "__main__":
    for p in make_student_edition(*sys.argv[1:]):
        print(p)
