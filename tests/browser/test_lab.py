"""The course as a learner meets it: `./course lab` in a real browser (headless Chromium via Playwright).

    .venv/bin/python -m pip install -r tests/browser/requirements.txt   # playwright (pinned)
    apt-get install chromium                                           # Debian's; or set COURSE_CHROMIUM
    .venv/bin/python -m pytest tests/browser

`.ci/run` installs both and runs this after the README's test command. Plain `./course test`
collects this folder only where playwright is installed (tests/conftest.py).

It starts `./course lab` (in a scratch workspace, workspace/.browser-test/, so a learner's own
copies are left alone), then, in JupyterLab:
- chapter 01 of the learner's edition: the stored H100 images load, the ✓ lines are shown, each
  exercise shows its placeholder and none of its solution, and the solution's and its checker's
  outputs are empty;
- chapter 00: runs the first cells through the UI (Shift+Enter), checks what this CPU machine
  prints (no warnings), saves, and checks the save went to the workspace copy and that no tracked
  file changed.
"""

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from course_utils.tooling import workspace as ws

sync_api = pytest.importorskip("playwright.sync_api")

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("COURSE_CHROMIUM", "/usr/bin/chromium")
# Debian's Chromium on a machine with no network: without these it keeps trying to reach Google.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCRATCH = "workspace/.browser-test"  # inside the checkout (git-ignored), like the real workspace
LAB_SETTINGS = {
    # every cell in the DOM, so the whole notebook can be checked
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    # no requests to the outside, no news toast over the notebook
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}
TIMEOUT_MS = 60_000

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM} (set COURSE_CHROMIUM)")


