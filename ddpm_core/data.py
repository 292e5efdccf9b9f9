"""Datasets and loaders: CIFAR-10, a folder of images, and a generated offline dataset.

Every dataset here yields one image as a ``uint8`` tensor of shape 3 x 32 x 32. What happens
next is the loader's job, and ``make_loader`` offers the three data paths the series compares:

* ``mode="float"``: the classic path. Workers flip, convert to float32 and scale to [-1, 1];
  float batches are copied to the device (4 bytes per pixel over PCIe).
* ``mode="uint8"``: workers only flip; uint8 batches are copied (1 byte per pixel) and
  normalized on the device.
* ``mode="device"``: no DataLoader at all. The whole uint8 dataset lives on the device as one
  tensor; each epoch is a permutation, a gather and a flip done there.

Shuffling and flips are decided by ``EpochSampler`` from (seed, epoch) alone, so every path,
every worker count and a resumed run see exactly the same images in the same order.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .atomic import _umask, file_lock
from .paths import data_dir

DATASET_CHOICES = ("auto", "cifar10", "synthetic", "folder")
LOADER_MODES = ("float", "uint8", "device")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
IMAGE_SIZE = 32
SYNTHETIC_SIZE = 10_000
SYNTHETIC_VERSION = 1
CIFAR10_HOST = ("www.cs.toronto.edu", 443)


class DatasetError(RuntimeError):
    """A dataset could not be found, downloaded or read. The message says how to fix it."""


# ------------------------------------------------------------------------------------ datasets
def _natural_key(path: Path) -> list:
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", path.name)]


class FolderImages(Dataset):
    """A flat folder of PNG/JPEG images (e.g. Kaggle's CIFAR-10 ``train/1.png ...``), resized to 32x32.

    Images are decoded on every access, which makes this the decode-bound dataset of the
    data-loading notebook.
    """

    def __init__(self, root: str | os.PathLike, size: int = IMAGE_SIZE):
        self.root = Path(root)
        self.size = size
        if not self.root.is_dir():
            raise DatasetError(
                f"image folder {self.root} does not exist. Fix: set image_folder (--image-folder) to a "
                f"folder of PNG/JPEG images (e.g. Kaggle's cifar-10/train), or use dataset='synthetic'."
            )
        self.files = sorted(
            # hidden files are skipped: macOS writes "._0.png" resource forks next to every image
            (p for p in self.root.iterdir()
             if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".") and p.is_file()),
            key=_natural_key,
        )
        if not self.files:
            raise DatasetError(
                f"no images ({', '.join(IMAGE_EXTENSIONS)}) found in {self.root}. Fix: the folder "
                f"must hold the image files directly (not in subfolders), e.g. cifar-10/train/1.png."
            )

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        from PIL import Image, UnidentifiedImageError
        from torchvision.transforms.v2.functional import pil_to_tensor

        path = self.files[index]
        try:
            with Image.open(path) as im:
                im = _to_rgb(im)
                if im.size != (self.size, self.size):
                    im = im.resize((self.size, self.size), Image.Resampling.BICUBIC)
                return pil_to_tensor(im)
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise DatasetError(
                f"cannot read image {path}: {e}. Fix: delete or replace this file."
            ) from e


def _to_rgb(im):
    """An RGB PIL image; 16-bit and 32-bit integer images are scaled to 8 bits, not clipped.

    PIL's ``convert`` clips a 16-bit grayscale value of 33000 to 255, so such images would come
    out nearly white.
    """
    from PIL import Image

    if im.mode.startswith("I"):  # "I;16", "I;16B", "I": integer pixels, 16 bits in PNGs
        arr = np.asarray(im, dtype=np.float64)
        scale = 257.0 if im.mode.startswith("I;16") or arr.max(initial=0) <= 65535 else arr.max() / 255.0
        im = Image.fromarray(np.clip(np.round(arr / scale), 0, 255).astype(np.uint8), "L")
    return im.convert("RGB")


class InMemoryImages(Dataset):
    """A uint8 N x 3 x H x W tensor as a dataset: no decoding, the fastest host-side source."""

    def __init__(self, images: torch.Tensor):
        if images.dtype != torch.uint8 or images.ndim != 4:
            raise ValueError(f"InMemoryImages needs a uint8 N x C x H x W tensor, got {images.dtype} {tuple(images.shape)}")
        self.images = images

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.images[index]

    def as_tensor(self) -> torch.Tensor:
        return self.images


class CIFAR10Images(InMemoryImages):
    """torchvision's CIFAR-10 training (or test) split as uint8 images; labels are dropped."""

    def __init__(self, root: str | os.PathLike | None = None, train: bool = True, download: bool = True):
        from torchvision.datasets import CIFAR10

        self.root = Path(root) if root is not None else data_dir()
        if not _cifar10_present(self.root):
            if not download:
                raise DatasetError(_cifar10_missing_message(self.root, "download=False"))
            if not cifar10_reachable():
                raise DatasetError(_cifar10_missing_message(self.root, "no network connection to the CIFAR-10 host"))
        if _cifar10_present(self.root):
            bad = _cifar10_bad_files(self.root)
            if bad:
                raise DatasetError(
                    f"CIFAR-10 in {self.root / 'cifar-10-batches-py'} is damaged: {', '.join(bad)} "
                    f"(an interrupted download or copy?). Fix: delete the folder {self.root / 'cifar-10-batches-py'} "
                    f"and run `make cifar10` again, or use dataset='synthetic'."
                )
        try:
            if _cifar10_present(self.root) or not download:
                ds = CIFAR10(str(self.root), train=train, download=False)
            else:
                ds = _download_cifar10(self.root, train)
        except DatasetError:
            raise
        except Exception as e:  # noqa: BLE001 - torchvision raises URLError, RuntimeError, OSError...
            raise DatasetError(_cifar10_missing_message(self.root, f"{type(e).__name__}: {e}")) from e
        super().__init__(torch.from_numpy(np.ascontiguousarray(ds.data)).permute(0, 3, 1, 2).contiguous())


def _download_cifar10(root: Path, train: bool, timeout: float | None = None):
    """Download CIFAR-10 into ``root`` once per machine, with a timeout on every network read.

    torchvision's downloader opens its connection without a timeout, so a host (or proxy) that
    accepts the connection and never answers would hang forever: every socket opened here gets
    ``timeout`` seconds ($DDPM_DOWNLOAD_TIMEOUT, default 60) of silence before it gives up. A
    file lock in ``root`` makes concurrent processes (DDP ranks, parallel notebooks) wait for the
    one that downloads instead of writing the same archive at once; they then find it present.
    """
    import fcntl

    from torchvision.datasets import CIFAR10

    timeout = float(os.environ.get("DDPM_DOWNLOAD_TIMEOUT", 60)) if timeout is None else timeout
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".cifar10-download.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if _cifar10_present(root):  # another process finished the download while we waited
            return CIFAR10(str(root), train=train, download=False)
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(timeout)
        try:
            return CIFAR10(str(root), train=train, download=True)
        except OSError as e:  # a timeout arrives as TimeoutError or as URLError("timed out")
            if "timed out" not in str(e):
                raise
            raise DatasetError(_cifar10_missing_message(
                root, f"the download host sent nothing for {timeout:g} s ({e}); set DDPM_DOWNLOAD_TIMEOUT "
                      f"to wait longer")) from e
        finally:
            socket.setdefaulttimeout(previous)


def _cifar10_bad_files(root: Path) -> list[str]:
    """The CIFAR-10 batch files under ``root`` that are missing or fail torchvision's md5 check."""
    from torchvision.datasets import CIFAR10, cifar

    folder = root / CIFAR10.base_folder
    bad = []
    for name, md5 in [*CIFAR10.train_list, *CIFAR10.test_list]:
        path = folder / name
        if not path.exists():
            bad.append(f"{name} is missing")
        elif not cifar.check_integrity(str(path), md5):
            bad.append(f"{name} fails its checksum ({path.stat().st_size:,} bytes)")
    return bad


def _cifar10_present(root: Path) -> bool:
    return (root / "cifar-10-batches-py" / "data_batch_1").exists()


def _cifar10_missing_message(root: Path, reason: str) -> str:
    return (
        f"CIFAR-10 is not in {root / 'cifar-10-batches-py'} and could not be downloaded ({reason}). "
        f"Fix: on a machine with internet run `make cifar10` (or python -c \"import torchvision; "
        f"torchvision.datasets.CIFAR10('{root}', download=True)\") and copy the folder "
        f"cifar-10-batches-py into {root}; or use dataset='synthetic' (generated offline) or "
        f"dataset='folder' with a folder of images."
    )


def cifar10_reachable(timeout: float = 3.0) -> bool:
    """Whether the CIFAR-10 download host answers (a quick TCP connect, no download)."""
    try:
        with socket.create_connection(CIFAR10_HOST, timeout=timeout):
            return True
    except OSError:
        return False


# ------------------------------------------------------------------------- synthetic dataset
def _render_synthetic(rng: np.random.Generator, size: int = IMAGE_SIZE, ss: int = 2) -> np.ndarray:
    """One image: a two-colour linear gradient with 1-3 bright shapes (circle, square, triangle).

    Drawn at ``ss`` times the size and box-filtered down, for anti-aliased edges.
    """
    s = size * ss
    yy, xx = np.mgrid[0:s, 0:s].astype(np.float32) / (s - 1)
    c0, c1 = rng.uniform(0.0, 0.6, size=(2, 3)).astype(np.float32)  # muted background colours
    ang = rng.uniform(0, 2 * np.pi)
    g = np.clip(0.5 + (np.cos(ang) * (xx - 0.5) + np.sin(ang) * (yy - 0.5)), 0, 1)[..., None]
    img = c0 * (1 - g) + c1 * g
    palette = np.array(
        [[1, .2, .2], [.2, .9, .2], [.2, .4, 1], [1, .9, .1], [1, .3, 1], [.1, .9, .9], [1, 1, 1], [1, .6, .1]],
        dtype=np.float32,
    )
    for _ in range(rng.integers(1, 4)):
        kind = rng.integers(0, 3)
        cx, cy = rng.uniform(0.2, 0.8, size=2)
        r = rng.uniform(0.12, 0.28)
        if kind == 0:  # circle
            mask = (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
        elif kind == 1:  # square
            mask = (np.abs(xx - cx) <= r * 0.85) & (np.abs(yy - cy) <= r * 0.85)
        else:  # upward triangle
            mask = (yy <= cy + r * 0.8) & (yy - (cy - r) >= 1.8 * np.abs(xx - cx))
        img = np.where(mask[..., None], palette[rng.integers(0, len(palette))], img)
    img = img.reshape(size, ss, size, ss, 3).mean(axis=(1, 3))
    return np.round(np.clip(img, 0, 1) * 255).astype(np.uint8)


def make_synthetic(
    root: str | os.PathLike | None = None, n: int = SYNTHETIC_SIZE, seed: int = 0, progress: bool = True
) -> Path:
    """Write the synthetic dataset once as PNG files and return its folder.

    The folder is ``<root>/synthetic/n<n>-seed<seed>``. It is built in a temporary folder and
    renamed into place when complete, so an interrupted run never leaves a half dataset.
    The same (n, seed) always gives the same pixels.
    """
    from PIL import Image
    from tqdm.auto import tqdm

    base = Path(root) if root is not None else data_dir()
    final = base / "synthetic" / f"n{n}-seed{seed}"
    manifest = {"n": n, "seed": seed, "size": IMAGE_SIZE, "version": SYNTHETIC_VERSION}
    if _synthetic_complete(final, manifest):
        return final
    with contextlib.ExitStack() as stack:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(file_lock(final))  # one writer per dataset: other processes (DDP ranks) wait, then reuse it
        except OSError as e:
            raise DatasetError(
                f"cannot write the synthetic dataset under {final.parent}: {e}. Fix: point the data folder at a "
                f"writable place with the environment variable DDPM_DATA_DIR or --data-root (TrainConfig.data_root)."
            ) from e
        if _synthetic_complete(final, manifest):  # another process finished it while we waited
            return final
        _remove_abandoned_builds(final)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)  # gone after the rename; a half build if it failed
        rng = np.random.Generator(np.random.PCG64(seed))
        for i in tqdm(range(n), desc=f"writing synthetic dataset ({n} PNGs)", disable=not progress, leave=False):
            Image.fromarray(_render_synthetic(rng)).save(tmp / f"{i}.png", optimize=False)
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700 folders: give the usual permissions
        if final.exists():  # stale (another version) or incomplete, and we hold the lock: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
    return final


def _remove_abandoned_builds(final: Path) -> None:
    """Delete hidden half-built copies of ``final`` left by killed writers (called under its lock,
    so no live writer of this dataset exists: every one found is abandoned)."""
    for old in final.parent.glob(f".{final.name}.*"):
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)


