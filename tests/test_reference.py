"""The reference run: one command writes a complete, packable reference folder, and every notebook shows it.

The whole series runs once per test session, in smoke mode, through ``python -m ddpm_core.reference run``:
that is both the notebooks' smoke test and the reference command's test.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import torch

from ddpm_core import reference, series, traces

NOTEBOOKS = series.list_notebooks()
MEASURING = ["02", "03", "04", "05", "06", "07", "08", "09", "10"]  # notebooks that append result rows


@pytest.mark.slow
def test_the_reference_command_writes_a_complete_folder(smoke_reference):
    out, log, seconds, _ = smoke_reference
    meta = json.loads((out / "meta.json").read_text())
    for key in ("device_name", "mode", "date", "torch_version", "cuda_version", "python_version", "git_commit"):
        assert key in meta, key
    assert meta["mode"] == "smoke"
    status = json.loads((out / "parts.json").read_text())
    assert [p for p in reference.PARTS if status[p]["status"] != "done"] == []
    for log_name in ("tests.log", "tests-slow.log", "tests-autotune.log"):  # without a GPU: not run, and says why
        assert "passed" in (out / log_name).read_text() or "skipped" in (out / log_name).read_text()
    for nb in NOTEBOOKS:
        assert (out / "notebooks" / nb.name).exists(), nb.name
        # its reference block says it is the reference (the H100's copies said none was committed)
        assert reference.IS_REFERENCE in (out / "notebooks" / nb.name).read_text(), nb.name
        for fig in series.declared_figures(nb):
            assert (out / "figures" / fig).stat().st_size > 5000, fig
    assert "budget 480 s per part" in log  # the per-part budget line (what it holds on a GPU is the GPU run's)


def test_no_figure_of_the_smoke_run_has_a_legend_over_a_label(smoke_reference):
    from ddpm_core.plots import LAYOUT_WARNING

    out = smoke_reference[0]
    found = []
    for nb in sorted((out / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(nb, as_version=4).cells:
            for o in cell.get("outputs", []):
                text = o.get("text", "") + "".join(str(v) for v in o.get("data", {}).values())
                found += [f"{nb.name}: {line.strip()}" for line in text.splitlines() if LAYOUT_WARNING in line]
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_results_csv_has_every_measuring_notebook_with_the_documented_columns(smoke_reference):
    out = smoke_reference[0]
    df = pd.read_csv(out / "results.csv")
    assert {nb[:2] for nb in df["notebook"].astype(str)} >= set(MEASURING)
    documented = (Path(reference.__file__).parents[1] / "data" / "README.md").read_text()
    for col in ("notebook", "variant", "device_name", "torch_version", "timestamp", "config", "median_ms",
                "images_per_s", "mfu", "mfu_bf16", "precision"):
        assert col in df.columns, col
        assert f"`{col}`" in documented, f"data/README.md does not document the results column {col}"


@pytest.mark.slow
def test_traces_are_trimmed_and_still_read_by_hta(smoke_reference):
    out = smoke_reference[0]
    names = reference.trace_names(out, ["*", "*/*"])
    assert {"02_baseline", "07_data_loading"} <= set(names) and any(n.startswith("03_batch_size/") for n in names)
    for name in names:
        for f in (out / "traces" / name).glob("*.json.gz"):
            with gzip.open(f, "rt") as fh:
                steps = {e["name"] for e in json.load(fh)["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
            assert 1 <= len(steps) <= reference.TRACE_STEPS, (name, steps)
    rep = traces.analyze(out / "traces" / "02_baseline", verbose=False)
    assert rep.cpu_temporal is not None and len(rep.cpu_ops)


@pytest.mark.slow
def test_the_archive_fits_and_unpacks_into_data_reference_and_figures(smoke_reference, tmp_path):
    out = smoke_reference[0]
    archive = out.parent / f"{out.name}.tar.gz"
    assert archive.stat().st_size <= reference.ARCHIVE_LIMIT_BYTES
    with tarfile.open(archive) as tar:
        assert not [n for n in tar.getnames() if reference.WORK in Path(n).parts]
    folder = reference.unpack(archive, root=tmp_path / "data" / "reference", figures=tmp_path / "figures")
    assert folder == tmp_path / "data" / "reference" / "cpu-smoke" and (folder / "meta.json").exists()
    assert (tmp_path / "figures" / "02_top_ops.png").exists()


@pytest.mark.slow
def test_a_second_run_skips_every_part(smoke_reference):
    out, _, _, env = smoke_reference
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ddpm_core.reference", "run", "--smoke", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.count("already done") == len(reference.PARTS)
    assert time.perf_counter() - start < 60


def _reference_cells(nb: Path) -> list:
    book = nbformat.read(nb, as_version=4)
    return [c for c in book.cells if c.cell_type == "code" and "reference" in c.metadata.get("tags", [])]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_has_a_self_contained_reference_cell(nb):
    cells = _reference_cells(nb)
    assert len(cells) == 1 and f'reference.show("{nb.stem}"' in cells[0].source


@pytest.mark.slow
def test_with_a_smoke_reference_every_notebook_shows_the_reference_block(smoke_reference, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    out = smoke_reference[0]
    monkeypatch.setenv("DDPM_REFERENCE_DIR", str(out.parent))
    monkeypatch.setenv("DDPM_FIGURES_DIR", str(tmp_path / "figures"))
    cells = [c for nb in NOTEBOOKS for c in _reference_cells(nb)]
    book = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.source) for c in cells])
    NotebookClient(book, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    for nb, cell in zip(NOTEBOOKS, book.cells):
        # what a reader sees as text: streams and the text/* forms of each output (a figure's base64 bytes can spell
        # "Error" by chance: 07's did once)
        text = json.dumps([[o.get("text", ""), {m: v for m, v in o.get("data", {}).items() if m.startswith("text/")}]
                           for o in cell.outputs])
        assert not [o for o in cell.outputs if o.get("output_type") == "error"], nb.name
        assert "(reference run, not this machine)" in text, nb.name
        assert "This notebook ran for" in text, nb.name  # its run time there, from parts.json
        assert "Traceback" not in text and "Error" not in text.replace("stderr", ""), nb.name
    assert (tmp_path / "figures" / "02_reference_02_baseline_temporal.png").exists()


def test_without_a_reference_the_block_says_how_to_make_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DDPM_REFERENCE_DIR", str(tmp_path / "none"))
    assert reference.show("02_profile_the_baseline", traces=["02_baseline"]) is False
    assert "make reference" in capsys.readouterr().out
    monkeypatch.setenv(reference.SELF_ENV, "1")  # inside the reference run: it is the reference
    monkeypatch.setenv("DDPM_SMOKE", "1")
    assert reference.show("02_profile_the_baseline", traces=["02_baseline"]) is False
    said = capsys.readouterr().out.strip()
    assert said == reference.self_line() and said.startswith(reference.IS_REFERENCE)
    assert "smoke mode" in said and "no GPU numbers" in said  # this CPU run is no GPU reference, and says so


def test_trim_keeps_the_asked_steps_and_the_kernels_they_launched(tmp_path):
    from gpu_trace import gpu_trace_from_cpu

    from ddpm_core import profiling
    from ddpm_core.train import build
    from helpers import tiny_config
    import torch

    t = build(tiny_config(tmp_path, batch_size=2))
    cap = profiling.capture(t.train_step, torch.rand(2, 3, 32, 32) * 2 - 1, out_dir=tmp_path / "cpu", active=5)
    # every third kernel launched through the driver API (cuLaunchKernel), as a compiled step's Triton kernels are
    src = gpu_trace_from_cpu(cap.trace_path, tmp_path / "gpu" / "rank0.pt.trace.json.gz", driver_every=3)
    counts = reference.trim_trace(src, tmp_path / "trim" / "rank0.pt.trace.json.gz", steps=2)
    assert counts["events_after"] < counts["events_before"]
    with gzip.open(tmp_path / "trim" / "rank0.pt.trace.json.gz", "rt") as f:
        kept = json.load(f)
    steps = [e for e in kept["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") != "gpu_user_annotation"]  # the host's spans (Kineto copies each onto the GPU's row)
    assert any(e.get("cat") == "gpu_user_annotation" for e in kept["traceEvents"])
    kernels = [e for e in kept["traceEvents"] if e.get("cat") == "kernel"]
    launches = {e["args"]["correlation"] for e in kept["traceEvents"] if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    assert len(steps) == 2 and kernels and {k["args"]["correlation"] for k in kernels} == launches
    assert any(e.get("cat") == "cuda_driver" for e in kept["traceEvents"])  # driver launches keep their kernels too
    assert kept["distributedInfo"]["rank"] == 0 and kept["deviceProperties"]
    rep = traces.analyze(tmp_path / "trim", verbose=False)
    assert rep.has_gpu and rep.temporal is not None


def test_a_relative_out_folder_reaches_the_notebooks_as_an_absolute_one(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(reference, "_part_notebooks", lambda out, *a: seen.append(out) or {})
    monkeypatch.chdir(tmp_path)
    reference.run(Path("ref"), smoke=True, parts=["nb-02"])
    assert seen == [tmp_path / "ref"]  # the notebooks run in notebooks/: a relative path would name another folder
    with pytest.raises(ValueError, match="unknown part"):
        reference.run(Path("other"), smoke=True, parts=["nb-99"])
    assert not (tmp_path / "other").exists()  # refused before anything was made


def test_slug_and_parts():
    assert reference.slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert reference.slug("NVIDIA H200") == "h200"
    assert reference.PARTS[0] == "meta" and reference.PARTS[-1] == "pack"
    with pytest.raises(ValueError, match="unknown part"):
        reference.run(Path("/tmp/never"), smoke=True, parts=["nb-99"])


@pytest.mark.slow
def test_the_grader_passes_every_notebook_of_the_smoke_run(smoke_reference):
    from ddpm_core import grade

    out = smoke_reference[0]
    for nb in NOTEBOOKS:
        report = grade.grade(nb.stem, results=out / reference.WORK / "results", figures=out / "figures",
                             executed=out / "notebooks" / nb.name)
        assert report.ok, report.text()


def _rows(nb: str, variants: list[str]) -> pd.DataFrame:
    return pd.DataFrame({"notebook": nb, "variant": variants, "median_ms": range(1, len(variants) + 1)})


def test_collect_makes_the_folder_whole_after_a_part_and_a_rerun_replaces_only_its_notebooks_rows(tmp_path):
    from gpu_trace import gpu_trace_from_cpu

    from ddpm_core import profiling
    from ddpm_core.train import build
    from helpers import tiny_config
    import torch

    out = tmp_path / "ref"
    work = out / reference.WORK
    (work / "results").mkdir(parents=True)
    # an earlier session left 02's and 03's rows; this command re-ran 03 and ran 04
    _rows("02_profile_the_baseline", ["eager"]).to_csv(out / "results.csv", index=False)
    pd.concat([pd.read_csv(out / "results.csv"), _rows("03_batch_size", ["old-1", "old-2"])]).to_csv(
        out / "results.csv", index=False)
    _rows("03_batch_size", ["new"]).to_csv(work / "results" / "03_batch_size.csv", index=False)
    _rows("04_torch_compile", ["default", "max-autotune"]).to_csv(work / "results" / "04_torch_compile.csv", index=False)
    t = build(tiny_config(tmp_path, batch_size=2))
    cap = profiling.capture(t.train_step, torch.rand(2, 3, 32, 32) * 2 - 1, out_dir=tmp_path / "cpu", active=5)
    gpu_trace_from_cpu(cap.trace_path, work / "runs" / "traces" / "04_default" / "rank0.pt.trace.json.gz")

    detail = reference.collect(out, ["03_batch_size", "04_torch_compile"])
    df = pd.read_csv(out / "results.csv")
    assert sorted(zip(df["notebook"], df["variant"])) == [
        ("02_profile_the_baseline", "eager"), ("03_batch_size", "new"),
        ("04_torch_compile", "default"), ("04_torch_compile", "max-autotune")]
    assert detail == {"results_rows": 4, "traces_trimmed": 1}
    assert traces.analyze(out / "traces" / "04_default", verbose=False).has_gpu
    # idempotent: nothing new, nothing trimmed again, no row twice
    assert reference.collect(out) == {"results_rows": 4, "traces_trimmed": 0}
    # the scratch may now go (the next command runs elsewhere): the folder alone holds everything
    import shutil
    shutil.rmtree(work)
    assert len(reference.results(out)) == 4 and reference.trace_names(out, ["04_*"]) == ["04_default"]


def test_keep_going_runs_past_a_failed_part_and_every_part_is_packed_as_it_ends(tmp_path, monkeypatch):
    calls = []

    def fake(out, smoke, prefixes, only, keep_going=False):
        calls.append(prefixes[0])
        if prefixes == ["03"]:
            raise series.NotebookFailed("03_batch_size.ipynb: cell 4 raised OutOfMemoryError: CUDA out of memory")
        (out / "notebooks").mkdir(exist_ok=True)
        (out / "notebooks" / f"{prefixes[0]}.ipynb").write_text("{}")
        return {"notebooks": {prefixes[0]: 1.0}}

    monkeypatch.setattr(reference, "_part_notebooks", fake)
    out, dest = tmp_path / "ref", tmp_path / "OUT"
    with pytest.raises(RuntimeError, match="reference part 'nb-03' failed"):
        reference.run(out, smoke=True, parts=["nb-02", "nb-03", "nb-04"], archive_to=dest)
    assert calls == ["02", "03"]  # without keep_going the run stops at the failure
    status = json.loads((out / "parts.json").read_text())
    assert status["nb-03"]["status"] == "failed" and "OutOfMemoryError" in status["nb-03"]["error"]
    with pytest.raises(RuntimeError, match="parts failed: nb-03$|parts failed: nb-03 "):
        reference.run(out, smoke=True, parts=["nb-02", "nb-03", "nb-04"], keep_going=True, archive_to=dest)
    assert calls == ["02", "03", "03", "04"]  # nb-02 was done: skipped; nb-03 tried again; nb-04 ran after it
    status = json.loads((out / "parts.json").read_text())
    assert [status[p]["status"] for p in ("nb-02", "nb-03", "nb-04")] == ["done", "failed", "done"]
    with tarfile.open(dest / "ref.tar.gz") as tar:  # the second command's archive: what it added, 04 and the status
        names = set(tar.getnames())
    assert {"ref/parts.json", "ref/notebooks/04.ipynb", f"ref/{reference.DELTA}"} <= names
    assert "ref/notebooks/02.ipynb" not in names  # there before that command began


def test_next_takes_the_parts_not_done_most_needed_first_and_one_gpu_leaves_08_out(tmp_path, monkeypatch, capsys):
    """`--parts next`, the word a short GPU session's plan uses: every part the folder has not done, in PRIORITY's
    order (09 and 09b before the one-technique notebooks); on one GPU in full mode, nb-08 is recorded as skipped with
    its reason (its DDP runs would be CPU processes there), never as done, and the notebook's block and the README's
    table say why."""
    assert sorted(reference.PRIORITY) == sorted(p for p in reference.PARTS if p != "pack")
    assert reference.PRIORITY[:5] == ["meta", "nb-09", "nb-09b", "nb-09c", "gpu-tests"]
    calls = []

    def fake(out, smoke, prefixes, only, keep_going=False):
        calls.append(prefixes[0])
        return {"notebooks": {prefixes[0]: 1.0}}

    monkeypatch.setattr(reference, "_part_notebooks", fake)
    monkeypatch.setattr(reference, "_part_gpu_tests", lambda out, smoke, part="gpu-tests": calls.append(part) or {})
    monkeypatch.setattr(reference, "_part_meta", lambda out, smoke: (out / "meta.json").write_text(json.dumps(
        {"device_name": "NVIDIA H200", "mode": "full", "torch_version": "2.11.0+cu130"})) and None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = tmp_path / "h200"
    out.mkdir()
    (out / "parts.json").write_text(json.dumps({"_mode": "full", "nb-09": {"status": "done", "seconds": 1.0}}))
    reference.run(out, smoke=False, parts=["next"])
    assert calls == ["09b", "09c", "gpu-tests", "02", "03", "04", "05", "03b", "07", "10", "gpu-tests-slow", "00",
                     "gpu-tests-autotune"]
    status = json.loads((out / "parts.json").read_text())
    assert status["nb-08"]["status"] == "skipped" and "gloo processes" in status["nb-08"]["reason"]
    assert "[nb-08] skipped: one GPU on this machine" in capsys.readouterr().out
    calls.clear()
    reference.run(out, smoke=False, parts=["next"])  # everything done but the skipped part, which is asked again
    assert calls == [] and json.loads((out / "parts.json").read_text())["nb-08"]["status"] == "skipped"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # two GPUs: NCCL, so it runs
    reference.run(out, smoke=False, parts=["nb-08"])
    assert calls == ["08"]
    assert "skipped" not in reference.status_markdown(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU's full run: 08 shows that CPU, and runs
    assert reference._skip_reason("nb-08", smoke=False) is None
    with pytest.raises(ValueError, match="'next'"):
        reference.run(out, smoke=False, parts=["nxt"])


def test_a_run_with_a_deadline_starts_no_part_that_cannot_end_before_it(tmp_path, monkeypatch, capsys):
    """scripts/gpu_call.sh gives the run its deadline (DDPM_RUN_DEADLINE): a part cut off by it is lost (redone from
    its start), so a part whose expected time no longer fits is not started, and a shorter one after it may be. Each
    fake part here moves a fake clock by its estimate; a committed full reference's measured time beats the estimate."""
    clock = [1_000_000.0]
    monkeypatch.setattr(reference.time, "time", lambda: clock[0])

    def fake(out, smoke, prefixes, only, keep_going=False):
        part = next(p for p, pre in reference.NOTEBOOK_PARTS.items() if pre == prefixes)
        clock[0] += reference.PART_ESTIMATE_S[part]
        return {"notebooks": {prefixes[0]: reference.PART_ESTIMATE_S[part]}}

    def fake_tests(out, smoke, part="gpu-tests"):
        clock[0] += reference.PART_ESTIMATE_S[part]
        return {}

    monkeypatch.setattr(reference, "_part_notebooks", fake)
    monkeypatch.setattr(reference, "_part_gpu_tests", fake_tests)
    monkeypatch.setattr(reference, "_part_meta", lambda out, smoke: (out / "meta.json").write_text(json.dumps(
        {"device_name": "NVIDIA H200", "mode": "full"})) and None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("DDPM_REFERENCE_DIR", str(tmp_path))
    h100 = tmp_path / "h100-80gb-hbm3"  # a committed full reference that measured nb-03b at 200 s
    h100.mkdir()
    (h100 / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3", "mode": "full"}))
    (h100 / "parts.json").write_text(json.dumps({"_mode": "full", "nb-03b": {"status": "done", "seconds": 200.0}}))
    assert reference.part_estimate_s("nb-03b") == (200.0, "measured in h100-80gb-hbm3")
    assert reference.part_estimate_s("nb-09") == (300.0, "estimated from the code")
    monkeypatch.setenv(reference.DEADLINE_ENV, str(clock[0] + 700))
    out = tmp_path / "h200"
    reference.run(out, smoke=False, parts=["next"])
    status = json.loads((out / "parts.json").read_text())
    done = [p for p in reference.PARTS if status.get(p, {}).get("status") == "done"]
    # meta (0 s here) + nb-09 (300) leave 400 s: 09b (450) does not fit; 09c (210) does, leaving 190 s; gpu-tests (150)
    # does, leaving 40 s: nothing after it fits (03b: 200)
    assert done == ["meta", "gpu-tests", "nb-09", "nb-09c"] and status["nb-08"]["status"] == "skipped"
    text = capsys.readouterr().out
    assert "[nb-09b] not started: it takes about 450 s (estimated from the code) and 400 s are left" in text
    assert "not started for lack of time: nb-09b nb-02 nb-03 nb-04 nb-05-06 nb-03b nb-07 nb-10 gpu-tests-slow " \
           "nb-00-01 gpu-tests-autotune" in text
    assert "nb-09b" not in status  # nothing recorded: it is simply still to do
    monkeypatch.delenv(reference.DEADLINE_ENV)  # no deadline (a run by hand, make reference): every part is started
    reference.run(out, smoke=False, parts=["nb-09b"])
    assert json.loads((out / "parts.json").read_text())["nb-09b"]["status"] == "done"


def test_side_by_side_parts_run_in_processes_of_their_own_and_leave_the_folder_whole(tmp_path, monkeypatch):
    """run(jobs=2), as the test suite's smoke run uses it: notebook parts two at a time, each in a process of its own
    (forked here, so that the fake below reaches them; the real run starts fresh ones), recorded as they end."""
    def fake(out, smoke, prefixes, only, keep_going=False):
        os.environ["DDPM_SMOKE"] = "part " + prefixes[0]  # what a part sets stays in its own process
        time.sleep(1.0 if prefixes == ["02"] else 0.1)
        if prefixes == ["03"]:
            raise series.NotebookFailed("03_batch_size.ipynb: cell 4 raised OutOfMemoryError")
        (out / "notebooks").mkdir(exist_ok=True)
        (out / "notebooks" / f"{prefixes[0]}.ipynb").write_text(str(os.getpid()))
        (out / reference.WORK / "results").mkdir(parents=True, exist_ok=True)
        (out / reference.WORK / "results" / f"{prefixes[0]}.csv").write_text(f"notebook,value\n{prefixes[0]},1\n")
        return {"notebooks": {prefixes[0]: 1.0}}

    monkeypatch.setattr(reference, "_part_notebooks", fake)
    monkeypatch.setattr(reference, "_MP_START", "fork")
    smoke_before = os.environ.get("DDPM_SMOKE")
    out, parts = tmp_path / "ref", ["nb-02", "nb-03", "nb-04", "pack"]
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="parts failed: nb-03"):
        reference.run(out, smoke=True, parts=parts, keep_going=True, jobs=2)
    assert time.perf_counter() - start < 1.0 + 0.1 + 0.1 + 5  # side by side: 04 ran while 02 slept
    assert os.environ.get("DDPM_SMOKE") == smoke_before
    status = json.loads((out / "parts.json").read_text())
    assert [status[p]["status"] for p in parts] == ["done", "failed", "done", "done"]
    assert "OutOfMemoryError" in status["nb-03"]["error"]
    pid = {n: int((out / "notebooks" / f"{n}.ipynb").read_text()) for n in ("02", "04")}
    assert os.getpid() not in pid.values() and pid["02"] != pid["04"]
    assert sorted(pd.read_csv(out / "results.csv")["notebook"].astype(str)) == ["2", "4"]  # collected by this process
    # without keep_going a failure starts no later part, and the part running beside it is still recorded
    with pytest.raises(RuntimeError, match="reference part 'nb-03' failed"):
        reference.run(tmp_path / "ref2", smoke=True, parts=["nb-02", "nb-03", "nb-04"], jobs=2)
    status = json.loads((tmp_path / "ref2" / "parts.json").read_text())
    assert status["nb-02"]["status"] == "done" and status["nb-03"]["status"] == "failed" and "nb-04" not in status


def test_parts_side_by_side_are_refused_in_full_mode_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="only a smoke run may do.*Fix: --jobs 1"):
        reference.run(tmp_path / "full", smoke=False, jobs=2)
    with pytest.raises(ValueError, match="at least 1"):
        reference.run(tmp_path / "full", smoke=True, jobs=0)
    assert not (tmp_path / "full").exists()


