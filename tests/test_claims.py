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
from course_utils.measure.claims import (
    NO_SPREAD_BAND,
    Ratio,
    claim_change,
    claim_count,
    claim_order,
    claim_ratio,
    claim_versus,
    readme_claims,
    speed_ratio,
)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))

# ---------------------------------------------------------------------------------------------
# The claim functions: each prints what it computed, and fails when the record contradicts the words.


def test_claim_count_states_and_checks(capsys):
    claim = claim_count("causal blocks skipped", {512: True, 1024: True, 2048: True}, cases="lengths", says="all")
    assert claim.verdict == "all"
    assert "✓ causal blocks skipped in 3 of 3 lengths (says: all)" in capsys.readouterr().out
    claim_count("the ring holds more", [True, False, True], says="most")
    claim_count("the ring holds more", [True, False, False], says="some")


@pytest.mark.parametrize("outcomes, says", [
    ({512: True, 1024: False, 2048: True}, "all"),    # "at every length" when one length is not
    ([False, False, True], "most"),
    ([False, False], "some"),
    ([True], "none"),
    ([True, True], "most"),                           # exact: "most" does not accept "all"
    ([True, True], "some"),                           # nor "some"
])
def test_claim_count_fails_when_the_words_are_wrong(outcomes, says):
    with pytest.raises(CheckFailed, match="update the prose"):
        claim_count("the ring holds more", outcomes, says=says)


@pytest.mark.parametrize("label", ["ours faster than FA2", "ours ≥ cuDNN", "ours at least as fast as cuDNN",
                                   "ours ahead of cuDNN"])
def test_claim_count_refuses_a_count_of_speeds(label):
    """A count of booleans such as ``r >= 1`` cannot see the noise: speeds are counted by claim_versus."""
    with pytest.raises(ValueError, match="claim_versus"):
        claim_count(label, [True, True])


def test_claim_count_names_the_exceptions(capsys):
    claim_count("the ring holds more", {"S=512": False, "S=1k": True, "S=2k": True})
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


def test_faster_means_beyond_the_noise(capsys):
    """Without a stored spread a ratio has the band NO_SPREAD_BAND: 1.03 is level, not above 1."""
    claim_ratio("fast exp2 ÷ exact exp2", [1.01, 1.05], says="level")
    assert "(level: within the spread)" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="the record says 'level'"):
        claim_ratio("fast exp2 ÷ exact exp2", [1.01, 1.05], says="above 1")
    claim_ratio("ours ÷ FA2", [1.54, 2.12], says="above 1")
    assert "(lower bound 1.45)" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="the record says 'mixed'"):
        claim_ratio("persistent ÷ rotated", [1.03, 1.20], says="above 1")


def _row(ms, lo, hi):
    return {"ms": ms, "ms_spread": {"min": lo, "median": ms, "max": hi, "rounds": 6}}


def test_speed_ratio_takes_its_bounds_from_the_stored_spread():
    tight = speed_ratio(_row(1.0, 0.99, 1.01), _row(1.04, 1.03, 1.05))  # 4% faster, rounds 1% apart
    assert tight.spread_stored and tight.side == "above 1" and tight.low == pytest.approx(1.03 / 1.01)
    loose = speed_ratio(_row(1.0, 0.9, 1.1), _row(1.04, 1.0, 1.1))       # the same 4%, rounds 10% apart
    assert loose.side == "level"
    unmeasured = speed_ratio({"ms": 1.0}, {"ms": 1.04})                   # no spread stored: the band
    assert not unmeasured.spread_stored and unmeasured.side == "level"
    assert unmeasured.low == pytest.approx(1.04 / (1 + NO_SPREAD_BAND))


