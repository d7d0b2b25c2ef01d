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

from .common import PLACEHOLDER, WORKSPACE

__all__ = ["hint", "solution", "solution_cells", "exercises_of", "exercise_defining", "needed_first",
           "name_errors_name_their_exercise"]

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


# --- A checker run before the exercise it needs: name that exercise, not a NameError ---------------

_DEFINED = {}


def exercise_defining(name):
    """(chapter, letter) of the exercise whose solution cell defines ``name`` (a ``def`` or a ``class`` at the top
    of a cell tagged ``ex-<letter>``, or the skeleton cell just before it), or None."""
    if not _DEFINED:
        for path in sorted(_notebooks_dir().glob("[0-9][0-9]_*.py")):
            chapter, letter, last = path.name[:2], None, None
            for cell in re.split(r"^# %%", path.read_text(encoding="utf-8"), flags=re.M)[1:]:
                header = cell.splitlines()[0] if cell else ""
                tagged = re.search(r'"ex-([a-z])"', header)
                letter = tagged.group(1) if tagged else None
                for defined in re.findall(r"^(?:def|class) (\w+)", cell, re.M):
                    if letter:
                        _DEFINED.setdefault(defined, (chapter, letter))
                        if last:  # the skeleton cell the solution fills in
                            for skeleton in last:
                                _DEFINED.setdefault(skeleton, (chapter, letter))
                if "[markdown]" not in header:  # a skeleton may sit a few markdown cells above its solution
                    last = None if letter else re.findall(r"^(?:def|class) (\w+)", cell, re.M)
    return _DEFINED.get(name)


def needed_first(exc):
    """For a NameError whose name an exercise defines: one line saying which exercise to run first; else None."""
    match = re.search(r"name '(\w+)' is not defined", str(exc)) if isinstance(exc, NameError) else None
    found = exercise_defining(match.group(1)) if match else None
    if found is None:
        return None
    chapter, letter = found
    return (f"`{match.group(1)}` is not defined yet: it comes from exercise {chapter} ({letter}). Run that "
            f"exercise's cells first (they may still say `raise NotImplementedError`; hint(\"{chapter}\", "
            f"\"{letter}\", 1) helps).")


def _name_error_hint(shell, etype, value, tb, tb_offset=None):
    line = needed_first(value)
    if line is None:
        return shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
    print(line)
    return None


def name_errors_name_their_exercise(shell=None):
    """In IPython, show a NameError of a name an exercise defines as one line naming that exercise (a checker run
    before its exercise, or out of order); every other error keeps its traceback. Called when the package loads."""
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return
        shell = get_ipython()
    if shell is not None and hasattr(shell, "set_custom_exc"):
        shell.set_custom_exc((NameError,), _name_error_hint)


# --- A later chapter builds on an earlier exercise: the learner's version, else the course's -------

_PRELUDE = """import math
import torch
import tilelang.language as T
from course_utils.kernels.flash_pieces import LOG2E
from course_utils.kernels.tiles import TileBackend
"""


def _learner_cells(chapter, letter, workspace=None):
    """The learner's solution cells of the exercise, from their copy in workspace/learner/, or None."""
    import nbformat

    folder = Path(workspace or WORKSPACE) / "learner"
    copies = sorted(folder.glob(f"{chapter}_*.ipynb"))
    if not copies:
        return None
    try:
        nb = nbformat.read(copies[0], as_version=4)
    except Exception:  # not a readable notebook any more: the course's version stands in
        return None
    cells = [c.source for c in nb.cells if c.cell_type == "code"
             and {"solution", f"ex-{letter}"} <= set(c.metadata.get("tags", []))]
    return cells or None


def _load(cells, name, label):
    import linecache

    text = _PRELUDE + "\n\n".join(cells) + "\n"
    filename = f"<{label}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)  # TileLang reads the source
    namespace = {"__name__": f"solution_{abs(hash(filename))}"}
    exec(compile(text, filename, "exec"), namespace)
    if name not in namespace:
        raise NameError(f"the cells define no `{name}`")
    return namespace[name]


def your_solution(chapter, exercise, name, *, probe=None, workspace=None):
    """The learner's ``name`` from their workspace copy of chapter ``chapter``, exercise ``exercise`` (its
    solution cells, run afresh), if it is written and ``probe(fn)`` does not raise; else the course's
    (the committed notebook's solution cells), with one printed line saying so."""
    chapter, letter = _chapter(chapter), _letter(exercise)
    cells = _learner_cells(chapter, letter, workspace)
    why = f"no workspace copy of chapter {chapter} with exercise {chapter}{letter}"
    if cells is not None:
        if any(PLACEHOLDER in c for c in cells):
            why = f"exercise {chapter}{letter} is not written yet in your copy"
        else:
            try:
                fn = _load(cells, name, f"your {chapter}{letter}")
                if probe is not None:
                    probe(fn)
                print(f"Using your `{name}` from chapter {chapter}, exercise ({letter}).")
                return fn
            except Exception as exc:  # the learner's version does not run: the course's keeps the chapter going
                why = f"your `{name}` from exercise {chapter}{letter} fails ({type(exc).__name__}: " \
                      f"{str(exc).splitlines()[0][:100] if str(exc) else ''})"
    print(f"Using the course's `{name}` ({why}).")
    return _load(solution_cells(chapter, letter), name, f"course {chapter}{letter}")


def your_code(chapter, exercise):
    """Print the learner's solution cells of an earlier exercise (from their workspace copy): the start of an
    exercise that extends the learner's own code. When theirs is missing or not written it prints one line
    saying so and how to see the course's answer (``solution``), never the answer itself."""
    chapter, letter = _chapter(chapter), _letter(exercise)
    cells = _learner_cells(chapter, letter)
    if cells and not any(PLACEHOLDER in c for c in cells):
        print(f"# Your exercise {chapter}{letter}, from your copy of chapter {chapter}:\n")
        print("\n\n".join(cells))
        return
    why = "is not written yet in your copy" if cells else f"has no workspace copy of chapter {chapter}"
    print(f"Exercise {chapter}{letter} {why}: write it first (this exercise extends it), or start from the "
          f"course's answer with solution(\"{chapter}\", \"{letter}\").")
