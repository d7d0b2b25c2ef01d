"""Execute the course notebooks headlessly and report the time each took.

    python -m course_utils.tooling.run_notebooks              # every chapter, executed copies in workspace/executed/
    python -m course_utils.tooling.run_notebooks 03 05        # the ones whose names start with these
    python -m course_utils.tooling.run_notebooks --jobs 4     # several notebooks at once
    python -m course_utils.tooling.run_notebooks --in-place   # on a GPU: rewrite the committed notebooks and figures
    python -m course_utils.tooling.run_notebooks --refresh    # on a GPU: --in-place, and re-measure the records
    python -m course_utils.tooling.run_notebooks 07 --refresh-records ch07_forward_vs_peers_h100  # only this one
    python -m course_utils.tooling.run_notebooks --normalise  # only normalise the committed notebooks (no execution)

By default nothing tracked is touched: each chapter is made from its ``.py`` source and its
executed copy goes to ``workspace/executed/`` (git-ignored), so a CPU run never replaces the
stored H100 outputs. Only ``--in-place`` (or ``--refresh``) on a GPU rewrites ``notebooks/*.ipynb``
(synced from their ``.py`` first) and ``figures/*.png``; that is how the committed outputs are made.

Every notebook written is normalised: no machine-dependent metadata (the Python version, the
kernel's display name) and no machine paths in its outputs (the checkout's path, site-packages
and the home directory become relative), so the committed files do not change from machine to
machine.
"""

import argparse
import base64
import io
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is course_utils/tooling/…)
NOTEBOOKS = ROOT / "notebooks"
EXECUTED = ROOT / "workspace" / "executed"

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
# language_info fields that depend on the machine that ran the notebook.
MACHINE_LANGUAGE_INFO = ("version",)
_TEXT_MIMETYPES = ("text/plain", "text/html", "text/markdown", "text/latex")
_SITE_PACKAGES = re.compile(r"(?:/[^\s'\"()<>:,\[\]]+)*/(?:site|dist)-packages/")


def select(prefixes):
    sources = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    return [p for p in sources if not prefixes or any(p.name.startswith(x) for x in prefixes)]


def sync(source):
    """Make ``source``'s .ipynb from the .py (keeping existing outputs) when jupytext is available."""
    try:
        subprocess.run([sys.executable, "-m", "jupytext", "--sync", "--quiet", str(source)], check=True)
    except (subprocess.CalledProcessError, FileNotFoundError):
        if not source.with_suffix(".ipynb").exists():
            raise


def shrink_images(nb, colors=128):
    """Re-encode the PNG outputs of ``nb`` with a 128-colour palette: a fraction of the bytes."""
    from PIL import Image

    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                image = Image.open(io.BytesIO(base64.b64decode(data["image/png"]))).convert("RGB")
                buffer = io.BytesIO()
                image.quantize(colors=colors).save(buffer, format="PNG", optimize=True)
                data["image/png"] = base64.b64encode(buffer.getvalue()).decode()
    return nb


def scrub_paths(text, root=ROOT):
    """``text`` with this machine's paths made relative: the checkout's, site-packages' and the home's."""
    text = text.replace(f"{root}/", "")
    text = _SITE_PACKAGES.sub("", text)
    return text.replace(f"{Path.home()}/", "~/")


def _scrub(value, root):
    if isinstance(value, list):
        return [_scrub(v, root) for v in value]
    return scrub_paths(value, root) if isinstance(value, str) else value


def normalise(nb, root=ROOT):
    """Make ``nb`` the same whichever machine ran it: canonical kernelspec, no Python version, no paths."""
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    info = nb.metadata.get("language_info", {})
    for key in MACHINE_LANGUAGE_INFO:
        info.pop(key, None)
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if "text" in output:
                output["text"] = _scrub(output["text"], root)
            for mime in _TEXT_MIMETYPES:
                if mime in output.get("data", {}):
                    output["data"][mime] = _scrub(output["data"][mime], root)
            if output.get("output_type") == "error":
                output["evalue"] = _scrub(output["evalue"], root)
                output["traceback"] = _scrub(output["traceback"], root)
    return nb


def execute(nb, cwd, timeout=900, keep_going=False):
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}},
                   allow_errors=keep_going).execute()
    return time.perf_counter() - start


def failed_cells(nb):
    """The numbers of the code cells whose output is an error."""
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            and any(o.get("output_type") == "error" for o in cell.get("outputs", []))]