def _synthetic_complete(folder: Path, manifest: dict) -> bool:
    try:
        return json.loads((folder / "MANIFEST.json").read_text()) == manifest
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------------ by name
def get_dataset(
    name: str = "auto",
    *,
    root: str | os.PathLike | None = None,
    folder: str | os.PathLike | None = None,
    synthetic_size: int = SYNTHETIC_SIZE,
    download: bool = True,
    verbose: bool = True,
) -> Dataset:
    """A training dataset of uint8 3x32x32 images, by name.

    Args:
        name: "cifar10" (torchvision, downloaded into ``root``), "folder" (images in ``folder``),
            "synthetic" (generated once under ``root/synthetic``) or "auto" (CIFAR-10 if present
            or downloadable, else synthetic; prints which and why).
        root: the data folder (default: $DDPM_DATA_DIR or <repo>/data).
        folder: the image folder for name="folder".
    """
    say = print if verbose else (lambda *a, **k: None)
    if name not in DATASET_CHOICES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {DATASET_CHOICES}")
    root = Path(root) if root is not None else data_dir()
    if name == "auto":
        if _cifar10_present(root):
            say(f"dataset: CIFAR-10 (found in {root / 'cifar-10-batches-py'})")
            return CIFAR10Images(root, download=False)
        if download and cifar10_reachable():
            say(f"dataset: CIFAR-10 (not in {root}; downloading it, 170 MB)")
            return CIFAR10Images(root, download=True)
        say(
            f"dataset: synthetic ({synthetic_size} generated images) - CIFAR-10 is not in {root} "
            f"and its host is unreachable. Run `make cifar10` with internet access to use the real data."
        )
        name = "synthetic"
    if name == "cifar10":
        return CIFAR10Images(root, download=download)
    if name == "synthetic":
        return FolderImages(make_synthetic(root, n=synthetic_size, progress=verbose))
    if folder is None:
        raise DatasetError("dataset='folder' needs folder=<path to a folder of PNG/JPEG images>")
    return FolderImages(folder)


