"""The measured ceiling: how fast this device runs *this model's own* convolutions, next to the datasheet.

MFU divides by a datasheet peak that no real kernel reaches: on the H100 the reference runs on, a
large bf16 matmul reaches about 800 of the datasheet's 989 TFLOP/s, and the UNet's convolutions
(3x3, 32x32 down to 4x4 images, 128 to 256 channels) reach less. This module measures what they do
reach, so that the gap between a training step and the datasheet splits in two:

- **what the framework can still win**: the step against the ceiling (memory-bound GroupNorm, SiLU
  and adds, launches, the optimizer, idle time: fusion, compilation and CUDA graphs attack these);
- **what only a better kernel could win**: the ceiling against the datasheet.

How it measures. One forward pass of the model at the given batch records every ``nn.Conv2d`` call
(input shape, weight shape, stride, padding, whether its input needs a gradient). Each distinct shape
is then timed alone, forward and backward (``conv2d`` and its gradients for input, weight and bias, as
in a training step), in the given precision and memory format, with cuDNN autotuning on (GPU). Its
FLOPs come from ``torch.utils.flop_counter``. The model's convolutions would take ``sum(count x time)``
at these rates; the rest of the step's FLOPs (attention, the time-embedding MLP) are charged at the
large-matmul rate. The ceiling of the step is its FLOPs over that time: no elementwise op, no launch
gap, no optimizer. A step can only approach it.

    python -m ddpm_core.ceiling                  # the paper's model on the GPU at hand (bf16, channels_last)
    python -m ddpm_core.ceiling --smoke          # the tiny model on a CPU, a check of the whole path
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from . import bench
from .env import label

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ConvShape:
    """One distinct convolution call of the model: what ``conv2d`` is given in a training step."""

    input: tuple[int, int, int, int]  # N, C, H, W
    weight: tuple[int, int, int, int]  # C_out, C_in / groups, kH, kW
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    bias: bool
    input_grad: bool  # False for the first conv: the noisy image needs no gradient

    def text(self) -> str:
        n, c, h, w = self.input
        k = f"{self.weight[2]}x{self.weight[3]}"
        s = f"/{self.stride[0]}" if self.stride != (1, 1) else ""
        return f"{k}{s} {c}->{self.weight[0]} @ {h}x{w}"


def conv_shapes(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor) -> Counter:
    """Every ``nn.Conv2d`` call of one forward pass of ``model(x, t)``, counted by distinct shape."""
    found: Counter = Counter()

    def hook(mod: torch.nn.Conv2d, args: tuple) -> None:
        inp = args[0]
        if isinstance(mod.padding, str):
            raise ValueError(f"{mod}: string padding {mod.padding!r} is not supported by the ceiling's shape capture")
        found[ConvShape(tuple(inp.shape), tuple(mod.weight.shape), tuple(mod.stride), tuple(mod.padding),
                        tuple(mod.dilation), mod.groups, mod.bias is not None, inp.requires_grad)] += 1

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    try:
        model(x, t)
    finally:
        for h in handles:
            h.remove()
    return found


def _conv_step(shape: ConvShape, dtype: torch.dtype, device: torch.device, memory_format: torch.memory_format):
    """A forward + backward of one convolution shape, as a training step runs it: a no-argument callable."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape.input, generator=g).to(device, dtype).contiguous(memory_format=memory_format)
    w = (torch.randn(shape.weight, generator=g) * 0.05).to(device, dtype).contiguous(memory_format=memory_format)
    b = torch.zeros(shape.weight[0], device=device, dtype=dtype) if shape.bias else None
    x.requires_grad_(shape.input_grad)
    w.requires_grad_(True)
    if b is not None:
        b.requires_grad_(True)
    with torch.no_grad():
        out = F.conv2d(x, w, b, shape.stride, shape.padding, shape.dilation, shape.groups)
    grad_out = torch.randn(out.shape, generator=g).to(device, dtype).contiguous(memory_format=memory_format)
    inputs = [v for v in (x, w, b) if v is not None and v.requires_grad]

    def step() -> tuple[torch.Tensor, ...]:
        y = F.conv2d(x, w, b, shape.stride, shape.padding, shape.dilation, shape.groups)
        return torch.autograd.grad(y, inputs, grad_out)

    return step


def _matmul(n: int, dtype: torch.dtype, device: torch.device):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device, dtype)
    b = torch.randn(n, n, generator=g).to(device, dtype)
    return lambda: a @ b, 2 * n**3


