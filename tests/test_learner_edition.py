"""The learner's edition as a learner meets it: blanks in place, Run All with errors allowed.

CI runs the teacher's notebooks with nbval; a learner runs ``workspace/learner/``, where every exercise is a
``raise NotImplementedError``. Here that edition is made with ``workspace.learner_edition`` and executed with
errors allowed: every error must be a checker's one line (``ExerciseIncomplete``, ``ExerciseWrong``), never a
TVM or TileLang traceback, and every cell after a blank must either run on the course's stand-in or stop with
that one line. Each chapter runs its first cell and its exercises up to its listings; chapter 03 also runs the
cells of its body whose names the exercises read (its later cells lower and trace the learner's forward), not the
body's own GPU-sized lowerings, which hold no blank and which CI runs in the teacher's edition. Chapters 05 and 06
are the build path: 05's capstone on the learner's 03 (d), 06 (e) on it again.

No stored output of the learner's edition may claim that the learner's code ran ("✓ … your kernel …"):
checked on every chapter, without running anything.
"""

import ast
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


def _names(source):
    """(names a cell defines, names it reads), from its Python (IPython's % and ! lines dropped)."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    defined, read = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (defined if isinstance(node.ctx, ast.Store) else read).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return defined, read


def _part(nb, body):
    """The cells a learner runs before the listings: the chapter's first code cell (its imports), the cells of
    the body before ``## Exercises`` that ``body`` asks for, and every cell from there on. ``body`` "needed": the
    body cells that define a name the exercises read, and those their own names come from (they hold no blank and
    run as in the teacher's edition, which CI runs whole); "none": no body cell."""
    cells = nb.cells
    heading = [i for i, c in enumerate(cells) if c.cell_type == "markdown"]
    stop = next((i for i in heading if cells[i].source.startswith("## The course's")), len(cells))
    start = next(i for i in heading if cells[i].source.startswith("## Exercises"))
    first = next(i for i, c in enumerate(cells) if c.cell_type == "code")
    chosen = []
    if body == "needed":
        needed, defined_here = set(), set()
        for cell in cells[start:stop]:
            if cell.cell_type == "code":
                defined, read = _names(cell.source)
                defined_here |= defined  # a name a cell both sets and reads is its own (``shape, tiling = ...``)
                needed |= read - defined_here
        for index in range(start - 1, first, -1):  # backwards: a cell reads only what earlier cells define
            if cells[index].cell_type == "code":
                defined, read = _names(cells[index].source)
                if defined & needed:
                    chosen.insert(0, cells[index])
                    needed |= read
    part = nbformat.v4.new_notebook(metadata=nb.metadata)
    part.cells = [cells[first]] + chosen + cells[start:stop]
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


@pytest.mark.parametrize("chapter, body", [("03", "needed"), ("05", "none"), ("06", "none")],
                         ids=["03 exercises and what they read", "05 exercises", "06 exercises"])
def test_the_learner_edition_runs_with_its_blanks(chapter, body):
    from nbclient import NotebookClient

    nb = _part(_learner_notebook(chapter), body)
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