def describe_dataset(dataset: Dataset) -> str:
    """What a dataset is, for figure titles: "50,000 CIFAR-10 images", "10,000 generated synthetic images", ...

    No parentheses of its own: the titles and tables that quote it often put it inside theirs."""
    if isinstance(dataset, CIFAR10Images):
        return f"{len(dataset):,} CIFAR-10 images"
    if isinstance(dataset, FolderImages):
        if (dataset.root / "MANIFEST.json").is_file() and dataset.root.parent.name == "synthetic":
            return f"{len(dataset):,} generated synthetic images"
        return f"{len(dataset):,} images from the folder {dataset.root.name}/"
    return f"{len(dataset):,} {type(dataset).__name__} images"


def dataset_as_tensor(dataset: Dataset, progress: bool = True) -> torch.Tensor:
    """All images of ``dataset`` as one N x 3 x H x W uint8 tensor.

    A folder of PNGs is decoded once per dataset object: the tensor is kept on the dataset, so
    every device-resident loader made from it later (notebook 09 builds several) reuses it.
    """
    if hasattr(dataset, "as_tensor"):
        return dataset.as_tensor()
    cached = getattr(dataset, "_decoded", None)
    if isinstance(cached, torch.Tensor) and len(cached) == len(dataset):
        return cached
    from tqdm.auto import tqdm

    items = [dataset[i] for i in tqdm(range(len(dataset)), desc="decoding dataset", disable=not progress, leave=False)]
    out = torch.stack(items)
    try:
        dataset._decoded = out
    except AttributeError:  # a dataset class with __slots__: decode again next time
        pass
    return out


