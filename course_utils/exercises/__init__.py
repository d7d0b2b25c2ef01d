"""Exercise checkers. Each chapter's checkers live in ``chNN.py``; they all use ``check_exercise``."""

from .common import ExerciseIncomplete, ExerciseWrong, check_exercise

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_exercise"]
