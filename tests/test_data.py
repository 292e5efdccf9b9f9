import numpy as np
import pytest
import torch
from PIL import Image

from ddpm_core import data as D


def test_synthetic_dataset_is_deterministic_and_written_once(tmp_path):
    a = D.make_synthetic(tmp_path / "a", n=40, seed=3, progress=False)
    b = D.make_synthetic(tmp_path / "b", n=40, seed=3, progress=False)
    other = D.make_synthetic(tmp_path / "c", n=40, seed=4, progress=False)
    da, db, dc = D.FolderImages(a), D.FolderImages(b), D.FolderImages(other)
    assert len(da) == 40
    assert all(torch.equal(da[i], db[i]) for i in range(40))
    assert not all(torch.equal(da[i], dc[i]) for i in range(40))
    mtime = (a / "0.png").stat().st_mtime_ns
    assert D.make_synthetic(tmp_path / "a", n=40, seed=3, progress=False) == a
    assert (a / "0.png").stat().st_mtime_ns == mtime  # reused, not rewritten
    assert a.parent.name == "synthetic"


def test_synthetic_images_have_visible_structure(synthetic_folder):
    ds = D.FolderImages(synthetic_folder)
    img = ds[0]
    assert img.dtype == torch.uint8 and img.shape == (3, 32, 32)
    stds = torch.stack([ds[i].float().std() for i in range(32)])
    assert (stds > 20).all()  # shapes on gradients, not flat colour
    means = torch.stack([ds[i].float().mean() for i in range(32)])
    assert means.std() > 5  # and they differ from image to image


def test_incomplete_synthetic_folder_is_regenerated(tmp_path):
    folder = D.make_synthetic(tmp_path, n=8, progress=False)
    (folder / "MANIFEST.json").write_text("{}")  # pretend it was interrupted
    (folder / "3.png").unlink()
    again = D.make_synthetic(tmp_path, n=8, progress=False)
    assert len(D.FolderImages(again)) == 8


def test_folder_dataset_reads_kaggle_layout_in_numeric_order_and_resizes(tmp_path):
    folder = tmp_path / "train"
    folder.mkdir()
    for i, v in [(1, 10), (2, 20), (10, 100)]:
        Image.fromarray(np.full((64, 48, 3), v, np.uint8)).save(folder / f"{i}.png")
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(folder / "11.jpg")
    (folder / "notes.txt").write_text("not an image")
    ds = D.FolderImages(folder)
    assert [p.name for p in ds.files] == ["1.png", "2.png", "10.png", "11.jpg"]
    assert ds[2].shape == (3, 32, 32) and ds[2].float().mean().item() == pytest.approx(100, abs=1)


def test_folder_with_a_corrupt_image_names_the_file(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(folder / "1.png")
    (folder / "2.png").write_bytes(b"\x89PNG this is not really a png")
    ds = D.FolderImages(folder)
    with pytest.raises(D.DatasetError, match=r"2\.png.*Fix: delete or replace"):
        ds[1]
    loader = D.make_loader(ds, 2, flip=False)  # also surfaces through the DataLoader
    with pytest.raises(D.DatasetError, match=r"2\.png"):
        next(iter(loader))


def test_folder_with_no_images_or_missing_names_the_path(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(D.DatasetError, match=r"no images .* found in .*empty"):
        D.FolderImages(tmp_path / "empty")
    with pytest.raises(D.DatasetError, match=r"image folder .*nowhere does not exist"):
        D.get_dataset("folder", folder=tmp_path / "nowhere")


def test_cifar10_without_files_or_network_says_how_to_download_or_use_synthetic(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "cifar10_reachable", lambda timeout=3.0: False)
    with pytest.raises(D.DatasetError) as err:
        D.get_dataset("cifar10", root=tmp_path)
    msg = str(err.value)
    assert str(tmp_path) in msg and "make cifar10" in msg and "download=True" in msg and "synthetic" in msg
    with pytest.raises(D.DatasetError, match="download=False"):
        D.CIFAR10Images(tmp_path, download=False)


def test_cifar10_download_failure_is_reported_not_raised_raw(tmp_path, monkeypatch):
    import torchvision

    monkeypatch.setattr(D, "cifar10_reachable", lambda timeout=3.0: True)

    def broken_download(self):
        raise OSError("connection reset")

    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", broken_download)
    with pytest.raises(D.DatasetError, match="connection reset.*synthetic"):
        D.get_dataset("cifar10", root=tmp_path)


def test_auto_falls_back_to_synthetic_offline_and_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(D, "cifar10_reachable", lambda timeout=3.0: False)
    ds = D.get_dataset("auto", root=tmp_path, synthetic_size=12)
    out = capsys.readouterr().out
    assert "synthetic" in out and "unreachable" in out
    assert len(ds) == 12


def test_auto_uses_cifar10_when_present(tmp_path, monkeypatch, capsys):
    import pickle

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    # a fake CIFAR-10 of 10 images: skip torchvision's md5 checks
    monkeypatch.setattr("torchvision.datasets.CIFAR10._check_integrity", lambda self: True)
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda *a, **k: True)
    batch = {"data": np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072), "labels": [0, 1]}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [str(i) for i in range(10)]}, f)
    ds = D.get_dataset("auto", root=tmp_path)
    assert "CIFAR-10 (found in" in capsys.readouterr().out
    assert len(ds) == 10 and ds[0].shape == (3, 32, 32) and ds.as_tensor().dtype == torch.uint8


def _epoch(loader, epoch=0, start=0):
    loader.set_epoch(epoch, start)
    return torch.cat(list(loader))


