"""Honest instruments: a synchronizing timer, FLOPs of the real step, MFU against a named peak.

    m = measure(t.train_step, x, batch_size=128, flops=count_flops(t.train_step, x))  # precision: the trainer's
    print(m)                       # ms/step, img/s, TFLOP/s, MFU (vs which peak), peak memory

MFU (model FLOPs utilization) = achieved FLOP/s / the device's dense peak FLOP/s for the
precision the step runs in. The FLOPs are the model's (forward + backward, attention counted as
softmax(QK^T)V whatever kernel ran), so a kernel that recomputes does not earn extra credit.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import statistics
import time
import types
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from .env import device_name
from .text import plural

if TYPE_CHECKING:
    import pandas as pd

# Dense (no 2:4 sparsity) peak TFLOP/s by device and precision, from NVIDIA's datasheets and
# architecture whitepapers. "fp32" is the plain CUDA-core rate; "tf32", "bf16" and "fp16" are
# tensor-core rates (fp32 accumulate where the consumer cards differ). None: no such mode.
PEAK_TFLOPS: dict[str, dict[str, float | None]] = {
    # NVIDIA H100 datasheet (SXM5): FP32 67, TF32 989 / BF16 1979 / FP16 1979 with sparsity -> halve.
    "H100 SXM": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    # NVIDIA H100 datasheet (PCIe): FP32 51, TF32 756 / BF16 1513 / FP16 1513 with sparsity.
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5},
    # NVIDIA H200 datasheet (SXM): same compute as H100 SXM (FP32 67, BF16 1979 sparse), more/faster HBM3e.
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    # NVIDIA A100 datasheet: FP32 19.5, TF32 156, BF16 312, FP16 312 (dense; 40 GB and 80 GB alike).
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    # NVIDIA A10 datasheet: FP32 31.2, TF32 62.5, BF16 125, FP16 125 (dense).
    "A10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    # NVIDIA L4 datasheet: FP32 30.3, TF32 120 / BF16 242 / FP16 242 with sparsity -> halve.
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    # NVIDIA T4 datasheet: FP32 8.1, mixed FP16/FP32 65; Turing has no TF32 and no BF16.
    "T4": {"fp32": 8.1, "tf32": None, "bf16": None, "fp16": 65.0},
    # NVIDIA V100 SXM2 datasheet: FP32 15.7, tensor FP16 125; Volta has no TF32 and no BF16.
    "V100": {"fp32": 15.7, "tf32": None, "bf16": None, "fp16": 125.0},
    # NVIDIA Ampere GA102 whitepaper, RTX 3090: FP32 35.6, TF32 35.6, FP16/BF16 with FP32 accumulate 71.
    "RTX 3090": {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0},
    # NVIDIA Ada Lovelace whitepaper, RTX 4090: FP32 82.6, TF32 82.6, FP16/BF16 with FP32 accumulate 165.2.
    "RTX 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
}

# Which table row a device name belongs to; the first match wins (so "A100" before "A10").
_DEVICE_PATTERNS = [
    (r"H200(?!\s*NVL)", "H200"),  # the H200 NVL, a 600 W PCIe card, has lower datasheet peaks: not the SXM row (add_peak)
    (r"H100.*PCIe", "H100 PCIe"),
    (r"H100", "H100 SXM"),
    (r"A100", "A100"),
    (r"\bA10\b", "A10"),
    (r"\bL4\b", "L4"),
    (r"\bT4\b", "T4"),
    (r"V100", "V100"),
    (r"3090", "RTX 3090"),
    (r"4090", "RTX 4090"),
]


ADDED_PEAK_SOURCES: dict[str, str] = {}  # rows add_peak added in this session, and where their figures come from


def add_peak(key: str, pattern: str, *, fp32: float, tf32: float | None, bf16: float | None, fp16: float | None,
             source: str) -> None:
    """Teach this Python session the peaks of a GPU that ``PEAK_TFLOPS`` lacks, without editing the package.

    ``key`` names the row ("L40S"); ``pattern`` is a regular expression that the name
    ``torch.cuda.get_device_name()`` returns must match ("L40S"); the rates are the datasheet's
    **dense** TFLOP/s (half of any "with sparsity" figure), None for a mode the GPU does not have;
    ``source`` says where they come from (a datasheet URL). The new pattern is tried before the
    built-in ones, so a pattern such as "A10" cannot shadow it. Everything is checked before
    anything changes. To make the row permanent, add it to ``PEAK_TFLOPS`` with its source.
    """
    rates = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16}
    problems = []
    if not isinstance(key, str) or not key.strip():
        problems.append(f"key must name the GPU, e.g. 'L40S'; got {key!r}")
    try:
        re.compile(pattern)
    except (re.error, TypeError) as e:
        problems.append(f"pattern {pattern!r} is not a regular expression ({e})")
    for name, v in rates.items():
        if v is None and name != "fp32":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e5:
            problems.append(f"{name} must be a dense peak in TFLOP/s (a positive number"
                            f"{'' if name == 'fp32' else ', or None where the GPU has no such mode'}); got {v!r}")
    if not isinstance(source, str) or not source.strip():
        problems.append("source must say where the figures come from (the datasheet's URL): MFU is only as good as its peak")
    if problems:
        raise ValueError("add_peak: " + "; ".join(problems))
    PEAK_TFLOPS[key] = {k: (None if v is None else float(v)) for k, v in rates.items()}
    _DEVICE_PATTERNS[:] = [(pattern, key)] + [(p, k) for p, k in _DEVICE_PATTERNS if k != key]
    ADDED_PEAK_SOURCES[key] = source


@dataclass(frozen=True)
class Peak:
    """A peak FLOP/s figure and what it is: MFU always says which peak it divides by."""

    tflops: float
    device: str
    precision: str

    def __str__(self) -> str:
        return f"{self.device} {self.precision} dense peak {self.tflops:g} TFLOP/s"


def peak_for(device: torch.device | str | None, precision: str) -> tuple[Peak | None, str]:
    """The dense peak for ``precision`` on ``device``, or (None, why not).

    On CPU, or a GPU missing from the table, there is no peak: MFU is left out, never guessed.
    Note: with precision "fp32" the series switches TF32 off; cuDNN would otherwise run "fp32"
    convolutions on TF32 tensor cores by default, and the fp32 peak would be the wrong yardstick.
    """
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        return None, "MFU is not reported on CPU: there is no single published peak to divide by"
    name = device_name(device)
    return peak_for_name(name, precision)


def peak_for_name(name: str, precision: str) -> tuple[Peak | None, str]:
    """Like ``peak_for`` but from a device name such as "NVIDIA H100 80GB HBM3"."""
    key = next((k for pat, k in _DEVICE_PATTERNS if re.search(pat, name)), None)
    if key is None:
        return None, (f"MFU left out: {name!r} is not in ddpm_core.bench.PEAK_TFLOPS (give it its dense datasheet "
                      "figures with bench.add_peak(...), notebook 00's Exercise 3)")
    value = PEAK_TFLOPS[key].get(precision)
    if value is None:
        return None, f"MFU left out: {key} has no {precision} tensor-core mode"
    return Peak(value, key, precision), ""


# ------------------------------------------------------------------------------ FLOPs
def _owner_models(fn: Callable) -> list[torch.nn.Module]:
    owner = getattr(fn, "__self__", None)
    found = []
    for obj in (owner, getattr(owner, "model", None), getattr(owner, "net", None)):
        if isinstance(obj, torch.nn.Module):
            found.append(obj)
    return found


@contextlib.contextmanager
def _countable(fn: Callable) -> Iterator[None]:
    """Make ``fn`` countable: eager (not compiled) and with math attention.

    FlopCounterMode sees aten ops, so a compiled step must run eagerly while counting, and the
    attention of our UNet is switched to the explicit softmax(QK^T)V, whose FLOPs every torch
    version counts. It computes the same function as SDPA (see the model tests).
    """
    from .model import AttnBlock

    owner = getattr(fn, "__self__", None)
    saved_loss = None
    if owner is not None and hasattr(owner, "loss_eager") and hasattr(owner, "loss_fn"):
        saved_loss, owner.loss_fn = owner.loss_fn, owner.loss_eager
    blocks = [m for model in _owner_models(fn) for m in model.modules() if isinstance(m, AttnBlock)]
    saved_attn = [b.attention for b in blocks]
    for b in blocks:
        b.attention = "math"
    try:
        yield
    finally:
        for b, a in zip(blocks, saved_attn):
            b.attention = a
        if saved_loss is not None:
            owner.loss_fn = saved_loss


def _sdpa_fallback_mapping() -> dict:
    """FLOP formulas for SDPA kernels this torch's FlopCounterMode does not know.

    Recent torch counts every SDPA backend; older builds skipped some (notably the CPU ones),
    which silently dropped attention from the total. Fill in whatever is missing.
    """
    import torch.utils.flop_counter as fc

    mapping = {}
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
        op = getattr(torch.ops.aten, name, None)
        if op is None or op in fc.flop_registry:
            continue

        def formula(query_shape, key_shape, value_shape, *args, **kwargs):
            return fc.sdpa_flop_count(query_shape, key_shape, value_shape)

        mapping[op] = formula
    return mapping


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """FLOPs of one call of ``fn(*args, **kwargs)`` (e.g. ``t.train_step(x)``: forward + backward).

    Counted with ``torch.utils.flop_counter.FlopCounterMode``. The call really runs once (a
    train step updates the weights). For a ``Trainer`` method it runs eagerly with math
    attention, so compiled and SDPA steps count the same model FLOPs as the baseline.
    """
    return flop_breakdown(fn, *args, **kwargs)["flops"].sum().item()


def flop_breakdown(fn: Callable[..., Any], *args: Any, **kwargs: Any):
    """Per-operator FLOPs of one call, as a DataFrame (op, flops, share) sorted by FLOPs."""
    import pandas as pd

    with _countable(fn), FlopCounterMode(display=False, custom_mapping=_sdpa_fallback_mapping()) as counter:
        fn(*args, **kwargs)
    counts = counter.get_flop_counts().get("Global", {})
    df = pd.DataFrame([{"op": str(op), "flops": int(n)} for op, n in counts.items()], columns=["op", "flops"])
    df = df.sort_values("flops", ascending=False, ignore_index=True)
    total = df["flops"].sum()
    df["share"] = df["flops"] / total if total else 0.0
    return df


def preset_flop_breakdown(name: str, batch_size: int = 1, image_size: int = 32):
    """``flop_breakdown`` of one forward + backward of model preset ``name`` (math attention), built and run on
    PyTorch's meta device: shapes only, no weights and no arithmetic, so the paper's 35.7M-parameter model is counted
    in a second or two on any machine (a smoke run compares the tiny model's shares with it)."""
    from .model import preset

    with torch.device("meta"):
        model = preset(name, attention="math")
    x = torch.randn(batch_size, 3, image_size, image_size, device="meta")
    t = torch.zeros(batch_size, dtype=torch.long, device="meta")
    return flop_breakdown(lambda: model(x, t).float().pow(2).mean().backward())


# ------------------------------------------------------------------------------ timing
@dataclass
class Measurement:
    """Step time and what follows from it. Times in milliseconds, memory in bytes."""

    name: str
    device: str
    device_name: str
    torch_version: str
    batch_size: int
    iters: int
    first_ms: float  # the first call alone: includes compilation, autotuning, allocator warm-up
    median_ms: float
    p10_ms: float
    p90_ms: float
    images_per_s: float
    peak_memory_bytes: int | None
    memory_kind: str  # what peak_memory_bytes measures
    flops_per_step: int | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak: str | None = None  # e.g. "H100 SXM bf16 dense peak 989.4 TFLOP/s"
    # One fixed yardstick for every row, whatever its precision: achieved / the device's dense bf16
    # peak. Per-precision MFU divides fp32 rows by a ~15x lower peak, so it cannot rank stages.
    mfu_bf16: float | None = None
    precision: str | None = None
    reserved_bytes: int | None = None  # CUDA: peak memory reserved by the caching allocator
    note: str = ""
    times_ms: list[float] = field(default_factory=list, repr=False)
    noise: Any = field(default=None, repr=False)  # a Noise, where the measurement recorded one

    @property
    def peak_memory_gib(self) -> float | None:
        return None if self.peak_memory_bytes is None else self.peak_memory_bytes / 2**30

    def row(self) -> dict[str, Any]:
        """A flat dict for tables and the results CSV (without the per-iteration times)."""
        d = asdict(self)
        d.pop("times_ms")
        d.pop("noise", None)
        d["peak_memory_gib"] = self.peak_memory_gib
        return d

    def __str__(self) -> str:
        s = (f"{self.name or 'step'} on {self.device_name}: {self.median_ms:.2f} ms/step "
             f"(p10-p90 {self.p10_ms:.2f}-{self.p90_ms:.2f}), {self.images_per_s:,.0f} img/s, "
             f"first call {self.first_ms:.0f} ms")
        if self.tflops is not None:
            s += f", {self.tflops:.2f} TFLOP/s"
        if self.mfu is not None:
            s += f", MFU {100 * self.mfu:.1f}% of {self.peak}"
        if self.mfu_bf16 is not None and self.precision != "bf16":
            s += f" ({100 * self.mfu_bf16:.1f}% of the bf16 peak)"
        if self.peak_memory_bytes is not None:
            s += f", {self.memory_kind} {self.peak_memory_bytes / 2**20:,.0f} MiB"
        return s + (f" [{self.note}]" if self.note else "")


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _trainer_cfg(fn: Callable[..., Any]) -> Any:
    """The config of the trainer whose method ``fn`` is (``t.train_step``, or ``functools.partial(t.train_step, x)``),
    else None. A lambda hides its trainer: pass ``precision=`` and ``cuda_graphs=`` explicitly then."""
    fn = getattr(fn, "func", fn)  # functools.partial
    return getattr(getattr(fn, "__self__", None), "cfg", None)


def _precision_of(fn: Callable[..., Any]) -> str | None:
    """The precision of the trainer whose method ``fn`` is (``t.train_step``), else None."""
    return getattr(_trainer_cfg(fn), "precision", None)


def _uses_cuda_graphs(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a method of a trainer whose compile mode replays CUDA graphs."""
    from .train import CUDAGRAPH_MODES

    return getattr(_trainer_cfg(fn), "compile", None) in CUDAGRAPH_MODES


def mfu_fields(tflops: float, device_name_: str, precision: str) -> dict[str, Any]:
    """MFU against the dense peak of ``precision`` and against the dense bf16 peak (the fixed
    yardstick), for a GPU named ``device_name_``; None and a note where the table has no peak."""
    out: dict[str, Any] = {"mfu": None, "peak": None, "mfu_bf16": None, "note": ""}
    peak, why = peak_for_name(device_name_, precision)
    if peak is not None:
        out["mfu"], out["peak"] = tflops / peak.tflops, str(peak)
    else:
        out["note"] = why
    bf16, _ = peak_for_name(device_name_, "bf16")
    if bf16 is not None:
        out["mfu_bf16"] = tflops / bf16.tflops
    return out


def cuda_peak_memory(device: torch.device, cuda_graphs: bool, others: int = 0) -> tuple[int, int, str]:
    """(bytes to report, bytes reserved, what the first number is) after the timed calls.

    ``max_memory_allocated`` counts live tensors, but CUDA-graph replays run in a private memory
    pool that was filled when the graph was recorded, before the stats were reset: their
    activations never show up as new allocations. For such steps the memory reserved by the
    caching allocator (which holds the graph pools) is what the step really holds.

    ``others``: bytes the rest of the process held while the step ran (other trainers a notebook
    keeps alive: :func:`held_by_others`), left out of the first number, so that it is this step's
    peak as if it ran alone, not whatever else the kernel holds.
    """
    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    alone = ", this step alone" if others > 0 else ""
    if cuda_graphs:
        return max(allocated, reserved) - others, reserved, f"peak reserved, CUDA{alone}, CUDA-graph pools included"
    return allocated - others, reserved, f"peak allocated, CUDA{alone}"


def owned_bytes(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
                device: torch.device | str | None = None, max_objects: int = 200_000) -> int:
    """Bytes of the tensors on ``device`` that calling ``fn(*args, **kwargs)`` holds: those reachable from the
    callable (a bound method's object, a ``functools.partial``'s function and arguments, a closure's cells, the
    module-level variables a function names: a notebook's ``t`` in ``def step(): t.train_step(x)``) and from
    its arguments, through modules (parameters, their gradients, buffers), optimizers (their state), containers and
    object attributes. Each storage counts once (views share it).

    For a trainer's ``train_step`` that is its weights, gradients, optimizer state, EMA and input batch: what the
    step needs between calls. A tensor the step allocates inside a library the walk cannot see (cuBLAS's
    workspace) is not counted.
    """
    device = torch.device(device) if device is not None else None
    seen_objects: set[int] = set()
    storages: dict[tuple[int, int], int] = {}
    todo: list[Any] = [fn, *args, *(kwargs or {}).values()]
    visited = 0

    def add(t: torch.Tensor) -> None:
        if device is not None and (t.device.type != device.type
                                   or (device.index is not None and t.device.index not in (None, device.index))):
            return
        key = storage_key(t)
        storages[key] = key[1]

    while todo and visited < max_objects:
        obj = todo.pop()
        if (obj is None or isinstance(obj, _NOT_WALKED) or id(obj) in seen_objects
                or type(obj).__module__.split(".")[0] in ("numpy", "pandas", "matplotlib", "PIL")):
            continue
        seen_objects.add(id(obj))
        visited += 1
        try:
            _walk_one(obj, todo, add)
        except Exception:  # noqa: BLE001 - an object that will not be inspected holds nothing we can count
            continue
    return sum(storages.values())


_NOT_WALKED = (str, bytes, int, float, bool, complex, type, types.ModuleType, torch.device, torch.dtype)


def _walk_one(obj: Any, todo: list[Any], add: Callable[[torch.Tensor], None]) -> None:
    """One step of :func:`owned_bytes`' walk: count ``obj`` if it is a tensor, else queue what it holds."""
    if isinstance(obj, torch.Tensor):
        add(obj)
        if obj.grad is not None:
            add(obj.grad)
    elif isinstance(obj, torch.nn.Module):
        todo.extend(obj.parameters())
        todo.extend(obj.buffers())
        todo.extend(v for v in vars(obj).values() if not isinstance(v, dict))  # e.g. tensors kept as attributes
    elif isinstance(obj, torch.optim.Optimizer):
        todo.extend(obj.state.values())
        todo.extend(p for g in obj.param_groups for p in g["params"])
    elif isinstance(obj, dict):
        todo.extend(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        todo.extend(obj)
    elif callable(obj) and (hasattr(obj, "__self__") or hasattr(obj, "__closure__") or hasattr(obj, "func")):
        todo.append(getattr(obj, "__self__", None))  # a bound method's object
        todo.extend(c.cell_contents for c in (getattr(obj, "__closure__", None) or ()) if _filled(c))
        if hasattr(obj, "func"):  # functools.partial
            todo.extend([obj.func, *obj.args, *obj.keywords.values()])
        todo.append(getattr(obj, "__wrapped__", None))
        code, scope = getattr(obj, "__code__", None), getattr(obj, "__globals__", None)
        if code is not None and scope is not None:  # the module-level (a notebook's) variables the function names
            todo.extend(scope[n] for n in _names(code) if n in scope)
    elif hasattr(obj, "__dict__"):
        todo.extend(vars(obj).values())


def _names(code: types.CodeType) -> set[str]:
    """The global names a code object and the code nested in it (comprehensions, inner functions) refer to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell: a variable the closure refers to before it is assigned
        return False
    return True


def held_by_others(fn: Callable[..., Any], args: tuple, kwargs: dict | None, device: torch.device,
                   owned: int | None = None) -> int:
    """Bytes allocated on ``device`` right now that ``fn`` does not hold (:func:`owned_bytes`, or ``owned`` where the
    caller walked it once already): other trainers, leftovers of earlier cells. Call it after the stats reset,
    before the timed calls."""
    if owned is None:
        owned = owned_bytes(fn, args, kwargs, device)
    return max(0, torch.cuda.memory_allocated(device) - owned)


def measure(
    fn: Callable[..., Any],
    *args: Any,
    batch_size: int,
    warmup: int = 3,
    iters: int = 10,
    flops: int | None = None,
    precision: str | None = None,
    device: torch.device | str | None = None,
    name: str = "",
    cuda_graphs: bool | None = None,
    **kwargs: Any,
) -> Measurement:
    """Time ``fn(*args, **kwargs)``: one first call, ``warmup - 1`` more untimed, then ``iters`` timed.

    On CUDA each timed call is bracketed by CUDA events after a synchronize; on CPU by
    ``time.perf_counter``. ``flops`` (per call, from ``count_flops``) gives TFLOP/s, MFU against
    the dense peak of the step's precision, and ``mfu_bf16`` against the dense bf16 peak.
    ``precision`` defaults to the trainer's when ``fn`` is a trainer method (``t.train_step``);
    for any other callable with ``flops`` it must be given. ``cuda_graphs`` (default: from the
    trainer's compile mode when ``fn`` is ``t.train_step``; pass it for a lambda around a trainer
    compiled with "reduce-overhead" or "max-autotune") reports reserved memory, which holds the
    CUDA-graph pools.
    """
    if iters < 1 or warmup < 1:
        raise ValueError(f"need warmup >= 1 (the first call is timed apart) and iters >= 1; got warmup={warmup}, iters={iters}")
    precision = precision or _precision_of(fn)
    if flops is not None and precision is None:
        raise ValueError(
            "measure(..., flops=...) needs the step's precision to compute MFU against the right peak, and "
            "cannot read it from this callable. Fix: pass precision='fp32' | 'tf32' | 'bf16' | 'fp16' "
            "(the trainer's cfg.precision)."
        )
    if cuda_graphs is None:
        cuda_graphs = _uses_cuda_graphs(fn)
    device = torch.device(device) if device is not None else _device_of(args, kwargs)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    sync()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    sync()
    first_ms = 1e3 * (time.perf_counter() - t0)
    for _ in range(warmup - 1):
        fn(*args, **kwargs)
    sync()

    times: list[float] = []
    with CpuLoad() as load:
        if cuda:
            if cuda_graphs:
                # Give back cached blocks nobody uses (earlier stages' leftovers) so that "reserved"
                # counts what this step holds: the graph pools stay, they are in use.
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            others = held_by_others(fn, args, kwargs, device)
            times = _cuda_times(fn, args, kwargs, iters, device)
        else:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn(*args, **kwargs)
                times.append(1e3 * (time.perf_counter() - t0))
    if cuda:
        peak_mem, reserved, mem_kind = cuda_peak_memory(device, cuda_graphs, others)
    else:
        (peak_mem, mem_kind), reserved = saved_tensor_bytes(fn, *args, **kwargs), None
    m = _measurement(name, device, batch_size, first_ms, times, peak_mem, mem_kind, reserved, flops, precision)
    # A single measurement has no ratio to withhold, but it can still say it was taken on a busy machine.
    m.noise = load.noise({name or "step": (m.p90_ms - m.p10_ms) / m.median_ms} if iters >= 3 else {})
    if m.noise.noisy:
        m.note = (m.note + " | " if m.note else "") + "NOISY: " + "; ".join(m.noise.reasons)
    return m


def _cuda_times(fn: Callable[..., Any], args: tuple, kwargs: dict, iters: int, device: torch.device) -> list[float]:
    """``iters`` calls of ``fn``, each bracketed by CUDA events; ms per call."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn(*args, **kwargs)
        e.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _measurement(name: str, device: torch.device, batch_size: int, first_ms: float, times: list[float],
                 peak_mem: int | None, mem_kind: str, reserved: int | None, flops: int | None,
                 precision: str | None) -> Measurement:
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
    median = statistics.median(times)
    m = Measurement(
        name=name, device=str(device), device_name=device_name(device), torch_version=torch.__version__,
        batch_size=batch_size, iters=len(times), first_ms=first_ms, median_ms=median, p10_ms=q[0], p90_ms=q[-1],
        images_per_s=batch_size / (median / 1e3), peak_memory_bytes=peak_mem, memory_kind=mem_kind,
        times_ms=list(times), precision=precision, reserved_bytes=reserved,
    )
    if flops is not None:
        m.flops_per_step = int(flops)
        m.tflops = flops / (median / 1e3) / 1e12
        if device.type == "cuda":
            for key, value in mfu_fields(m.tflops, m.device_name, precision).items():
                setattr(m, key, value)
        else:
            m.note = peak_for(device, precision)[1]
    return m


SAVED_KIND = "saved for backward, CPU"  # no parentheses: the notebooks quote it inside theirs


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(an id of ``t``'s storage, its size in bytes): views of one storage share the key, so it counts once."""
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse, functional wrappers)
        return id(t), t.numel() * t.element_size()


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter (a leaf that requires grad) or a view of one, such as the ``weight.t()`` a Linear layer saves for its
    backward: it shares the parameter's storage, so it is weights, not activations, and costs no memory of its own."""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


def saved_tensor_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[int | None, str]:
    """Bytes of the tensors one call of ``fn`` saves for its backward pass, and what that is.

    The CPU allocator keeps no statistics, and the resident-set size of a process moves with the
    allocator's caching, not with the step (it read 0 MiB for a bf16 step). What a training step
    holds at its peak is, above the weights and optimizer state, the activations autograd saves
    between forward and backward: that is what a bigger batch, bf16 (half the bytes) or a fused
    attention (no T x T matrix) change. Counted with ``torch.autograd.graph.saved_tensors_hooks``
    during one extra call (a real training step), each storage once; parameters (leaf tensors
    that require grad) and views of them are not activations and are left out. Compiled steps report what their
    compiled graph saves. Returns (None, reason) if the hooks cannot run the step.
    """
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not is_parameter(t):
            key, nbytes = storage_key(t)
            seen[key] = nbytes
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*args, **kwargs)
    except RuntimeError as e:
        return None, f"saved-for-backward not measurable here ({str(e).splitlines()[0][:120]})"
    return sum(seen.values()), SAVED_KIND


# ------------------------------------------------------------------------------ comparisons
# A comparison is reported as a ratio only when it can be told apart from noise. The thresholds:
NOISY_SPREAD = 0.25      # (p90 - p10) / median of one variant's repeats above this: too noisy
# A p10-p90 range needs a few timed calls to be a spread: from one call it is a point, from two their distance. With
# fewer timed calls per variant than this, no ratio is stated.
MIN_TIMED = 3
# Fewer timed calls than this, and a stated factor no larger than the two variants' p10-p90 spread: the verdict calls it
# a hint (a short run's range can miss a slow or a fast round that a longer one would catch)
FEW_TIMED = 10
NOISY_OTHER_CPU = 0.25   # other processes used more than this share of the machine's CPU time
SUPERLINEAR = 1.05       # a scaling efficiency above this is a measurement problem, not a result


@dataclass
class Variant:
    """One contender of a comparison: ``fn(*args)`` is one training step on ``batch_size`` images.

    ``flops`` (per call) gives TFLOP/s and MFU; ``precision`` defaults to the trainer's when ``fn``
    is a trainer method; ``cuda_graphs`` as in :func:`measure`.
    """

    name: str
    fn: Callable[..., Any]
    args: tuple = ()
    batch_size: int = 1
    flops: int | None = None
    precision: str | None = None
    cuda_graphs: bool | None = None


class CpuLoad:
    """``with CpuLoad() as load:`` how busy the machine was with *other* work while the block ran.

    ``other_share``: CPU time spent outside this process and its children (hypervisor steal
    included), as a share of all cores' time over the block. ``load_1min``: the higher of the
    1-minute load averages at the start and the end.

    The kernel counts CPU time in clock ticks (10 ms where CLK_TCK is 100), and each counter read here
    is cut to a whole tick: over a block of a few milliseconds one stray tick reads as tens of percent
    of the machine (07's augmentation timing, 10 ms long on an idle machine, read "68%"). So the
    count is lowered by what that rounding can add (``slack_s``: a tick per counter) before it is
    divided: a block too short to measure reads 0, not busy; a block of seconds loses a few points.
    """

    def __enter__(self) -> "CpuLoad":
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        self.cores = psutil.cpu_count() or 1
        self._children: dict[int, float] = {}  # the CPU seconds of each child _own() counted at its last call
        self._procs0 = self._process_times()
        self._busy0, self._own0, self._kernel0 = self._busy(), self._own(), self._kernel_side()
        self._t0 = time.perf_counter()
        self.load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        self.other_share, self.load_1min, self.top_others, self.unnamed = 0.0, self.load_start, [], ""
        return self

    def _busy(self) -> float:
        t = self._psutil.cpu_times()
        return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))

    def _own(self) -> float:
        t = self._proc.cpu_times()
        own = t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
        self._children = {}
        for child in self._proc.children(recursive=True):  # live workers / ranks of this run
            try:
                ct = child.cpu_times()
                own += ct.user + ct.system
                self._children[child.pid] = ct.user + ct.system
            except self._psutil.Error:
                pass
        return own

    def _process_times(self) -> dict[int, tuple[str, float]]:
        """Every process's name and CPU seconds so far (those this user may read), to name the busiest others."""
        out = {}
        for p in self._psutil.process_iter(["name", "cpu_times"]):
            t = p.info.get("cpu_times")
            if t is not None:
                out[p.pid] = (p.info.get("name") or "?", t.user + t.system)
        return out

    def _top_others(self, wall: float, n: int = 3) -> tuple[list[str], float]:
        """The ``n`` other processes that used the most CPU over the block, as 'name, pid P: S% of one core', and the
        CPU seconds of every other process this user can read."""
        mine = {self._proc.pid} | {c.pid for c in self._proc.children(recursive=True)}
        used = []
        for pid, (name, t1) in self._process_times().items():
            if pid in mine:
                continue
            t0 = self._procs0.get(pid, (name, 0.0))[1]  # a process born during the block: all of its time
            if t1 - t0 > 0:
                used.append((t1 - t0, name, pid))
        # no process that rounds to 0% of a core: "the busiest" would name idle ones
        return ([f"{name}, pid {pid}: {100 * d / wall:.0f}% of one core"
                 for d, name, pid in sorted(used, reverse=True)[:n] if d > self.tick_s() * 2 and 100 * d / wall >= 0.5],
                sum(d for d, _, _ in used))

    def _kernel_side(self) -> float:
        """CPU seconds so far in interrupts and in a hypervisor's steal: busy time that belongs to no process."""
        t = self._psutil.cpu_times()
        return sum(getattr(t, k, 0.0) for k in ("irq", "softirq", "steal"))

    @staticmethod
    def tick_s() -> float:
        try:
            return 1.0 / os.sysconf("SC_CLK_TCK")
        except (AttributeError, ValueError, OSError):  # not a POSIX system: psutil's usual resolution
            return 0.01

    def __exit__(self, *exc: Any) -> None:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        children0 = self._children
        other = (self._busy() - self._busy0) - (self._own() - self._own0)
        # a tick per counter read: 6 system-wide, 4 of this process, 2 per child (at the start or the end)
        # a child whose counters did not move between the two reads adds no rounding (an idle compile worker, a
        # kernel waiting): only the children that ran, started or ended count
        moved = sum(1 for pid in children0.keys() | self._children.keys() if children0.get(pid) != self._children.get(pid))
        self.slack_s = self.tick_s() * (6 + 4 + 2 * moved)
        self.other_share = min(1.0, max(0.0, (other - self.slack_s) / (wall * self.cores)))
        end = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        self.load_1min = max(self.load_start, end)
        # who, where the share counts as busy: a warning that names the process can be checked (and acted on)
        self.top_others, self.unnamed = [], ""
        if self.other_share > NOISY_OTHER_CPU:
            self.top_others, named = self._top_others(wall)
            kernel = self._kernel_side() - self._kernel0
            # what no process it can read accounts for: processes that ended during the block (their time leaves the
            # process table with them), other users' processes, interrupts, a hypervisor's steal time
            rest = (other - self.slack_s - named) / (wall * self.cores)
            if rest > 0.5 * self.other_share:
                self.unnamed = (f"{rest:.0%} of the CPU was in no process it could read (processes that ended during "
                                "the block, other users', interrupts or a hypervisor's steal time"
                                + (f"; interrupts and steal: {kernel / (wall * self.cores):.0%})"
                                   if kernel > self.tick_s() * 6 else ")"))

    def noise(self, spreads: dict[str, float] | None = None) -> "Noise":
        """This block's load as a ``Noise``, with the variants' ``spreads`` (none: the machine's load alone, for
        ``Noise.busy`` / ``busy_reasons``)."""
        return Noise(cores=self.cores, load_1min=self.load_1min, other_cpu_share=self.other_share, spreads=spreads or {},
                     top_others=list(self.top_others), unnamed=self.unnamed)


@dataclass
class Noise:
    """How noisy the conditions of one comparison were, and whether that spoils it."""

    cores: int
    load_1min: float
    other_cpu_share: float
    spreads: dict[str, float]  # per variant: (p90 - p10) / median of its repeats
    threads: int = field(default_factory=torch.get_num_threads)
    top_others: list[str] = field(default_factory=list)  # the busiest other processes, where other_cpu_share was high
    unnamed: str = ""  # how much of other_cpu_share no readable process accounts for, where that is most of it

    @property
    def busy_reasons(self) -> list[str]:
        """What other work on the machine did while the rounds ran (then no ratio is stated at all)."""
        out = []
        # The load average counts this run's own threads too (a quiet run with T threads reads about
        # T): what is left above them is other work, and more of it than cores is a busy machine.
        if self.load_1min - self.threads > self.cores:
            out.append(f"the load average was {self.load_1min:.1f} on {self.cores} cores, "
                       f"{self.load_1min - self.threads:.1f} above this run's own {self.threads} threads")
        if self.other_cpu_share > NOISY_OTHER_CPU:
            out.append(f"other processes used {self.other_cpu_share:.0%} of the CPU while it ran"
                       + (f" (the busiest: {'; '.join(self.top_others)})" if self.top_others else "")
                       + (f"; {self.unnamed}" if self.unnamed else ""))
        return out

    @property
    def reasons(self) -> list[str]:
        out = self.busy_reasons
        wide = {k: v for k, v in self.spreads.items() if v > NOISY_SPREAD}
        if wide:
            out.append("repeats of one configuration spread by more than "
                       f"{NOISY_SPREAD:.0%} of their median (" + ", ".join(f"{k}: {v:.0%}" for k, v in wide.items()) + ")")
        return out

    @property
    def busy(self) -> bool:
        """Other work competed with the run: every variant's times are suspect, so no ratio is stated."""
        return bool(self.busy_reasons)

    @property
    def noisy(self) -> bool:
        return bool(self.reasons)

    def wide(self, name: str) -> bool:
        """Whether the repeats of variant ``name`` spread by more than ``NOISY_SPREAD`` of their median."""
        return self.spreads.get(name, 0.0) > NOISY_SPREAD

    def warning(self, rule: str | None = None, busy_rule: str | None = None, ranges: str = "per-image") -> str:
        """'' on a quiet run; else why, and which ratios are still stated: ``Comparison``'s rule, or
        ``rule`` where the caller compares by its own (a spread-only warning then ends with it); on a busy run
        ``busy_rule``, where the caller still states something (default: no speedup at all). ``ranges`` names what
        each timed call measured, where it is not images (``"per-epoch"`` for a variant that runs one epoch)."""
        if not self.noisy:
            return ""
        if self.busy:
            return ("Too noisy to compare: " + "; ".join(self.reasons) + ". " + (
                busy_rule or "No speedup is stated from this run; rerun on a quiet machine (close other programs) or "
                             "with more rounds."))
        if rule is None:
            rule = (f"Where a variant spread that widely, a ratio is stated only if the two {ranges} p10-p90 ranges "
                    f"lie at least {NOISY_SPREAD:.0%} apart (the slower one's p10 against the faster one's p90); "
                    "closer pairs are not compared. Rerun on a quiet machine (close other programs) or with more "
                    "rounds to compare them all.")
        return ("Noisy repeats: " + "; ".join(self.reasons) + ". " + rule).strip()


OTHER_NETWORK = "(other network, by TFLOP/s)"  # ends a speedup cell that compares TFLOP/s (work_factor; plots.peers_figure)


class Comparison:
    """Variants measured side by side in interleaved rounds, with a verdict per pair.

    ``speedup(a, b)`` is a number only when no other work competed with the run, each variant has at
    least ``MIN_TIMED`` timed calls, and the per-image p10-p90 ranges of the two variants lie apart (at
    least 25% apart where a variant's repeats spread widely); otherwise it is None and ``verdict(a, b)``
    says why. On a busy machine nothing is compared, not even the direction of a wide gap: the other work can slow one
    variant far more than another. On a 2-core AVX512-BF16 EPYC (torch 2.14.1), the tiny model's bf16 step ran at 1.19x
    fp32's throughput on the quiet machine, and 3.5x slower, every repeat, with two CPU burners beside it.
    """

    def __init__(self, measurements: list[Measurement], noise: Noise, baseline: int = 0, rounds: int = 0,
                 dropped: dict[str, str] | None = None):
        self.measurements, self.noise, self.rounds = measurements, noise, rounds
        self.baseline = measurements[baseline]
        self.dropped = dict(dropped or {})  # variant name -> where it ran out of memory (compare(on_oom="drop"))

    def __getitem__(self, name: str) -> Measurement:
        for m in self.measurements:
            if m.name == name:
                return m
        raise KeyError(f"no variant named {name!r}; have {[m.name for m in self.measurements]}")

    def _m(self, m: Measurement | str | None) -> Measurement:
        return self.baseline if m is None else (self[m] if isinstance(m, str) else m)

    @staticmethod
    def per_image_range(m: Measurement) -> tuple[float, float]:
        return m.p10_ms / m.batch_size, m.p90_ms / m.batch_size

    def separated(self, a: Measurement | str, b: Measurement | str | None = None) -> bool:
        """Whether the per-image p10-p90 ranges of ``a`` and ``b`` (default: the baseline) do not overlap."""
        (a_lo, a_hi), (b_lo, b_hi) = self.per_image_range(self._m(a)), self.per_image_range(self._m(b))
        return a_hi < b_lo or b_hi < a_lo

    def too_close_for_the_spread(self, a: Measurement | str, b: Measurement | str | None = None) -> bool:
        """Whether ``a`` and ``b`` separate, but one of them spread widely (``Noise.wide``) and their
        per-image ranges lie less than ``NOISY_SPREAD`` apart (the slower one's p10 under 1.25x the
        faster one's p90): a gap that small could be the spread's."""
        a, b = self._m(a), self._m(b)
        if not self.separated(a, b) or not (self.noise.wide(a.name) or self.noise.wide(b.name)):
            return False
        (a_lo, a_hi), (b_lo, b_hi) = self.per_image_range(a), self.per_image_range(b)
        slow_p10, fast_p90 = (a_lo, b_hi) if a_lo > b_hi else (b_lo, a_hi)
        return slow_p10 < (1 + NOISY_SPREAD) * fast_p90

    def noisy(self, a: Measurement | str, b: Measurement | str | None = None) -> bool:
        """Whether noise withheld the ratio of ``a`` to ``b`` (``factor`` says "noisy"): a busy machine, or separate
        ranges too close for a wide spread. False where a ratio is stated, where the ranges overlap, and (on a machine
        that was not busy) where too few calls were timed."""
        if self.speedup(a, b) is not None:
            return False
        return self.noise.busy or (self.too_close_for_the_spread(a, b) and not self.too_few(a, b))

    def too_few(self, a: Measurement | str, b: Measurement | str | None = None) -> bool:
        """Whether ``a`` or ``b`` has fewer than ``MIN_TIMED`` timed calls: too few for a range to be a spread."""
        return min(self._m(a).iters, self._m(b).iters) < MIN_TIMED

    def speedup(self, a: Measurement | str, b: Measurement | str | None = None) -> float | None:
        """Throughput of ``a`` over ``b`` (default: the baseline), or None when noise hides it.

        None on a busy machine (``Noise.busy``: other work competed with every variant), where the
        per-image p10-p90 ranges overlap, and where one of the two spread widely and the ranges lie
        less than 25% apart (``too_close_for_the_spread``). A 10x gap stays a 10x gap however wide
        the spread: only the comparisons the noise can explain are withheld.
        """
        a, b = self._m(a), self._m(b)
        if a is b:
            return 1.0
        if (self.noise.busy or self.too_few(a, b) or not self.separated(a, b)
                or self.too_close_for_the_spread(a, b)):
            return None
        return a.images_per_s / b.images_per_s

    def verdict(self, a: Measurement | str, b: Measurement | str | None = None, ranges: str = "per-image") -> str:
        """How ``a`` compares with ``b`` (default: the baseline), by ``speedup``'s rules. ``ranges`` names what each
        timed call measured, where it is not images (``"per-epoch"`` for variants that each run one epoch)."""
        return self._verdict(a, b, ranges=ranges)

    def work_verdict(self, a: Measurement | str, b: Measurement | str | None = None) -> str:
        """``verdict`` by the rate of work (TFLOP/s), not images/s: for two networks whose FLOPs per image differ
        (another implementation's UNet), where more images per second need not be a faster step. The same rules,
        on the p10-p90 ranges of time per FLOP: a ratio only where they lie apart."""
        a, b = self._m(a), self._m(b)
        if a is b:
            return "baseline"
        by_work = self._by_work(a, b)
        if by_work is None:
            return (f"not compared with {b.name}: the FLOPs of both were not counted, and images/s do not compare "
                    "across networks")
        return by_work._verdict(*by_work.measurements, rate="the TFLOP/s", ranges="per-FLOP",
                                words=("more work per second", "less work per second"))

    def _by_work(self, a: Measurement, b: Measurement) -> "Comparison | None":
        """``a`` and ``b`` as a comparison of work done (FLOPs per timed call, TFLOP/s as the rate) under this run's
        noise, for ``work_verdict`` and ``work_factor``; None where either one's FLOPs were not counted."""
        if not (a.flops_per_step and b.flops_per_step and a.tflops and b.tflops):
            return None
        return Comparison([replace(m, batch_size=m.flops_per_step, images_per_s=m.tflops) for m in (a, b)],
                          self.noise, rounds=self.rounds)

    def _verdict(self, a: Measurement | str, b: Measurement | str | None = None, rate: str = "the throughput",
                 ranges: str = "per-image", words: tuple[str, str] = ("faster", "slower")) -> str:
        a, b = self._m(a), self._m(b)
        if a is b:
            return "baseline"
        if self.noise.busy:
            return "not compared, too noisy (see the warning)"
        if self.too_few(a, b):
            return (f"not compared with {b.name}: {plural(min(a.iters, b.iters), 'timed call')}, too few for a spread "
                    f"(a ratio needs {MIN_TIMED} or more of each)")
        if self.too_close_for_the_spread(a, b):
            return (f"not compared with {b.name}: the repeats spread widely and the two ranges lie less than "
                    f"{NOISY_SPREAD:.0%} apart (see the warning)")
        r = self.speedup(a, b)
        if r is None:
            return f"no measurable difference from {b.name} at this noise level (their {ranges} p10-p90 ranges overlap)"
        # the direction first: b.name often ends in parentheses ("baseline (fp32, eager)"), and a "(faster)" after it nested them
        said = (words[0] if r > 1 else words[1]) + f", at {r:.2f}x {rate} of {b.name}"
        hint = self.hint(a, b)
        return said + (f" ({hint})" if hint else "")

    def hint(self, a: Measurement | str, b: Measurement | str | None = None) -> str:
        """'' unless the ratio of ``a`` to ``b`` is stated but only as a hint: the ranges lie apart, but from fewer than
        ``FEW_TIMED`` timed calls each and by a factor within their repeats' spread; then the words that say so (which
        ``verdict`` appends). A number derived from that ratio (04's break-even step count) carries them too."""
        a, b = self._m(a), self._m(b)
        r = self.speedup(a, b)
        if r is None or a is b:
            return ""
        timed, spread = min(a.iters, b.iters), max((m.p90_ms - m.p10_ms) / m.median_ms for m in (a, b))
        if timed < FEW_TIMED and max(r, 1 / r) - 1 <= spread:  # the ranges lie apart, but from few calls and closely
            return (f"a hint: from {timed} timed calls each, a factor within their repeats' spread of {spread:.0%} "
                    "can be drift between rounds")
        return ""

    def factor(self, a: Measurement | str, b: Measurement | str | None = None) -> str:
        """The short form of ``verdict`` for a table cell: "1.23x" ("1.23x (a hint)" where ``hint`` says so), "noisy"
        or "no measurable difference"."""
        r = self.speedup(a, b)
        if r is not None:
            return f"{r:.2f}x" + (" (a hint)" if self.hint(a, b) else "")
        if self.noisy(a, b):
            return "noisy"
        return "too few repeats" if self.too_few(a, b) else "no measurable difference"

    def best(self) -> tuple[Measurement, list[Measurement]]:
        """The variant with the highest throughput, and the others it cannot be told apart from
        (no ratio stated between them: ``speedup`` is None; on a busy machine, all of them)."""
        best = max(self.measurements, key=lambda m: m.images_per_s)
        ties = [m for m in self.measurements if m is not best and self.speedup(m, best) is None]
        return best, ties

    def best_sentence(self) -> str:
        best, ties = self.best()
        if not ties:
            return f"**{best.name}** is the fastest, and its range separates from every other variant's."
        if self.noise.busy:
            return f"**{best.name}** had the highest median throughput (img/s), but the run was too noisy to call a winner."
        if any(self.too_few(m, best) for m in ties):
            return (f"**{best.name}** had the highest median throughput (img/s), but with fewer than {MIN_TIMED} timed "
                    "calls per variant there is no spread to call a winner by.")
        names = [f"**{m.name}**" for m in ties]
        return (f"**{best.name}** had the highest median throughput (img/s), but it cannot be told apart from "
                + (", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]) + " at this noise level.")

    def work_factor(self, a: Measurement | str, b: Measurement | str | None = None) -> str:
        """``factor`` by the rate of work (TFLOP/s), as ``work_verdict``: for a table cell of another network."""
        by_work = self._by_work(self._m(a), self._m(b))
        return "other network, FLOPs not counted" if by_work is None else f"{by_work.factor(*by_work.measurements)} {OTHER_NETWORK}"

    def table(self, by_work: Sequence[str] = ()) -> "pd.DataFrame":
        """``summary_table`` with the spread of each variant and the verdict-aware speedup column. The variants in
        ``by_work`` are other networks than the baseline's: their cell compares TFLOP/s (``work_factor``), since
        images/s do not compare across networks."""
        t = summary_table(self.measurements, baseline=self.measurements.index(self.baseline))
        t["p10-p90 ms"] = [f"{m.p10_ms:.1f}-{m.p90_ms:.1f}" for m in self.measurements]
        t["speedup"] = ["1.00x (baseline)" if m is self.baseline else self.work_factor(m) if m.name in by_work
                        else self.factor(m) for m in self.measurements]
        return t

    def report(self, only: Sequence[str] | None = None, by_work: Sequence[str] = ()) -> str:
        """Markdown: the noise warning (if any) and one verdict per variant against the baseline; with ``only``, for
        those variants alone (a variant measured in the same rounds for scale, such as the whole step beside a part of
        it, is no alternative to the baseline, and a ratio against it would mean nothing). The variants in ``by_work``
        are other networks than the baseline's: their verdicts compare TFLOP/s (``work_verdict``), not images/s."""
        unknown = sorted(set(only or ()) - {m.name for m in self.measurements})
        if unknown:
            raise KeyError(f"report(only=...) names no measured variant: {unknown}; measured: {[m.name for m in self.measurements]}")
        lines = []
        if self.noise.noisy:
            lines.append(f"**Warning.** {self.noise.warning()}")
        for m in self.measurements:
            if m is not self.baseline and (only is None or m.name in only):
                lines.append(f"- **{m.name}**: " + (f"another network, by the work done per second: {self.work_verdict(m)}."
                                                      if m.name in by_work else f"{self.verdict(m)}."))
        for name, where in self.dropped.items():
            lines.append(f"- **{name}**: ran out of memory beside the other variants ({where}), so it is left out of "
                         "this comparison.")
        lines.append(f"\n<small>{self.rounds} interleaved rounds, {self.noise.threads} torch threads for every variant, "
                     f"other processes' CPU use {self.noise.other_cpu_share:.0%}, load average {self.noise.load_1min:.1f} "
                     f"on {self.noise.cores} cores.</small>")
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self.report()


def compare(variants: list[Variant], *, rounds: int = 5, iters: int = 2, warmup: int = 2, baseline: int = 0,
            device: torch.device | str | None = None, memory: bool = True, progress: bool = True,
            on_oom: str = "raise") -> Comparison:
    """Measure ``variants`` side by side: the protocol every comparison of the series uses.

    1. Each variant's first call is timed apart (compilation, autotuning), then ``warmup - 1``
       more untimed calls.
    2. ``rounds`` interleaved rounds, ABC then CBA, each timing ``iters`` calls of every variant:
       drift (thermals, another program starting) hits all variants alike. Every variant runs in
       this one process, with the same torch thread count.
    3. Each variant's spread (p10-p90) is kept; the machine's load and other processes' CPU use
       are recorded while the rounds run. :class:`Comparison` states a ratio only when no other
       work competed and the two ranges separate by more than the noise explains.

    Memory: on CUDA the peak allocated (reserved for CUDA-graph steps) over the variant's own
    rounds, less what the rest of the process held (the other variants' trainers: :func:`held_by_others`),
    so each row is its step as if alone; on CPU the bytes saved for backward (:func:`saved_tensor_bytes`).

    ``on_oom="drop"``: a variant (not the baseline) that runs out of memory is left out from then on, its cached
    blocks are freed, and the others go on; ``Comparison.dropped`` and ``report()`` say which and where. A batch
    found to fit alone (:func:`largest_batch`) can fail beside the others' inputs and cached blocks, on a 16 GB card
    for one. The default, ``"raise"``, lets the error through.
    """
    from tqdm.auto import tqdm

    if on_oom not in ("raise", "drop"):
        raise ValueError(f"on_oom must be 'raise' or 'drop', got {on_oom!r}")
    if not variants:
        raise ValueError("compare() needs at least one Variant")
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must be unique, got {names}")
    if rounds < 1 or iters < 1 or warmup < 1:
        raise ValueError(f"need rounds, iters and warmup >= 1; got rounds={rounds}, iters={iters}, warmup={warmup}")
    for v in variants:
        if v.flops is not None and (v.precision or _precision_of(v.fn)) is None:
            raise ValueError(f"variant {v.name!r} has flops but no precision: pass precision='fp32' | 'tf32' | 'bf16' | 'fp16'")
    device = torch.device(device) if device is not None else _device_of(variants[0].args, {})
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    first: dict[str, float] = {}
    dropped: dict[str, str] = {}
    rewarm = [False]
    base_name = variants[baseline].name

    def attempt(v: Variant, where: str, thunk: Callable[[], Any]) -> Any:
        """``thunk()``, or None once ``v`` ran out of memory and ``on_oom="drop"`` left it out."""
        if v.name in dropped:
            return None
        try:
            return thunk()
        except Exception as e:  # noqa: BLE001 - only OOM is dropped; anything else is re-raised
            if on_oom != "drop" or not is_out_of_memory(e):
                raise
            if v.name == base_name:
                raise RuntimeError(f"the baseline {v.name!r} ran out of memory ({where}): nothing to compare against. "
                                   "Lower its batch size, or pass a smaller variant as the baseline.") from e
        # after the except clause: the traceback (and the failed step's tensors) is gone, so the cache can be freed
        dropped[v.name] = where
        free_memory(device)
        rewarm[0] = True  # the others' cached blocks went with it: each pays for them again, untimed, before its next timing
        return None

    def run_first(v: Variant) -> float:
        sync()
        t0 = time.perf_counter()
        v.fn(*v.args)
        sync()
        return 1e3 * (time.perf_counter() - t0)

    def run_warmup(v: Variant) -> None:
        for _ in range(warmup - 1):
            v.fn(*v.args)
        sync()

    def run_cpu(v: Variant) -> list[float]:
        got = []
        for _ in range(iters):
            t0 = time.perf_counter()
            v.fn(*v.args)
            got.append(1e3 * (time.perf_counter() - t0))
        return got

    graphs = {v.name: (v.cuda_graphs if v.cuda_graphs is not None else _uses_cuda_graphs(v.fn)) for v in variants}
    bar = tqdm(total=len(variants) * (warmup + rounds), desc="compare", disable=not progress, leave=False)
    for v in variants:
        took = attempt(v, "its first call", lambda: run_first(v))
        if took is not None:
            first[v.name] = took
            attempt(v, "warm-up", lambda: run_warmup(v))
        bar.update(warmup)
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    peak: dict[str, tuple[int, int, str]] = {}
    # what each step holds is set once it has run (weights, Adam state, EMA, batch): walk it once, not every round
    owned = {v.name: owned_bytes(v.fn, v.args, {}, device) for v in variants if v.name not in dropped} if cuda else {}
    with CpuLoad() as load:
        for r in range(rounds):
            for v in (variants if r % 2 == 0 else variants[::-1]):
                bar.update(1)
                if v.name in dropped:
                    continue
                if rewarm[0]:  # after a drop, one untimed call of every variant left, before any is timed again
                    rewarm[0] = False
                    for w in variants:
                        attempt(w, f"the untimed call after a drop, before timed round {r + 1}", lambda: (w.fn(*w.args), sync()))
                    if v.name in dropped:
                        continue
                where = f"timed round {r + 1}"
                if cuda and graphs[v.name]:  # its memory is read once, after the rounds (below)
                    times[v.name] += attempt(v, where, lambda: _cuda_times(v.fn, v.args, {}, iters, device)) or []
                elif cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                    others = held_by_others(v.fn, v.args, {}, device, owned[v.name])  # the other variants' trainers
                    got_times = attempt(v, where, lambda: _cuda_times(v.fn, v.args, {}, iters, device))
                    if got_times is not None:
                        times[v.name] += got_times
                        got = cuda_peak_memory(device, False, others)
                        if v.name not in peak or got[0] > peak[v.name][0]:
                            peak[v.name] = got
                else:
                    times[v.name] += attempt(v, where, lambda: run_cpu(v)) or []
    bar.close()
    kept = [v for v in variants if v.name not in dropped]
    for v in kept if cuda else []:
        if graphs[v.name]:  # its memory from one more call, untimed
            # Give back cached blocks nobody uses so that "reserved" counts what this step holds (its graph pools stay:
            # they are in use). After the timed rounds, not inside them: the variant timed after an empty_cache would
            # pay for allocating its blocks again in its first timed call.
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            others = held_by_others(v.fn, v.args, {}, device, owned[v.name])
            ran_out = False
            try:
                v.fn(*v.args)
                sync()
            except Exception as e:  # noqa: BLE001 - the timings stand; only this extra call's memory reading is lost
                if not is_out_of_memory(e):
                    raise
                ran_out = True
            if ran_out:
                free_memory(device)  # after the except clause, whose traceback held the failed call's tensors
                peak[v.name] = (None, None, "not read: the untimed call that reads it ran out of memory")
                continue
            held, reserved, kind = cuda_peak_memory(device, True, others)
            shared = [n for n, g in graphs.items() if g]  # a dropped one's graphs may still sit in the pool
            if len(shared) > 1:  # one pool per GPU holds every compiled step's graphs: not this step's alone
                kind += f", one pool shared by the {len(shared)} CUDA-graph steps"
            peak[v.name] = (held, reserved, kind)
    measurements = []
    for v in kept:
        if cuda:
            mem, reserved, kind = peak[v.name]
        else:
            (mem, kind), reserved = (saved_tensor_bytes(v.fn, *v.args) if memory else (None, "not measured")), None
        measurements.append(_measurement(v.name, device, v.batch_size, first[v.name], times[v.name], mem, kind,
                                         reserved, v.flops, v.precision or _precision_of(v.fn)))
    spreads = {m.name: (m.p90_ms - m.p10_ms) / m.median_ms for m in measurements}
    noise = load.noise(spreads)
    return Comparison(measurements, noise, baseline=[m.name for m in measurements].index(base_name), rounds=rounds,
                      dropped=dropped)


def comparison_of_times(times: dict[str, list[float]], first_ms: dict[str, float], load: "CpuLoad", *,
                        batch_size: int = 1, rounds: int = 0, device: torch.device | str = "cpu") -> Comparison:
    """A :class:`Comparison` of calls timed outside :func:`compare`, for a protocol that needs untimed work between the
    timed calls (07's Exercise 3 times only the first batch of each epoch, and ends each epoch untimed). ``times``: ms
    per timed call of each variant, the first variant the baseline; ``first_ms``: each one's first call, timed apart;
    ``load``: the ``CpuLoad`` block the timed calls ran in. The same verdicts as ``compare``'s, from the same rules."""
    device = torch.device(device)
    measurements = [_measurement(name, device, batch_size, first_ms[name], list(t), None, "not measured", None, None, None)
                    for name, t in times.items()]
    return Comparison(measurements, load.noise({m.name: (m.p90_ms - m.p10_ms) / m.median_ms for m in measurements}),
                      rounds=rounds)


def compare_in_processes(configs: dict[str, dict[str, Any]], *, batch_size: int, rounds: int = 3, iters: int = 5,
                         warmup: int = 3, flops: int | None = None, baseline: int = 0, timeout: float = 900,
                         progress: bool = True) -> Comparison:
    """:func:`compare` for settings a process remembers: each variant's step is timed in a fresh Python process
    (``python -m ddpm_core.step_bench``), one launch per variant per round, launched in interleaved order (ABC, then
    CBA). ``configs`` maps a variant's name to its ``TrainConfig`` fields; every launch gets this process's torch
    thread count. The times of a variant's launches are pooled; its first call is the median of theirs.

    Why: cuDNN caches the algorithm it picked for each convolution shape for the life of the process, by heuristics
    or by timing the candidates (``cudnn.benchmark``), and a later trainer with the same shapes reuses it. In one
    process, ``cudnn.benchmark=True`` after a ``False`` run of the same shapes changes nothing.
    """
    import subprocess
    import sys
    import tempfile

    from tqdm.auto import tqdm

    if not configs:
        raise ValueError("compare_in_processes() needs at least one configuration")
    if rounds < 1 or iters < 1 or warmup < 1:
        raise ValueError(f"need rounds, iters and warmup >= 1; got rounds={rounds}, iters={iters}, warmup={warmup}")
    from .train import TrainConfig

    for name, fields in configs.items():  # a bad field fails here, with its name, before any launch
        try:
            TrainConfig(**{"dataset": "synthetic", **fields, "batch_size": batch_size})
        except (TypeError, ValueError) as e:
            raise ValueError(f"configuration {name!r} is not a valid TrainConfig: {e}") from e
    names = list(configs)
    got: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    bar = tqdm(total=rounds * len(names), desc="launches", disable=not progress, leave=False)
    with tempfile.TemporaryDirectory(prefix="ddpm-step-bench-") as tmp, CpuLoad() as load:
        for r in range(rounds):
            for i, name in enumerate(names if r % 2 == 0 else names[::-1]):
                out = Path(tmp) / f"r{r}_{i}.json"
                cmd = [sys.executable, "-m", "ddpm_core.step_bench", "--config", json.dumps(configs[name]),
                       "--batch-size", str(batch_size), "--warmup", str(warmup), "--iters", str(iters),
                       "--threads", str(torch.get_num_threads()), "--out", str(out)]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                if proc.returncode != 0 or not out.exists():
                    raise RuntimeError(f"the launch of {name!r} (round {r + 1}) failed with exit {proc.returncode}; "
                                       f"its last output:\n{(proc.stdout + proc.stderr)[-3000:]}")
                got[name].append(json.loads(out.read_text()))
                bar.update(1)
    bar.close()
    measurements = []
    for name in names:
        runs = got[name]
        mem = [r["memory_bytes"] for r in runs if r["memory_bytes"] is not None]
        reserved = [r["reserved_bytes"] for r in runs if r["reserved_bytes"] is not None]
        m = _measurement(name, torch.device(runs[0]["device"]), batch_size, statistics.median(r["first_ms"] for r in runs),
                         [t for r in runs for t in r["times_ms"]], max(mem) if mem else None, runs[0]["memory_kind"],
                         max(reserved) if reserved else None, flops, runs[0]["precision"])
        measurements.append(m)
    spreads = {m.name: (m.p90_ms - m.p10_ms) / m.median_ms for m in measurements}
    noise = load.noise(spreads)
    return Comparison(measurements, noise, baseline=baseline, rounds=rounds)


def scaling_efficiency(single_images_per_s: float, images_per_s: float, world_size: int) -> tuple[float | None, str]:
    """Weak-scaling efficiency, images/s with N processes / (N x one process), and a note.

    Above ``SUPERLINEAR`` (1.05) the number is a measurement problem (the single-process run was
    slowed by something the N-process run was not, or the processes did not share the work as
    assumed), never a result: the value is None and the note says so.
    """
    eff = images_per_s / (world_size * single_images_per_s)
    if world_size > 1 and eff > SUPERLINEAR:
        return None, (f"measured {eff:.2f} > {SUPERLINEAR}: more than linear scaling is a measurement problem "
                      "(noise, or unequal threads per process), not a result")
    return eff, ""


# ------------------------------------------------------------------------------ tables and limits
def same_step_note(earlier: Measurement, now_ms: float, *, where: str, tolerance: float = 0.10) -> str:
    """A sentence for when a step timed again later in a notebook (``now_ms``, median) lies more than ``tolerance``
    from an earlier timing of the same step (``earlier``, described by ``where``), else "". The two were not measured
    side by side, so the gap is the machine's or the process's drift, and only side-by-side pairs are compared."""
    if now_ms <= 0 or earlier.median_ms <= 0:
        raise ValueError(f"need positive step times, got {earlier.median_ms} and {now_ms} ms")
    gap = abs(now_ms / earlier.median_ms - 1)
    if gap <= tolerance:
        return ""
    return (f"({where} timed the same step at {earlier.median_ms:.0f} ms, p10-p90 {earlier.p10_ms:.0f}-{earlier.p90_ms:.0f}; "
            f"this cell at {now_ms:.0f} ms: {gap:.0%} apart. Whatever changed on the machine or in this process in "
            "between is in that gap, which is why only pairs measured side by side, in one cell, are compared.)")


# The memory column of summary_table is named by what its rows measured (see memory_column).
MEMORY_COLUMNS = ("peak memory (MiB)", "saved for backward (MiB)", "memory (MiB)")


def memory_column(measurements: Sequence[Measurement]) -> str:
    """The name of summary_table's memory column: "peak memory (MiB)" where every row is a CUDA peak, "saved for
    backward (MiB)" where every row counted the bytes autograd saves (a CPU: no peak is measured there), and plain
    "memory (MiB)" for a mix (the "memory measured" column then says which is which)."""
    kinds = {m.memory_kind for m in measurements if m.peak_memory_bytes is not None}
    if kinds and all(k.startswith("peak") or "CUDA" in k for k in kinds):
        return MEMORY_COLUMNS[0]
    if kinds == {SAVED_KIND}:
        return MEMORY_COLUMNS[1]
    return MEMORY_COLUMNS[2]


def summary_table(measurements: list[Measurement], baseline: int = 0) -> "pd.DataFrame":
    """The Summary table every notebook ends with: variant, ms/step, img/s, speedup over
    ``measurements[baseline]`` (a ratio of two measurements of this run), memory (named by what was measured:
    :func:`memory_column`), MFU with the peak it divides by (no MFU column where every row ran on a CPU: there is
    no peak to divide by), device."""
    import pandas as pd

    base = measurements[baseline]
    memory = memory_column(measurements)
    rows = []
    for m in measurements:
        rows.append({
            "variant": m.name,
            "batch": m.batch_size,
            "ms/step": round(m.median_ms, 2),
            "img/s": round(m.images_per_s, 1),
            "speedup": f"{m.images_per_s / base.images_per_s:.2f}x",
            memory: None if m.peak_memory_bytes is None else round(m.peak_memory_bytes / 2**20),
            "TFLOP/s": None if m.tflops is None else round(m.tflops, 3),
            # a CPU has no peak to divide by: no column of "n/a" where every row ran on one (dropped below)
            "MFU": (f"{100 * m.mfu:.1f}% of {m.peak}" if m.mfu is not None else
                    None if m.device.startswith("cpu") else (m.note or "n/a")),
            "MFU vs bf16 peak": None if m.mfu_bf16 is None else f"{100 * m.mfu_bf16:.1f}%",
            "memory measured": m.memory_kind,
            "device": m.device_name,
        })
        if m.reserved_bytes is not None:  # CUDA: what the caching allocator held, beside the live-tensor peak
            rows[-1]["reserved (MiB)"] = round(m.reserved_bytes / 2**20)
    df = pd.DataFrame(rows)
    if memory == MEMORY_COLUMNS[1]:  # the column's name already says what every row measured
        df = df.drop(columns="memory measured")
    if len(df) == 1:  # one row: nothing to compare it with
        df = df.drop(columns="speedup")
    return readable(df, drop_empty=("MFU", "MFU vs bf16 peak"))


NOT_AVAILABLE = "n/a"


def with_spread(median: Sequence[float], p10: Sequence[float], p90: Sequence[float], digits: int = 1) -> list[str]:
    """One table column from three: each median with its p10-p90 spread in brackets, e.g. "5.2 (4.4-5.9)"."""
    return [f"{m:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})" for m, lo, hi in zip(median, p10, p90)]


def readable(df: "pd.DataFrame", *, drop_empty: Sequence[str] = (), na: str = NOT_AVAILABLE) -> "pd.DataFrame":
    """``df`` as a reader should see it: the columns named in ``drop_empty`` left out where no row has a value
    (a CPU has no bf16 peak, so that column would be a column of blanks), and every other missing cell shown as
    ``na`` instead of pandas' ``None``/``NaN``. Columns with no missing cell keep their dtype. An empty string counts
    as no value (a note column with nothing to note)."""
    df = df.drop(columns=[c for c in drop_empty if c in df and df[c].map(lambda v: v is None or v != v or v == "").all()])
    for c in df.columns:
        if df[c].isna().any():
            df[c] = df[c].astype(object).where(df[c].notna(), na)
    return df


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is the device running out of memory (CUDA OOM, or the CPU allocator failing)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and ("out of memory" in str(err).lower() or "can't allocate memory" in str(err).lower())


def free_memory(device: torch.device | str | None = None, compiled: bool = False) -> None:
    """Give cached device memory back after an out-of-memory error, or once trainers are deleted, so the kernel lives on.

    Call it after the ``except`` clause that caught the error, not inside it: until the clause
    ends, the exception's traceback keeps the failed step's frames and tensors alive.

    ``compiled``: also drop every function ``torch.compile`` made in this process (``torch._dynamo.reset()``), and with
    them the CUDA-graph memory pool of ``reduce-overhead`` (one per GPU, shared by every compiled trainer). ``del
    trainer`` alone does not free that pool: Dynamo keeps compiled code on the code object of the function it
    compiled (``Trainer.loss_eager``, the same for every trainer). Trainers compiled before the call compile again at
    their next step (Inductor's on-disk cache makes that quicker than the first time).
    """
    import gc

    if compiled:
        import torch._dynamo as dynamo  # "import torch._dynamo" here would make torch a local name of this function

        dynamo.reset()
    gc.collect()
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def largest_batch(step: Callable[[int], Any], start: int, max_batch: int, device: torch.device | str | None = None) -> tuple[int | None, bool]:
    """Double the batch from ``start`` while ``step(batch)`` runs; return (largest that ran, hit OOM).

    ``step(b)`` should build its input and run one training step at batch ``b``. Out-of-memory
    errors are caught and the cache is freed, so the caller's process survives.
    """
    best, b, hit = None, start, False
    while b <= max_batch:
        try:
            step(b)
        except Exception as e:  # noqa: BLE001 - only OOM is expected; anything else is re-raised
            if not is_out_of_memory(e):
                raise
            hit = True
        # Free only here, after the except clause: while it runs, the exception's traceback keeps
        # the failed step's frames, and with them its activations, alive.
        if hit:
            break
        best, b = b, b * 2
    free_memory(device)
    return best, hit


def attention_inputs(model_or_trainer: Any, x: torch.Tensor, t: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k, v that the model's first attention block really hands to attention, for input ``x``.

    Runs one forward pass (no gradients) and records them, under the trainer's autocast when given
    a ``Trainer``, so a bf16 trainer yields bf16 tensors with the model's own shapes and strides.
    Probe these with ``sdpa_backends``: a synthetic contiguous tensor can pass checks (layout,
    dtype) that the model's tensors fail.
    """
    return every_attention_input(model_or_trainer, x, t)[0]


def every_attention_input(model_or_trainer: Any, x: torch.Tensor, t: torch.Tensor | None = None
                          ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``attention_inputs`` for every attention block of the model, in the order the forward pass calls them."""
    from .model import AttnBlock

    model = getattr(model_or_trainer, "model", model_or_trainer)
    autocast = getattr(model_or_trainer, "_autocast", contextlib.nullcontext)
    blocks = [m for m in model.modules() if isinstance(m, AttnBlock)]
    if not blocks:
        raise ValueError("this model has no attention block (attn_resolutions is empty)")
    device = next(model.parameters()).device
    x = x.to(device)
    t = torch.zeros(x.shape[0], dtype=torch.long, device=device) if t is None else t.to(device)
    seen: list[tuple[torch.Tensor, ...]] = []

    def recorder(original):
        def record(h: torch.Tensor):
            out = original(h)
            seen.append(tuple(a.detach() for a in out))
            return out
        return record

    for block in blocks:
        block.qkv_tokens = recorder(block.qkv_tokens)
    try:
        with torch.no_grad(), autocast():
            model(x, t)
    finally:
        for block in blocks:
            del block.qkv_tokens  # back to the class method
    return seen  # type: ignore[return-value] - each entry is the (q, k, v) that qkv_tokens returned


def math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(QK^T / sqrt(d)) V, with the N x N matrix written out: the model's ``attention="math"`` path."""
    return torch.matmul((torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5).softmax(dim=-1), v)


def attention_cores(model_or_trainer: Any, x: torch.Tensor, attention: Callable[..., torch.Tensor] | None = None
                    ) -> Callable[[], None]:
    """A function that runs the attention cores of one training step: ``attention`` (default ``math_attention``),
    forward and backward, on the q, k, v every attention block receives for ``x`` (their shapes, strides and dtype,
    under the trainer's autocast). Time it alone with :func:`measure`, or against another kernel's cores in
    interleaved rounds with :func:`compare` (``Variant(name, attention_cores(...), (), batch)``)."""
    fn = attention or math_attention
    autocast = getattr(model_or_trainer, "_autocast", contextlib.nullcontext)  # a bf16 step's softmax runs in fp32
    inputs = [tuple(a.detach().clone().requires_grad_(True) for a in qkv) for qkv in every_attention_input(model_or_trainer, x)]

    def cores() -> None:
        for q, k, v in inputs:
            with autocast():
                out = fn(q, k, v)
            out.backward(torch.ones_like(out))
            q.grad = k.grad = v.grad = None

    cores.inputs = inputs  # for measure()'s device, and for a reader who wants the shapes
    return cores


def attention_core_ms(model_or_trainer: Any, x: torch.Tensor, *, iters: int = 5, warmup: int = 2,
                      attention: Callable[..., torch.Tensor] | None = None) -> float:
    """Milliseconds that the attention cores of one training step take when timed alone (:func:`attention_cores`),
    summed over the blocks; the median of ``iters`` timed calls.

    The projections around it (the qkv and output 1x1 convolutions, the norm) are not in it: they run the same
    whichever attention kernel is used. So this is what a faster attention kernel can take off the step at most:
    see ``amdahl_bound``. To say whether one kernel's cores are faster than another's, time both in one
    :func:`compare`: one median each, timed one after the other, has no spread to judge by.
    """
    cores = attention_cores(model_or_trainer, x, attention)
    return measure(cores, batch_size=x.shape[0], warmup=warmup, iters=iters, device=cores.inputs[0][0].device).median_ms


def amdahl_bound(step_ms: float, part_ms: float) -> float:
    """The largest speedup of a whole step that making one part of it (``part_ms`` of ``step_ms``) free could give:
    step / (step - part). Infinity where the part takes the whole step."""
    if step_ms <= 0 or part_ms < 0:
        raise ValueError(f"need step_ms > 0 and part_ms >= 0, got {step_ms} and {part_ms}")
    rest = step_ms - min(part_ms, step_ms)
    return math.inf if rest == 0 else step_ms / rest


def part_change_bounds(step_ms: float, part_ms: float, new_part_ms: float, *, part_factor: float | None
                       ) -> tuple[float, float]:
    """The range a whole-step throughput factor can take when a change touches only one part of the step: the part
    takes ``part_ms`` of the ``step_ms`` step, and ``new_part_ms`` after the change (both timed alone).

    ``part_factor`` is the new part's speedup over the old one from a side-by-side comparison
    (``Comparison.speedup(new, old)``): which way the part moved, not read from two medians that noise can order
    either way. None: the comparison did not tell the two apart.

    Returns ``(lowest, highest)``. The step cannot get slower than adding the part's extra time on top, nor faster than
    making the part free (``amdahl_bound``); a part measurably slower cannot make the step faster (highest 1.0), one
    measurably faster cannot make it slower (lowest 1.0), and one not told apart is bounded on both sides. A measured
    factor outside this range is not the change's doing: it is drift between the rounds that the interleaving did not
    cancel.
    """
    if step_ms <= 0 or part_ms < 0 or new_part_ms < 0:
        raise ValueError(f"need step_ms > 0 and part times >= 0, got {step_ms}, {part_ms} and {new_part_ms}")
    slowest = step_ms / (step_ms + abs(new_part_ms - part_ms))
    faster, slower = part_factor is not None and part_factor > 1, part_factor is not None and part_factor < 1
    return (1.0 if faster else slowest, 1.0 if slower else amdahl_bound(step_ms, part_ms))


def spread_margin(*measurements: "Measurement") -> float:
    """How far a factor between ``measurements`` can sit from what their parts' own times predict by their noise alone:
    half the sum of their relative p10-p90 spreads (two steps that each spread 4% give +-4%)."""
    return sum((m.p90_ms - m.p10_ms) / m.median_ms for m in measurements) / 2


def ranges_apart(a, b) -> bool:
    """Whether two timings' p10-p90 ranges do not overlap (``a`` and ``b``: mappings or rows with ``p10_ms`` and
    ``p90_ms``): the rule by which 05 reads attention timed alone, one length after another, in its text and figure."""
    return a["p90_ms"] < b["p10_ms"] or b["p90_ms"] < a["p10_ms"]


def past_bounds(factor: float, low: float, high: float, margin: float = 0.0) -> bool:
    """Whether ``factor`` lies outside ``[low, high]`` (``part_change_bounds``, ``amdahl_bound``) by more than the
    relative ``margin`` (``spread_margin``): only then is it drift, not the change. A factor just past a bound,
    within the steps' own spread, is what a change of that size measures on a noisy step."""
    return factor < low * (1 - margin) or factor > high * (1 + margin)


def sdpa_backends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> "pd.DataFrame":
    """Which ``scaled_dot_product_attention`` backends accept these inputs, and which one the
    dispatcher picks by default. Each backend is forced with ``torch.nn.attention.sdpa_kernel``;
    the reason a backend refuses (dtype, head size, device) is kept."""
    import warnings

    import pandas as pd
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {int(getattr(SDPBackend, n)): n for n in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")}
    try:
        chosen = names.get(int(torch._fused_sdp_choice(q, k, v)), "unknown")
    except Exception as e:  # noqa: BLE001 - a private helper; report rather than fail
        chosen = f"unknown ({type(e).__name__})"
    rows = []
    for code, name in names.items():
        try:
            with warnings.catch_warnings(record=True) as caught, sdpa_kernel(getattr(SDPBackend, name)):
                warnings.simplefilter("always")
                F.scaled_dot_product_attention(q, k, v)
            ok, why = True, ""
        except RuntimeError as e:
            ok = False
            why = " ".join(str(w.message) for w in caught)
            if not why:
                why = (f"no {name} kernel for {q.device.type} inputs" if "No viable backend" in str(e) and q.device.type == "cpu"
                       else str(e).splitlines()[0])
        rows.append({"backend": name, "runs": ok, "default choice": name == chosen, "why not": why[:200]})
    return pd.DataFrame(rows)


def loader_timing(loader: Any, step: Callable[[torch.Tensor], Any], steps: int, warmup: int = 2,
                  device: torch.device | str | None = None, raw: bool = False) -> dict[str, Any]:
    """Run ``step(batch)`` on ``steps`` batches of ``loader`` and split each step's wall time into
    waiting for the batch (``next()``, host-to-device copy included) and computing on it.

    Both sides are synchronized with the device. The first ``warmup`` batches (worker start-up,
    first-call costs) are not counted. Returns mean data-wait and compute ms per step, the share
    of time waiting, and images/s over the counted steps; with ``raw``, also each counted step's times
    (``waits_ms``, ``computes_ms``) and the images (``images``), which ``loader_rounds`` pools.
    """
    device = torch.device(device) if device is not None else getattr(loader, "device", torch.device("cpu"))
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    from .data import forever

    it = forever(loader) if hasattr(loader, "set_epoch") else iter(loader)
    waits: list[float] = []
    computes: list[float] = []
    images = 0
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        x = next(it)
        sync()
        t1 = time.perf_counter()
        step(x)
        sync()
        t2 = time.perf_counter()
        if i >= warmup:
            waits.append(1e3 * (t1 - t0))
            computes.append(1e3 * (t2 - t1))
            images += x.shape[0]
    out: dict[str, Any] = _loader_summary(waits, computes, images)
    if raw:
        out.update(waits_ms=waits, computes_ms=computes, images=images)
    return out


def _loader_summary(waits: list[float], computes: list[float], images: int) -> dict[str, float]:
    """Mean data wait and compute per step (ms), their p10-p90, the share waiting and images/s, from per-step times."""
    wait, compute = sum(waits) / 1e3, sum(computes) / 1e3
    total = wait + compute

    def q(v: list[float], k: int) -> float:
        return statistics.quantiles(v, n=10, method="inclusive")[k] if len(v) > 1 else v[0]

    return {"data_wait_ms": 1e3 * wait / len(waits), "compute_ms": 1e3 * compute / len(computes),
            "wait_share": wait / total if total else 0.0, "images_per_s": images / total if total else 0.0,
            "data_wait_p10_ms": q(waits, 0), "data_wait_p90_ms": q(waits, -1),
            "compute_p10_ms": q(computes, 0), "compute_p90_ms": q(computes, -1)}


def loader_rounds(settings: Sequence[tuple[str, Callable[[], Any]]], step: Callable[[torch.Tensor], Any], *,
                  steps: int, warmup: int = 2, rounds: int = 3, device: torch.device | str | None = None
                  ) -> dict[str, dict[str, float]]:
    """``loader_timing`` of several loader settings, side by side in interleaved rounds (ABC, then CBA, ...), as
    ``compare`` times steps: drift (another program starting, thermals) hits every setting alike.

    ``settings``: (name, make) pairs, ``make()`` building that setting's loader. Each round builds every loader afresh
    (a loader kept alive between rounds would go on decoding in its workers while the others are timed, and start
    its next round with batches ready), leaves out its first ``warmup`` batches and times ``steps``, spread over the
    rounds (at least 2 a round). Returns, per name, ``loader_timing``'s numbers over every round's steps pooled,
    ``rounds`` and ``steps`` (the timed steps pooled).
    """
    if rounds < 1 or not settings:
        raise ValueError(f"loader_rounds needs rounds >= 1 and at least one setting, got {rounds} and {len(settings)}")
    per_round = max(2, math.ceil(steps / rounds))
    pooled: dict[str, dict[str, Any]] = {name: {"waits": [], "computes": [], "images": 0} for name, _ in settings}
    for r in range(rounds):
        for name, make in (settings if r % 2 == 0 else list(reversed(settings))):
            t = loader_timing(make(), step, per_round, warmup=warmup, device=device, raw=True)
            pooled[name]["waits"] += t["waits_ms"]
            pooled[name]["computes"] += t["computes_ms"]
            pooled[name]["images"] += t["images"]
    return {name: {**_loader_summary(p["waits"], p["computes"], p["images"]), "rounds": rounds, "steps": len(p["waits"])}
            for name, p in pooled.items()}


def loader_throughput(loader: Any, batches: int, warmup: int = 2, device: torch.device | str | None = None) -> dict[str, float]:
    """Images per second that ``loader`` delivers on its own (no training step): what the data path
    could feed a step that took no time. Synchronized with the device after each batch.

    ``batch_ms`` is the mean time per batch (the images/s in other units); ``batch_ms_median`` the median. With
    worker processes batches arrive in bursts: those already decoded while the loop waited for another come at once,
    so the median can lie far under the mean, which is what sets the rate."""
    device = torch.device(device) if device is not None else getattr(loader, "device", torch.device("cpu"))
    from .data import forever

    it = forever(loader) if hasattr(loader, "set_epoch") else iter(loader)
    times, images = [], 0
    for i in range(warmup + batches):
        t0 = time.perf_counter()
        x = next(it)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            images += x.shape[0]
    return {"loader_images_per_s": images / sum(times), "batch_ms": 1e3 * sum(times) / len(times),
            "batch_ms_median": 1e3 * statistics.median(times)}
