"""Run the numbered notebooks headless with papermill: the main job, and the notebook tests.

    python -m ddpm_core.series                 # every notebook; smoke mode without a GPU
    python -m ddpm_core.series 01 02 --smoke   # some of them, smoke mode forced

Each notebook declares the figures it makes in its metadata (``metadata["ddpm"]["figures"]``);
a run fails if a cell raises or a declared figure was not written. Executed copies go to
``runs/notebooks/`` (never over the committed, output-free notebooks), figures to ``data/figures/``
or ``$DDPM_FIGURES_DIR`` (never over the committed ones in ``figures/``: ``reference figures`` copies them there).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .paths import REPO_ROOT, figures_dir

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"


class NotebookFailed(RuntimeError):
    """A notebook raised in a cell or did not write a figure it declares."""


@dataclass
class NotebookRun:
    notebook: Path
    executed: Path
    seconds: float
    figures: list[Path]


def list_notebooks(folder: Path = NOTEBOOKS_DIR) -> list[Path]:
    """The numbered notebooks (``NN_name.ipynb``, and ``NNx_name.ipynb`` for a lesson inserted after NN) in order."""
    import re

    return sorted(p for p in folder.glob("[0-9][0-9]*_*.ipynb") if re.match(r"^\d\d[a-z]?_", p.name))


def select(only: list[str] | None, folder: Path = NOTEBOOKS_DIR) -> list[Path]:
    """The notebooks named by ``only`` (all when empty): a number ("03", "03b") names exactly that
    notebook, a longer name ("03_batch") the notebooks whose file name starts with it."""
    def named(nb: Path, o: str) -> bool:
        return nb.name.split("_")[0] == o or ("_" in o and nb.name.startswith(o))

    return [nb for nb in list_notebooks(folder) if not only or any(named(nb, o) for o in only)]


def declared_figures(notebook: Path, gpu: bool = False) -> list[str]:
    """The figure file names a notebook declares in ``metadata["ddpm"]["figures"]``; with ``gpu=True`` also those it
    writes only where a GPU ran it (``metadata["ddpm"]["gpu_figures"]``: 03b's allocator timeline)."""
    meta = json.loads(Path(notebook).read_text()).get("metadata", {}).get("ddpm", {})
    return list(meta.get("figures", [])) + (list(meta.get("gpu_figures", [])) if gpu else [])


@contextlib.contextmanager
def temporary_env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables (seen by the kernels started inside) and restore them afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


WIDGET_VIEW, WIDGET_STATE = "application/vnd.jupyter.widget-view+json", "application/vnd.jupyter.widget-state+json"


def settle_progress_bars(nb) -> int:
    """Give each tqdm progress bar of an executed notebook its final text.

    A tqdm bar in a notebook is a widget; its output also carries a plain-text copy for viewers
    that do not run widgets (GitHub, a terminal), and that copy is the bar as it was created:
    "0%| | 0/40". The executed notebook stores every widget's final state in its metadata, so
    the text is rebuilt from there ("training: 100%|##########| 40/40 [00:12<00:00, 3.2it/s]").
    A bar made with ``leave=False`` closes its widget when it ends, and JupyterLab then hides it; its
    stored text is its last refresh ("decoding dataset:  94%"). tqdm marks every bar that it keeps
    (``bar_style`` "success", or "danger" for one that stopped early), so a finished bar with no style
    is one that was hidden: its output is removed from the executed copy too.
    Returns the number of bars rewritten or removed.
    """
    import html

    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})

    def model(ref: str) -> dict:
        return state.get(ref.removeprefix("IPY_MODEL_"), {})

    n = 0
    for cell in nb.cells:
        kept = []
        for out in cell.get("outputs", []):
            kept.append(out)
            view = out.get("data", {}).get(WIDGET_VIEW)
            box = model(view["model_id"]) if view else {}
            parts = [model(c) for c in box.get("state", {}).get("children", [])] if box.get("model_name") == "HBoxModel" else []
            if len(parts) != 3 or parts[1].get("model_name") != "FloatProgressModel":
                continue
            left, bar, right = (p.get("state", {}) for p in parts)
            n += 1
            if not bar.get("bar_style"):  # leave=False: closed and hidden when it ended
                kept.pop()
                continue
            done = bar.get("value", 0) / bar["max"] if bar.get("max") else 0.0
            filled = min(10, max(0, round(10 * done)))
            text = f"{left.get('value', '')}|{'#' * filled}{' ' * (10 - filled)}|{right.get('value', '')}"
            out["data"]["text/plain"] = html.unescape(text).replace("\u2007", " ")
        if "outputs" in cell:
            cell["outputs"] = kept
    return n


