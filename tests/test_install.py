"""The package as pip installs it (not editable) works on its own, and the set-up files say what was run.

``pip install .`` builds a wheel from pyproject.toml; a package it leaves out (``course_utils.measure.benchmarks``
once was) only shows outside the checkout, where the source tree is not on the path. So the test
installs the package into a temporary folder (``--no-deps``: the dependencies are this venv's),
then, from another temporary folder, with only that install on ``PYTHONPATH``, imports every
package of the source tree and runs the forward kernel's self-check (``python -m
course_utils.kernels.flash_fwd``: every head against the float64 reference, planted bugs caught).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def source_packages():
    """Every package of the source tree: each folder under course_utils with an __init__.py."""
    return sorted(".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "course_utils").rglob("__init__.py")
                  if "__pycache__" not in p.parts)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    # Built from a copy of what the wheel is made of: setuptools writes build/ next to the sources it
    # builds, and would reuse a stale one (hiding a package the configuration leaves out).
    source = tmp_path_factory.mktemp("source")
    shutil.copy(ROOT / "pyproject.toml", source)
    shutil.copytree(ROOT / "course_utils", source / "course_utils", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path_factory.mktemp("site")
    # --no-deps: the dependencies are this venv's; --no-build-isolation: its setuptools (no download).
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                             "--no-compile", "--target", str(target), str(source)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return target


def run_outside(installed, tmp_path, code_or_module, *args, module=False):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = str(installed)
    command = ["-m", code_or_module, *args] if module else ["-c", code_or_module]
    return subprocess.run([sys.executable, *command], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env=env)


def test_non_editable_install_carries_every_package(installed, tmp_path):
    packages = source_packages()
    assert "course_utils.measure.benchmarks" in packages and "course_utils.exercises" in packages
    code = ("import importlib, course_utils\n"
            f"print(course_utils.__file__)\n"
            f"for name in {packages!r}:\n"
            "    print(importlib.import_module(name).__file__)\n")
    result = run_outside(installed, tmp_path, code)
    assert result.returncode == 0, result.stdout + result.stderr
    files = result.stdout.split()
    assert files and all(f.startswith(str(installed)) for f in files), \
        f"imported from outside the temporary install: {files}"


def test_non_editable_install_runs_a_kernel_self_check(installed, tmp_path):
    result = run_outside(installed, tmp_path, "course_utils.check", "flash_fwd", module=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ticks = [line for line in result.stdout.splitlines() if line.startswith("✓")]
    assert any("causal=True" in line for line in ticks) and any("planted bug caught" in line for line in ticks), \
        result.stdout


# ---------------------------------------------------------------------------------------------
# What the set-up files promise.

def test_cpu_pins_stay_exact():
    """CI and CPU machines must install torch 2.13.0 exactly: an open range pulls a multi-GB CUDA build."""
    pins = [line for line in (ROOT / "requirements.txt").read_text().splitlines()
            if line and not line.startswith(("#", "-"))]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][0-9A-Za-z.+]*", line) for line in pins), pins
    assert "torch==2.13.0" in pins


def test_readme_names_the_tested_gpu_environment():
    text = (ROOT / "README.md").read_text()
    for version in ("torch 2.11.0+cu130", "tilelang 0.1.15", "CUDA 13.0", "cuDNN 9.19"):
        assert version in text, f"the README does not name the tested {version}"
    course = (ROOT / "course").read_text()
    assert "(2, 11) <= (major, minor) <= (2, 13)" in course, "./course no longer keeps a CUDA torch 2.11-2.13"


def test_no_runbook_at_the_root():
    """How the GPU parts are run is docs/gpu_runs.md; what a teacher needs, the README. (Machine paths anywhere
    tracked: tests/test_words.py.)"""
    assert not (ROOT / "GPU_RUN.md").exists(), "how the GPU parts are run goes in docs/gpu_runs.md"
    assert (ROOT / "docs" / "gpu_runs.md").is_file()
