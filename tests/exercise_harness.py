"""The exercises that run the learner's code, their mutants, and how a checker is run on either: read the
exercise's cells from its notebook, plant a mutant, load it like a notebook cell and call the checker.

Three lists of exercises use it: ``exercise_mutants.py`` (the flash kernels of chapters 02–06,
``test_exercises_ch02_03_05_06.py``), ``exercise_mutants_speed_and_scale.py`` (chapters 04 and 07–10,
``test_exercises_ch04_07_to_10.py``) and ``exercise_mutants_fp8.py`` (chapter 12, ``test_exercises_ch12.py``).
Each test module gets the tests every list needs from ``exercise_tests`` and adds its own.
Mutants are checked in worker processes (``mutant_verdicts`` says how many), which import the list they come from by
its module name.
"""

import importlib
import linecache
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from multiprocessing import get_context
from pathlib import Path

import jupytext
import pytest

from course_utils.tooling.workspace import strip_solutions  # noqa: F401  (the learner's edition of a cell)

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@dataclass(frozen=True)
class Exercise:
    notebook: str  # stem of notebooks/<stem>.py
    defines: tuple  # functions whose cells make up the exercise (skeleton and solution)
    checker: str  # "module:function" in course_utils.exercises
    factory: str  # the name passed to the checker
    prelude: str  # what the chapter's earlier cells provide (imports, constants)


@dataclass(frozen=True)
class Mutant:
    exercise: str
    name: str
    edits: tuple  # ((find, replace), ...): each find text must occur; every occurrence is replaced
    diagnosis: str  # must appear in the checker's message ("" for a correct variant)


def exercise_source(exercise):
    """The source of the notebook cells that define the exercise's functions, in notebook order."""
    cells = [c.source for c in jupytext.read(NOTEBOOKS / f"{exercise.notebook}.py").cells if c.cell_type == "code"]
    chosen = [src for src in cells if any(re.search(rf"^def {name}\(", src, re.M) for name in exercise.defines)]
    defined = {name for name in exercise.defines if any(re.search(rf"^def {name}\(", src, re.M) for src in chosen)}
    assert defined == set(exercise.defines), f"{exercise.notebook}: no cell defines {set(exercise.defines) - defined}"
    return "\n\n".join(chosen)


def load(exercise, source, label):
    """Execute ``source`` like a notebook cell (TileLang reads a function's source through linecache)."""
    filename = f"<{exercise.notebook} {label}>"
    text = exercise.prelude + "\n" + source
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace = {"__name__": f"exercise_{abs(hash(filename))}"}
    exec(compile(text, filename, "exec"), namespace)
    return namespace[exercise.factory]


def checker(exercise):
    module, function = exercise.checker.split(":")
    return getattr(importlib.import_module(f"course_utils.exercises.{module}"), function)


def mutate(source, mutant):
    for find, replace in mutant.edits:
        assert find in source, f"mutant {mutant.name!r}: {find!r} is no longer in the solution"
        source = source.replace(find, replace)
    return source


def mutant_verdict(mutants_module, index):
    """Run the checker on mutant ``index`` of ``mutants_module``: (exception class name or "passed", message)."""
    import course_utils  # noqa: F401  (quiets TileLang's logging, as in the notebooks)

    mutants = importlib.import_module(mutants_module)
    mutant = mutants.MUTANTS[index]
    exercise = mutants.EXERCISES[mutant.exercise]
    try:
        checker(exercise)(load(exercise, mutate(exercise_source(exercise), mutant), mutant.name))
    except Exception as exc:  # the verdict is the point; AssertionError from mutate included
        return type(exc).__name__, str(exc)
    return "passed", ""


def mutant_verdicts(mutants_module):
    """(kind, message) of the checker on every mutant of ``mutants_module``, in two worker processes at a time, or
    in as many as the cores pytest-xdist's workers leave to each (``./course test`` on two cores: one). A second
    process beside another xdist worker finishes no sooner there, and costs its start (importing torch and TileLang)
    and its own compiler warm-up: measured on two cores, 12 CPU-seconds more for chapters 04 and 07-10's mutants."""
    count = len(importlib.import_module(mutants_module).MUTANTS)
    cores = (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    workers = max(1, min(2, cores))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(partial(mutant_verdict, mutants_module), range(count)))


