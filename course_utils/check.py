"""One runner for the kernels' self-checks: ``python -m course_utils.check <kernel> [<kernel> ...]``.

Each registered kernel is checked against the float64 reference on whatever device this is (the CPU
runs the same tile programs through TileLang's C backend, at small sizes), with planted bugs shown
being caught where the check has them; on a GPU it is then timed side by side with its peers
(SDPA's FlashAttention-2 and cuDNN backends). Kernels that need an sm_90 GPU say what they can do
without one (``flash_fwd_hopper`` lowers itself and prints ptxas's report).

    python -m course_utils.check --list          # the registered kernels
    python -m course_utils.check flash_fwd       # one kernel
    python -m course_utils.check all             # every kernel that runs here
    python -m course_utils.check --fuzz          # the correctness gate: random problems over the whole API

A new kernel is one row of ``CHECKS``.
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple


class Check(NamedTuple):
    """A registered self-check: what it covers (chapter) and the function that runs it."""

    chapter: str
    run: object  # () -> None; raises on a failed check
    needs_hopper: bool = False  # only meaningful on an sm_90 GPU (skipped by "all" elsewhere)


def _forward():
    from .api.attention import TUNED_FORWARD_CONFIG
    from .core.device import HAS_GPU
    from .tooling.selfcheck import check_and_time_forward

    check_and_time_forward(TUNED_FORWARD_CONFIG if HAS_GPU else None)  # chapter 04's tiling on a GPU


def _backward():
    from .core.device import HAS_GPU
    from .measure.benchmarks import CH05_BACKWARD_CONFIG
    from .tooling.selfcheck import check_and_time_backward

    check_and_time_backward(CH05_BACKWARD_CONFIG if HAS_GPU else None)  # this chapter's kernel, also on Hopper


def _hopper_forward():
    from .tooling.selfcheck import check_hopper_forward

    check_hopper_forward()


def _persistent_forward():
    from .tooling.selfcheck import check_persistent_forward

    check_persistent_forward()


def _one_warpgroup_forward():
    from .tooling.selfcheck import check_one_warpgroup_forward

    check_one_warpgroup_forward()


def _hopper_backward():
    from .measure.benchmarks.ch08_hopper_backward import self_check

    self_check()


def _varlen():
    from .tooling.selfcheck import check_varlen

    check_varlen()


def _decode():
    from .tooling.selfcheck import check_decode

    check_decode()


def _ring():
    from .tooling.selfcheck import check_ring

    check_ring()


def _flex():
    from .tooling.selfcheck import check_flex

    check_flex()


def _fp8_forward():
    from .tooling.selfcheck import check_fp8_forward

    check_fp8_forward()


CHECKS = {
    "flash_fwd": Check("ch03/04 forward", _forward),
    "flash_bwd": Check("ch05 backward", _backward),
    "flash_fwd_hopper": Check("ch07 rotated-loop forward", _hopper_forward),
    "flash_fwd_hopper_persistent": Check("ch07 persistent forward", _persistent_forward, needs_hopper=True),
    "flash_fwd_hopper_one_warpgroup": Check("ch07 one-warpgroup forward (D = 64)", _one_warpgroup_forward,
                                            needs_hopper=True),
    "flash_bwd_hopper": Check("ch08 Hopper backward", _hopper_backward),
    "flash_varlen": Check("ch09 packed batches", _varlen),
    "flash_decode": Check("ch09 decoding", _decode),
    "ring": Check("ch10 ring attention (gloo, CPU processes)", _ring),
    "flex": Check("ch11 flex attention (score and mask modifiers)", _flex),
    "flash_fwd_fp8": Check("ch12 FP8 forward (C backend, FP8 rounding emulated; sm_90a lowered)",
                           _fp8_forward),
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--fuzz" in argv:  # the correctness gate: random problems over the public API (checking/fuzz.py)
        from .checking import fuzz

        return fuzz.main([a for a in argv if a != "--fuzz"])
    parser = argparse.ArgumentParser(prog="python -m course_utils.check", description=__doc__.splitlines()[0])
    parser.add_argument("kernels", nargs="*", help=f"'all' or any of: {', '.join(CHECKS)}")
    parser.add_argument("--list", action="store_true", help="list the registered kernels")
    args = parser.parse_args(argv)
    if args.list or not args.kernels:
        for name, check in CHECKS.items():
            print(f"{name:30} {check.chapter}{' (sm_90 only)' if check.needs_hopper else ''}")
        return 0
    unknown = [k for k in args.kernels if k != "all" and k not in CHECKS]
    if unknown:
        parser.error(f"unknown kernel(s) {', '.join(unknown)}; registered: {', '.join(CHECKS)}")
    names = list(CHECKS) if "all" in args.kernels else args.kernels
    if "all" in args.kernels:
        from .api.attention import is_hopper

        names = [n for n in names if is_hopper() or not CHECKS[n].needs_hopper]
    for name in names:
        print(f"── {name}: {CHECKS[name].chapter}")
        CHECKS[name].run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
