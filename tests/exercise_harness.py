"""Read a kernel exercise from its notebook, plant a mutant, and run the checker on it (used by
``test_exercise_kernels.py``, also in worker processes)."""

import importlib
import linecache
import re
from pathlib import Path

import jupytext
from exercise_mutants import EXERCISES, MUTANTS, PRELUDE

from course_utils.tooling.workspace import strip_solutions  # noqa: F401  (the learner's edition of a cell)

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


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
    text = PRELUDE + "\n" + source
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


def mutant_verdict(index):
    """Run the checker on mutant ``index``: (exception class name or "passed", message)."""
    import course_utils  # noqa: F401  (quiets TileLang's logging, as in the notebooks)

    mutant = MUTANTS[index]
    exercise = EXERCISES[mutant.exercise]
    try:
        checker(exercise)(load(exercise, mutate(exercise_source(exercise), mutant), mutant.name))
    except Exception as exc:  # the verdict is the point; AssertionError from mutate included
        return type(exc).__name__, str(exc)
    return "passed", ""
