"""Our training step side by side with what a reader would otherwise use: the diffusers and the
lucidrains implementations of the same DDPM training, measured in one process, in interleaved rounds.

    python -m ddpm_core.bench_peers                 # on the GPU at hand: the paper's model, batch sized to it
    python -m ddpm_core.bench_peers --smoke         # a CPU check of the whole path with small models

Contenders (each a full training step: noise, forward, loss, backward, clipping, optimizer, EMA):

- ``ours (baseline)``: ``TrainConfig()`` (fp32, eager, math attention), the series' starting point;
- ``ours (fast)``: ``TrainConfig.fast()``, where the series ends;
- ``diffusers``: ``UNet2DModel`` with the configuration of ``google/ddpm-cifar10-32`` (the paper's model
  as diffusers publishes it: same channels, attention at 16x16, so the same FLOPs), trained the way
  diffusers' ``examples/unconditional_image_generation/train_unconditional.py`` does: ``DDPMScheduler``
  (linear betas) ``add_noise``, MSE on the noise, AdamW (lr 1e-4, betas 0.95/0.999, weight decay 1e-6),
  clipping at 1, ``EMAModel`` (0.9999), under bf16 autocast (its ``--mixed_precision bf16``; on a GPU without
  bf16 hardware, such as a T4, fp16 autocast with a GradScaler, as accelerate runs ``--mixed_precision fp16``);
- ``lucidrains``: ``denoising-diffusion-pytorch``'s ``Unet(dim=64, dim_mults=(1, 2, 4, 8), flash_attn=True)``
  and ``GaussianDiffusion(timesteps=1000)`` as its README configures them, at 32x32, trained the way its
  ``Trainer`` does: Adam (lr 8e-5, betas 0.9/0.99), clipping at 1, ``ema_pytorch.EMA`` (0.995, every 10
  steps), under bf16 autocast (its ``mixed_precision_type="bf16"``; fp16 with a GradScaler where the GPU has no
  bf16, as diffusers'). A different network: its FLOPs
  are counted on its own step, so TFLOP/s and MFU compare, images/s only roughly.

TFLOP/s come from each step's own FLOP count (``torch.utils.flop_counter``), MFU against the dense bf16
peak of the GPU named in ``bench.PEAK_TFLOPS``, and against the ceiling measured on the same device
(``ddpm_core.ceiling``: the paper model's own convolutions timed alone): the datasheet says how far
a step is from the hardware's best case, the ceiling how much of that a framework could still win.
The ceiling applies to the paper's network (ours and diffusers'); lucidrains' is another network,
and so is diffusers' small smoke-mode UNet. diffusers and denoising-diffusion-pytorch are
benchmark-only extras (``pip install -e ".[peers]"``), not dependencies of the notebooks; a missing
one is reported and skipped.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import bench
from .env import label

SMOKE_DIFFUSERS = {"block_out_channels": [32, 64, 64, 64], "norm_num_groups": 8}  # a small UNet2DModel for CPU checks
SMOKE_LUCIDRAINS = {"dim": 16}


def _batch(batch_size: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(batch_size, 3, 32, 32, generator=g) * 2 - 1).to(device)


def _autocast(device: torch.device, precision: str):
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=precision in ("bf16", "fp16"))


def _scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """The loss scaler accelerate uses under fp16 (a pass-through otherwise)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def ours(fast: bool, batch_size: int, device: torch.device, smoke: bool) -> tuple[Callable[[], Any], str, int]:
    """Our baseline or ``TrainConfig.fast()`` step at ``batch_size``: (step, precision, FLOPs per step)."""
    from .train import TrainConfig, build

    common = dict(batch_size=batch_size, device=str(device), dataset="synthetic", progress=False)
    if smoke:
        common["model"] = "tiny"
    cfg = TrainConfig.fast(**common) if fast else TrainConfig(**common)
    t = build(cfg)
    x = _batch(batch_size, t.device)
    # Counted on the trainer's method, so that a compiled step is counted eagerly (bench.count_flops). A partial of
    # the method, not a lambda: bench sees the trainer through it (a CUDA-graph step's memory is its graph pool).
    return functools.partial(t.train_step, x), cfg.precision, bench.count_flops(t.train_step, x)


def diffusers_step(batch_size: int, device: torch.device, smoke: bool, precision: str) -> Callable[[], Any]:
    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.training_utils import EMAModel

    from .pretrained import CONFIG

    config = {**CONFIG, **(SMOKE_DIFFUSERS if smoke else {})}
    model = UNet2DModel(**config).to(device)
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.95, 0.999), weight_decay=1e-6, eps=1e-8)
    ema = EMAModel(model.parameters(), decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=3 / 4)
    ema.to(device)
    scaler = _scaler(device, precision)
    clean = _batch(batch_size, device)

    def step() -> torch.Tensor:
        model.train()
        noise = torch.randn(clean.shape, device=device)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (clean.shape[0],), device=device)
        noisy = scheduler.add_noise(clean, noise, timesteps)
        with _autocast(device, precision):
            pred = model(noisy, timesteps).sample
        loss = F.mse_loss(pred.float(), noise.float())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # clipping reads the true gradients (accelerate's clip_grad_norm_ unscales first)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        ema.step(model.parameters())
        return loss.detach()

    return step


