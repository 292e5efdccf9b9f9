"""Profiler traces that HTA can read, and the profiler's operator table as a DataFrame.

``capture`` runs a function under ``torch.profiler`` with a wait/warmup/active schedule (so the
trace carries the ``ProfilerStep#N`` markers HTA needs) and writes one gzipped Chrome trace per
rank into one folder per run. HTA takes the rank from the trace's ``distributedInfo``, which
torch writes only when torch.distributed is initialized; for a single process we add it, so
two runs never collide as "rank-less" traces.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from .atomic import atomic_write_bytes

TRACE_SUFFIX = ".pt.trace.json.gz"


@dataclass
class Capture:
    """The result of ``capture``: where the trace went, and the profiler for ``op_table``."""

    trace_path: Path
    trace_dir: Path
    profiler: profile
    device: torch.device
    steps: int

    def op_table(self, **kw: Any) -> pd.DataFrame:
        return op_table(self.profiler, **kw)


def _rank_world() -> tuple[int, int, str]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist.get_backend()
    return 0, 1, "none"


def _guess_device(args: tuple) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def capture(
    fn: Callable[..., Any],
    *args: Any,
    out_dir: str | os.PathLike,
    wait: int = 1,
    warmup: int = 1,
    active: int = 3,
    record_shapes: bool = False,
    profile_memory: bool = False,
    with_stack: bool = False,
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> Capture:
    """Profile ``wait + warmup + active`` calls of ``fn(*args, **kwargs)``; write the active steps.

    The trace goes to ``<out_dir>/rank<R>.pt.trace.json.gz`` (R = this process's rank), with
    ``distributedInfo`` set, so ``ddpm_core.traces.analyze(out_dir)`` reads it. Use one
    ``out_dir`` per run. Returns a ``Capture`` (``.trace_path``, ``.op_table()``).
    """
    if active < 1 or wait < 0 or warmup < 0:
        raise ValueError(f"need active >= 1 and wait, warmup >= 0; got wait={wait}, warmup={warmup}, active={active}")
    device = torch.device(device) if device is not None else _guess_device(args)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    rank, world, backend = _rank_world()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"rank{rank}{TRACE_SUFFIX}"

    def on_ready(prof: profile) -> None:
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            trace = json.loads(raw.read_text())
        info = trace.setdefault("distributedInfo", {})
        info.setdefault("rank", rank)
        info.setdefault("world_size", world)
        info.setdefault("backend", backend)
        trace.setdefault("ddpm_core", {})["device"] = str(device)
        atomic_write_bytes(final, gzip.compress(json.dumps(trace).encode(), compresslevel=6))

    with native_stderr_filtered(), quiet_profiler_warnings(), profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=on_ready,
        record_shapes=record_shapes,
        profile_memory=profile_memory,
        with_stack=with_stack,
    ) as prof:
        for _ in range(wait + warmup + active):
            fn(*args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            prof.step()
    return Capture(trace_path=final, trace_dir=out_dir, profiler=prof, device=device, steps=active)


@contextlib.contextmanager
def quiet_profiler_warnings():
    """Ignore torch's "Profiler clears events at the end of each cycle" warning (torch 2.11 prints it in every
    notebook that profiles, in red). Our schedules have one cycle (``repeat=1``), so "the events of the current
    cycle" are all of them: the warning says nothing about these captures. Other warnings still show."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*Profiler clears events at the end of each cycle")
        yield


# Lines the profiler's C++ side (Kineto) writes straight to file descriptor 2 that carry no news:
# start/stop markers, and, on a CUDA build of torch without a GPU, the failed GPU count. In
# JupyterLab they land in a red stderr box that reads like an error.
_HARMLESS_NATIVE = re.compile(r"USDT:.*profiler_(start|stop)|gpuGetDeviceCount failed with code 35|"
                              r"cudaGetDeviceCount.*(35|no CUDA-capable device)|"
                              # profile_memory=True: blocks allocated before the capture have no allocation event
                              r"Memory block of unknown size was allocated before the profiling started")


