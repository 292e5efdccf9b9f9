"""Read profiler traces with Holistic Trace Analysis (HTA) and return its answers as DataFrames.

``analyze(trace_dir)`` runs HTA's analyses on every rank in the folder. HTA's GPU analyses
need GPU kernels in the trace: on a CPU run they are skipped with a plain notice, and the
result carries a breakdown of CPU operators instead, so a notebook has something true to show
on any machine. HTA draws plotly charts; we ask it for DataFrames only and plot them with
``ddpm_core.plots``.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from .series import temporary_env

GPU_ONLY_NOTICE = (
    "This trace has no GPU kernels (a CPU run), so HTA's GPU analyses - temporal breakdown, "
    "kernel breakdown, idle time, kernel launch stats, comm/comp overlap, memory bandwidth - "
    "do not apply: they need a trace captured on a GPU. `cpu_ops` holds the CPU operator breakdown, "
    "`cpu_temporal` the CPU counterpart of the temporal breakdown, and `op_categories(cpu_ops)` "
    "the counterpart of the kernel-type breakdown."
)


class TraceError(ValueError):
    """A trace folder or file that cannot be analyzed; the message names the path."""


@dataclass
class TraceReport:
    """HTA's analyses of one run (one folder, one trace per rank)."""

    trace_dir: Path
    trace_files: dict[int, Path]
    has_gpu: bool
    cpu_ops: pd.DataFrame  # rank, name, calls, self_us, total_us, self_pct: always present
    cpu_temporal: pd.DataFrame | None = None  # main thread: compute ops / other ops / outside ops, per rank
    temporal: pd.DataFrame | None = None  # per rank: idle / compute / non-compute time and shares
    kernels: pd.DataFrame | None = None  # kernel type (COMPUTATION / COMMUNICATION / MEMORY) shares
    top_kernels: pd.DataFrame | None = None  # the TOP_KERNELS most time-consuming kernels per rank
    kernel_kinds: pd.DataFrame | None = None  # GPU kernel time by what the kernels do (see kernel_kinds)
    idle: pd.DataFrame | None = None  # host wait / kernel wait / other wait per rank and stream
    launch: pd.DataFrame | None = None  # per kernel launch: CPU duration, GPU duration, launch delay
    launch_summary: pd.DataFrame | None = None  # per rank: launch cost vs kernel time vs queueing (see launch_summary)
    overlap: pd.DataFrame | None = None  # comm/comp overlap per rank (multi-rank runs)
    memory_bw: pd.DataFrame | None = None  # memcpy / memset bandwidth summary
    graph_kernels: dict[int, int] = field(default_factory=dict)  # per rank: kernels launched by cudaGraphLaunch
    notes: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.trace_files)

    def table(self, name: str) -> pd.DataFrame | None:
        """The analysis ``name`` ("temporal", "idle", "kernels", "launch_summary", ...), or None after
        printing why it is missing (HTA failed on it, or it needs a GPU or several ranks)."""
        df = getattr(self, name)
        if df is None:
            why = [n for n in self.notes if _NOTE_KEYS.get(name, name) in n] or self.notes or ["not computed"]
            print(f"{name} is not available for this trace: {why[0]}")
        return df

    def __str__(self) -> str:
        lines = [f"trace {self.trace_dir} - ranks {self.ranks}, {'GPU' if self.has_gpu else 'CPU only'}"]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def per_rank(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """A per-rank table (one row per rank, HTA's long column names: the temporal breakdown, its CPU counterpart,
    comm/comp overlap) turned to one column per rank, so that it fits a notebook's width with HTA's names kept."""
    if df is None or "rank" not in df or df["rank"].duplicated().any():
        return df
    out = df.set_index("rank").T
    out.columns = [f"rank {r}" for r in out.columns]
    out.index.name = None
    return out


def host_wait_share(idle: pd.DataFrame | None, rank: int = 0) -> tuple[float, int] | None:
    """Of the GPU idle time on the stream that runs the step's kernels, the share that was host wait (the GPU idle
    because the CPU had not enqueued the next kernel yet), from HTA's idle-time breakdown; with that stream's id.

    HTA classifies idle time per stream. A step's kernels run on one stream, and side streams (copies, the
    profiler's, NCCL's) sit idle nearly all the step with almost nothing classified but "other": averaging the
    streams' host-wait ratios, or summing their idle times, dilutes the one stream that matters. That stream is the
    one with the most idle time classified as host or kernel wait: the gaps between its own back-to-back kernels.
    None without the table or its columns.
    """
    need = {"rank", "stream", "idle_category", "idle_time"}
    if idle is None or not need <= set(idle.columns) or not (idle["rank"] == rank).any():
        return None
    mine = idle[idle["rank"] == rank]
    between = mine[mine["idle_category"].isin(["host_wait", "kernel_wait"])].groupby("stream")["idle_time"].sum()
    if between.empty or between.max() <= 0:
        return None
    stream = int(between.idxmax())
    on = mine[mine["stream"] == stream]
    total = float(on["idle_time"].sum())
    host = float(on.loc[on["idle_category"] == "host_wait", "idle_time"].sum())
    return (host / total if total > 0 else 0.0), stream


# The CPU counterparts keep HTA's column names so that the same charts draw both; shown in a table, those names
# would call operator time "kernel time" and time outside operators "idle". These are what they mean on a CPU.
CPU_NAMES = {"idle_time(us)": "outside operators (us)", "compute_time(us)": "compute operators (us)",
             "non_compute_time(us)": "other operators (us)", "kernel_time(us)": "profiled steps (us)",
             "idle_time_pctg": "outside operators %", "compute_time_pctg": "compute operators %",
             "non_compute_time_pctg": "other operators %", "kernel_type": "operator kind",
             "sum": "self time (us)", "percentage": "% of operator self time"}


def cpu_names(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """``df`` (a CPU temporal breakdown or ``op_categories`` table, wide or ``per_rank``) with its HTA names
    replaced by what they measure on a CPU: for display only (the charts take HTA's names)."""
    if df is None:
        return None
    return df.rename(columns=CPU_NAMES, index=CPU_NAMES)


TOP_KERNELS = 10
_NOTE_KEYS = {"temporal": "temporal", "kernels": "kernel breakdown", "top_kernels": "kernel breakdown",
              "kernel_kinds": "kernel breakdown",
              "idle": "idle time", "launch": "launch", "launch_summary": "launch", "overlap": "overlap",
              "memory_bw": "memory bandwidth"}


def _trace_files(trace_dir: Path) -> list[Path]:
    return sorted(p for p in trace_dir.iterdir() if p.is_file() and (p.name.endswith(".json") or p.name.endswith(".json.gz")))


def _load_json(path: Path) -> dict:
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt") as f:
            trace = json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"cannot read trace file {path}: {e}. Fix: delete it and capture the trace again.") from e
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise TraceError(f"{path} is not a PyTorch profiler trace (no 'traceEvents'). Fix: keep only profiler traces in the folder.")
    return trace


def _rank_map(trace_dir: Path) -> tuple[dict[int, Path], dict[int, dict]]:
    """rank -> trace file, from each trace's distributedInfo (files without it get the next free rank)."""
    if not trace_dir.is_dir():
        raise TraceError(f"trace folder {trace_dir} does not exist. Fix: pass the out_dir given to ddpm_core.profiling.capture.")
    files = _trace_files(trace_dir)
    if not files:
        raise TraceError(
            f"no trace files (*.json or *.json.gz) in {trace_dir}. Fix: capture one with "
            f"ddpm_core.profiling.capture(fn, ..., out_dir={str(trace_dir)!r})."
        )
    by_rank: dict[int, Path] = {}
    traces: dict[int, dict] = {}
    unranked = []
    for path in files:
        trace = _load_json(path)
        rank = trace.get("distributedInfo", {}).get("rank")
        if rank is None:
            unranked.append((path, trace))
            continue
        if rank in by_rank:
            raise TraceError(
                f"two traces in {trace_dir} claim rank {rank}: {by_rank[rank].name} and {path.name}. "
                f"Fix: keep one run per folder."
            )
        by_rank[int(rank)], traces[int(rank)] = path, trace
    for path, trace in unranked:
        rank = max(by_rank, default=-1) + 1
        by_rank[rank], traces[rank] = path, trace
    return by_rank, traces


def _cpu_op_breakdown(traces: dict[int, dict]) -> pd.DataFrame:
    """Self and inclusive time of every CPU operator, per rank (self = minus nested operators)."""
    rows = []
    for rank, trace in traces.items():
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
                  and not str(e.get("name", "")).startswith(("ProfilerStep", "train_step/"))]  # spans, not operators
        by_thread: dict[tuple, list] = {}
        for e in events:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        for evs in by_thread.values():
            evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
            stack: list[list] = []  # [end, event, child time]
            for e in evs:
                start, dur = e["ts"], e.get("dur", 0)
                while stack and stack[-1][0] <= start:
                    end, ev, child = stack.pop()
                    rows.append((rank, ev["name"], ev.get("dur", 0), ev.get("dur", 0) - child))
                if stack:
                    stack[-1][2] += dur
                stack.append([start + dur, e, 0.0])
            while stack:
                end, ev, child = stack.pop()
                rows.append((rank, ev["name"], ev.get("dur", 0), ev.get("dur", 0) - child))
    df = pd.DataFrame(rows, columns=["rank", "name", "total_us", "self_us"])
    if df.empty:
        return pd.DataFrame(columns=["rank", "name", "calls", "self_us", "total_us", "self_pct"])
    out = df.groupby(["rank", "name"], as_index=False).agg(
        calls=("self_us", "size"), self_us=("self_us", "sum"), total_us=("total_us", "sum"))
    out["self_pct"] = 100 * out["self_us"] / out.groupby("rank")["self_us"].transform("sum")
    return out.sort_values(["rank", "self_us"], ascending=[True, False], ignore_index=True)


