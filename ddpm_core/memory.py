"""What takes memory in a training step: the fixed state, the activations saved for backward,
and (on a GPU) the allocator's timeline of one step.

A training step holds two kinds of memory:

- **the fixed state**, whatever the batch: the weights, their gradients, the optimizer's state
  (Adam: two moments per weight) and the EMA copy of the weights. ``fixed_state`` computes it
  from the parameter count and checks it against the tensors the trainer really holds;
- **the activations** autograd saves between forward and backward, which grow with the batch.
  ``saved_by_module`` measures them with ``torch.autograd.graph.saved_tensors_hooks`` and names
  the module that saved each one. This works on a CPU as well as on a GPU.

On a GPU, ``cuda_timeline`` records the caching allocator's history over one step
(``torch.cuda.memory._record_memory_history``) and returns the bytes allocated after every
event, so the rise through the forward pass, the peak and the fall through backward can be drawn.
"""

from __future__ import annotations

from typing import Any, Callable

import pandas as pd
import torch
from torch import nn

from .bench import _cuda_times, is_parameter, storage_key

MiB = 2**20


def fixed_state(trainer: Any) -> pd.DataFrame:
    """The batch-independent memory of ``trainer``: computed and measured, in bytes.

    *computed*: parameter count x bytes per element (x2 for Adam's two moments); *measured*: the
    sizes of the tensors the trainer holds (its parameters, their ``.grad``, the optimizer state,
    the EMA weights). Gradients and optimizer state exist only after the first step.
    """
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    size = params[0].element_size()
    rows = [{"what": "weights", "computed": n * size, "measured": sum(p.numel() * p.element_size() for p in params)}]
    grads = [p.grad for p in params if p.grad is not None]
    rows.append({"what": "gradients", "computed": n * size,
                 "measured": sum(g.numel() * g.element_size() for g in grads) if grads else 0})
    moments = {"exp_avg": "Adam first moment (m)", "exp_avg_sq": "Adam second moment (v)"}
    opt = trainer.optimizer
    for key, label in moments.items():
        held = [s[key] for s in opt.state.values() if key in s]
        if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            rows.append({"what": label, "computed": n * size,
                         "measured": sum(t.numel() * t.element_size() for t in held)})
    if trainer.ema is not None:
        ema = list(trainer.ema.model.parameters())
        rows.append({"what": "EMA weights", "computed": n * size, "measured": sum(p.numel() * p.element_size() for p in ema)})
    df = pd.DataFrame(rows)
    df["computed_MiB"] = df["computed"] / MiB
    df["measured_MiB"] = df["measured"] / MiB
    return df