def test_claim_versus_counts_ahead_level_behind(capsys):
    ratios = {"S=1k": 1.2, "S=2k": 1.03, "S=4k": 0.97}
    claim = claim_versus("ours against cuDNN", ratios, says="ahead or level")
    assert claim.verdict == "ahead or level"
    out = capsys.readouterr().out
    assert "ahead in 1, level in 2, behind in 0 of 3 cases" in out and "(level: S=2k, S=4k)" in out
    claim_versus("ours against FA2", [Ratio(1.5, 1.4, 1.6, True)] * 3, says="ahead")
    assert "where no spread is stored" not in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="the record says 'ahead or level'"):
        claim_versus("ours against cuDNN", ratios, says="ahead")
    with pytest.raises(CheckFailed, match="'mixed'"):
        claim_versus("ours against cuDNN", {"a": 1.2, "b": 0.8}, says="ahead or level")


# The two records of chapter 07's forward that were measured side by side a minute apart, as of the commit that
# stored them (the forward's record has been re-measured since).
SIDE_BY_SIDE_COMMIT = "0edbad2"


def test_the_no_spread_band_covers_two_records_taken_a_minute_apart():
    """NO_SPREAD_BAND must cover half the largest disagreement between chapter 07's two forward records that
    timed the same cases side by side (each record's band then holds the other's ratio's midpoint)."""
    import json
    import subprocess

    from course_utils.core.labels import CUDNN, OURS

    def ratios(name):
        shown = subprocess.run(["git", "show", f"{SIDE_BY_SIDE_COMMIT}:figures/{name}.json"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parents[1])
        if shown.returncode != 0:
            pytest.skip(f"this checkout has no commit {SIDE_BY_SIDE_COMMIT} (a shallow clone)")
        results = json.loads(shown.stdout)["results"]
        rows = {(r["impl"], r["seq"], r["dim"], r["dtype"], r["causal"]): r for r in results}
        return {k[1:]: rows[(CUDNN,) + k[1:]]["ms"] / r["ms"] for k, r in rows.items()
                if k[0] == OURS and (CUDNN,) + k[1:] in rows}

    a, b = ratios("ch07_persistent_vs_rotated_h100"), ratios("ch07_forward_vs_peers_h100")
    worst = max(max(a[k], b[k]) / min(a[k], b[k]) for k in a.keys() & b.keys())
    assert worst > 1.05, "the records no longer disagree: the band may be narrowed (and the docstring updated)"
    assert (1 + NO_SPREAD_BAND) ** 2 >= worst, f"two records disagree by {worst:.3f}: widen NO_SPREAD_BAND"


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
    ("11", "5%"): "a target; the claims cell after it checks it against the record",
    ("12", "2.6×"): "a published figure, quoted with its source (the FlashAttention-3 paper's abstract)",
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


# ---------------------------------------------------------------------------------------------
# Records store their spread: the measuring code keeps each round's median beside the overall median.

def test_time_side_by_side_keeps_each_rounds_median_and_save_record_stores_the_spread(monkeypatch):
    import json

    from course_utils.measure import bench

    clock = iter(range(1, 1000))
    monkeypatch.setattr(bench, "HAS_GPU", True)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "_samples", lambda fn, rep: [float(next(clock))] * rep)  # each round slower
    ms = bench.time_side_by_side({"ours": lambda: None, "peer": lambda: None}, warmup=0, rounds=4, rep=3)
    assert isinstance(ms["ours"], float) and len(ms["ours"].round_medians) == 4
    spread = ms["ours"].spread
    assert spread["min"] < spread["median"] < spread["max"] and spread["rounds"] == 4
    rows = bench.with_spreads([{"impl": "ours", "ms": ms["ours"]}, {"ms": dict(ms)}])
    assert rows[0]["ms_spread"] == spread and set(rows[1]["ms_spread"]) == {"ours", "peer"}
    assert json.loads(json.dumps(rows))[0]["ms"] == float(ms["ours"])
    ratio = speed_ratio(rows[0], {"ms": ms["peer"], "ms_spread": ms["peer"].spread})
    assert ratio.spread_stored and ratio.low <= ratio.value <= ratio.high


