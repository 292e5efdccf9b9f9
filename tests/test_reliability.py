"""Nothing hangs and nothing is lost: network stalls, concurrent downloads."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from ddpm_core import data
from helpers import tiny_config


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


# ------------------------------------------------------------------------------ images and folders
def _png(path, array, mode=None):
    from PIL import Image

    Image.fromarray(array, mode).save(path) if mode else Image.fromarray(array).save(path)


def test_16_bit_grayscale_pngs_are_scaled_not_clipped(tmp_path):
    import numpy as np

    _png(tmp_path / "0.png", np.full((32, 32), 33153, dtype=np.uint16))  # mid-gray in 16 bits
    img = data.FolderImages(tmp_path)[0]
    assert img.shape == (3, 32, 32)
    assert 126 <= img.float().mean() <= 132  # 33153 / 257 = 129; PIL's convert gave 255


def test_macos_resource_forks_and_hidden_files_are_skipped(tmp_path):
    import numpy as np

    _png(tmp_path / "0.png", np.zeros((32, 32, 3), dtype=np.uint8))
    (tmp_path / "._0.png").write_bytes(b"\x00\x05\x16\x07 resource fork, not a PNG")
    ds = data.FolderImages(tmp_path)
    assert [p.name for p in ds.files] == ["0.png"]
    assert ds[0].shape == (3, 32, 32)


def test_a_decompression_bomb_names_the_file(tmp_path, monkeypatch):
    import numpy as np
    from PIL import Image

    _png(tmp_path / "0.png", np.zeros((64, 64, 3), dtype=np.uint8))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 64x64 > 2x the limit: PIL raises
    with pytest.raises(data.DatasetError, match=r"cannot read image .*0\.png.*Fix"):
        data.FolderImages(tmp_path)[0]


def test_a_missing_image_folder_names_the_setting(tmp_path):
    with pytest.raises(data.DatasetError, match="image_folder"):
        data.FolderImages(tmp_path / "nope")


def test_a_damaged_cifar10_folder_names_the_bad_file(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch"]:
        (folder / name).write_bytes(b"truncated")
    with pytest.raises(data.DatasetError, match=r"damaged: data_batch_1 fails its checksum .*Fix: delete the folder"):
        data.get_dataset("auto", root=tmp_path, verbose=False)


def test_a_read_only_data_folder_says_how_to_move_it(tmp_path):
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores permissions: simulate with a file in the way
            ro.chmod(0o700)
            (ro / "synthetic").write_text("a file where the folder should be")
        with pytest.raises(data.DatasetError, match=r"cannot write the synthetic dataset .*DDPM_DATA_DIR"):
            data.make_synthetic(ro, n=4, progress=False)
    finally:
        ro.chmod(0o700)


# ------------------------------------------------------------------------------ atomic writes
def test_disk_full_says_the_previous_file_survived(tmp_path):
    import errno

    from ddpm_core.atomic import DiskFullError, atomic_open, atomic_write_text

    target = tmp_path / "ckpt.pt"
    atomic_write_text(target, "previous checkpoint")
    with pytest.raises(DiskFullError, match=r"no space left .*ckpt\.pt was left as it was.*Fix: free space"):
        with atomic_open(target, "wb") as f:
            f.write(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_text() == "previous checkpoint"
    assert not list(tmp_path.glob("*.partial"))


def test_a_library_error_on_a_nearly_full_disk_is_reported_as_disk_full(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from ddpm_core import atomic

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(atomic.DiskFullError, match="nothing was written"):
        with atomic.atomic_open(tmp_path / "x.pt", "wb"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")


def test_partial_files_of_killed_writers_are_cleaned_up_and_fresh_ones_kept(tmp_path):
    import os

    from ddpm_core.atomic import atomic_write_text

    stale = tmp_path / ".ckpt.pt.abc123.partial"
    fresh = tmp_path / ".ckpt.pt.def456.partial"
    stale.write_bytes(b"0" * 1000)
    fresh.write_bytes(b"0")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    atomic_write_text(tmp_path / "ckpt.pt", "new")
    assert not stale.exists() and fresh.exists()


# ------------------------------------------------------------------------------ results CSVs
def _append_rows(path, writer, n):
    from ddpm_core import results

    for i in range(n):
        results.append("nb", {"variant": f"w{writer}-{i}", "median_ms": float(i)}, path=path)


def test_concurrent_writers_keep_every_row(tmp_path):
    """4 processes x 25 appends = 100 rows (without a lock, 25-30 survived)."""
    import multiprocessing as mp

    from ddpm_core import results

    path = tmp_path / "r.csv"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_append_rows, args=(path, w, 25)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    df = results.load(path)
    assert len(df) == 100 and df["variant"].nunique() == 100


def test_results_ids_stay_text_and_an_empty_file_names_itself(tmp_path):
    from ddpm_core import results

    path = tmp_path / "r.csv"
    results.append("nb", [{"variant": "NA", "mfu": None, "median_ms": 1.5}, {"variant": "1e3", "mfu": 0.4, "median_ms": 2.0}],
                   path=path)
    df = results.load(path)
    assert list(df["variant"]) == ["NA", "1e3"]
    assert df["mfu"].dtype.kind == "f" and df["mfu"].isna().iloc[0] and df["median_ms"].iloc[1] == 2.0
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.csv is empty"):
        results.load(empty)
    results.append("nb", {"variant": "after"}, path=empty)  # a later append starts the file afresh
    assert list(results.load(empty)["variant"]) == ["after"]


# ------------------------------------------------------------------------------ checkpoints and divergence
def _run(tmp_path, **kw):
    from ddpm_core.train import train
    from helpers import tiny_config

    return train(tiny_config(tmp_path, batch_size=4, synthetic_size=64, **kw))


def test_pruning_never_deletes_a_good_checkpoint_because_of_a_corrupt_newer_one(tmp_path):
    import warnings

    from ddpm_core.train import checkpoint_readable, list_checkpoints

    _run(tmp_path, steps=4, checkpoint_every=2, keep_checkpoints=1)
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step-00000006.pt").write_bytes(os.urandom(4096))  # a corrupt "newest" checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = _run(tmp_path, steps=5, checkpoint_every=1, keep_checkpoints=1)
    assert r.resumed_from.name == "step-00000004.pt"
    kept = list_checkpoints(tmp_path / "run")
    assert [p.name for p in kept] == ["step-00000005.pt"] and checkpoint_readable(kept[0])
    assert (ckpts / "step-00000006.pt.corrupt").exists()  # set aside, not counted, not deleted


def test_with_every_checkpoint_unreadable_new_ones_are_still_kept(tmp_path):
    import pickle
    import warnings

    from ddpm_core.train import list_checkpoints

    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "step-00000008.pt").write_bytes(os.urandom(2048))

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    (ckpts / "step-00000009.pt").write_bytes(pickle.dumps(Evil()))  # a malicious pickle
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = _run(tmp_path, steps=2, checkpoint_every=1)
    assert r.resumed_from is None and not (tmp_path / "pwned").exists()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-00000001.pt", "step-00000002.pt"]


def test_a_diverging_run_stops_and_never_overwrites_a_finite_checkpoint(tmp_path):
    from ddpm_core.train import TrainingDiverged, list_checkpoints, load_checkpoint_file

    with pytest.raises(TrainingDiverged, match=r"at step \d+ .*lr .*precision fp32"):
        _run(tmp_path, steps=40, checkpoint_every=1, log_every=4, lr=100.0, grad_clip=None, warmup_steps=0)
    assert list_checkpoints(tmp_path / "run")  # the finite steps before it were saved
    for path in list_checkpoints(tmp_path / "run"):
        state = load_checkpoint_file(path)["model"]
        assert all(torch.isfinite(v).all() for v in state.values()), path.name


# ------------------------------------------------------------------ configuration errors come first, by name
@pytest.mark.parametrize("kw, message", [
    (dict(batch_size="64"), r"batch_size must be an int, got '64' \(str\)\. Fix: batch_size=64"),
    (dict(lr="2e-4"), r"lr must be a float, got '2e-4' \(str\)\. Fix: lr=0\.0002"),
    (dict(batch_size=True), r"batch_size must be an int, got True \(bool\)"),
    (dict(keep_checkpoints=1.5), r"keep_checkpoints must be an int, got 1\.5"),
    (dict(lr=float("inf")), r"lr must be a finite number, got inf"),
    (dict(grad_clip=float("nan")), r"grad_clip must be a finite number, got nan \(use None for none\)"),
    (dict(resume="no"), r"resume must be a bool, got 'no'"),
])
def test_config_types_are_checked_and_the_field_named(tmp_path, kw, message):
    with pytest.raises((TypeError, ValueError), match=message):
        tiny_config(tmp_path, **kw)


def test_a_path_object_is_a_valid_out_dir(tmp_path):
    assert tiny_config(tmp_path, out_dir=tmp_path / "run").out_dir == str(tmp_path / "run")


def test_a_changed_lr_or_warmup_on_resume_is_used_from_then_on(tmp_path, capsys):
    from ddpm_core.train import build

    _run(tmp_path, steps=2, checkpoint_every=2, lr=1e-5, warmup_steps=100)
    cfg = tiny_config(tmp_path, batch_size=4, synthetic_size=64, steps=3, checkpoint_every=1, lr=1e-3, warmup_steps=0)
    t = build(cfg)
    t.resume_latest(cfg.out_dir)
    assert "lr 1e-05 -> 0.001, warmup_steps 100 -> 0" in capsys.readouterr().out
    # was 1e-5 * min(1, 3/0...) mixed: the old base lr with the new warm-up
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert t.scheduler.base_lrs == [1e-3]
    t.train_step(torch.zeros(4, 3, 32, 32))
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    # and a warm-up that is still running continues from the restored step with the new lr
    t2 = build(tiny_config(tmp_path, batch_size=4, synthetic_size=64, lr=2e-3, warmup_steps=10))
    t2.resume_latest(t2.cfg.out_dir)
    assert t2.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * 3 / 10)


def test_path_errors_are_raised_before_any_training(tmp_path, monkeypatch):
    from ddpm_core import train as T

    steps = []
    monkeypatch.setattr(T.Trainer, "train_step", lambda self, x: steps.append(1))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    with pytest.raises(ValueError, match=r"is a file, not a folder"):
        _run(tmp_path, out_dir=str(a_file))
    with pytest.raises(ValueError, match=r"cannot write to out_dir .*nothing was trained yet"):
        _run(tmp_path, out_dir=str(a_file / "run"))
    assert steps == [] and a_file.read_text() == "mine"


def test_out_dir_pointed_at_the_checkpoints_folder_is_refused(tmp_path):
    _run(tmp_path, steps=2, checkpoint_every=2)
    with pytest.raises(ValueError, match=r"is the checkpoints folder of a run.*out_dir=.*run'"):
        _run(tmp_path, steps=4, out_dir=str(tmp_path / "run" / "checkpoints"))


def test_the_mismatch_error_does_not_suggest_resume_false(tmp_path):
    _run(tmp_path, steps=2, checkpoint_every=2)
    with pytest.raises(ValueError, match=r"different run") as e:
        _run(tmp_path, steps=4, seed=1)
    assert "resume=False" not in str(e.value) and "delete" in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["--precision", "fp16", "--device", "cpu"], r"^error: precision='fp16' cannot run on cpu"),
    (["--samples", "0"], r"^error: --samples must be >= 1"),
    (["--sample-grid", "grid.jpg"], r"^error: --sample-grid 'grid.jpg' must name a \.png"),
    (["--batch-size", "0"], r"^error: batch_size must be >= 1"),
])
def test_the_command_line_prints_one_error_line_and_exits_2_before_training(tmp_path, monkeypatch, capsys, args, message):
    from ddpm_core import train as T

    monkeypatch.setattr(T.Trainer, "train_step", lambda self, x: pytest.fail("trained before the error"))
    rc = T.main(["--model", "tiny", "--dataset", "synthetic", "--synthetic-size", "64", "--no-progress",
                 "--out-dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert any(__import__("re").match(message, line) for line in err.splitlines()), err


def test_world_size_without_torchrun_says_to_use_torchrun(tmp_path, monkeypatch, capsys):
    from ddpm_core import train as T

    monkeypatch.setenv("WORLD_SIZE", "2")
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    rc = T.main(["--model", "tiny", "--out-dir", str(tmp_path / "run")])
    assert rc == 2 and "started without torchrun" in capsys.readouterr().err  # was: KeyError: 'RANK'


def test_a_missing_peer_ends_the_wait_with_a_clear_error(tmp_path, monkeypatch):
    from ddpm_core import train as T

    with socket.socket() as s:  # a port nobody listens on: the other process never came
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("DDPM_RENDEZVOUS_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.raises(T.RendezvousError, match=r"rank 1 of 2 could not form the process group .* within 1 s"):
        _run(tmp_path)
    assert time.monotonic() - start < 60  # was: a silent wait of up to 10 minutes


def test_stream_command_stops_a_silent_command_and_its_children_at_the_timeout(tmp_path):
    from ddpm_core.series import stream_command

    pid_file = tmp_path / "child.pid"
    start = time.monotonic()
    rc, out = stream_command(["sh", "-c", f"sleep 300 & echo $! > {pid_file}; sleep 300"], timeout=1)
    assert rc == 124 and "no end after 1 s" in out
    assert time.monotonic() - start < 30  # was: no timeout until a line arrived
    child = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the command's child outlived the timeout")  # was: kill() reached only the direct child


def _build_synthetic(root):
    p = data.make_synthetic(root, n=16, progress=False)
    return sorted(x.name for x in p.iterdir())


def test_concurrent_synthetic_builds_make_one_complete_dataset_and_clean_up(tmp_path):
    import multiprocessing as mp

    abandoned = tmp_path / "synthetic" / ".n16-seed0.12345.xyz"  # left by a writer killed with SIGKILL
    abandoned.mkdir(parents=True)
    (abandoned / "0.png").write_bytes(b"half")
    with mp.get_context("fork").Pool(4) as pool:
        listings = pool.map(_build_synthetic, [tmp_path] * 4)
    assert all(lst == listings[0] for lst in listings) and len(listings[0]) == 17  # 16 PNGs + MANIFEST
    hidden = [p.name for p in (tmp_path / "synthetic").iterdir() if p.name.startswith(".")]
    assert hidden == []  # was: hidden half-built folders stayed forever
    mode = (tmp_path / "synthetic" / "n16-seed0").stat().st_mode & 0o777
    mask = os.umask(0)
    os.umask(mask)
    assert mode == 0o777 & ~mask  # was 0700 (mkdtemp's)
