"""The TileLang exercises: each solution passes its checker, each mutant fails with its diagnosis,
and the learner's edition (solutions stripped) says "not written yet" in one line.

The solutions are read from the notebooks' .py sources, so a change there that drops a mutant's
find text fails here. Every case compiles a kernel on the C backend (a few seconds each); the
checkers stop at the first wrong case, so most mutants cost one compilation, and the mutants are
checked in worker processes (two at a time, or one beside each pytest-xdist worker on two cores).
"""

import jupytext
import pytest
from exercise_harness import NOTEBOOKS, checker, exercise_source, exercise_tests, load, strip_solutions
from exercise_mutants import EXERCISES

from course_utils.exercises.common import ExerciseFailed, ExerciseIncomplete, ExerciseWrong

# Solutions, learner's editions, mutants and correct variants of exercise_mutants.py (exercise_harness.py).
globals().update(exercise_tests("exercise_mutants"))


def test_build_error_is_one_line():
    exercise = EXERCISES["ch03_forward"]
    source = exercise_source(exercise).replace("T.copy(m, m_prev)", "T.copy(m, m_previous)")
    with pytest.raises(ExerciseWrong, match="does not build: NameError") as info:
        checker(exercise)(load(exercise, source, "typo"))
    assert "\n" not in str(info.value) and "m_previous" in str(info.value)


def test_failures_render_as_one_line():
    assert issubclass(ExerciseWrong, ExerciseFailed) and issubclass(ExerciseWrong, AssertionError)
    assert ExerciseWrong("✗ x: wrong")._render_traceback_() == ["✗ x: wrong"]


def test_cell_using_a_blank_function_says_not_written_yet():
    """Chapter 03's cell after exercise (b) calls the learner's kernel_flops: blank, it ends in one line."""
    import course_utils as cu
    from course_utils.exercises import ch03

    cells = [c.source for c in jupytext.read(NOTEBOOKS / "03_flash_forward.py").cells if c.cell_type == "code"]
    solution = next(src for src in cells if src.startswith("def kernel_flops("))
    downstream = next(src for src in cells if 'with ch03.needs("kernel_flops"' in src)
    from course_utils.core.labels import OURS

    record = dict(impl=OURS, causal=True, batch=1, heads=1, seq=256, dim=64)
    namespace = {"cu": cu, "ch03": ch03, "rows": [record], "OURS": OURS}
    exec(strip_solutions(solution), namespace)
    with pytest.raises(ExerciseIncomplete, match=r"`kernel_flops` is not written yet: finish exercise \(b\)"):
        exec(downstream, namespace)


# A GPU-sized configuration of each skeleton: it must lower for the H100 too (no GPU needed).
_GPU_CONFIGS = {
    "ch02_online_softmax": ((4096, 1024), dict(scale=0.5, block_M=8, block_N=64)),
    "ch03_forward": ((1, 8, 1024, 1024, 64), dict(causal=True, block_M=64, block_N=64)),
    "ch05_backward": ((1, 8, 1024, 1024, 64), dict(causal=True, block_M=64, block_N=64)),
    "ch06_window_sinks": ((1, 8, 2, 1024, 1024, 64), dict(window=128, block_M=64, block_N=64)),
    "ch03_full_forward": ((1, 8, 1024, 1024, 64), dict(causal=True, block_M=64, block_N=64)),
    "ch05_delta": ((1, 8, 1024, 64), dict(block_M=64)),
    "ch05_dkdv": ((1, 8, 1024, 1024, 64), dict(causal=True, block_M=64, block_N=64)),
    "ch05_dq": ((1, 8, 1024, 1024, 64), dict(causal=True, block_M=64, block_N=64)),
    "ch06_own_gpt_oss": ((1, 8, 2, 1024, 1024, 64), dict(window=128, block_M=64, block_N=64)),
}


@pytest.mark.parametrize("key", EXERCISES)
def test_solution_lowers_for_the_h100(key):
    import tilelang
    from tilelang import tvm

    exercise = EXERCISES[key]
    args, kwargs = _GPU_CONFIGS[key]
    prim_func = load(exercise, exercise_source(exercise), "cuda")(*args, **kwargs, target="cuda")
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        assert "__global__" in tilelang.lower(prim_func).kernel_source


