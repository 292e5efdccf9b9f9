"""The notebooks are committed clean and follow the pattern; the runner fails loudly. (They are executed in\nsmoke mode by tests/test_reference.py, through the reference command.)"""

import json
import re

import nbformat
import pytest

from ddpm_core import series

NOTEBOOKS = series.list_notebooks()


def test_the_series_is_complete_and_in_order():
    names = [nb.stem for nb in NOTEBOOKS]
    assert names == ["00_setup", "01_build_the_ddpm", "02_profile_the_baseline", "03_batch_size", "03b_memory", "04_torch_compile",
                     "05_sdpa_attention", "06_mixed_precision", "07_data_loading", "08_multi_gpu",
                     "09_putting_it_together", "09b_the_fastest_step", "09c_nothing_given_up",
                     "10_optimizers_and_normalization"]


def test_the_readme_table_lists_every_notebook_and_figure():
    from ddpm_core.paths import REPO_ROOT

    readme = (REPO_ROOT / "README.md").read_text().splitlines()
    # One Markdown table: a header, its |---| rule, and one row per notebook with no blank line
    # between them (on GitHub a blank line ends the table and the rest renders as paragraphs).
    start = next(i for i, line in enumerate(readme) if line.startswith("| notebook |"))
    assert readme[start + 1].startswith("|---"), "the header must be followed by its |---| rule"
    table = []
    for line in readme[start + 2:]:
        if not line.startswith("|"):
            break
        table.append(line)
    assert len(table) == len(NOTEBOOKS), f"the notebook table ends after {len(table)} rows: a blank or non-table line inside it?"
    columns = readme[start].count("|")
    for nb, row in zip(NOTEBOOKS, table):
        assert f"(notebooks/{nb.name})" in row, (nb.name, row[:80])
        assert row.count("|") - row.count("\\|") == columns, f"{nb.name}: row has a different number of cells than the header"
        for fig in series.declared_figures(nb):
            assert fig in row, fig


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_clean_and_follows_the_pattern(nb):
    book = nbformat.read(nb, as_version=4)
    nbformat.validate(book)
    code = [c for c in book.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit notebooks without outputs"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and 'SMOKE = os.environ.get("DDPM_SMOKE") == "1"' in params[0].source
    first = book.cells[0].source
    assert first.startswith("# ") and "What you will learn" in first and "Run time" in first and "Figures" in first
    assert "**Read more:** [" in first and "](https://" in first  # the docs and papers it relies on
    assert "env.show()" in "".join(c.source for c in code)  # the environment cell
    text = "\n".join(c.source for c in book.cells)
    for heading in ("## Summary", "## Takeaways", "## Exercises", "**Next:**"):
        assert heading in text, heading
    prefix = nb.name.split("_")[0]  # "03", "03b"
    figures = series.declared_figures(nb)
    assert figures and all(f.startswith(prefix + "_") and f in text for f in figures)


# Every notebook runs in smoke mode once per test session, through the reference command:
# tests/test_reference.py checks that each one ran and wrote the figures it declares.


def _notebook(tmp_path, source: str, figures: list[str]):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "ddpm": {"figures": figures}}
    path = tmp_path / "99_probe.ipynb"
    nbformat.write(nb, path)
    return path


def test_the_harness_fails_a_notebook_whose_cell_raises(tmp_path):
    nb = _notebook(tmp_path, "raise RuntimeError('broken on purpose')", [])
    with pytest.raises(series.NotebookFailed, match=r"99_probe.ipynb: cell 1 raised RuntimeError: broken on purpose"):
        series.run_notebook(nb, tmp_path / "out", smoke=True, figures=tmp_path / "figs")