def lucidrains_step(batch_size: int, device: torch.device, smoke: bool, precision: str) -> Callable[[], Any]:
    from denoising_diffusion_pytorch import GaussianDiffusion, Unet
    from ema_pytorch import EMA

    unet = Unet(dim=SMOKE_LUCIDRAINS["dim"] if smoke else 64, dim_mults=(1, 2, 4, 8), flash_attn=True)
    diffusion = GaussianDiffusion(unet, image_size=32, timesteps=1000).to(device)
    opt = torch.optim.Adam(diffusion.parameters(), lr=8e-5, betas=(0.9, 0.99))
    ema = EMA(diffusion, beta=0.995, update_every=10).to(device)
    images = (_batch(batch_size, device) + 1) / 2  # its GaussianDiffusion takes images in [0, 1]
    scaler = _scaler(device, precision)

    def step() -> torch.Tensor:
        with _autocast(device, precision):
            loss = diffusion(images)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(diffusion.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        ema.update()
        return loss.detach()

    return step


def contenders(batch_size: int, device: torch.device, smoke: bool, fast_batch: int | None = None
               ) -> tuple[list[bench.Variant], list[str]]:
    """The steps to compare, each with its own FLOP count; and a line per contender left out, with why.

    Every contender runs at ``batch_size``. ``fast_batch`` (where it differs) adds ``TrainConfig.fast()``
    at that batch too: the batch where its throughput saturates is part of the fast configuration.
    """
    from .env import cpu_bf16, mixed_precision

    # the fast step's 16-bit precision: bf16 (fp16 on a GPU without bf16 hardware), fp32 on a CPU without bf16 instructions
    peers_precision = mixed_precision(device) if device.type == "cuda" or cpu_bf16()[0] else "fp32"
    variants, skipped = [], []
    def peer(make: Callable[..., Callable[[], Any]]) -> tuple[Callable[[], Any], str, int]:
        fn = make(batch_size, device, smoke, peers_precision)
        return fn, peers_precision, bench.count_flops(fn)  # its own step, as FlopCounterMode sees it

    makers: list[tuple[str, Callable[[], tuple[Callable[[], Any], str, int]]]] = [
        ("ours (baseline)", lambda: ours(False, batch_size, device, smoke)),
        ("ours (fast)", lambda: ours(True, batch_size, device, smoke)),
        *([(f"ours (fast, batch {fast_batch})", lambda: ours(True, fast_batch, device, smoke))]
          if fast_batch and fast_batch != batch_size else []),
        ("diffusers", lambda: peer(diffusers_step)),
        ("lucidrains", lambda: peer(lucidrains_step)),
    ]
    for name, make in makers:
        try:
            fn, precision, flops = make()
        except ImportError as e:
            skipped.append(f"{name}: not installed ({e.name or e}); pip install -e '.[peers]'")
            continue
        except Exception as e:  # noqa: BLE001 - a peer that fails to build is reported, ours never hides an error
            if name.startswith("ours"):
                raise
            # e.g. diffusers' lazy modules turn a failed import of a dependency (a version that does not match this
            # torch) into a RuntimeError: the other contenders are still measured
            skipped.append(f"{name}: could not be built here ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                           "check its version against this torch (pip install -e '.[peers]')")
            continue
        b = fast_batch if name.startswith("ours (fast, batch") else batch_size
        variants.append(bench.Variant(name, fn, (), b, flops=flops, precision=precision))
    return variants, skipped


def run(batch_size: int | None = None, smoke: bool = False, rounds: int = 5, iters: int = 4, warmup: int = 5,
        device: str = "auto", fast_batch: int | None = None) -> tuple[bench.Comparison, list[str]]:
    """Every contender side by side at ``batch_size`` (default: the paper's 128 on a GPU of 24 GB or more, 64 on a
    smaller one; 16 on a CPU, 4 in smoke mode), and ``TrainConfig.fast()`` at ``fast_batch`` too (default
    on a GPU of 40 GB or more: the batch ``TrainConfig.fast()`` picks for its memory)."""
    from .env import gpu_memory_gib
    from .train import TrainConfig

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    if batch_size is None:
        # Every contender stays alive through the interleaved rounds: at 128 on a 16 GB card their states, the fp32
        # baseline's activations (about 6 GiB) and the fast step's CUDA-graph pool (4-5 GiB) would come to 13-15 GiB.
        batch_size = 4 if smoke else 16 if dev.type != "cuda" else 128 if gpu_memory_gib(str(dev)) >= 24 else 64
    if fast_batch is None and dev.type == "cuda" and not smoke and gpu_memory_gib(str(dev)) >= 40:
        # Below 40 GB the five contenders' states and CUDA-graph pools would not fit beside a second fast
        # batch: the fast configuration's own batch is then measured in notebook 09 only.
        fast_batch = TrainConfig.fast(device=str(dev)).batch_size
    variants, skipped = contenders(batch_size, dev, smoke, fast_batch)
    if not variants:
        raise RuntimeError("no contender could be built: " + "; ".join(skipped))
    comparison = bench.compare(variants, rounds=rounds, iters=iters, warmup=warmup, device=dev)
    del variants  # the contenders' trainers; on a GPU their compiled code and CUDA-graph pool too (free_memory says why)
    bench.free_memory(dev, compiled=dev.type == "cuda")
    return comparison, skipped


def same_network(name: str, smoke: bool) -> bool:
    """Whether contender ``name`` runs the network the ceiling was measured on: the paper's model (our
    tiny model in smoke mode, where diffusers runs a small UNet2DModel of its own)."""
    return name.startswith("ours (") or (name == "diffusers" and not smoke)


def ceiling_column(table, ceiling, smoke: bool, measurements: list[bench.Measurement]) -> str:
    """Add to ``table`` (a Comparison.table(), one row per measurement in order) each contender's share of the
    measured ceiling, from its unrounded TFLOP/s (to a whole percent, as "about", where the ceiling was noisy);
    return the column's name."""

    def share(variant: str, tflops: Any) -> str:
        if not same_network(variant, smoke):
            return "n/a (other network)"
        if tflops is None or tflops != tflops:
            return "n/a"
        # a ceiling timed on a noisy machine is rough: a whole percent, said to be approximate (the summary says why)
        return f"about {100 * tflops / ceiling.tflops:.0f}%" if ceiling.noisy else f"{100 * tflops / ceiling.tflops:.1f}%"

    name = f"of measured {ceiling.precision} ceiling"
    table[name] = [share(m.name, m.tflops) for m in measurements]
    return name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpm_core.bench_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="small models, few steps: a CPU check of the whole path")
    p.add_argument("--batch-size", type=int, default=None, help="per step (default: 128 on a GPU of 24 GB or more, 64 on a smaller one, 16 on a CPU, 4 in smoke)")
    p.add_argument("--fast-batch", type=int, default=None,
                   help="also TrainConfig.fast() at this batch (default on a GPU of 40 GB or more: the one it picks for it)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-ceiling", action="store_true", help="skip the measured ceiling (ddpm_core.ceiling)")
    p.add_argument("--out", default=None, help="append the rows to this results CSV (default: data/results/bench_peers.csv)")
    args = p.parse_args(argv)
    for flag, v in (("--batch-size", args.batch_size), ("--fast-batch", args.fast_batch)):
        if v is not None and v < 1:
            p.error(f"{flag} must be >= 1, got {v}")
    rounds = args.rounds or (3 if args.smoke else 5)  # 3 timed calls per contender in smoke: the fewest for a ratio
    comparison, skipped = run(args.batch_size, args.smoke, rounds=rounds, iters=1 if args.smoke else 4,
                              warmup=1 if args.smoke else 5, device=args.device, fast_batch=args.fast_batch)
    from . import results

    others = [m.name for m in comparison.measurements if not same_network(m.name, args.smoke)]  # compared by TFLOP/s
    table = comparison.table(by_work=others)
    columns = ["variant", "batch", "ms/step", "img/s", "TFLOP/s", "speedup", "MFU", "p10-p90 ms"]
    ceil = None
    if not args.no_ceiling:
        from . import ceiling

        # at the largest batch measured, as notebook 09b does: the yardstick of the fast step
        ceil = ceiling.measure("tiny" if args.smoke else "ddpm-cifar10", max(m.batch_size for m in comparison.measurements),
                               device=comparison.measurements[0].device,
                               iters=3 if args.smoke else 20, warmup=1 if args.smoke else 5,
                               matmul_n=256 if args.smoke else None, progress=False)
        columns.insert(-1, ceiling_column(table, ceil, args.smoke, comparison.measurements))
    print(f"{label(comparison.measurements[0].device)}{' (smoke)' if args.smoke else ''}")
    print(table[[c for c in columns if c in table]].to_string(index=False))  # a CPU table has no MFU column
    print(comparison.report(by_work=others).replace("**", ""))
    if ceil is not None:
        print(ceil.summary())
    for line in skipped:
        print("skipped:", line)
    extra = lambda m: {} if ceil is None else {  # noqa: E731
        "ceiling_tflops": ceil.tflops, "of_ceiling": m.tflops / ceil.tflops if same_network(m.name, args.smoke) and m.tflops else None}
    results.append("bench_peers", [{**m.row(), "variant": m.name, "smoke": args.smoke, **extra(m)}
                                   for m in comparison.measurements], path=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
