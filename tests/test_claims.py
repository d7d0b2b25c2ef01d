"""Claims about records: the claim functions, the README's claims block, and no unbacked numbers in prose.

A number-like claim in a chapter's markdown (a rate in TFLOP/s or TB/s, a decimal ratio such as
"1.8×", a count "12 of 12", a percentage) goes stale when its record is re-measured. Such claims
belong in the code cell that shows the record, computed by ``course_utils.measure.claims`` and checked
against the words the prose uses. ``test_markdown_has_no_unbacked_number`` fails on any such
pattern in the markdown of ``notebooks/*.py`` (the ``## Exercises`` sections aside: they state
tasks, not results) unless it is allow-listed below with the reason it is not a measurement.
"""

import re
from pathlib import Path

import pytest

from course_utils.checking.checks import CheckFailed
from course_utils.measure.claims import claim_change, claim_count, claim_order, claim_ratio, readme_claims

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))

# ---------------------------------------------------------------------------------------------
# The claim functions: each prints what it computed, and fails when the record contradicts the words.


def test_claim_count_states_and_checks(capsys):
    claim = claim_count("ours faster than FA2", {512: True, 1024: True, 2048: True}, cases="lengths", says="all")
    assert claim.verdict == "all"
    assert "✓ ours faster than FA2 in 3 of 3 lengths (says: all)" in capsys.readouterr().out
    claim_count("ours faster", [True, False, True], says="most")
    claim_count("ours faster", [True, False, True], says="some")  # "some" holds whenever at least one does
    claim_count("ours faster", [True, False, True], says="not all")


@pytest.mark.parametrize("outcomes, says", [
    ({512: True, 1024: False, 2048: True}, "all"),    # "at every length" when one length is slower
    ([False, False, True], "most"),
    ([False, False], "some"),
    ([True], "none"),
    ([True, True], "not all"),
])
def test_claim_count_fails_when_the_words_are_wrong(outcomes, says):
    with pytest.raises(CheckFailed, match="update the prose"):
        claim_count("ours faster", outcomes, says=says)


def test_claim_count_names_the_exceptions(capsys):
    claim_count("ours faster", {"S=512": False, "S=1k": True, "S=2k": True})
    assert "2 of 3 cases (not in: S=512)" in capsys.readouterr().out


def test_claim_ratio_with_a_target(capsys):
    claim_ratio("packed/dense", [0.76, 0.79], target=0.9, says="not met")
    assert "✓ packed/dense 0.76–0.79×, target 0.90×: not met" in capsys.readouterr().out
    claim_ratio("packed/dense", [0.85, 0.95], target=0.9, says="partly met")
    assert "met in 1 of 2" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="the record says 'not met'"):
        claim_ratio("packed/dense", [0.76, 0.79], target=0.9, says="met")


def test_claim_ratio_sides_of_one():
    claim_ratio("ours ÷ FA2", [1.2, 1.9], says="above 1")
    claim_ratio("variation ÷ shipped", [0.97, 1.02], says="near 1")
    with pytest.raises(CheckFailed):
        claim_ratio("ours ÷ cuDNN", [0.9, 1.1], says="above 1")
    with pytest.raises(CheckFailed):
        claim_ratio("variation ÷ shipped", [0.90, 1.02], says="near 1")  # a 10% loss is not noise


def test_claim_change_and_order(capsys):
    claim_change("window forward, ms", 0.149, 0.203, names=("D=64", "D=128"), unit="ms", says="higher")
    assert "(+36%)" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="about the same"):  # the sentence the issue found wrong
        claim_change("window forward, ms", 0.149, 0.203, says="about the same")
    claim_order("TFLOP/s by stages", {1: 589, 2: 583, 3: 580}, says="decreasing")
    with pytest.raises(CheckFailed, match="no consistent order"):
        claim_order("TFLOP/s by stages", {1: 589, 2: 583, 3: 580}, says="no consistent order")


@pytest.mark.parametrize("call, error", [
    (lambda: claim_count("x", []), ValueError),
    (lambda: claim_count("x", [True], says="every"), ValueError),
    (lambda: claim_ratio("x", []), ValueError),
    (lambda: claim_change("x", 0, 1), ValueError),
    (lambda: claim_order("x", [1, 2]), ValueError),
])
def test_claims_reject_bad_input(call, error):
    with pytest.raises(error):
        call()


# ---------------------------------------------------------------------------------------------
# The README's claims block is the output of readme_claims().

def test_readme_claims_are_generated_from_records():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- claims:start.*?-->\n(.*?)\n<!-- claims:end -->", text, re.S)
    assert block, "README lost its claims markers"
    assert block.group(1).strip() == readme_claims().strip(), \
        "README claims are stale: paste the output of `python -m course_utils.measure.claims`"


def test_chapter_00_lists_every_chapter():
    text = (ROOT / "notebooks" / "00_setup.py").read_text()
    for notebook in NOTEBOOKS:
        assert re.search(rf"^# \| {notebook.name[:2]} \|", text, re.M), f"00's chapter table lacks {notebook.name[:2]}"