# How CPU operators map onto the kernel types HTA uses for GPU kernels. Names are matched on
# whole words of the operator name (aten::convolution_backward -> convolution, backward;
# ConvolutionBackward0 -> convolution, backward), never on substrings: "to" must not match
# "autograd", "mm" must not match "comms", "conv" must not match "convex".
_COMPUTE_WORDS = {"conv", "convolution", "conv2d", "cudnn", "mkldnn", "mm", "bmm", "addmm", "addbmm", "baddbmm",
                  "matmul", "linear", "scaled", "attention", "sdpa", "flash", "efficient"}
_CATEGORIES = [
    ("optimizer", {"optimizer", "foreach", "adam", "adamw", "sgd", "addcdiv", "addcmul", "lerp"}),
    ("convolution", {"conv", "convolution", "cudnn", "mkldnn"}),
    ("matmul / attention", {"mm", "bmm", "addmm", "addbmm", "baddbmm", "matmul", "linear", "scaled", "attention",
                            "sdpa", "flash", "efficient"}),
    ("normalization", {"norm"}),  # group_norm, layer_norm, batch_norm, NativeGroupNormBackward0
    ("copy / fill / memory", {"copy", "to", "fill", "zero", "zeros", "empty", "contiguous", "clone", "cat", "stack",
                              "view", "reshape", "permute", "transpose", "expand", "slice", "select", "index",
                              "memcpy", "memset"}),
]