def test_float_uint8_and_device_paths_give_identical_batches(synthetic_folder):
    ds = D.FolderImages(synthetic_folder)
    ref = _epoch(D.make_loader(ds, 32, mode="float", seed=1))
    assert ref.shape == (256, 3, 32, 32) and ref.dtype == torch.float32
    assert ref.min() >= -1 and ref.max() <= 1 and ref.min() < -0.9 and ref.max() > 0.9
    for mode in ("uint8", "device"):
        assert torch.allclose(_epoch(D.make_loader(ds, 32, mode=mode, seed=1)), ref, atol=1e-6)
    workers = D.make_loader(ds, 32, mode="float", seed=1, num_workers=2, persistent_workers=True, prefetch_factor=2)
    assert torch.equal(_epoch(workers), ref)  # augmentation does not depend on worker RNG


def test_epochs_shuffle_and_flip_differently_and_resume_mid_epoch(synthetic_folder):
    ds = D.FolderImages(synthetic_folder)
    loader = D.make_loader(ds, 32, seed=0)
    e0, e1 = _epoch(loader, 0), _epoch(loader, 1)
    assert not torch.equal(e0, e1)
    assert torch.equal(_epoch(loader, 1, start=3), e1[3 * 32:])
    plain = D.make_loader(ds, 32, seed=0, flip=False)
    flipped_share = (~torch.isclose(e0, _epoch(plain, 0)).flatten(1).all(1)).float().mean()
    assert 0.3 < flipped_share < 0.7  # about half the images are mirrored


def test_ranks_get_disjoint_equal_shards(synthetic_folder):
    n = 256
    plans = [D.EpochSampler(n, seed=0, rank=r, world_size=3).epoch_plan()[0] for r in range(3)]
    assert all(len(p) == n // 3 for p in plans)
    assert len(set(torch.cat(plans).tolist())) == 3 * (n // 3)


def test_loader_arguments_are_checked(synthetic_folder):
    ds = D.FolderImages(synthetic_folder)
    with pytest.raises(ValueError, match="loader mode must be one of"):
        D.make_loader(ds, 8, mode="gpu")
    with pytest.raises(ValueError, match="fewer than one batch"):
        D.make_loader(ds, 1024)
    with pytest.raises(ValueError, match="prefetch_factor only applies"):
        D.make_loader(ds, 8, prefetch_factor=2)
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'"):
        D.get_dataset("imagenet")


def test_workers_that_would_overflow_shared_memory_are_refused_before_they_start(synthetic_folder, monkeypatch):
    """Docker's default /dev/shm (64 MiB) cannot hold 16 workers' prefetched float batches of 256 (07's full grid):
    the workers would die with a bus error mid-run. make_loader says so, and how to fix it, before starting any."""
    import collections

    ds = D.FolderImages(synthetic_folder)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(D.shutil, "disk_usage", lambda path: usage(64 * 2**20, 0, 64 * 2**20))
    started = []
    monkeypatch.setattr(D, "Loader", lambda *a, **k: started.append(1))
    with pytest.raises(RuntimeError, match=r"16 DataLoader workers .* need about 99 MiB of shared memory in /dev/shm, "
                                           r"and it has 64 MiB free\. Lower num_workers .*--shm-size"):
        D.make_loader(ds, 256, num_workers=16)  # the fixture's 256 images: one batch
    assert not started
    D.make_loader(ds, 8, num_workers=16)  # 3 MiB in flight: fits
    D.make_loader(ds, 256, mode="device")  # no workers: nothing to check
    assert len(started) == 1
    D.check_shared_memory(16, 2, 256, mode="uint8")  # a quarter of the bytes: 25 MiB fits
    monkeypatch.setattr(D.shutil, "disk_usage", lambda path: (_ for _ in ()).throw(FileNotFoundError(path)))
    D.check_shared_memory(16, 2, 4096)  # no /dev/shm (macOS, Windows): nothing to check


def test_forever_moves_to_the_next_epoch_when_one_ends(synthetic_folder):
    ds = D.FolderImages(synthetic_folder)
    loader = D.make_loader(ds, 128, seed=0)  # 2 batches per epoch
    it = D.forever(loader)
    got = torch.cat([next(it) for _ in range(4)])
    assert torch.equal(got[:256], _epoch(loader, 0)) and torch.equal(got[256:], _epoch(loader, 1))


def test_a_folder_dataset_is_decoded_once_for_every_device_resident_loader(synthetic_folder):
    from ddpm_core.data import FolderImages, dataset_as_tensor, make_loader

    class Counting(FolderImages):
        reads = 0

        def __getitem__(self, i):
            Counting.reads += 1
            return super().__getitem__(i)

    ds = Counting(synthetic_folder)
    first = dataset_as_tensor(ds, progress=False)
    assert Counting.reads == len(ds)
    make_loader(ds, 8, device="cpu", mode="device")
    make_loader(ds, 16, device="cpu", mode="device")
    assert Counting.reads == len(ds)  # was: one full decode per loader
    assert dataset_as_tensor(ds) is first


@pytest.mark.parametrize("mode", ["float", "device"])
def test_drop_last_false_keeps_the_last_smaller_batch(mode):
    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.full((3, 4, 4), i, dtype=torch.uint8)

    kept = D.make_loader(Images(), 4, mode=mode, drop_last=False)
    dropped = D.make_loader(Images(), 4, mode=mode)
    assert [len(b) for b in kept] == [4, 4, 2] and len(kept) == 3
    assert [len(b) for b in dropped] == [4, 4] and len(dropped) == 2
    kept.set_epoch(0, start_batch=2)  # resume at the last batch
    assert [len(b) for b in kept] == [2]
