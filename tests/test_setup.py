"""The install files and the README agree with each other and with the Makefile."""

import re
import sys
import tomllib
from pathlib import Path

import yaml

from ddpm_core import series

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(?:bash|sh)?\n(.*?)```", quick, re.S)


def test_environment_yml_installs_the_project_with_the_pyproject_python():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert env["channels"] == ["conda-forge"]
    deps = env["dependencies"]
    python = next(d for d in deps if isinstance(d, str) and d.startswith("python="))
    major, minor = map(int, python.split("=")[1].split(".")[:2])
    low = tuple(map(int, re.match(r">=(\d+)\.(\d+)", project["requires-python"]).groups()))
    assert (major, minor) >= low
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    assert pip == ["-c constraints.txt", '-e ".[dev]"']  # everything else comes from pyproject
    assert "pip" in deps


def test_pyproject_lists_the_series_packages_and_leaves_torch_to_pair_with_torchvision():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!\[ ]", d)[0].lower() for d in project["dependencies"]}
    assert {"torch", "torchvision", "jupyterlab", "matplotlib", "seaborn", "pandas",
            "holistictraceanalysis", "ipywidgets", "tqdm"} <= names
    torch_req = next(d for d in project["dependencies"] if d.startswith("torch") and not d.startswith("torchvision"))
    assert "==" not in torch_req  # a pinned torch could pull a CPU wheel that torchvision cannot load
    dev = {re.split(r"[<>=!\[ ]", d)[0].lower() for d in project["optional-dependencies"]["dev"]}
    assert {"pytest", "papermill"} <= dev


def test_constraints_pin_one_tested_torch_torchvision_pair_that_every_install_uses():
    pins = dict(re.findall(r"^(torch|torchvision)==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M))
    assert set(pins) == {"torch", "torchvision"}
    # torchvision 0.N pairs with torch 2.(N - 15): 0.29 <-> 2.14, 0.24 <-> 2.9
    assert int(pins["torchvision"].split(".")[1]) - 15 == int(pins["torch"].split(".")[1])
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()


def test_every_constraint_is_one_exact_version_and_the_suite_runs_on_it():
    """constraints.txt pins exact versions (with a marker where a version needs a newer Python), and the
    environment running this suite has them: what the README calls tested is what was tested."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    wrong = []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        req = Requirement(line)
        assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==", f"not one exact pin: {line}"
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            wrong.append(f"{req.name}: not installed (pinned {req.specifier})")
            continue
        if not req.specifier.contains(have, prereleases=True):
            wrong.append(f"{req.name} {have} (pinned {req.specifier})")
    assert not wrong, ("this environment is not the pinned one; fix: make setup (pip install -c constraints.txt "
                       "-e '.[dev]'):\n" + "\n".join(wrong))


def test_readme_quick_start_gives_two_commands_that_the_makefile_and_ci_use():
    blocks = _readme_commands()
    commands = [line.strip() for b in blocks for line in b.splitlines() if line.strip() and not line.startswith("#")]
    assert "make run" in commands and "make test" in commands
    makefile = (ROOT / "Makefile").read_text()
    for target in ("setup", "run", "test", "lab"):
        assert re.search(rf"^{target}:", makefile, re.M), target
    assert re.search(r"^run: \$\(STAMP\)", makefile, re.M) and re.search(r"^test: \$\(STAMP\)", makefile, re.M)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


def test_repo_layout():
    for path in ("notebooks", "ddpm_core", "data/README.md", "figures", "environment.yml", "README.md",
                 "pyproject.toml", "tests", ".ci/run", "Makefile"):
        assert (ROOT / path).exists(), path
    ignored = (ROOT / ".gitignore").read_text()
    assert "data/*" in ignored and "!data/README.md" in ignored and "!data/reference/" in ignored


def _nbstrip_command() -> str:
    makefile = (ROOT / "Makefile").read_text()
    line = next(ln for ln in makefile.splitlines() if ln.startswith("NBSTRIP"))
    return line.split(":=", 1)[1].strip().replace("$(abspath $(VENV))/bin/nbstripout", f"{sys.executable} -m nbstripout")


def test_a_notebook_run_and_saved_in_jupyterlab_leaves_git_status_clean(tmp_path):
    """What JupyterLab writes when it runs and saves a notebook (outputs, execution counts, the
    kernel's language_info) is removed by the git filter that `make setup` configures, so git sees
    the committed file. Checked with git itself: hash-object --path applies .gitattributes' filter."""
    import subprocess

    import nbformat

    assert "notebooks/*.ipynb filter=nbstripout" in (ROOT / ".gitattributes").read_text()
    src = ROOT / "notebooks" / "00_setup.ipynb"
    nb = nbformat.read(src, as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hello\n")]
    code.execution_count = 7
    nb.metadata["language_info"] = {"name": "python", "version": "3.12.3", "mimetype": "text/x-python",
                                    "codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py"}
    saved = tmp_path / "00_setup.ipynb"
    nbformat.write(nb, saved)

    def blob(path) -> str:
        return subprocess.run(["git", "-c", f"filter.nbstripout.clean={_nbstrip_command()}", "hash-object",
                               "--path=notebooks/00_setup.ipynb", str(path)], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()

    assert blob(saved) == blob(src)
    # and the committed notebooks are already what the filter makes of them (as JupyterLab writes their metadata)
    import shutil

    committed = series.list_notebooks()
    copies = []
    for nb_path in committed:
        assert nbformat.read(nb_path, as_version=4).metadata.kernelspec.display_name == "Python 3 (ipykernel)", nb_path.name
        copies.append(tmp_path / "strip" / nb_path.name)
        copies[-1].parent.mkdir(exist_ok=True)
        shutil.copy(nb_path, copies[-1])
    subprocess.run(_nbstrip_command().split() + [str(c) for c in copies], check=True)
    for nb_path, copy in zip(committed, copies):
        assert copy.read_text() == nb_path.read_text(), f"{nb_path.name} is not in the form the git filter writes"


def test_the_save_hook_clears_git_status_for_output_only_changes_and_leaves_real_ones(tmp_path):
    """git reports a notebook whose size changed as modified without running the filter; the Jupyter
    post-save hook that make setup registers (ddpm_core.lab) refreshes the index when the filtered
    notebook is unchanged, and stays away from real changes and from what the user staged."""
    import json
    import subprocess

    import nbformat

    from ddpm_core.lab import refresh_git_index

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.com"), git("config", "user.name", "t")
    git("config", "filter.nbstripout.clean", _nbstrip_command()), git("config", "filter.nbstripout.smudge", "cat")
    (tmp_path / ".gitattributes").write_text((ROOT / ".gitattributes").read_text())
    (tmp_path / "notebooks").mkdir()
    path = tmp_path / "notebooks" / "00_setup.ipynb"
    path.write_text((ROOT / "notebooks" / "00_setup.ipynb").read_text())
    git("add", "-A"), git("commit", "-qm", "start")

    nb = nbformat.read(path, as_version=4)
    code = next(c for c in nb.cells if c.cell_type == "code")
    code.outputs, code.execution_count = [nbformat.v4.new_output("stream", name="stdout", text="ran\n")], 3
    nbformat.write(nb, path)  # what a save in JupyterLab writes: the same notebook, with outputs
    assert git("status", "--porcelain") != ""  # git's size shortcut: "modified" without a look
    assert refresh_git_index(None, str(path)) is True
    assert git("status", "--porcelain") == "" and "ran" in path.read_text()  # clean, and the outputs are still on disk

    code.source += "\n# a real change"
    nbformat.write(nb, path)
    assert refresh_git_index(None, str(path)) is False
    assert git("status", "--porcelain").strip() == "M notebooks/00_setup.ipynb" and git("diff", "--cached") == ""
    assert refresh_git_index(None, str(tmp_path / "notes.txt")) is False  # not a notebook
    hook = json.loads((ROOT / "jupyter" / "jupyter_server_config.json").read_text())
    assert hook["ContentsManager"]["post_save_hook"] == "ddpm_core.lab.refresh_git_index"
    assert "cp jupyter/jupyter_server_config.json $(VENV)/etc/jupyter/" in (ROOT / "Makefile").read_text()