@dataclass
class Ceiling:
    """The measured ceiling of one model's training step on one device, in one precision."""

    device_name: str
    label: str
    model: str
    precision: str
    batch_size: int
    channels_last: bool
    shapes: Any  # DataFrame: one row per distinct conv shape (count, GFLOP, ms, TFLOP/s, spread, share of conv time)
    conv_flops: int  # all conv calls of one step, forward + backward
    conv_ms: float  # their time at the measured rates
    matmul_n: int
    matmul_tflops: float
    step_flops: int  # the whole training step, counted the way bench counts every step
    datasheet: bench.Peak | None
    why_no_datasheet: str = ""
    noise: Any = field(default=None, repr=False)

    @property
    def conv_tflops(self) -> float:
        return self.conv_flops / (self.conv_ms / 1e3) / 1e12

    @property
    def other_flops(self) -> int:
        return max(0, self.step_flops - self.conv_flops)

    @property
    def ceiling_ms(self) -> float:
        """The step at the measured rates: convs as timed, every other FLOP at the large-matmul rate."""
        return self.conv_ms + self.other_flops / (self.matmul_tflops * 1e12) * 1e3

    @property
    def tflops(self) -> float:
        return self.step_flops / (self.ceiling_ms / 1e3) / 1e12

    @property
    def images_per_s(self) -> float:
        return self.batch_size / (self.ceiling_ms / 1e3)

    def mfu(self, tflops: float) -> dict[str, float | None]:
        """A step's achieved TFLOP/s as a share of the datasheet peak and of this measured ceiling."""
        return {"vs_datasheet": tflops / self.datasheet.tflops if self.datasheet else None,
                "vs_ceiling": tflops / self.tflops}

    @property
    def noise_reasons(self) -> list[str]:
        """Why these rates are rough: the machine's load, and shapes whose repeats spread widely."""
        reasons = list(self.noise.reasons) if self.noise is not None else []
        wide = int((self.shapes["spread"] > bench.NOISY_SPREAD).sum()) if "spread" in self.shapes else 0
        if wide:
            reasons.append(f"the repeats of {wide} of the {len(self.shapes)} shapes spread by more than "
                           f"{bench.NOISY_SPREAD:.0%} of their median")
        return reasons

    @property
    def noisy(self) -> bool:
        return bool(self.noise_reasons)

    @property
    def how_noisy(self) -> str:
        """"on a noisy machine" where other work competed, else "with noisy repeats" (a quiet machine can still
        time a few small shapes unevenly): the words a caveat uses."""
        return "on a noisy machine" if self.noise is not None and self.noise.busy else "with noisy repeats"

    def summary(self) -> str:
        """What was measured, in sentences made from the numbers."""
        conv_share = self.conv_flops / self.step_flops if self.step_flops else 0.0
        s = (f"On {self.label}, {self.model} at batch {self.batch_size} in {self.precision}"
             f"{', channels_last' if self.channels_last else ''}: its {int(self.shapes['count'].sum())} convolution calls "
             f"({len(self.shapes)} distinct shapes, {100 * conv_share:.0f}% of the step's FLOPs) run forward and backward "
             f"at {self.conv_tflops:.3g} TFLOP/s when timed alone; a {self.matmul_n}x{self.matmul_n} matmul runs at "
             f"{self.matmul_tflops:.3g} TFLOP/s. The step's ceiling is {self.tflops:.3g} TFLOP/s, "
             f"{self.images_per_s:,.0f} img/s ({self.ceiling_ms:.2f} ms per step of {self.batch_size}).")
        if self.datasheet is not None:
            s += (f" That is {100 * self.tflops / self.datasheet.tflops:.0f}% of the datasheet's {self.datasheet}: "
                  f"the rest only a better kernel could win.")
        else:
            s += f" {self.why_no_datasheet}."
        if self.noisy:
            s += f" Timed {self.how_noisy}, so take these rates as rough: " + "; ".join(self.noise_reasons) + "."
        return s

    def rows(self) -> list[dict[str, Any]]:
        """One row for the results CSV: the ceiling, labelled with its device (its step time is the ceiling's)."""
        return [{"variant": f"measured ceiling ({self.precision})", "device_name": self.device_name,
                 "torch_version": torch.__version__, "precision": self.precision, "batch_size": self.batch_size,
                 "model": self.model, "median_ms": self.ceiling_ms, "images_per_s": self.images_per_s,
                 "tflops": self.tflops, "ceiling_tflops": self.tflops,
                 "conv_tflops": self.conv_tflops, "matmul_tflops": self.matmul_tflops,
                 "datasheet_tflops": self.datasheet.tflops if self.datasheet else None,
                 "peak": str(self.datasheet) if self.datasheet else None}]