# --- The chapter 05 capstone: the learner's kernels wrapped in a torch.autograd.Function ------------

def _capstone(edit=None, strip=False, forward_edit=None):
    """The learner's flash_attention of chapter 05 (g), built from the notebook's solution cells (05 d–g)
    and the course's forward of chapter 03 (d) (with ``forward_edit`` = (find, replace) applied)."""
    from course_utils.exercises.help import _PRELUDE, _load, solution_cells

    forward_cells = solution_cells("03", "d")
    if forward_edit:
        assert any(forward_edit[0] in c for c in forward_cells), forward_edit[0]
        forward_cells = [c.replace(*forward_edit) for c in forward_cells]
    forward = _load(forward_cells, "my_flash_forward", f"course 03d {abs(hash(forward_edit))}")
    cells = [c for letter in "defg" for c in solution_cells("05", letter)]
    text = "\n\n".join(cells)
    if edit:
        assert edit[0] in text, edit[0]
        text = text.replace(*edit)
    if strip:
        text = strip_solutions(text)
    import linecache

    filename = f"<05 capstone {abs(hash(text))}>"
    source = _PRELUDE + text
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "capstone", "my_flash_forward": forward}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["my_flash_attention"]


def test_capstone_passes_its_gradient_check(capsys):
    from course_utils.exercises.ch05 import check_my_flash_attention

    check_my_flash_attention(_capstone())
    assert "✓ your flash_attention" in capsys.readouterr().out


def test_capstone_with_dk_and_dv_swapped_is_named():
    from course_utils.exercises.ch05 import check_my_flash_attention

    with pytest.raises(ExerciseWrong, match="holds the other gradient") as info:
        check_my_flash_attention(_capstone(("return dq, dk, dv, None", "return dq, dv, dk, None")))
    assert "\n" not in str(info.value)


# Kernel bugs that the capstone's end-to-end check passed with its fixed shapes; it now fails on a drawn shape and
# names the kernel, with that kernel's own diagnosis.
@pytest.mark.parametrize("edit, forward_edit, named", [
    (("(kb * block_N - past) // block_M", "T.ceildiv(kb * block_N - past, block_M)"), None, ("my_dkdv", "rounded up")),
    (None, ("T.fill(m, neg_inf)", "T.fill(m, 0)"), ("my_flash_forward", "running max starts at 0")),
], ids=["dK/dV start rounded up", "forward's max started at 0"])
def test_capstone_names_the_wrong_kernel(edit, forward_edit, named):
    from course_utils.exercises.ch05 import check_my_flash_attention

    with pytest.raises(ExerciseWrong) as info:
        check_my_flash_attention(_capstone(edit, forward_edit=forward_edit))
    message = str(info.value)
    assert "\n" not in message and f"`{named[0]}` is wrong on this shape alone" in message and named[1] in message


def test_capstone_blank_says_not_written_yet():
    from course_utils.exercises.ch05 import check_my_flash_attention

    with pytest.raises(ExerciseIncomplete, match="not written yet"):
        check_my_flash_attention(_capstone(strip=True))


# --- Help in tiers, and a solution cell that did not run --------------------------------------------

def test_hints_and_solutions_exist_for_every_tagged_exercise(capsys):
    from course_utils.exercises import hint, solution
    from course_utils.exercises.help import exercises_of, solution_cells

    for chapter in ("00", "01", "02", "03", "05", "06"):
        for letter in exercises_of(chapter):
            assert solution_cells(chapter, letter), f"{chapter}{letter}: no cell tagged solution + ex-{letter}"
            hint(chapter, letter, 1)
            hint(chapter, letter, 2)
            solution(chapter, letter)
            out = capsys.readouterr().out
            assert f"Hint 1 for exercise {chapter}{letter}" in out and "### BEGIN SOLUTION" in out


@pytest.mark.parametrize("args, error", [(("3", "a", 1), ValueError), (("03", "z", 1), ValueError),
                                         (("03", "a", 3), ValueError), ((3.0, "a", 1), TypeError),
                                         (("03", 1, 1), TypeError)])
