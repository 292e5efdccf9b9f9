"""The install files and the README agree with each other and with the Makefile."""

import re
import tomllib
from pathlib import Path

import yaml

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