def _words(name: str) -> list[str]:
    """The lower-case words of an operator name: namespace, snake_case and CamelCase split apart."""
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name.split("::")[-1])
    return [w for w in re.split(r"[^a-zA-Z0-9]+|(?<=[a-zA-Z])(?=[0-9])|(?<=[0-9])(?=[a-zA-Z])", name.lower()) if w]


def _category(name: str) -> str:
    words = set(_words(name))
    if "backward" in words and words & {"conv", "convolution"}:
        return "convolution"
    for cat, keys in _CATEGORIES:
        if words & keys:
            return cat
    return "elementwise / other"


def _is_compute(name: str) -> bool:
    return bool(set(_words(name)) & _COMPUTE_WORDS)


# What a GPU kernel does, from its name; the first pattern that matches wins (a cuDNN attention kernel is attention,
# a Triton kernel fused around a convolution is Triton's, a copy inside an elementwise template is a copy).
KERNEL_KINDS = [
    ("attention", r"sdpa|flash|fmha|attention|mem_eff|softmax"),
    ("fused elementwise / norm (Triton)", r"^triton_"),
    ("optimizer", r"multi_tensor_apply|fused_adam|adam"),
    ("copies and layout changes", r"direct_copy|copy_kernel|CatArray|nchwToNhwc|nhwcToNchw|^Memcpy DtoD"),
    ("convolution (cuDNN)", r"fprop|dgrad|wgrad|implicit_gemm|implicit_convolve|cudnn|conv|fft|cf32"),  # cf32: FFT
    ("matmul (cuBLAS)", r"gemm|nvjet|cutlass|cublas|splitKreduce"),
    ("normalization (eager)", r"norm|welford|RowwiseMoments|FusedParams|InternalGradients|GammaBeta"),
    ("elementwise / reduce (eager)", r"elementwise|reduce|vectorized|unrolled|dropout|upsample"),
    ("memset / memcpy", r"^Memset|^Memcpy"),
]


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel (``KERNEL_KINDS``), or "other"."""
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def kernel_kinds(per_kernel: pd.DataFrame, conv_share: dict[str, float] | None = None) -> pd.DataFrame:
    """GPU kernel time grouped by what the kernels do: convolutions, attention, Triton's fused kernels, copies and
    layout changes, the optimizer, ... from HTA's per-kernel sums (``get_gpu_kernel_breakdown`` with every kernel
    kept), all ranks together. HTA's own kernel types split only computation, communication and memory (a layout
    copy counts as computation there). Same columns as ``op_categories`` (kernel_type, sum, percentage), so the same
    chart draws both.

    A kernel's name does not always say what launched it: cuDNN runs many convolutions, backward ones above all, as
    GEMM kernels (``sm80_xmma_gemm_f32f32_...``), named like cuBLAS's. ``conv_share`` (``launched_by_convolution``:
    per kernel name, the share of its time that a convolution operator launched) moves that share of a GEMM-named
    kernel's time to the convolutions; in the H200's fp32 eager step, three quarters of the GEMM-named time."""
    df = per_kernel[per_kernel["name"] != "others"].assign(kernel_type=lambda d: d["name"].map(kernel_kind))
    if conv_share:
        share = df["name"].map(conv_share).fillna(0.0).where(df["kernel_type"] == "matmul (cuBLAS)", 0.0)
        moved = df[share > 0].assign(**{"sum (us)": lambda d: d["sum (us)"] * share[share > 0],
                                        "kernel_type": "convolution (cuDNN)"})
        df = pd.concat([df.assign(**{"sum (us)": df["sum (us)"] * (1 - share)}), moved], ignore_index=True)
    out = (df.groupby("kernel_type", as_index=False)["sum (us)"].sum()
           .rename(columns={"sum (us)": "sum"}))
    out["percentage"] = (100 * out["sum"] / out["sum"].sum()).round(1)
    return out.sort_values("sum", ascending=False, ignore_index=True)


def op_categories(cpu_ops: pd.DataFrame) -> pd.DataFrame:
    """CPU operator self time grouped into kinds (convolution, matmul, normalization, ...).

    The CPU counterpart of HTA's kernel-type breakdown, with the same columns (kernel_type,
    sum, percentage), so the same chart draws both.
    """
    df = cpu_ops.assign(kernel_type=cpu_ops["name"].map(_category))
    out = df.groupby("kernel_type", as_index=False)["self_us"].sum().rename(columns={"self_us": "sum"})
    out["percentage"] = (100 * out["sum"] / out["sum"].sum()).round(1)
    return out.sort_values("sum", ascending=False, ignore_index=True)


def step_spans(events: list[dict]) -> list[dict]:
    """The host's ``ProfilerStep#N`` spans: one per profiled step. On a GPU trace Kineto writes each of them a second
    time on the GPU's row (category ``gpu_user_annotation``), which a step count must not count again."""
    return [e for e in events if e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation"
            and str(e.get("name", "")).startswith("ProfilerStep#")]


