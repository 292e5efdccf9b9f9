"""The reference run: every notebook in full mode on a real GPU, committed under ``data/reference/<gpu>/``.

    make reference                               # = python -m ddpm_core.reference run
    python -m ddpm_core.reference run --parts nb-04        # one part (each fits an 8-minute command)
    python -m ddpm_core.reference pack           # results.csv, trimmed traces, one archive (<= 15 MB)
    python -m ddpm_core.reference unpack data/reference/h100-80gb-hbm3.tar.gz

``run`` goes in parts (``PARTS``), each at most 8 minutes on one H100, and is resumable: a part
already done is skipped (``--force`` redoes it). After every notebook part the folder is whole
(its result rows merged into results.csv, its traces trimmed into traces/), so the scratch folder
``_work`` never has to travel: a run can go on in another command, on another machine, in another
session, from the committed folder alone. ``--archive-to DIR`` packs the folder into DIR after
every part, so a command killed at its time limit still returns the parts it finished, and
``--keep-going`` runs the remaining parts after one fails (a shakedown of every notebook's GPU
branches in one command: ``run --smoke --keep-going``). ``scripts/gpu_call.sh`` is one device command.
Without a GPU the same command runs everything in smoke mode and writes a complete folder of the
same layout, which the test suite checks.

Layout of one reference folder::

    meta.json          GPU name and memory, driver, CUDA, cuDNN, torch, python, date, git commit, mode
    parts.json         each part's status, wall seconds and error
    tests.log          the output of the ``gpu``-marked tests that are not ``slow`` (pytest -m "gpu and not slow")
    tests-slow.log     the output of the ``gpu`` and ``slow`` ones: those that compile (CUDA graphs, max-autotune)
    results.csv        every notebook's measurement rows (columns: see data/README.md)
    notebooks/         the executed notebooks, with their outputs
    figures/           the figures of the run, titled with its device
    traces/<name>/     trimmed profiler traces (rank<R>.pt.trace.json.gz), one folder per captured run

Notebooks show it with ``show(notebook, traces=[...])``: an "On <GPU> (reference run, not this
machine)" block beside their own numbers.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from .paths import REPO_ROOT, figures_dir

REFERENCE_DIR = REPO_ROOT / "data" / "reference"
# one device command is at most 10 minutes; keep 2 in hand. A detached run (scripts/gpu_call.sh --detach) outlives
# one command and gives each notebook its whole deadline through DDPM_PART_BUDGET_S.
PART_BUDGET_S = int(os.environ.get("DDPM_PART_BUDGET_S") or 8 * 60)
ARCHIVE_LIMIT_BYTES = 15 * 2**20
TRACE_STEPS = 3  # ProfilerSteps kept per trimmed trace (HTA drops the last one)
WORK = "_work"  # scratch inside the folder (runs, per-notebook results): never packed or committed
NOTEBOOK_PARTS: dict[str, list[str]] = {  # grouped so that each part fits PART_BUDGET_S on one H100
    "nb-00-01": ["00", "01"],  # 01 trains the paper's model for 4 minutes (TRAIN_SECONDS) and samples 1000 steps
    "nb-02": ["02"],
    "nb-03": ["03", "03b"],  # 03b_memory runs largest-batch searches
    "nb-04": ["04"],  # compiles three modes, then its solutions compile more (CUDA graphs at two batches, max-autotune)
    "nb-05-06": ["05", "06"],
    "nb-07-08": ["07", "08"],  # 07 compiles its step
    "nb-09": ["09"],  # seven compiled stages
    "nb-09b": ["09b"],  # the peers (diffusers, lucidrains: their wheels, scripts/gpu_wheels.sh), the ceiling, the quality runs
    "nb-10": ["10"],
}
# The gpu tests in two parts: on the H100 (2026-11-26) one cold reduce-overhead compile of the tiny model took 55 s
# and the max-autotune test ran past 160 s, so all of them together do not fit one part.
GPU_TEST_PARTS = {"gpu-tests": ("gpu and not slow", "tests.log"), "gpu-tests-slow": ("gpu and slow", "tests-slow.log")}
PARTS = ["meta", *GPU_TEST_PARTS, *NOTEBOOK_PARTS, "pack"]
SELF_ENV = "DDPM_REFERENCE_SELF"  # set while the reference run executes the notebooks
IS_REFERENCE = "This executed copy is the reference run itself"  # how self_line() begins, whatever the machine


def self_line() -> str:
    """What a notebook's reference block says inside the reference run: it is the reference, made where and how.

    A smoke-mode or GPU-less reference (the test suite's stand-in) says it holds no GPU numbers: its block sits
    under a heading about the reference GPU, and "everything above was measured there" must not read as a GPU run.
    """
    import torch

    from .env import device_name

    where = device_name()
    if os.environ.get("DDPM_SMOKE") == "1" or not torch.cuda.is_available():
        mode = "smoke mode" if os.environ.get("DDPM_SMOKE") == "1" else "full mode"
        return (f"{IS_REFERENCE}, made in {mode} on {where}: a stand-in made without a GPU (the test suite makes "
                "one), so it shows no GPU numbers. Copies of this notebook run elsewhere show the committed GPU "
                "reference in this place.")
    return (f"{IS_REFERENCE}, made in full mode on {where}: everything above was measured there. Copies of this "
            "notebook run elsewhere show its numbers in this place.")
NO_REFERENCE = ("No reference GPU run is committed in data/reference/ yet: run `make reference` on a GPU "
                "machine (README, 'Reference run').")
RESULT_COLUMNS = [("variant", "variant"), ("batch_size", "batch"), ("precision", "precision"),
                  ("median_ms", "ms/step"), ("p10_ms", "p10 ms"), ("p90_ms", "p90 ms"), ("images_per_s", "img/s"),
                  ("tflops", "TFLOP/s"), ("mfu", "MFU"), ("mfu_bf16", "MFU vs bf16 peak"),
                  ("peak_memory_gib", "peak memory (GiB)")]


# ------------------------------------------------------------------------------ reading
def reference_dir() -> Path:
    """Where reference folders live: $DDPM_REFERENCE_DIR if set, else <repo>/data/reference."""
    return Path(os.environ.get("DDPM_REFERENCE_DIR") or REFERENCE_DIR)


def reference_runs(root: Path | None = None) -> list[Path]:
    """The reference folders that hold a meta.json, by name."""
    root = Path(root) if root is not None else reference_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / "meta.json").is_file())


def notebook_seconds(folder: Path, notebook: str) -> float | None:
    """How long ``notebook`` ran in the reference run in ``folder`` (from parts.json), or None."""
    path = Path(folder) / "parts.json"
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for part in status.values():
        if isinstance(part, dict) and notebook in part.get("notebooks", {}):
            return float(part["notebooks"][notebook])
    return None


def meta(folder: Path) -> dict:
    """A reference folder's meta.json (device_name, torch_version, ...)."""
    return json.loads((Path(folder) / "meta.json").read_text())


def label(folder: Path) -> str:
    """"reference: NVIDIA H100 80GB HBM3 · torch 2.x · <date>" for figure titles."""
    m = meta(folder)
    parts = [f"reference: {m.get('device_name', Path(folder).name)}", f"torch {m.get('torch_version', '?')}"]
    if m.get("date"):
        parts.append(str(m["date"])[:10])
    if m.get("mode") == "smoke":
        parts.append("smoke mode")
    return " · ".join(parts)


def trace_dir(folder: Path, run: str) -> Path | None:
    """The trace folder of ``run`` (e.g. "02_baseline") in a reference folder, if it was committed."""
    d = Path(folder) / "traces" / run
    return d if d.is_dir() and any(d.glob("*.json*")) else None


def trace_names(folder: Path, patterns: Sequence[str]) -> list[str]:
    """The trace folders of a reference that match ``patterns`` (globs relative to its traces/)."""
    root = Path(folder) / "traces"
    found: list[str] = []
    for pat in patterns:
        for d in sorted(root.glob(pat)):
            name = d.relative_to(root).as_posix()
            if d.is_dir() and any(d.glob("*.json*")) and name not in found:
                found.append(name)
    return found


def results(folder: Path, notebook: str | None = None):
    """The reference's results.csv as a DataFrame (only ``notebook``'s rows when given)."""
    import pandas as pd

    path = Path(folder) / "results.csv"
    if not path.exists():
        return pd.DataFrame()
    df = pd.read_csv(path, keep_default_na=False, na_values=[""])
    if notebook is not None and "notebook" in df:
        df = df[df["notebook"].astype(str) == notebook]
    return df


def _result_table(df):
    cols = [(c, n) for c, n in RESULT_COLUMNS if c in df and df[c].notna().any()]
    out = df[[c for c, _ in cols]].rename(columns=dict(cols)).reset_index(drop=True)
    for name in ("MFU", "MFU vs bf16 peak"):
        if name in out:
            out[name] = out[name].map(lambda v: None if v != v else f"{100 * float(v):.1f}%")
    from ddpm_core.bench import readable

    return readable(out.round(3))  # a missing value says n/a


def show(notebook: str, *, traces: Sequence[str] = (), figures: Sequence[str] | None = None) -> bool:
    """Show the committed reference GPU run(s) for ``notebook`` (e.g. "03_batch_size") in a notebook.

    For each reference folder: a heading "On <GPU> (reference run, not this machine)", the
    notebook's result rows, HTA's temporal / idle / kernel / launch analyses of the reference
    traces matching ``traces`` (their charts saved as ``<NN>_reference_<trace>_<kind>.png``), and
    the notebook's own figures from that run (``figures``: default, those it declares). Returns
    whether anything was shown; with no reference it prints one line saying how to make one.
    """
    from IPython.display import Image, Markdown, display

    from . import plots
    from . import traces as tr

    if os.environ.get(SELF_ENV) == "1":  # the H100 run's own copies said "no reference is committed yet"
        print(self_line())
        return False
    runs = reference_runs()
    if not runs:
        print(NO_REFERENCE)
        return False
    if figures is None:
        from .series import NOTEBOOKS_DIR, declared_figures

        nb_path = NOTEBOOKS_DIR / f"{notebook}.ipynb"
        figures = declared_figures(nb_path) if nb_path.exists() else []
    prefix = notebook.split("_")[0]  # "03", "03b"
    for folder in runs:
        m = meta(folder)
        ref_label = label(folder)
        mode = " in smoke mode (a stand-in made without a GPU)" if m.get("mode") == "smoke" else ""
        display(Markdown(
            f"### On {m.get('device_name', folder.name)} (reference run, not this machine)\n\n"
            f"Everything above this heading was measured on this machine. Everything below comes from the "
            f"reference run{mode}: {ref_label}, git commit `{str(m.get('git_commit', '?'))[:10]}`, "
            f"committed in `data/reference/{folder.name}/`."
            + (f" This notebook ran for **{secs / 60:.1f} min** there{mode or ' in full mode'}."
               if (secs := notebook_seconds(folder, notebook)) is not None else "")))
        if secs is None and (folder / "parts.json").exists():
            # a reference made across several commands or sessions: this notebook's part is not done yet
            done = [p for p, v in json.loads((folder / "parts.json").read_text()).items()
                    if isinstance(v, dict) and v.get("status") == "done"]
            display(Markdown(f"That run has not reached this notebook yet (parts done: {', '.join(done) or 'none'}). "
                             "Nothing below comes from it for this notebook."))
            continue
        rows = results(folder, notebook)
        if len(rows):
            display(_result_table(rows))
        for name in trace_names(folder, traces):
            try:
                rep = tr.analyze(folder / "traces" / name, verbose=False)
            except Exception as e:  # noqa: BLE001 - a damaged reference trace must not stop the notebook
                print(f"reference trace {name}: cannot be read ({type(e).__name__}: {e})")
                continue
            stem = f"{prefix}_reference_{name.replace('/', '_')}"
            display(Markdown(f"**Trace `{name}`** ({'GPU' if rep.has_gpu else 'CPU only'}, ranks {rep.ranks})"))
            if rep.has_gpu:
                temporal, kinds = rep.table("temporal"), rep.table("kernels")
                for what in ("idle", "launch_summary"):
                    df = rep.table(what)
                    if df is not None:
                        display(df)
                title = "GPU time: compute, non-compute, idle (HTA)"
            else:
                temporal, kinds = rep.cpu_temporal, tr.op_categories(rep.cpu_ops)
                title = "CPU main thread: compute ops, other ops, outside ops (no GPU in this trace)"
            if temporal is not None and len(temporal):
                display(tr.per_rank(temporal))
                fig = plots.temporal_breakdown(temporal, label=ref_label, title=f"{name}: {title}")
                plots.savefig(fig, f"{stem}_temporal.png")
                plots.plt.show()
            if kinds is not None and len(kinds):
                fig = plots.kernel_breakdown(kinds, label=ref_label, title=f"{name}: " + (
                    "GPU kernel time by type (HTA)" if rep.has_gpu else "CPU operator self time by kind"))
                plots.savefig(fig, f"{stem}_kernels.png")
                plots.plt.show()
        for fig_name in figures:
            path = folder / "figures" / fig_name
            if path.exists():
                display(Markdown(f"`{fig_name}` from the reference run:"))
                display(Image(filename=str(path)))
    return True


# A line of a reference notebook's own output that the README quotes under its status table (so that the README's
# GPU sentences are the run's printed words, never retyped): notebook -> a regular expression for the line.
HEADLINES = {"01_build_the_ddpm": r"^fastest eager configuration: .* per step on average.*$"}


def headlines(folder: Path) -> dict[str, str]:
    """The HEADLINES lines that the executed notebooks in ``folder`` printed, by notebook."""
    found = {}
    for name, pattern in HEADLINES.items():
        path = Path(folder) / "notebooks" / f"{name}.ipynb"
        if not path.exists():
            continue
        for cell in json.loads(path.read_text())["cells"]:
            text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("output_type") == "stream")
            if hit := re.search(pattern, text, flags=re.M):
                found[name] = hit.group(0).strip()
                break
    return found


