"""The TileLang exercises: each solution passes its checker, each mutant fails with its diagnosis,
and the learner's edition (solutions stripped) says "not written yet" in one line.

The solutions are read from the notebooks' .py sources, so a change there that drops a mutant's
find text fails here. Every case compiles a kernel on the C backend (a few seconds each); the
checkers stop at the first wrong case, so most mutants cost one compilation, and the mutants are
checked two at a time in worker processes.
"""

import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import jupytext
import pytest
from exercise_harness import NOTEBOOKS, checker, exercise_source, load, mutant_verdict, mutate, strip_solutions
from exercise_mutants import EXERCISES, MUTANTS, VARIANTS

from course_utils.exercises.common import ExerciseFailed, ExerciseIncomplete, ExerciseWrong


@pytest.fixture(scope="module")
def verdicts():
    """(kind, message) of the checker on every mutant, computed in parallel worker processes."""
    workers = max(1, min(2, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(mutant_verdict, range(len(MUTANTS))))


@pytest.mark.parametrize("key", EXERCISES)
def test_solution_passes(key, capsys):
    exercise = EXERCISES[key]
    checker(exercise)(load(exercise, exercise_source(exercise), "solution"))
    assert "✓" in capsys.readouterr().out


@pytest.mark.parametrize("key", EXERCISES)
def test_blank_says_not_written_yet(key):
    exercise = EXERCISES[key]
    source = strip_solutions(exercise_source(exercise))
    assert "raise NotImplementedError" in source
    with pytest.raises(ExerciseIncomplete, match="not written yet") as info:
        checker(exercise)(load(exercise, source, "learner edition"))
    assert "\n" not in str(info.value) and info.value._render_traceback_() == [str(info.value)]


@pytest.mark.parametrize("index", range(len(MUTANTS)), ids=[f"{m.exercise}: {m.name}" for m in MUTANTS])
def test_mutant_gets_its_diagnosis(index, verdicts):
    kind, message = verdicts[index]
    assert kind == "ExerciseWrong", f"{MUTANTS[index].name}: {kind}: {message}"
    assert MUTANTS[index].diagnosis in message, message
    assert "\n" not in message


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v.exercise}: {v.name}")
def test_correct_variant_passes(variant, capsys):
    exercise = EXERCISES[variant.exercise]
    checker(exercise)(load(exercise, mutate(exercise_source(exercise), variant), variant.name))
    assert "✓" in capsys.readouterr().out


def test_every_exercise_has_mutants():
    assert {m.exercise for m in MUTANTS} == set(EXERCISES)


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
    """Chapter 03's cell after exercise 2 calls the learner's kernel_flops: blank, it ends in one line."""
    import course_utils as cu
    from course_utils.exercises import ch03

    cells = [c.source for c in jupytext.read(NOTEBOOKS / "03_flash_forward.py").cells if c.cell_type == "code"]
    solution = next(src for src in cells if src.startswith("def kernel_flops("))
    downstream = next(src for src in cells if src.startswith('with ch03.needs("kernel_flops"'))
    from course_utils.core.labels import OURS

    record = dict(impl=OURS, causal=True, batch=1, heads=1, seq=256, dim=64)
    namespace = {"cu": cu, "ch03": ch03, "rows": [record], "OURS": OURS}
    exec(strip_solutions(solution), namespace)
    with pytest.raises(ExerciseIncomplete, match="`kernel_flops` is not written yet: finish exercise 2"):
        exec(downstream, namespace)


# A GPU-sized configuration of each skeleton: it must lower for the H100 too (no GPU needed).
_GPU_CONFIGS = {
    "ch02_online_softmax": ((4096, 1024), dict(scale=0.5, block_M=8, block_N=64)),
    "ch03_forward": ((1, 8, 1024, 1024, 64), dict(causal=True, block_M=64, block_N=64)),
    "ch05_backward": ((1, 8, 1024, 1024, 64), dict(causal=True, block_M=64, block_N=64)),
    "ch06_window_sinks": ((1, 8, 2, 1024, 1024, 64), dict(window=128, block_M=64, block_N=64)),
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