def phase_ms(trace_dir: str | Path, step: int = 0) -> dict[str, float]:
    """The host's time in each ``Trainer.train_step`` phase (``forward``, ``backward``, ``optimizer``, ``ema``: the
    ``train_step/`` spans it labels) in profiled step ``step`` of rank 0's trace, in ms: the step ``diff`` compares
    (the first). A phase that runs the same eager code in two traces (the update after backward, which
    ``torch.compile`` leaves eager) is a yardstick for how much the machine itself moved between them."""
    files, raw = _rank_map(Path(trace_dir).resolve())
    evs = [e for e in raw[min(raw)]["traceEvents"] if e.get("ph") == "X"]
    steps = sorted(step_spans(evs), key=lambda e: e["ts"])
    if not steps:
        raise TraceError(f"no ProfilerStep# spans in {files[min(raw)]}: capture it with profiling.capture")
    span = steps[min(step, len(steps) - 1)]
    start, end = span["ts"], span["ts"] + span.get("dur", 0)
    out: dict[str, float] = {}
    for e in evs:
        name = str(e.get("name", ""))
        if (name.startswith("train_step/") and e.get("cat") != "gpu_user_annotation"
                and start <= e["ts"] and e["ts"] + e.get("dur", 0) <= end):
            key = name[len("train_step/"):]
            out[key] = out.get(key, 0.0) + e.get("dur", 0) / 1e3
    return out


def _cpu_temporal(traces: dict[int, dict]) -> pd.DataFrame:
    """Per rank, how the profiled steps' wall time on the main thread splits into compute
    operators (convolutions, matmuls), other operators, and time outside any operator (Python,
    framework overhead, waiting). The CPU counterpart of HTA's temporal breakdown, same columns."""
    rows = []
    for rank, trace in traces.items():
        evs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        steps = step_spans(evs)
        if not steps:
            continue
        tid = steps[0].get("tid")
        ops = sorted((e for e in evs if e.get("cat") == "cpu_op" and e.get("tid") == tid), key=lambda e: (e["ts"], -e.get("dur", 0)))
        total = sum(s.get("dur", 0) for s in steps)
        compute = other = 0.0
        end = -1.0
        for e in ops:  # top-level operators only: those not nested in the previous top-level one
            if e["ts"] >= end:
                end = e["ts"] + e.get("dur", 0)
                is_compute = _is_compute(e["name"])  # ConvolutionBackward0 too
                compute += e.get("dur", 0) if is_compute else 0.0
                other += 0.0 if is_compute else e.get("dur", 0)
        idle = max(0.0, total - compute - other)
        rows.append({"rank": rank, "idle_time(us)": idle, "compute_time(us)": compute, "non_compute_time(us)": other,
                     "kernel_time(us)": total, "idle_time_pctg": round(100 * idle / total, 2),
                     "compute_time_pctg": round(100 * compute / total, 2),
                     "non_compute_time_pctg": round(100 * other / total, 2)})
    return pd.DataFrame(rows)


def _graph_kernels(traces: dict[int, dict]) -> dict[int, int]:
    """Per rank, the kernels that ran inside CUDA graphs: one cudaGraphLaunch launches them all, so HTA's launch
    statistics (cudaLaunchKernel calls) leave them out."""
    out = {}
    for rank, trace in traces.items():
        evs = trace["traceEvents"]
        graph = {e["args"]["correlation"] for e in evs if e.get("name") == "cudaGraphLaunch" and "correlation" in e.get("args", {})}
        out[rank] = sum(1 for e in evs if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in graph)
    return out