# ---------------------------------------------------------------------------------------------
# Comparative prose about a record goes through a claim: a sentence that says "faster", "ahead",
# "level with", "within noise", "in some cases", "the largest step", ... must name the claim, count,
# range or record it reads, or sit in a cell that declares its judgements to be the checked claims above.
# What is left is allow-listed with the reason it is not a statement about a record (a mechanism, a
# paper's title, a definition).

COMPARATIVE = re.compile(
    r"\b(?:faster|slower|ahead of|behind|level with|on par|within (?:the )?noise|largest (?:single )?step|"
    r"in (?:some|most|every|all but \w+) (?:cases?|lengths?|shapes?)|at every length|beats?|outperforms?|"
    r"wins?|loses?|gains?|gained|lost)\b", re.I)
BACKED = re.compile(r"claim|count(?:s|ed)? above|(?:ratio|range|table|line)s? above|printed above|\(says|\brecord\b",
                    re.I)
DECLARES_ITS_CLAIMS = re.compile(r"checks each judgement below|every judgement below is one of the checked claims")

# (chapter, words of the sentence) -> why the sentence is not a comparison of measurements.
ALLOWED_COMPARATIVES = {
    ("01", "lose accuracy in 16 bit"): "numerics: float32 for the softmax, not a measurement",
    ("03", "may issue ahead of the compute"): "describes T.Pipelined (ahead in time), not a speed",
    ("04", "the largest tile wins"): "the sweep's rule (largest tile that fits), explained by reuse",
    ("04", "above 1 means ours is faster"): "defines the ratio shown next",
    ("05", "Faster Attention with Better Parallelism"): "a paper's title",
    ("05", "128 threads are far slower than 256"): "register arithmetic: the accumulators do not fit",
    ("05", "above 1: ours is faster"): "defines the ratio shown next",
    ("06", "above 1, ours is faster"): "defines the ratio shown next",
    ("07", "stays behind cuDNN"): "the chapter's opening question; chapter 04's claims check it",
    ("07", "issuing them anyway is faster than skipping them"): "points to section 4's generated-code argument",
    ("07", "no wgmma sits behind a branch"): "code layout (behind a branch), not a speed",
    ("07", "above 1 means ours is faster"): "defines the ratio shown next",
    ("07", "two published ideas"): "summary of section 5, whose claims check each",
    ("07", "why it gains little there"): "points to section 5's takeaways",
    ("07", "Section 4c's block wins because"): "explains section 4b's claims (register and block limits)",
    ("08", "lags furthest behind cuDNN"): "the chapter's opening question; chapter 05's claims check it",
    ("08", "timed right after a slower, cooler one"): "the power cap's mechanism; the claims on the record after it "
                                                       "check its effect",
    ("04", "once a copy fits behind the rest"): "the pipeline model's prediction, not a measurement",
    ("04", "what scheduling can still win"): "the roofline's reading",
    ("06", "no longer hidden behind the matrix products"): "the mechanism behind the window's fixed costs",
    ("06", "Naive PyTorch gains nothing from the window"): "it computes the whole S × S matrix whatever the window",
    ("07", "The one-warpgroup block does not help at D = 128"): "register arithmetic; the timing is in docs/, named",
    ("08", "faster than version 20 in every block"): "blocks of alternated timings summed up in docs/, named as such",
    ("08", "faster than version 9 at every S timed back to back"): "timings summed up in docs/, named as such",
    ("10", "which one is slower changes between runs"): "introduces the per-GPU times printed next",
    ("10", "the ring runs at its slower rank's pace"): "how the speed-up is defined",
    ("10", "speed-up against the slower one's"): "introduces the table printed next",
    ("08", "A tiling rejected on one step can win"): "a lesson drawn from the sentence before, which cites its source",
    ("09", "gained too little to tell from noise"): "a measurement kept in docs/, named as such",
    ("09", "schedule is slower in the forward"): "section 5's claim (list ÷ grid time, forward) checks it",
    ("09", "far behind either schedule"): "section 5's claim (padded SDPA ÷ ours) checks it",
    ("09", "one block per SM read as fast"): "the split rule's reason, from docs/, named as such",
    ("09", "target: ≤ 5% slower"): "a target, checked by the claims cell below",
    ("10", "the communication hidden behind"): "defines the 'comm hidden' column",
    ("10", "Does the communication hide behind"): "a section title",
}