def run_notebook(notebook: Path, out_dir: Path, *, smoke: bool, figures: Path | None = None,
                 timeout: int = 1800, parameters: dict | None = None) -> NotebookRun:
    """Execute ``notebook`` into ``out_dir`` and check its declared figures were written.

    Figures go to ``figures`` (default: the figures folder in effect). Raises ``NotebookFailed``
    naming the cell error or the missing figure.
    """
    import papermill as pm

    notebook, out_dir = Path(notebook), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = Path(figures) if figures is not None else figures_dir()
    executed = out_dir / notebook.name
    import torch  # the kernel sees the GPU this process sees: then the GPU-only figures are due too

    expected = declared_figures(notebook, gpu=torch.cuda.is_available())
    before = {name: (figures / name).stat().st_mtime_ns if (figures / name).exists() else None for name in expected}
    start = time.perf_counter()
    try:
        # DDPM_HEADLESS: no frontend is attached, so notebooks leave out live widgets (00's slider).
        # MPLBACKEND: the kernel's own inline backend, whatever the caller's (the H100 run exported Agg for its tests,
        # and every figure of its executed notebooks was missing: plt.show() under Agg embeds nothing).
        with temporary_env({"DDPM_SMOKE": "1" if smoke else "0", "DDPM_FIGURES_DIR": str(figures), "DDPM_HEADLESS": "1",
                            "MPLBACKEND": "module://matplotlib_inline.backend_inline"}):
            pm.execute_notebook(str(notebook), str(executed), parameters=parameters or {}, cwd=str(notebook.parent),
                                kernel_name="python3", progress_bar=False, execution_timeout=timeout,
                                # ipykernel >= 7.4 logs a plain-TCP warning at every start; the kernel listens on
                                # 127.0.0.1 only. Its errors still print.
                                extra_arguments=["--IPKernelApp.log_level=ERROR"])
    except pm.PapermillExecutionError as e:
        raise NotebookFailed(f"{notebook.name}: cell {e.exec_count} raised {e.ename}: {e.evalue} "
                             f"(executed copy: {executed})") from e
    finally:
        _settle_file(executed)
    seconds = time.perf_counter() - start
    missing = [n for n in expected if not (figures / n).exists() or (figures / n).stat().st_mtime_ns == before[n]]
    if missing:
        raise NotebookFailed(f"{notebook.name} declares figures it did not write in {figures}: {', '.join(missing)}")
    return NotebookRun(notebook, executed, seconds, [figures / n for n in expected])


def _settle_file(executed: Path) -> None:
    """settle_progress_bars on an executed copy on disk (if it exists and has bars)."""
    import nbformat

    if executed.is_file():
        nb = nbformat.read(executed, as_version=4)
        if settle_progress_bars(nb):
            nbformat.write(nb, executed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpm_core.series", description=__doc__.split("\n\n")[0])
    p.add_argument("only", nargs="*", help="notebook numbers to run, e.g. 03 03b (default: all)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="force smoke mode")
    mode.add_argument("--full", action="store_true", help="force full mode (slow without a GPU)")
    p.add_argument("--out", default=str(REPO_ROOT / "runs" / "notebooks"), help="where executed copies go")
    args = p.parse_args(argv)

    import torch

    if args.smoke or args.full:
        smoke = args.smoke
        why = "as asked"
    elif os.environ.get("DDPM_SMOKE") in ("0", "1"):
        smoke = os.environ["DDPM_SMOKE"] == "1"
        why = "from DDPM_SMOKE"
    else:
        smoke = not torch.cuda.is_available()
        why = "no GPU found, so the series runs shrunk to finish in minutes" if smoke else "a GPU is present"
    notebooks = select(args.only)
    if not notebooks:
        print(f"no notebooks match {args.only} in {NOTEBOOKS_DIR}", file=sys.stderr)
        return 2
    print(f"mode: {'SMOKE' if smoke else 'FULL'} ({why}); {len(notebooks)} notebooks; "
          f"figures -> {figures_dir()}; executed copies -> {args.out}", flush=True)
    for nb in notebooks:
        print(f"running {nb.name} ...", flush=True)
        try:
            run = run_notebook(nb, Path(args.out), smoke=smoke)
        except NotebookFailed as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
        print(f"  done in {run.seconds:.0f} s: {', '.join(f.name for f in run.figures) or 'no figures'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def stream_command(cmd: list[str], env: dict | None = None, timeout: float | None = None) -> tuple[int, str]:
    """Run ``cmd`` and print its output line by line as it comes (a notebook cell shows it live).

    Returns (exit code, the whole output). Used to launch ``torchrun`` from the notebooks.

    The command runs in its own process group. After ``timeout`` seconds, even if it prints
    nothing, or when the cell is interrupted, the whole group is stopped (SIGTERM, then SIGKILL
    5 s later), so torchrun's workers do not outlive it; the exit code is then 124 (timeout).
    """
    import queue
    import signal
    import subprocess
    import threading

    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    lines: list[str] = []
    q: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()

    def stop_group() -> None:
        """SIGTERM to the whole group, 5 s to exit, then SIGKILL to whatever is left of it (workers too)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                line = q.get(timeout=wait)
            except queue.Empty:
                stop_group()
                msg = f"[stream_command: no end after {timeout:g} s; stopped {cmd[0]} and every process it started]\n"
                lines.append(msg)
                print(msg, end="", flush=True)
                proc.wait()
                return 124, "".join(lines)
            if line is None:
                break
            lines.append(line)
            print(line, end="", flush=True)
    except KeyboardInterrupt:
        stop_group()
        raise
    rc = proc.wait()
    with contextlib.suppress(ProcessLookupError):  # workers left behind by a leader that exited
        os.killpg(proc.pid, signal.SIGKILL)
    return rc, "".join(lines)