def test_a_part_killed_from_outside_stays_running_and_the_next_run_does_it_again(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(reference, "_part_notebooks", lambda out, smoke, pre, *a: calls.append(pre[0]) or {})
    out = tmp_path / "ref"
    out.mkdir()
    (out / "parts.json").write_text(json.dumps({"_mode": "smoke", "nb-02": {"status": "done", "seconds": 5},
                                                "nb-04": {"status": "running", "started": "2026-11-24T10:00:00"}}))
    reference.run(out, smoke=True, parts=["nb-02", "nb-04"])
    assert calls == ["04"]
    assert json.loads((out / "parts.json").read_text())["nb-04"]["status"] == "done"


def test_each_gpu_test_gets_a_limit_of_its_own_where_pytest_timeout_is_installed(tmp_path, monkeypatch):
    """A hung gpu test must fail alone (pytest-timeout, which the GPU image has), not hold its part and the session's
    minutes until the part's budget; without the plugin the command is the same, less the option."""
    import importlib.util
    import types

    ran = []

    def fake_run(cmd, cwd, stdout, stderr, text, timeout):
        ran.append(cmd)
        stdout.write("1 passed in 1.0s\n")
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(reference.subprocess, "run", fake_run)
    real = importlib.util.find_spec
    for installed in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
            (object() if installed else None) if name == "pytest_timeout" else real(name, *a)))
        for part in reference.GPU_TEST_PARTS:
            assert reference._part_gpu_tests(tmp_path, smoke=False, part=part) == {"passed": 1}
            option = f"--timeout={reference.GPU_TEST_TIMEOUT_S[part]}"
            assert (option in ran[-1]) is installed and ran[-1][-1] == "tests"
            assert (option in (tmp_path / reference.GPU_TEST_PARTS[part][1]).read_text().splitlines()[0]) is installed