STAGES_NOTEBOOK = "09_putting_it_together"


def stages_markdown(folder: Path) -> str:
    """The README's GPU table: notebook 09's stages from a reference's results.csv ("" before 09 has run there).

    Each stage's img/s is compared with the first stage's by ``bench.Comparison.speedup`` itself, built from the
    rows; otherwise the cell says "noisy", as 09's table does. (The machine's load, which a row does not keep, is
    09's own to report: the rebuilt comparison counts the machine as quiet.)"""
    from .bench import Comparison, Measurement, Noise

    rows = results(folder, STAGES_NOTEBOOK)
    if not len(rows):
        return ""
    rows = rows.reset_index(drop=True)
    base = rows.iloc[0]

    def measurement(r) -> Measurement:
        v = r.get("iters")
        return Measurement(name=str(r["variant"]), device=str(r.get("device", "")), device_name=str(r.get("device_name", "")),
                           torch_version=str(r.get("torch_version", "")), batch_size=int(r["batch_size"]),
                           iters=int(v) if v == v and v is not None else 10**6,  # no column: not held to MIN_TIMED
                           first_ms=float("nan"), median_ms=float(r["median_ms"]), p10_ms=float(r["p10_ms"]),
                           p90_ms=float(r["p90_ms"]), images_per_s=float(r["images_per_s"]), peak_memory_bytes=None,
                           memory_kind="")

    ms = [measurement(r) for _, r in rows.iterrows()]
    spreads = {m.name: (m.p90_ms - m.p10_ms) / m.median_ms for m in ms}
    cmp = Comparison(ms, Noise(cores=1, load_1min=0.0, other_cpu_share=0.0, spreads=spreads, threads=0))

    lines = ["| stage | batch | precision | ms/step (p10-p90) | img/s | img/s vs the first stage | TFLOP/s | MFU | "
             "peak memory (GiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in rows.iterrows():
        fold = cmp.speedup(ms[i])
        ratio = "noisy" if fold is None else f"{fold:.2f}x"  # "noisy": the word 09's own table uses
        mfu = f"{100 * float(r['mfu']):.1f}%" if "mfu" in r and r["mfu"] == r["mfu"] else "n/a"
        mem = f"{float(r['peak_memory_gib']):.2f}" if "peak_memory_gib" in r and r["peak_memory_gib"] == r["peak_memory_gib"] else "n/a"
        lines.append(f"| {r['variant']} | {int(r['batch_size'])} | {r['precision']} | {float(r['median_ms']):.1f} "
                     f"({float(r['p10_ms']):.1f}-{float(r['p90_ms']):.1f}) | {float(r['images_per_s']):,.0f} | {ratio} | "
                     f"{float(r['tflops']):.1f} | {mfu} | {mem} |")
    peaks = sorted({str(p) for p in rows.get("peak", []) if p == p and str(p)})
    kinds = sorted({str(k) for k in rows.get("memory_kind", []) if k == k and str(k)})
    notes = [f"MFU against {', '.join(peaks)}, by the stage's precision." if peaks else "No MFU: no datasheet peak for this device.",
             f"Memory: {'; '.join(kinds)}." if kinds else ""]
    return (f"Notebook 09's stages on {base.get('device_name', '?')} (from `results.csv`; a ratio only where the "
            f"per-image p10-p90 step times of the stage and the first stage lie apart, as in the notebook):\n\n"
            + "\n".join(lines) + "\n\n" + " ".join(n for n in notes if n))


def status_markdown(root: Path | None = None) -> str:
    """Where each committed reference run stands, as the README shows it: one table per run, a row per part
    (status and wall time from parts.json), written by ``python -m ddpm_core.reference status``."""
    runs = [f for f in reference_runs(root) if meta(f).get("mode") == "full"]
    if not runs:
        return NO_REFERENCE
    blocks = []
    for folder in runs:
        m = meta(folder)
        status = json.loads((folder / "parts.json").read_text()) if (folder / "parts.json").exists() else {}
        lines = [f"**{m.get('device_name', folder.name)}**, torch {m.get('torch_version', '?')}, CUDA "
                 f"{m.get('cuda_version', '?')}, started {str(m.get('date', '?'))[:10]}, commit "
                 f"`{str(m.get('git_commit') or '?')[:7]}` (`data/reference/{folder.name}/`):", "",
                 "| part | status | wall time | notebooks | finished (commit) |", "|---|---|---|---|---|"]
        for part in PARTS:
            v = status.get(part)
            if not isinstance(v, dict):
                lines.append(f"| {part} | not run yet | | | |")
                continue
            secs = f"{v['seconds']:.0f} s" if "seconds" in v else ""
            nbs = ", ".join(f"{n.split('_')[0]} {t:.0f} s" for n, t in v.get("notebooks", {}).items())
            when = (f"{v['finished'][:10]} (`{str(v.get('git_commit') or '?')[:7]}`)" if v.get("finished") else "")
            lines.append(f"| {part} | {v.get('status', '?')} | {secs} | {nbs} | {when} |")
        for name, line in headlines(folder).items():
            lines += ["", f"{name.split('_')[0]} printed: *{line}*"]
        if stages := stages_markdown(folder):
            lines += ["", stages]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# ------------------------------------------------------------------------------ traces
def trim_trace(src: Path, dst: Path, steps: int = TRACE_STEPS) -> dict[str, int]:
    """Copy a profiler trace keeping its first ``steps`` ProfilerStep windows.

    Kept: metadata, every host event inside the window, and the GPU kernels, copies and memsets
    launched from it (matched by correlation id: a kernel runs after its launch, often after the
    window), with their flow events. Launches are runtime calls (``cudaLaunchKernel``, category
    ``cuda_runtime``) or driver calls (``cuLaunchKernel``, ``cuda_driver``: how Triton kernels of a
    compiled step are launched). GPU-side ``record_function`` spans (``gpu_user_annotation``) are kept
    where they start inside the window. Returns the event counts before and after.
    """
    with gzip.open(src, "rt") if src.name.endswith(".gz") else open(src) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    marks = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("ph") == "X"),
                   key=lambda e: e["ts"])
    if len(marks) > steps:
        start, end = marks[0]["ts"], marks[steps - 1]["ts"] + marks[steps - 1].get("dur", 0)
        device_cats = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
        launch_cats = {"cuda_runtime", "cuda_driver"}

        def host_kept(e: dict) -> bool:
            return e.get("cat") not in device_cats and "ts" in e and start <= float(e["ts"]) <= end

        kept_corr = {e.get("args", {}).get("correlation") for e in events
                     if e.get("cat") in launch_cats and host_kept(e)} - {None}
        out = []
        for e in events:
            if e.get("ph") == "M" or "ts" not in e:
                out.append(e)
            elif e.get("cat") == "gpu_user_annotation":  # no launch of its own: kept where it starts in the window
                if start <= float(e["ts"]) <= end:
                    out.append(e)
            elif e.get("cat") in device_cats:
                if e.get("args", {}).get("correlation") in kept_corr:
                    out.append(e)
            elif e.get("ph") in ("s", "f"):
                if e.get("id") in kept_corr or host_kept(e):
                    out.append(e)
            elif host_kept(e):
                out.append(e)
        trace["traceEvents"] = out
    dst.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(dst, "wt", compresslevel=9) as f:
        json.dump(trace, f, separators=(",", ":"))
    return {"events_before": len(events), "events_after": len(trace["traceEvents"])}


