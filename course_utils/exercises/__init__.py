"""Exercise checkers. Each chapter's checkers live in ``chNN.py``; they all use ``check_exercise``.
Help in tiers: ``hint(chapter, letter, 1 or 2)`` and ``solution(chapter, letter)`` (see ``help.py``)."""

from .common import ExerciseFailed, ExerciseIncomplete, ExerciseWrong, check_exercise, needs
from .help import hint, name_errors_name_their_exercise, solution, your_code, your_solution

name_errors_name_their_exercise()

__all__ = ["ExerciseFailed", "ExerciseIncomplete", "ExerciseWrong", "check_exercise", "needs", "hint", "solution",
           "your_code", "your_solution"]
