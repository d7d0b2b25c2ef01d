"""Help on an exercise, in tiers, on request: the idea, then the API, then the answer.

    from course_utils.exercises import hint, solution
    hint("03", "a", 1)     # tier 1: the idea, no code
    hint("03", "a", 2)     # tier 2: the TileLang / PyTorch API to use, still not the solution
    solution("03", "a")    # the solution cell(s), read from the committed notebooks/03_*.py

An exercise is chapter ``"NN"`` plus a letter. Its hints are ``HINTS[letter]`` (a list of two
strings) in ``course_utils/exercises/chNN.py``; its solution is every code cell of the chapter's
``.py`` tagged both ``solution`` and ``ex-<letter>``, so the answer printed is always the one the
notebook runs. Nothing here is printed unless asked for: the learner's edition shows no solution
code before its exercise.
"""

import importlib
import re
from pathlib import Path

__all__ = ["hint", "solution", "solution_cells", "exercises_of"]

TIERS = (1, 2)


def _chapter(chapter):
    if isinstance(chapter, bool) or not isinstance(chapter, (str, int)):
        raise TypeError(f"chapter must be a string such as \"03\", not {type(chapter).__name__}")
    text = f"{chapter:02d}" if isinstance(chapter, int) else chapter.strip()
    if not re.fullmatch(r"\d\d", text):
        raise ValueError(f"chapter must be two digits such as \"03\", not {chapter!r}")
    return text


def _letter(exercise):
    if not isinstance(exercise, str):
        raise TypeError(f"exercise must be a letter such as \"a\", not {type(exercise).__name__}")
    text = exercise.strip().lower()
    if not re.fullmatch(r"[a-z]", text):
        raise ValueError(f"exercise must be one letter such as \"a\", not {exercise!r}")
    return text


def _hints(chapter):
    try:
        module = importlib.import_module(f"course_utils.exercises.ch{chapter}")
    except ModuleNotFoundError:
        raise ValueError(f"chapter {chapter!r} has no exercises") from None
    return getattr(module, "HINTS", {})


def _notebooks_dir():
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "notebooks").is_dir():
            return parent / "notebooks"
    raise FileNotFoundError("cannot find the course's notebooks/ folder above " + str(here))


def _notebook(chapter):
    found = sorted(_notebooks_dir().glob(f"{chapter}_*.py"))
    if not found:
        raise ValueError(f"chapter {chapter!r}: no notebooks/{chapter}_*.py")
    return found[0]


def solution_cells(chapter, exercise):
    """The sources of the code cells of chapter ``chapter`` tagged ``solution`` and ``ex-<exercise>``."""
    import jupytext

    chapter, letter = _chapter(chapter), _letter(exercise)
    cells = jupytext.read(_notebook(chapter)).cells
    return [c.source for c in cells if c.cell_type == "code"
            and {"solution", f"ex-{letter}"} <= set(c.metadata.get("tags", []))]


def exercises_of(chapter):
    """The letters of the chapter's exercises that have hints or a tagged solution cell."""
    import jupytext

    chapter = _chapter(chapter)
    letters = set(_hints(chapter))
    for cell in jupytext.read(_notebook(chapter)).cells:
        letters |= {t[3:] for t in cell.metadata.get("tags", []) if re.fullmatch(r"ex-[a-z]", t)}
    return sorted(letters)


def _unknown(chapter, letter):
    known = exercises_of(chapter)
    listed = ", ".join(f'"{x}"' for x in known) or "none"
    return ValueError(f"chapter {chapter} has no exercise {letter!r} (its exercises: {listed})")


def hint(chapter, exercise, tier=1):
    """Print hint ``tier`` (1: the idea, 2: the API) of exercise ``exercise`` of chapter ``chapter``."""
    chapter, letter = _chapter(chapter), _letter(exercise)
    if isinstance(tier, bool) or not isinstance(tier, int):
        raise TypeError(f"tier must be 1 or 2, not {tier!r}")
    if tier not in TIERS:
        raise ValueError(f"tier must be 1 (the idea) or 2 (the API), not {tier}; "
                         f"solution({chapter!r}, {letter!r}) shows the answer")
    hints = _hints(chapter).get(letter)
    if not hints:
        raise _unknown(chapter, letter)
    text = hints[tier - 1]
    more = (f'Next: hint("{chapter}", "{letter}", 2).' if tier == 1
            else f'Still stuck? solution("{chapter}", "{letter}") shows the answer.')
    print(f"Hint {tier} for exercise {chapter}{letter}: {text}\n{more}")


def solution(chapter, exercise):
    """Print the solution of exercise ``exercise`` of chapter ``chapter`` (the notebook's solution cells)."""
    chapter, letter = _chapter(chapter), _letter(exercise)
    cells = solution_cells(chapter, letter)
    if not cells:
        raise _unknown(chapter, letter)
    print(f"# Solution of exercise {chapter}{letter} (from {_notebook(chapter).name}); "
          "paste it into your solution cell, then run that cell and the checker.\n")
    print("\n\n".join(cells))