def test_a_smoke_run_on_a_gpu_gets_its_own_folder_beside_the_gpus_reference(monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("DDPM_REFERENCE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    assert reference.default_out(smoke=False) == tmp_path / "h100-80gb-hbm3"
    assert reference.default_out(smoke=True) == tmp_path / "h100-80gb-hbm3-smoke"
    # a 16 GB card rehearsed on it (issue: every notebook on a T4) gets a folder of its own, labelled as such
    monkeypatch.setenv("DDPM_GPU_MEMORY_GB", "16")
    assert reference.default_out(smoke=False) == tmp_path / "h100-80gb-hbm3-cap16gib"
    (tmp_path / "capped").mkdir()
    (tmp_path / "capped" / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3", "torch_version": "2.11",
                                                              "gpu_memory_cap_gib": 16.0}))
    assert reference.label(tmp_path / "capped").startswith("reference: NVIDIA H100 80GB HBM3, capped at 16 GiB · torch 2.11")
    # and with a T4's lack of bf16 rehearsed too (DDPM_GPU_NO_BF16): another folder, another label
    monkeypatch.setenv("DDPM_GPU_NO_BF16", "1")
    assert reference.default_out(smoke=False) == tmp_path / "h100-80gb-hbm3-cap16gib-nobf16"
    (tmp_path / "capped" / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3", "torch_version": "2.11",
                                                              "gpu_memory_cap_gib": 16.0, "gpu_bf16_off": True}))
    assert reference.label(tmp_path / "capped").startswith("reference: NVIDIA H100 80GB HBM3, capped at 16 GiB, bf16 off · ")


def test_gpu_call_without_parts_says_how_to_name_them_before_doing_anything(tmp_path):
    script = series.REPO_ROOT / "scripts" / "gpu_call.sh"
    proc = subprocess.run(["bash", str(script)], env={**os.environ, "OUT": str(tmp_path / "OUT")},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "name the parts to run" in proc.stderr and "--shakedown" in proc.stderr
    assert not (tmp_path / "OUT").exists()  # nothing installed, made or run


def test_gpu_call_runs_its_parts_and_leaves_the_archive_and_the_log_in_OUT(tmp_path):
    import shutil

    script = series.REPO_ROOT / "scripts" / "gpu_call.sh"
    # the shakedown's default parts are real parts
    text = script.read_text()
    default = text.split("|| parts=(", 1)[1].split(")", 1)[0].split()
    assert default and set(default) <= set(reference.PARTS) and "meta" not in default
    env = {**os.environ, "OUT": str(tmp_path / "OUT"), "DDPM_REFERENCE_DIR": str(tmp_path / "reference"),
           # python3 there is the machine's python with torch: here, this environment's
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DEADLINE_S": "120",
           "WHEELS": str(tmp_path / "no-wheels")}  # never install into /tmp/site here
    if not shutil.which("python3", path=env["PATH"]):
        pytest.skip("no python3 on PATH")
    proc = subprocess.run(["bash", str(script), "meta"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu_call: exit 0" in proc.stdout
    with tarfile.open(tmp_path / "OUT" / "cpu-full.tar.gz") as tar:
        assert "cpu-full/meta.json" in tar.getnames()
    assert "[meta] done" in (tmp_path / "OUT" / "run.log").read_text()
    with tarfile.open(tmp_path / "OUT" / "cpu-full.tar.gz") as tar:  # each part says when and from which commit
        done = json.load(tar.extractfile("cpu-full/parts.json"))["meta"]
    assert done["finished"][:2] == "20" and "git_commit" in done


def test_a_run_into_a_folder_without_meta_describes_it_first(tmp_path, capsys):
    """The next GPU session's machine may be another GPU than the committed reference's (an H200 where the folder is
    an H100's): its run starts a new folder, and a plan written for the old one names no "meta". Without meta.json
    the folder is invisible (reference_runs, every notebook's block, the README's table), so the run does meta first."""
    out = tmp_path / "h200"
    reference.run(out, smoke=True, parts=["gpu-tests"])
    assert (out / "meta.json").exists() and reference.reference_runs(tmp_path) == [out]
    status = json.loads((out / "parts.json").read_text())
    assert status["meta"]["status"] == status["gpu-tests"]["status"] == "done"
    assert "no meta.json: doing it first" in capsys.readouterr().out
    reference.run(out, smoke=True, parts=["gpu-tests"], force=True)  # described already: meta is not redone
    assert "doing it first" not in capsys.readouterr().out


def test_meta_names_the_commit_from_the_environment_where_the_copy_has_no_git(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "_git", lambda *a: "")
    monkeypatch.setenv("DDPM_GIT_COMMIT", "0123456789abcdef")
    reference._part_meta(tmp_path, smoke=True)
    assert reference.meta(tmp_path)["git_commit"] == "0123456789abcdef"


def test_meta_asks_git_for_a_dirty_tree_without_running_the_notebook_filter(tmp_path, monkeypatch):
    """In a fresh clone git cannot trust the notebooks' timestamps and runs their clean filter (nbstripout, a second or
    more each) on every one: CI's clone took 20 s, past _git's 10 s limit, in every meta part, which then said "clean".
    Here the filter would take 30 s: meta asks with the files as they are, in well under that, and says what it saw."""
    import shutil

    if not shutil.which("git"):
        pytest.skip("no git")
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    (repo / ".gitattributes").write_text("notebooks/*.ipynb filter=nbstripout\n")
    nb = repo / "notebooks" / "00.ipynb"
    nb.write_text("{}\n")

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                       capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "x")
    git("config", "filter.nbstripout.clean", "sleep 30; cat")
    os.utime(nb, (time.time() + 100, time.time() + 100))  # its timestamp no longer matches the index: git must look
    monkeypatch.setattr(reference, "REPO_ROOT", repo)
    monkeypatch.delenv("DDPM_GIT_COMMIT", raising=False)
    start = time.perf_counter()
    reference._part_meta(tmp_path, smoke=True)
    assert time.perf_counter() - start < 8
    m = reference.meta(tmp_path)
    assert m["git_dirty"] is False and len(m["git_commit"]) == 40
    nb.write_text('{"changed": 1}\n')
    reference._part_meta(tmp_path, smoke=True)
    assert reference.meta(tmp_path)["git_dirty"] is True
    monkeypatch.setattr(reference, "REPO_ROOT", tmp_path / "not-a-repo")  # git fails: unknown, not "clean"
    (tmp_path / "not-a-repo").mkdir()
    reference._part_meta(tmp_path, smoke=True)
    assert reference.meta(tmp_path)["git_dirty"] is None and reference.meta(tmp_path)["git_commit"] is None


def test_meta_prefers_the_named_commit_over_a_git_folder_at_another_commit(tmp_path, monkeypatch):
    """The H100's copy of the tree held a .git at the session's first commit, not at the one that travelled."""
    monkeypatch.setattr(reference, "_git", lambda *a: "ff80671414537a1125a76f49c59d33c014edcc12" if "rev-parse" in a else " M x")
    monkeypatch.setenv("DDPM_GIT_COMMIT", "d7132134a1e60b8e1fffd7bc4b86350758f83bc3")
    reference._part_meta(tmp_path, smoke=True)
    m = reference.meta(tmp_path)
    assert m["git_commit"] == "d7132134a1e60b8e1fffd7bc4b86350758f83bc3"
    assert m["git_dirty"] is None  # that stale .git cannot say whether the tree that ran was clean
    monkeypatch.delenv("DDPM_GIT_COMMIT")
    reference._part_meta(tmp_path, smoke=True)
    assert reference.meta(tmp_path)["git_commit"].startswith("ff80671") and reference.meta(tmp_path)["git_dirty"] is True


def test_a_reference_that_has_not_reached_a_notebook_says_so_and_shows_nothing_for_it(tmp_path, monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(getattr(obj, "data", obj)))
    monkeypatch.setenv("DDPM_REFERENCE_DIR", str(tmp_path))
    folder = tmp_path / "h100-80gb-hbm3"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3", "mode": "full",
                                                  "torch_version": "2.11.0+cu130", "date": "2026-11-24"}))
    (folder / "parts.json").write_text(json.dumps({"_mode": "full", "meta": {"status": "done", "seconds": 1},
                                                   "nb-02": {"status": "done", "seconds": 90,
                                                             "notebooks": {"02_profile_the_baseline": 88.0}}}))
    _rows("02_profile_the_baseline", ["eager"]).to_csv(folder / "results.csv", index=False)
    assert reference.show("03_batch_size", figures=[]) is True
    text = " ".join(map(str, shown))
    assert "has not reached this notebook yet (parts done: meta, nb-02)" in text and "eager" not in text
    assert "### On" not in text  # no heading with nothing under it
    shown.clear()
    reference.show("02_profile_the_baseline", figures=[])
    text = " ".join(map(str, shown))
    assert "ran for **1.5 min**" in text and "not reached" not in text
    # a part a run left out (nb-08 on one GPU: reference._skip_reason) says why, in the block and in the README's table
    parts = json.loads((folder / "parts.json").read_text())
    (folder / "parts.json").write_text(json.dumps({**parts, "nb-08": {"status": "skipped", "reason": "1 GPU here"}}))
    shown.clear()
    reference.show("08_multi_gpu", figures=[])
    assert ("The reference run on NVIDIA H100 80GB HBM3 (`data/reference/h100-80gb-hbm3/`) left this notebook out: "
            "1 GPU here: nothing here comes from it.") in " ".join(map(str, shown))
    assert "nb-08 skipped: 1 GPU here." in reference.status_markdown(tmp_path)
    # a second GPU's run that has reached notebook 03: its block is shown, and the H100's gets one line after it
    h200 = tmp_path / "h200"
    h200.mkdir()
    (h200 / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H200", "mode": "full",
                                                "torch_version": "2.11.0+cu130", "date": "2026-12-01"}))
    (h200 / "parts.json").write_text(json.dumps({"meta": {"status": "done"}, "nb-03": {
        "status": "done", "seconds": 200, "notebooks": {"03_batch_size": 180.0}}}))
    _rows("03_batch_size", ["batch 128"]).to_csv(h200 / "results.csv", index=False)
    shown.clear()
    reference.show("03_batch_size", figures=[])
    text = [str(x) for x in shown]
    headings = [t for t in text if t.startswith("### On ")]
    assert len(headings) == 1 and headings[0].startswith("### On NVIDIA H200 (reference run")
    assert "batch 128" in " ".join(text) and "ran for **3.0 min**" in " ".join(text)
    assert text[-1] == ("The reference run on NVIDIA H100 80GB HBM3 (`data/reference/h100-80gb-hbm3/`) has not reached "
                        "this notebook yet (parts done: meta, nb-02): its GPU numbers for this notebook will appear here "
                        "once it has.")
    shown.clear()  # where neither has, a line each, and no heading
    reference.show("05_sdpa_attention", figures=[])
    assert not any(str(x).startswith("### On ") for x in shown)
    assert sum("has not reached this notebook yet" in str(x) for x in shown) == 2


