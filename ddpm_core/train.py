"""One configurable DDPM training step, the training loop, checkpoints and the DDP entry point.

Every optimization in the series is a field of ``TrainConfig`` acting on ONE code path,
``Trainer.train_step``, so a notebook times exactly the step it explains::

    t = build(TrainConfig(model="tiny", precision="bf16", compile="default"))
    loss = t.train_step(x)          # x: B x 3 x 32 x 32 in [-1, 1]

Multi-process training uses the same module::

    torchrun --nproc_per_node=2 -m ddpm_core.train --model tiny --batch-size 64 --steps 200

(gloo on CPU, NCCL on GPUs; rank 0 alone logs and writes checkpoints).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import math
import os
import re
import sys
import time
import typing
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .atomic import atomic_open
from .data import DATASET_CHOICES, LOADER_MODES, SYNTHETIC_SIZE, describe_dataset, get_dataset, make_loader
from .diffusion import GaussianDiffusion
from .env import check_gpu_build, gpu_bf16, gpu_compiles
from .model import ATTENTION_CHOICES, NORM_CHOICES, PRESETS, preset

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that replay CUDA graphs
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-nesterov", "adagrad", "adadelta")
FUSED_OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-nesterov")
# Fields that must match for a checkpoint to resume a run (they change weights or data order).
# The paper's training semantics, which TrainConfig.fast() keeps (fast_changes names them; tests/test_train.py checks them)
TRAINING_SEMANTICS = ("optimizer", "lr", "warmup_steps", "grad_clip", "ema_decay", "dropout", "timesteps")
RESUME_KEYS = ("model", "norm", "optimizer", "batch_size", "timesteps", "seed", "dataset", "synthetic_size")
# Values of those fields that hold the same weights and so resume each other: GroupNorm run in 16 bits under autocast
# is GroupNorm with the same parameters (a speed switch, like precision).
SAME_WEIGHTS = {("norm", "group16"): "group"}


@dataclass
class TrainConfig:
    """Every knob the series teaches. Defaults are the paper's CIFAR-10 hyper-parameters
    (Ho et al. 2020, Appendix B: Adam, lr 2e-4 with 5000 warm-up steps, batch 128, gradient
    clipping at 1, EMA 0.9999, dropout 0.1, T = 1000) in the plain baseline setting: fp32,
    eager, math attention, single-process data loading."""

    # model
    model: str = "ddpm-cifar10"
    attention: str = "math"
    norm: str = "group"
    dropout: float | None = None  # None: the preset's (0.1)
    # where and how fast
    device: str = "auto"
    precision: str = "fp32"
    compile: str | None = None
    channels_last: bool = False
    fused_optimizer: bool = False
    # compile the update after backward (clipping, the optimizer step, the EMA) into one function with torch.compile;
    # Inductor fuses the foreach optimizer itself, so not with fused_optimizer (notebook 09b measures what it can win)
    compile_optimizer: bool = False
    cudnn_benchmark: bool = False  # let cuDNN time its algorithms for each conv shape once, keep the fastest
    activation_checkpointing: bool = False  # recompute each block's activations in backward instead of keeping them
    # data
    dataset: str = "auto"
    data_root: str | None = None  # None: $DDPM_DATA_DIR or <repo>/data
    image_folder: str | None = None  # for dataset="folder"
    synthetic_size: int = SYNTHETIC_SIZE
    loader: str = "float"
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    drop_last: bool = True  # drop each epoch's last, smaller batch: one batch shape, so no recompiles
    # optimization
    batch_size: int = 128  # per process
    optimizer: str = "adam"
    lr: float = 2e-4
    warmup_steps: int = 5000
    grad_clip: float | None = 1.0
    grad_scaler: bool = True  # fp16 only: scale the loss so small gradients do not underflow (False: see what breaks)
    ema_decay: float | None = 0.9999
    timesteps: int = 1000
    seed: int = 0
    steps: int = 1000
    ddp_bucket_cap_mb: float | None = None  # DDP's gradient bucket size in MiB; None: DDP's default (25)
    max_seconds: float | None = None  # wall-clock budget of the loop: stop after the step that reaches it
    # run
    out_dir: str = "runs/default"
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    resume: bool = True
    log_every: int = 50
    progress: bool = True

    @classmethod
    def fast(cls, **overrides: Any) -> "TrainConfig":
        """The fastest configuration the series teaches, as one named setting (notebook 09 ends at
        it; ``python -m ddpm_core.train --preset fast`` and ``python -m ddpm_core.bench_peers`` use it).

        It changes only *how* the step runs: bf16 autocast (fp16 with the GradScaler on a GPU without bf16
        hardware, such as a T4: ``env.mixed_precision``), SDPA attention, channels_last, the fused
        Adam, cuDNN autotuning, the dataset resident on the device (flipped and normalized there),
        and on a GPU ``torch.compile(mode="reduce-overhead")`` (CUDA graphs; not on a GPU Triton cannot compile
        for, such as a P100: ``env.gpu_compiles``) and a batch sized to the
        GPU's memory. The paper's training semantics stay as they are, and their cost is measured,
        not dropped: Adam with lr 2e-4 and warm-up, gradient clipping at 1, EMA 0.9999, dropout 0.1,
        t uniform (``tests/test_train.py`` checks that these fields equal the baseline's).

        The update after backward (clipping, Adam, the EMA) stays eager (``compile_optimizer=False``): notebook 09b
        times it alone beside the whole step, and compiles it only where that bound leaves room.

        On a CPU: bf16 only where the CPU has bf16 instructions (``env.cpu_bf16``), and no
        compilation (notebook 04 measured no gain, or about 1.1x, on the 2-core CPUs it has run on, for 1-2 minutes
        of compiling).
        ``overrides`` win over all of it.
        """
        from .env import cpu_bf16, gpu_memory_gib, mixed_precision

        device = str(overrides.get("device", "auto"))
        gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        settings: dict[str, Any] = dict(attention="sdpa", channels_last=True, fused_optimizer=True,
                                        cudnn_benchmark=True, loader="device", num_workers=0)
        if gpu:
            # this process's GPU: cuda:LOCAL_RANK under torchrun, not always GPU 0 (build checks that it exists)
            dev = device if device not in ("auto", "cuda") else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            gib = gpu_memory_gib(dev)  # less what other processes hold; DDPM_GPU_MEMORY_GB caps it
            settings.update(precision=mixed_precision(dev),
                            compile="reduce-overhead" if gpu_compiles(dev)[0] else None,  # no Triton before 7.0 (a P100)
                            batch_size=512 if gib >= 40 else 256 if gib >= 15 else 128)
        else:
            settings.update(precision="bf16" if cpu_bf16()[0] else "fp32", compile=None)
        settings.update(overrides)
        return cls(**settings)

    @classmethod
    def fast_changes(cls, **shared: Any) -> tuple[Any, str]:
        """What ``TrainConfig.fast(**shared)`` changes against ``TrainConfig(**shared)`` on this machine: a table (field,
        baseline, ``TrainConfig.fast()``) of the fields that differ, and a sentence naming the training semantics
        (``TRAINING_SEMANTICS``) it keeps, with their values, and any it changes (notebooks 09b and 09c show both)."""
        import pandas as pd

        base, fast = cls(**shared), cls.fast(**shared)
        changed = pd.DataFrame([{"field": f.name, "baseline": repr(getattr(base, f.name)),
                                 "TrainConfig.fast()": repr(getattr(fast, f.name))}
                                for f in dataclasses.fields(cls) if getattr(base, f.name) != getattr(fast, f.name)])
        kept = [n for n in TRAINING_SEMANTICS if getattr(base, n) == getattr(fast, n)]
        said = ("It keeps " + ", ".join(f"`{n}={getattr(fast, n)!r}`" + (" (None: the model preset's own)"
                                                                         if n == "dropout" and fast.dropout is None else "")
                                        for n in kept)
                + (f"; it changes {', '.join(n for n in TRAINING_SEMANTICS if n not in kept)}"
                   if len(kept) < len(TRAINING_SEMANTICS) else "") + ".")
        return changed, said

    def __post_init__(self) -> None:
        _check_types(self)

        def choice(name: str, valid: tuple) -> None:
            value = getattr(self, name)
            if value not in valid:
                shown = ", ".join(repr(v) for v in valid)
                raise ValueError(f"unknown {name} {value!r}; valid values: {shown}")

        if self.compile in ("none", "None", ""):
            self.compile = None
        choice("model", tuple(PRESETS))
        choice("attention", ATTENTION_CHOICES)
        choice("norm", NORM_CHOICES)
        choice("precision", PRECISIONS)
        choice("compile", COMPILE_MODES)
        choice("dataset", DATASET_CHOICES)
        choice("loader", LOADER_MODES)
        choice("optimizer", OPTIMIZERS)
        if not (self.device in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ValueError(f"unknown device {self.device!r}; valid values: 'auto', 'cpu', 'cuda', 'cuda:N'")
        for name in ("batch_size", "steps", "timesteps", "checkpoint_every", "log_every", "keep_checkpoints", "synthetic_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "num_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be > 0 or None (no time limit), got {self.max_seconds}")
        if self.ema_decay is not None and not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1) or None, got {self.ema_decay}")
        if self.ddp_bucket_cap_mb is not None and self.ddp_bucket_cap_mb <= 0:
            raise ValueError(f"ddp_bucket_cap_mb must be > 0 or None (DDP's default, 25 MiB), got {self.ddp_bucket_cap_mb}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0 or None (no clipping), got {self.grad_clip}")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.fused_optimizer and self.optimizer not in FUSED_OPTIMIZERS:
            raise ValueError(
                f"fused_optimizer is available for {FUSED_OPTIMIZERS}, not {self.optimizer!r}; "
                f"set fused_optimizer=False"
            )
        if self.compile_optimizer and self.fused_optimizer:
            raise ValueError("compile_optimizer compiles the optimizer's foreach implementation into fused kernels of its "
                             "own, and torch.compile does not take the single-kernel fused one: set fused_optimizer=False, "
                             "or compile_optimizer=False to keep the fused optimizer")
        if self.compile_optimizer and self.precision == "fp16" and self.grad_scaler:
            raise ValueError("compile_optimizer cannot compile the GradScaler's step, which reads on the host whether the "
                             "gradients overflowed: use precision='bf16' (no scaler needed), or compile_optimizer=False")
        if self.dataset == "folder" and not self.image_folder:
            raise ValueError("dataset='folder' needs image_folder=<path to a folder of PNG/JPEG images>")
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ValueError("prefetch_factor only applies with num_workers > 0; set num_workers or leave prefetch_factor=None")


def _check_types(cfg: TrainConfig) -> None:
    """Each field has its declared type, and numbers are finite: values from YAML, JSON or the
    command line arrive as strings, and a bool is an int to Python, so neither slips through."""
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        value, hint = getattr(cfg, f.name), hints[f.name]
        args = typing.get_args(hint)
        optional = type(None) in args
        base = next((a for a in args if a is not type(None)), hint)
        if value is None:
            if optional:
                continue
            raise TypeError(f"{f.name} must not be None (default: {f.default!r})")
        if base is str and isinstance(value, os.PathLike):  # out_dir=Path(...) is a path like any other
            value = os.fspath(value)
            setattr(cfg, f.name, value)
        if base is bool:
            ok = isinstance(value, bool)
        elif base is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif base is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, base) if isinstance(base, type) else True
        if not ok:
            hint_fix = ""
            if isinstance(value, str) and base in (int, float):
                try:
                    hint_fix = f" Fix: {f.name}={base(value)!r} (a number, not the string {value!r}: YAML and JSON keep quoted values as text)"
                except ValueError:
                    pass
            kind = base.__name__ if isinstance(base, type) else str(base)
            raise TypeError(f"{f.name} must be {'an' if kind == 'int' else 'a'} {kind}{' or None' if optional else ''}, "
                            f"got {value!r} ({type(value).__name__}).{hint_fix}")
        if base is float and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value!r}"
                             + (" (use None for none)" if optional else ""))


# ------------------------------------------------------------------------------ helpers
def resolve_device(name: str = "auto") -> torch.device:
    """"auto" -> the GPU of this process (cuda:LOCAL_RANK) if there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={name!r} but torch sees no CUDA GPU (torch {torch.__version__}, "
                f"CUDA build {torch.version.cuda}). Fix: use device='cpu' or 'auto'."
            )
        if name == "cuda":
            name = f"cuda:{local_gpu_index()}"
        elif torch.device(name).index is not None and torch.device(name).index >= torch.cuda.device_count():
            raise ValueError(f"device={name!r} but only {torch.cuda.device_count()} GPU(s) are visible. "
                             f"Fix: use cuda:0 .. cuda:{torch.cuda.device_count() - 1}.")
        check_gpu_build(name)  # a GPU this torch build has no kernels for: the fix now, not "no kernel image" later
    return torch.device(name)


def local_gpu_index() -> int:
    """This process's GPU: LOCAL_RANK (set by torchrun), checked against the GPUs visible."""
    local_rank, visible = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if local_rank >= visible:
        raise ValueError(
            f"this process has LOCAL_RANK {local_rank} but only {visible} GPU(s) are visible, so there is "
            f"no cuda:{local_rank} for it. Fix: start at most {visible} process(es) per machine "
            f"(torchrun --nproc_per_node={visible}), or pass --device cpu to run the processes on the CPU."
        )
    return local_rank


def available_precisions(device: torch.device | str) -> list[str]:
    """The precisions ``build`` accepts on ``device``."""
    device = torch.device(device)
    if device.type != "cuda":
        return ["fp32", "bf16"]
    out = ["fp32"]
    if torch.cuda.get_device_capability(device)[0] >= 8:
        out.append("tf32")
    if gpu_bf16(device)[0]:  # not torch.cuda.is_bf16_supported(): it says yes where bf16 is only emulated (a T4)
        out.append("bf16")
    return out + ["fp16"]


def check_precision(precision: str, device: torch.device) -> None:
    """Raise a ValueError that explains why ``precision`` cannot run on ``device`` and what to use."""
    if precision in available_precisions(device):
        return
    if device.type != "cuda":
        why = {
            "fp16": "fp16 autocast needs a GradScaler to keep small gradients from underflowing, and "
                    "that path is built for CUDA GPUs. On CPU use precision='bf16': bfloat16 keeps fp32's "
                    "exponent range, so it needs no loss scaling.",
            "tf32": "TF32 is a tensor-core format of NVIDIA GPUs (Ampere and newer); on a CPU it would be "
                    "plain fp32. Use precision='fp32' or 'bf16' on CPU.",
        }[precision]
    elif precision == "bf16":
        why = gpu_bf16(device)[1]
    else:
        why = (f"{torch.cuda.get_device_name(device)} does not support it "
               f"(compute capability {torch.cuda.get_device_capability(device)}); use fp32 or fp16.")
    raise ValueError(f"precision={precision!r} cannot run on {device}: {why}")


def _read_tf32() -> tuple[bool, bool]:
    """(matmul, cuDNN) TF32 flags as they are now, whichever API set them."""
    try:
        return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    except RuntimeError:  # torch >= 2.9 refuses the legacy getters after the new API was used
        return (torch.backends.cuda.matmul.fp32_precision == "tf32",
                torch.backends.cudnn.conv.fp32_precision == "tf32")


@contextlib.contextmanager
def backend_flags(tf32: bool, cudnn_benchmark: bool):
    """TF32 for fp32 matmuls and convolutions, and cuDNN autotuning, for the duration of one step.

    cuDNN runs fp32 convolutions on TF32 by default, so the honest fp32 baseline switches it off
    explicitly. The flags are set through the legacy ``allow_tf32`` API because Inductor's
    max-autotune reads it, and torch >= 2.9 raises on reading it once the new ``fp32_precision``
    API was used; set through the legacy API, both stay readable. They are process-wide, so they
    are restored afterwards: one trainer's bf16 step must not turn TF32 on for the next trainer's
    fp32 comparison.
    """
    saved = (*_read_tf32(), torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved


def _dist_info() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def make_optimizer(name: str, params, lr: float, fused: bool, tensor_lr: bool = False,
                   capturable: bool = False) -> torch.optim.Optimizer:
    """The optimizer by name; ``fused=True`` selects the single-kernel implementation; ``tensor_lr=True`` holds the
    learning rate in a 0-dim tensor, which a compiled step reads instead of baking it in; ``capturable=True`` (Adam and
    AdamW on a GPU) keeps Adam's step counters on the device, as a compiled or graph-captured step needs them."""
    extra: dict[str, Any] = {"fused": True} if fused else {}
    if tensor_lr:
        lr = torch.tensor(lr)
    if capturable and name in ("adam", "adamw"):
        extra["capturable"] = True
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **extra)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, **extra)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **extra)
    if name == "sgd-nesterov":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, **extra)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    if name == "adadelta":
        return torch.optim.Adadelta(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; valid values: {OPTIMIZERS}")


class EMA:
    """Exponential moving average of the weights: ema <- decay * ema + (1 - decay) * weights.

    Written out rather than ``torch.optim.swa_utils.AveragedModel`` because that class
    checks a tensor counter once per parameter, which synchronizes the GPU hundreds of times
    per step. This is one ``_foreach_lerp_`` launch group and no sync.
    """

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self._ema = list(self.model.parameters())
        self._src = list(model.parameters())

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self._ema, [p.detach() for p in self._src], 1.0 - self.decay)

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)