def measure(model: str = "ddpm-cifar10", batch_size: int = 256, precision: str | None = None, device: str = "auto",
            channels_last: bool = True, cudnn_benchmark: bool = True, iters: int = 20, warmup: int = 5,
            matmul_n: int | None = None, progress: bool = True) -> Ceiling:
    """Measure the ceiling of ``model``'s training step (module docstring). ``precision`` defaults to the
    fast step's: bf16 on a GPU (fp16 on one without bf16 hardware, ``env.mixed_precision``) and on a CPU with bf16
    instructions, fp32 elsewhere."""
    from tqdm.auto import tqdm

    from .env import cpu_bf16, device_name, mixed_precision
    from .train import TrainConfig, backend_flags, build, check_precision, resolve_device

    if batch_size < 1 or iters < 1 or warmup < 1:
        raise ValueError(f"need batch_size, iters and warmup >= 1; got {batch_size}, {iters}, {warmup}")
    dev = resolve_device(device)
    gpu = dev.type == "cuda"
    precision = precision or (mixed_precision(dev) if gpu else "bf16" if cpu_bf16()[0] else "fp32")
    if precision not in DTYPES:
        raise ValueError(f"unknown precision {precision!r}; valid values: {', '.join(map(repr, DTYPES))}")
    check_precision(precision, dev)
    matmul_n = matmul_n or (8192 if gpu else 1024)
    dtype = DTYPES[precision]
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    # The step's FLOPs, counted as bench counts every step (forward, backward, all of it), and its conv calls.
    # Both are linear in the batch: probed at a small one, so that the count fits any GPU's memory.
    probe = min(batch_size, 4)
    t = build(TrainConfig(model=model, batch_size=probe, device=str(dev), precision="fp32", progress=False))
    x = torch.rand(probe, 3, 32, 32, device=dev) * 2 - 1
    step_flops = bench.count_flops(t.train_step, x) * batch_size // probe
    steps_t = torch.randint(0, t.cfg.timesteps, (probe,), device=dev)
    shapes = Counter()
    for shape, count in conv_shapes(t.model, t.diffusion.q_sample(x, steps_t), steps_t).items():
        shapes[replace(shape, input=(batch_size, *shape.input[1:]))] += count
    del t

    import pandas as pd

    rows = []
    with backend_flags(tf32=precision != "fp32", cudnn_benchmark=cudnn_benchmark), bench.CpuLoad() as load:
        for shape, count in tqdm(list(shapes.items()), desc="conv shapes", disable=not progress, leave=False):
            fn = _conv_step(shape, dtype, dev, fmt)
            flops = bench.count_flops(fn)
            m = bench.measure(fn, batch_size=shape.input[0], warmup=warmup, iters=iters, device=dev,
                              flops=flops, precision=precision, name=shape.text())
            rows.append({"shape": shape.text(), "count": count, "GFLOP": flops / 1e9, "ms": m.median_ms,
                         "TFLOP/s": m.tflops, "p10-p90 ms": f"{m.p10_ms:.3f}-{m.p90_ms:.3f}",
                         "spread": (m.p90_ms - m.p10_ms) / m.median_ms if iters >= 3 else 0.0})
            del fn
        mm, mm_flops = _matmul(matmul_n, dtype, dev)
        mm_m = bench.measure(mm, batch_size=1, warmup=warmup, iters=iters, device=dev, flops=mm_flops,
                             precision=precision, name="matmul")
    df = pd.DataFrame(rows)
    df["share of conv time"] = df["count"] * df["ms"] / (df["count"] * df["ms"]).sum()
    df = df.sort_values("share of conv time", ascending=False, ignore_index=True)
    peak, why = bench.peak_for(dev, precision)
    # Machine load only: the shapes' own spreads are summarized apart (one clause, not one per shape).
    noise = load.noise()
    return Ceiling(
        device_name=device_name(dev), label=label(dev), model=model, precision=precision, batch_size=batch_size,
        channels_last=channels_last, shapes=df,
        conv_flops=int((df["count"] * df["GFLOP"] * 1e9).sum().round()), conv_ms=float((df["count"] * df["ms"]).sum()),
        matmul_n=matmul_n, matmul_tflops=float(mm_m.tflops), step_flops=int(step_flops), datasheet=peak,
        why_no_datasheet=why, noise=noise)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpm_core.ceiling", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the tiny model at batch 4: a CPU check of the whole path")
    p.add_argument("--model", default=None, help="model preset (default: ddpm-cifar10; tiny with --smoke)")
    p.add_argument("--batch-size", type=int, default=None, help="default: 256 on a GPU, 16 on a CPU, 4 with --smoke")
    p.add_argument("--precision", default=None, choices=sorted(DTYPES), help="default: bf16 where the device has it (fp16 on a GPU without bf16)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help="append the row to this results CSV (default: data/results/ceiling.csv)")
    args = p.parse_args(argv)
    if args.batch_size is not None and args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    batch = args.batch_size or (4 if args.smoke else 256 if gpu else 16)
    c = measure(args.model or ("tiny" if args.smoke else "ddpm-cifar10"), batch, args.precision, args.device,
                iters=3 if args.smoke else 20, warmup=1 if args.smoke else 5, matmul_n=256 if args.smoke else None)
    from . import results

    print(c.shapes.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(c.summary())
    results.append("ceiling", [{**r, "smoke": args.smoke} for r in c.rows()], path=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