def test_an_interrupted_part_is_recorded_and_packed_before_the_interrupt_goes_on(tmp_path, monkeypatch):
    def interrupted(out, smoke, pre, *a):
        (out / "notebooks").mkdir(exist_ok=True)
        (out / "notebooks" / "04_torch_compile.ipynb").write_text("{}")  # what papermill saved so far
        raise KeyboardInterrupt

    monkeypatch.setattr(reference, "_part_notebooks", interrupted)
    out, dest = tmp_path / "ref", tmp_path / "OUT"
    with pytest.raises(KeyboardInterrupt):
        reference.run(out, smoke=True, parts=["nb-04", "nb-05-06"], archive_to=dest)
    assert json.loads((out / "parts.json").read_text())["nb-04"]["status"] == "interrupted"
    with tarfile.open(dest / "ref.tar.gz") as tar:
        assert "ref/notebooks/04_torch_compile.ipynb" in tar.getnames()


def test_a_part_cut_off_by_the_deadline_keeps_what_it_finished_and_is_not_started_again_in_a_window_too_short(
        tmp_path, monkeypatch):
    """A deadline's SIGINT in the middle of a part's second notebook: the first notebook's time, the rows the cut one's
    finished sections wrote, and where it was cut are recorded, and the notebook's block and the README's table show
    them. The time it ran bounds its estimate from below, so a later run in a window as short does not spend the
    window on the same half run again (09b's length on a GPU is only estimated)."""
    from types import SimpleNamespace

    def run_notebook(nb, out_dir, **kw):
        scratch = out / reference.WORK / "results"
        scratch.mkdir(parents=True, exist_ok=True)
        _rows(nb.stem, [f"{nb.stem} section 1"]).to_csv(scratch / f"{nb.stem}.csv", index=False)
        if nb.stem.startswith("06"):
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / nb.name).write_text("{}")  # what papermill saved so far
            raise KeyboardInterrupt
        return SimpleNamespace(seconds=12.0)

    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(getattr(obj, "data", obj)))
    monkeypatch.setattr(series, "run_notebook", run_notebook)
    monkeypatch.setattr(reference, "_part_meta", lambda out, smoke: (out / "meta.json").write_text(json.dumps(
        {"device_name": "NVIDIA H200", "mode": "full", "date": "2026-12-01"})) and None)
    monkeypatch.setenv("DDPM_REFERENCE_DIR", str(tmp_path))
    out, dest = tmp_path / "h200", tmp_path / "OUT"
    with pytest.raises(KeyboardInterrupt):
        reference.run(out, smoke=False, parts=["nb-05-06", "nb-07"], archive_to=dest)
    status = json.loads((out / "parts.json").read_text())
    part = status["nb-05-06"]
    assert part["status"] == "interrupted" and "nb-07" not in status
    assert part["notebooks"] == {"05_sdpa_attention": 12.0} and part["cut_in"] == "06_mixed_precision"
    assert part["results_rows"] == 2
    assert sorted(pd.read_csv(out / "results.csv")["variant"]) == ["05_sdpa_attention section 1",
                                                                   "06_mixed_precision section 1"]
    with tarfile.open(dest / "h200.tar.gz") as tar:
        assert {"h200/results.csv", "h200/notebooks/06_mixed_precision.ipynb"} <= set(tar.getnames())

    # the estimate: a short cut leaves the code's estimate; one after 700 s makes it at least 760 s
    assert reference.part_estimate_s("nb-05-06") == (reference.PART_ESTIMATE_S["nb-05-06"], "estimated from the code")
    (out / "parts.json").write_text(json.dumps({**status, "nb-05-06": {**part, "seconds": 700.0, "cut_after_s": 688.0}}))
    assert reference.part_estimate_s("nb-05-06") == (760.0, "cut off after 700 s in h200: it needs more")
    assert "nb-05-06 was cut off by its run's deadline after 700 s, 688 s into 06_mixed_precision: kept, 1 result row " \
           "from the sections it finished; a later run starts it again only where more than 760 s are left." \
           in reference.status_markdown(tmp_path)

    # the notebooks' blocks: 05 ran whole; 06 shows the rows of the sections it finished, and says it was cut off
    reference.show("05_sdpa_attention", figures=[])
    text = " ".join(map(str, shown))
    assert "ran for **0.2 min**" in text and "cut this notebook off" not in text
    shown.clear()
    reference.show("06_mixed_precision", figures=[])
    text = " ".join(map(str, shown))
    assert "cut this notebook off after 11.5 min" in text and "06_mixed_precision section 1" in text
    assert "has not reached" not in text

    # a later run whose window is shorter than that bound starts nb-07 (its estimate fits) and not nb-05-06
    monkeypatch.setattr(series, "run_notebook", lambda nb, out_dir, **kw: SimpleNamespace(seconds=1.0))
    monkeypatch.setenv(reference.DEADLINE_ENV, str(time.time() + 700))
    reference.run(out, smoke=False, parts=["next"])
    status = json.loads((out / "parts.json").read_text())
    assert status["nb-05-06"]["status"] == "interrupted" and status["nb-07"]["status"] == "done"


