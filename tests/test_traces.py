import os
import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

from ddpm_core import profiling, traces
from ddpm_core.train import build
from helpers import tiny_config


@pytest.fixture(scope="module")
def cpu_capture(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prof")
    t = build(tiny_config(tmp, batch_size=4))
    x = torch.rand(4, 3, 32, 32) * 2 - 1
    return profiling.capture(t.train_step, x, out_dir=tmp / "baseline", record_shapes=True)


def _load(path):
    with gzip.open(path, "rt") as f:
        return json.load(f)


def test_capture_writes_one_gzipped_trace_per_rank_with_rank_and_step_markers(cpu_capture):
    assert cpu_capture.trace_path.name == "rank0.pt.trace.json.gz"
    trace = _load(cpu_capture.trace_path)
    assert trace["distributedInfo"]["rank"] == 0
    steps = {e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert len(steps) == 3  # the active steps of the schedule
    assert any(e.get("args", {}).get("Input Dims") for e in trace["traceEvents"])  # record_shapes


def test_op_table_has_the_seed_slides_columns_and_convolution_backward_on_top(cpu_capture):
    df = cpu_capture.op_table()
    for col in ("name", "self_cpu_us", "cpu_total_us", "self_device_us", "device_total_us",
                "self_cpu_mem_bytes", "self_device_mem_bytes", "calls", "self_cpu_pct"):
        assert col in df.columns
    assert df["self_cpu_us"].is_monotonic_decreasing
    assert "aten::convolution_backward" in df.head(5)["name"].tolist()
    assert df["self_cpu_pct"].sum() == pytest.approx(100, abs=0.1)
    assert len(profiling.op_table(cpu_capture.profiler, top=10)) == 10
    with pytest.raises(ValueError, match="sort_by must be one of"):
        profiling.op_table(cpu_capture.profiler, sort_by="speed")


def test_the_step_is_split_into_labelled_phases_and_spans_are_not_operators(cpu_capture):
    names = set(cpu_capture.op_table()["name"])
    assert not any(n.startswith(("ProfilerStep", "train_step/")) for n in names)  # spans, not operators ("ProfilerStep*")
    phases = profiling.step_phases(cpu_capture.op_table(annotations=True))
    assert phases["phase"].tolist() == ["forward", "backward", "optimizer", "ema"]
    assert (phases["calls"] == 3).all() and phases["share"].sum() == pytest.approx(1.0)
    assert (phases["cpu_ms_per_step"] > 0).all()
    # the phases nest inside the step: together they are at most the profiled step time
    marks = [e for e in _load(cpu_capture.trace_path)["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
    step_ms = sum(e["dur"] for e in marks) / len(marks) / 1e3
    assert phases["cpu_ms_per_step"].sum() <= step_ms * 1.01
    assert not any(n.startswith("train_step/") for n in traces.analyze(cpu_capture.trace_dir, verbose=False).cpu_ops["name"])
    with pytest.raises(ValueError, match="no train_step/ phases"):
        profiling.step_phases(cpu_capture.op_table())
    # the same phases read from the trace file, one step at a time (04's yardstick: the eager update in two traces)
    first = traces.phase_ms(cpu_capture.trace_dir)
    assert set(first) == {"forward", "backward", "optimizer", "ema"} and all(v > 0 for v in first.values())
    per_step = [traces.phase_ms(cpu_capture.trace_dir, step=i) for i in range(3)]
    assert sum(p["optimizer"] for p in per_step) / 3 == pytest.approx(
        float(phases.set_index("phase").loc["optimizer", "cpu_ms_per_step"]), rel=0.02)
    assert sum(first.values()) <= max(e["dur"] for e in marks) / 1e3 * 1.01


def test_on_a_gpu_the_op_table_counts_device_time_once_and_phases_read_the_host_rows():
    """key_averages() on a GPU: operators (host rows; self device time = the kernels they launched), the kernels
    themselves (device rows: the same time again), and each record_function span twice (host and device)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def ev(key, device=DeviceType.CPU, self_cpu=0.0, cpu_total=0.0, self_dev=0.0, dev_total=0.0, calls=2, ann=False):
        return SimpleNamespace(key=key, device_type=device, self_cpu_time_total=self_cpu, cpu_time_total=cpu_total,
                               self_device_time_total=self_dev, device_time_total=dev_total, count=calls,
                               is_user_annotation=ann, self_cpu_memory_usage=0, cpu_memory_usage=0,
                               self_device_memory_usage=0, device_memory_usage=0, input_shapes=[])

    events = [ev("aten::cudnn_convolution", self_cpu=50, cpu_total=80, self_dev=600, dev_total=600),
              ev("aten::add", self_cpu=20, cpu_total=30, self_dev=200, dev_total=200),
              ev("cudaLaunchKernel", self_cpu=30, cpu_total=30),
              ev("sm90_xmma_fprop_implicit_gemm", DeviceType.CUDA, self_dev=600, dev_total=600),
              ev("vectorized_elementwise_kernel", DeviceType.CUDA, self_dev=200, dev_total=200),
              ev("ProfilerStep*", self_cpu=5, cpu_total=200, ann=True),
              ev("train_step/forward", self_cpu=10, cpu_total=60, dev_total=300, ann=True),
              ev("train_step/forward", DeviceType.CUDA, self_dev=300, dev_total=300, ann=True),
              ev("train_step/backward", self_cpu=10, cpu_total=120, ann=True),
              ev("train_step/backward", DeviceType.CUDA, self_dev=5, dev_total=5, ann=True),
              # torch's own record_function spans (the optimizer's), on the device too: not an operator
              ev("Optimizer.step#Adam.step", DeviceType.CUDA, self_dev=150, dev_total=150, ann=True)]
    prof = SimpleNamespace(key_averages=lambda group_by_input_shape=False: events)
    ops = profiling.op_table(prof)
    assert ops["name"].tolist() == ["aten::cudnn_convolution", "aten::add", "cudaLaunchKernel"]  # no kernel rows
    assert ops["self_device_pct"].tolist() == [75.0, 25.0, 0.0]  # of 800 us on the device, not of 1,600
    assert ops["self_cpu_pct"].sum() == pytest.approx(100)
    kernels = profiling.op_table(prof, kernels=True)
    assert kernels["name"].tolist() == ["sm90_xmma_fprop_implicit_gemm", "vectorized_elementwise_kernel"]
    assert kernels["self_device_pct"].sum() == pytest.approx(100)
    phases = profiling.step_phases(profiling.op_table(prof, annotations=True))
    assert phases["phase"].tolist() == ["forward", "backward"]  # one row each: the host's
    assert phases["cpu_ms_per_step"].tolist() == [0.03, 0.06] and "device_ms_per_step" not in phases
    fb = phases.set_index("phase")["cpu_ms_per_step"]
    assert f"{fb['backward'] / fb['forward']:.1f}" == "2.0"  # notebook 02 formats these as numbers


def test_analyze_on_a_cpu_trace_returns_the_cpu_breakdown_and_the_notice(cpu_capture, capsys):
    report = traces.analyze(cpu_capture.trace_dir)
    assert not report.has_gpu and report.ranks == [0]
    assert report.temporal is None and report.kernels is None and report.idle is None
    assert traces.GPU_ONLY_NOTICE in report.notes and "need a trace captured on a GPU" in capsys.readouterr().out
    ops = report.cpu_ops
    assert set(ops.columns) >= {"rank", "name", "calls", "self_us", "total_us", "self_pct"}
    assert ops["self_pct"].sum() == pytest.approx(100, abs=0.1)
    assert "aten::convolution_backward" in ops.head(5)["name"].tolist()
    conv = ops.set_index("name").loc["aten::conv2d"]
    assert conv["total_us"] > conv["self_us"] >= 0  # nested convolution time is not self time
    temporal = report.cpu_temporal.iloc[0]
    shares = temporal[["compute_time_pctg", "non_compute_time_pctg", "idle_time_pctg"]]
    assert shares.sum() == pytest.approx(100, abs=0.1) and temporal["compute_time_pctg"] > 30
    cats = traces.op_categories(ops)
    assert cats["kernel_type"].iloc[0] == "convolution" and cats["percentage"].sum() == pytest.approx(100, abs=0.5)
    # HTA itself reads the trace we wrote (rank taken from distributedInfo)
    from hta.trace_analysis import TraceAnalysis
    assert TraceAnalysis(trace_dir=str(cpu_capture.trace_dir)).t.get_ranks() == [0]


def test_analyze_reads_several_ranks_from_one_folder(cpu_capture, tmp_path):
    run = tmp_path / "ddp"
    run.mkdir()
    trace = _load(cpu_capture.trace_path)
    for rank in (0, 1):
        trace["distributedInfo"]["rank"] = rank
        with gzip.open(run / f"rank{rank}.pt.trace.json.gz", "wt") as f:
            json.dump(trace, f)
    report = traces.analyze(run, verbose=False)
    assert report.ranks == [0, 1] and set(report.cpu_ops["rank"]) == {0, 1}


def test_bad_trace_folders_get_errors_naming_the_path(cpu_capture, tmp_path):
    with pytest.raises(traces.TraceError, match=r"trace folder .*missing does not exist"):
        traces.analyze(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(traces.TraceError, match=r"no trace files .* in .*empty"):
        traces.analyze(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "rank0.pt.trace.json.gz").write_bytes(b"not gzip at all")
    with pytest.raises(traces.TraceError, match=r"cannot read trace file .*bad/rank0.pt.trace.json.gz"):
        traces.analyze(bad)
    dup = tmp_path / "dup"
    dup.mkdir()
    shutil.copy(cpu_capture.trace_path, dup / "a.json.gz")
    shutil.copy(cpu_capture.trace_path, dup / "b.json.gz")
    with pytest.raises(traces.TraceError, match=r"claim rank 0: a.json.gz and b.json.gz.*one run per folder"):
        traces.analyze(dup)


def test_hta_reads_a_compiled_h200_step_with_sub_microsecond_kernels():
    """The last stage of notebook 09 on the H200 (committed reference trace): 25 of its kernels are shorter than a
    microsecond, which HTA's default rounding turns into -1 us, and its temporal breakdown then failed an assertion
    (the notebook printed 'GPU idle: nan%'). Read with exact times, every analysis runs and the shares add up."""
    final = Path(__file__).resolve().parents[1] / "data/reference/h200/traces/09_putting_it_together/final"
    report = traces.analyze(final, verbose=False)
    assert report.has_gpu and not [n for n in report.notes if "failed" in n], report.notes
    row = report.temporal.iloc[0]
    shares = [row["idle_time_pctg"], row["compute_time_pctg"], row["non_compute_time_pctg"]]
    assert min(shares) >= 0 and sum(shares) == pytest.approx(100, abs=0.05)
    assert 0 < row["idle_time_pctg"] < 20  # a compiled bf16 step at batch 512 keeps the GPU busy
    assert report.idle is not None and report.launch_summary is not None
    assert "HTA_DISABLE_NS_ROUNDING" not in os.environ  # set for the parse only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_analyze_on_the_projects_own_gpu_trace_through_a_relative_path(tmp_path, monkeypatch):
    t = build(tiny_config(tmp_path, device="cuda"))
    x = torch.rand(32, 3, 32, 32, device="cuda") * 2 - 1
    monkeypatch.chdir(tmp_path)
    cap = profiling.capture(t.train_step, x, out_dir="runs/traces/gpu")  # relative, as the notebooks' were
    report = traces.analyze("runs/traces/gpu", verbose=False)
    assert report.has_gpu
    assert not [n for n in report.notes if "failed" in n], report.notes
    assert {"compute_time_pctg", "idle_time_pctg"} <= set(report.temporal.columns)
    assert "COMPUTATION" in set(report.kernels["kernel_type"])
    assert report.idle is not None and report.launch is not None and report.launch_summary is not None
    assert cap.op_table()["self_device_us"].sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_hta_diffs_the_kernels_of_two_real_gpu_traces(tmp_path):
    """04 and 09 diff two GPU traces with HTA's TraceDiff: on real traces it compares kernels, with no fallback note
    (where it cannot, diff falls back to operators and says so: the CPU tests cover that path)."""
    x = torch.rand(8, 3, 32, 32, device="cuda") * 2 - 1
    for attention in ("math", "sdpa"):
        t = build(tiny_config(tmp_path, device="cuda", attention=attention, batch_size=8))
        profiling.capture(t.train_step, x, out_dir=tmp_path / attention, wait=1, warmup=1, active=2)
    d = traces.diff(tmp_path / "math", tmp_path / "sdpa", top=500)
    assert d.attrs == {"compared": "kernels", "note": ""}, d.attrs
    assert len(d) and {"appeared", "vanished"} & set(d["change"]), d[["name", "change"]]


# ------------------------------------------------------------------------------ the GPU branch, on CPU
@pytest.fixture(scope="module")
def gpu_trace_dir(cpu_capture, tmp_path_factory):
    from gpu_trace import gpu_trace_from_cpu

    root = tmp_path_factory.mktemp("gpu")
    gpu_trace_from_cpu(cpu_capture.trace_path, root / "traces" / "baseline" / "rank0.pt.trace.json.gz")
    return root / "traces" / "baseline"


def test_hta_reads_a_gpu_trace_through_a_relative_path(gpu_trace_dir, monkeypatch):
    """HTA puts /tmp/trace in front of relative paths: every notebook passed one, and every GPU trace failed."""
    monkeypatch.chdir(gpu_trace_dir.parent.parent)
    rep = traces.analyze("traces/baseline", verbose=False)
    assert rep.has_gpu and rep.trace_dir.is_absolute()
    assert rep.temporal is not None and 0 < rep.temporal["compute_time_pctg"].iloc[0] <= 100
    assert rep.kernels is not None and rep.idle is not None and rep.launch is not None


def test_a_trace_hta_cannot_parse_gives_a_report_with_a_note_not_an_exception(gpu_trace_dir, monkeypatch):
    """HTA's parse of a real GPU trace had never run when the reference went to the GPU: a failure there must leave the
    notebook running (its HTA tables missing, said in a note), not stop it and the reference part with it."""
    import hta.trace_analysis

    def broken(*args, **kwargs):
        raise KeyError("ts")

    monkeypatch.setattr(hta.trace_analysis, "TraceAnalysis", broken)
    rep = traces.analyze(gpu_trace_dir, verbose=False)
    assert rep.has_gpu and rep.temporal is None and rep.kernels is None and rep.cpu_ops is not None
    assert any("HTA could not parse the traces" in n and "KeyError" in n for n in rep.notes)


def test_events_per_step_counts_each_profiled_step_once_on_a_gpu_trace(gpu_trace_dir, cpu_capture):
    """Kineto writes each ProfilerStep#N span twice on a GPU trace (the host's, and a gpu_user_annotation on the GPU's
    row): counting both halved 04's kernels and operators per step."""
    trace = _load(next(gpu_trace_dir.glob("*.json.gz")))["traceEvents"]
    on_gpu = [e for e in trace if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("ProfilerStep#")]
    assert on_gpu  # the synthetic trace carries the device-side copies, as a real one does
    kernels = sum(1 for e in trace if e.get("cat") == "kernel")
    row = traces.events_per_step(gpu_trace_dir).iloc[0]
    active = len([e for e in _load(cpu_capture.trace_path)["traceEvents"] if e.get("ph") == "X"
                  and e["name"].startswith("ProfilerStep#")])
    assert row["steps"] == active and row["gpu_kernels_per_step"] == kernels / active


def test_launch_summary_separates_launch_cost_from_queueing(cpu_capture, tmp_path):
    from gpu_trace import gpu_trace_from_cpu

    # kernels far longer than the CPU's gaps between launches, so that they queue however slowly the CPU capture ran
    # (at 400 us, a capture beside the test suite's background series spaced its launches enough to leave 826 us of
    # queue delay, under the 1000 asserted below)
    busy = traces.analyze(gpu_trace_from_cpu(cpu_capture.trace_path, tmp_path / "busy" / "rank0.pt.trace.json.gz",
                                             kernel_us=4000, launch_us=6).parent, verbose=False).launch_summary
    tiny = traces.analyze(gpu_trace_from_cpu(cpu_capture.trace_path, tmp_path / "tiny" / "rank0.pt.trace.json.gz",
                                             kernel_us=2, launch_us=8).parent, verbose=False).launch_summary
    assert list(busy.columns) == ["rank", "kernels", "launch_cpu_us", "kernel_us", "queue_delay_us", "launch_bound_share"]
    assert busy["launch_cpu_us"].iloc[0] < 10 and busy["queue_delay_us"].iloc[0] > 1000  # queued, not launch cost
    assert busy["launch_bound_share"].iloc[0] == 0.0 and tiny["launch_bound_share"].iloc[0] == 1.0


def test_missing_profiler_step_markers_are_a_note_and_hta_is_quiet(cpu_capture, tmp_path, capsys):
    from gpu_trace import gpu_trace_from_cpu

    d = gpu_trace_from_cpu(cpu_capture.trace_path, tmp_path / "nosteps" / "rank0.pt.trace.json.gz",
                           drop_step_markers=True).parent
    rep = traces.analyze(d, verbose=False)
    assert any("no ProfilerStep#N markers" in n for n in rep.notes)
    out = capsys.readouterr()
    assert "Parsed" not in out.out + out.err and "leaving" not in out.out + out.err  # HTA's progress logging


def test_report_table_prints_why_an_analysis_is_missing(gpu_trace_dir, capsys):
    rep = traces.analyze(gpu_trace_dir, verbose=False)
    assert rep.table("temporal") is rep.temporal
    assert rep.table("overlap") is None
    assert "overlap is not available for this trace: comm/comp overlap needs a multi-rank" in capsys.readouterr().out


@pytest.mark.parametrize("name, category", [
    ("aten::convolution_backward", "convolution"), ("ConvolutionBackward0", "convolution"),
    ("aten::mkldnn_convolution", "convolution"), ("aten::_slow_conv2d_forward", "convolution"),
    ("aten::addmm", "matmul / attention"), ("aten::bmm", "matmul / attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "matmul / attention"),
    ("aten::_to_copy", "copy / fill / memory"), ("aten::to", "copy / fill / memory"),
    ("aten::native_group_norm", "normalization"), ("Optimizer.step#Adam.step", "optimizer"),
    ("aten::_foreach_lerp_", "optimizer"), ("aten::silu", "elementwise / other"),
    # substrings that used to match: "to" in autograd, "mm" in comms, "conv" in convex
    ("autograd::engine::evaluate_function: SiluBackward0", "elementwise / other"),
    ("record_param_comms", "elementwise / other"), ("convex_hull", "elementwise / other"),
])
def test_operator_categories_match_whole_words(name, category):
    assert traces._category(name) == category


def test_top_ops_draws_one_rank_of_a_multi_rank_table():
    import pandas as pd

    from ddpm_core import plots

    table = pd.DataFrame({"rank": [0, 0, 1, 1], "name": ["a", "b", "a", "b"], "self_us": [10.0, 5.0, 9.0, 4.0]})
    fig = plots.top_ops(table, title="ops")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"] and len(ax.patches) == 2
    assert "(rank 0)" in ax.get_title()


def test_temporal_chart_legend_does_not_cover_the_axis_label(gpu_trace_dir):
    from ddpm_core import plots

    rep = traces.analyze(gpu_trace_dir, verbose=False)
    fig = plots.temporal_breakdown(rep.temporal, label="test")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent(renderer)
    assert not legend.overlaps(ax.xaxis.label.get_window_extent(renderer))
    assert not legend.overlaps(ax.get_window_extent(renderer))


def test_the_profilers_native_noise_is_held_back_and_real_errors_pass(capfd):
    from ddpm_core import profiling

    with profiling.native_stderr_filtered():
        os.write(2, b"USDT:2026-11-22 14:15:22 1:1 SyncActivityProfilerHandler.cpp:39] profiler_start\n")
        os.write(2, b"ERROR:2026-11-22 14:15:22 1:1 DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35\n")
        os.write(2, b"something real went wrong\n")
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "gpuGetDeviceCount" not in err
    assert "something real went wrong" in err


def test_capture_prints_nothing_to_stderr_on_cpu(tmp_path):
    import subprocess
    import sys

    code = ("import torch; from ddpm_core import profiling; "
            f"profiling.capture(lambda: torch.randn(32, 32) @ torch.randn(32, 32), out_dir={str(tmp_path)!r}, device='cpu')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "USDT" not in r.stderr and "gpuGetDeviceCount" not in r.stderr, r.stderr


def test_trace_diff_shows_the_operators_an_optimization_removed_and_added(tmp_path):
    """HTA's TraceDiff on two of our own captures, math attention vs SDPA: bmm vanishes and the fused
    attention operator appears."""
    from ddpm_core import plots

    x = torch.rand(2, 3, 32, 32) * 2 - 1
    for attention in ("math", "sdpa"):
        t = build(tiny_config(tmp_path, attention=attention, batch_size=2))
        profiling.capture(t.train_step, x, out_dir=tmp_path / attention, wait=1, warmup=1, active=1)
    d = traces.diff(tmp_path / "math", tmp_path / "sdpa", top=40)
    rows = d.set_index("name")
    assert rows.loc["aten::bmm", "calls after"] == 0 and rows.loc["aten::bmm", "change"] == "vanished"
    assert any("scaled_dot_product" in n and rows.loc[n, "change"] == "appeared" for n in rows.index), list(rows.index)
    # HTA's "+"/"-" is the sign of the count change only: a row with fewer calls is not "vanished"
    kept = rows[(rows["calls before"] > 0) & (rows["calls after"] > 0)]
    assert set(kept["change"]) <= {"more calls", "fewer calls", "same calls"}
    assert all(n.startswith("aten::") for n in rows.index)
    assert plots.trace_diff_bars(d.head(8)) is not None
    assert d.attrs == {"compared": "operators", "note": ""}
    with pytest.raises(traces.TraceError, match="no trace files"):
        traces.diff(tmp_path / "math", tmp_path / "nothing-here")


def test_the_diff_by_kind_of_the_h200_stack_says_which_kinds_the_last_stage_removed_and_added():
    """09's baseline (fp32, eager) against its last stage (bf16, compiled, CUDA graphs) on the H200, per kind of work:
    Triton's fused kernels appear from nothing, eager elementwise and normalization kernels all but vanish, and the
    convolutions take a fraction of their time; per-kind times add up to the traces' own kernel time per step."""
    root = Path(__file__).resolve().parents[1] / "data/reference/h200/traces/09_putting_it_together"
    d = traces.diff_by_kind(root / "baseline", root / "final")
    assert d.attrs["compared"] == "kernels"
    k = d.set_index("kind")
    triton = k.loc["fused elementwise / norm (Triton)"]
    assert triton["time before (us)"] == 0 and triton["calls after"] > 100 and triton["appeared"] > 100
    assert k.loc["normalization (eager)", "time after (us)"] < 0.01 * k.loc["normalization (eager)", "time before (us)"]
    conv = k.loc["convolution (cuDNN)"]
    assert conv["time after (us)"] < 0.5 * conv["time before (us)"] and conv["vanished"] > 0 and conv["appeared"] > 0
    # GEMM-named kernels a convolution launched count as convolution (as kernel_kinds): matmul stays small before
    assert k.loc["matmul (cuBLAS)", "time before (us)"] < 0.05 * conv["time before (us)"]
    assert list(d["time change (us)"].abs()) == sorted(d["time change (us)"].abs(), reverse=True)
    for side, folder in (("before", "baseline"), ("after", "final")):
        trace = traces._load_json(traces._trace_files(root / folder)[0])
        steps = len(traces.step_spans(trace["traceEvents"]))
        kernel_us = sum(float(e.get("dur", 0)) for e in trace["traceEvents"] if e.get("cat") == "kernel")
        assert d[f"time {side} (us)"].sum() == pytest.approx(kernel_us / steps, rel=1e-6)


def test_the_diff_by_kind_of_two_cpu_captures_uses_self_time(tmp_path):
    """On a CPU the kinds come from operators' self time (inclusive times would count nested operators twice): math
    attention against SDPA, the matmul kind loses bmm's name and gains SDPA's, and each side adds up to the step's
    operator self time."""
    from ddpm_core import plots

    x = torch.rand(2, 3, 32, 32) * 2 - 1
    for attention in ("math", "sdpa"):
        t = build(tiny_config(tmp_path, attention=attention, batch_size=2))
        profiling.capture(t.train_step, x, out_dir=tmp_path / attention, wait=1, warmup=1, active=2)
    d = traces.diff_by_kind(tmp_path / "math", tmp_path / "sdpa")
    assert d.attrs["compared"] == "operators"
    mm = d.set_index("kind").loc["matmul / attention"]
    assert mm["appeared"] >= 1 and mm["vanished"] >= 1
    trace = traces._load_json(traces._trace_files(tmp_path / "math")[0])
    own = traces._cpu_op_breakdown({0: trace})["self_us"].sum() / len(traces.step_spans(trace["traceEvents"]))
    assert d["time before (us)"].sum() == pytest.approx(own, rel=1e-6)
    fig = plots.trace_diff_bars(traces.diff(tmp_path / "math", tmp_path / "sdpa", top=6), by_kind=d)
    assert len(fig.axes) == 2 and "self time" in fig.axes[0].get_xlabel()
    with pytest.raises(traces.TraceError, match="no trace files"):
        traces.diff_by_kind(tmp_path / "math", tmp_path / "nothing-here")


def test_a_gpu_trace_diff_that_hta_cannot_make_falls_back_to_operators_and_says_why(tmp_path, monkeypatch):
    """HTA's kernel diff has not met every real GPU trace: where it raises, the notebooks (04, 09) still get a table,
    of the operators, with a note; where HTA cannot read the traces at all, of the operators counted without it."""
    from hta.trace_diff import DeviceType, TraceDiff

    x = torch.rand(2, 3, 32, 32) * 2 - 1
    for attention in ("math", "sdpa"):
        t = build(tiny_config(tmp_path, attention=attention, batch_size=2))
        profiling.capture(t.train_step, x, out_dir=tmp_path / attention, wait=1, warmup=1, active=1)
    real = TraceDiff.compare_traces

    def kernels_fail(control, test, device_type=DeviceType.CPU, **kw):
        if device_type == DeviceType.GPU:
            raise KeyError("stream")
        return real(control, test, device_type=device_type, **kw)

    monkeypatch.setattr(TraceDiff, "compare_traces", staticmethod(kernels_fail))
    d = traces.diff(tmp_path / "math", tmp_path / "sdpa", gpu=True)
    assert d.attrs["compared"] == "operators" and "KeyError" in d.attrs["note"] and "CPU operators" in d.attrs["note"]
    assert len(d) and all(n.startswith("aten::") for n in d["name"])
    # HTA cannot read the traces at all (a parse failure fails its CPU diff too): the operators are counted from the
    # files themselves, per profiled step, and the table still says which vanished and which appeared
    monkeypatch.setattr(TraceDiff, "compare_traces", staticmethod(lambda *a, **k: (_ for _ in ()).throw(ValueError("x"))))
    for gpu in (True, None):
        own = traces.diff(tmp_path / "math", tmp_path / "sdpa", top=200, gpu=gpu)  # every operator
        assert own.attrs["compared"] == "operators" and "could not read these traces (ValueError: x)" in own.attrs["note"]
        rows = own.set_index("name")
        assert rows.loc["aten::bmm", "change"] == "vanished" and rows.loc["aten::bmm", "calls after"] == 0
        assert any("scaled_dot_product" in n and rows.loc[n, "change"] == "appeared" for n in rows.index)
    assert traces.diff_summary(own).startswith("Of the ")

    def both_fail(control, test, device_type=DeviceType.CPU, **kw):  # the note names the error that forced the count
        raise KeyError("stream") if device_type == DeviceType.GPU else ValueError("operators")

    monkeypatch.setattr(TraceDiff, "compare_traces", staticmethod(both_fail))
    own = traces.diff(tmp_path / "math", tmp_path / "sdpa", gpu=True)
    assert "could not read these traces (ValueError: operators)" in own.attrs["note"], own.attrs["note"]


def test_per_rank_turns_hta_wide_tables_to_one_column_per_rank():
    df = pd.DataFrame([{"rank": 0, "idle_time(us)": 1.0, "idle_time_pctg": 10.0},
                       {"rank": 1, "idle_time(us)": 2.0, "idle_time_pctg": 20.0}])
    out = traces.per_rank(df)
    assert list(out.columns) == ["rank 0", "rank 1"] and list(out.index) == ["idle_time(us)", "idle_time_pctg"]
    assert out.loc["idle_time_pctg", "rank 1"] == 20.0
    assert traces.per_rank(None) is None
    several = pd.concat([df, df])  # several rows per rank (per stream, say): left as it is
    assert traces.per_rank(several) is several


def test_diff_summary_counts_each_kind_of_change_from_the_table_and_never_claims_a_count_change():
    d = pd.DataFrame({"name": ["aten::convolution_backward", "aten::bmm", "aten::_flash", "aten::add_", "aten::mul"],
                      "calls before": [43, 12, 0, 10, 5], "calls after": [43, 0, 6, 10, 7],
                      "time change (us)": [96_100.0, -5_000.0, 2_000.0, -300.0, 100.0],
                      "change": ["same calls", "vanished", "appeared", "same calls", "more calls"]})
    text = traces.diff_summary(d)
    assert text.startswith("Of the 5 operators whose time changed most, **1** vanished (no calls after), "
                           "**1** appeared (no calls before), **1** ran more times and **2** ran as many times")
    assert "longer (1) or less time (1)" in text and "fewer" not in text
    assert "`aten::convolution_backward` (43 -> 43 calls, +96.1 ms)" in text
    only_same = traces.diff_summary(d[d["change"] == "same calls"].head(1), "kernels")
    assert only_same.startswith("Of the 1 kernels") and "**1** ran as many times as before but took longer." in only_same


def test_the_profilers_one_cycle_warning_is_quieted_and_other_warnings_are_not(tmp_path):
    """torch 2.11 (the GPU machine's) warns "Profiler clears events at the end of each cycle" at every capture; our
    captures have one cycle, so it says nothing, and it printed in red in every notebook that profiles."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with profiling.quiet_profiler_warnings():
            warnings.warn("Warning: Profiler clears events at the end of each cycle.Only events from the current cycle")
            warnings.warn("something else")
        t = build(tiny_config(tmp_path, batch_size=2))
        profiling.capture(t.train_step, torch.rand(2, 3, 32, 32) * 2 - 1, out_dir=tmp_path / "cap", wait=0, warmup=1, active=1)
    texts = [str(w.message) for w in seen]
    assert "something else" in texts
    assert not [m for m in texts if "clears events" in m], texts


def test_cpu_names_relabel_hta_columns_for_display_on_cpu():
    temporal = pd.DataFrame([{"rank": 0, "idle_time(us)": 5.0, "compute_time(us)": 3.0, "non_compute_time(us)": 2.0,
                              "kernel_time(us)": 10.0, "idle_time_pctg": 50.0, "compute_time_pctg": 30.0,
                              "non_compute_time_pctg": 20.0}])
    wide = traces.cpu_names(traces.per_rank(temporal))
    assert "outside operators %" in wide.index and not any("kernel" in i or "idle" in i for i in wide.index)
    assert wide.loc["outside operators %", "rank 0"] == 50.0
    kinds = traces.cpu_names(pd.DataFrame({"kernel_type": ["convolution"], "sum": [1.0], "percentage": [100.0]}))
    assert list(kinds.columns) == ["operator kind", "self time (us)", "% of operator self time"]
    assert traces.cpu_names(None) is None


def test_kernel_kinds_say_where_the_h200_fast_step_goes():
    """HTA's kernel types put 100% of the compiled H200 step under COMPUTATION; grouped by what the kernels do, the
    committed trace shows Triton's fused normalization/elementwise kernels ahead of the convolutions, and 16% of the
    kernel time in layout copies (ATen copies before cuDNN's dgrad kernels, inside the CUDA graph)."""
    final = Path(__file__).resolve().parents[1] / "data/reference/h200/traces/09_putting_it_together/final"
    kinds = traces.analyze(final, verbose=False).kernel_kinds.set_index("kernel_type")["percentage"]
    assert kinds.sum() == pytest.approx(100, abs=0.5)  # each share rounded to 0.1
    assert kinds.index[0] == "fused elementwise / norm (Triton)" and 20 < kinds["convolution (cuDNN)"] < 45
    assert 10 < kinds["copies and layout changes"] < 25 and kinds["attention"] > 0 and kinds.get("other", 0) < 1
    names = {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
             "triton_poi_fused__to_copy_add_clone_convolution_native_dropout_native_group_norm_silu_13":
                 "fused elementwise / norm (Triton)",
             "void at::native::elementwise_kernel<128, 4, ...direct_copy_kernel_cuda...>": "copies and layout changes",
             "sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc": "convolution (cuDNN)",
             "sm80_xmma_gemm_cf32cf32_f32f32_cf32_nt_n_tilesize64x64x8": "convolution (cuDNN)",  # cuDNN's FFT algorithm
             "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNN": "matmul (cuBLAS)",
             "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>": "normalization (eager)",
             "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>": "optimizer",
             "Memset (Device)": "memset / memcpy"}
    assert {n: traces.kernel_kind(n) for n in names} == names


def test_gemm_named_kernels_that_a_convolution_launched_count_as_convolution():
    """cuDNN runs most of the fp32 eager step's backward convolutions as GEMM kernels named like cuBLAS's
    (sm80_xmma_gemm_f32f32_...): by name alone the H200's baseline read matmul 11% and convolution 70%. Each kernel
    names its launching operator (External id); by that, aten::convolution_backward launched three quarters of the
    GEMM-named time, and the matmuls (bmm, mm, addmm) are the rest."""
    baseline = Path(__file__).resolve().parents[1] / "data/reference/h200/traces/09_putting_it_together/baseline"
    kinds = traces.analyze(baseline, verbose=False).kernel_kinds.set_index("kernel_type")["percentage"]
    assert kinds.sum() == pytest.approx(100, abs=0.5)
    assert kinds["convolution (cuDNN)"] > 75 and kinds["matmul (cuBLAS)"] < 5, kinds
    per_kernel = pd.DataFrame({"name": ["sm80_xmma_gemm_f32f32", "nvjet_gemm", "triton_poi_x"],
                               "sum (us)": [100.0, 50.0, 50.0]})
    k = traces.kernel_kinds(per_kernel, {"sm80_xmma_gemm_f32f32": 0.75, "triton_poi_x": 1.0}).set_index("kernel_type")["sum"]
    assert k.to_dict() == {"convolution (cuDNN)": 75.0, "matmul (cuBLAS)": 75.0, "fused elementwise / norm (Triton)": 50.0}
    assert traces.kernel_kinds(per_kernel).set_index("kernel_type")["sum"]["matmul (cuBLAS)"] == 150.0  # by name alone


def test_the_launch_table_says_how_many_kernels_ran_inside_cuda_graphs():
    """HTA's launch statistics count cudaLaunchKernel calls: in the H200's CUDA-graph step they covered 52 kernels and
    left out the ~3,000 that one cudaGraphLaunch per step ran, which made the step look launch-bound beside 5% idle."""
    final = Path(__file__).resolve().parents[1] / "data/reference/h200/traces/09_putting_it_together/final"
    summary = traces.analyze(final, verbose=False).launch_summary
    assert summary["kernels in CUDA graphs (not in this table)"].iloc[0] > 10 * summary["kernels"].iloc[0]
    baseline = final.with_name("baseline")  # eager: every kernel launched one by one
    rep = traces.analyze(baseline, verbose=False)
    assert rep.graph_kernels == {0: 0} and "kernels in CUDA graphs (not in this table)" not in rep.launch_summary


def test_host_wait_is_read_on_the_stream_that_runs_the_step_not_averaged_over_side_streams():
    """07 said how much of the GPU's idle time was host wait by averaging HTA's per-stream ratios. In the H200's eager
    baseline, stream 7 runs the step (host wait 43% of its idle time); streams 30 and 31 sit idle with ~99% 'other'.
    A side stream with a host-wait row of its own would have pulled the average toward zero."""
    baseline = Path(__file__).resolve().parents[1] / "data/reference/h200/traces/09_putting_it_together/baseline"
    idle = traces.analyze(baseline, verbose=False).idle
    share, stream = traces.host_wait_share(idle)
    assert stream == 7 and share == pytest.approx(0.43, abs=0.01)
    side = pd.DataFrame({"rank": [0] * 5, "stream": [7, 7, 30, 30, 31], "idle_category": [
        "host_wait", "kernel_wait", "host_wait", "other", "other"], "idle_time": [40.0, 60.0, 1.0, 999.0, 500.0]})
    assert traces.host_wait_share(side) == (0.4, 7)  # the mean of the ratios would say (0.4 + 0.001) / 2
    assert traces.host_wait_share(None) is None and traces.host_wait_share(side, rank=1) is None
    assert traces.host_wait_share(side.drop(columns="stream")) is None


def test_the_diff_summary_says_when_autocast_doubled_a_count_not_the_work():
    """09's trace diff read 'aten::conv2d (43 -> 86 calls)' beside 'aten::convolution (43 -> 43)': autocast's layer
    calls conv2d again after casting, and the profiler records both. The sentence says so instead of leaving twice the
    convolutions to be read from it."""
    import torch
    from torch.profiler import profile

    m, x = torch.nn.Conv2d(3, 4, 3), torch.randn(1, 3, 8, 8)
    with profile() as prof, torch.autocast("cpu", dtype=torch.bfloat16):
        m(x)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts["aten::conv2d"] == 2 * counts["aten::convolution"]  # the premise, on this torch
    changed = pd.DataFrame({"name": ["aten::conv2d", "aten::convolution", "aten::add"], "calls before": [43.0, 43.0, 10.0],
                            "calls after": [86.0, 43.0, 20.0], "time change (us)": [-500.0, -400.0, 5.0],
                            "change": ["more calls", "same calls", "more calls"]})
    text = traces.diff_summary(changed, autocast_changed=True)
    # the count, not the work: a larger batch (09's last stage) makes each call do more work in as many calls
    assert "`aten::conv2d` doubled or halved its count without being called twice or half as often" in text
    assert "work" not in text.split("twice or half as often")[1].split("calls (")[0]
    assert "`aten::add`" not in text.split("Biggest change")[1]
    assert "autocast" not in traces.diff_summary(changed.iloc[1:], autocast_changed=True)
    assert "autocast" not in traces.diff_summary(changed)  # same precision on both sides (04's eager vs compiled)
    # SDPA, recorded twice under autocast too, appears on the bf16 side once the math attention is gone (09's CPU diff)
    with profile() as prof, torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.scaled_dot_product_attention(x[:, :1], x[:, :1], x[:, :1])
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts["aten::scaled_dot_product_attention"] == 2  # the premise, on this torch
    sdpa = pd.DataFrame({"name": ["aten::scaled_dot_product_attention", "aten::bmm"], "calls before": [0.0, 24.0],
                         "calls after": [8.0, 0.0], "time change (us)": [900.0, -800.0], "change": ["appeared", "vanished"]})
    text = traces.diff_summary(sdpa, autocast_changed=True, autocast_after=True)
    assert "`aten::scaled_dot_product_attention` (8 calls) ran only in the trace with autocast" in text and "4 calls of work." in text
    assert "records each" not in traces.diff_summary(sdpa, autocast_changed=True)  # which side: unknown, nothing said
    before = traces.diff_summary(sdpa, autocast_changed=True, autocast_after=False)  # the first trace ran autocast
    assert "`aten::bmm` (24 calls) ran only in the trace with autocast" in before and "(8 calls)" not in before
