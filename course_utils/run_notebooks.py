"""Execute the course notebooks headlessly, in place, and report the time each took.

    python -m course_utils.run_notebooks              # every notebook
    python -m course_utils.run_notebooks 03 05        # the ones whose names start with these
    python -m course_utils.run_notebooks --refresh    # on a GPU: re-measure stored records too
    python -m course_utils.run_notebooks --jobs 4     # several notebooks at once

This is how the committed outputs are produced (on the lent H100). The .ipynb files are made from
their paired ``.py`` sources first when jupytext is installed.
"""

import argparse
import base64
import io
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


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


def execute(notebook, timeout=900):
    nb = nbformat.read(notebook, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    nbformat.write(shrink_images(nb), notebook)
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefixes", nargs="*", help="notebook name prefixes, e.g. 03")
    parser.add_argument("--refresh", action="store_true", help="re-measure GPU records (GPU only)")
    parser.add_argument("--no-sync", action="store_true", help="execute the .ipynb files as they are")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks executed at the same time")
    args = parser.parse_args(argv)
    if args.refresh:
        os.environ["COURSE_REFRESH_RECORDS"] = "1"
    sources = select(args.prefixes)
    if not args.no_sync:
        for source in sources:
            sync(source)

    def run(source):
        notebook = source.with_suffix(".ipynb")
        try:
            seconds = execute(notebook)
            print(f"ok    {notebook.name:45} {seconds:7.1f} s", flush=True)
            return None
        except Exception as exc:  # report every notebook, then fail
            print(f"FAIL  {notebook.name:45} {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
            return notebook.name

    with ThreadPoolExecutor(args.jobs) as pool:
        failures = [name for name in pool.map(run, sources) if name]
    if failures:
        sys.exit(f"{len(failures)} notebook(s) failed: {', '.join(failures)}")


if __name__ == "__main__":
    main()
