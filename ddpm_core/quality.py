"""Quality preserved: does the fast configuration train as well as the plain fp32 baseline?

    r = quality.run(steps=1000, batch_size=128)      # 3 baseline seeds + the fast run, minutes on a GPU
    print(r.verdict())
    plots.quality_band(r)

The baseline trains once per seed; ``TrainConfig.fast`` trains once, with the first seed, the same
batch size and the same number of steps. Speed settings change how a step runs, not what it sees:
with the same seed both arms start from the same weights (``torch.manual_seed`` before the model
is built), see the same images in the same order with the same flips (``EpochSampler`` decides
shuffle and flips from (seed, epoch) for the float and the device-resident loader alike), and draw
the same t and noise (the trainer's generator), and in eager mode the same dropout masks. What is
left is rounding (bf16, other kernels) and, where ``torch.compile`` runs (on a GPU), dropout masks
drawn by Inductor's own generator (``torch._inductor.config.fallback_random`` is off). The question
is whether their effect is smaller than the effect of changing the seed.

Three pieces of evidence, as the issue asks: the training loss curves against the band the
baseline seeds span; the EMA model's loss on held-out images with fixed t and noise; sample grids.
The band comparison is done twice, because the fast run is a near copy of one band member (its
same-seed twin): where the twin draws the band's edge, rounding alone puts the fast curve outside
half the time. So besides the share of steps inside the band, ``within_spread`` is the share of
steps where the fast run's gap to its twin is no larger than the seeds' spread (high - low).
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

MIN_STEPS = 10  # fewer leaves no curve to smooth and no band worth the name
SKIP = 0.1  # the first tenth of the steps (warm-up, the loss falling fast) is not judged
PASS_SHARE = 0.9  # "stays inside": at least this share of the judged steps
HELDOUT_SEED = 1  # the held-out synthetic set; the training set is generated with seed 0
DATASETS = ("auto", "cifar10", "synthetic")


# ------------------------------------------------------------------------------ the band (pure)
def smooth(curve: Sequence[tuple[int, float]], window: int):
    """A loss curve [(step, loss)] as a pandas Series indexed by step, with a trailing rolling mean
    of ``window`` steps (per-step losses swing with the batch's t; the mean shows the trend)."""
    import pandas as pd

    s = pd.Series([float(v) for _, v in curve], index=[int(k) for k, _ in curve], dtype=float)
    return s.rolling(max(1, int(window)), min_periods=1).mean()


def step_noise(values: Sequence[float]) -> float:
    """A loss curve's step-to-step noise: the standard deviation of successive differences, over sqrt(2).

    For a loss that moves slowly plus independent noise per step, each difference is two draws of the noise, so this
    estimates the noise's standard deviation and counts almost none of the trend. The plain standard deviation of
    the values counts the descent itself as spread: a curve falling smoothly from 0.79 to 0.65 has a large one and
    almost no noise. NaN for fewer than 3 values."""
    v = [float(x) for x in values]
    if len(v) < 3:
        return float("nan")
    return statistics.stdev(b - a for a, b in zip(v, v[1:])) / math.sqrt(2)


def window_for(steps: int) -> int:
    """The smoothing window: a twentieth of the run, at least 3 steps (MIN_STEPS is 10)."""
    return max(3, steps // 20)


def band(baselines: Sequence[Sequence[tuple[int, float]]], fast: Sequence[tuple[int, float]], window: int,
         twin: int | None = 0, skip: float = SKIP):
    """Smooth every curve and compare the fast one with the baseline seeds' band.

    Returns ``(table, inside, within_spread)``: ``table`` has one row per step common to all
    curves (step, low, high, fast, twin, judged); ``inside`` is the share of judged steps (after
    the first ``skip`` of them) where low <= fast <= high; ``within_spread`` the share where
    ``|fast - twin| <= high - low``, ``twin`` being the index of the baseline run with the fast
    run's seed (None: no twin, and ``within_spread`` is NaN).
    """
    import pandas as pd

    if len(baselines) < 2:
        raise ValueError(f"a band needs at least 2 baseline runs, got {len(baselines)}")
    curves = pd.concat([smooth(c, window) for c in baselines], axis=1, join="inner")
    f = smooth(fast, window)
    common = curves.index.intersection(f.index)
    if len(common) == 0:
        raise ValueError("the fast curve and the baseline curves have no step in common")
    curves, f = curves.loc[common], f.loc[common]
    steps = pd.Series(common, index=common)
    table = pd.DataFrame({"step": common, "low": curves.min(axis=1).values, "high": curves.max(axis=1).values,
                          "fast": f.values, "twin": curves.iloc[:, twin].values if twin is not None else float("nan"),
                          "judged": (steps > steps.min() + skip * (steps.max() - steps.min())).values})
    judged = table[table["judged"]] if table["judged"].any() else table
    inside = float(((judged["fast"] >= judged["low"]) & (judged["fast"] <= judged["high"])).mean())
    within = (float(((judged["fast"] - judged["twin"]).abs() <= judged["high"] - judged["low"]).mean())
              if twin is not None else float("nan"))
    return table.reset_index(drop=True), inside, within


# ------------------------------------------------------------------------------ the result
@dataclass
class QualityResult:
    """Everything ``run`` measured; the band and the verdict's numbers are computed from ``curves``
    and ``heldout`` on construction, so a result assembled by hand (tests, a reloaded run) is
    judged by the same code. ``curves`` and ``samples`` are keyed by arm name; ``arms`` gives each
    arm's kind ("baseline" or "fast"), seed, precision and, for the fast arm, its same-seed twin."""

    curves: dict[str, list[tuple[int, float]]]
    heldout: Any  # rows or a DataFrame: arm, kind, seed, weights ("EMA" or "raw"), loss
    arms: dict[str, dict[str, Any]]
    config: dict[str, Any]
    label: str
    device_name: str
    seconds: dict[str, float] = field(default_factory=dict)
    samples: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    window: int | None = None  # None: window_for(steps)
    dataset: str = ""
    configs: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)  # each arm's TrainConfig
    band: Any = field(init=False, repr=False)  # DataFrame: step, low, high, fast, twin, judged
    inside: float = field(init=False)
    within_spread: float = field(init=False)
    heldout_inside: bool = field(init=False)

    def __post_init__(self) -> None:
        import pandas as pd

        self.heldout = pd.DataFrame(self.heldout)
        base, fast = self._names("baseline"), self._names("fast")
        if len(fast) != 1 or len(base) < 2:
            raise ValueError(f"a quality result needs one fast arm and at least 2 baseline arms, got {self.arms}")
        twin = self.arms[fast[0]].get("twin")
        self.window = self.window or window_for(len(self.curves[fast[0]]))
        self.band, self.inside, self.within_spread = band(
            [self.curves[n] for n in base], self.curves[fast[0]], self.window, twin=base.index(twin) if twin in base else None)
        lo, hi = self.heldout_range
        self.heldout_inside = bool(lo <= self.heldout_loss(fast[0]) <= hi)

    def _names(self, kind: str) -> list[str]:
        return [n for n, a in self.arms.items() if a["kind"] == kind]

    def heldout_loss(self, arm: str, weights: str = "EMA") -> float:
        h = self.heldout
        return float(h.loc[(h["arm"] == arm) & (h["weights"] == weights), "loss"].iloc[0])

    @property
    def heldout_range(self) -> tuple[float, float]:
        """(min, max) of the baseline seeds' held-out EMA losses."""
        losses = [self.heldout_loss(n) for n in self._names("baseline")]
        return min(losses), max(losses)

    @property
    def heldout_gap(self) -> float:
        """|fast - its same-seed twin| in held-out EMA loss (NaN without a twin)."""
        fast = self._names("fast")[0]
        twin = self.arms[fast]["twin"]
        return abs(self.heldout_loss(fast) - self.heldout_loss(twin)) if twin is not None else float("nan")

    @property
    def loss_rule(self) -> bool:
        """The training-loss half of the twin test: the fast run's smoothed loss within the seeds' spread of its twin's
        at PASS_SHARE of the judged steps (False without a twin)."""
        return math.isfinite(self.within_spread) and self.within_spread >= PASS_SHARE

    @property
    def heldout_rule(self) -> bool:
        """The held-out half of the twin test: the fast run's held-out EMA loss no further from its twin's than the
        seeds' held-out losses spread (False without a twin)."""
        lo, hi = self.heldout_range
        return math.isfinite(self.heldout_gap) and self.heldout_gap <= hi - lo

    @property
    def passed(self) -> bool:
        """Going fast changes the loss less than changing the seed does: the fast run's gap to its
        same-seed twin is within the seeds' spread at PASS_SHARE of the judged steps, and on the
        held-out batches (``loss_rule`` and ``heldout_rule``). Without a twin: the plain band test (inside at
        PASS_SHARE, held-out inside the seeds' range)."""
        if math.isfinite(self.within_spread):
            return self.loss_rule and self.heldout_rule
        return self.inside >= PASS_SHARE and self.heldout_inside

    def verdict(self) -> str:
        """The result in words, every number taken from this result."""
        fast = self._names("fast")[0]
        seeds, twin = len(self._names("baseline")), self.arms[fast]["twin"]
        lo, hi = self.heldout_range
        ho = self.heldout_loss(fast)
        where = "inside" if self.heldout_inside else "below" if ho < lo else "above"
        window = f"{self.window} step{'s' if self.window != 1 else ''}"
        band = (f"the fast run's smoothed loss (rolling mean of {window}, first {100 * SKIP:.0f}% not judged) is "
                f"inside the baseline's {seeds}-seed band at {100 * self.inside:.0f}% of the judged steps and outside it at "
                f"{100 * (1 - self.inside):.0f}%, and its held-out EMA loss {ho:.5f} is {where} the baseline seeds' "
                f"{lo:.5f}-{hi:.5f}")
        if twin is None or not math.isfinite(self.within_spread):
            return (f"{'Quality preserved' if self.passed else 'Quality NOT shown to be preserved'}: {band}.")
        gap, spread = self.heldout_gap, hi - lo
        head = ("Going fast changes the loss less than changing the seed" if self.passed else
                "Going fast changes the loss MORE than changing the seed")
        s = (f"{head}: the fast run's smoothed loss is within the seeds' spread (the band's width) of its same-seed "
             f"twin, {twin}, at {100 * self.within_spread:.0f}% of the judged steps, and its held-out EMA loss {ho:.5f} differs "
             f"from the twin's {self.heldout_loss(twin):.5f} by {gap:.5f}, {'within' if self.heldout_rule else 'outside'} the "
             f"seeds' spread {spread:.5f}. "
             f"Against the band itself, {band}.")
        if self.passed and (self.inside < PASS_SHARE or not self.heldout_inside):
            s += (" The fast run copies its twin's data, t and noise, so wherever the twin draws the band's edge, "
                  "rounding alone puts it on either side: the twin comparison is the one that measures the change.")
        return s

    def rows(self) -> list[dict[str, Any]]:
        """One row per arm for ``results.append("quality", rows)``, labelled with the device."""
        out = []
        for name, arm in self.arms.items():
            steps = len(self.curves[name])
            row = {"variant": name, "kind": arm["kind"], "seed": arm["seed"], "precision": arm["precision"],
                   "device_name": self.device_name, "torch_version": torch.__version__, "device_label": self.label,
                   "dataset": self.dataset, "steps": steps, "batch_size": self.config.get("batch_size"),
                   "train_seconds": self.seconds.get(name),
                   "final_loss_smoothed": float(smooth(self.curves[name], self.window).iloc[-1]),
                   "heldout_ema_loss": self.heldout_loss(name, "EMA"), "heldout_raw_loss": self.heldout_loss(name, "raw"),
                   "config": self.configs.get(name, {})}
            if arm["kind"] == "fast":
                row.update(band_inside=self.inside, within_spread=self.within_spread, heldout_inside=self.heldout_inside,
                           heldout_gap=self.heldout_gap, heldout_spread=self.heldout_range[1] - self.heldout_range[0],
                           passed=self.passed)
            out.append(row)
        return out


# ------------------------------------------------------------------------------ held-out data
def heldout_images(dataset: str, root: str | None, n: int, progress: bool = False) -> torch.Tensor:
    """``n`` uint8 images that training never sees: CIFAR-10's test split, or for the synthetic
    data a set generated with another seed (the training set is seed 0)."""
    from .data import CIFAR10Images, FolderImages, dataset_as_tensor, make_synthetic

    if dataset == "cifar10":
        images = CIFAR10Images(root, train=False).as_tensor()
        if len(images) < n:
            raise ValueError(f"CIFAR-10's test split has {len(images):,} images, fewer than the {n:,} asked for "
                             f"(heldout_batches x batch_size). Fix: fewer heldout_batches.")
    else:
        images = dataset_as_tensor(FolderImages(make_synthetic(root, n=n, seed=HELDOUT_SEED, progress=progress)),
                                   progress=False)
    return images[:n]


def fixed_batches(images: torch.Tensor, batch_size: int, timesteps: int, seed: int = 0
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x0, t, noise) batches drawn once from a fixed generator, so every arm is scored on the same
    noisy images: a difference between arms is then the models', not the draw's."""
    from .data import normalize

    g = torch.Generator().manual_seed(seed)
    out = []
    for x in normalize(images).split(batch_size):
        t = torch.randint(0, timesteps, (x.shape[0],), generator=g)
        out.append((x, t, torch.randn(x.shape, generator=g)))
    return out


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, diffusion, batches, device: torch.device) -> float:
    """The mean loss of ``model`` over ``batches`` in eval mode (no dropout), in fp32 with TF32 off,
    whatever precision the model trained in: the arms are scored by one yardstick."""
    from .train import backend_flags

    was = model.training
    model.eval()
    try:
        with backend_flags(tf32=False, cudnn_benchmark=False):
            losses = [diffusion.loss(model, x.to(device), t.to(device), n.to(device)).item() for x, t, n in batches]
    finally:
        model.train(was)
    return sum(losses) / len(losses)


# ------------------------------------------------------------------------------ the run
def _slug(name: str) -> str:
    """"baseline (fp32, seed 0)" -> "baseline-fp32-seed-0": the arm's folder and file names."""
    return re.sub(r"[^0-9A-Za-z]+", "-", name).strip("-")


def check_args(*, steps: int, batch_size: int, seeds: Sequence[int], heldout_batches: int, n_samples: int,
               sample_steps: int | None, dataset: str, timesteps: int = 1000) -> None:
    """Raise a ValueError naming the problem and the fix, before anything is trained."""
    def whole(name: str, v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be a whole number, got {v!r}")

    for name, v in (("steps", steps), ("batch_size", batch_size), ("heldout_batches", heldout_batches),
                    ("n_samples", n_samples)):
        whole(name, v)
    if steps < MIN_STEPS:
        raise ValueError(f"steps must be >= {MIN_STEPS} to smooth the curves and judge them against a band, got {steps}. "
                         f"Fix: steps={MIN_STEPS} or more (a run of minutes on a GPU: about 1000).")
    for name, v in (("batch_size", batch_size), ("heldout_batches", heldout_batches), ("n_samples", n_samples)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    seeds = list(seeds)
    for s in seeds:
        whole("each seed", s)
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise ValueError(f"the band needs at least 2 different baseline seeds, got {seeds}. Fix: seeds=(0, 1, 2).")
    if sample_steps is not None:
        whole("sample_steps", sample_steps)
        if not 1 <= sample_steps <= timesteps:
            raise ValueError(f"sample_steps must be in 1..{timesteps} or None (the full chain), got {sample_steps}")
    if dataset not in DATASETS:
        hint = (" The check needs images training never sees: CIFAR-10's test split, or a synthetic set drawn "
                "with another seed; a folder of images has neither." if dataset == "folder" else "")
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}.{hint}")


def run(*, model: str = "ddpm-cifar10", steps: int, batch_size: int = 128, seeds: Sequence[int] = (0, 1, 2),
        lr: float = 2e-4, warmup_steps: int | None = None, ema_decay: float | None = 0.999, dataset: str = "auto",
        data_root: str | None = None, synthetic_size: int | None = None, heldout_batches: int = 4,
        n_samples: int = 16, sample_steps: int | None = None, device: str = "auto",
        out_dir: str | Path | None = None, progress: bool = True) -> QualityResult:
    """Train the baseline once per seed and the fast configuration once (seed ``seeds[0]``), all for
    ``steps`` steps of ``batch_size`` images, and compare them (see the module's docstring).

    ``warmup_steps`` None: a tenth of ``steps`` (the paper's 5000 outlasts a run of minutes).
    ``ema_decay`` 0.999 as in notebook 01: the paper's 0.9999 averages over ~10,000 steps, so after a
    few thousand the EMA would still be mostly its initial weights. ``synthetic_size`` None: the
    data module's default. Each arm trains from scratch in ``<out_dir>/<arm>`` (default:
    ``runs/quality``), whose previous contents are replaced.
    """
    from tqdm.auto import tqdm

    from .data import SYNTHETIC_SIZE, CIFAR10Images, get_dataset
    from .env import device_name, label
    from .paths import runs_dir
    from .train import TrainConfig, resolve_device, train

    check_args(steps=steps, batch_size=batch_size, seeds=seeds, heldout_batches=heldout_batches,
               n_samples=n_samples, sample_steps=sample_steps, dataset=dataset)
    dev = resolve_device(device)  # before TrainConfig.fast, which asks a GPU for its memory
    seeds = list(seeds)
    warmup = steps // 10 if warmup_steps is None else warmup_steps
    common = dict(model=model, batch_size=batch_size, steps=steps, lr=lr, warmup_steps=warmup, ema_decay=ema_decay,
                  data_root=data_root, synthetic_size=synthetic_size or SYNTHETIC_SIZE, device=device,
                  resume=False, checkpoint_every=steps, keep_checkpoints=1, progress=False)
    # Every config is built (and so checked) before any work: a bad lr fails now, not after 3 arms.
    plan = [(f"baseline (fp32, seed {s})", "baseline", TrainConfig(seed=s, dataset=dataset, **common)) for s in seeds]
    fast_cfg = TrainConfig.fast(seed=seeds[0], dataset=dataset, **common)
    plan.append((f"fast ({fast_cfg.precision}, seed {seeds[0]})", "fast", fast_cfg))
    base = Path(out_dir) if out_dir is not None else runs_dir() / "quality"
    if base.exists() and not base.is_dir():
        raise ValueError(f"out_dir {base} is a file; pass a folder (each arm trains in a subfolder of it)")

    # "auto" is resolved once, so every arm trains on the same data even if the network comes and goes.
    data = get_dataset(dataset, root=data_root, synthetic_size=common["synthetic_size"], verbose=progress)
    name = "cifar10" if isinstance(data, CIFAR10Images) else "synthetic"
    del data
    images = heldout_images(name, data_root, heldout_batches * batch_size, progress=progress)
    batches = fixed_batches(images, batch_size, plan[0][2].timesteps)

    curves, samples, seconds, arms, configs, rows, described = {}, {}, {}, {}, {}, [], ""
    twin_name = plan[0][0]
    for arm, kind, cfg in tqdm(plan, desc="quality arms", disable=not progress):
        cfg.dataset, cfg.out_dir = name, str(base / _slug(arm))
        shutil.rmtree(cfg.out_dir, ignore_errors=True)
        result = train(cfg)
        t = result.trainer
        curves[arm], seconds[arm], configs[arm], described = result.losses, result.seconds, asdict(cfg), result.dataset
        arms[arm] = {"kind": kind, "seed": cfg.seed, "precision": cfg.precision,
                     "twin": twin_name if kind == "fast" else None}
        for weights, net in (("EMA", t.ema.model if t.ema is not None else t.model), ("raw", t.model)):
            rows.append({"arm": arm, "kind": kind, "seed": cfg.seed, "weights": weights,
                         "loss": heldout_loss(net, t.diffusion, batches, t.device)})
        if arm == twin_name or kind == "fast":
            samples[arm] = t.sample(n_samples, steps=sample_steps, seed=0, progress=False).cpu()
        del t, result, net  # free this arm's weights and optimizer state before the next arm builds its own
    config = dict(model=model, steps=steps, batch_size=batch_size, seeds=seeds, lr=lr, warmup_steps=warmup,
                  ema_decay=ema_decay, dataset=name, heldout_batches=heldout_batches, n_samples=n_samples,
                  sample_steps=sample_steps, device=str(dev), out_dir=str(base))
    return QualityResult(curves=curves, heldout=rows, arms=arms, config=config, label=label(dev),
                         device_name=device_name(dev), seconds=seconds, samples=samples, dataset=described,
                         configs=configs)


# ------------------------------------------------------------------------------ command line
def main(argv: list[str] | None = None) -> int:
    """Run the check, print the verdict, append the rows to ``data/results/quality.csv`` (or
    ``--out``) and write the band figure and the two sample grids to the figures folder."""
    from . import plots, results
    from .data import DatasetError

    p = argparse.ArgumentParser(prog="python -m ddpm_core.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny model on synthetic data, 30 steps of 8: a CPU check")
    p.add_argument("--steps", type=int, default=None, help="steps per arm (default: 1000; 30 with --smoke)")
    p.add_argument("--batch-size", type=int, default=None, help="per step, every arm (default: 128; 8 with --smoke)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="baseline seeds; the fast run uses the first")
    p.add_argument("--dataset", choices=DATASETS, default=None, help="default: auto (synthetic with --smoke)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help="results CSV to append to (default: data/results/quality.csv)")
    args = p.parse_args(argv)
    kw: dict[str, Any] = (dict(model="tiny", steps=30, batch_size=8, lr=1e-3, warmup_steps=0, ema_decay=0.9,
                               dataset="synthetic", synthetic_size=512, n_samples=4, sample_steps=5)
                          if args.smoke else dict(steps=1000))
    kw.update({k: v for k, v in dict(steps=args.steps, batch_size=args.batch_size, dataset=args.dataset).items()
               if v is not None})
    try:
        r = run(seeds=tuple(args.seeds), device=args.device, **kw)
    except (ValueError, TypeError, DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{r.label}{' (smoke)' if args.smoke else ''}")
    print(r.verdict())
    print("results:", results.append("quality", [{**row, "smoke": args.smoke} for row in r.rows()], path=args.out))
    print("figure:", plots.savefig(plots.quality_band(r), "quality_band.png"))
    steps = r.config["steps"]
    for name, images in r.samples.items():
        print("samples:", plots.save_image_grid(images, f"quality_samples_{_slug(name)}.png",
                                                title=f"{name}: EMA samples after {steps} steps\n{r.label}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
