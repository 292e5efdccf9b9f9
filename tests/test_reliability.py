"""Nothing hangs and nothing is lost: network stalls, concurrent downloads."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from ddpm_core import data


@pytest.fixture
def silent_server():
    """A server on 127.0.0.1 that accepts connections and never answers (a stalled proxy)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield srv.getsockname()[1]
    stop.set()
    thread.join()
    for c in held:
        c.close()
    srv.close()


def test_a_download_host_that_accepts_and_never_answers_times_out_with_a_clear_error(silent_server, tmp_path, monkeypatch):
    from torchvision.datasets import CIFAR10

    monkeypatch.setattr(CIFAR10, "url", f"http://127.0.0.1:{silent_server}/cifar-10-python.tar.gz")
    monkeypatch.setattr(data, "CIFAR10_HOST", ("127.0.0.1", silent_server))
    monkeypatch.setenv("DDPM_DOWNLOAD_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.raises(data.DatasetError, match=r"sent nothing for 1 s.*DDPM_DOWNLOAD_TIMEOUT"):
        data.get_dataset("cifar10", root=tmp_path, verbose=False)
    assert time.monotonic() - start < 20  # was: hung until killed
    assert socket.getdefaulttimeout() is None  # the process-wide default is restored


def test_concurrent_cifar10_downloads_wait_for_one_downloader(tmp_path, monkeypatch):
    """Two processes (DDP ranks) asking for CIFAR-10 at once: one downloads, the other waits and reuses it."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    calls = ctx.Value("i", 0)
    active = ctx.Value("i", 0)
    overlap = ctx.Value("i", 0)

    def fake_cifar(root, train=True, download=False):
        from pathlib import Path

        if download:
            with active.get_lock():
                active.value += 1
                overlap.value = max(overlap.value, active.value)
            with calls.get_lock():
                calls.value += 1
            time.sleep(0.5)
            batches = Path(root) / "cifar-10-batches-py"
            batches.mkdir(parents=True, exist_ok=True)
            (batches / "data_batch_1").write_bytes(b"x")
            with active.get_lock():
                active.value -= 1
        return "dataset"

    import torchvision.datasets

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", fake_cifar)
    procs = [ctx.Process(target=data._download_cifar10, args=(tmp_path, True, 5.0)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert calls.value == 1 and overlap.value == 1
