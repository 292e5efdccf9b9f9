"""The notebooks in a real browser, as a reader uses them. Notebook 00: JupyterLab, headless Chromium, Run All, the
slider, Ctrl+S.

The test clones this repository (its committed HEAD) into tmp_path, defines the nbstripout git filter in the clone
the way `make setup` does, and starts JupyterLab there on 127.0.0.1 with its config, data, runtime, settings and
workspace folders in tmp_path (no user settings leak in, nothing is written outside tmp_path). The kernel runs in
smoke mode with runs in tmp_path, and its figures and results where a reader's go, under the data folder (the
session's, outside the clone, so its generated dataset is made once): not into the clone's committed figures/. It
imports the clone's ddpm_core. Chromium (Debian's
`chromium` package, driven by Playwright; no browser download) opens 00_setup.ipynb and runs all cells from the
Run menu. Checked: no cell raises; after Ctrl+S `git status` is clean in the clone (the metadata JupyterLab writes
is as committed, the filter strips the outputs, and the save hook of ddpm_core/lab.py, which the server finds in the
environment's jupyter config as make setup put it there, refreshes git's index) and nothing was written into the
repository; the forward-noising slider is a live widget and dragging it redraws the image;
the "Next" link opens notebook 01.

A second test opens the executed notebooks of the session's smoke run (the reference command's, conftest.py) in
JupyterLab at 1280 x 800, a laptop screen, and fails on any output wider than the notebook (a table that scrolls
sideways, an image cut off), naming the cell.

Skipped, with the reason, where no Chromium or no playwright module is installed (.ci/run installs Chromium).
With DDPM_REQUIRE_BROWSER=1 (.ci/run sets it once Chromium is installed) each of those reasons is a failure
instead, so a passing CI run is one in which this test ran. Run it alone: pytest -m browser.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ddpm_core.paths import REPO_ROOT

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK = "notebooks/00_setup.ipynb"
NEXT = "01_build_the_ddpm.ipynb"
# Bounded waits (seconds). The test needs about 45 s of CPU time in all (JupyterLab, Chromium, the kernel); the
# waits leave room for a 2-core machine that runs other jobs beside it.
SERVER_START_S = 90
KERNEL_READY_S = 120
RUN_ALL_S = 300
SAVE_S = 30
SLIDER_S = 60
NEXT_S = 60

# JupyterLab user settings written into the test's settings folder: every cell stays in the page (the default
# windowing mode may leave cells out of the DOM), and no news or update check pops up over the notebook.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(cmd)} failed in {cwd}:\n{done.stdout}{done.stderr}"
    return done.stdout


def _text(locator) -> str:
    """The element's text, or "" while it is not in the page (inner_text() itself would block until it is)."""
    return locator.first.inner_text() if locator.count() else ""