def launched_by_convolution(traces: dict[int, dict]) -> dict[str, float]:
    """Per GPU kernel name, the share of its time launched by a convolution operator (``aten::convolution_backward``,
    ``aten::cudnn_convolution``, ...), all ranks together; names no convolution launched are left out. A kernel
    names the operator that launched it by its ``External id``. Kernels replayed from a CUDA graph have no operator
    in the trace: their names alone say what they are (``kernel_kinds``)."""
    conv, total = {}, {}
    for trace in traces.values():
        evs = trace["traceEvents"]
        ops = {e["args"]["External id"]: str(e.get("name", "")) for e in evs
               if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
        for e in evs:
            if e.get("cat") != "kernel":
                continue
            name, dur = str(e.get("name", "")), float(e.get("dur", 0) or 0)
            total[name] = total.get(name, 0.0) + dur
            op = ops.get(e.get("args", {}).get("External id"))
            if op is not None and "conv" in op.lower():
                conv[name] = conv.get(name, 0.0) + dur
    return {n: conv[n] / total[n] for n in conv if total[n] > 0}


def _has_gpu_kernels(traces: dict[int, dict]) -> bool:
    return any(e.get("cat") == "kernel" for t in traces.values() for e in t["traceEvents"])


def analyze(trace_dir: str | Path, verbose: bool = True) -> TraceReport:
    """Run HTA on every rank's trace in ``trace_dir`` and collect the results as DataFrames.

    Never raises on a valid CPU-only trace (see ``TraceReport.notes``); raises ``TraceError``
    naming the path for a missing folder, an empty one, or an unreadable file.
    """
    trace_dir = Path(trace_dir).resolve()  # HTA puts /tmp/trace in front of any relative path
    files, traces = _rank_map(trace_dir)
    report = TraceReport(trace_dir=trace_dir, trace_files=files, has_gpu=_has_gpu_kernels(traces),
                         cpu_ops=_cpu_op_breakdown(traces), cpu_temporal=_cpu_temporal(traces),
                         graph_kernels=_graph_kernels(traces))
    conv_share = launched_by_convolution(traces) if report.has_gpu else {}
    unmarked = [r for r, t in traces.items()
                if not any(str(e.get("name", "")).startswith("ProfilerStep#") for e in t["traceEvents"])]
    if unmarked:
        report.notes.append(
            f"rank(s) {unmarked} have no ProfilerStep#N markers, so the analyses cover the whole trace, not whole "
            f"training steps. Capture with a torch.profiler schedule (ddpm_core.profiling.capture does) so steps are marked."
        )
    if not report.has_gpu:
        report.notes.append(GPU_ONLY_NOTICE)
    else:
        _run_hta(report, conv_share)
    if verbose:
        for n in report.notes:
            print(n)
    return report


@contextlib.contextmanager
def _quiet():
    """Silence HTA: it logs progress at WARNING through its own handlers, and prints."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


# HTA rounds each event's start up and its end down to whole microseconds. A kernel shorter than that (common in a
# compiled step on an H100/H200: the final stage of notebook 09 had 25 of them) comes out with a duration of -1 us;
# the kernel intervals then no longer add up, and the temporal breakdown fails its own assertion (non-compute time
# >= 0). The idle and launch figures shift too (kernel wait 2.7 ms rounded against 1.0 ms exact in that trace).
# Kernel times are exact in the trace, so they are parsed as they are.
_EXACT_TIMES = {"HTA_DISABLE_NS_ROUNDING": "1"}


def _run_hta(report: TraceReport, conv_share: dict[str, float] | None = None) -> None:
    from hta.trace_analysis import TraceAnalysis

    ranks = report.ranks
    try:
        with _quiet(), temporary_env(_EXACT_TIMES):
            hta = TraceAnalysis(trace_files={r: str(Path(p).resolve()) for r, p in report.trace_files.items()})
    except Exception as e:  # noqa: BLE001 - a note, not a crash: the report's own tables (cpu_ops, ...) still hold
        # The notebooks read a missing HTA table as "not available" and say so; a raise here would stop the notebook
        # (and a reference part on a GPU machine) for an analysis that only illustrates it.
        report.notes.append(f"HTA could not parse the traces in {report.trace_dir} ({type(e).__name__}: {e}), so its "
                            "analyses are missing from this report; the operator tables come from the trace itself.")
        return

    def attempt(what: str, call):
        try:
            with _quiet():
                return call()
        except Exception as e:  # noqa: BLE001 - one failed analysis must not hide the others
            report.notes.append(f"HTA {what} failed on this trace: {type(e).__name__}: {e}")
            return None

    report.temporal = attempt("temporal breakdown", lambda: hta.get_temporal_breakdown(visualize=False))
    # every kernel kept (none folded into "others"): its kinds need them all, and the top ones are its first rows
    kernels = attempt("kernel breakdown", lambda: hta.get_gpu_kernel_breakdown(
        visualize=False, num_kernels=1_000_000, duration_ratio=1.0))
    if kernels is not None:
        report.kernels, every = kernels
        report.top_kernels = (every.sort_values("sum (us)", ascending=False).groupby("rank", group_keys=False)
                              .head(TOP_KERNELS).reset_index(drop=True))
        report.kernel_kinds = kernel_kinds(every, conv_share)
    idle = attempt("idle time breakdown", lambda: hta.get_idle_time_breakdown(ranks=ranks, visualize=False))
    if idle is not None:
        report.idle = idle[0]
    launch = attempt("kernel launch stats", lambda: hta.get_cuda_kernel_launch_stats(ranks=ranks, visualize=False))
    if launch is not None:
        report.launch = pd.concat([df.assign(rank=r) for r, df in launch.items()], ignore_index=True) if launch else None
    if report.launch is not None:
        report.launch_summary = launch_summary(report.launch)
        if any(report.graph_kernels.values()):  # the table covers kernels launched one by one: say how many it cannot
            report.launch_summary["kernels in CUDA graphs (not in this table)"] = (
                report.launch_summary["rank"].map(report.graph_kernels).fillna(0).astype(int))
    if len(ranks) > 1:
        report.overlap = attempt("comm/comp overlap", lambda: hta.get_comm_comp_overlap(visualize=False))
    else:
        report.notes.append("comm/comp overlap needs a multi-rank (DDP) run; this trace has one rank.")
    report.memory_bw = attempt("memory bandwidth summary", lambda: hta.get_memory_bw_summary(ranks=ranks))


def launch_summary(launch: pd.DataFrame) -> pd.DataFrame:
    """Per rank, what a kernel launch costs next to what the kernel does (times in us, medians).

    HTA's ``launch_delay`` is the time from the launch call to the kernel's start. On a busy GPU
    that is mostly *queueing* behind earlier kernels (tens of ms on a GPU-bound step), not launch
    overhead, so it is reported apart:

    - ``launch_cpu_us``: the CPU time of the launch call (cudaLaunchKernel), the real launch cost;
    - ``kernel_us``: the kernel's GPU time;
    - ``queue_delay_us``: launch call to kernel start (HTA's launch_delay);
    - ``launch_bound_share``: the share of kernels shorter than their launch call. When most are,
      the CPU cannot enqueue work as fast as the GPU finishes it: the launch-bound regime, where
      bigger batches, fusion (torch.compile) and CUDA graphs help.
    """
    rows = []
    for rank, g in launch.groupby("rank"):
        rows.append({"rank": rank, "kernels": len(g), "launch_cpu_us": g["cpu_duration"].median(),
                     "kernel_us": g["gpu_duration"].median(), "queue_delay_us": g["launch_delay"].median(),
                     "launch_bound_share": float((g["gpu_duration"] < g["cpu_duration"]).mean())})
    return pd.DataFrame(rows, columns=["rank", "kernels", "launch_cpu_us", "kernel_us", "queue_delay_us",
                                       "launch_bound_share"])


def events_per_step(trace_dir: str | Path) -> pd.DataFrame:
    """Per rank: profiled steps, and GPU kernels and CPU operators launched per step.

    Fusion shows up here: ``torch.compile`` turns many small elementwise kernels into a few.
    """
    files, raw = _rank_map(Path(trace_dir))
    rows = []
    for rank, trace in raw.items():
        evs = trace["traceEvents"]
        steps = len(step_spans(evs))
        kernels = sum(1 for e in evs if e.get("cat") == "kernel")
        ops = sum(1 for e in evs if e.get("cat") == "cpu_op")
        rows.append({"rank": rank, "steps": steps, "gpu_kernels_per_step": kernels / max(steps, 1),
                     "cpu_ops_per_step": ops / max(steps, 1)})
    return pd.DataFrame(rows)


def diff(before: str | Path, after: str | Path, *, top: int = 12, gpu: bool | None = None) -> pd.DataFrame:
    """HTA's ``TraceDiff`` of two trace folders: which operators (CPU) or kernels (GPU) appeared,
    vanished, or changed in count and time between ``before`` and ``after`` (one profiled step each,
    the first of each trace, rank 0).

    Returns the ``top`` rows by absolute change in time, with HTA's columns renamed for reading:
    ``calls before/after``, ``time before/after (us)``, ``time change (us)`` and ``change``: "appeared"
    (no calls before), "vanished" (no calls after), "more calls", "fewer calls" or "same calls".
    (HTA's own code, kept as ``hta code``, is only the sign of the count change: "+" for more calls,
    whether or not the row is new.) ``gpu`` None: kernels when both traces have GPU kernels,
    operators otherwise. ``attrs["compared"]`` says which ("kernels" or "operators"): where HTA cannot compare the
    kernels of two GPU traces, the operators are compared instead and ``attrs["note"]`` says why.
    """
    from hta.trace_diff import DeviceType, TraceDiff

    before, after = Path(before).resolve(), Path(after).resolve()  # HTA puts /tmp/trace before relative paths
    for folder in (before, after):
        if not folder.is_dir() or not _trace_files(folder):
            raise TraceError(f"no trace files (*.pt.trace.json[.gz]) in {folder}: capture one with profiling.capture")
    if gpu is None:
        gpu = all(_has_gpu_kernels({0: _load_json(_trace_files(f)[0])}) for f in (before, after))

    def hta_diff(kernels: bool) -> pd.DataFrame:
        with _quiet(), temporary_env(_EXACT_TIMES):  # as analyze: sub-microsecond kernels keep their real durations
            return TraceDiff.compare_traces(str(before), str(after), use_short_name=True,
                                            device_type=DeviceType.GPU if kernels else DeviceType.CPU)

    note = ""
    try:
        df = hta_diff(gpu)
    except Exception as e:  # noqa: BLE001 - HTA has not met every real trace; the operators still tell the story
        try:
            if not gpu:
                raise  # HTA's operator diff is what failed: nothing else to ask it
            df = hta_diff(False)
            note = (f"HTA's TraceDiff could not compare the GPU kernels of these traces ({type(e).__name__}: {e}), so "
                    "this table compares their CPU operators instead.")
        except Exception as e2:  # noqa: BLE001 - HTA cannot read them at all: count the operators from the files ourselves
            df = _own_diff(before, after)  # e2: the operator diff's error (the same as e where that was the one asked)
            note = (f"HTA's TraceDiff could not read these traces ({type(e2).__name__}: {e2}), so this table compares "
                    "their CPU operators as counted from the trace files themselves: calls and inclusive time per "
                    "profiled step.")
        gpu = False
    df = df.rename(columns={"Control_counts": "calls before", "Test_counts": "calls after",
                            "Control_total_duration": "time before (us)", "Test_total_duration": "time after (us)",
                            "diff_counts": "calls change", "diff_duration": "time change (us)",
                            "counts_change_categories": "hta code"})
    df["change"] = ["appeared" if before == 0 else "vanished" if after == 0 else
                    "more calls" if after > before else "fewer calls" if after < before else "same calls"
                    for before, after in zip(df["calls before"], df["calls after"])]
    if not gpu:  # CPU: the ATen operators themselves; wrappers (autograd nodes, compiled regions) nest them
        df = df[df.index.astype(str).str.startswith("aten::")]
    df = df.reindex(df["time change (us)"].abs().sort_values(ascending=False).index).head(top)
    df = df.reset_index()
    df = df.rename(columns={df.columns[0]: "name"})
    df.attrs.update(compared="kernels" if gpu else "operators", note=note)  # what the rows are, and why if not kernels
    return df


def _per_kind(trace: dict, gpu: bool) -> pd.DataFrame:
    """One trace's work per name and kind, per profiled step: GPU kernels (``kernel_kind``; the share of a GEMM-named
    kernel a convolution launched counted as convolution, as ``kernel_kinds`` does) or CPU operators' self time
    (``_category``). Columns: name, kind, calls, time (us)."""
    steps = max(1, len(step_spans(trace.get("traceEvents", []))))
    if gpu:
        evs = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
        df = pd.DataFrame({"name": [str(e.get("name", "")) for e in evs], "time": [float(e.get("dur", 0) or 0) for e in evs]})
        df = df.groupby("name", as_index=False).agg(calls=("time", "size"), time=("time", "sum"))
        df["kind"] = df["name"].map(kernel_kind)
        share = df["name"].map(launched_by_convolution({0: trace})).fillna(0.0).where(df["kind"] == "matmul (cuBLAS)", 0.0)
        # the time splits by who launched it; the name and its calls go with the larger part (appeared / vanished count
        # names: a GEMM kernel that convolutions launched is one of the convolution's)
        conv = share >= 0.5
        split = df[(share > 0) & (share < 1)].assign(
            time=lambda d: d["time"] * (1 - share[d.index]).where(conv[d.index], share[d.index]), calls=0,
            kind=lambda d: d["kind"].where(conv[d.index], "convolution (cuDNN)"))
        df = df.assign(time=df["time"] * share.where(conv, 1 - share),
                       kind=df["kind"].where(~conv, "convolution (cuDNN)"))
        df = pd.concat([df, split], ignore_index=True)
    else:
        ops = _cpu_op_breakdown({0: trace})
        df = pd.DataFrame({"name": ops["name"], "calls": ops["calls"], "time": ops["self_us"], "kind": ops["name"].map(_category)})
    return df.assign(calls=df["calls"] / steps, time=df["time"] / steps)


def diff_by_kind(before: str | Path, after: str | Path) -> pd.DataFrame:
    """What changed between two traces, per kind of work: ``diff``'s question asked of whole classes, one profiled
    step of ``before`` against one of ``after`` (each trace's average over its profiled steps, rank 0's file).

    GPU kernel time by ``kernel_kind`` where both traces have GPU kernels, CPU operator self time by kind otherwise
    (self time: operators nest, and inclusive times summed over a kind would count the nested ones twice). Columns:
    kind, calls before/after, time before/after (us), time change (us), and appeared / vanished: how many distinct
    kernel (operator) names of that kind ran in one trace only. ``attrs["compared"]``: "kernels" or "operators"."""
    before, after = Path(before).resolve(), Path(after).resolve()
    for folder in (before, after):
        if not folder.is_dir() or not _trace_files(folder):
            raise TraceError(f"no trace files (*.pt.trace.json[.gz]) in {folder}: capture one with profiling.capture")
    traces = [_load_json(_trace_files(f)[0]) for f in (before, after)]
    gpu = all(_has_gpu_kernels({0: t}) for t in traces)
    b, a = (_per_kind(t, gpu) for t in traces)
    names_b, names_a = set(b.loc[b["calls"] > 0, "name"]), set(a.loc[a["calls"] > 0, "name"])
    rows = []
    for kind in sorted(set(b["kind"]) | set(a["kind"])):
        kb, ka = b[b["kind"] == kind], a[a["kind"] == kind]
        rows.append({"kind": kind, "calls before": float(kb["calls"].sum()), "calls after": float(ka["calls"].sum()),
                     "time before (us)": float(kb["time"].sum()), "time after (us)": float(ka["time"].sum()),
                     "appeared": len(set(ka.loc[ka["calls"] > 0, "name"]) - names_b),
                     "vanished": len(set(kb.loc[kb["calls"] > 0, "name"]) - names_a)})
    df = pd.DataFrame(rows, columns=["kind", "calls before", "calls after", "time before (us)", "time after (us)",
                                     "appeared", "vanished"])
    df["time change (us)"] = df["time after (us)"] - df["time before (us)"]
    df = df.reindex(df["time change (us)"].abs().sort_values(ascending=False).index).reset_index(drop=True)
    df.attrs.update(compared="kernels" if gpu else "operators")
    return df


def _own_diff(before: Path, after: Path) -> pd.DataFrame:
    """TraceDiff's table (its column names, indexed by operator) made without HTA: each trace's CPU operators
    (rank 0's file), calls and inclusive time per profiled step."""
    per_step = []
    for folder in (before, after):
        trace = _load_json(_trace_files(folder)[0])
        steps = max(1, len(step_spans(trace.get("traceEvents", []))))
        ops = _cpu_op_breakdown({0: trace}).groupby("name")[["calls", "total_us"]].sum() / steps
        per_step.append(ops)
    df = pd.concat(per_step, axis=1, keys=["Control", "Test"]).fillna(0.0)
    df.columns = [f"{side}_{'counts' if col == 'calls' else 'total_duration'}" for side, col in df.columns]
    df["diff_counts"] = df["Test_counts"] - df["Control_counts"]
    df["diff_duration"] = df["Test_total_duration"] - df["Control_total_duration"]
    df["counts_change_categories"] = ["+" if d > 0 else "-" if d < 0 else "=" for d in df["diff_counts"]]
    df.index.name = "name"
    return df


# Operators autocast wraps: with autocast on, the profiler records each call twice (the wrapper's, then the call it
# makes after casting), so their counts double between an fp32 and an autocast trace while the work does not.
# Checked on torch 2.14.1 (CPU autocast, bf16): one conv2d under autocast shows aten::conv2d twice and aten::convolution once.
AUTOCAST_RECORDED_TWICE = {"aten::conv2d", "aten::conv1d", "aten::conv3d", "aten::linear", "aten::matmul", "aten::bmm",
                           "aten::mm", "aten::addmm", "aten::baddbmm", "aten::scaled_dot_product_attention"}


def diff_summary(changed: pd.DataFrame, what: str = "operators", autocast_changed: bool = False,
                 autocast_after: bool | None = None) -> str:
    """One sentence from a ``diff`` table, its counts read from the ``change`` column (never assumed):
    how many of the rows vanished, appeared, ran more / fewer / as many times, and the biggest change.

    ``autocast_changed``: the two traces differ in autocast (fp32 against bf16, say). Then an operator autocast wraps
    whose count exactly doubled or halved is said to have changed in count only (see ``AUTOCAST_RECORDED_TWICE``).
    ``autocast_after``: which side ran autocast (True: the second trace), where known. Then such an operator that
    appeared on the autocast side (SDPA, once the math attention is gone) is said to count each of its calls twice."""
    n = changed["change"].value_counts()
    parts = [f"**{n.get(k, 0)}** {label}" for k, label in
             [("vanished", "vanished (no calls after)"), ("appeared", "appeared (no calls before)"),
              ("more calls", "ran more times"), ("fewer calls", "ran fewer times")] if n.get(k, 0)]
    same = changed[changed["change"] == "same calls"]
    if len(same):
        up, down = int((same["time change (us)"] > 0).sum()), int((same["time change (us)"] < 0).sum())
        parts.append(f"**{len(same)}** ran as many times as before but took " + (
            "longer" if not down else "less time" if not up else f"longer ({up}) or less time ({down})"))
    listed = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1] if parts else "none changed"
    top = changed.iloc[0] if len(changed) else None
    biggest = "" if top is None else (
        f" Biggest change: `{top['name']}` ({top['calls before']:.0f} -> {top['calls after']:.0f} calls, "
        f"{top['time change (us)'] / 1e3:+.1f} ms).")
    doubled = [r["name"] for _, r in changed.iterrows() if autocast_changed and str(r["name"]) in AUTOCAST_RECORDED_TWICE
               and min(r["calls before"], r["calls after"]) > 0
               and max(r["calls before"], r["calls after"]) == 2 * min(r["calls before"], r["calls after"])]
    twice = ("" if not doubled else
             f" {', '.join(f'`{n}`' for n in doubled)} doubled or halved {'its count' if len(doubled) == 1 else 'their counts'} "
             "without being called twice or half as often: "
             "under autocast the profiler records each such call twice (autocast's layer calls the operator again once "
             "it has cast the inputs), so the count of the operator beneath (`aten::convolution` for a convolution) is "
             "the one that counts the calls (what each call does grows with the batch, which the count does not show).")
    side, count = (("appeared", "calls after") if autocast_after else ("vanished", "calls before"))
    new_twice = [(r["name"], int(r[count])) for _, r in changed.iterrows()
                 if autocast_changed and autocast_after is not None and str(r["name"]) in AUTOCAST_RECORDED_TWICE
                 and r["change"] == side and r[count] > 0 and r[count] % 2 == 0]
    twice += ("" if not new_twice else
              " " + ", ".join(f"`{n}` ({c} calls)" for n, c in new_twice) + " ran only in the trace with autocast (the "
              f"operator{'s are' if len(new_twice) > 1 else ' is'} new there, not made by autocast), and autocast records "
              "each such call twice: " + (" and ".join(str(c // 2) for _, c in new_twice))
              + f" call{'s' if new_twice[0][1] != 2 or len(new_twice) > 1 else ''} of work"
              + (", in that order." if len(new_twice) > 1 else "."))
    return f"Of the {len(changed)} {what} whose time changed most, {listed}.{biggest}{twice}"