# ------------------------------------------------------------------------------ the trainer
class Trainer:
    """What ``build(cfg)`` returns: the model, the diffusion, the optimizer and ``train_step``."""

    def __init__(self, cfg: TrainConfig, *, ddp: bool | None = None):
        self.cfg = cfg
        self.rank, self.world_size = _dist_info()
        if ddp and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("ddp=True wraps the model in DistributedDataParallel, which needs a process group: call "
                             "torch.distributed.init_process_group(...) first (a group of one process will do).")
        self.device = resolve_device(cfg.device)
        check_precision(cfg.precision, self.device)
        if (cfg.compile or cfg.compile_optimizer) and self.device.type == "cuda":
            compiles, why = gpu_compiles(self.device)
            if not compiles:
                what = f"compile={cfg.compile!r}" if cfg.compile else "compile_optimizer=True"
                raise ValueError(f"{what} cannot run on {self.device}: {why}")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        overrides: dict[str, Any] = {"attention": cfg.attention, "norm": cfg.norm}
        if cfg.dropout is not None:
            overrides["dropout"] = cfg.dropout
        model = preset(cfg.model, **overrides).to(self.device)
        model.activation_checkpointing = cfg.activation_checkpointing
        self.memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
        model = model.to(memory_format=self.memory_format)
        self.model = model
        self.diffusion = GaussianDiffusion(cfg.timesteps).to(self.device)
        self.ema = EMA(model, cfg.ema_decay) if cfg.ema_decay else None

        self.net: nn.Module = model
        if ddp or (ddp is None and self.world_size > 1):
            from torch.nn.parallel import DistributedDataParallel as DDP

            bucket = {} if cfg.ddp_bucket_cap_mb is None else {"bucket_cap_mb": cfg.ddp_bucket_cap_mb}
            self.net = DDP(model, device_ids=[self.device] if self.device.type == "cuda" else None, **bucket)

        # compile_optimizer: the learning rate as a tensor, so that the scheduler's warm-up changes a value the compiled
        # step reads, not a constant baked into it (a float would recompile the step at every new lr)
        self.optimizer = make_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.fused_optimizer,
                                        tensor_lr=cfg.compile_optimizer,
                                        capturable=cfg.compile_optimizer and self.device.type == "cuda")
        warmup = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.precision == "fp16" and cfg.grad_scaler)
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        # t and eps come from their own generator (seed + rank), saved in checkpoints, so a
        # resumed run draws exactly what the uninterrupted one would have drawn.
        self.generator = torch.Generator(self.device).manual_seed(cfg.seed + self.rank)
        # What train_step calls for the forward pass and the loss: loss_eager itself, or its compiled version.
        # Assign another callable of the same signature to swap it (04's recording backend does).
        self.loss_fn = None  # None: loss_eager (see the property)
        if cfg.compile:
            # dynamic=False: every trainer compiles the same function (loss_eager), and Dynamo remembers the shapes
            # it saw per function; a second trainer at another batch size would get a dynamic-batch graph, not the
            # static one the same config gets in a fresh process. The loader drops the last partial batch, so a run
            # sees one shape.
            self.loss_fn = torch.compile(self.loss_eager, mode=cfg.compile, dynamic=False)
        # What train_step calls after backward when compile_optimizer is on: update_eager compiled (default mode, no
        # CUDA graphs of its own). None: the eager update, with the GradScaler's steps where fp16 uses one.
        self.update_fn = torch.compile(self.update_eager, dynamic=False) if cfg.compile_optimizer else None
        self.step = 0

    @property
    def loss_fn(self) -> typing.Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """What ``train_step`` calls for the forward pass and the loss: ``loss_eager`` unless another callable was set.

        The eager default is not stored: a trainer holding its own bound method is a reference cycle, and ``del
        trainer`` would then leave its weights, gradients and optimizer state on the GPU until the garbage collector
        ran (03b's run on the H200 found 4.2 GiB allocated beyond its three live trainers: six deleted ones' worth). A
        compiled function holds the bound method too, so a compiled trainer is freed only by ``gc.collect()``."""
        return self.loss_eager if self._loss_fn is None else self._loss_fn

    @loss_fn.setter
    def loss_fn(self, fn: typing.Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None) -> None:
        self._loss_fn = None if fn is None or fn == self.loss_eager else fn

    def loss_eager(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The forward pass and the DDPM loss, never compiled: what ``compile=...`` hands to ``torch.compile``."""
        return self.diffusion.loss(self.net, x0, t, noise)

    def update_eager(self) -> None:
        """Clipping, the optimizer step and the EMA: the update after backward, never compiled; what
        ``compile_optimizer=True`` hands to ``torch.compile`` (without a GradScaler: it refuses fp16 with one)."""
        if self.cfg.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update()

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def train_step(self, x: torch.Tensor, t: torch.Tensor | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
        """One optimizer step on a batch ``x`` of images in [-1, 1] (moved to the device if needed).

        ``t`` and ``noise`` are drawn from the trainer's generator unless given (tests pass them).
        Returns the loss as a detached 0-dim tensor (no device sync; ``float()`` it to read it).
        """
        if self.cfg.compile in CUDAGRAPH_MODES:
            # A new iteration: CUDA-graph outputs of the previous replay may now be overwritten.
            torch.compiler.cudagraph_mark_step_begin()
        x = x.to(self.device, non_blocking=True).contiguous(memory_format=self.memory_format)
        if t is None:
            t = torch.randint(0, self.cfg.timesteps, (x.shape[0],), device=self.device, generator=self.generator)
        if noise is None:
            noise = torch.randn(x.shape, device=self.device, generator=self.generator, dtype=x.dtype)
        t = t.to(self.device)
        noise = noise.to(self.device).contiguous(memory_format=self.memory_format)
        self.model.train()
        phase = torch.profiler.record_function  # labels the phases in profiler traces (PHASES); ~1 us each otherwise
        with backend_flags(tf32=self.cfg.precision != "fp32", cudnn_benchmark=self.cfg.cudnn_benchmark):
            with phase("train_step/forward"), self._autocast():
                loss = self.loss_fn(x, t, noise)
            with phase("train_step/backward"):
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
            if self.update_fn is not None:
                # one compiled function: its phases cannot be labelled apart (Dynamo ignores record_function inside it)
                with phase("train_step/optimizer"):
                    self.update_fn()  # clipping, the optimizer step and the EMA
                    self.scheduler.step()
            else:
                with phase("train_step/optimizer"):
                    if self.cfg.grad_clip is not None:
                        self.scaler.unscale_(self.optimizer)
                        nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                    self.scheduler.step()
                if self.ema is not None:
                    with phase("train_step/ema"):
                        self.ema.update()
        self.step += 1
        # A copy: under CUDA graphs the loss lives in the graph's output buffer, which the next
        # replay overwrites, and callers (train()) keep losses across steps.
        return loss.detach().clone()

    @torch.no_grad()
    def sample(self, n: int, steps: int | None = None, seed: int = 0, progress: bool = True, **kw: Any):
        """Images in [-1, 1] from the EMA model (the raw model if EMA is off); see GaussianDiffusion.sample."""
        net = self.ema.model if self.ema is not None else self.model
        was_training = net.training
        net.eval()
        try:
            g = torch.Generator(self.device).manual_seed(seed)
            with self._autocast():
                return self.diffusion.sample(net, n, steps=steps, device=self.device, generator=g, progress=progress, **kw)
        finally:
            net.train(was_training)

    # -------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "config": asdict(self.cfg),
            "model": self.model.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "torch_version": str(torch.__version__),
        }

    def _rng_state(self) -> dict:
        state = {"cpu": torch.get_rng_state(), "generator": self.generator.get_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def save_checkpoint(self, out_dir: str | os.PathLike) -> Path | None:
        """Write ``<out_dir>/checkpoints/step-NNNNNNNN.pt`` atomically (rank 0) and prune old ones.

        Every rank must call it: the RNG states of all ranks are gathered into the file.
        """
        rngs = [self._rng_state()]
        if self.world_size > 1:
            rngs = [None] * self.world_size
            dist.all_gather_object(rngs, {k: v.cpu() for k, v in self._rng_state().items()})
        if self.rank != 0:
            return None
        ckpt_dir = Path(out_dir) / "checkpoints"
        path = ckpt_dir / f"step-{self.step:08d}.pt"
        with atomic_open(path, "wb") as f:
            torch.save({**self.state_dict(), "rng": rngs}, f)
        if not checkpoint_readable(path):
            raise RuntimeError(f"the checkpoint just written, {path}, cannot be read back; the earlier ones are kept. "
                               "Fix: check the disk (space, errors) and run again: training resumes from the newest good one.")
        # Prune: only verified checkpoints count towards keep_checkpoints; unreadable ones are set
        # aside (renamed *.corrupt), never counted as kept and never the reason a good one is deleted.
        good = [path]
        for older in reversed(list_checkpoints(out_dir)):
            if older == path:
                continue
            if checkpoint_readable(older):
                good.append(older)
            else:
                set_aside(older)
        for extra in good[self.cfg.keep_checkpoints:]:
            extra.unlink(missing_ok=True)
        return path

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore weights, EMA, optimizer, schedule, scaler, step and RNG state from ``path``."""
        # On the CPU first: load_state_dict then puts weights and moments on their parameters'
        # device, while non-fused Adam's `step` counters stay CPU tensors as they must (on the GPU,
        # Adam reads each with .item(): two device syncs per parameter per step).
        ckpt = load_checkpoint_file(path, "cpu")
        mismatched = {k: (ckpt["config"].get(k), getattr(self.cfg, k)) for k in RESUME_KEYS
                      if SAME_WEIGHTS.get((k, ckpt["config"].get(k)), ckpt["config"].get(k))
                      != SAME_WEIGHTS.get((k, getattr(self.cfg, k)), getattr(self.cfg, k))}
        if mismatched:
            desc = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in mismatched.items())
            raise ValueError(
                f"checkpoint {path} was written by a different run ({desc}). Fix: use another "
                f"out_dir for this configuration, or delete {Path(path).parent} to start over in this one."
            )
        self.model.load_state_dict(ckpt["model"])
        if self.ema is not None and ckpt.get("ema") is not None:
            self.ema.load_state_dict(ckpt["ema"])
        # The implementation is this config's, whichever the checkpoint's run used (fused, foreach, capturable: a fused
        # fast() checkpoint resumed with compile_optimizer must not come back fused); load_state_dict places Adam's
        # step counters by these flags (on the device where fused or capturable, on the CPU otherwise).
        for saved, own in zip(ckpt["optimizer"]["param_groups"], self.optimizer.param_groups):
            saved.update({k: own[k] for k in ("fused", "foreach", "capturable") if k in own})
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.step = int(ckpt["step"])
        self._apply_schedule(ckpt["config"], path)
        rngs = ckpt.get("rng") or []
        if len(rngs) == self.world_size:
            rng = rngs[self.rank]
            torch.set_rng_state(rng["cpu"].cpu())
            self.generator.set_state(rng["generator"].cpu())
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"].cpu(), self.device)
        elif self.rank == 0:
            warnings.warn(f"{path} holds RNG state for {len(rngs)} ranks, this run has {self.world_size}; "
                          f"training continues with fresh random streams")

    def _apply_schedule(self, saved: dict, path: str | os.PathLike) -> None:
        """Continue with THIS config's lr and warm-up at the restored step.

        The scheduler's state holds the base lr of the run that wrote the checkpoint, while its
        warm-up rule comes from this config: restored as is, a changed ``lr`` or ``warmup_steps``
        would mix the two (a requested 1e-3 ran at 1e-5). The new schedule is applied from the
        current step, and a change is announced.
        """
        lr = self.cfg.lr
        self.scheduler.base_lrs = [lr for _ in self.optimizer.param_groups]
        for group, rule in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["initial_lr"] = lr
            new = lr * rule(self.scheduler.last_epoch)
            # the lr's type is this config's: a tensor for compile_optimizer, a float otherwise, whichever the
            # checkpoint's run used (its optimizer state restored a group's lr as that run held it)
            if not self.cfg.compile_optimizer:
                group["lr"] = float(new)
            elif isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(new)
            else:
                group["lr"] = torch.tensor(new)
        self.scheduler._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        changed = [f"{k} {saved.get(k)!r} -> {getattr(self.cfg, k)!r}" for k in ("lr", "warmup_steps")
                   if saved.get(k) is not None and saved.get(k) != getattr(self.cfg, k)]
        if changed and self.rank == 0:
            print(f"note: {', '.join(changed)} since {Path(path).name}; from step {self.step} "
                  f"on, training follows the new schedule (lr now {self.scheduler._last_lr[0]:.3g})", flush=True)

    def resume_latest(self, out_dir: str | os.PathLike) -> Path | None:
        """Load the newest readable checkpoint under ``out_dir``; return its path (None if none).

        A file that does not load as a checkpoint (cut short, corrupt, not plain tensors) is set
        aside as ``*.corrupt`` and the previous one is tried. A readable checkpoint that does not
        fit this run (another configuration) raises: it is never moved or skipped.
        """
        for path in reversed(list_checkpoints(out_dir)):
            if not checkpoint_readable(path):
                moved = set_aside(path) if self.rank == 0 else path
                warnings.warn(f"skipping unreadable checkpoint {path} (moved to {moved.name})")
                continue
            self.load_checkpoint(path)
            return path
        return None