def markdown_cells(path):
    """(first line number, lines) of each markdown cell of a percent script, up to its Exercises."""
    cells, kind, start, lines = [], None, 0, []
    for number, line in enumerate(path.read_text().splitlines() + ["# %%"], 1):
        if line.startswith("# %%"):
            if kind == "markdown":
                if lines and lines[0].startswith("# ## Exercises"):
                    break
                cells.append((start, lines))
            kind = "markdown" if "[markdown]" in line else "code"
            start, lines = number + 1, []
        elif kind:
            lines.append(line)
    return cells


def sentences(start, lines):
    """(line number, sentence) of a markdown cell's prose, split at sentence ends and list items."""
    text, where = "", []
    for i, line in enumerate(lines):
        body = line[2:] if line.startswith("# ") else line.lstrip("#")
        if re.match(r"\s*[-*] ", body) or not body.strip():
            text += "\n"
        where.append((len(text), start + i))
        text += body + " "
    for m in re.finditer(r"[^\n]+?(?:[.!?](?=\s)|\n|$)", text):
        if m.group().strip():
            yield max(n for pos, n in where if pos <= m.start()), " ".join(m.group().split())


def unbacked_comparatives(chapter, cells):
    found = []
    for start, lines in cells:
        if DECLARES_ITS_CLAIMS.search(" ".join(line.lstrip("# ") for line in lines)):
            continue
        for number, sentence in sentences(start, lines):
            if (COMPARATIVE.search(sentence) and not BACKED.search(sentence)
                    and not any(c == chapter and words in sentence for c, words in ALLOWED_COMPARATIVES)):
                found.append(f"{chapter}:{number}: {sentence[:140]}")
    return found


def test_comparative_prose_goes_through_a_claim():
    found = [hit for path in NOTEBOOKS for hit in unbacked_comparatives(path.name[:2], markdown_cells(path))]
    assert not found, ("comparative sentences about measurements that no claim computes: put the judgement in a "
                       "claim (course_utils.measure.claims) in the cell before, name the claim the sentence reads, "
                       "or allow-list it in tests/test_claims.py with why it is no measurement:\n" + "\n".join(found))


@pytest.mark.parametrize("sentence", [
    "# Our kernel is faster than cuDNN at every length.",
    "# The two schedules ran within noise of each other.",
    "# The paged lookup is level with the contiguous cache.",
    "# FlexAttention is still faster in some cases.",
])
def test_the_comparative_test_catches_a_planted_sentence(sentence):
    """A stale sentence planted in a markdown cell that follows no claims cell is caught."""
    assert unbacked_comparatives("03", [(10, ["# Some context about kernels.", sentence])]), f"not caught: {sentence}"
    assert not unbacked_comparatives("03", [(10, [sentence[:-1] + " (the claim above)."])])


def test_every_allowed_comparative_still_occurs():
    text = {path.name[:2]: " ".join(" ".join(s for _, s in sentences(start, lines))
                                    for start, lines in markdown_cells(path)) for path in NOTEBOOKS}
    gone = [key for key in ALLOWED_COMPARATIVES if key[1] not in text.get(key[0], "")]
    assert not gone, f"allow-list entries whose sentence is gone: {gone}"


# ---------------------------------------------------------------------------------------------
# Every stored output carries the date of the record it shows, and it is the record in figures/.

ANNOUNCEMENT = re.compile(r"\[(?:stored record|measured now): (\w+)\] .*?, (\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC)")
LIVE_TIMING = re.compile(r"\btime_your_(?:forward|training)\(")
STALE_MARK = "**Stale output.**"


def record_date(name):
    from course_utils.measure.bench import load_record

    return load_record(name)["machine"]["date"]