def _git_status():
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`./course lab` on a free port, headless; yields its URL and token."""
    tmp = tmp_path_factory.mktemp("lab")
    shutil.rmtree(ROOT / SCRATCH, ignore_errors=True)
    settings = tmp / "settings"
    for plugin, values in LAB_SETTINGS.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, COURSE_WORKSPACE=SCRATCH, JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "lab-workspaces"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"))
    log = tmp / "lab.log"
    status_before = _git_status()
    with open(log, "w") as out:
        server = subprocess.Popen(
            ["./course", "lab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
             f"--IdentityProvider.token={token}"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"`./course lab` did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield {"url": url, "token": token, "log": log, "status_before": status_before}
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server we started, and its kernels
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        shutil.rmtree(ROOT / SCRATCH, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(TIMEOUT_MS)
        yield context
        context.close()


@pytest.fixture
def page(browser, request, tmp_path):
    page = browser.new_page()
    yield page
    shot = Path(os.environ.get("COURSE_BROWSER_SHOTS", tmp_path)) / f"{request.node.name}.png"
    shot.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shot))
    print(f"screenshot: {shot}")
    page.close()


def open_notebook(page, lab, name):
    page.goto(f"{lab['url']}/lab/tree/{name}?token={lab['token']}&reset")
    panel = page.locator(".jp-NotebookPanel:visible")
    panel.wait_for()
    # the kernel is up once the status bar says so (the toolbar's indicator reads idle before it starts)
    idle = re.compile(r"Python 3 \(ipykernel\) \| Idle")
    page.locator("#jp-main-statusbar").get_by_text(idle).wait_for(timeout=120_000)
    cells = panel.locator(".jp-Notebook .jp-Cell")
    expected = len(nbformat.read(ROOT / SCRATCH / "learner" / name, as_version=4).cells)
    page.wait_for_function("([sel, n]) => document.querySelectorAll(sel).length === n",
                           arg=[".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell", expected])
    return panel, cells


def cell_input(cell):
    cell.scroll_into_view_if_needed()
    return cell.locator(".jp-InputArea-editor, .jp-MarkdownOutput").first.inner_text()


def test_course_lab_opens_the_learner_workspace(lab, page):
    assert "learner edition in workspace/.browser-test/learner/" in lab["log"].read_text()
    page.goto(f"{lab['url']}/lab?token={lab['token']}&reset")
    listing = page.locator(".jp-DirListing-content")
    listing.get_by_text("00_setup.ipynb").wait_for()
    assert listing.get_by_text("07_hopper_overlap.ipynb").count() == 1


def test_stored_outputs_render_and_solutions_are_blank(lab, page):
    name = "01_naive_attention.ipynb"
    learner = nbformat.read(ROOT / SCRATCH / "learner" / name, as_version=4)
    teacher = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    panel, cells = open_notebook(page, lab, name)

    # the stored H100 figures are there and the browser decoded them
    stored_images = sum("image/png" in o.get("data", {}) for c in learner.cells for o in c.get("outputs", []))
    images = panel.locator(".jp-RenderedImage img")
    assert stored_images > 0 and images.count() == stored_images
    for i in range(images.count()):
        images.nth(i).scroll_into_view_if_needed()
        page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=images.nth(i).element_handle())
    # the ✓ lines of the checks, as stored
    stored_ticks = sum(o.get("text", "").count("✓") for c in learner.cells for o in c.get("outputs", []))
    shown_ticks = panel.locator(".jp-OutputArea-output").evaluate_all(
        "nodes => nodes.map(n => (n.innerText.match(/✓/g) || []).length).reduce((a, b) => a + b, 0)")
    assert stored_ticks > 0 and shown_ticks == stored_ticks
    # each exercise: the placeholder, none of the solution, no output that gives it away
    solutions = [i for i, cell in enumerate(teacher.cells) if ws.is_solution_cell(cell)]
    assert solutions
    for i in solutions:
        shown = cell_input(cells.nth(i))
        assert ws.PLACEHOLDER in shown
        block = ws._SOLUTION.search(teacher.cells[i].source).group(0)
        for line in block.splitlines()[1:-1]:
            assert not line.strip() or line.strip() not in shown, f"solution line shown: {line.strip()}"
        for j in (i, i + 1):  # the solution and its checker
            assert cells.nth(j).locator(".jp-OutputArea-output").count() == 0


def test_run_chapter_00_first_cells_through_the_ui(lab, page):
    name = "00_setup.ipynb"
    panel, cells = open_notebook(page, lab, name)
    first = cells.nth(1)
    assert "NVIDIA H100" in first.locator(".jp-OutputArea").inner_text(), "the stored output before running"

    # select the first cell and press Shift+Enter through the first four code cells (0..8; cell 2 is the note
    # that the stored machine printout is the H100's)
    cells.nth(0).locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    for _ in range(9):
        page.keyboard.press("Shift+Enter")
    last = cells.nth(8)
    # queued or running: [*]; the stored outputs keep their execution counts, so wait for the star first
    sync_api.expect(last.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\*\]"), timeout=30_000)
    sync_api.expect(last.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"), timeout=240_000)

    machine = first.locator(".jp-OutputArea").inner_text()
    assert "No GPU: tile programs run through TileLang's C backend" in machine
    assert "NVIDIA H100" not in machine
    assert first.locator("[data-mime-type='application/vnd.jupyter.stderr']").count() == 0, \
        f"a warning in the course's very first output:\n{machine}"
    assert "def shared(self, shape, dtype):" in cells.nth(4).locator(".jp-OutputArea").inner_text()
    assert "✓ vector add" in last.locator(".jp-OutputArea").inner_text()
    assert panel.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").count() == 0

    # save: the learner's copy gets this machine's outputs, the repository does not change
    page.keyboard.press("Control+s")
    copy = ROOT / SCRATCH / "learner" / name
    deadline = time.monotonic() + 30
    while "No GPU" not in copy.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "No GPU" in copy.read_text(), "Ctrl+S did not save the workspace copy"
    assert _git_status() == lab["status_before"], "using JupyterLab changed files in the repository"
