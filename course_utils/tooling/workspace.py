"""The learner's workspace: git-ignored copies of the chapters that Lab opens instead of the tracked ones.

    python -m course_utils.tooling.workspace              # refresh workspace/learner/ (what `./course lab` does)
    python -m course_utils.tooling.workspace --teacher    # refresh workspace/teacher/ (`./course lab --teacher`)
    python -m course_utils.tooling.workspace --reset 03   # move your chapter 03 to workspace/backup/, write a fresh one

Two editions are made from the committed notebooks in ``notebooks/``:

- **learner** (the default): every exercise's solution is removed and the stored outputs are kept
  (the H100 plots, tables and ✓ lines), except the outputs of the solution cells and of the
  checker cell right after each one, which would show the answer or a ✓ not yet earned.
  Inside a solution, the lines from ``### BEGIN SOLUTION`` to ``### END SOLUTION`` become the one
  line ``PLACEHOLDER`` (``raise NotImplementedError  # your code here``) at the same indentation,
  wherever the block sits: a plain function, a loop, a ``@T.prim_func`` body. Exercise checkers
  may look for that exact line, so it does not change.
- **teacher**: the committed notebooks as they are, solutions included.

Lab never opens a tracked file, so opening, running and saving never dirty the repository.
Refreshing never overwrites a learner's work: ``workspace/.manifest.json`` remembers hashes of
what was written to each copy. A missing copy is written; when a chapter changes (say after a
``git pull``), a copy whose cells are still as written is replaced, and a copy whose cells the
learner edited is kept, with a line saying so and how to get the new version (``--reset``, which
moves the old copy to ``workspace/backup/``).
"""

import argparse
import copy
import hashlib
import json
import platform
import re
import shutil
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is course_utils/tooling/…)
NOTEBOOKS = ROOT / "notebooks"
# `./course lab` runs this file itself (nbformat only, a second) rather than importing the package, so the
# two names the checkers share with it are spelled here too; tests/test_workspace.py keeps them equal to
# course_utils.exercises.common's.
WORKSPACE = ROOT / "workspace"
EDITIONS = ("learner", "teacher")

PLACEHOLDER = "raise NotImplementedError  # your code here"

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
_SOLUTION = re.compile(r"^([ \t]*)### BEGIN SOLUTION[^\n]*\n.*?^[ \t]*### END SOLUTION[^\n]*(\n|\Z)", re.M | re.S)


def strip_solutions(source):
    """Replace every solution block of ``source`` by ``PLACEHOLDER`` at the block's indentation."""
    stripped = _SOLUTION.sub(lambda m: f"{m.group(1)}{PLACEHOLDER}{m.group(2)}", source)
    if BEGIN in stripped or END in stripped:
        raise ValueError(f"unbalanced {BEGIN!r} / {END!r} markers in:\n{source[:300]}")
    return stripped


def is_solution_cell(cell):
    return cell.cell_type == "code" and ("solution" in cell.metadata.get("tags", []) or BEGIN in cell.source)


# Cells whose stored output shows an exercise's answer (the course's code of an earlier exercise,
# printed as the start of a later one): the learner's edition drops it; running the cell prints theirs.
_ANSWER_PRINTING = re.compile(r"^\s*(your_code|solution)\(", re.M)
# Cells that run the learner's own code (or the course's in its place): their stored outputs were made by the
# course's solution ("✓ O your kernel …"), which the learner did not write; running the cell prints theirs.
_RUNS_LEARNER_CODE = re.compile(r"\b(time_your_\w+|\w+_or_course|your_solution)\(")


def learner_edition(nb):
    """A copy of notebook ``nb`` with the solutions removed and every other output kept."""
    nb = copy.deepcopy(nb)
    hide_next_output = False
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if _ANSWER_PRINTING.search(cell.source) or _RUNS_LEARNER_CODE.search(cell.source):
            cell.outputs, cell.execution_count = [], None
            continue
        if is_solution_cell(cell):
            cell.source = strip_solutions(cell.source)
            cell.outputs, cell.execution_count = [], None
            hide_next_output = True  # the checker right after a solution prints its ✓
        elif hide_next_output:
            cell.outputs, cell.execution_count = [], None
            hide_next_output = False
    return nb


def teacher_edition(nb):
    return copy.deepcopy(nb)


def _for_this_machine(nb):
    """Metadata of a workspace copy: no jupytext pairing (the copy stands alone), this Python's version.

    Jupyter fills ``language_info`` from the kernel when a notebook opens; writing the version
    this machine's kernel reports keeps a just-opened copy from looking edited.
    """
    nb.metadata.pop("jupytext", None)
    nb.metadata.setdefault("language_info", {})["version"] = platform.python_version()
    return nb


def cells_hash(nb):
    """What a learner edits: the cells' types and sources (outputs and metadata change by running)."""
    cells = [[c.cell_type, c.source] for c in nb.cells]
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode()).hexdigest()


