"""The learner's workspace (course_utils.tooling.workspace): solutions out, stored outputs in, edits never lost."""

import json

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from course_utils.tooling import workspace as ws

PLACEHOLDER = "raise NotImplementedError  # your code here"


# --- stripping a solution -------------------------------------------------------------------

def test_placeholder_text_is_stable():
    # Exercise checkers may look for this exact line: change it only together with them.
    assert ws.PLACEHOLDER == PLACEHOLDER


def test_solution_in_a_function_body():
    source = "def f(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n"
    assert ws.strip_solutions(source) == f"def f(x):\n    {PLACEHOLDER}\n"


def test_solution_inside_a_prim_func_loop_keeps_its_indentation_and_surroundings():
    source = (
        "@T.prim_func\n"
        "def kernel(A: T.Tensor([n], dtype)):\n"
        "    with T.Kernel(1) as bx:\n"
        "        for i in T.grid(n):\n"
        "            ### BEGIN SOLUTION\n"
        "            a[i] = alpha * a[i] + b[i]\n"
        "            c[i] = a[i]\n"
        "            ### END SOLUTION\n"
        "        T.copy(a, C)\n"
    )
    assert ws.strip_solutions(source) == (
        "@T.prim_func\n"
        "def kernel(A: T.Tensor([n], dtype)):\n"
        "    with T.Kernel(1) as bx:\n"
        "        for i in T.grid(n):\n"
        f"            {PLACEHOLDER}\n"
        "        T.copy(a, C)\n"
    )


def test_several_blocks_and_a_block_at_the_very_end():
    source = ("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n\n"
              "def g():\n\t### BEGIN SOLUTION\n\treturn 2\n\t### END SOLUTION")
    assert ws.strip_solutions(source) == f"def f():\n    {PLACEHOLDER}\n\ndef g():\n\t{PLACEHOLDER}"


def test_unbalanced_markers_are_an_error_not_a_leak():
    with pytest.raises(ValueError, match="unbalanced"):
        ws.strip_solutions("def f():\n    ### BEGIN SOLUTION\n    return 1\n")


# --- the learner edition of a notebook ----------------------------------------------------

def _notebook():
    def code(source, text, **kw):
        return new_code_cell(source, outputs=[new_output("stream", name="stdout", text=text)], execution_count=1, **kw)

    return new_notebook(cells=[
        new_markdown_cell("# A chapter"),
        code("x = measure()", "[stored record: H100]\n"),
        new_code_cell("plot()", outputs=[new_output("display_data", data={"image/png": "iVBORw0KGgo="})]),
        new_markdown_cell("## Exercise"),
        code("def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n", "",
             metadata={"tags": ["solution"]}),
        code("check_exercise('double', double)", "✓ double: correct\n"),
        code("print('after the exercise')", "after the exercise\n"),
    ])


def test_learner_edition_removes_the_solution_and_its_checker_output_only():
    original = _notebook()
    learner = ws.learner_edition(original)
    code = [c for c in learner.cells if c.cell_type == "code"]
    assert code[2].source == f"def double(x):\n    {PLACEHOLDER}\n"
    assert "return 2 * x" not in json.dumps(learner)
    assert code[2].outputs == [] and code[3].outputs == [], \
        "the solution's and the checker's outputs give the answer away"
    assert code[3].source == "check_exercise('double', double)"
    assert code[0].outputs[0].text == "[stored record: H100]\n"
    assert code[1].outputs[0].data["image/png"] == "iVBORw0KGgo="
    assert code[4].outputs[0].text == "after the exercise\n"
    assert "return 2 * x" in json.dumps(original), "the teacher's notebook is left as it was"


def test_an_untagged_cell_with_a_solution_block_is_a_solution_cell_too():
    nb = new_notebook(cells=[new_code_cell("### BEGIN SOLUTION\nanswer = 42\n### END SOLUTION\n",
                                           outputs=[new_output("stream", name="stdout", text="42\n")])])
    (cell,) = ws.learner_edition(nb).cells
    assert cell.source == f"{PLACEHOLDER}\n" and cell.outputs == []