def stale_outputs(chapter, cells, date_of=record_date):
    """What a chapter's stored outputs show that is older than figures/: an announced record whose date is not the
    record's, a cell that loads a record but prints no announcement, a live timing that shows neither a record
    nor its own date ("[timed live: GPU, date]") and is not marked stale by the markdown cell after it.
    ``cells``: nbformat-like dicts."""
    found = []
    for number, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))
        for name, date in ANNOUNCEMENT.findall(text):
            if date != date_of(name):
                found.append(f"{chapter} nb:{number}: shows {name} of {date}, figures/ has {date_of(name)}")
        if "cu.measured(" in source and cell.get("outputs") and not ANNOUNCEMENT.search(text) \
                and "[no stored record:" not in text:
            found.append(f"{chapter} nb:{number}: loads a record but its output does not say which, of what date")
        if LIVE_TIMING.search(source) and cell.get("outputs") and not ANNOUNCEMENT.search(text) \
                and "[timed live: " not in text:
            after = next((c for c in cells[number + 1:] if c["cell_type"] == "markdown"), None)
            if after is None or not "".join(after["source"]).startswith(STALE_MARK):
                found.append(f"{chapter} nb:{number}: a live timing with no date; mark it {STALE_MARK!r} or re-run it")
    return found


def _ipynb_cells(path):
    import json

    return json.loads(path.with_suffix(".ipynb").read_text())["cells"]


def test_stored_outputs_show_the_records_in_figures():
    found = [hit for path in NOTEBOOKS for hit in stale_outputs(path.name[:2], _ipynb_cells(path))]
    assert not found, ("stored outputs older than figures/: re-execute the chapter on the GPU "
                       "(run_notebooks --in-place) "
                       "or mark the output stale:\n" + "\n".join(found))


def test_the_date_test_catches_an_older_record_and_an_unmarked_live_timing():
    cells = _ipynb_cells(ROOT / "notebooks" / "07_hopper_overlap.py")
    shown = next(i for i, c in enumerate(cells) if ANNOUNCEMENT.search(
        "".join("".join(o.get("text", "")) for o in c.get("outputs", []))))
    assert not stale_outputs("07", cells)
    assert stale_outputs("07", cells, date_of=lambda name: "2099-01-01 00:00 UTC"), "a newer record went unnoticed"
    live = [{"cell_type": "code", "source": "time_your_forward(f, record='x');",
             "outputs": [{"output_type": "stream", "text": "   cuDNN (SDPA cudnn)   0.147 ms  466 TFLOP/s\n"}]},
            {"cell_type": "markdown", "source": "The timing above shows ..."}]
    assert stale_outputs("03", live), "an unmarked live timing went unnoticed"
    live[1]["source"] = STALE_MARK + " The stored output above is a live timing from an older run."
    assert not stale_outputs("03", live)
    assert shown is not None


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if ANNOUNCEMENT.search(p.with_suffix(".ipynb").read_text())],
                         ids=lambda p: p.stem)
@pytest.mark.parametrize("origin", ["stored record", "measured now"])
def test_the_date_test_catches_an_older_announcement_planted_in_a_copy(path, origin):
    """Each chapter that announces a record, copied with one announcement's date set a year back (as a stored or
    as a re-measured record): the copy fails, naming that record; the chapter itself passes."""
    import copy

    cells = _ipynb_cells(path)
    assert not stale_outputs(path.name[:2], cells)
    planted = copy.deepcopy(cells)
    for cell in planted:
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", ""))
            m = ANNOUNCEMENT.search(text)
            if m:
                old = m.group(0).replace(m.group(2), "2025" + m.group(2)[4:])
                old = re.sub(r"^\[(?:stored record|measured now):", f"[{origin}:", old)
                output["text"] = text.replace(m.group(0), old, 1)
                break
        else:
            continue
        break
    found = stale_outputs(path.name[:2], planted)
    assert len(found) == 1 and f"shows {m.group(1)} of 2025" in found[0], found