def test_the_harness_fails_a_notebook_that_skips_a_declared_figure(tmp_path):
    src = ("import os, pathlib\n"
           "d = pathlib.Path(os.environ['DDPM_FIGURES_DIR']); d.mkdir(parents=True, exist_ok=True)\n"
           "(d / '99_made.png').write_bytes(b'png')")
    nb = _notebook(tmp_path, src, ["99_made.png", "99_forgotten.png"])
    with pytest.raises(series.NotebookFailed, match=r"did not write .*: 99_forgotten.png$"):
        series.run_notebook(nb, tmp_path / "out", smoke=True, figures=tmp_path / "figs")
    (tmp_path / "figs" / "99_forgotten.png").write_bytes(b"stale")  # an old file does not count either
    with pytest.raises(series.NotebookFailed, match="99_forgotten.png"):
        series.run_notebook(nb, tmp_path / "out", smoke=True, figures=tmp_path / "figs")
    assert json.loads((tmp_path / "out" / "99_probe.ipynb").read_text())["cells"]


def test_the_executed_copy_embeds_its_figures_even_where_the_caller_chose_agg(tmp_path, monkeypatch):
    """The H100 reference run exported MPLBACKEND=Agg, and its executed notebooks held no figure at all."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    src = "import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4])\nplt.show()"
    series.run_notebook(_notebook(tmp_path, src, []), tmp_path / "out", smoke=True, figures=tmp_path / "figs")
    out = json.loads((tmp_path / "out" / "99_probe.ipynb").read_text())
    assert any("image/png" in o.get("data", {}) for c in out["cells"] for o in c.get("outputs", []))


def test_a_headless_run_tells_the_kernel_so_and_00_leaves_its_live_slider_out(tmp_path):
    """A widget that captures output (00's interact slider) sometimes left papermill waiting forever for
    the cell to end, with the kernel idle (seen in CI; nbclient#312): headless runs leave it out."""
    src = "import os\nprint('headless:', os.environ.get('DDPM_HEADLESS'))"
    series.run_notebook(_notebook(tmp_path, src, []), tmp_path / "out", smoke=True, figures=tmp_path / "figs")
    out = json.loads((tmp_path / "out" / "99_probe.ipynb").read_text())
    assert "headless: 1" in "".join("".join(o.get("text", "")) for c in out["cells"] for o in c.get("outputs", []))
    code = _code("00_setup")
    assert 'if os.environ.get("DDPM_HEADLESS") == "1":' in code and "widgets.interact(" in code.split("DDPM_HEADLESS")[1]


# ------------------------------------------------------------------------------ full mode fits any single GPU
def _code(stem: str) -> str:
    nb = next(n for n in NOTEBOOKS if n.stem == stem)
    return "\n".join(c.source for c in nbformat.read(nb, as_version=4).cells if c.cell_type == "code")


def test_no_full_mode_batch_is_sized_for_one_80gb_gpu():
    """09 had BIG_BATCH = 1024 in fp32 with math attention: ~50 GiB of activations, a crash below 80 GB."""
    import re

    for nb in NOTEBOOKS:
        book = nbformat.read(nb, as_version=4)
        params = next(c.source for c in book.cells if "parameters" in c.metadata.get("tags", []))
        for name, full in re.findall(r"^(\w*BATCH\w*) = .* if SMOKE else (\d+)", params, re.M):
            assert int(full) <= 256, f"{nb.name}: {name} = {full} in full mode does not fit a 16 GB GPU in fp32"
    assert "bench.largest_batch(" in _code("09_putting_it_together")


def test_each_compile_mode_compiles_in_a_cell_of_its_own():
    """04 compiled default, reduce-overhead and max-autotune in one cell: past papermill's per-cell timeout."""
    book = nbformat.read(next(n for n in NOTEBOOKS if n.stem == "04_torch_compile"), as_version=4)
    calls = [c.source for c in book.cells if c.cell_type == "code" and "compile_and_measure(\"" in c.source]
    assert len(calls) == 3 and all(c.count("compile_and_measure(") == 1 for c in calls)


def test_notebooks_write_runs_under_the_runs_dir_not_relative_paths():
    """HTA prefixes relative paths with /tmp/trace; and the reference run collects traces from runs_dir()."""
    for nb in NOTEBOOKS:
        assert "../runs" not in _code(nb.stem), nb.name


def test_the_readme_and_each_notebook_state_the_same_measured_smoke_run_time():
    import re

    from ddpm_core.paths import REPO_ROOT

    rows = {line.split("](notebooks/")[1].split(")")[0]: line for line in (REPO_ROOT / "README.md").read_text().splitlines()
            if line.startswith("| [") and "](notebooks/" in line}
    for nb in NOTEBOOKS:
        first = nbformat.read(nb, as_version=4).cells[0].source
        said = re.search(r"\*\*Run time:\*\* (?:about )?(([\d.]+)(?:-([\d.]+))? (?:s|min)) in smoke mode on a 2-core CPU "
                         r"\(measured[^)]*?(?:: ([\d.]+) s on [^,]+, ([\d.]+) s on [^)]+)?\)", first)
        assert said, f"{nb.name}: the Run time line must state the measured smoke time"
        readme_cell = rows[nb.name].rstrip(" |").rsplit("|", 1)[1].strip()
        assert readme_cell.lstrip("~") == said.group(1), (nb.name, readme_cell, said.group(1))
        if said.group(3):  # a range over the CPUs it was measured on: its ends are those CPUs' times
            assert sorted(float(v) for v in said.group(4, 5)) == [float(said.group(2)), float(said.group(3))], said.group(0)


def test_the_lab_plan_times_each_session_as_the_sum_of_its_notebooks_run_times():
    from ddpm_core.paths import REPO_ROOT

    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    times = {}  # notebook prefix -> (low, high) seconds, from the notebook table
    for line in lines:
        if line.startswith("| [") and "](notebooks/" in line:
            prefix = line.split("](notebooks/")[1].split("_")[0]
            low, _, high = line.rstrip(" |").rsplit("|", 1)[1].strip().lstrip("~").removesuffix(" s").partition("-")
            times[prefix] = (float(low), float(high or low))
    start = lines.index("| session | notebooks | what students leave with | smoke run time (2-core CPU) |")
    sessions = [line for line in lines[start + 2:start + 6]]
    assert len(sessions) == 4 and all(line.startswith(f"| {i} |") for i, line in enumerate(sessions, 1))
    for line in sessions:
        cells = [c.strip() for c in line.strip("|").split("|")]
        nbs = [n.strip() for n in cells[1].split("(")[0].split(",")]  # "(10 as reading)" is not run in the session
        low, high = (sum(times[n][k] for n in nbs) for k in (0, 1))
        assert cells[3] == f"{low:.0f}-{high:.0f} s", (cells[1], cells[3], low, high)


def test_a_notebook_number_selects_exactly_that_notebook():
    assert [nb.stem for nb in series.select(["03"])] == ["03_batch_size"]  # not 03b too (make notebook NB=03)
    assert [nb.stem for nb in series.select(["03b", "04_torch"])] == ["03b_memory", "04_torch_compile"]
    assert series.select([]) == NOTEBOOKS


def test_executed_copies_show_progress_bars_finished_not_at_zero(tmp_path):
    """tqdm bars are widgets; their plain-text copy (GitHub, terminals) is rebuilt from the final state."""
    nb = _notebook(tmp_path, "from tqdm.auto import tqdm\nfor _ in tqdm(range(7), desc='work'):\n    pass\n"
                   "for _ in tqdm(range(3), desc='hidden', leave=False):\n    pass", [])
    run = series.run_notebook(nb, tmp_path / "out", smoke=True, figures=tmp_path / "figs")
    texts = [o["data"]["text/plain"] for o in nbformat.read(run.executed, 4).cells[0].outputs if "data" in o]
    # the leave=False bar is hidden by JupyterLab when it ends (its text is its last refresh): gone here too
    assert len(texts) == 1 and "100%" in texts[0] and "7/7" in texts[0] and "|##########|" in texts[0], texts


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_exercise_has_a_worked_solution_that_student_copies_drop(nb, tmp_path):
    """Each numbered exercise has a "**Exercise N.**" cell and code, all tagged ``solution`` and after the
    exercises; no exercise asks to edit the package; make student drops exactly the solution cells."""
    import re

    from ddpm_core.student import SOLUTION_TAG, strip_solutions

    book = nbformat.read(nb, as_version=4)
    at = next(i for i, c in enumerate(book.cells) if c.cell_type == "markdown" and "## Exercises" in c.source)
    listing = book.cells[at].source.split("## Exercises", 1)[1].split("**Next:**")[0]
    numbers = [int(n) for n in re.findall(r"^(\d+)\. ", listing, flags=re.M)]
    assert numbers == list(range(1, len(numbers) + 1)) and numbers, listing
    assert "ddpm_core/" not in listing, "an exercise asks to edit the package: give it a TrainConfig field or argument"
    solutions = [(i, c) for i, c in enumerate(book.cells) if SOLUTION_TAG in c.metadata.get("tags", [])]
    assert all(i > at for i, _ in solutions), "solution cells go after the exercises"
    for n in numbers:
        where = [i for i, c in solutions if c.cell_type == "markdown" and c.source.lstrip().startswith(f"**Exercise {n}.**")
                 or c.cell_type == "markdown" and f"\n**Exercise {n}.**" in c.source]
        assert where, f"Exercise {n} has no solution cell starting with '**Exercise {n}.**' tagged {SOLUTION_TAG!r}"
        after = [c for i, c in solutions if i > where[0]]
        assert after and after[0].cell_type == "code", f"Exercise {n}: its solution has no code cell right after it"
    out, removed = strip_solutions(nb, tmp_path / nb.name)
    assert removed == len(solutions)
    assert not [c for c in nbformat.read(out, 4).cells if SOLUTION_TAG in c.metadata.get("tags", [])]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_code_cell_compiles(nb):
    """A syntax error (a quote escaped once too often in a rendered sentence) fails here in milliseconds,
    not ten minutes into the smoke run."""
    book = nbformat.read(nb, as_version=4)
    for i, cell in enumerate(book.cells):
        if cell.cell_type == "code":
            source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
            compile(source, f"{nb.name}, cell {i}", "exec")


def test_rendered_counts_agree_with_their_nouns():
    """Sentences say "1 call" and "3 calls", never "call(s)": env.plural (ddpm_core.text, torch-free for the tools
    that run before torch is installed)."""
    from ddpm_core import env, text

    assert env.plural is text.plural
    assert [text.plural(n, "call") for n in (0, 1, 2)] == ["0 calls", "1 call", "2 calls"]
    assert text.plural(1, "batch", "batches") == "1 batch" and text.plural(4, "batch", "batches") == "4 batches"
    rendered = re.compile(r"\{[^{}]*\}\s*[A-Za-z-]+\(s\)")  # an f-string count followed by "word(s)"
    for nb in NOTEBOOKS:
        code = "\n".join(c.source for c in nbformat.read(nb, as_version=4).cells if c.cell_type == "code")
        assert not rendered.search(code), (nb.name, rendered.search(code).group(0))


def test_each_next_link_opens_the_notebook_after_it():
    """09b's quality section became a notebook of its own (09c): every "Next" link follows the series' order, and the
    last notebook's leads back to the start."""
    for nb, after in zip(NOTEBOOKS, NOTEBOOKS[1:] + NOTEBOOKS[:1]):
        text = "\n".join(c.source for c in nbformat.read(nb, as_version=4).cells if c.cell_type == "markdown")
        link = re.search(r"\*\*Next:\*\*[^\n]*?\]\(([^)]+\.ipynb)\)", text)
        assert link and link.group(1) == after.name, (nb.name, link and link.group(0))