def list_checkpoints(out_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``out_dir``, oldest first (temporary files are ignored)."""
    return sorted((Path(out_dir) / "checkpoints").glob("step-*.pt"))


def checkpoint_readable(path: str | os.PathLike) -> bool:
    """Whether ``path`` loads as a checkpoint of ours (memory-mapped: cheap even for the 0.6 GB ones)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return isinstance(ckpt, dict) and "model" in ckpt and "step" in ckpt
    except Exception:  # noqa: BLE001 - any failure to load means: not a usable checkpoint
        return False


def set_aside(path: Path) -> Path:
    """Rename an unreadable checkpoint to ``<name>.corrupt`` (kept for inspection, no longer listed)."""
    target = path.with_name(path.name + ".corrupt")
    try:
        path.replace(target)
    except OSError:
        return path
    return target


class RendezvousError(RuntimeError):
    """The processes of a multi-process run did not all join the process group in time."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; no checkpoint was written from the diverged weights."""


def load_checkpoint_file(path: str | os.PathLike, device: torch.device | str = "cpu") -> dict:
    """Read a checkpoint written by ``Trainer.save_checkpoint``."""
    return torch.load(path, map_location=device, weights_only=True)


def build(cfg: TrainConfig, *, ddp: bool | None = None) -> Trainer:
    """A ``Trainer`` for ``cfg``: ``t.model``, ``t.diffusion``, ``t.optimizer``, ``t.train_step(x)``.

    ``ddp``: wrap the model in DistributedDataParallel (``t.net``). None (the default) wraps it when this process is
    one of several in a process group (a torchrun launch); True wraps it in any initialized group, a group of one
    process included, which builds the same DDP (buckets, hooks) as a launch on one machine; False never wraps it.
    """
    return Trainer(cfg, ddp=ddp)


# ------------------------------------------------------------------------------ the loop
@dataclass
class TrainResult:
    trainer: Trainer
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) of this rank
    resumed_from: Path | None = None
    dataset: str = ""  # what it trained on, for figure titles (data.describe_dataset)
    seconds: float = 0.0  # wall time of the training loop (data loading and logging included)
    stopped_by_time: bool = False  # max_seconds ended the run before cfg.steps