def saved_by_module(model: nn.Module, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> pd.DataFrame:
    """Run ``fn(*args)`` (one training step of ``model``) and attribute every tensor saved for
    backward to the innermost module of ``model`` that was running when it was saved.

    Each storage is counted once (where it was first saved); parameters (and views of them) are not activations and
    are left out. Returns one row per saving module: ``module`` (its name in ``model``; "(model)"
    for functional code in the UNet's own forward), ``type`` (its class), ``block`` (the
    top-level block it belongs to, e.g. ``down.1``), ``tensors`` and ``bytes``.
    """
    names = {m: name for name, m in model.named_modules()}
    stack: list[nn.Module] = []
    handles = []

    def pre(m: nn.Module, _args: Any) -> None:
        stack.append(m)

    def post(m: nn.Module, _args: Any, _out: Any) -> None:
        if stack and stack[-1] is m:
            stack.pop()

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    seen: dict[int, None] = {}
    counts: dict[nn.Module, list[int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if is_parameter(t):  # a parameter or a view of one (a Linear saves weight.t()): weights, not activations
            return t
        key, nbytes = storage_key(t)
        if key not in seen:
            seen[key] = None
            owner = stack[-1] if stack else model
            c = counts.setdefault(owner, [0, 0])
            c[0] += 1
            c[1] += nbytes
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    rows = []
    for m, (k, nbytes) in counts.items():
        name = names.get(m, "?") or "(model)"
        parts = name.split(".")
        block = ".".join(parts[:2]) if parts[0] in ("down", "up", "mid") and len(parts) > 1 else parts[0]
        rows.append({"module": name, "type": type(m).__name__, "block": block, "tensors": k, "bytes": nbytes})
    return pd.DataFrame(rows, columns=["module", "type", "block", "tensors", "bytes"]).sort_values(
        "bytes", ascending=False, ignore_index=True)


# What the saving module's class means for the tensors it saved. A block's "own" tensors come from
# the functional code in its forward (F.silu, the residual add, the attention matmuls and softmax).
KINDS = {
    "Conv2d": "convolution inputs",
    "GroupNorm": "GroupNorm",
    "GroupNorm16": "GroupNorm",
    "LayerNorm": "LayerNorm",
    "BatchNorm2d": "BatchNorm",
    "Dropout": "dropout masks and inputs",
    "Linear": "linear (time embedding)",
    "SiLU": "SiLU (time-embedding MLP)",  # the only nn.SiLU module; the blocks call F.silu (their own ops)
    "ResBlock": "ResBlock's own ops (SiLU, time-embedding add)",
    "AttnBlock": "attention (scores, softmax, weighted sum)",
    "UNet": "UNet's own ops (skip concat, output SiLU)",
}


def group_saved(df: pd.DataFrame, by: str, batch_size: int | None = None) -> pd.DataFrame:
    """``saved_by_module`` summed by ``by`` ("kind", "type" or "block"), with each group's share
    and, given the batch size, the bytes per image."""
    if by == "kind" and "kind" not in df:
        df = df.assign(kind=df["type"].map(lambda t: KINDS.get(t, t)))
    g = df.groupby(by, as_index=False, sort=False)[["tensors", "bytes"]].sum().sort_values("bytes", ascending=False, ignore_index=True)
    g["MiB"] = g["bytes"] / MiB
    g["share"] = g["bytes"] / g["bytes"].sum()
    if batch_size:
        g["KiB_per_image"] = g["bytes"] / batch_size / 1024
    return g


def batch_that_fits(budget_bytes: float, fixed_bytes: float, saved_per_image: float) -> int:
    """The largest batch whose fixed state plus saved activations fit in ``budget_bytes``
    (a first-order estimate: it leaves out the allocator's fragmentation and workspaces)."""
    if saved_per_image <= 0:
        raise ValueError("saved_per_image must be > 0")
    return max(0, int((budget_bytes - fixed_bytes) // saved_per_image))


# ------------------------------------------------------------------------------ GPU only
def cuda_timeline(fn: Callable[..., Any], *args: Any, device: torch.device | str = "cuda", max_entries: int = 200_000,
                  **kwargs: Any) -> pd.DataFrame:
    """The caching allocator's events during one call of ``fn`` on a CUDA device.

    Records the allocator history (``torch.cuda.memory._record_memory_history``), runs ``fn``
    once, takes a snapshot and returns one row per allocation or free on ``device``: ``event``
    (0, 1, ...), ``action``, ``bytes`` (the block), ``allocated`` (bytes allocated after the
    event, starting from what was allocated before the call) and ``time_us`` when the snapshot
    has it. Raises ``RuntimeError`` without a CUDA device.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("cuda_timeline needs a CUDA GPU: the allocator history is a feature of the CUDA caching "
                           "allocator (on a CPU, use saved_by_module)")
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    # context=None: no tracebacks (only the events' sizes and times are read), so the snapshot has no C++ frames to
    # symbolize, which can take minutes for a whole training step
    torch.cuda.memory._record_memory_history(context=None, stacks="python", max_entries=max_entries, device=device)
    try:
        fn(*args, **kwargs)
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    traces = snap.get("device_traces", [])
    events = traces[device.index or 0] if len(traces) > (device.index or 0) else []
    rows, allocated = [], start
    for e in events:
        action = e.get("action")
        if action == "alloc":
            allocated += e["size"]
        elif action == "free_completed":
            allocated -= e["size"]
        else:
            continue
        rows.append({"action": action, "bytes": e["size"], "allocated": allocated, "time_us": e.get("time_us")})
    df = pd.DataFrame(rows, columns=["action", "bytes", "allocated", "time_us"])
    df.insert(0, "event", range(len(df)))
    return df


def h2d_copy(batch: torch.Tensor, device: torch.device | str = "cuda", repeats: int = 20) -> pd.DataFrame:
    """Time copying ``batch`` from host memory to the GPU, from pageable and from pinned memory.

    Returns one row per source: ``bytes``, median ``ms`` (CUDA events) and ``GB_per_s``.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError("h2d_copy measures host-to-GPU copies: it needs a CUDA GPU")
    rows = []
    for name, src in (("pageable", batch.cpu().contiguous()), ("pinned", batch.cpu().contiguous().pin_memory())):
        ms = sorted(_cuda_times(lambda: src.to(device, non_blocking=True), (), {}, repeats, device))[repeats // 2]
        nbytes = src.numel() * src.element_size()
        rows.append({"host memory": name, "bytes": nbytes, "ms": ms, "GB_per_s": nbytes / (ms / 1e3) / 1e9})
    return pd.DataFrame(rows)
