"""Shared fixtures. Tests never touch the repo's data/ or figures/: both point at temp folders."""

from __future__ import annotations

import os
import time

# Two OpenMP threads that spin while they wait (the default) stall when another busy process holds one of the 2 cores:
# at every operator's barrier they wait for a thread that is not running. The smoke reference run goes on beside the
# other tests (``_smoke_reference_run``), so this process, the run and every process they start wait passively
# instead: read by the OpenMP runtime when torch loads, so set before the import below. Measured with notebook 01 in
# smoke mode on 2 cores: 68 s alone; 194 s beside a 2-thread neighbour with spinning threads; 71 s alone and 85 s
# beside that neighbour with passive ones.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(autouse=True)
def _isolated_dirs(monkeypatch, data_root, tmp_path_factory):
    monkeypatch.setenv("DDPM_DATA_DIR", data_root)
    monkeypatch.setenv("DDPM_FIGURES_DIR", str(tmp_path_factory.getbasetemp() / "figures"))
    monkeypatch.setenv("DDPM_COMMITTED_FIGURES_DIR", str(tmp_path_factory.getbasetemp() / "committed-figures"))


@pytest.fixture(scope="session")
def synthetic_folder(data_root):
    from ddpm_core.data import make_synthetic

    return make_synthetic(data_root, n=256, seed=0, progress=False)


@pytest.fixture(scope="session")
def synthetic_batch(synthetic_folder) -> torch.Tensor:
    """16 synthetic images in [-1, 1]."""
    from ddpm_core.data import FolderImages, normalize

    ds = FolderImages(synthetic_folder)
    return normalize(torch.stack([ds[i] for i in range(16)]))


def _uses_smoke_reference(item) -> bool:
    return "smoke_reference" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items):
    """The tests that read the smoke reference run last: the run itself starts in the background before the first
    test (``_smoke_reference_run``), so the rest of the suite runs beside it instead of waiting for it."""
    items.sort(key=_uses_smoke_reference)  # stable: the order within each group is kept


SMOKE_REFERENCE_JOBS = 2
SMOKE_REFERENCE_TIMEOUT_S = 2700  # ~17 min alone on 2 CPU cores, one part at a time; 19 min two at a time beside the tests


@pytest.fixture(scope="session", autouse=True)
def _smoke_reference_run(request, tmp_path_factory):
    """Start ``python -m ddpm_core.reference run --smoke`` in the background at the start of the session, when a selected
    test needs it, so that the 17-19 minutes it takes on 2 cores overlap the rest of the suite. Its notebooks see the
    tests' work beside them, and their comparisons say so (too noisy to state a ratio): the run checks that the series
    runs and that its text follows its numbers, not what this machine measures. Its log goes to a file;
    ``smoke_reference`` waits for it. It gets a data folder of its own (it writes the 10,000-image synthetic set there)
    and a process group of its own, which is stopped if the session ends first."""
    import signal
    import subprocess
    import sys

    if os.environ.get("DDPM_TEST_SMOKE_REFERENCE") or not any(_uses_smoke_reference(i) for i in request.session.items):
        yield None
        return
    root = tmp_path_factory.mktemp("reference")
    env = {**os.environ, "DDPM_DATA_DIR": str(root / "data"), "DDPM_FIGURES_DIR": str(root / "ignored-figures"),
           "DDPM_COMMITTED_FIGURES_DIR": str(root / "ignored-committed-figures"),
           "PYTHONUNBUFFERED": "1"}
    log = open(root / "run.log", "w+")
    # two notebook parts at a time: one alone keeps about 1.25 of 2 cores busy, and once the other tests are done
    # (about 14 minutes in) a lone part left most of a core idle for the rest of the run
    proc = subprocess.Popen([sys.executable, "-m", "ddpm_core.reference", "run", "--smoke", "--jobs", str(SMOKE_REFERENCE_JOBS),
                             "--out", str(root / "cpu-smoke")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started = time.perf_counter()
    yield proc, root, env, log, started
    if proc.poll() is None:  # the session ended before the run did (a failure, ^C, -x): stop it and its notebooks
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    log.close()


@pytest.fixture(scope="session")
def smoke_reference(_smoke_reference_run, data_root):
    """The whole series, run once per test session in smoke mode through ``python -m ddpm_core.reference run``: the
    notebooks' smoke test and the reference command's test (test_reference.py); the browser's layout check reads
    its executed notebooks (test_browser.py). Returns (folder, output, seconds, environment). The run started in the
    background when the session did (``_smoke_reference_run``); this waits for it to end.

    For development only: ``DDPM_TEST_SMOKE_REFERENCE=<a cpu-smoke folder>`` (one a run of this fixture left under
    pytest's temporary folders, with a notebook swapped for a freshly executed copy) reuses it instead of running the
    series again, so that e.g. the browser's layout check of one changed notebook takes a minute, not fifteen. The
    tests that check the run itself (its log and timing) then see an empty log. CI never sets it."""
    import subprocess

    if os.environ.get("DDPM_TEST_SMOKE_REFERENCE"):
        from pathlib import Path

        folder = Path(os.environ["DDPM_TEST_SMOKE_REFERENCE"])
        if not (folder / "parts.json").exists():
            raise FileNotFoundError(f"DDPM_TEST_SMOKE_REFERENCE={folder} holds no parts.json: point it at a cpu-smoke "
                                    "folder a smoke reference run wrote, or unset it")
        return folder, "", 0.0, {**os.environ, "DDPM_DATA_DIR": data_root}
    proc, root, env, log, started = _smoke_reference_run
    try:
        proc.wait(timeout=max(1.0, SMOKE_REFERENCE_TIMEOUT_S - (time.perf_counter() - started)))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the smoke reference run took over {SMOKE_REFERENCE_TIMEOUT_S} s; its log: {root / 'run.log'}")
    log.seek(0)
    output = log.read()
    assert proc.returncode == 0, output[-6000:]
    return root / "cpu-smoke", output, time.perf_counter() - started, env