def _init_distributed(cfg: TrainConfig) -> bool:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1). Returns True if it did."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    from datetime import timedelta

    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            f"not: this looks like a multi-process run started without torchrun. Fix: launch it with "
            f"torchrun --nproc_per_node={os.environ['WORLD_SIZE']} -m ddpm_core.train ..., or unset WORLD_SIZE "
            f"for one process.")
    use_cuda = cfg.device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_gpu_index())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    wait_s = float(os.environ.get("DDPM_RENDEZVOUS_TIMEOUT", "300"))
    # torchrun keeps one key-value store across restarts. A restarted group would read the
    # addresses the killed workers left there and fail to connect, so every attempt gets its
    # own key prefix.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=(not agent_store and rank == 0), timeout=timedelta(seconds=wait_s))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                store=dist.PrefixStore(f"ddpm/attempt-{attempt}", store), rank=rank, world_size=world)
    except (RuntimeError, dist.DistError) as e:
        raise RendezvousError(
            f"rank {rank} of {world} could not form the process group at {where} within {wait_s:g} s "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). The other processes did not join: "
            f"start all {world} with one torchrun command (torchrun --nproc_per_node={world} ...), or on several "
            f"machines with the same --rdzv_endpoint. DDPM_RENDEZVOUS_TIMEOUT sets the wait in seconds.") from e
    return True


