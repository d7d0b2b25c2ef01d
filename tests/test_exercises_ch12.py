"""Chapter 12's exercises: each solution passes its checker, each mutant fails with its diagnosis in one line, and
the learner's edition (solutions stripped) says "not written yet". The solutions are read from the notebook's .py;
the mutants are checked in worker processes (two at a time, or one beside each pytest-xdist worker on two
cores; one kernel compilation each, about two seconds)."""

from exercise_harness import exercise_tests

# Solutions, learner's editions and mutants of exercise_mutants_fp8.py (exercise_harness.py).
globals().update(exercise_tests("exercise_mutants_fp8"))

