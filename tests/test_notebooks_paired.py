"""Each notebook's .ipynb holds exactly the cells of its paired jupytext .py source, and its stored source listings
are the code as it is today."""

from pathlib import Path

import jupytext
import nbformat
import pytest

from course_utils.tooling.splice_shown_source import course_library, stale_listings

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

def stale_lines(notebook, library):
    """``stale_listings``, one readable line each."""
    return [f"cell {number}, lines {run[0][0]}–{run[-1][0]}: {run[0][1].strip()[:60]}"
            for number, run in stale_listings(notebook, library)]


@pytest.fixture(scope="module")
def library():
    return course_library()


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_shown_source_is_the_source_today(source, library):
    """A chapter's stored ``show_source`` output was printed when its H100 run executed; a later change to the
    code it shows (or above it in its file) leaves the stored lines wrong until the chapter runs again."""
    stale = stale_lines(nbformat.read(source.with_suffix(".ipynb"), as_version=4), library)
    assert not stale, (f"{source.name}: stored source lines no longer in course_utils (re-execute the chapter, or "
                       "replace those cells' outputs with a CPU run's):\n" + "\n".join(stale))


def test_stale_shown_source_is_caught(library):
    """The check above on a planted case: a shown line whose text or number no longer matches."""
    path, lines = next((p, ls) for p, ls in library.items() if len(ls) > 20)
    fresh = "".join(f"{n:4d} │ {lines[n - 1].strip()}\n" for n in (10, 11, 12))
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("show_source(f)", outputs=[
        nbformat.v4.new_output("stream", name="stdout", text=fresh)])])
    assert stale_listings(notebook, {path: lines}) == []
    notebook.cells[0].outputs[0].text = fresh.replace("  10 │", "   9 │").replace("  11 │", "  10 │").replace(
        "  12 │", "  11 │")
    shifted = stale_listings(notebook, {path: lines})
    notebook.cells[0].outputs[0].text = fresh[:-1] + " # changed\n"
    assert shifted and stale_listings(notebook, {path: lines}), "a shifted or edited shown line went unnoticed"
