"""The learner's edition as a learner meets it: blanks in place, Run All with errors allowed.

CI runs the teacher's notebooks with nbval; a learner runs ``workspace/learner/``, where every exercise is a
``raise NotImplementedError``. Here that edition is made with ``workspace.learner_edition`` and executed with
errors allowed: every error must be a checker's one line (``ExerciseIncomplete``, ``ExerciseWrong``), never a
TVM or TileLang traceback, and every cell after a blank must either run on the course's stand-in or stop with
that one line. Chapter 03 runs whole up to its listings (its later cells lower and trace the learner's
forward); chapters 05 and 06 run their first cell and their exercises (the build path: 05's capstone on the
learner's 03 (d), 06 (e) on it again). About a minute and a half on CI's two cores, in one worker.

No stored output of the learner's edition may claim that the learner's code ran ("✓ … your kernel …"):
checked on every chapter, without running anything.
"""

import re
from pathlib import Path

import nbformat
import pytest

from course_utils.tooling.workspace import learner_edition

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
_ONE_LINE = ("ExerciseIncomplete", "ExerciseWrong")
_COMPILER_TRACE = re.compile(r"TVMError|InternalError|tvm\.error|Traceback \(most recent call last\)")


def _learner_notebook(chapter):
    path = next(NOTEBOOKS.glob(f"{chapter}_*.ipynb"))
    return learner_edition(nbformat.read(path, as_version=4))


def _part(nb, whole):
    """The cells a learner runs before the listings: all of them (``whole``), or the first code cell (the
    chapter's imports) and the exercises."""
    cells = nb.cells
    heading = [i for i, c in enumerate(cells) if c.cell_type == "markdown"]
    stop = next((i for i in heading if cells[i].source.startswith("## The course's")), len(cells))
    start = 0 if whole else next(i for i in heading if cells[i].source.startswith("## Exercises"))
    first = next(i for i, c in enumerate(cells) if c.cell_type == "code")
    part = nbformat.v4.new_notebook(metadata=nb.metadata)
    part.cells = ([] if whole else [cells[first]]) + cells[start:stop]
    for cell in part.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return part


def _text(output):
    if output.output_type == "stream":
        return output.get("text", "")
    if output.output_type == "error":
        return "\n".join(output.get("traceback", []))
    return "".join(output.get("data", {}).get("text/plain", ""))


@pytest.mark.parametrize("chapter, whole", [("03", True), ("05", False), ("06", False)],
                         ids=["03 whole", "05 exercises", "06 exercises"])
def test_the_learner_edition_runs_with_its_blanks(chapter, whole):
    from nbclient import NotebookClient

    nb = _part(_learner_notebook(chapter), whole)
    NotebookClient(nb, timeout=600, allow_errors=True, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    problems = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        first_line = cell.source.strip().splitlines()[0][:70] if cell.source.strip() else ""
        for output in cell.outputs:
            if output.output_type == "error" and (output.ename not in _ONE_LINE or len(output.traceback) != 1):
                problems.append(f"cell {index} ({first_line}): {output.ename}: {output.evalue[:200]}")
            elif output.output_type != "error" and _COMPILER_TRACE.search(_text(output)):
                problems.append(f"cell {index} ({first_line}) prints a compiler traceback: {_text(output)[:200]}")
    assert not problems, "\n".join(problems)


def test_no_stored_output_claims_the_learners_code_ran():
    claims = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = learner_edition(nbformat.read(path, as_version=4))
        for index, cell in enumerate(nb.cells):
            for output in cell.get("outputs", []):
                for line in _text(output).splitlines():
                    if re.search(r"✓.*\byour\b|^\s*your kernels?\b", line):
                        claims.append(f"{path.name} cell {index}: {line.strip()[:120]}")
    assert not claims, "\n".join(claims)