def _prove_writable(folder: Path) -> None:
    """Create ``folder`` if needed and write (and remove) a file in it; raises OSError if it cannot."""
    import tempfile

    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
        pass


def check_out_dir(out_dir: str | os.PathLike) -> Path:
    """Create ``out_dir`` and prove it writable, before any training (the first checkpoint comes
    ``checkpoint_every`` steps later: a bad path must not cost those steps)."""
    p = Path(out_dir)
    if p.exists() and not p.is_dir():
        raise ValueError(f"out_dir {p} is a file, not a folder. Fix: pass a folder, e.g. --out-dir runs/my-run "
                         f"(checkpoints go to <out_dir>/checkpoints/).")
    if p.name == "checkpoints" and any(p.glob("step-*.pt")):
        raise ValueError(f"out_dir {p} is the checkpoints folder of a run, not the run's folder: training would start "
                         f"over in {p / 'checkpoints'}. Fix: out_dir={str(p.parent)!r} to resume that run.")
    try:
        _prove_writable(p)
    except OSError as e:
        raise ValueError(f"cannot write to out_dir {p} ({e.strerror or e}). Fix: pass a folder you can write to "
                         f"(--out-dir / TrainConfig(out_dir=...)); nothing was trained yet.") from e
    return p


def _past_budget(start: float, seconds: float, world_size: int) -> bool:
    """Whether the wall-clock budget is spent; under DDP rank 0 decides for all (they must stop together)."""
    past = time.perf_counter() - start >= seconds
    if world_size > 1:
        flag = torch.tensor([float(past)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.broadcast(flag, src=0)
        past = bool(flag.item())
    return past


def _fault_injection(rank: int) -> int | None:
    """The step at which this process kills itself, for fault-tolerance demos and tests.

    ``DDPM_KILL_AT="<rank>:<step>"`` kills that rank with SIGKILL right after that step, on the
    first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0), so a restarted group
    resumes from its last checkpoint and finishes.
    """
    spec = os.environ.get("DDPM_KILL_AT")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    try:
        r, s = (int(v) for v in spec.split(":"))
    except ValueError as e:
        raise ValueError(f"DDPM_KILL_AT must look like '<rank>:<step>', e.g. '1:6'; got {spec!r}") from e
    return s if r == rank else None


def train(cfg: TrainConfig) -> TrainResult:
    """Train for ``cfg.steps`` optimizer steps with a progress bar, EMA and periodic checkpoints.

    With ``cfg.max_seconds`` the loop also stops (and checkpoints) after the first step that ends
    past that wall-clock budget, counted from the first step; ``result.stopped_by_time`` says so.

    Resumes from the newest checkpoint in ``cfg.out_dir`` when ``cfg.resume`` is set, continuing
    with the same data order and random draws as an uninterrupted run.
    """
    from tqdm.auto import tqdm

    check_out_dir(cfg.out_dir)
    started_group = _init_distributed(cfg)
    t = None
    try:
        t = build(cfg)
        rank0 = t.rank == 0
        if not cfg.resume and list_checkpoints(cfg.out_dir):
            raise ValueError(
                f"{Path(cfg.out_dir) / 'checkpoints'} holds checkpoints of an earlier run, and resume=False "
                f"would mix a new run with them. Fix: resume=True to continue that run, another out_dir, "
                f"or delete that folder if you no longer need it."
            )
        resumed = t.resume_latest(cfg.out_dir) if cfg.resume else None
        if resumed and rank0:
            print(f"resuming from {resumed} (step {t.step})")
        dataset = get_dataset(cfg.dataset, root=cfg.data_root, folder=cfg.image_folder,
                              synthetic_size=cfg.synthetic_size, verbose=rank0)
        loader = make_loader(
            dataset, cfg.batch_size, device=t.device, mode=cfg.loader, num_workers=cfg.num_workers,
            pin_memory=cfg.pin_memory, persistent_workers=cfg.persistent_workers,
            prefetch_factor=cfg.prefetch_factor, seed=cfg.seed, rank=t.rank, world_size=t.world_size,
            drop_last=cfg.drop_last,
        )
        result = TrainResult(trainer=t, resumed_from=resumed, dataset=describe_dataset(dataset))
        pending: list[tuple[int, torch.Tensor]] = []
        timed = cfg.max_seconds is not None  # a time budget ends the run: the bar counts seconds, not a far step bound
        # (the H100's 01 run showed "0% 2870/1000000 [04:01<20:08:42]" under a 240 s budget)
        bar = tqdm(total=cfg.max_seconds if timed else cfg.steps, initial=0 if timed else min(t.step, cfg.steps),
                   desc=f"training ({cfg.max_seconds:g} s budget)" if timed else "training", unit="s" if timed else "it",
                   bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]" if timed else None,
                   disable=not (cfg.progress and rank0), dynamic_ncols=True)
        kill_at = _fault_injection(t.rank)
        start = time.perf_counter()
        while t.step < cfg.steps and not result.stopped_by_time:
            epoch, offset = divmod(t.step, len(loader))
            loader.set_epoch(epoch, offset)
            for x in loader:
                pending.append((t.step + 1, t.train_step(x)))
                bar.update(min(time.perf_counter() - start, cfg.max_seconds) - bar.n if timed else 1)
                done = t.step >= cfg.steps
                if cfg.max_seconds is not None and not done and _past_budget(start, cfg.max_seconds, t.world_size):
                    result.stopped_by_time = done = True
                save = t.step % cfg.checkpoint_every == 0 or done
                if t.step % cfg.log_every == 0 or save:  # one device sync per log interval (and before a save)
                    values = torch.stack([v for _, v in pending]).float().tolist()
                    bad = next(((s, v) for (s, _), v in zip(pending, values) if not math.isfinite(v)), None)
                    if bad is not None:  # checked before any save: diverged weights never replace good ones
                        bar.close()
                        raise TrainingDiverged(
                            f"the loss became {bad[1]} at step {bad[0]} (lr {t.optimizer.param_groups[0]['lr']:.3g} "
                            f"after warm-up scaling, base lr {cfg.lr:g}, precision {cfg.precision}, grad_clip "
                            f"{cfg.grad_clip}). No checkpoint was written from it; the newest one in "
                            f"{Path(cfg.out_dir) / 'checkpoints'} is from before. Fix: lower lr, keep grad_clip on, "
                            "or use bf16 instead of fp16.")
                    result.losses += [(s, v) for (s, _), v in zip(pending, values)]
                    pending.clear()
                    bar.set_postfix(**({"step": f"{t.step:,}"} if timed else {}), loss=f"{values[-1]:.4f}", epoch=epoch)
                if save:
                    t.save_checkpoint(cfg.out_dir)
                if t.step == kill_at:
                    print(f"rank {t.rank}: killed at step {t.step} on purpose (DDPM_KILL_AT)", flush=True)
                    os.kill(os.getpid(), 9)
                if done:
                    break
        bar.close()
        result.seconds = time.perf_counter() - start
        return result
    finally:
        if started_group:
            _release_group(t)


def _release_group(*trainers: Trainer | None) -> None:
    """End this process's part in the process group, while the interpreter is fully alive.

    DDP's reducer holds the process group, so ``destroy_process_group`` alone leaves the gloo group
    (and its worker threads) alive inside the trainer's DDP wrapper until interpreter shutdown,
    where destroying it can abort the finished worker with "terminate called without an active
    exception" (SIGABRT; seen once in 53 restarted runs on a 2-core machine, and in 2 full test
    suites). torchrun takes that for a crash and stops the group. So the wrappers go first: each
    trainer keeps its plain model, which is all sampling and checkpoints need, and the group is
    destroyed now.
    """
    import gc

    for t in trainers:
        if t is not None:
            t.net = t.model
    gc.collect()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ command line
PRESET_CHOICES = ("baseline", "fast")


def _parser(suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """The command line; with ``suppress_defaults`` the result holds only the options given."""
    p = argparse.ArgumentParser(
        prog="python -m ddpm_core.train",
        description="Train the DDPM (one process, or one per GPU/CPU worker under torchrun).",
        argument_default=argparse.SUPPRESS if suppress_defaults else None,
    )
    p.add_argument("--preset", choices=PRESET_CHOICES, default="baseline",
                   help="baseline: the fields' defaults (the paper's plain fp32 step); fast: TrainConfig.fast(), the "
                        "fastest configuration of the series. Options given on the command line win over either.")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        args = typing.get_args(hint)
        base = next((a for a in args if a is not type(None)), hint)
        if base is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **({} if suppress_defaults else {"default": f.default}))
        else:
            conv = base if base in (int, float, str) else str

            def parse(s: str, conv=conv, optional=type(None) in args):
                return None if optional and s.lower() == "none" else conv(s)

            p.add_argument(flag, type=parse, metavar=base.__name__.upper(), help=f"default: {f.default}",
                           **({} if suppress_defaults else {"default": f.default}))
    keep = {} if suppress_defaults else None
    p.add_argument("--sample-grid", metavar="PNG", help="after training, write a grid of EMA samples to this PNG (rank 0)",
                   **(keep if keep is not None else {"default": None}))
    p.add_argument("--samples", type=int, help="images in the sample grid", **(keep if keep is not None else {"default": 64}))
    p.add_argument("--sample-steps", type=int, help="reverse steps for the grid (strided preview; 1000 for the full chain)",
                   **(keep if keep is not None else {"default": 100}))
    return p


def check_sample_args(grid: str | None, n_samples: int, sample_steps: int, timesteps: int) -> None:
    """The sample-grid options, checked before training (they are used after it)."""
    if n_samples < 1:
        raise ValueError(f"--samples must be >= 1, got {n_samples}")
    if not 1 <= sample_steps <= timesteps:
        raise ValueError(f"--sample-steps must be in 1..{timesteps} (the diffusion's steps), got {sample_steps}")
    if grid:
        p = Path(grid)
        if p.suffix.lower() != ".png":
            raise ValueError(f"--sample-grid {grid!r} must name a .png file, e.g. samples.png")
        if p.is_dir():
            raise ValueError(f"--sample-grid {grid!r} is a folder; name a file in it, e.g. {p / 'samples.png'}")
        parent = p.resolve().parent
        try:  # prove it writable now: the grid is written after all the training
            _prove_writable(parent)
        except OSError as e:
            raise ValueError(f"--sample-grid {grid!r}: cannot write into {parent} ({e.strerror or e}). "
                             f"Fix: a path in a folder you can write to.") from e


def main(argv: list[str] | None = None) -> int:
    """The command line. A configuration, path or data error prints ``error: <what and the fix>``
    and exits 2 (no traceback); a run that diverges exits 1 with the same kind of line."""
    args = vars(_parser().parse_args(argv))
    grid, n_samples, sample_steps = args.pop("sample_grid"), args.pop("samples"), args.pop("sample_steps")
    preset_name = args.pop("preset")
    from .data import DatasetError

    try:
        if preset_name == "fast":  # the options given on the command line win over the preset
            given = vars(_parser(suppress_defaults=True).parse_args(argv))
            cfg = TrainConfig.fast(**{k: v for k, v in given.items() if k in args})
        else:
            cfg = TrainConfig(**args)
        check_sample_args(grid, n_samples, sample_steps, cfg.timesteps)
        result = train(cfg)
    except (ValueError, TypeError, DatasetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TrainingDiverged, RendezvousError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    t = result.trainer
    if grid and t.rank == 0:
        from .plots import save_image_grid

        images = t.sample(n_samples, steps=sample_steps)
        from .env import label

        title = f"{cfg.model} DDPM after {t.step} steps ({sample_steps} sampling steps)\n{label(t.device)}"
        path = save_image_grid(images, str(Path(grid).resolve()), title=title)  # relative to the cwd
        print(f"wrote {path}")
    if result.losses and t.rank == 0:
        print(f"done: step {t.step}, last loss {result.losses[-1][1]:.4f}, checkpoints in {Path(cfg.out_dir) / 'checkpoints'}")
    return 0


def exit_worker(code: int) -> typing.NoReturn:
    """Leave a process that torchrun started: flush stdout and stderr, then ``os._exit(code)``.

    A finished worker's exit must not be able to fail. Interpreter finalization and C++ static
    destructors still run after ``main`` has released the process group, and on a 2-core machine
    they have aborted a worker that had finished its work ("terminate called without an active
    exception", SIGABRT, no Python frame): once in 53 restarted runs, and once in a full CI
    run after ``_release_group`` was added. torchrun then stops the whole group as failed.
    Everything a run keeps is written before ``main`` returns (checkpoints are renamed into
    place, JSON results written atomically), so skipping finalization loses nothing; the two
    flushes keep the last printed lines. A process not started by torchrun exits normally.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing left to keep
            pass
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        sys.exit(code)
    os._exit(code)


if __name__ == "__main__":
    import faulthandler

    # A worker that dies of a signal (SIGABRT from C++, SIGSEGV) prints every thread's Python stack first:
    # torchrun's log then shows where a crashed worker was, not only its exit code.
    faulthandler.enable()
    exit_worker(main())