@pytest.mark.parametrize("chapter", ws.chapters(), ids=lambda p: p.stem)
def test_committed_chapters_learner_edition(chapter):
    teacher = nbformat.read(chapter, as_version=4)
    learner = ws.learner_edition(teacher)
    text = json.dumps(learner)
    assert ws.BEGIN not in text and ws.END not in text
    solutions = [(t, s) for t, s in zip(teacher.cells, learner.cells) if ws.is_solution_cell(t)]
    for original, stripped in solutions:
        assert PLACEHOLDER in stripped.source
        removed = ws._SOLUTION.findall(original.source)
        assert removed, f"a solution cell of {chapter.name} has no ### BEGIN/END SOLUTION block"
        # Every line of a solution that appears nowhere else in the cell must be gone (a skeleton may
        # share ordinary lines, such as a loop header, with its solution).
        outside = ws._SOLUTION.sub("", original.source)
        hidden = [line.strip() for block in ws._SOLUTION.finditer(original.source)
                  for line in block.group(0).splitlines()[1:-1] if line.strip() and line.strip() not in outside]
        assert hidden, f"{chapter.name}: a solution block with no line of its own"
        for line in hidden:
            assert line not in stripped.source, f"{chapter.name}: solution line left in: {line}"
    # every output outside the exercises is kept (the H100 plots, tables and ✓ lines)
    cleared = sum(1 for t, s in zip(teacher.cells, learner.cells) if t.get("outputs") and not s.get("outputs"))
    assert cleared <= 2 * len(solutions)
    images = lambda nb: sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))  # noqa: E731
    assert images(learner) == images(teacher)


# --- refreshing never destroys a learner's work ----------------------------------------------

@pytest.fixture
def course(tmp_path):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nbformat.write(_notebook(), notebooks / "01_first.ipynb")
    nbformat.write(_notebook(), notebooks / "02_second.ipynb")
    return notebooks, tmp_path / "workspace"


def _edit_upstream(notebooks, name, text):
    nb = nbformat.read(notebooks / name, as_version=4)
    nb.cells[0].source = text
    nbformat.write(nb, notebooks / name)


def test_refresh_writes_missing_copies_then_leaves_them(course):
    notebooks, workspace = course
    assert ws.refresh("learner", workspace, notebooks)["written"] == ["01_first.ipynb", "02_second.ipynb"]
    assert PLACEHOLDER in (workspace / "learner" / "01_first.ipynb").read_text()
    assert ws.refresh("learner", workspace, notebooks)["unchanged"] == ["01_first.ipynb", "02_second.ipynb"]
    (workspace / "learner" / "02_second.ipynb").unlink()
    assert ws.refresh("learner", workspace, notebooks)["written"] == ["02_second.ipynb"]
    teacher = ws.refresh("teacher", workspace, notebooks)
    assert teacher["written"] == ["01_first.ipynb", "02_second.ipynb"]
    assert "return 2 * x" in (workspace / "teacher" / "01_first.ipynb").read_text()


