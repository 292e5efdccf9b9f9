"""The grader and the student copies: what an instructor runs."""

from __future__ import annotations

import json

import nbformat
import pytest

from ddpm_core import grade, results, series, student


def _good_run(tmp_path, notebook="03b_memory"):
    res, figs = tmp_path / "results", tmp_path / "figures"
    rows = [{"variant": v, "median_ms": 10.0, "images_per_s": 800.0, "device_name": "CPU (test)"}
            for v in ("no checkpointing", "activation checkpointing")]
    results.append(notebook, rows, path=res / f"{notebook}.csv")
    figs.mkdir()
    for name in series.declared_figures(series.NOTEBOOKS_DIR / f"{notebook}.ipynb"):
        (figs / name).write_bytes(b"png")
    return res, figs


def test_a_complete_run_passes(tmp_path, capsys):
    res, figs = _good_run(tmp_path)
    assert grade.main(["03b", "--results", str(res), "--figures", str(figs)]) == 0
    out = capsys.readouterr().out
    assert "03b_memory: complete" in out and "row 'activation checkpointing' on CPU (test)" in out


def test_a_broken_run_names_each_missing_piece(tmp_path, capsys):
    res, figs = _good_run(tmp_path)
    df = results.load(res / "03b_memory.csv")
    df = df[df["variant"] != "activation checkpointing"]
    df.loc[:, "device_name"] = ""
    df.to_csv(res / "03b_memory.csv", index=False)
    (figs / "03b_memory_budget.png").unlink()
    assert grade.main(["03b_memory", "--results", str(res), "--figures", str(figs)]) == 1
    out = capsys.readouterr().out
    assert "no row whose variant matches '^activation checkpointing$'" in out
    assert "the step with activation checkpointing (section 4) is not in 03b_memory.csv" in out  # in plain words
    assert "row 'no checkpointing' has no device_name" in out
    assert "03b_memory_budget.png was not written (the cell that saves it is cell" in out and 'in section "' in out


def test_a_sweep_of_one_batch_size_is_told_it_needs_two_and_a_missing_file_names_its_writers(tmp_path, capsys):
    res, figs = tmp_path / "results", tmp_path / "figures"
    results.append("03_batch_size", [{"variant": "batch 4", "median_ms": 10.0, "images_per_s": 400.0,
                                      "device_name": "CPU (test)"}], path=res / "03_batch_size.csv")
    assert grade.main(["03", "--results", str(res), "--figures", str(figs)]) == 1
    out = capsys.readouterr().out
    assert "a second batch size: the sweep needs at least two" in out and "other than the rows already counted" in out
    assert grade.main(["02", "--results", str(res), "--figures", str(figs)]) == 1
    assert "run the notebook to the end (its Summary and section 7 write the rows)" in capsys.readouterr().out


def test_an_unlabelled_row_that_no_pattern_names_is_reported(tmp_path, capsys):
    res, figs = _good_run(tmp_path)
    results.append("03b_memory", [{"variant": "an optional extra", "median_ms": 5.0, "images_per_s": 9.0}],
                   path=res / "03b_memory.csv")
    df = results.load(res / "03b_memory.csv")
    df.loc[df["variant"] == "an optional extra", "device_name"] = ""
    df.to_csv(res / "03b_memory.csv", index=False)
    assert grade.main(["03b", "--results", str(res), "--figures", str(figs)]) == 1
    out = capsys.readouterr().out
    assert "1 other row without a device or torch version (first: 'an optional extra')" in out
    df.loc[df["variant"] == "an optional extra", "device_name"] = "CPU (test)"
    df.to_csv(res / "03b_memory.csv", index=False)
    assert grade.main(["03b", "--results", str(res), "--figures", str(figs)]) == 0
    assert "1 other row, each labelled with its device and torch version" in capsys.readouterr().out


def test_a_gpu_run_owes_the_figures_only_a_gpu_draws(tmp_path, capsys):
    res, figs = _good_run(tmp_path)  # a CPU run: 03b's allocator timeline is not due
    assert "03b_gpu_timeline.png" in series.declared_figures(series.NOTEBOOKS_DIR / "03b_memory.ipynb", gpu=True)
    assert grade.main(["03b", "--results", str(res), "--figures", str(figs)]) == 0
    capsys.readouterr()
    df = results.load(res / "03b_memory.csv")
    df.loc[:, "device_name"] = "NVIDIA H200"
    df.to_csv(res / "03b_memory.csv", index=False)
    assert grade.main(["03b", "--results", str(res), "--figures", str(figs)]) == 1
    assert "03b_gpu_timeline.png was not written" in capsys.readouterr().out
    (figs / "03b_gpu_timeline.png").write_bytes(b"png")
    assert grade.main(["03b", "--results", str(res), "--figures", str(figs)]) == 0


