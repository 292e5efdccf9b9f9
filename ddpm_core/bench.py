"""Honest instruments: a synchronizing timer, FLOPs of the real step, MFU against a named peak.

    m = measure(t.train_step, x, batch_size=128, flops=count_flops(t.train_step, x))  # precision: the trainer's
    print(m)                       # ms/step, img/s, TFLOP/s, MFU (vs which peak), peak memory

MFU (model FLOPs utilization) = achieved FLOP/s / the device's dense peak FLOP/s for the
precision the step runs in. The FLOPs are the model's (forward + backward, attention counted as
softmax(QK^T)V whatever kernel ran), so a kernel that recomputes does not earn extra credit.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from .env import device_name

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
    (r"H200", "H200"),
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
        return None, f"MFU left out: {name!r} is not in ddpm_core.bench.PEAK_TFLOPS (add its datasheet figures)"
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
    if owner is not None and hasattr(owner, "_loss_eager") and hasattr(owner, "_loss"):
        saved_loss, owner._loss = owner._loss, owner._loss_eager
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
            owner._loss = saved_loss


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

    @property
    def peak_memory_gib(self) -> float | None:
        return None if self.peak_memory_bytes is None else self.peak_memory_bytes / 2**30

    def row(self) -> dict[str, Any]:
        """A flat dict for tables and the results CSV (without the per-iteration times)."""
        d = asdict(self)
        d.pop("times_ms")
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


class _RssSampler:
    """Peak resident memory of this process above its level at start, sampled every ``interval`` s.

    The CPU allocator keeps no statistics, so on CPU this is the honest stand-in for
    ``torch.cuda.max_memory_allocated``: what the measured steps added to the process.
    """

    def __init__(self, interval: float = 0.002):
        import psutil

        self.proc, self.interval = psutil.Process(), interval
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> "_RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def increase(self) -> int:
        return max(0, self.peak - self.base)


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _precision_of(fn: Callable[..., Any]) -> str | None:
    """The precision of the trainer whose method ``fn`` is (``t.train_step``), else None."""
    cfg = getattr(getattr(fn, "__self__", None), "cfg", None)
    return getattr(cfg, "precision", None)


def _uses_cuda_graphs(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a method of a trainer whose compile mode replays CUDA graphs."""
    from .train import CUDAGRAPH_MODES

    cfg = getattr(getattr(fn, "__self__", None), "cfg", None)
    return getattr(cfg, "compile", None) in CUDAGRAPH_MODES


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


def cuda_peak_memory(device: torch.device, cuda_graphs: bool) -> tuple[int, int, str]:
    """(bytes to report, bytes reserved, what the first number is) after the timed calls.

    ``max_memory_allocated`` counts live tensors, but CUDA-graph replays run in a private memory
    pool that was filled when the graph was recorded, before the stats were reset: their
    activations never show up as new allocations. For such steps the memory reserved by the
    caching allocator (which holds the graph pools) is what the step really holds.
    """
    allocated = torch.cuda.max_memory_allocated(device)
    reserved = torch.cuda.max_memory_reserved(device)
    if cuda_graphs:
        return max(allocated, reserved), reserved, "peak reserved (CUDA, includes CUDA-graph pools)"
    return allocated, reserved, "peak allocated (CUDA)"


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
    if cuda:
        if cuda_graphs:
            # Give back cached blocks nobody uses (earlier stages' leftovers) so that "reserved"
            # counts what this step holds: the graph pools stay, they are in use.
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends):
            s.record()
            fn(*args, **kwargs)
            e.record()
        sync()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        peak_mem, reserved, mem_kind = cuda_peak_memory(device, cuda_graphs)
    else:
        with _RssSampler() as rss:
            for _ in range(iters):
                t0 = time.perf_counter()
                fn(*args, **kwargs)
                times.append(1e3 * (time.perf_counter() - t0))
        peak_mem, reserved, mem_kind = rss.increase, None, "peak RSS increase (CPU, sampled)"

    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else [times[0]] * 9
    median = statistics.median(times)
    m = Measurement(
        name=name, device=str(device), device_name=device_name(device), torch_version=torch.__version__,
        batch_size=batch_size, iters=iters, first_ms=first_ms, median_ms=median, p10_ms=q[0], p90_ms=q[-1],
        images_per_s=batch_size / (median / 1e3), peak_memory_bytes=peak_mem, memory_kind=mem_kind,
        times_ms=times, precision=precision, reserved_bytes=reserved,
    )
    if flops is not None:
        m.flops_per_step = int(flops)
        m.tflops = flops / (median / 1e3) / 1e12
        if cuda:
            for key, value in mfu_fields(m.tflops, m.device_name, precision).items():
                setattr(m, key, value)
        else:
            m.note = peak_for(device, precision)[1]
    return m