def test_bad_help_requests_name_the_argument(args, error):
    from course_utils.exercises import hint

    with pytest.raises(error, match="chapter|exercise|tier"):
        hint(*args)


def test_a_solution_cell_with_a_syntax_error_is_reported_not_rechecked():
    import linecache

    from course_utils.exercises.common import stale_definition

    cell = "def f(x):\n    return 2 * x\n"
    linecache.cache["<cell 1>"] = (len(cell), None, cell.splitlines(True), "<cell 1>")
    namespace = {}
    exec(compile(cell, "<cell 1>", "exec"), namespace)
    f = namespace["f"]
    assert stale_definition("f", f, history=["", cell, "check(f)"]) is None
    broken = stale_definition("f", f, history=["", cell, "def f(x):\n    return 3 * x +\n", "check(f)"])
    assert broken is not None and "SyntaxError (line 2" in str(broken) and "previous `f`" in str(broken)
    edited = stale_definition("f", f, history=["", cell, "def f(x):\n    return 3 * x\n", "check(f)"])
    assert edited is not None and "did not run" not in str(edited) and "run that cell" in str(edited)


def test_a_blank_kernel_in_check_exercise_logs_no_builder_dump(caplog):
    """Chapter 00's first exercise: a placeholder inside a prim_func gives one line, no CRITICAL dump."""
    import logging

    import tilelang.language as T

    from course_utils.exercises import check_exercise

    def blank_kernel(n):
        @T.prim_func
        def kernel(A: T.Tensor([n], "float32")):
            with T.Kernel(1):
                raise NotImplementedError  # your code here
        return kernel

    with caplog.at_level(logging.DEBUG), pytest.raises(ExerciseIncomplete, match="not written yet"):
        check_exercise("axpy", lambda n: blank_kernel(n), lambda n: None, [(4,)])
    assert not [r for r in caplog.records if r.levelno >= logging.CRITICAL]


def test_a_kernel_that_only_the_gpu_compiler_rejects_fails_on_the_cpu():
    exercise = EXERCISES["ch03_full_forward"]
    source = exercise_source(exercise).replace("T.copy(S, P)\n        T.gemm(P, V_s, acc_o)", "T.gemm(S, V_s, acc_o)")
    with pytest.raises(ExerciseWrong, match="lowered for sm_90a") as info:
        checker(exercise)(load(exercise, source, "fragment into gemm"))
    assert "\n" not in str(info.value) and "shared tile" in str(info.value)


# --- A checker run before the exercise it needs -------------------------------------------------------

def test_a_checker_run_before_its_exercise_names_that_exercise(capsys):
    """In IPython, `check_my_dq(my_dq)` before exercise (f)'s cell ran: one line naming 05 (f), not a NameError."""
    from IPython.core.interactiveshell import InteractiveShell

    from course_utils.exercises.help import name_errors_name_their_exercise

    shell = InteractiveShell.instance()
    try:
        name_errors_name_their_exercise(shell)
        shell.run_cell("from course_utils.exercises import ch05\nch05.check_my_dq(my_dq)")
        shell.run_cell("undefined_name_of_nobody")
    finally:
        shell.set_custom_exc((), None)
        InteractiveShell.clear_instance()
    out = capsys.readouterr()
    assert "`my_dq` is not defined yet: it comes from exercise 05 (f)" in out.out
    assert "NameError" in out.out + out.err and "undefined_name_of_nobody" in out.out + out.err  # others untouched


def test_the_capstone_without_an_earlier_kernel_names_its_exercise():
    from course_utils.exercises.ch05 import check_my_flash_attention

    fn = _capstone()
    del fn.__globals__["my_delta"]
    with pytest.raises(ExerciseIncomplete, match=r"`my_delta` is not defined yet: it comes from exercise 05 \(d\)"):
        check_my_flash_attention(fn)


def test_your_code_never_prints_the_courses_answer(capsys, monkeypatch):
    from course_utils.exercises import help as exercise_help

    monkeypatch.setattr(exercise_help, "_learner_cells", lambda chapter, letter, workspace=None: None)
    exercise_help.your_code("03", "d")
    out = capsys.readouterr().out
    assert 'solution("03", "d")' in out and "def my_flash_forward" not in out and out.count("\n") == 1