def test_since_excludes_an_earlier_run_and_an_executed_error_is_reported(tmp_path, capsys):
    res, figs = _good_run(tmp_path)
    book = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1/0")])
    book.cells[0].outputs = [nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="division by zero", traceback=[])]
    executed = tmp_path / "03b_memory.ipynb"
    executed.write_text(json.dumps(book))
    assert grade.main(["03b", "--results", str(res), "--figures", str(figs), "--since", "2999-01-01T00:00:00",
                       "--executed", str(executed)]) == 1
    out = capsys.readouterr().out
    assert "since 2999-01-01" in out and "older than 2999-01-01" in out and "ZeroDivisionError" in out
    assert "the first: cell 0, ZeroDivisionError, in the cell that begins '1/0'" in out
    # two notebooks, one executed copy each: an error is reported under its own notebook only
    other = tmp_path / "03_batch_size.ipynb"
    other.write_text(json.dumps(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])))
    grade.main(["03b", "03", "--results", str(res), "--figures", str(figs), "--executed", str(executed), str(other)])
    out = capsys.readouterr().out
    mine, theirs = out.split("03_batch_size:")[0], out.split("03_batch_size:")[1]
    assert "ZeroDivisionError" in mine and "ZeroDivisionError" not in theirs and "03_batch_size.ipynb: no errors" in theirs
    grade.main(["03b", "03", "--results", str(res), "--figures", str(figs), "--executed", str(executed)])
    assert "none of the copies given is 03_batch_size's (its file name starts with '03_')" in capsys.readouterr().out


def test_an_unknown_notebook_is_a_clear_error(capsys):
    assert grade.main(["42"]) == 2
    assert "no single notebook is '42'; give one of: 00_setup" in capsys.readouterr().err


def test_every_measuring_notebook_has_expectations():
    stems = {nb.stem for nb in series.list_notebooks()}
    assert set(grade.EXPECTED) <= stems
    assert stems - set(grade.EXPECTED) == {"00_setup", "01_build_the_ddpm"}


def test_student_copies_drop_the_solutions_and_the_outputs(tmp_path):
    with_solutions = [nb for nb in series.list_notebooks()
                      if any(student.SOLUTION_TAG in c.metadata.get("tags", []) for c in nbformat.read(nb, 4).cells)]
    assert len(with_solutions) >= 2
    assert student.main(["--out", str(tmp_path / "student")]) == 0
    for nb in series.list_notebooks():
        orig, copy = nbformat.read(nb, 4), nbformat.read(tmp_path / "student" / nb.name, 4)
        kept = [c.source for c in orig.cells if student.SOLUTION_TAG not in c.metadata.get("tags", [])]
        assert [c.source for c in copy.cells] == kept
        assert all(not c.get("outputs") for c in copy.cells if c.cell_type == "code")
    assert student.main(["--out", str(series.NOTEBOOKS_DIR)]) == 2  # never over the notebooks themselves


@pytest.mark.parametrize("nb", series.list_notebooks(), ids=lambda p: p.stem)
def test_solutions_come_after_the_exercises(nb):
    cells = nbformat.read(nb, 4).cells
    sol = [i for i, c in enumerate(cells) if student.SOLUTION_TAG in c.metadata.get("tags", [])]
    if sol:
        ex = next(i for i, c in enumerate(cells) if "## Exercises" in c.source)
        assert min(sol) > ex


def test_the_students_edition_is_the_committed_tree_without_any_solution(tmp_path, capsys):
    import subprocess

    from ddpm_core import hosted
    from ddpm_core.paths import REPO_ROOT

    if not (REPO_ROOT / ".git").exists():
        pytest.skip(f"{REPO_ROOT} is not a git checkout: the students' edition is made from its committed tree")
    url = "https://example.org/course/ddpm-student.git"
    dest = tmp_path / "edition"
    assert student.main(["--repo", str(dest), "--url", url]) == 0
    assert "students' edition of the committed tree" in capsys.readouterr().out
    committed = set(subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files"], capture_output=True, text=True,
                                   check=True).stdout.split())
    made = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()}
    assert made == {f for f in committed if not f.startswith(student.NOT_IN_STUDENT_REPO)}
    for nb in sorted((dest / "notebooks").glob("*.ipynb")) + sorted((dest / "data" / "reference").glob("*/notebooks/*.ipynb")):
        cells = nbformat.read(nb, 4).cells
        assert not [c for c in cells if student.SOLUTION_TAG in c.metadata.get("tags", [])], nb
        assert "## Exercises" in "".join(c.source for c in cells if c.cell_type == "markdown") or "reference" in nb.parts
    for nb in sorted((dest / "data" / "reference").glob("*/notebooks/*.ipynb")):  # the reference runs keep their outputs
        assert any(c.get("outputs") for c in nbformat.read(nb, 4).cells if c.cell_type == "code"), nb
    for nb in sorted((dest / "notebooks").glob("*.ipynb")):
        assert hosted.cells(nbformat.read(nb, 4))[0].source == hosted.cell_source(url)
    assert (dest / "README.md").read_text().startswith(student.STUDENT_NOTE)
    # a second edition into the same folder, a URL without --repo, and a bad URL are refused before anything is written
    assert student.main(["--repo", str(dest)]) == 2
    assert student.main(["--url", url]) == 2
    assert student.main(["--repo", str(tmp_path / "bad"), "--url", "not a url"]) == 2 and not (tmp_path / "bad").exists()
