"""Exercise checkers. Each chapter's checkers live in ``chNN.py``; they all use ``check_exercise``."""

from .common import ExerciseFailed, ExerciseIncomplete, ExerciseWrong, check_exercise, needs

__all__ = ["ExerciseFailed", "ExerciseIncomplete", "ExerciseWrong", "check_exercise", "needs"]