# ------------------------------------------------------------------------------ sampling
class EpochSampler(Sampler):
    """Shuffled indices with a flip decision each, fixed by (seed, epoch): yields (index, flip).

    Like ``DistributedSampler`` it gives rank r the slice r::world of one shared permutation (the
    tail that does not divide evenly is dropped so all ranks take the same number of steps).
    Unlike it, it also decides the random horizontal flip, so augmentation does not depend on
    worker RNG, and ``set_epoch(epoch, start=k)`` resumes an epoch at its k-th sample.
    """

    def __init__(self, n: int, *, seed: int = 0, rank: int = 0, world_size: int = 1, shuffle: bool = True, flip: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.n, self.seed, self.rank, self.world = n, seed, rank, world_size
        self.shuffle, self.flip = shuffle, flip
        self.per_rank = n // world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def epoch_plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (indices, flips) for the current epoch, as CPU tensors."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        perm = torch.randperm(self.n, generator=g) if self.shuffle else torch.arange(self.n)
        flips = torch.rand(self.n, generator=g) < 0.5 if self.flip else torch.zeros(self.n, dtype=torch.bool)
        sl = slice(self.rank, self.per_rank * self.world, self.world)
        return perm[sl], flips[sl]

    def __iter__(self) -> Iterator[tuple[int, bool]]:
        idx, flips = self.epoch_plan()
        return iter(zip(idx[self.start:].tolist(), flips[self.start:].tolist()))

    def __len__(self) -> int:
        return self.per_rank - self.start


class _Augmented(Dataset):
    """Applies the training transforms to (index, flip) keys: flip, then (mode="float") scale to [-1, 1]."""

    def __init__(self, base: Dataset, to_float: bool):
        self.base, self.to_float = base, to_float

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key: tuple[int, bool]) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as TF

        index, flip = key
        img = self.base[index]
        if flip:
            img = TF.horizontal_flip(img)
        if self.to_float:
            img = normalize(img)
        return img