@pytest.mark.slow
def test_gpu_call_shakedown_goes_on_past_a_failing_notebook_and_returns_the_executed_notebooks(tmp_path):
    """The shakedown (smoke mode, past failures) on this machine, with notebooks 00 and 01 broken on purpose: 00
    fails with its traceback in the archive, and 01, the next notebook of its part, still runs (and fails too)."""
    import shutil

    repo = tmp_path / "repo"  # a copy: the broken notebook must not touch the real one
    shutil.copytree(series.REPO_ROOT, repo, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "data", "figures",
                                                                           ".whl", "student", "*.egg-info"))
    for name in ("00_setup", "01_build_the_ddpm"):  # both fail at once: seconds, not the minutes of a real run
        nb = nbformat.read(repo / "notebooks" / f"{name}.ipynb", as_version=4)
        nb.cells.insert(1, nbformat.v4.new_code_cell(f"raise RuntimeError('{name} broken on purpose')"))
        nbformat.write(nb, repo / "notebooks" / f"{name}.ipynb")
    env = {**os.environ, "OUT": str(tmp_path / "OUT"), "SHAKEDOWN_DIR": str(tmp_path / "shake"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "WHEELS": str(tmp_path / "no-wheels"),
           "DDPM_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.run(["bash", str(repo / "scripts" / "gpu_call.sh"), "--shakedown", "nb-00-01"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "parts failed: nb-00-01" in out, out[-3000:]
    with tarfile.open(tmp_path / "OUT" / "shakedown.tar.gz") as tar:
        names = set(tar.getnames())
        status = json.load(tar.extractfile("shake/parts.json"))
    assert {"shake/notebooks/00_setup.ipynb", "shake/notebooks/01_build_the_ddpm.ipynb"} <= names
    assert status["nb-00-01"]["status"] == "failed"
    assert "00_setup broken on purpose" in status["nb-00-01"]["error"] and "01_build_the_ddpm broken" in status["nb-00-01"]["error"]
    with tarfile.open(tmp_path / "OUT" / "shakedown.tar.gz") as tar:
        executed = nbformat.reads(tar.extractfile("shake/notebooks/00_setup.ipynb").read().decode(), as_version=4)
    assert any(o.get("ename") == "RuntimeError" for c in executed.cells for o in c.get("outputs", []))


def test_the_readme_shows_where_each_committed_reference_run_stands():
    """The README's status block is `python -m ddpm_core.reference status`: `reference readme` after committing a part."""
    text = (series.REPO_ROOT / "README.md").read_text()
    block = text.split("<!-- reference-status -->\n", 1)[1].split("<!-- /reference-status -->", 1)[0]
    assert block.strip() == reference.README_BLOCKS["reference-status"]().strip(), (
        "README's reference status is stale. Fix: run `python -m ddpm_core.reference readme`, which writes it "
        "between its <!-- reference-status --> markers.")


def test_status_lists_every_part_and_quotes_the_lines_the_notebooks_printed(tmp_path):
    folder = tmp_path / "h100-80gb-hbm3"
    (folder / "notebooks").mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3", "mode": "full",
                                                  "torch_version": "2.11.0+cu130", "git_commit": "abcdef0123"}))
    (folder / "parts.json").write_text(json.dumps({"_mode": "full", "meta": {"status": "done", "seconds": 0.1},
                                                   "nb-00-01": {"status": "done", "seconds": 507,
                                                                "notebooks": {"00_setup": 34.3, "01_build_the_ddpm": 471.3}},
                                                   "gpu-tests": {"status": "failed", "seconds": 12, "error": "x"}}))
    line = "fastest eager configuration: 10 steps on x in 1.0 s: 100 ms per step on average, data loading included"
    nb = {"cells": [{"cell_type": "code", "outputs": [{"output_type": "stream", "name": "stdout",
                                                      "text": ["dataset: x\n", line + "\n"]}]}]}
    (folder / "notebooks" / "01_build_the_ddpm.ipynb").write_text(json.dumps(nb))
    (tmp_path / "cpu-smoke").mkdir()  # a smoke stand-in is not a reference run's status
    (tmp_path / "cpu-smoke" / "meta.json").write_text(json.dumps({"mode": "smoke"}))
    md = reference.status_markdown(tmp_path)
    assert "`abcdef0`" in md and "cpu-smoke" not in md
    assert "| nb-00-01 | done | 507 s | 00 34 s, 01 471 s |  |" in md and "| gpu-tests | failed | 12 s |" in md
    assert all(f"| {p} |" in md for p in reference.PARTS) and "| nb-09 | not run yet |" in md
    status = json.loads((folder / "parts.json").read_text())
    status["nb-02"] = {"status": "done", "seconds": 300, "finished": "2026-12-01T10:00:00+00:00", "git_commit": "0123456789"}
    (folder / "parts.json").write_text(json.dumps(status))
    assert "| nb-02 | done | 300 s |  | 2026-12-01 (`0123456`) |" in reference.status_markdown(tmp_path)
    assert f"01 printed: *{line}*" in md
    assert reference.status_markdown(tmp_path / "none") == reference.NO_REFERENCE


def test_the_gpu_tests_go_in_three_parts_that_together_select_every_gpu_test_once():
    assert len({log for _, log in reference.GPU_TEST_PARTS.values()}) == 3
    assert reference.PARTS[:4] == ["meta", "gpu-tests", "gpu-tests-slow", "gpu-tests-autotune"]

    # One collection (each took a Python start and every test module's imports), with each test's markers; the parts'
    # -m expressions (names joined by and, or, not) are then evaluated on them as pytest would.
    plugin = ("import json, pytest\n"
              "class Markers:\n"
              "    def pytest_collection_finish(self, session):\n"
              "        print('MARKERS ' + json.dumps({i.nodeid: sorted({m.name for m in i.iter_markers()}) for i in session.items}))\n"
              "pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests/test_gpu.py'], plugins=[Markers()])\n")
    out = subprocess.run([sys.executable, "-c", plugin], cwd=series.REPO_ROOT, capture_output=True, text=True).stdout
    markers = json.loads(next(line for line in out.splitlines() if line.startswith("MARKERS "))[len("MARKERS "):])

    def collected(expr):
        names = set(re.findall(r"[A-Za-z_]\w*", expr)) - {"and", "or", "not"}
        return [test for test, marks in markers.items() if eval(expr, {"__builtins__": {}}, {n: n in marks for n in names})]

    every = collected("gpu")
    parts = [collected(expr) for expr, _ in reference.GPU_TEST_PARTS.values()]
    assert sorted(sum(parts, [])) == sorted(every) and len(every) > 20  # each gpu test in exactly one part
    assert [t.split("::")[1] for t in parts[2]] == ["test_train_under_cuda_graphs_keeps_every_steps_loss[max-autotune-tf32]"]