# ---------------------------------------------------------------------------------------------
# No unbacked number-like claims in markdown.

PATTERNS = {
    "rate": r"\d+(?:[.,]\d+)*\s*(?:TFLOP/?s|TFLOPS|GB/s|TB/s)",
    "ratio": r"\d+\.\d+\s*(?:[–-]\s*\d+(?:\.\d+)?\s*)?×",
    "count": r"\b\d+\s+(?:of|out of)\s+(?:the\s+)?\d+\b",
    "percentage": r"\b\d+(?:\.\d+)?\s*%",
}

# (chapter, the matched text) -> why it is not a measured claim. Keep the reasons honest.
ALLOWED = {
    ("01", "1 %"): "a tolerance the next cell's check uses (allocator rounding)",
    ("03", "10 of the 16"): "exact geometry of the drawn example (4 × 4 tiles, causal), computed by the cell after it",
    ("03", "1%"): "the size of a planted bug (LSE × 1.01)",
    ("04", "35%"): "a published figure, with its source (the FlashAttention-3 paper's abstract)",
    ("04", "989 TFLOP/s"): "H100 SXM datasheet, named as such",
    ("04", "3.35 TB/s"): "H100 SXM datasheet, named as such",
    ("05", "2.5 ×"): "the FLOP convention: five matmuls against the forward's two",
    ("05", "3.5 ×"): "the FLOP convention: forward + backward",
    ("07", "989 TFLOP/s"): "FlashAttention-3's quoted H100 throughput, named as such",
    ("07", "3.9 TFLOP/s"): "FlashAttention-3's quoted H100 SFU throughput, named as such",
    ("07", "3%"): "the tolerance of the check in the next cell",
    ("08", "2.5 ×"): "the FLOP convention: five matmuls against the forward's two",
    ("09", "1%"): "the size of a planted bug (LSE × 1.01)",
    ("09", "0.9×"): "a target; the claims cell checks it against the record",
    ("09", "989 TFLOP/s"): "H100 SXM datasheet",
    ("11", "2.5×"): "the FLOP convention: five matmuls against the forward's two",
    ("11", "10%"): "a target; the claims cell after it checks it against the record",
    ("09", "3.35 TB/s"): "H100 SXM datasheet",
    ("09", "3 TB/s"): "an order of magnitude in an estimate (about the datasheet bandwidth)",
    ("09", "85%"): "a target; the claims cell checks it against the record",
    ("09", "5%"): "a target; the claims cell checks it against the record",
}


def markdown_lines(path):
    """(line number, text) of each markdown line of a jupytext percent script, up to its Exercises."""
    in_markdown = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("# %%"):
            in_markdown = "[markdown]" in line
            continue
        if in_markdown:
            if line.startswith("# ## Exercises"):
                return
            yield number, line


def number_claims(text):
    """The number-like claims in one line of prose (code spans and formulas left out)."""
    text = re.sub(r"`[^`]*`|\$[^$]*\$", " ", text)
    return [(kind, m.group()) for kind, pattern in PATTERNS.items() for m in re.finditer(pattern, text)]


def unbacked_claims(chapter, lines):
    return [f"{chapter}:{number}: {kind} {found!r} in: {line.strip()[:100]}"
            for number, line in lines for kind, found in number_claims(line)
            if (chapter, found) not in ALLOWED]


def test_markdown_has_no_unbacked_number():
    found = [hit for path in NOTEBOOKS for hit in unbacked_claims(path.name[:2], markdown_lines(path))]
    assert not found, ("numbers typed into markdown: compute them from the record with course_utils.measure.claims in "
                       "the cell that shows it, or allow-list them in tests/test_claims.py with a reason:\n"
                       + "\n".join(found))


@pytest.mark.parametrize("sentence", [
    "# Our kernel reaches 612 TFLOP/s at S = 4k.",
    "# The packed kernels reach 0.76–0.79× the dense ones.",
    "# Ours is 1.8× cuDNN.",
    "# Ours is ahead of FlashAttention-2 in 12 of 12 cases.",
    "# The paged cache is 4% slower.",
])
def test_the_markdown_test_catches_a_planted_claim(sentence):
    assert unbacked_claims("03", [(1, sentence)]), f"not caught: {sentence}"


def test_the_markdown_test_spares_code_and_allowed_numbers():
    assert not unbacked_claims("03", [(1, "# a `32 of 64` code span, $1.5 × x$ in a formula, 64 × 128 tiles")])
    assert not unbacked_claims("04", [(1, "# H100 SXM datasheet figures: 989 TFLOP/s dense fp16, 3.35 TB/s.)")])


def test_every_allowed_number_still_occurs():
    """A stale allow-list entry hides nothing, but it must not linger after its sentence is gone."""
    present = {(path.name[:2], found) for path in NOTEBOOKS for _, line in markdown_lines(path)
               for _, found in number_claims(line)}
    assert set(ALLOWED) <= present, f"allow-list entries that no longer occur: {sorted(set(ALLOWED) - present)}"
