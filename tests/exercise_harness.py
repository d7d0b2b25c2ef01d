"""The exercises that run the learner's code, their mutants, and how a checker is run on either: read the
exercise's cells from its notebook, plant a mutant, load it like a notebook cell and call the checker.

Three lists of exercises use it: ``exercise_mutants.py`` (the flash kernels of chapters 02–06,
``test_exercises_ch02_03_05_06.py``), ``exercise_mutants_speed_and_scale.py`` (chapters 04 and 07–10,
``test_exercises_ch04_07_to_10.py``) and ``exercise_mutants_fp8.py`` (chapter 12, ``test_exercises_ch12.py``).
Mutants are checked in worker processes, which import the list they come from by its module name.
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
    """(kind, message) of the checker on every mutant of ``mutants_module``, two worker processes at a time."""
    count = len(importlib.import_module(mutants_module).MUTANTS)
    workers = max(1, min(2, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(partial(mutant_verdict, mutants_module), range(count)))


# The checks every list of exercises makes; each test module parametrizes them over its own lists.
def assert_passes(exercise, source, label, capsys):
    """The checker accepts ``source`` and says so with a ✓."""
    checker(exercise)(load(exercise, source, label))
    assert "✓" in capsys.readouterr().out


def assert_blank_says_not_written_yet(exercise):
    """The learner's edition (solutions stripped) fails with "not written yet" in one line, without a traceback."""
    import pytest

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