def test_gpu_call_detach_runs_on_past_its_command_and_attach_collects_what_it_wrote(tmp_path):
    """A run longer than one device command: --detach starts it in its own session and returns when ATTACH_S runs
    out; --attach (the next command, while the machine is warm) follows it to the end and copies it into $OUT."""
    import shutil

    script = series.REPO_ROOT / "scripts" / "gpu_call.sh"
    env = {**os.environ, "DDPM_REFERENCE_DIR": str(tmp_path / "reference"), "BG_DIR": str(tmp_path / "bg"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "WHEELS": str(tmp_path / "no-wheels")}
    if not shutil.which("python3", path=env["PATH"]):
        pytest.skip("no python3 on PATH")

    def call(*args, out, attach_s):
        return subprocess.run(["bash", str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                              env={**env, "OUT": str(tmp_path / out), "ATTACH_S": str(attach_s)})

    committed = tmp_path / "reference" / "cpu-full"  # a committed folder to resume from, copied out of the repo
    committed.mkdir(parents=True)
    (committed / "parts.json").write_text(json.dumps({"_mode": "full", "nb-10": {"status": "done", "seconds": 1.0}}))
    first = call("--detach", "meta", out="OUT1", attach_s=0)  # returns at once: the run goes on without it
    assert first.returncode == 0 and "the detached run goes on" in first.stdout, first.stdout + first.stderr
    second = call("--attach", out="OUT2", attach_s=120)
    assert second.returncode == 0 and "the detached run ended (exit 0)" in second.stdout, second.stdout + second.stderr
    with tarfile.open(tmp_path / "OUT2" / "cpu-full.tar.gz") as tar:
        assert "cpu-full/meta.json" in tar.getnames()
    assert "[meta] done" in (tmp_path / "OUT2" / "run.log").read_text()
    assert "budget 660 s per part" in (tmp_path / "OUT2" / "run.log").read_text()  # each part gets the run's deadline
    with tarfile.open(tmp_path / "OUT2" / "cpu-full.tar.gz") as tar:  # it resumed the committed folder's copy
        assert set(json.load(tar.extractfile("cpu-full/parts.json"))) >= {"nb-10", "meta"}
    assert json.loads((committed / "parts.json").read_text()).keys() == {"_mode", "nb-10"}  # the original is untouched
    shutil.rmtree(tmp_path / "bg")
    lost = call("--attach", out="OUT3", attach_s=5)
    assert lost.returncode == 4 and "no detached run on this machine" in lost.stderr


def test_attach_moves_a_detached_runs_deadline_later_and_its_sigint_reaches_the_run(tmp_path):
    """--detach sets the run's deadline for a session's slowest start (RUN_DEADLINE_S); --attach, given what is left of
    the session (ATTACH_S), moves it later. At the deadline the run gets a SIGINT it can act on (KeyboardInterrupt packs
    what a cut part finished), though a background job of a script starts with SIGINT ignored: without
    reference.main's reset the SIGINT did nothing, and the kill 30 s later lost the cut part's rows."""
    import shutil

    script = series.REPO_ROOT / "scripts" / "gpu_call.sh"
    stub = tmp_path / "bin" / "python3"  # the run itself is a stand-in that waits for the deadline's SIGINT
    stub.parent.mkdir()
    stub.write_text('#!/bin/bash\nif [ "$1 $2 $3" = "-m ddpm_core.reference run" ]; then\n  exec "$REAL_PY" -c \'\n'
                    'import os, sys, time\nfrom ddpm_core import reference\ndef run(*a, **k):\n'
                    '    print("stand-in run: waiting for the deadline", flush=True)\n    try:\n        time.sleep(120)\n'
                    '    except KeyboardInterrupt:\n        open(os.environ["MARK"], "w").write(str(time.time()))\n'
                    '        raise\nreference.run = run\nsys.exit(reference.main(sys.argv[1:]))\' "${@:3}"\nfi\n'
                    'exec "$REAL_PY" "$@"\n')
    stub.chmod(0o755)
    mark = tmp_path / "sigint_at"
    env = {**os.environ, "REAL_PY": sys.executable, "MARK": str(mark), "BG_DIR": str(tmp_path / "bg"),
           "DDPM_REFERENCE_DIR": str(tmp_path / "reference"), "PATH": f"{stub.parent}:{os.environ['PATH']}",
           "WHEELS": str(tmp_path / "no-wheels")}
    if not shutil.which("python3", path=env["PATH"]):
        pytest.skip("no python3 on PATH")
    start = time.time()
    first = subprocess.run(["bash", str(script), "--detach", "nb-10"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60, env={**env, "OUT": str(tmp_path / "OUT1"), "ATTACH_S": "0", "RUN_DEADLINE_S": "20"})
    assert first.returncode == 0 and "the detached run goes on" in first.stdout, first.stdout + first.stderr
    second = subprocess.run(["bash", str(script), "--attach"], cwd=tmp_path, capture_output=True, text=True, timeout=90,
                            env={**env, "OUT": str(tmp_path / "OUT2"), "ATTACH_S": "40", "ATTACH_MARGIN_S": "10"})
    assert re.search(r"the run's deadline moves \d+ s later, to 30 s from now", second.stdout), second.stdout
    assert "the detached run ended (exit 130)" in second.stdout, second.stdout + second.stderr  # KeyboardInterrupt
    assert mark.exists(), (tmp_path / "bg" / "out" / "console.log").read_text()  # the run saw KeyboardInterrupt
    assert float(mark.read_text()) - start > 20 + 2  # not at the deadline --detach set: the one --attach moved it to
    assert "stand-in run: waiting for the deadline" in (tmp_path / "OUT2" / "run.log").read_text()


def test_the_readme_race_comes_from_09bs_rows_with_ratios_only_where_09b_would(tmp_path):
    """09b's contenders and ceiling, and 09c's quality verdict, from results.csv: the README's race, written by
    reference readme."""
    folder = tmp_path / "h200"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H200", "mode": "full"}))
    assert reference.peers_markdown(folder) == ""  # 09b has not run there
    row = dict(notebook="09b_the_fastest_step", device_name="NVIDIA H200", iters=20, peak_memory_gib=3.0)
    race = [  # name, batch, median, p10, p90, precision, tflops, mfu
        ("suspect channels_last=False: TrainConfig.fast()", 128, 20.0, 19.8, 20.2, "bf16", 240.0, 0.24),  # not a contender
        ("ours (baseline)", 128, 137.6, 137.0, 138.0, "fp32", 35.0, 0.035),
        ("ours (fast)", 128, 20.0, 19.8, 20.2, "bf16", 240.0, 0.24),
        ("diffusers", 128, 40.0, 39.5, 40.5, "bf16", 120.0, 0.12),
        ("lucidrains", 128, 20.1, 19.7, 20.4, "bf16", 90.0, 0.09),   # overlaps ours (fast): no ratio between them
    ]
    rows = [{**row, "variant": n, "batch_size": b, "median_ms": m, "p10_ms": lo, "p90_ms": hi, "precision": pr,
             "images_per_s": b / m * 1e3, "tflops": tf, "mfu": mfu} for n, b, m, lo, hi, pr, tf, mfu in race]
    rows.append({**row, "variant": "measured ceiling (bf16)", "batch_size": 512, "precision": "bf16",
                 "ceiling_tflops": 480.0, "conv_tflops": 470.0, "matmul_tflops": 790.0, "datasheet_tflops": 989.4})
    rows.append({**row, "notebook": "09c_nothing_given_up", "variant": "quality: fast (bf16, seed 0)", "batch_size": 128,
                 "dataset": "10,000 generated images", "steps": 120, "band_inside": 0.9, "within_spread": 1.0,
                 "passed": True})
    pd.DataFrame(rows).to_csv(folder / "results.csv", index=False)
    md = reference.peers_markdown(folder)
    cells = {line.split(" | ")[0].strip("| "): line.split(" | ")[5] for line in md.splitlines() if line.startswith("| ")}
    assert cells == {"contender": "vs ours (baseline)", "ours (baseline)": "1.00x", "ours (fast)": "6.88x",
                     "diffusers": "3.44x", "lucidrains": "6.85x"}  # the suspect row is no contender
    assert "| 50.0% |" in md and "n/a (other network)" in md  # 240 of 480 TFLOP/s; lucidrains is another network
    assert "ours (fast) against diffusers at batch 128: faster, at 2.00x the throughput of diffusers" in md
    assert "ours (fast) against lucidrains at batch 128: no measurable difference" in md
    assert "480.0 TFLOP/s in bf16; convolutions 470.0, a large matmul 790.0; against the datasheet's 989.4" in md
    assert "quality" not in md  # 09c's, below
    check = reference.quality_markdown(folder)
    assert check.startswith("Notebook 09c's quality check on NVIDIA H200") and "120 steps of 128 images each): " \
        "the check passed; its smoothed loss within the seeds' spread of its same-seed twin at 100% of the judged " \
        "steps, inside the band at 90%" in check
    assert md in reference.status_markdown(tmp_path) and check in reference.status_markdown(tmp_path)
    pd.DataFrame(rows[:-1]).to_csv(folder / "results.csv", index=False)
    assert reference.quality_markdown(folder) == ""  # 09c has not run there


def test_the_readme_gpu_table_states_a_stage_ratio_only_where_09_would(tmp_path):
    """Notebook 09's stages from results.csv, a ratio where the per-image ranges lie apart (as bench.Comparison)."""
    folder = tmp_path / "h100-80gb-hbm3"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3", "mode": "full"}))
    row = dict(notebook="09_putting_it_together", device_name="NVIDIA H100 80GB HBM3", precision="bf16", iters=10,
               tflops=100.0, mfu=0.101, peak="H100 SXM bf16 dense peak 989.4 TFLOP/s", peak_memory_gib=10.0,
               memory_kind="peak allocated, CUDA")
    stages = [  # name, batch, median, p10, p90
        ("baseline", 128, 100.0, 99.0, 101.0),
        ("+ apart", 128, 50.0, 49.0, 51.0),        # 2.00x: the ranges lie far apart
        ("+ overlapping", 128, 99.5, 98.0, 100.5),  # overlaps the baseline's range
        ("+ wide, close", 128, 90.0, 70.0, 98.5),   # apart, but it spread 31% and lies under 25% from the baseline
        ("+ too few calls", 128, 50.0, 49.0, 51.0),
    ]
    rows = [{**row, "variant": n, "batch_size": b, "median_ms": m, "p10_ms": lo, "p90_ms": hi,
             "images_per_s": b / m * 1e3, **({"iters": 2} if n == "+ too few calls" else {})} for n, b, m, lo, hi in stages]
    pd.DataFrame(rows).to_csv(folder / "results.csv", index=False)
    md = reference.stages_markdown(folder)
    cells = {line.split(" | ")[0].strip("| "): line.split(" | ")[5] for line in md.splitlines() if line.startswith("| ")}
    assert cells == {"stage": "img/s vs the first stage", "baseline": "1.00x", "+ apart": "2.00x",
                     "+ overlapping": "noisy", "+ wide, close": "noisy", "+ too few calls": "noisy"}
    assert "| 10.1% |" in md and "H100 SXM bf16 dense peak 989.4 TFLOP/s" in md and "peak allocated, CUDA" in md
    assert md in reference.status_markdown(tmp_path)
    (folder / "results.csv").unlink()
    assert reference.stages_markdown(folder) == ""


def _committed_folder(folder: Path) -> Path:
    """A small fake reference folder as a commit holds it after meta, gpu-tests and nb-02."""
    (folder / "notebooks").mkdir(parents=True)
    (folder / "figures").mkdir()
    (folder / "traces" / "02_baseline").mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3", "mode": "full",
                                                  "git_commit": "c0ffee0000"}))
    (folder / "parts.json").write_text(json.dumps({"_mode": "full", "meta": {"status": "done", "seconds": 1.0},
                                                   "nb-02": {"status": "done", "seconds": 90.0}}))
    (folder / "tests.log").write_text("5 passed\n")
    _rows("02_profile_the_baseline", ["eager"]).to_csv(folder / "results.csv", index=False)
    (folder / "notebooks" / "02_profile_the_baseline.ipynb").write_bytes(os.urandom(4000))
    (folder / "figures" / "02_top_ops.png").write_bytes(os.urandom(3000))
    (folder / "traces" / "02_baseline" / "rank0.pt.trace.json.gz").write_bytes(os.urandom(5000))
    return folder


