import gzip
import json
import shutil

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_analyze_on_a_gpu_trace_returns_hta_breakdowns(tmp_path):
    t = build(tiny_config(tmp_path, device="cuda"))
    x = torch.rand(32, 3, 32, 32, device="cuda") * 2 - 1
    cap = profiling.capture(t.train_step, x, out_dir=tmp_path / "gpu")
    report = traces.analyze(cap.trace_dir)
    assert report.has_gpu
    assert {"compute_time_pctg", "idle_time_pctg"} <= set(report.temporal.columns)
    assert "COMPUTATION" in set(report.kernels["kernel_type"])
    assert report.idle is not None and report.launch is not None
    assert cap.op_table()["self_device_us"].sum() > 0