# The checks every list of exercises makes; ``exercise_tests`` parametrizes them over one list.
def assert_passes(exercise, source, label, capsys):
    """The checker accepts ``source`` and says so with a ✓."""
    checker(exercise)(load(exercise, source, label))
    assert "✓" in capsys.readouterr().out


def assert_blank_says_not_written_yet(exercise):
    """The learner's edition (solutions stripped) fails with "not written yet" in one line, without a traceback."""
    from course_utils.exercises.common import ExerciseIncomplete

    source = strip_solutions(exercise_source(exercise))
    assert "raise NotImplementedError" in source
    with pytest.raises(ExerciseIncomplete, match="not written yet") as info:
        checker(exercise)(load(exercise, source, "learner edition"))
    assert "\n" not in str(info.value) and info.value._render_traceback_() == [str(info.value)]


def assert_diagnosed(mutant, verdict):
    """The checker failed ``mutant`` as wrong, naming its diagnosis in one line."""
    kind, message = verdict
    assert kind == "ExerciseWrong", f"{mutant.name}: {kind}: {message}"
    assert mutant.diagnosis in message, message
    assert "\n" not in message


# The tests every list of exercises gets, made per list: a test module binds them into its globals, where pytest
# collects them under these names (tests/conftest.py schedules test_mutant_gets_its_diagnosis by its name).
def exercise_tests(mutants_module, why_mutant_is_skipped=None):
    """The shared tests of the list in ``mutants_module`` by name, for ``globals().update(exercise_tests(...))``.

    ``why_mutant_is_skipped(mutant)`` says why this machine cannot check a mutant, or None where it can."""
    mutants = importlib.import_module(mutants_module)
    tests = {"verdicts": _verdicts_fixture(mutants_module), **_solution_tests(mutants.EXERCISES),
             "test_mutant_gets_its_diagnosis": _mutant_test(mutants.MUTANTS, why_mutant_is_skipped)}
    if mutants.VARIANTS:  # an empty parametrization would still collect one (skipped) case
        tests["test_correct_variant_passes"] = _variant_test(mutants.EXERCISES, mutants.VARIANTS)
    tests["test_every_exercise_has_mutants"] = _coverage_test(mutants.EXERCISES, mutants.MUTANTS)
    return tests


def _verdicts_fixture(mutants_module):
    @pytest.fixture(scope="module")
    def verdicts():
        """(kind, message) of the checker on every mutant, computed once per test module in worker processes."""
        return mutant_verdicts(mutants_module)

    return verdicts


def _solution_tests(exercises):
    @pytest.mark.parametrize("key", exercises)
    def test_solution_passes(key, capsys):
        """The course's solution passes its own checker: a checker that rejects it is wrong, not the learner."""
        exercise = exercises[key]
        assert_passes(exercise, exercise_source(exercise), "solution", capsys)

    @pytest.mark.parametrize("key", exercises)
    def test_blank_says_not_written_yet(key):
        """What the learner starts from fails in one line that says so, not with a traceback."""
        assert_blank_says_not_written_yet(exercises[key])

    return {"test_solution_passes": test_solution_passes,
            "test_blank_says_not_written_yet": test_blank_says_not_written_yet}


def _mutant_test(mutants, why_skipped):
    @pytest.mark.parametrize("index", range(len(mutants)), ids=[f"{m.exercise}: {m.name}" for m in mutants])
    def test_mutant_gets_its_diagnosis(index, verdicts):
        """Each planted bug is caught, and named the way a learner who wrote it needs to read."""
        reason = why_skipped and why_skipped(mutants[index])
        if reason:
            pytest.skip(reason)
        assert_diagnosed(mutants[index], verdicts[index])

    return test_mutant_gets_its_diagnosis


def _variant_test(exercises, variants):
    @pytest.mark.parametrize("variant", variants, ids=lambda v: f"{v.exercise}: {v.name}")
    def test_correct_variant_passes(variant, capsys):
        """A correct rewrite of the solution passes too: the checker tests the result, not the course's wording."""
        exercise = exercises[variant.exercise]
        assert_passes(exercise, mutate(exercise_source(exercise), variant), variant.name, capsys)

    return test_correct_variant_passes


def _coverage_test(exercises, mutants):
    def test_every_exercise_has_mutants():
        """An exercise without mutants has a checker that nothing shows can fail."""
        assert {m.exercise for m in mutants} == set(exercises)

    return test_every_exercise_has_mutants