def test_refresh_updates_untouched_copies_and_keeps_edited_ones(course, capsys):
    notebooks, workspace = course
    ws.refresh("learner", workspace, notebooks)
    mine = workspace / "learner" / "01_first.ipynb"
    nb = nbformat.read(mine, as_version=4)
    nb.cells[4].source = "def double(x):\n    return x + x  # my answer\n"
    nbformat.write(nb, mine)
    assert ws.refresh("learner", workspace, notebooks)["unchanged"] == ["01_first.ipynb", "02_second.ipynb"]
    assert "my answer" in mine.read_text()

    _edit_upstream(notebooks, "01_first.ipynb", "# A chapter, revised")
    _edit_upstream(notebooks, "02_second.ipynb", "# A chapter, revised")
    report = ws.refresh("learner", workspace, notebooks)
    assert report["kept"] == ["01_first.ipynb"] and report["updated"] == ["02_second.ipynb"]
    assert "my answer" in mine.read_text()
    assert "revised" in (workspace / "learner" / "02_second.ipynb").read_text()
    message = ws.describe(report, "learner", workspace)
    assert "kept" in message and "01_first.ipynb" in message and "--reset 01" in message

    # a kept copy stays kept on every later refresh, until reset
    assert ws.refresh("learner", workspace, notebooks)["kept"] == ["01_first.ipynb"]
    (backup,) = ws.reset("01", "learner", workspace)
    assert "my answer" in backup.read_text() and backup.parent == workspace / "backup" / "learner"
    assert ws.refresh("learner", workspace, notebooks)["written"] == ["01_first.ipynb"]
    assert "revised" in mine.read_text() and "my answer" not in mine.read_text()
    assert ws.refresh("learner", workspace, notebooks)["unchanged"] == ["01_first.ipynb", "02_second.ipynb"]


def test_running_cells_is_not_editing(course):
    notebooks, workspace = course
    ws.refresh("learner", workspace, notebooks)
    mine = workspace / "learner" / "01_first.ipynb"
    nb = nbformat.read(mine, as_version=4)
    nb.cells[1].outputs = [new_output("stream", name="stdout", text="[stored record: CPU]\n")]
    nb.metadata["language_info"]["version"] = "3.99.0"
    nbformat.write(nb, mine)
    _edit_upstream(notebooks, "01_first.ipynb", "# A chapter, revised")
    assert ws.refresh("learner", workspace, notebooks)["updated"] == ["01_first.ipynb"]


def test_without_a_manifest_only_identical_copies_are_adopted(course):
    notebooks, workspace = course
    ws.refresh("learner", workspace, notebooks)
    mine = workspace / "learner" / "01_first.ipynb"
    nb = nbformat.read(mine, as_version=4)
    nb.cells[4].source = "my answer"
    nbformat.write(nb, mine)
    (workspace / ".manifest.json").unlink()
    _edit_upstream(notebooks, "01_first.ipynb", "# A chapter, revised")
    report = ws.refresh("learner", workspace, notebooks)
    assert report["kept"] == ["01_first.ipynb"] and report["unchanged"] == ["02_second.ipynb"]
    assert "my answer" in mine.read_text()


def test_workspace_copies_stand_alone(course):
    notebooks, workspace = course
    nb = _notebook()
    nb.metadata["jupytext"] = {"formats": "ipynb,py:percent"}
    nbformat.write(nb, notebooks / "01_first.ipynb")
    ws.refresh("learner", workspace, notebooks)
    copy = nbformat.read(workspace / "learner" / "01_first.ipynb", as_version=4)
    assert "jupytext" not in copy.metadata, "a paired copy would make Lab write a .py beside it"


def test_a_cell_printing_an_earlier_answer_keeps_no_output_in_the_learner_edition():
    printed = new_code_cell('your_code("03", "d")', outputs=[new_output("stream", name="stdout", text="def f(): ...")])
    kept = new_code_cell("print(1)", outputs=[new_output("stream", name="stdout", text="1")])
    learner = ws.learner_edition(new_notebook(cells=[printed, kept]))
    assert learner.cells[0].outputs == [] and learner.cells[1].outputs


def test_the_checkers_and_the_workspace_agree_on_its_names():
    """`./course lab` runs tooling/workspace.py as a file, without the package: its copies of the two names
    the checkers use must stay the same as course_utils.exercises.common's."""
    from course_utils.exercises import common
    from course_utils.tooling import workspace as tooling_workspace

    assert tooling_workspace.PLACEHOLDER == common.PLACEHOLDER
    assert tooling_workspace.WORKSPACE == common.WORKSPACE