def normalize(x: torch.Tensor) -> torch.Tensor:
    """uint8 [0, 255] -> float32 [-1, 1] (works on CPU in a worker or on the device)."""
    return x.float().mul_(2.0 / 255.0).sub_(1.0)


# ------------------------------------------------------------------------------ loaders
class Loader:
    """Batches of float32 images in [-1, 1], already on ``device``; one ``iter()`` is one epoch."""

    def __init__(self, dataset: Dataset, batch_size: int, device: torch.device, mode: str, *,
                 num_workers: int, pin_memory: bool, persistent_workers: bool,
                 prefetch_factor: int | None, non_blocking: bool, sampler: EpochSampler, drop_last: bool = True):
        self.dataset, self.batch_size, self.device, self.mode = dataset, batch_size, device, mode
        self.sampler, self.non_blocking, self.drop_last = sampler, non_blocking, drop_last
        self.loader = DataLoader(
            _Augmented(dataset, to_float=(mode == "float")),
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,  # True (default): fixed batch shape, so no recompiles and no odd last step
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            # Its own generator: creating an iterator must not draw from the global RNG, or a
            # resumed run (new iterator mid-epoch) would get different dropout masks.
            generator=torch.Generator().manual_seed(sampler.seed),
        )

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch's shuffle and skip its first ``start_batch`` batches (for resume)."""
        self.sampler.set_epoch(epoch, start_batch * self.batch_size)

    def __len__(self) -> int:
        return _batches(self.sampler.per_rank, self.batch_size, self.drop_last)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for batch in self.loader:
            batch = batch.to(self.device, non_blocking=self.non_blocking)
            yield normalize(batch) if self.mode == "uint8" else batch