def file_hash(nb):
    return hashlib.sha256(nbformat.writes(nb).encode()).hexdigest()


def chapters(notebooks=NOTEBOOKS):
    return sorted(Path(notebooks).glob("[0-9][0-9]_*.ipynb"))


def _load_manifest(path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def refresh(edition="learner", workspace=WORKSPACE, notebooks=NOTEBOOKS, only=None):
    """Bring ``workspace/<edition>/`` up to date with ``notebooks/``; never overwrite an edited copy.

    Returns the file names by what happened to them: ``written`` (were missing), ``updated`` (the
    chapter changed and the copy's cells were as written, so it was replaced), ``unchanged``
    (nothing new), ``kept`` (the chapter changed but the copy's cells were edited: left as it is).
    """
    make = {"learner": learner_edition, "teacher": teacher_edition}[edition]
    workspace = Path(workspace)
    folder = workspace / edition
    folder.mkdir(parents=True, exist_ok=True)
    manifest_path = workspace / ".manifest.json"
    manifest = _load_manifest(manifest_path)
    report = {"written": [], "updated": [], "unchanged": [], "kept": []}
    for source in chapters(notebooks):
        if only and not any(source.name.startswith(prefix) for prefix in only):
            continue
        fresh = _for_this_machine(make(nbformat.read(source, as_version=4)))
        fresh_entry = {"cells": cells_hash(fresh), "file": file_hash(fresh)}
        target = folder / source.name
        key = f"{edition}/{source.name}"
        written = manifest.get(key)
        if target.exists():
            try:
                current_cells = cells_hash(nbformat.read(target, as_version=4))
            except Exception:  # no longer a readable notebook: the learner's business, keep it
                current_cells = None
            if written is None:  # no record of writing it (manifest lost): only adopt an identical copy
                if current_cells == fresh_entry["cells"]:
                    manifest[key] = fresh_entry
                    report["unchanged"].append(source.name)
                else:
                    report["kept"].append(source.name)
                continue
            if written["file"] == fresh_entry["file"]:
                report["unchanged"].append(source.name)
                continue
            if current_cells != written["cells"]:
                report["kept"].append(source.name)
                continue
            status = "updated"
        else:
            status = "written"
        nbformat.write(fresh, target)
        manifest[key] = fresh_entry
        report[status].append(source.name)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return report


def reset(prefix, edition="learner", workspace=WORKSPACE):
    """Move the copies whose names start with ``prefix`` to ``workspace/backup/``; the next refresh writes
    fresh ones."""
    if not re.fullmatch(r"\d\d", str(prefix)[:2]):
        raise ValueError(f"--reset takes a chapter number such as 03, not {prefix!r}")
    workspace = Path(workspace)
    moved = []
    for target in sorted((workspace / edition).glob(f"{str(prefix)[:2]}_*.ipynb")):
        backup = workspace / "backup" / edition / f"{target.stem}-{time.strftime('%Y%m%d-%H%M%S')}.ipynb"
        backup.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(target, backup)
        moved.append(backup)
    return moved


def _relative(path):
    path = Path(path).resolve()
    try:
        return path.relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def describe(report, edition, workspace=WORKSPACE):
    """What a refresh did, in a few lines: counts, then each kept copy and how to replace it."""
    folder = _relative(Path(workspace) / edition)
    what = ("solutions removed, stored H100 outputs kept" if edition == "learner"
            else "full notebooks, solutions included")
    counts = ", ".join(f"{len(report[k])} {k}" for k in ("written", "updated", "unchanged", "kept") if report[k])
    lines = [f"{edition} edition in {folder}/ ({what}): {counts or 'no chapters'}"]
    flag = " --teacher" if edition == "teacher" else ""
    for name in report["kept"]:
        lines.append(f"  kept {folder / name}: the chapter changed, but you edited your copy, so it was left "
                     "as it is.\n"
                     f"    For the new version (yours is moved to {_relative(Path(workspace) / 'backup' / edition)}/): "
                     f".venv/bin/python -m course_utils.tooling.workspace{flag} --reset {name[:2]}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", action="store_true", help="the teacher edition (solutions included)")
    parser.add_argument("--reset", metavar="NN", help="back up your copy of chapter NN and write a fresh one")
    parser.add_argument("--workspace", type=Path, default=WORKSPACE,
                        help="the folder of the editions (default: %(default)s)")
    args = parser.parse_args(argv)
    edition = "teacher" if args.teacher else "learner"
    if args.reset:
        if not re.fullmatch(r"\d\d", args.reset[:2]):
            parser.error(f"--reset takes a chapter number such as 03, not {args.reset!r}")
        for backup in reset(args.reset, edition, args.workspace):
            print(f"your copy is now {_relative(backup)}")
    report = refresh(edition, args.workspace)
    print(describe(report, edition, args.workspace))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