def run_in_place(source, keep_going=False):
    """Execute the committed notebook of ``source`` and write it back (GPU runs only). With ``keep_going`` every
    cell runs even after one fails (a claim the new record contradicts, say); the notebook is written with the
    error in place, and this raises afterwards, naming the cells to fix."""
    notebook = source.with_suffix(".ipynb")
    nb = nbformat.read(notebook, as_version=4)
    seconds = execute(nb, NOTEBOOKS, keep_going=keep_going)
    if keep_going and failed_cells(nb):
        nbformat.write(normalise(shrink_images(nb)), notebook)
        raise RuntimeError(f"cells {failed_cells(nb)} failed (the notebook was written with their errors)")
    nbformat.write(normalise(shrink_images(nb)), notebook)
    return notebook, seconds


def run_copy(source, out_dir, from_ipynb=False):
    """Execute the chapter of ``source`` (its .py, or its committed .ipynb) and write the copy to ``out_dir``."""
    import jupytext

    nb = nbformat.read(source.with_suffix(".ipynb"), as_version=4) if from_ipynb else jupytext.read(source)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{source.stem}.ipynb"
    try:
        seconds = execute(nb, out_dir)
    finally:  # keep what ran, failures included, to read the error in context
        nb.metadata.pop("jupytext", None)
        nbformat.write(normalise(nb), target)
    return target, seconds


def normalise_committed(sources):
    changed = []
    for source in sources:
        notebook = source.with_suffix(".ipynb")
        before = notebook.read_text()
        nb = normalise(nbformat.read(notebook, as_version=4))
        after = nbformat.writes(nb)
        after += "" if after.endswith("\n") else "\n"  # as nbformat.write does
        if after != before:
            notebook.write_text(after)
            changed.append(notebook)
    return changed


def _shown(path):
    path = Path(path).resolve()
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefixes", nargs="*", help="notebook name prefixes, e.g. 03")
    parser.add_argument("--in-place", action="store_true",
                        help="GPU only: rewrite the committed notebooks/*.ipynb and figures/*.png")
    parser.add_argument("--refresh", action="store_true",
                        help="GPU only: re-measure the stored records too (implies --in-place)")
    parser.add_argument("--refresh-records", metavar="NAMES",
                        help="GPU only: --in-place, and re-measure only these records (comma-separated names)")
    parser.add_argument("--keep-going", action="store_true",
                        help="with --in-place: run every cell even after one fails, and write the notebook")
    parser.add_argument("--normalise", action="store_true",
                        help="only normalise the committed notebooks' metadata and paths; execute nothing")
    parser.add_argument("--out", type=Path, default=EXECUTED, help="where executed copies go (default: %(default)s)")
    parser.add_argument("--no-sync", action="store_true",
                        help="execute the committed .ipynb files as they are instead of their .py sources")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks executed at the same time")
    args = parser.parse_args(argv)
    sources = select(args.prefixes)

    if args.normalise:
        for notebook in normalise_committed(sources):
            print(f"normalised {_shown(notebook)}")
        return

    in_place = args.in_place or args.refresh or bool(args.refresh_records)
    if in_place:
        from course_utils.core.device import HAS_GPU

        if not HAS_GPU:
            sys.exit("--in-place and --refresh rewrite the committed notebooks, whose outputs come from the H100: "
                     "they run on a GPU only. On this machine run without them: the executed copies go to "
                     f"{EXECUTED.relative_to(ROOT)}/ and nothing tracked changes.")
        os.environ["COURSE_WRITE_FIGURES"] = "1"  # plots.save writes figures/*.png in this run only
        if args.refresh or args.refresh_records:
            os.environ["COURSE_REFRESH_RECORDS"] = "1" if args.refresh else args.refresh_records
        if not args.no_sync:
            for source in sources:
                sync(source)

    def run(source):
        try:
            if in_place:
                notebook, seconds = run_in_place(source, keep_going=args.keep_going)
            else:
                notebook, seconds = run_copy(source, args.out, from_ipynb=args.no_sync)
            print(f"ok    {_shown(notebook):60} {seconds:7.1f} s", flush=True)
            return None
        except Exception as exc:  # report every notebook, then fail
            print(f"FAIL  {source.stem:60} {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
            return source.stem

    with ThreadPoolExecutor(args.jobs) as pool:
        failures = [name for name in pool.map(run, sources) if name]
    if failures:
        sys.exit(f"{len(failures)} notebook(s) failed: {', '.join(failures)}")


if __name__ == "__main__":
    main()