class DeviceLoader:
    """The whole uint8 dataset as one tensor on the device; shuffle, flip and normalize happen there."""

    def __init__(self, images: torch.Tensor, batch_size: int, device: torch.device, sampler: EpochSampler,
                 drop_last: bool = True):
        self.images = images.to(device)
        self.batch_size, self.device, self.sampler, self.drop_last = batch_size, device, sampler, drop_last
        self.mode = "device"

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_batch * self.batch_size)

    def __len__(self) -> int:
        return _batches(self.sampler.per_rank, self.batch_size, self.drop_last)

    def __iter__(self) -> Iterator[torch.Tensor]:
        idx, flips = self.sampler.epoch_plan()  # one small index copy per epoch
        idx, flips = idx.to(self.device), flips.to(self.device)
        for b in range(self.sampler.start // self.batch_size, len(self)):
            sl = slice(b * self.batch_size, (b + 1) * self.batch_size)
            x = self.images.index_select(0, idx[sl])
            x = torch.where(flips[sl, None, None, None], x.flip(-1), x)
            yield normalize(x)


def _batches(n: int, batch_size: int, drop_last: bool) -> int:
    """Batches in an epoch of ``n`` samples: the last, smaller one is dropped or kept."""
    return n // batch_size if drop_last else -(-n // batch_size)


def forever(loader: "Loader | DeviceLoader", start_epoch: int = 0) -> Iterator[torch.Tensor]:
    """Batches of ``loader`` without end, moving to the next epoch (new shuffle and flips) each time
    one is exhausted: for benchmarks and short training loops that count steps, not epochs."""
    epoch = start_epoch
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def check_shared_memory(num_workers: int, prefetch: int, batch_size: int, mode: str = "float",
                        shm: str | os.PathLike = "/dev/shm") -> None:
    """Refuse, before any worker starts, a loader whose batches in flight cannot fit in shared memory.

    DataLoader workers hand their batches to the main process through shared memory (``/dev/shm`` on Linux):
    up to ``num_workers * prefetch`` of them at once. A container's default ``/dev/shm`` (64 MiB under Docker)
    holds fewer than that at a large batch, and the workers then die with a bus error in the middle of a run.
    Where the folder does not exist (macOS, Windows) there is nothing to check.
    """
    try:
        free = shutil.disk_usage(shm).free
    except OSError:
        return
    per_image = 3 * IMAGE_SIZE * IMAGE_SIZE * (4 if mode == "float" else 1)
    need = (num_workers * prefetch + 1) * batch_size * per_image  # every batch in flight, and the one being received
    if need > free:
        mib = 2**20
        raise RuntimeError(
            f"{num_workers} DataLoader workers with prefetch_factor {prefetch} at batch {batch_size} ({mode} batches) "
            f"need about {need / mib:.0f} MiB of shared memory in {shm}, and it has {free / mib:.0f} MiB free. "
            "Lower num_workers or prefetch_factor, use mode='uint8' (a quarter of the bytes), or give the machine more "
            "shared memory (in a Docker container: `docker run --shm-size=1g ...`).")


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    device: torch.device | str = "cpu",
    mode: str = "float",
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    non_blocking: bool | None = None,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    flip: bool = True,
    drop_last: bool = True,
) -> Loader | DeviceLoader:
    """An epoch iterable of training batches (float32 in [-1, 1], on ``device``).

    Args:
        mode: "float" (normalize in workers), "uint8" (copy uint8, normalize on the device) or
            "device" (whole dataset resident on the device; no DataLoader, no workers).
        num_workers, pin_memory, persistent_workers, prefetch_factor: passed to DataLoader.
        non_blocking: asynchronous host-to-device copies (default: on when pin_memory is on).
        seed, rank, world_size: the shuffle, and this process's shard under DDP.
        drop_last: drop the last, smaller batch of each epoch (default). Every batch then has one
            shape: a compiled step never recompiles for it (notebook 04, Exercise 3 turns it off).
    """
    if mode not in LOADER_MODES:
        raise ValueError(f"loader mode must be one of {LOADER_MODES}, got {mode!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if prefetch_factor is not None and num_workers == 0:
        raise ValueError("prefetch_factor only applies with num_workers > 0; set num_workers or leave prefetch_factor=None")
    device = torch.device(device)
    sampler = EpochSampler(len(dataset), seed=seed, rank=rank, world_size=world_size, flip=flip)
    if sampler.per_rank < batch_size:
        raise ValueError(
            f"the dataset has {len(dataset)} images ({sampler.per_rank} per rank), fewer than one batch "
            f"of {batch_size}; lower batch_size or use a larger dataset"
        )
    if mode == "device":
        return DeviceLoader(dataset_as_tensor(dataset), batch_size, device, sampler, drop_last=drop_last)
    if pin_memory and device.type != "cuda":
        pin_memory = False  # pinning only helps host-to-GPU copies
    if num_workers:
        check_shared_memory(num_workers, prefetch_factor or 2, batch_size, mode)
    return Loader(
        dataset, batch_size, device, mode,
        num_workers=num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor,
        non_blocking=pin_memory if non_blocking is None else non_blocking,
        sampler=sampler, drop_last=drop_last,
    )