def _resumed_run(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """The committed folder here, a copy of it on the "device", and a run there of nb-02 (done: skipped) and nb-04
    (new), archived into OUT after each part. Returns (the folder here, the archive)."""
    import shutil

    here = _committed_folder(tmp_path / "here" / "h100-80gb-hbm3")
    device = tmp_path / "device" / "h100-80gb-hbm3"
    shutil.copytree(here, device)
    os.utime(device / "notebooks" / "02_profile_the_baseline.ipynb")  # touched, same bytes: not packed

    def nb04(out, smoke, prefixes, only, keep_going=False):
        (out / "notebooks" / "04_torch_compile.ipynb").write_bytes(os.urandom(6000))
        (out / "figures" / "04_compile_modes.png").write_bytes(os.urandom(3000))
        (out / reference.WORK / "results").mkdir(parents=True, exist_ok=True)
        _rows("04_torch_compile", ["default", "max-autotune"]).to_csv(
            out / reference.WORK / "results" / "04_torch_compile.csv", index=False)
        return {"notebooks": {"04_torch_compile": 200.0}}

    monkeypatch.setattr(reference, "_part_notebooks", nb04)
    monkeypatch.setenv("DDPM_GIT_COMMIT", "d00dfeed11")
    reference.run(device, smoke=False, parts=["nb-02", "nb-04"], archive_to=tmp_path / "OUT")
    return here, tmp_path / "OUT" / "h100-80gb-hbm3.tar.gz"


def test_a_run_resumed_from_a_committed_folder_packs_only_what_it_added_and_unpack_merges_it(tmp_path, monkeypatch):
    here, archive = _resumed_run(tmp_path, monkeypatch)
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        marker = json.load(tar.extractfile(f"h100-80gb-hbm3/{reference.DELTA}"))
    top = "h100-80gb-hbm3"
    added = {"parts.json", "results.csv", "notebooks/04_torch_compile.ipynb", "figures/04_compile_modes.png"}
    assert names == {top, f"{top}/{reference.DELTA}", *(f"{top}/{n}" for n in added)}
    assert set(marker["files"]) == added and marker["base_files"] == 7 and marker["git_commit"] == "d00dfeed11"
    figures = tmp_path / "figures"
    folder = reference.unpack(archive, root=here.parent, figures=figures)
    assert folder == here and not (here / reference.DELTA).exists()
    files = {p.relative_to(here).as_posix() for p in here.rglob("*") if p.is_file()}
    assert files == {"meta.json", "parts.json", "tests.log", "results.csv", "notebooks/02_profile_the_baseline.ipynb",
                     "notebooks/04_torch_compile.ipynb", "figures/02_top_ops.png", "figures/04_compile_modes.png",
                     "traces/02_baseline/rank0.pt.trace.json.gz"}  # the union: nothing the commit had is lost
    status = json.loads((here / "parts.json").read_text())
    assert status["nb-02"]["status"] == status["nb-04"]["status"] == "done" and status["meta"]["seconds"] == 1.0
    assert sorted(zip(*[reference.results(here)[c] for c in ("notebook", "variant")])) == [
        ("02_profile_the_baseline", "eager"), ("04_torch_compile", "default"), ("04_torch_compile", "max-autotune")]
    assert sorted(p.name for p in figures.iterdir()) == ["04_compile_modes.png"]  # its own figures only
    assert reference.unpack(archive, root=here.parent, figures=figures) == here  # the same delta again: harmless
    assert reference.status_markdown(here.parent).count("| done |") == 3
    # a plain pack of the merged folder is a full archive again: every file, no marker
    with tarfile.open(reference.pack(here)) as tar:
        assert {n.split("/", 1)[1] for n in tar.getnames() if "/" in n} == files


def test_a_delta_over_a_missing_folder_or_one_it_did_not_start_from_is_refused_naming_the_fix(tmp_path, monkeypatch):
    here, archive = _resumed_run(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=r"which is missing here\. Fix: unpack the earlier archives .* or check out "
                                         r"the commit that has it"):
        reference.unpack(archive, root=tmp_path / "elsewhere", figures=tmp_path / "figures")
    assert not (tmp_path / "elsewhere" / "h100-80gb-hbm3").exists()
    # here, after another archive from the same start was unpacked: its parts.json would be written over
    status = json.loads((here / "parts.json").read_text())
    (here / "parts.json").write_text(json.dumps({**status, "nb-03": {"status": "done", "seconds": 300.0}}))
    (here / "tests.log").unlink()
    with pytest.raises(ValueError, match=r"1 missing here \(tests.log\) and 1 different here \(parts.json\).*Fix: "
                                         r"unpack the archives in the order they were made"):
        reference.unpack(archive, root=here.parent, figures=tmp_path / "figures")
    assert not (here / "notebooks" / "04_torch_compile.ipynb").exists()  # refused before anything was written
    reference.unpack(archive, root=here.parent, figures=tmp_path / "figures", force=True)
    assert (here / "notebooks" / "04_torch_compile.ipynb").exists()
    proc = subprocess.run([sys.executable, "-m", "ddpm_core.reference", "unpack", str(archive)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "DDPM_REFERENCE_DIR": str(tmp_path / "cli-root"),
                                                       "DDPM_COMMITTED_FIGURES_DIR": str(tmp_path / "cli-figures")})
    assert proc.returncode == 1 and "which is missing here. Fix: unpack the earlier archives" in proc.stderr
    # a delta that holds meta.json (a run that redid meta) makes a missing folder only when told to
    again = _committed_folder(tmp_path / "again" / "h100-80gb-hbm3")
    reference.record_base(again)
    (again / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3", "mode": "full"}))
    with pytest.raises(ValueError, match=r"missing here.*`unpack --force` makes the folder from this archive alone"):
        reference.unpack(reference.pack(again, delta=True), root=tmp_path / "new", figures=tmp_path / "figures")
    made = reference.unpack(again.parent / "h100-80gb-hbm3.tar.gz", root=tmp_path / "new", figures=tmp_path / "figures",
                            force=True)
    assert [p.name for p in made.iterdir()] == ["meta.json"]  # what it holds, and no DELTA.json


def test_a_run_closes_each_archive_at_the_segment_size_and_unpack_all_applies_the_chain_in_order(tmp_path, monkeypatch):
    """A command that runs nb-02 (several MB of traces) and more parts must not outgrow one archive: each archive is
    closed at SEGMENT_BYTES and the next part starts the next, chained to it. A detached run's two calls return
    copies of the same links; unpack_all keeps the later copy of each and applies the chain in order."""
    import shutil

    here = _committed_folder(tmp_path / "here" / "h100-80gb-hbm3")
    device = tmp_path / "device" / "h100-80gb-hbm3"
    shutil.copytree(here, device)
    sizes = {"03": 5000, "03b": 100, "04": 6000}  # nb-03 and nb-04 close their archive; nb-03b stays open
    copies = []

    def part(out, smoke, prefixes, only, keep_going=False):
        nb = prefixes[0]
        (out / "notebooks" / f"{nb}.ipynb").write_bytes(os.urandom(sizes[nb]))
        if nb == "04":  # what a --detach call would have copied by now: the second link, holding nb-03b only
            copies.append(tmp_path / "detach-copy.tar.gz")
            shutil.copy2(tmp_path / "OUT" / "h100-80gb-hbm3.part2.tar.gz", copies[-1])
        return {"notebooks": {nb: 1.0}}

    monkeypatch.setattr(reference, "_part_notebooks", part)
    monkeypatch.setattr(reference, "SEGMENT_BYTES", 4000)
    reference.run(device, smoke=False, parts=["nb-03", "nb-03b", "nb-04"], archive_to=tmp_path / "OUT")
    out = tmp_path / "OUT"
    assert sorted(p.name for p in out.iterdir()) == ["h100-80gb-hbm3.part2.tar.gz", "h100-80gb-hbm3.tar.gz"]

    def holds(archive):
        with tarfile.open(archive) as tar:
            return {n.split("/", 1)[1] for n in tar.getnames() if n.count("/") and not n.endswith(reference.DELTA)}

    assert holds(out / "h100-80gb-hbm3.tar.gz") == {"parts.json", "notebooks/03.ipynb"}
    assert holds(out / "h100-80gb-hbm3.part2.tar.gz") == {"parts.json", "notebooks/03b.ipynb", "notebooks/04.ipynb"}
    assert holds(copies[0]) == {"parts.json", "notebooks/03b.ipynb"}  # the earlier copy of the same link
    # the second link alone is refused here: it starts where the first left the folder
    with pytest.raises(ValueError, match="not what it started from"):
        reference.unpack(out / "h100-80gb-hbm3.part2.tar.gz", root=here.parent, figures=tmp_path / "figures")
    done = reference.unpack_all([out / "h100-80gb-hbm3.part2.tar.gz", copies[0], out / "h100-80gb-hbm3.tar.gz"],
                                root=here.parent, figures=tmp_path / "figures")
    assert [p.name for p in done] == ["h100-80gb-hbm3.tar.gz", "h100-80gb-hbm3.part2.tar.gz"]
    status = json.loads((here / "parts.json").read_text())
    assert all(status[p]["status"] == "done" for p in ("meta", "nb-02", "nb-03", "nb-03b", "nb-04"))
    assert all((here / "notebooks" / f"{nb}.ipynb").stat().st_size == n for nb, n in sizes.items())
    assert not list(out.glob(".*"))  # no half-written archive left beside them


def test_a_first_run_packs_a_full_archive_and_a_full_archive_still_replaces_the_folder(tmp_path, monkeypatch):
    def nb02(out, smoke, prefixes, only, keep_going=False):
        (out / "notebooks").mkdir(exist_ok=True)
        (out / "notebooks" / "02_profile_the_baseline.ipynb").write_text("{}")
        (out / "meta.json").write_text(json.dumps({"device_name": "cpu", "mode": "smoke"}))
        (out / reference.DELTA).write_text("{}")  # a stray marker (a delta extracted by hand) is never packed
        return {}

    monkeypatch.setattr(reference, "_part_notebooks", nb02)
    out = tmp_path / "device" / "ref"
    reference.run(out, smoke=True, parts=["nb-02"], archive_to=tmp_path / "OUT")  # into an empty folder
    archive = tmp_path / "OUT" / "ref.tar.gz"
    with tarfile.open(archive) as tar:
        assert set(tar.getnames()) == {"ref", "ref/parts.json", "ref/meta.json", "ref/notebooks/02_profile_the_baseline.ipynb"}
    old = _committed_folder(tmp_path / "here" / "ref")
    assert reference.unpack(archive, root=old.parent, figures=tmp_path / "figures") == old
    assert {p.relative_to(old).as_posix() for p in old.rglob("*") if p.is_file()} == {
        "parts.json", "meta.json", "notebooks/02_profile_the_baseline.ipynb"}  # replaced, as before deltas
    # an archive without meta.json is refused before the folder here is touched
    import shutil
    shutil.rmtree(old / "notebooks")
    (old / "meta.json").unlink()
    bad = reference.pack(old)
    shutil.rmtree(old)
    kept = _committed_folder(old)
    with pytest.raises(ValueError, match="holds no meta.json"):
        reference.unpack(bad, root=old.parent, figures=tmp_path / "figures")
    assert (kept / "meta.json").exists() and (kept / "traces" / "02_baseline").is_dir()


def test_a_delta_over_the_limit_names_its_biggest_files_and_the_fix(tmp_path, monkeypatch):
    folder = _committed_folder(tmp_path / "ref")
    with pytest.raises(RuntimeError, match="no run recorded"):  # `pack --delta` where no run started
        reference.pack(folder, delta=True)
    reference.record_base(folder)
    (folder / "notebooks" / "09_putting_it_together.ipynb").write_bytes(os.urandom(30_000))
    (folder / "traces" / "09_stage").mkdir()
    (folder / "traces" / "09_stage" / "rank0.pt.trace.json.gz").write_bytes(os.urandom(20_000))
    monkeypatch.setattr(reference, "ARCHIVE_LIMIT_BYTES", 40_000)
    with pytest.raises(RuntimeError) as err:
        reference.pack(folder, delta=True)
    said = str(err.value)
    assert "2 new or changed files of 9" in said and "Fix: run fewer parts per command" in said
    assert said.index("notebooks/09_putting_it_together.ipynb") < said.index("traces/09_stage/rank0.pt.trace.json.gz")
    assert "02_baseline" not in said  # the base's files are not in the archive: not named


def test_the_sentence_on_the_committed_figures_is_written_from_the_figures(tmp_path, monkeypatch):
    """Where each figure comes from: a full reference run's copy by its bytes, any other by its PNG's record."""
    from ddpm_core import env, plots

    figs, root = tmp_path / "figures", tmp_path / "reference"
    run = root / "h200"
    (run / "figures").mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H200", "mode": "full",
                                               "torch_version": "2.11.0+cu130", "date": "2026-12-01T10:00:00"}))
    monkeypatch.setenv("DDPM_FIGURES_DIR", str(figs))
    monkeypatch.setenv("DDPM_SMOKE", "1")
    monkeypatch.setattr(env, "_RUN_LABEL", "CPU (test) · torch 9.9")
    declared = {nb.stem.split("_")[0]: series.declared_figures(nb) for nb in NOTEBOOKS}
    fig = plots.plt.figure()
    for prefix, names in declared.items():
        for name in names:
            if prefix not in ("00", "02"):
                plots.savefig(fig, name)  # this machine, smoke mode
    for name in declared["00"]:  # the GPU's, as unpack copies them
        (run / "figures" / name).write_bytes(plots.savefig(fig, name, source="NVIDIA H200 · torch 2.11.0+cu130",
                                                           mode="full").read_bytes())
    fig.savefig(figs / declared["02"][0])  # no record
    text = reference.figures_markdown(figs, root)
    total = sum(map(len, declared.values()))
    assert text.startswith(f"The figures in `figures/` (all {total} that the notebooks declare)")
    today = time.strftime("%Y-%m-%d", time.gmtime())  # the day the PNG records, not the day the run began
    assert (f"the {len(declared['00'])} of notebook 00 from the reference run on NVIDIA H200 (full mode, torch "
            f"2.11.0+cu130, {today}; [where it stands](#where-the-reference-run-stands))") in text
    assert "notebooks 01, 03, 03b," in text and " and 10 from a smoke-mode run" in text and "from a smoke-mode run on CPU (test) · torch 9.9 (2026-" in text
    assert f"No record says where `{declared['02'][0]}` came from." in text
    assert "Missing: " + ", ".join(f"`{n}`" for n in declared["02"][1:]) + "." in text
    assert text.endswith("Each is replaced by its GPU figure as the reference run reaches its notebook.")
    # a figure that differs from the reference run's copy is not credited to it
    plots.savefig(fig, declared["00"][0])
    assert "notebook 00 from" not in reference.figures_markdown(figs, root)
    # a figure only a GPU draws counts where a reference run committed it (and is never missing where none did)
    gpu = [n for n in series.declared_figures(series.NOTEBOOKS_DIR / "03b_memory.ipynb", gpu=True) if n not in declared["03b"]]
    assert gpu and f"`{gpu[0]}`" not in reference.figures_markdown(figs, root)
    (run / "figures" / gpu[0]).write_bytes(plots.savefig(fig, gpu[0], source="NVIDIA H200 · torch 2.11.0+cu130",
                                                         mode="full").read_bytes())
    text = reference.figures_markdown(figs, root)
    assert f"(all {total + 1} that the notebooks declare, 1 of which only a GPU draws)" in text
    assert f"`{gpu[0]}` from the reference run on NVIDIA H200" in text