@contextlib.contextmanager
def native_stderr_filtered() -> Iterator[None]:
    """Hold back what C++ code writes to file descriptor 2 while the block runs, then pass on every
    line except the profiler's harmless ones (``_HARMLESS_NATIVE``). Python-level ``sys.stderr``
    (tqdm, warnings) is untouched. Where fd 2 cannot be redirected, the block runs as it is."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines() if ln and not _HARMLESS_NATIVE.search(ln)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")
                sys.stderr.flush()


# Labels that mark spans of a step, not operators: the profiler's step markers and the phases
# Trainer.train_step labels with record_function (forward, backward, optimizer, ema).
PHASE_PREFIX = "train_step/"
ANNOTATION = re.compile(r"^(ProfilerStep[#*]|" + re.escape(PHASE_PREFIX) + ")")  # key_averages names them "ProfilerStep*"


def step_phases(table: pd.DataFrame) -> pd.DataFrame:
    """The train_step phases of an op table (``op_table(..., annotations=True)``): the host's time per
    phase, per profiled step, and each phase's share of the labelled time.

    Host time only. On a GPU the profiler also records each span on the device (a second row of the same name), but
    that row misses the backward pass: autograd launches its kernels from a thread of its own, outside the span's
    thread. Which kernels each phase launched, and when they ran, is read from the trace file (notebook 02, Exercise 1).
    """
    rows = table[table["name"].astype(str).str.startswith(PHASE_PREFIX)]
    if "device_type" in rows:
        rows = rows[rows["device_type"] == "CPU"]
    if rows.empty:
        raise ValueError("no train_step/ phases in this table: capture Trainer.train_step, and pass annotations=True to op_table")
    rows = rows.groupby("name", as_index=False, sort=False)[["calls", "cpu_total_us"]].sum()
    out = pd.DataFrame({"phase": rows["name"].str.slice(len(PHASE_PREFIX)), "calls": rows["calls"],
                        "cpu_ms_per_step": rows["cpu_total_us"] / rows["calls"] / 1e3})
    out["share"] = out["cpu_ms_per_step"] / out["cpu_ms_per_step"].sum()
    order = {p: i for i, p in enumerate(("forward", "backward", "optimizer", "ema"))}
    return out.sort_values("phase", key=lambda s: s.map(order)).reset_index(drop=True)


_OP_COLUMNS = {
    "name": "key",
    "self_cpu_us": "self_cpu_time_total",
    "cpu_total_us": "cpu_time_total",
    "self_device_us": "self_device_time_total",
    "device_total_us": "device_time_total",
    "self_cpu_mem_bytes": "self_cpu_memory_usage",
    "cpu_mem_bytes": "cpu_memory_usage",
    "self_device_mem_bytes": "self_device_memory_usage",
    "device_mem_bytes": "device_memory_usage",
    "calls": "count",
}


def _device_type(e: Any) -> str:
    d = getattr(e, "device_type", None)
    return getattr(d, "name", None) or str(d or "CPU").rsplit(".", 1)[-1]


def op_table(prof: profile, sort_by: str | None = None, top: int | None = None, group_by_input_shape: bool = False,
             annotations: bool = False, kernels: bool = False) -> pd.DataFrame:
    """The profiler's ``key_averages()`` as a DataFrame (times in microseconds, memory in bytes).

    Columns: name, self/total CPU time, self/total device time, CPU/device memory (self and
    total), calls, each row's share of the total self time, and ``device_type`` (where the row's
    events ran). Sorted by self device time when the trace has device activity, else by self CPU
    time. Step markers (``ProfilerStep#N``) and the train_step phase labels are spans, not
    operators: they are left out unless ``annotations=True`` (``step_phases`` reads the phases).

    On a GPU, ``key_averages()`` has a row per operator (run on the host; its self device time is the
    kernels it launched) *and* a row per kernel (run on the device): the same device time twice. The
    table keeps the operators, or with ``kernels=True`` the kernels instead; the device shares are
    of the device's total either way.
    """
    events = prof.key_averages(group_by_input_shape=group_by_input_shape)
    if not annotations:
        events = [e for e in events if not ANNOTATION.match(str(e.key))]
    rows = [{col: getattr(e, attr, 0) for col, attr in _OP_COLUMNS.items()} for e in events]
    for r, e in zip(rows, events):
        r["device_type"] = _device_type(e)
        r["annotation"] = bool(getattr(e, "is_user_annotation", False))
        if group_by_input_shape:
            r["input_shapes"] = str(e.input_shapes)
    df = pd.DataFrame(rows, columns=list(_OP_COLUMNS) + ["device_type", "annotation"]
                      + (["input_shapes"] if group_by_input_shape else []))
    on_device = (df["device_type"] != "CPU") & ~df["annotation"]
    # the device's total: its own rows where the profiler wrote them (kineto), else the operators' (legacy)
    device_total = df.loc[on_device, "self_device_us"].sum() if on_device.any() else df["self_device_us"].sum()
    cpu_total = df.loc[~on_device, "self_cpu_us"].sum()  # host rows (record_function spans inside torch included)
    # operators: the host's rows (the device's record_function spans, device_type CUDA, would count their kernels again)
    df = df[on_device if kernels else df["device_type"] == "CPU"].drop(columns="annotation").reset_index(drop=True)
    for kind, total in (("cpu", cpu_total), ("device", device_total)):
        df[f"self_{kind}_pct"] = 100.0 * df[f"self_{kind}_us"] / total if total > 0 else 0.0
    if sort_by is None:
        sort_by = "self_device_us" if df["self_device_us"].sum() > 0 else "self_cpu_us"
    if sort_by not in df.columns:
        raise ValueError(f"sort_by must be one of {list(df.columns)}, got {sort_by!r}")
    df = df.sort_values(sort_by, ascending=False, ignore_index=True)
    return df.head(top) if top else df
