"""Each notebook's .ipynb holds exactly the cells of its paired jupytext .py source."""

import re
from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_ipynb_matches_py(source):
    text = jupytext.read(source)
    notebook = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    assert [c.source for c in notebook.cells] == [c.source for c in text.cells], \
        f"{source.name} and its .ipynb differ: run `.venv/bin/python -m jupytext --sync {source}`"


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_cells_stay_short(source):
    for cell in jupytext.read(source).cells:
        if cell.cell_type == "code":
            assert cell.source.count("\n") < 45, f"a cell of {source.name} has over 45 lines:\n{cell.source[:200]}"



# ---------------------------------------------------------------------------------------------
# Stored outputs of `show_source`: the lines a chapter shows are the course's lines today.

_SHOWN_LINE = re.compile(r"^\s*(\d+) │ ?(.*)$")
_LIBRARY = Path(__file__).resolve().parent.parent / "course_utils"


def shown_runs(text):
    """The runs of consecutive numbered lines ``show_source`` printed in one stored output: [(number, text)]."""
    runs, run = [], []
    for line in text.splitlines():
        m = _SHOWN_LINE.match(line)
        if m and (not run or int(m.group(1)) == run[-1][0] + 1):
            run.append((int(m.group(1)), m.group(2)))
            continue
        if run:
            runs.append(run)
        run = [(int(m.group(1)), m.group(2))] if m else []
    return runs + ([run] if run else [])


def stale_runs(notebook, library):
    """Each run of shown lines that no file of ``library`` ({path: lines}) holds at those line numbers today."""
    stale = []
    for number, cell in enumerate(notebook.cells):
        if cell.cell_type != "code" or "show_source" not in cell.source:
            continue
        text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
        for run in shown_runs(text):
            if not any(all(n <= len(lines) and lines[n - 1].strip() == shown.strip() for n, shown in run)
                       for lines in library.values()):
                stale.append(f"cell {number}, lines {run[0][0]}–{run[-1][0]}: {run[0][1].strip()[:60]}")
    return stale


@pytest.fixture(scope="module")
def library():
    return {path: path.read_text().splitlines() for path in _LIBRARY.rglob("*.py")}


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_shown_source_is_the_source_today(source, library):
    """A chapter's stored ``show_source`` output was printed when its H100 run executed; a later change to the
    code it shows (or above it in its file) leaves the stored lines wrong until the chapter runs again."""
    stale = stale_runs(nbformat.read(source.with_suffix(".ipynb"), as_version=4), library)
    assert not stale, (f"{source.name}: stored source lines no longer in course_utils (re-execute the chapter, or "
                       "replace those cells' outputs with a CPU run's):\n" + "\n".join(stale))


def test_stale_shown_source_is_caught(library):
    """The check above on a planted case: a shown line whose text or number no longer matches."""
    path, lines = next((p, ls) for p, ls in library.items() if len(ls) > 20)
    fresh = "".join(f"{n:4d} │ {lines[n - 1].strip()}\n" for n in (10, 11, 12))
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("show_source(f)", outputs=[
        nbformat.v4.new_output("stream", name="stdout", text=fresh)])])
    assert stale_runs(notebook, {path: lines}) == []
    notebook.cells[0].outputs[0].text = fresh.replace("  10 │", "   9 │").replace("  11 │", "  10 │").replace(
        "  12 │", "  11 │")
    shifted = stale_runs(notebook, {path: lines})
    notebook.cells[0].outputs[0].text = fresh[:-1] + " # changed\n"
    assert shifted and stale_runs(notebook, {path: lines}), "a shifted or edited shown line went unnoticed"
