"""Help in tiers gives hints, not answers: every exercise of every chapter has two tiers, and no line of its
solution stands in either of them (spaces aside), so that asking for a hint never prints the answer."""

import importlib
import re

import pytest

from course_utils.exercises.help import exercises_of, solution_cells

CHAPTERS = [f"{n:02d}" for n in range(1, 13)]


def _solution_lines(chapter, letter):
    """The lines between ### BEGIN SOLUTION and ### END SOLUTION, without spaces or comments, long enough to be
    an answer rather than a name: a line and, for an assignment or a return, the expression it computes, when that
    holds an operator or a call (`ctx.saved_tensors` is the API's name, not an answer)."""
    lines = []
    for cell in solution_cells(chapter, letter):
        for block in re.findall(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", cell, re.S):
            for line in block.splitlines():
                code = line.split("  #")[0].strip()
                value = re.sub(r"^(return\s+|[\w\[\], .]+?\s*[-+*/]?=\s*)", "", code)  # what it computes
                lines += [re.sub(r"\s+", "", text) for text in {code, value}
                          if len(re.sub(r"\s+", "", text)) >= 16 and re.search(r"[-()+*/%^<>=&|]", text)]
    return lines


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_no_hint_holds_a_line_of_the_answer(chapter):
    hints = importlib.import_module(f"course_utils.exercises.ch{chapter}").HINTS
    for letter in exercises_of(chapter):
        assert len(hints.get(letter, ())) == 2, f"{chapter}{letter}: hints in two tiers"
        for tier, text in enumerate(hints[letter], 1):
            flat = re.sub(r"\s+", "", text)
            given = [line for line in _solution_lines(chapter, letter) if line in flat]
            assert not given, f"{chapter}{letter} tier {tier} gives the answer's line(s): {given}"
