"""Every ✓ a chapter prints compares something.

1. No notebook prints a tick by hand: the code of ``notebooks/*.py`` holds no string with ✓ or ✗
   (``print("✓ ...")``, an f-string, ``'✗' if e else '✓'``) and no bare ``assert`` (a check that
   prints nothing and fails with no message). Ticks come from the check functions below, which
   print what they compared and raise ``CheckFailed`` when it is wrong.
2. Every public check function of ``course_utils`` (``checks``, ``validation``, ``claims``) is run
   here on an input it must reject, and must raise ``CheckFailed``. A new check function without a
   failing case here fails ``test_every_check_function_has_a_failing_case``.
"""

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

from course_utils.checking import checks, validation
from course_utils.checking.checks import CheckFailed
from course_utils.measure import claims

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
TICKS = re.compile("[✓✗]")


def hand_printed_ticks(source, where="<source>"):
    """(line, what) for each string with a tick, and each bare assert, in Python source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and TICKS.search(node.value):
            found.append((node.lineno, f"a string with a tick: {node.value[:60]!r}"))
        elif isinstance(node, ast.Assert):
            found.append((node.lineno, "a bare assert (use cu.check_true / cu.check_close: they print and explain)"))
    return [f"{where}:{line}: {what}" for line, what in sorted(set(found))]


def test_no_notebook_prints_its_own_tick():
    found = [hit for path in NOTEBOOKS for hit in hand_printed_ticks(path.read_text(), path.name)]
    assert not found, "ticks must come from course_utils' check functions:\n" + "\n".join(found)


@pytest.mark.parametrize("planted", [
    'print("✓ step_blocks computes every visible pair exactly once")',
    'print(f"✓ {name}: passed")',
    "print(f\"{'✗' if error else '✓'} {case}\")",
    "assert torch.equal(count, expected), (world, layout)",
])
def test_the_tick_test_catches_a_planted_tick(planted):
    assert hand_printed_ticks("x = 1\n" + planted + "\n")


def test_the_tick_test_spares_markdown_and_checks():
    assert not hand_printed_ticks('# %% [markdown]\n# the checker prints ✓\ncu.check_true(ok, "all rows checked")\n')


# ---------------------------------------------------------------------------------------------
# Every check function fails when it must.

def _tiny():
    torch.manual_seed(0)
    q, k, v, d_out = (torch.randn(1, 2, 8, 4) for _ in range(4))
    refs = validation.references(q, k, v, d_out=d_out)
    return q, k, v, d_out, refs


def _forward_wrong():
    q, k, v, _, refs = _tiny()
    validation.check_forward(q, k, v, refs["out"].float() * 1.01, refs["lse"], refs=refs)


def _backward_wrong():
    q, k, v, d_out, refs = _tiny()
    dq, dk, dv = (g.float() for g in refs["grads"][:3])
    validation.check_backward(q, k, v, d_out, (dq, dk * 0.9, dv), refs=refs)


def _bugs_not_caught():
    q, k, v, _, refs = _tiny()
    out, lse = refs["out"].float(), refs["lse"]
    # A "bug" that is the right answer: the check passes it, so show_bugs_caught must fail.
    validation.show_bugs_caught(lambda o, l: validation.check_forward(q, k, v, o, l, refs=refs, quiet=True),
                                {"no bug at all": (out, lse)})


FAILING = {
    "check_close": lambda: checks.check_close(torch.ones(3), torch.ones(3) * 1.01, "x"),
    "check_true": lambda: checks.check_true(False, "a false statement"),
    "check_attention_error": lambda: checks.check_attention_error(
        torch.ones(4) * 1.5, torch.ones(4, dtype=torch.float64), torch.ones(4) * 1.001, "x"),
    "expect_failure": lambda: checks.expect_failure("a check that passes", lambda: checks.check_true(True, "fine")),
    "check_forward": _forward_wrong,
    "check_backward": _backward_wrong,
    "show_bugs_caught": _bugs_not_caught,
    "check_stored_errors": lambda: validation.check_stored_errors(
        [{"impl": "ours", "errors": {"O": {"err": 2e-3, "allowed": 1e-3}}}], "a row over its bound"),
    "claim_count": lambda: claims.claim_count("rows of ours within their bound", [True, False], says="all"),
    "claim_versus": lambda: claims.claim_versus("ours vs the peer", {"S=1k": 1.5, "S=4k": 1.4}, says="behind"),
    "claim_ratio": lambda: claims.claim_ratio("packed/dense", [0.76, 0.79], target=0.9, says="met"),
    "claim_change": lambda: claims.claim_change("ms", 0.149, 0.203, says="about the same"),
    "claim_order": lambda: claims.claim_order("TFLOP/s", {1: 3, 2: 2, 3: 1}, says="increasing"),
}


def public_check_functions():
    names = set()
    for module in (checks, validation, claims):
        for name in module.__all__:
            if inspect.isfunction(getattr(module, name)) and name.startswith(("check_", "expect_", "claim_",
                                                                             "show_bugs")):
                names.add(name)
    return names


def test_every_check_function_has_a_failing_case():
    missing = public_check_functions() - set(FAILING)
    assert not missing, f"check functions never shown failing in tests/test_ticks.py: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(FAILING))
def test_check_function_fails_on_a_wrong_input(name):
    with pytest.raises(CheckFailed):
        FAILING[name]()


def test_stored_errors_without_errors_fail():
    with pytest.raises(CheckFailed, match="carry no validation errors"):
        validation.check_stored_errors([{"impl": "ours", "errors": None}], "a row never validated")
