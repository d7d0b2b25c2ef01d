"""The GPU test tiers, run on a GPU machine (CI has none, so these tests skip there).

    python -m course_utils.tooling.gpu_tests smoke            # before a kernel change lands: at most 5 minutes
    python -m course_utils.tooling.gpu_tests full --part 1/2  # every GPU test, in two runs of at most 10 minutes
    python -m course_utils.tooling.gpu_tests full --part 2/2
    python -m course_utils.tooling.gpu_tests gate             # the fuzz gate's GPU tier alone (1500 problems)

``smoke`` is the fuzz gate with a smaller budget, then the tests of the default kernels (``tests/test_gpu.py``).
``full`` runs the test files below on several worker processes at once (pytest-xdist; TileLang compiles
on the CPU, so workers overlap their compiles; the GPU work of a test is small). Each writes a JSON summary
(tests, failures, seconds, machine, versions, date) with ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

# Every test file with tests that need a GPU (the others run in CI, on the CPU).
GPU_TEST_FILES = ("tests/test_gpu.py", "tests/test_varlen_decode_gpu.py", "tests/test_hopper_backward.py",
                  "tests/test_hopper_kernel.py", "tests/test_varlen_packed_hopper.py", "tests/test_checks_and_bench.py",
                  "tests/test_exercises_ch04_07_to_10.py", "tests/test_flex_hopper.py",
                  "tests/test_flex_hopper_backward.py", "tests/test_fp8.py")
SMOKE_TEST_FILES = ("tests/test_gpu.py",)
SMOKE_GATE = dict(problems=500, seconds=150)


def _machine():
    import torch

    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _collect(files):
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", *files], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if "::" in line]


def _pytest(ids_or_files, workers, log):
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *ids_or_files]
    if workers > 1:
        command[5:5] = ["-n", str(workers)]
    start = time.time()
    with open(log, "w") as handle:
        code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT).returncode
    text = open(log).read()
    tail = [line for line in text.splitlines() if re.match(r"^=* ?\d+ (passed|failed|error)", line)]
    failures = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"exit": code, "summary": tail[-1].strip("= ") if tail else "no summary", "failures": failures,
            "seconds": round(time.time() - start)}


def _gate(problems, seconds, workers, seed):
    from ..checking import fuzz

    lines = []
    start = time.time()
    run, failed = fuzz.run_gate(fuzz.draw_problems(seed, problems, gpu=True), seconds=seconds, workers=workers,
                                out=lines.append, progress=lambda line: print(line, flush=True))
    print("\n".join(lines), flush=True)
    return {"seed": seed, "problems": run, "failed": failed, "seconds": round(time.time() - start), "table": lines[:8]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tier", choices=("smoke", "full", "gate"))
    parser.add_argument("--part", default="1/1", help="K/N: the K-th of N runs of the full tier")
    # pytest workers share one GPU's memory: some tests take 9-17 GiB, and 14 workers ran an 80 GB H100 out of
    # memory in 26 of 81 tests of tests/test_gpu.py. The gate's problems are small: it runs on 10.
    parser.add_argument("--workers", type=int, default=4, help="pytest workers (the gate uses 10)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--logs", default=".", help="folder for pytest's logs")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 2**31
    summary = {"tier": args.tier, **_machine()}
    if args.tier in ("smoke", "gate"):
        budget = SMOKE_GATE if args.tier == "smoke" else dict(problems=1500, seconds=420)
        summary["gate"] = _gate(budget["problems"], budget["seconds"], 10, seed)
    if args.tier == "smoke":
        summary["tests"] = _pytest(list(SMOKE_TEST_FILES), args.workers, os.path.join(args.logs, "smoke.log"))
    if args.tier == "full":
        k, n = map(int, args.part.split("/"))
        ids = _collect(GPU_TEST_FILES)
        mine = ids[k - 1::n]
        summary.update(part=args.part, collected=len(ids), ran=len(mine))
        summary["tests"] = _pytest(mine, args.workers, os.path.join(args.logs, f"full_{k}_of_{n}.log"))
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(summary, handle, indent=1)
    ok = summary.get("tests", {"exit": 0})["exit"] == 0 and summary.get("gate", {"failed": 0})["failed"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
