"""The repository is a course, not a lab log: no tracked text file names a path of the machine it was
written on, or narrates how the work was organised (numbered work periods, how the GPU machine was
obtained, internal issue numbers). The design and the measurements are explained in docs/; where
something came from is a record in figures/ or a commit hash. Another project's issue is cited by its
address (https://github.com/OWNER/REPO/issues/N), which no rule matches."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RULES = {
    "machine path": re.compile(
        r"(?<![\w.~-])/(?:work|root|home|Users)/[\w.\-]*"      # a checkout or a home directory
        r"|/tmp/site\b"                                         # an unpacked package bundle
        r"|/(?:site|dist)-packages/"),                          # an installed package's file
    "narration": re.compile(
        r"\bsessions?\b"                                        # "the seventeenth session", "this session"
        r"|\blent\b"                                            # how the GPU machine was obtained
        r"|\bdevice[ -](?:calls?|time)\b"
        r"|\bissue #?\d+|(?<![\w&#/])#\d{1,4}\b",               # internal issue numbers: "issue 26", "#27"
        re.IGNORECASE),
}

# Files a rule does not apply to, each with why; keep this tiny.
EXEMPT = {
    "tests/test_words.py": set(RULES),                          # the patterns themselves
    "tests/test_tracked_files.py": {"machine path"},            # plants machine paths to show they are caught
}


def tracked_text_files():
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    for name in names.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            yield name, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def offenders(files):
    """Every line of ``files`` ((name, text) pairs) that a rule finds, as 'name:line: [rule] match'."""
    found = []
    for name, text in files:
        rules = {rule: pattern for rule, pattern in RULES.items() if rule not in EXEMPT.get(name, ())}
        for number, line in enumerate(text.splitlines(), 1):
            for rule, pattern in rules.items():
                for match in pattern.finditer(line):
                    found.append(f"{name}:{number}: [{rule}] {match.group()!r} in {line.strip()[:160]!r}")
    return found


def test_the_rules_catch_planted_lines():
    planted = [("notes.md", "Measured in the seventeenth session on the lent H100 (issue 26)."),
               ("a.py", "# see #27; run from /work/main with /tmp/site on PYTHONPATH"),
               ("b.json", '"path": "/home/alice/.venv/lib/python3.12/site-packages/torch/x.py", "device time"')]
    found = "\n".join(offenders(planted))
    for word in ("seventeenth session", "lent", "issue 26", "#27", "/work/main", "/tmp/site",
                 "/home/alice", "/site-packages/", "device time"):
        assert word in found, f"{word!r} not caught:\n{found}"
    clean = [("c.md", "Run `./course lab`; the kernel issues 2 wgmma batches (see #section, colors #1f77b4 and "
                      "#555555); chapter 10 splits the sequence; the site-packages folder is made relative; "
                      "FlashAttention-3's https://github.com/Dao-AILab/flash-attention/issues/1745.")]
    assert offenders(clean) == []


def test_no_machine_paths_or_narration_in_tracked_files():
    found = offenders(tracked_text_files())
    assert not found, f"{len(found)} lines name a machine path or narrate the work:\n" + "\n".join(found)