# ------------------------------------------------------------------------------ the run
def slug(device_name: str) -> str:
    """A folder name for a device: "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3"."""
    s = re.sub(r"^nvidia\s+", "", device_name.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "device"


def default_out(smoke: bool) -> Path:
    import torch

    if not torch.cuda.is_available():
        return reference_dir() / ("cpu-smoke" if smoke else "cpu-full")
    # a smoke run on a GPU (the shakedown) must never land in, or collide with, that GPU's full reference
    return reference_dir() / (slug(torch.cuda.get_device_name(0)) + ("-smoke" if smoke else ""))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _part_meta(out: Path, smoke: bool) -> None:
    import torch

    from .env import device_name, memory_cap_gib

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "device_name": device_name("cuda:0" if cuda else "cpu"),
        "mode": "smoke" if smoke else "full",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if cuda else None,
        "python_version": platform.python_version(),
        # a device machine gets a copy of the working tree whose .git (if any) need not be the commit that
        # travelled (the H100 run of 2026-11-26 found the session's first commit there): the command names it
        "git_commit": os.environ.get("DDPM_GIT_COMMIT") or _git("rev-parse", "HEAD"),
        # unknown where the command names the commit: commit before the call, so that the tree is that commit
        "git_dirty": None if os.environ.get("DDPM_GIT_COMMIT") else bool(_git("status", "--porcelain", "--untracked-files=no")),
        "cpu_cores": os.cpu_count(),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_memory_cap_gib"] = memory_cap_gib()  # DDPM_GPU_MEMORY_GB: a smaller card rehearsed on this one
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["gpu_count"] = torch.cuda.device_count()
        smi = shutil.which("nvidia-smi")
        if smi:
            lines = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30).stdout.split()
            info["driver_version"] = lines[0] if lines else None
    (out / "meta.json").write_text(json.dumps(info, indent=1))