def test_readme_writes_both_blocks_between_their_markers_and_refuses_a_readme_without_them(monkeypatch):
    monkeypatch.setattr(reference, "README_BLOCKS", {"reference-status": lambda: "STATUS", "figure-sources": lambda: "FIGS"})
    text = ("intro\n<!-- figure-sources -->\nold\n<!-- /figure-sources -->\nmiddle\n"
            "<!-- reference-status -->\nold table\n<!-- /reference-status -->\nend\n")
    assert reference.readme_blocks(text) == ("intro\n<!-- figure-sources -->\nFIGS\n<!-- /figure-sources -->\nmiddle\n"
                                             "<!-- reference-status -->\nSTATUS\n<!-- /reference-status -->\nend\n")
    with pytest.raises(ValueError, match="no <!-- figure-sources --> ... <!-- /figure-sources --> markers"):
        reference.readme_blocks("intro\n<!-- reference-status -->\nx\n<!-- /reference-status -->\n")


def test_the_readme_says_where_the_committed_figures_come_from():
    """Every committed figure is credited to a run that made it, and the README says so in the generated words."""
    block = reference.README_BLOCKS["figure-sources"]()
    assert "No record" not in block and "Missing" not in block, block
    text = (series.REPO_ROOT / "README.md").read_text()
    assert block in text, ("README's sentence on where the figures come from is stale. Fix: run "
                           "`python -m ddpm_core.reference readme` (after `unpack`, or after replacing figures).")


def test_a_committed_gpu_figure_is_never_replaced_by_a_cpu_one():
    """`make run` on a CPU rewrites every figure in figures/, 00 and 01 included: the reference GPU run's copies must
    come back (`git checkout figures/<name>`, or `reference unpack`) before a commit, and the README's sentence would
    otherwise credit them to the CPU without a word."""
    figures = series.REPO_ROOT / "figures"
    copies: dict[str, set[str]] = {}
    for folder in reference.reference_runs(reference.REFERENCE_DIR):
        if reference.meta(folder).get("mode") == "full":
            for png in (folder / "figures").glob("*.png"):
                copies.setdefault(png.name, set()).add(reference._sha1(png))
    replaced = [name for name, digests in copies.items()
                if (figures / name).exists() and reference._sha1(figures / name) not in digests]
    assert not replaced, (f"figures/ holds other copies of {replaced} than the reference GPU run committed. Fix: "
                          "git checkout those files (or `python -m ddpm_core.reference unpack` the run again).")


def test_the_readme_says_where_the_last_stage_gpu_time_goes_from_the_committed_trace(tmp_path):
    """The README's status block ends with 09's last stage read from its committed H200 trace (kernel kinds, idle);
    a reference without that trace adds nothing."""
    from ddpm_core import reference

    line = reference.last_stage_trace_markdown(reference.REFERENCE_DIR / "h200")
    assert "copies and layout changes" in line and "convolution (cuDNN)" in line and "idle" in line
    assert line in (reference.REPO_ROOT / "README.md").read_text()
    assert reference.last_stage_trace_markdown(tmp_path) == ""


def test_status_names_done_parts_whose_notebooks_changed_since_they_ran():
    """The H200's nb-09 and nb-03b ran at 12a70f1; both notebooks changed after reading their output, so their
    executed copies show older text: `reference status` says so, with the command that redoes them."""
    import subprocess

    from ddpm_core import reference

    if subprocess.run(["git", "cat-file", "-e", "12a70f1^{commit}"], cwd=reference.REPO_ROOT).returncode != 0:
        pytest.skip("a shallow clone: the commit the H200 parts ran at is not here")
    lines = reference.changed_since_run()
    assert any(line.startswith("h200: nb-09 ran at `12a70f1`") and "FORCE=1 bash scripts/gpu_call.sh --detach nb-09" in line
               for line in lines), lines
    assert not any(": meta " in line for line in lines)  # a part without notebooks is never named


def test_next_redoes_a_done_part_whose_notebook_changed_after_every_part_not_run(tmp_path, monkeypatch, capsys):
    """A part records the sha1 of the code cells of each notebook it ran; once every part is done, `next` redoes the
    parts whose notebooks' code changed since (their executed copies show older output), and only those. A change to
    the markdown alone redoes nothing. No git needed."""
    from ddpm_core.series import NOTEBOOKS_DIR

    ran = []

    def fake(out, smoke, prefixes, only, keep_going=False):
        part = next(p for p, pre in reference.NOTEBOOK_PARTS.items() if pre == prefixes)
        ran.append(part)
        names = [nb.stem for nb in sorted(NOTEBOOKS_DIR.glob("*.ipynb")) if nb.stem.split("_")[0] in prefixes]
        return {"notebooks": {n: 1.0 for n in names}}

    monkeypatch.setattr(reference, "_part_notebooks", fake)
    monkeypatch.setattr(reference, "_part_gpu_tests", lambda out, smoke, part="gpu-tests": {})
    monkeypatch.setattr(reference, "_part_meta", lambda out, smoke: (out / "meta.json").write_text(json.dumps(
        {"device_name": "NVIDIA H200", "mode": "full"})) and None)
    monkeypatch.setattr(reference, "_skip_reason", lambda part, smoke: None)
    monkeypatch.delenv(reference.DEADLINE_ENV, raising=False)
    out = tmp_path / "h200"
    reference.run(out, smoke=False, parts=["next"])  # every part, once
    status = json.loads((out / "parts.json").read_text())
    assert status["nb-09"]["code_sha1"] == {"09_putting_it_together": reference.notebook_code_sha1("09_putting_it_together")}
    assert reference.stale_parts(status) == []
    status["nb-09"]["code_sha1"]["09_putting_it_together"] = "0" * 40  # as if 09's code had changed since it ran
    (out / "parts.json").write_text(json.dumps(status))
    ran.clear()
    capsys.readouterr()
    reference.run(out, smoke=False, parts=["next"])
    assert ran == ["nb-09"]
    assert "next: nb-09 (nb-09: done, but its notebook's code changed since)" in capsys.readouterr().out
    assert reference.stale_parts(json.loads((out / "parts.json").read_text())) == []  # recorded anew


def test_code_sha1_ignores_markdown_and_outputs_but_not_code():
    """What makes a part stale is its notebook's code: an edited markdown cell, or outputs, leave the hash as it was;
    an edited code cell, or a code cell moved, change it."""
    def nb(cells):
        return json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5})

    md = {"cell_type": "markdown", "metadata": {}, "source": ["Some text\n"]}
    a = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": ["x = 1\n", "print(x)"]}
    b = {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": "y = 2"}
    base = reference.code_sha1(nb([md, a, b]))
    assert reference.code_sha1(nb([{**md, "source": ["Other text"]}, a, b])) == base
    assert reference.code_sha1(nb([md, {**a, "outputs": [{"output_type": "stream", "name": "stdout", "text": "1"}],
                                        "execution_count": 3}, b])) == base
    assert reference.code_sha1(nb([md, {**a, "source": "x = 1\nprint(x)"}, b])) == base  # list or string source
    assert reference.code_sha1(nb([md, {**a, "source": ["x = 2\n", "print(x)"]}, b])) != base
    assert reference.code_sha1(nb([md, b, a])) != base


def test_last_stage_kinds_reads_the_newest_reference_run_that_has_the_trace(tmp_path):
    """09b's "Two suspects" reads its shares from here: the H200's committed trace of 09's last stage (the H100's
    reference has none), and None where no reference run has that trace."""
    from ddpm_core import reference

    folder, kinds = reference.last_stage_kinds()
    assert folder.name == "h200"
    share = dict(zip(kinds["kernel_type"], kinds["percentage"]))
    assert 10 < share["copies and layout changes"] < 25 and 35 < share["fused elementwise / norm (Triton)"] < 60
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "meta.json").write_text('{"device_name": "NVIDIA H100 80GB HBM3", "date": "2030-01-01"}')
    assert reference.last_stage_kinds(tmp_path) is None


def test_peak_gib_reads_one_row_of_a_reference_run():
    """03b sets its batch-size estimate beside the peak the H200 measured for the same configuration."""
    from ddpm_core import reference

    got, kind = reference.peak_gib(reference.REFERENCE_DIR / "h200", "03b_memory", "no checkpointing", 128, "fp32")
    assert 8.0 < got < 8.7 and kind.startswith("peak allocated, CUDA")
    assert reference.peak_gib(reference.REFERENCE_DIR / "h200", "03b_memory", "no checkpointing", 64, "fp32") is None
    assert reference.peak_gib(reference.REFERENCE_DIR / "h100-80gb-hbm3", "03b_memory", "no checkpointing", 128, "fp32") is None


def test_a_runs_figures_go_to_the_committed_ones_only_on_purpose_and_never_over_a_gpu_runs(tmp_path, monkeypatch):
    """Runs write to data/figures/ (git-ignored), not to the committed figures/; `reference figures` copies a run's
    figures there, except those a full reference GPU run made, which change only through unpack."""
    from ddpm_core import paths, plots

    monkeypatch.delenv("DDPM_FIGURES_DIR")
    monkeypatch.setenv("DDPM_DATA_DIR", str(tmp_path / "data"))
    assert paths.figures_dir() == tmp_path / "data" / "figures" != paths.committed_figures_dir()
    committed, root = tmp_path / "committed", tmp_path / "reference"
    monkeypatch.setenv("DDPM_COMMITTED_FIGURES_DIR", str(committed))
    run = root / "h200"
    (run / "figures").mkdir(parents=True)
    (run / "meta.json").write_text(json.dumps({"device_name": "NVIDIA H200", "mode": "full", "torch_version": "2.11"}))
    declared = {nb.stem.split("_")[0]: series.declared_figures(nb) for nb in NOTEBOOKS}
    gpu_name = declared["00"][0]
    committed.mkdir()
    gpu_png = plots.savefig(plots.plt.figure(), run / "figures" / gpu_name, source="NVIDIA H200 · torch 2.11", mode="full")
    (committed / gpu_name).write_bytes(gpu_png.read_bytes())  # as unpack copies it
    fig = plots.plt.figure()
    for names in declared.values():
        for name in names[1:] if names[0] == gpu_name else names:
            plots.savefig(fig, name)  # the run's, into data/figures/
    plots.savefig(fig, gpu_name)
    assert not list(committed.glob("*.png"))[1:]  # the run wrote nothing into the committed folder
    done = reference.gallery(root=root)
    assert done["kept"] == [gpu_name] and (committed / gpu_name).read_bytes() == gpu_png.read_bytes()
    assert sorted(done["copied"]) == sorted(n for names in declared.values() for n in names if n != gpu_name)
    assert done["missing"] == []
    with pytest.raises(ValueError, match="same folder"):
        reference.gallery(committed, committed, root=root)