# ------------------------------------------------------------------------------ tables and limits
def summary_table(measurements: list[Measurement], baseline: int = 0) -> "pd.DataFrame":
    """The Summary table every notebook ends with: variant, ms/step, img/s, speedup over
    ``measurements[baseline]`` (a ratio of two measurements of this run), peak memory, MFU with
    the peak it divides by, device."""
    import pandas as pd

    base = measurements[baseline]
    rows = []
    for m in measurements:
        rows.append({
            "variant": m.name,
            "batch": m.batch_size,
            "ms/step": round(m.median_ms, 2),
            "img/s": round(m.images_per_s, 1),
            "speedup": f"{m.images_per_s / base.images_per_s:.2f}x",
            "peak memory (MiB)": None if m.peak_memory_bytes is None else round(m.peak_memory_bytes / 2**20),
            "TFLOP/s": None if m.tflops is None else round(m.tflops, 3),
            "MFU": f"{100 * m.mfu:.1f}% of {m.peak}" if m.mfu is not None else (m.note or "n/a"),
            "MFU vs bf16 peak": None if m.mfu_bf16 is None else f"{100 * m.mfu_bf16:.1f}%",
            "device": m.device_name,
        })
    return pd.DataFrame(rows)


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is the device running out of memory (CUDA OOM, or the CPU allocator failing)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and ("out of memory" in str(err).lower() or "can't allocate memory" in str(err).lower())


def free_memory(device: torch.device | str | None = None) -> None:
    """Give cached device memory back after an out-of-memory error, so the kernel lives on.

    Call it after the ``except`` clause that caught the error, not inside it: until the clause
    ends, the exception's traceback keeps the failed step's frames and tensors alive.
    """
    import gc

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
    from .model import AttnBlock

    model = getattr(model_or_trainer, "model", model_or_trainer)
    autocast = getattr(model_or_trainer, "_autocast", contextlib.nullcontext)
    block = next((m for m in model.modules() if isinstance(m, AttnBlock)), None)
    if block is None:
        raise ValueError("this model has no attention block (attn_resolutions is empty)")
    device = next(model.parameters()).device
    x = x.to(device)
    t = torch.zeros(x.shape[0], dtype=torch.long, device=device) if t is None else t.to(device)
    seen: list[tuple[torch.Tensor, ...]] = []
    original = block.qkv_tokens

    def record(h: torch.Tensor):
        out = original(h)
        seen.append(tuple(a.detach() for a in out))
        return out

    block.qkv_tokens = record
    try:
        with torch.no_grad(), autocast():
            model(x, t)
    finally:
        del block.qkv_tokens  # back to the class method
    q, k, v = seen[0]
    return q, k, v


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
                  device: torch.device | str | None = None) -> dict[str, float]:
    """Run ``step(batch)`` on ``steps`` batches of ``loader`` and split each step's wall time into
    waiting for the batch (``next()``, host-to-device copy included) and computing on it.

    Both sides are synchronized with the device. The first ``warmup`` batches (worker start-up,
    first-call costs) are not counted. Returns mean data-wait and compute ms per step, the share
    of time waiting, and images/s over the counted steps.
    """
    device = torch.device(device) if device is not None else getattr(loader, "device", torch.device("cpu"))
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    from .data import forever

    it = forever(loader) if hasattr(loader, "set_epoch") else iter(loader)
    wait = compute = 0.0
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
            wait += t1 - t0
            compute += t2 - t1
            images += x.shape[0]
    total = wait + compute
    return {"data_wait_ms": 1e3 * wait / steps, "compute_ms": 1e3 * compute / steps,
            "wait_share": wait / total if total else 0.0, "images_per_s": images / total if total else 0.0}