def _part_gpu_tests(out: Path, smoke: bool, part: str = "gpu-tests") -> dict:
    import torch

    marker, log_name = GPU_TEST_PARTS[part]
    cmd = [sys.executable, "-m", "pytest", "-m", marker, "-v", "-rs", "--durations=10", "-p", "no:cacheprovider", "tests"]
    path = out / log_name
    if not torch.cuda.is_available():  # every one of them would be skipped: a pytest run only to say so took 15-18 s
        path.write_text(f"$ pytest -m '{marker}'\nnot run: this machine has no CUDA GPU; all gpu tests are skipped "
                        "without one (the test suite collects them on every run)\n")
        return {"skipped": "no CUDA GPU"}
    with open(path, "w") as f:  # written as it goes: a command stopped at its limit still shows how far it got
        f.write(f"$ {' '.join(cmd[2:4])} '{marker}' {' '.join(cmd[5:])}\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=PART_BUDGET_S)
    log = path.read_text()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", log)}
    if proc.returncode not in (0, 5) or counts.get("failed") or counts.get("error") or counts.get("errors"):
        raise RuntimeError(f"gpu tests failed (exit {proc.returncode}, {counts}); see {path}")
    return counts


def _env(out: Path) -> dict[str, str]:
    work = out / WORK
    (work / "no-reference").mkdir(parents=True, exist_ok=True)
    return {"DDPM_RUNS_DIR": str(work / "runs"), "DDPM_RESULTS_DIR": str(work / "results"),
            # the executed notebooks of a reference run ARE the reference: they show no other, and say so
            "DDPM_REFERENCE_DIR": str(work / "no-reference"), SELF_ENV: "1"}


def _part_notebooks(out: Path, smoke: bool, prefixes: list[str], only: Sequence[str] | None,
                    keep_going: bool = False) -> dict:
    from .series import NotebookFailed, run_notebook, temporary_env

    chosen = _chosen(prefixes, only)
    seconds: dict[str, float] = {}
    errors: list[str] = []
    with temporary_env(_env(out)):
        for nb in chosen:
            print(f"  {nb.name} ...", flush=True)
            # rows of an earlier try of this notebook (failed, killed or --force) must not count twice
            (out / WORK / "results" / f"{nb.stem}.csv").unlink(missing_ok=True)
            try:
                run = run_notebook(nb, out / "notebooks", smoke=smoke, figures=out / "figures", timeout=PART_BUDGET_S)
            except NotebookFailed as e:
                if not keep_going:
                    raise
                print(f"  {nb.name}: FAILED: {e}", flush=True)
                errors.append(str(e))
                continue
            seconds[nb.stem] = round(run.seconds, 1)
            print(f"  {nb.name}: {run.seconds:.0f} s", flush=True)
    if errors:  # keep_going: the part's other notebooks ran; the part still fails
        raise NotebookFailed(" | ".join(errors))
    return {"notebooks": seconds}


def collect(out: Path, notebooks: Sequence[str] | None = None) -> dict:
    """Make the folder whole from its scratch: result rows into results.csv, traces trimmed into traces/.

    The rows of ``notebooks`` (stems such as "03_batch_size"; default: every notebook with rows in
    the scratch) replace that notebook's rows in results.csv, whatever an earlier command or session
    left there; the other notebooks' rows stay. A trace is trimmed again only when its source is
    newer than the trimmed copy. Idempotent: safe after every part.
    """
    import pandas as pd

    work = out / WORK
    csvs = sorted((work / "results").glob("*.csv")) if (work / "results").is_dir() else []
    frames = [pd.read_csv(p, keep_default_na=False, na_values=[""]) for p in csvs]
    frames = [f for f in frames if len(f)]
    replaced = set(notebooks) if notebooks is not None else set()
    for f in frames:
        if "notebook" in f:
            replaced |= set(f["notebook"].astype(str))
    old_path = out / "results.csv"
    if old_path.exists() and old_path.stat().st_size:
        old = pd.read_csv(old_path, keep_default_na=False, na_values=[""])
        if "notebook" in old:
            old = old[~old["notebook"].astype(str).isin(replaced)]
        frames = [old, *frames] if len(old) else frames
    rows = 0
    if frames:
        merged = pd.concat(frames, ignore_index=True)
        rows = len(merged)
        merged.to_csv(old_path, index=False)
    trimmed = 0
    runs = work / "runs"
    for f in sorted(runs.rglob("*.json.gz")) if runs.exists() else []:
        rel = f.parent.relative_to(runs)
        rel = rel.relative_to("traces") if rel.parts[:1] == ("traces",) else rel
        dst = out / "traces" / rel / f.name
        if not dst.exists() or dst.stat().st_mtime < f.stat().st_mtime:
            trim_trace(f, dst)
            trimmed += 1
    return {"results_rows": rows, "traces_trimmed": trimmed}


def _part_pack(out: Path, smoke: bool) -> dict:
    detail = collect(out)
    archive = pack(out)
    return {**detail, "traces": len(list((out / "traces").rglob("*.json.gz"))), "archive": str(archive),
            "archive_mb": round(archive.stat().st_size / 2**20, 2)}


def pack(out: Path) -> Path:
    """``<out>.tar.gz`` of the folder without its scratch; fails naming the biggest files past 15 MB."""
    out = Path(out)
    archive = out.parent / f"{out.name}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=lambda ti: None if WORK in Path(ti.name).parts else ti)
    size = archive.stat().st_size
    if size > ARCHIVE_LIMIT_BYTES:
        files = sorted((p for p in out.rglob("*") if p.is_file() and WORK not in p.parts),
                       key=lambda p: p.stat().st_size, reverse=True)[:5]
        biggest = ", ".join(f"{p.relative_to(out)} ({p.stat().st_size / 2**20:.1f} MB)" for p in files)
        raise RuntimeError(f"{archive} is {size / 2**20:.1f} MB, over the {ARCHIVE_LIMIT_BYTES / 2**20:.0f} MB a "
                           f"reference may take. Biggest files: {biggest}. Fix: capture fewer steps or trim harder.")
    return archive


def unpack(archive: Path, root: Path | None = None, figures: Path | None = None) -> Path:
    """Extract a reference archive into ``root`` (data/reference) and copy its figures into figures/."""
    root = Path(root) if root is not None else reference_dir()
    figures = Path(figures) if figures is not None else figures_dir()
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        top = {n.split("/", 1)[0] for n in names}
        if len(top) != 1 or any(n.startswith("/") or ".." in Path(n).parts for n in names):
            raise ValueError(f"{archive} is not a reference archive (one top folder, relative paths). "
                             f"Fix: make it with `python -m ddpm_core.reference pack`.")
        folder = root / top.pop()
        if folder.exists():
            shutil.rmtree(folder)
        root.mkdir(parents=True, exist_ok=True)
        tar.extractall(root, filter="data") if sys.version_info >= (3, 12) else tar.extractall(root)
    if not (folder / "meta.json").exists():
        raise ValueError(f"{archive} holds no meta.json: not a reference run")
    figures.mkdir(parents=True, exist_ok=True)
    for png in sorted((folder / "figures").glob("*.png")):
        shutil.copy2(png, figures / png.name)
    return folder


def run(out: Path | None = None, *, smoke: bool | None = None, parts: Sequence[str] | None = None,
        force: bool = False, notebooks: Sequence[str] | None = None, keep_going: bool = False,
        archive_to: Path | None = None) -> Path:
    """Run the reference ``parts`` (default: all) into ``out``; skip parts already done unless ``force``.

    A part that raises is recorded as failed in parts.json; the run stops there unless
    ``keep_going``, which runs the rest and raises at the end naming every failed part. A part
    killed from outside stays "running" in parts.json, and the next run does it again.
    ``archive_to``: after every part, pack the folder into that folder (``<name>.tar.gz``).
    """
    import torch

    smoke = (not torch.cuda.is_available()) if smoke is None else smoke
    unknown = [p for p in (parts or []) if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; the parts are {PARTS}")
    # absolute: the notebooks run in notebooks/, where a relative --out would name another folder
    out = Path(out).resolve() if out is not None else default_out(smoke)
    out.mkdir(parents=True, exist_ok=True)
    status_path = out / "parts.json"
    status = json.loads(status_path.read_text()) if status_path.exists() else {}
    if status.get("_mode") not in (None, "smoke" if smoke else "full"):
        raise ValueError(f"{out} holds a {status['_mode']} run; this one is {'smoke' if smoke else 'full'}. "
                         f"Fix: another --out, or delete {out}.")
    status["_mode"] = "smoke" if smoke else "full"

    def notebook_part(pre: list[str]) -> dict:
        detail = _part_notebooks(out, smoke, pre, notebooks, keep_going) or {}
        stems = [nb.stem for nb in _chosen(pre, notebooks)]
        return {**detail, **collect(out, stems)}

    actions: dict[str, Callable[[], Any]] = {
        "meta": lambda: _part_meta(out, smoke),
        **{name: (lambda name=name: _part_gpu_tests(out, smoke, name)) for name in GPU_TEST_PARTS},
        **{name: (lambda pre=pre: notebook_part(pre)) for name, pre in NOTEBOOK_PARTS.items()},
        "pack": lambda: _part_pack(out, smoke),
    }
    print(f"reference run -> {out} ({'smoke' if smoke else 'full'} mode)", flush=True)
    total = 0.0
    failed: list[str] = []
    for part in parts or PARTS:
        if status.get(part, {}).get("status") == "done" and not force:
            print(f"[{part}] already done ({status[part]['seconds']:.0f} s): skipped", flush=True)
            continue
        print(f"[{part}] ...", flush=True)
        status[part] = {"status": "running", "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        status_path.write_text(json.dumps(status, indent=1))  # a command killed here leaves "running": redone next time
        start = time.perf_counter()
        try:
            detail = actions[part]() or {}
        except KeyboardInterrupt:  # the deadline's SIGINT (scripts/gpu_call.sh) or Ctrl+C: keep what it shows
            status[part] = {"status": "interrupted", "seconds": round(time.perf_counter() - start, 1)}
            status_path.write_text(json.dumps(status, indent=1))
            print(f"[{part}] INTERRUPTED after {status[part]['seconds']:.0f} s: packing what it wrote", flush=True)
            _archive_to(out, archive_to)  # the executed notebook so far (papermill saves it as cells end)
            raise
        except Exception as e:
            seconds = time.perf_counter() - start
            total += seconds
            status[part] = {"status": "failed", "seconds": round(seconds, 1), "error": f"{type(e).__name__}: {e}"}
            status_path.write_text(json.dumps(status, indent=1))
            _archive_to(out, archive_to)
            if not keep_going:
                raise RuntimeError(f"reference part {part!r} failed: {type(e).__name__}: {e} "
                                   f"(status in {status_path})") from e
            print(f"[{part}] FAILED after {seconds:.0f} s: {type(e).__name__}: {e}", flush=True)
            failed.append(part)
            continue
        seconds = time.perf_counter() - start
        total += seconds
        # a reference made across sessions: each part says when and from which commit (meta.json has the first part's)
        status[part] = {"status": "done", "seconds": round(seconds, 1), "finished": _now(),
                        "git_commit": os.environ.get("DDPM_GIT_COMMIT") or _git("rev-parse", "HEAD"), **detail}
        status_path.write_text(json.dumps(status, indent=1))
        _archive_to(out, archive_to)
        over = " OVER BUDGET" if seconds > PART_BUDGET_S else ""
        print(f"[{part}] done in {seconds:.0f} s (budget {PART_BUDGET_S} s per part){over}", flush=True)
    done = [p for p in PARTS if isinstance(status.get(p), dict) and status[p].get("status") == "done"]
    print(f"this command: {total:.0f} s; parts done in {out.name}: {len(done)} of {len(PARTS)} "
          f"(`python -m ddpm_core.reference status` for the table)", flush=True)
    if failed:
        raise RuntimeError(f"reference parts failed: {', '.join(failed)} (errors in {status_path})")
    return out


def _chosen(prefixes: list[str], only: Sequence[str] | None) -> list[Path]:
    from .series import select

    return [nb for nb in select(prefixes) if not only or nb in select(list(only))]


def _archive_to(out: Path, folder: Path | None) -> None:
    """Pack ``out`` into ``folder`` (if given) after a part; a pack that fails is reported, never raised."""
    if folder is None:
        return
    try:
        archive = pack(out)
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if archive.parent.resolve() != folder.resolve():
            shutil.copy2(archive, folder / archive.name)
        print(f"  packed -> {folder / archive.name} ({archive.stat().st_size / 2**20:.1f} MB)", flush=True)
    except (OSError, RuntimeError) as e:
        print(f"  could not pack {out} into {folder}: {e}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpm_core.reference", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the reference parts (resumable)")
    mode = r.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", default=None, help="smoke mode (default without a GPU)")
    mode.add_argument("--full", action="store_true", help="full mode (default with a GPU)")
    r.add_argument("--out", default=None, help="the reference folder (default: data/reference/<gpu>)")
    r.add_argument("--parts", nargs="+", default=None, choices=PARTS, help=f"parts to run (default: all: {PARTS})")
    r.add_argument("--notebooks", nargs="+", default=None, help="only these notebooks: numbers (03 03b) or name prefixes (03_batch)")
    r.add_argument("--force", action="store_true", help="redo parts already done")
    r.add_argument("--keep-going", action="store_true", help="after a part fails, run the others (exit 1 at the end)")
    r.add_argument("--archive-to", default=None, metavar="DIR",
                   help="after every part, pack the folder into DIR/<name>.tar.gz (e.g. $OUT on a device machine)")
    sub.add_parser("status", help="print where each committed full reference run stands (the README's table)")
    k = sub.add_parser("pack", help="pack a reference folder into <folder>.tar.gz")
    k.add_argument("folder")
    u = sub.add_parser("unpack", help="extract a reference archive into data/reference and figures/")
    u.add_argument("archive")
    args = p.parse_args(argv)
    try:
        if args.cmd == "run":
            smoke = True if args.smoke else (False if args.full else None)
            run(args.out, smoke=smoke, parts=args.parts, force=args.force, notebooks=args.notebooks,
                keep_going=args.keep_going, archive_to=Path(args.archive_to) if args.archive_to else None)
        elif args.cmd == "status":
            print(status_markdown())
        elif args.cmd == "pack":
            print(pack(Path(args.folder)))
        else:
            print(f"unpacked into {unpack(Path(args.archive))}")
    except (RuntimeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