def _wait(what: str, timeout: float, check, why=lambda: ""):
    """Poll ``check()`` until it returns something truthy; fail naming ``what`` (and ``why()``) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}. {why()}".strip())
        time.sleep(0.25)


def _nbstripout_filter() -> str:
    """The clean filter exactly as the Makefile's setup target defines it (NBSTRIP), with this environment's nbstripout."""
    makefile = (REPO_ROOT / "Makefile").read_text()
    m = re.search(r"^NBSTRIP\s*:=\s*\$\(abspath \$\(VENV\)\)/bin/nbstripout(.*)$", makefile, re.M)
    assert m, "the Makefile no longer defines NBSTRIP := $(abspath $(VENV))/bin/nbstripout ...: update this test"
    exe = shutil.which("nbstripout", path=str(Path(sys.executable).parent)) or shutil.which("nbstripout")
    assert exe, "nbstripout is not installed (a dev dependency: pip install -c constraints.txt -e '.[dev]')"
    return shlex.quote(exe) + m.group(1).rstrip()


# ---------------------------------------------------------------------------------------------------- fixtures
REQUIRE_ENV = "DDPM_REQUIRE_BROWSER"


def _skip(reason: str):
    """Skip with ``reason``; fail with it where $DDPM_REQUIRE_BROWSER says the browser test must run (.ci/run)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but the browser test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    exe = _chromium()
    if exe is None:
        _skip("no Chromium found (chromium or chromium-browser on PATH): install Debian's package with "
                    "`apt-get install -y --no-install-recommends chromium` (.ci/run does it where it can)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _skip("the playwright module is not installed: pip install -c constraints.txt -e '.[dev]'")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--disable-dev-shm-usage"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def clone(tmp_path) -> Path:
    """A fresh clone of the committed repository, with the nbstripout filter of `make setup`."""
    if not (REPO_ROOT / ".git").exists():
        _skip(f"{REPO_ROOT} is not a git checkout: the browser test checks `git status` in a clone of it")
    repo = tmp_path / "repo"
    _run(["git", "clone", "--quiet", str(REPO_ROOT), str(repo)], tmp_path)
    # Files checked out in the second the index was written are "racily clean": the next `git status` would
    # re-read each of them through the filter (a Python start per notebook, minutes on a busy 2-core machine).
    # A refresh a second later, before the filter is defined, records them as clean at the cost of a hash each.
    time.sleep(1.1)
    _run(["git", "update-index", "--refresh"], repo)
    assert _run(["git", "status", "--porcelain"], repo) == "", "a fresh clone is not clean"
    _run(["git", "config", "filter.nbstripout.clean", _nbstripout_filter()], repo)
    _run(["git", "config", "filter.nbstripout.smudge", "cat"], repo)
    return repo


class Lab:
    def __init__(self, url: str, token: str, log: Path):
        self.url, self.token, self.log = url, token, log

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def log_tail(self, n: int = 25) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "JupyterLab's log ends:\n" + "\n".join(lines[-n:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(request, clone, tmp_path, data_root):
    """JupyterLab serving the clone on 127.0.0.1, started from this Python (so kernel "python3" is its ipykernel).
    For a test marked ``lab_reads_only`` it opens notebooks without starting their kernels (that test only looks), and
    exposes the app to the page (``window.jupyterapp``), so that the test opens each notebook without reloading it."""
    starts_kernels = request.node.get_closest_marker("lab_reads_only") is None
    jupyter = tmp_path / "jupyter"
    settings, workspaces, config = jupyter / "settings", jupyter / "workspaces", jupyter / "config"
    for name, values in LAB_SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(values))
    workspaces.mkdir(parents=True)
    config.mkdir(parents=True)
    port, token = _free_port(), os.urandom(16).hex()
    (config / "jupyter_server_config.py").write_text(
        f"c.ServerApp.ip = '127.0.0.1'\n"
        f"c.ServerApp.port = {port}\n"
        f"c.ServerApp.port_retries = 0\n"
        f"c.ServerApp.open_browser = False\n"
        f"c.ServerApp.allow_root = True\n"  # CI runs as root
        f"c.ServerApp.root_dir = {str(clone)!r}\n"
        f"c.IdentityProvider.token = {token!r}\n"
        f"c.LabApp.user_settings_dir = {str(settings)!r}\n"
        f"c.LabApp.workspaces_dir = {str(workspaces)!r}\n"
        f"c.LabApp.news_url = None\n"
        f"c.LabApp.check_for_updates_class = 'jupyterlab.NeverCheckForUpdate'\n"
        f"c.LabApp.extension_manager = 'readonly'\n"
        + ("" if starts_kernels else "c.LabServerApp.notebook_starts_kernel = False\nc.LabApp.expose_app_in_browser = True\n")
    )
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JUPYTER", "JPY_", "DDPM_")) and k not in ("PYTHONPATH", "MPLBACKEND", "IPYTHONDIR")}
    env.update({
        "JUPYTER_CONFIG_DIR": str(config), "JUPYTER_DATA_DIR": str(jupyter / "data"),
        "JUPYTER_RUNTIME_DIR": str(jupyter / "runtime"), "IPYTHONDIR": str(jupyter / "ipython"),
        # the kernel inherits these: smoke mode, runs in tmp_path, the clone's ddpm_core; figures and results where a
        # reader's go (DDPM_FIGURES_DIR and DDPM_RESULTS_DIR unset: under the data folder), not into the clone's figures/
        "DDPM_SMOKE": "1", "DDPM_RUNS_DIR": str(tmp_path / "runs"),
        "DDPM_DATA_DIR": data_root,  # the session's data folder: the generated dataset is made once per test run
        "PYTHONPATH": str(clone),
    })
    log = tmp_path / "jupyterlab.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "jupyterlab"], cwd=clone, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    server = Lab(f"http://127.0.0.1:{port}", token, log)
    try:
        def ready():
            assert proc.poll() is None, f"JupyterLab exited with code {proc.returncode}. {server.log_tail()}"
            try:
                return server.api("kernelspecs")
            except OSError:
                return None

        server.kernelspecs = _wait(f"JupyterLab to answer on {server.url}", SERVER_START_S, ready, server.log_tail)
        yield server
    finally:
        try:
            server.api("shutdown", method="POST")  # stops its kernels too (they run in sessions of their own)
            proc.wait(20)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
                proc.wait(10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass


@pytest.fixture
def page(browser, lab, tmp_path):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.errors = []  # uncaught exceptions and console errors, shown when a step fails
    page.on("pageerror", lambda e: page.errors.append(f"uncaught: {e}"))
    page.on("console", lambda m: m.type == "error" and page.errors.append(f"console: {m.text[:300]}"))
    try:
        yield page
    finally:
        context.close()


# ---------------------------------------------------------------------------------------------------- the test
def test_notebook_00_runs_in_jupyterlab_in_a_real_browser(clone, lab, page, tmp_path, data_root):
    started = time.time() - 1  # figures older than this come from another test's run
    nb_path = clone / NOTEBOOK
    committed = json.loads(nb_path.read_text())
    kernel = committed["metadata"]["kernelspec"]
    specs = lab.kernelspecs["kernelspecs"]
    assert kernel["name"] in specs, (f"{NOTEBOOK} names kernel {kernel['name']!r} but JupyterLab offers only "
                                     f"{sorted(specs)}: install ipykernel where the tests run")
    kernel_label = specs[kernel["name"]]["spec"]["display_name"]  # what the status bar shows (and the save writes)

    def why() -> str:
        shot = tmp_path / "failure.png"
        try:
            page.screenshot(path=str(shot), full_page=True)
        except Exception as e:  # noqa: BLE001 - a diagnostic only
            shot = f"(no screenshot: {e})"
        errors = "\n".join(page.errors[-10:]) or "none"
        return f"Screenshot: {shot}. Browser errors: {errors}. {lab.log_tail(10)}"

    status_bar = page.locator(".jp-StatusBar-Widget")
    notebook = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook")
    prompts = notebook.locator(".jp-CodeCell .jp-InputPrompt")
    current_tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")

    # 1. Open notebook 00: its kernel starts and is idle.
    page.goto(f"{lab.url}/lab/tree/{NOTEBOOK}?token={lab.token}")
    _wait(f"kernel {kernel_label!r} to start for {NOTEBOOK} (status bar: '{kernel_label} | Idle')", KERNEL_READY_S,
          lambda: f"{kernel_label} | Idle" in _text(status_bar), why)
    n_code = sum(c["cell_type"] == "code" for c in committed["cells"])
    assert prompts.count() == n_code, f"JupyterLab shows {prompts.count()} code cells, the notebook has {n_code}"

    # 2. Run > Run All Cells, and wait until no cell is queued or running ("[*]:"). After an error JupyterLab
    # un-queues the cells below it, so a failing notebook ends the wait too.
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()

    def ran():
        texts = prompts.all_inner_texts()
        return texts and texts[0] != "[ ]:" and "[*]:" not in texts

    _wait(f"Run All Cells to finish {NOTEBOOK}", RUN_ALL_S, ran, why)

    # 3. Ctrl+S saves it (the tab is dirty until then).
    assert "jp-mod-dirty" in (current_tab.get_attribute("class") or ""), "running the notebook did not mark it changed"
    before = nb_path.stat().st_mtime_ns
    notebook.locator(".jp-Cell").first.click(position={"x": 2, "y": 2})  # focus the notebook (command mode)
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    _wait("Ctrl+S to save the notebook", SAVE_S,
          lambda: nb_path.stat().st_mtime_ns != before and "jp-mod-dirty" not in (current_tab.get_attribute("class") or ""),
          why)

    # 4. What was saved: every code cell ran, none raised, and the figures went where a reader's go (data/figures/).
    saved = json.loads(nb_path.read_text())
    code = [(i, c) for i, c in enumerate(saved["cells"], 1) if c["cell_type"] == "code"]
    errors = [f"cell {i} (id {c.get('id')}): {o['ename']}: {o['evalue']}"
              for i, c in code for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, f"{NOTEBOOK} raised in the browser:\n" + "\n".join(errors)
    not_run = [f"cell {i} (id {c.get('id')})" for i, c in code if c.get("execution_count") is None]
    assert not not_run, f"Run All Cells left cells unexecuted: {', '.join(not_run)}"
    figures = committed["metadata"]["ddpm"]["figures"]
    written = Path(data_root) / "figures"
    missing = [f for f in figures if not (written / f).is_file() or (written / f).stat().st_mtime < started]
    assert not missing, f"{NOTEBOOK} did not write {missing} into the data folder's figures/ ({written})"

    # 5. `git status` is clean: the filter strips the outputs, the metadata JupyterLab wrote is as committed, and the
    # save hook that make setup registers (ddpm_core/lab.py) refreshed git's index (git takes a file whose size
    # changed as modified without running the filter).
    status = _run(["git", "status", "--porcelain", "--ignored"], clone).splitlines()
    changed = [line for line in status if not line.startswith("!! ")]
    if changed:
        _run(["git", "add", "--all"], clone)
        diff = _run(["git", "diff", "--cached"], clone) or "(none: only the save hook did not run; is it registered?)"
        pytest.fail(f"running and saving {NOTEBOOK} in JupyterLab changed the repository for git: {changed}\n"
                    f"git diff (after the nbstripout filter):\n{diff[:4000]}")
    # ... and nothing was written into the clone's ignored folders either (data/, runs/), but caches.
    stray = [line for line in status if not re.search(r"(^|/)(\.ipynb_checkpoints|__pycache__)/$", line)]
    assert not stray, f"running {NOTEBOOK} wrote into the repository: {stray}"

    # 6. The forward-noising slider is a live widget: dragging it makes the kernel redraw the image.
    widget_errors = notebook.get_by_text("Error displaying widget")
    assert widget_errors.count() == 0, f"a widget failed to render: {widget_errors.first.inner_text()}. {why()}"
    slider = notebook.locator(".widget-slider")
    assert slider.count() == 1, f"expected the one forward-noising slider, found {slider.count()}. {why()}"
    readout, handle = slider.locator(".widget-readout"), slider.locator(".noUi-handle")
    image = notebook.locator(".widget-interact .widget-output img")
    assert image.count() == 1, f"the slider's output shows {image.count()} images, not one. {why()}"
    first, t0 = image.get_attribute("src"), _text(readout)
    lo, hi = (float(handle.get_attribute(a)) for a in ("aria-valuemin", "aria-valuemax"))
    slider.scroll_into_view_if_needed()
    knob, track = handle.bounding_box(), slider.locator(".noUi-base").bounding_box()
    y = knob["y"] + knob["height"] / 2
    page.mouse.move(knob["x"] + knob["width"] / 2, y)
    page.mouse.down()
    page.mouse.move(track["x"] + track["width"] * 0.6, y, steps=10)
    page.mouse.up()
    _wait(f"the slider to move off t = {t0}", SLIDER_S, lambda: _text(readout) not in ("", t0), why)
    t = int(_text(readout))
    assert abs(t - (lo + 0.6 * (hi - lo))) <= 0.1 * (hi - lo), f"dragging the slider to 60 % of its track gave t = {t}"
    _wait(f"the image to be redrawn for t = {t}", SLIDER_S,
          lambda: image.count() == 1 and image.get_attribute("src") not in (None, first), why)

    # 7. The "Next" link opens notebook 01 in JupyterLab.
    # JupyterLab renders the link as .../files/notebooks/01_...ipynb?_xsrf=... and opens it in a tab of its own.
    link = notebook.locator("p", has_text="Next:").locator(f'a[href*="/notebooks/{NEXT}"]')
    assert link.count() == 1, f"{NOTEBOOK} has no 'Next:' link to {NEXT}. {why()}"
    link.click()
    _wait(f"the Next link to open {NEXT}", NEXT_S, lambda: current_tab.inner_text().strip() == NEXT, why)
    _wait(f"{NEXT} to show its title", NEXT_S,
          lambda: _text(notebook.locator(".jp-MarkdownCell h1")).startswith("01"), why)


def test_ci_turns_a_missing_browser_into_a_failure(monkeypatch):
    """.ci/run sets DDPM_REQUIRE_BROWSER=1 once Chromium is installed, so a skipped browser test cannot pass CI."""
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no Chromium"):
        _skip("no Chromium")
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="cannot run: no Chromium"):
        _skip("no Chromium")
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert f"export {REQUIRE_ENV}=1" in ci and ci.index(f"export {REQUIRE_ENV}=1") < ci.index("make test")


# The widths a student's browser gives the notebook: a 1280-pixel laptop screen with JupyterLab's file browser open
# leaves an output area of about 850 pixels.
LAPTOP = {"width": 1280, "height": 800}
OPEN_S = 60
# Every output wider than its output area (a table that scrolls sideways, an image cut off), as
# {cell, kind, area, width, text}: the widest descendant's right edge against the output area's own width.
TOO_WIDE_JS = """() => {
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const cells = [...panel.querySelectorAll('.jp-Cell')];
  const found = [];
  panel.querySelectorAll('.jp-OutputArea-output').forEach((o) => {
    const box = o.getBoundingClientRect();
    let right = box.left + o.scrollWidth;
    o.querySelectorAll('*').forEach((e) => { right = Math.max(right, e.getBoundingClientRect().right); });
    if (right - box.left > o.clientWidth + 2) {
      found.push({cell: cells.indexOf(o.closest('.jp-Cell')) + 1,
                  kind: o.querySelector('table') ? 'table' : o.querySelector('img') ? 'image' : 'text',
                  area: Math.round(o.clientWidth), width: Math.round(right - box.left),
                  text: o.innerText.slice(0, 90).replace(/\\s+/g, ' ')});
    }
  });
  return found;
}"""


@pytest.mark.lab_reads_only  # one JupyterLab load, no kernels: 42 s instead of 78 s, a reload and a kernel per notebook
def test_every_executed_notebook_fits_a_laptop_screen(smoke_reference, clone, lab, browser, tmp_path):
    """The smoke run's executed notebooks, opened in JupyterLab at 1280 x 800: no output is wider than its area."""
    executed = sorted((smoke_reference[0] / "notebooks").glob("*.ipynb"))
    assert len(executed) == len(list((clone / "notebooks").glob("*.ipynb"))), "the smoke run left notebooks out"
    for nb in executed:
        shutil.copy(nb, clone / "notebooks" / nb.name)
    context = browser.new_context(viewport=LAPTOP)
    page = context.new_page()
    page.set_default_timeout(OPEN_S * 1000)
    too_wide = {}
    try:
        for nb in executed:
            outputs = sum(len(c.get("outputs", [])) > 0 for c in json.loads(nb.read_text())["cells"])
            if nb == executed[0]:  # JupyterLab loads once; each notebook is then opened in it, alone
                page.goto(f"{lab.url}/lab?reset&token={lab.token}")
                page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands.hasCommand('docmanager:open')")
            page.evaluate("""async (path) => {
                await window.jupyterapp.commands.execute('application:close-all');
                await window.jupyterapp.commands.execute('docmanager:open', {path});
            }""", f"notebooks/{nb.name}")
            shown = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell .jp-OutputArea-child")
            _wait(f"{nb.name} to show the outputs of its {outputs} cells", OPEN_S, lambda: shown.count() >= outputs)
            page.wait_for_function("() => [...document.images].every((i) => i.complete)")
            found = page.evaluate(TOO_WIDE_JS)
            if found:
                too_wide[nb.name] = found
                page.screenshot(path=str(tmp_path / f"{nb.stem}.png"))
            started = lab.api("sessions")
            assert not started, f"opening {nb.name} to look at it started kernels: {started}"
    finally:
        context.close()
    assert not too_wide, (f"outputs wider than the notebook at {LAPTOP['width']} px (screenshots in {tmp_path}):\n"
                          + "\n".join(f"{name}: {f}" for name, found in too_wide.items() for f in found))
