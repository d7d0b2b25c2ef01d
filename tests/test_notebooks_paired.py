"""Each notebook's .ipynb holds exactly the cells of its paired jupytext .py source."""

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

