"""What we are running on: every figure and table in the series is labeled with it."""

from __future__ import annotations

import logging
import os
import platform
import re

import torch

from .text import plural  # noqa: F401 - the notebooks call env.plural


def device_name(device: torch.device | str | None = None) -> str:
    """"NVIDIA H100 80GB HBM3" for a GPU, "CPU (<processor>, N threads)" for the CPU."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:  # the model name is more telling than "x86_64"
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    n = torch.get_num_threads()
    return f"CPU ({cpu}, {n} thread{'' if n == 1 else 's'})"


_RUN_LABEL: str | None = None  # what env.show() printed: the device this process measures on


def run_label() -> str:
    """The label of this process's measurements: what ``show()`` printed, else ``label()`` for the default device."""
    return _RUN_LABEL or label()


def label(device: torch.device | str | None = None) -> str:
    """One line for figure titles: device and torch version (and CUDA version on a GPU)."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    parts = [device_name(device), f"torch {torch.__version__}"]
    if device.type == "cuda" and torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    return " · ".join(parts)


def onednn_bf16() -> bool:
    """Whether PyTorch sends bf16 convolutions on this CPU to oneDNN (``mkldnn_bf16_device_check``: AVX512 core,
    i.e. avx512bw, vl and dq, with or without bf16 instructions) rather than to the generic ``_slow_conv2d`` kernels."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:  # a build without oneDNN
        return False


def cpu_bf16() -> tuple[bool, str]:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX), and a sentence saying what that
    means for a bf16 training step on it.

    Three cases. With those instructions, oneDNN runs bf16 convolutions natively. Without them but with AVX512
    (``onednn_bf16``: PyTorch's gate is avx512bw/vl/dq), PyTorch still sends bf16 convolutions to oneDNN, which
    converts around fp32 arithmetic: no generic fallback, but no faster arithmetic either. Without AVX512 (an
    AVX2-only CPU, like many laptops and CI machines) bf16 convolutions fall back to generic kernels such as
    ``aten::_slow_conv2d_forward``: a bf16 step was 10x slower than fp32 on such a CPU with torch 2.14.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(p is not None for p in probes):
        has = any(p() for p in probes)
    else:  # older torch: read the flags
        try:
            flags = open("/proc/cpuinfo").read()
        except OSError:
            flags = ""
        has = "avx512_bf16" in flags or "amx_bf16" in flags
    if has:
        # Not a promise of speed: on a 2-core AMD EPYC with AVX512-BF16 (torch 2.14.1) the tiny model's bf16 step ran
        # at 1.19x fp32's throughput on the quiet machine, and at under a third of it with other work beside it, on
        # oneDNN's kernels (aten::mkldnn_convolution) both times.
        return True, (f"This CPU ({capability}) has bf16 instructions (AVX512-BF16 or AMX): bf16 convolutions can run "
                      "on oneDNN's bf16 kernels instead of the generic fallback. Whether that beats fp32 depends on the "
                      "CPU and the layer sizes, so it is measured here, not assumed.")
    if onednn_bf16():
        return False, (f"This CPU ({capability}) has no bf16 instructions (AVX512-BF16 or AMX), but it has AVX512, so "
                       "PyTorch still sends bf16 convolutions to oneDNN (not to the generic fallback), which converts "
                       "bf16 to fp32 around its arithmetic: that arithmetic is no faster than fp32's, so expect little or "
                       "nothing from bf16 here beyond smaller tensors (measured where a notebook runs it, not assumed). "
                       "On a GPU (Ampere or newer) bf16 runs on tensor cores.")
    return False, (f"This CPU ({capability}) has no bf16 instructions (AVX512-BF16 or AMX): bf16 convolutions fall back "
                   "to slow generic kernels (aten::_slow_conv2d_forward), so expect a bf16 step to be much slower "
                   "than fp32 here. On a GPU (Ampere or newer) bf16 runs on tensor cores.")


def check_gpu_build(device: torch.device | str | None = None) -> None:
    """Raise a RuntimeError that names the fix when this PyTorch build has no kernels for the GPU.

    A wheel carries compiled kernels for a list of architectures (``torch.cuda.get_arch_list()``): a kernel built for
    sm_XY runs on a GPU of the same major version and a minor at least Y, PTX (compute_XY) on any GPU of XY or newer.
    CUDA 13 builds (the registry's default, and constraints.txt's) start at sm_75, Turing: on a V100 or a P100 (16 GB
    cards still common on clusters and hosted notebooks) torch only warns, and the first CUDA operation then fails
    with "no kernel image is available for execution on the device".
    """
    if not torch.version.cuda:  # a CPU or ROCm build: nothing to check here
        return
    arch = torch.cuda.get_arch_list()
    if not arch:
        return
    device = torch.device(device) if device is not None else torch.device("cuda")
    major, minor = torch.cuda.get_device_capability(device)
    cc = 10 * major + minor
    built = [(m[1], int(m[2])) for m in (re.match(r"(sm|compute)_(\d+)", a) for a in arch) if m]  # "sm_90a": 90
    if any((kind == "sm" and v // 10 == major and v % 10 <= minor) or (kind == "compute" and v <= cc) for kind, v in built):
        return
    raise RuntimeError(
        f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}, sm_{cc}) cannot run this PyTorch "
        f"build (torch {torch.__version__}, CUDA {torch.version.cuda}): it holds kernels for {' '.join(arch)} only, so "
        "every CUDA operation would fail with 'no kernel image is available'. Fix: install a PyTorch build whose CUDA "
        f"still supports sm_{cc} (CUDA 13 builds start at sm_75; CUDA 12.x builds reach further back): pick one at "
        "https://pytorch.org/get-started/locally/ (e.g. pip install torch torchvision --index-url "
        "https://download.pytorch.org/whl/cu126), or run on the CPU (device='cpu', DDPM_SMOKE=1 for the short runs).")


def _capability_at_least(device: torch.device | str | None, major_needed: int, has: str, lacks: str) -> tuple[bool, str]:
    """Whether the GPU's compute capability is at least ``major_needed``.0, with "<name> (compute capability X.Y)
    <has or lacks>". A ROCm GPU answers yes: PyTorch treats AMD's GPUs as capable of both things asked here."""
    name = torch.cuda.get_device_name(device)
    if torch.version.hip:
        return True, f"{name} (ROCm): yes."
    major, minor = torch.cuda.get_device_capability(device)
    return major >= major_needed, f"{name} (compute capability {major}.{minor}) {has if major >= major_needed else lacks}"


def gpu_compiles(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether ``torch.compile`` can build GPU kernels for this GPU, and a sentence saying why not.

    Inductor writes its GPU kernels in Triton, and Triton needs compute capability 7.0 (Volta) or newer: on a P100
    (6.0, a free tier of hosted notebooks under a CUDA 12 build of PyTorch) the first compiled call fails.
    """
    return _capability_at_least(
        device, 7, "Inductor's Triton kernels run on it",
        "cannot run torch.compile's GPU kernels: Inductor writes them in Triton, which needs compute capability 7.0 or "
        "newer. Fix: compile=None on this GPU (eager), or compile on the CPU (device='cpu'), or use a newer GPU.")


NO_BF16_ENV = "DDPM_GPU_NO_BF16"


def gpu_bf16(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether this GPU has bf16 hardware, and a sentence saying what that means for a bf16 step on it.

    ``torch.cuda.is_bf16_supported()`` answers True on older NVIDIA GPUs too (a T4, the free tier of hosted
    notebooks; a V100): its default ``including_emulation=True`` only checks that a bf16 tensor can be made. Before
    Ampere (compute capability 8.0) no tensor core runs bf16 and cuDNN has no bf16 convolutions, so PyTorch sends
    them to slow fallback kernels. Their tensor cores run fp16: fp16 autocast with the GradScaler is their mixed
    precision (``mixed_precision``). ROCm GPUs answer for themselves (PyTorch treats them all as bf16-capable).
    ``DDPM_GPU_NO_BF16=1`` answers no on any GPU: with ``DDPM_GPU_MEMORY_GB=16`` it rehearses a T4 on a bigger card.
    """
    device = torch.device(device) if device is not None else torch.device("cuda")  # "cuda": the current GPU
    name = torch.cuda.get_device_name(device)
    if os.environ.get(NO_BF16_ENV) == "1":
        return False, (f"{name}: bf16 is switched off by {NO_BF16_ENV}=1 (rehearsing a GPU without bf16 hardware, such "
                       "as a T4). Use precision='fp16' (autocast with the GradScaler), or 'fp32'; unset it for bf16.")
    return _capability_at_least(
        device, 8, "has bf16 tensor cores",
        "has no bf16 hardware: bf16 came with Ampere (8.0). PyTorch would emulate it, with the convolutions on slow "
        "fallback kernels and no tensor cores. Its tensor cores run fp16: use precision='fp16' (autocast with the "
        "GradScaler), or 'fp32'.")


def mixed_precision(device: torch.device | str) -> str:
    """The 16-bit autocast precision the series uses on ``device``: ``"bf16"`` on a CPU (whether it is fast there
    is the CPU's question: ``cpu_bf16``) and on a GPU with bf16 hardware; ``"fp16"`` (autocast with the GradScaler)
    on an older GPU, whose tensor cores run fp16 only (``gpu_bf16``)."""
    device = torch.device(device)
    if device.type != "cuda" or gpu_bf16(device)[0]:
        return "bf16"
    return "fp16"


MEMORY_CAP_ENV = "DDPM_GPU_MEMORY_GB"


def memory_cap_gib() -> float | None:
    """The GPU memory cap set with ``DDPM_GPU_MEMORY_GB`` (in GiB), or None.

    It rehearses a smaller card on a bigger one: ``DDPM_GPU_MEMORY_GB=16`` makes an 80 GB GPU
    behave like a 16 GB one (a T4, the free tier of hosted notebooks) for every notebook: the
    allocator refuses more (``torch.cuda.set_per_process_memory_fraction``, applied by ``show``),
    and everything that sizes a batch from the GPU's memory reads ``gpu_memory_gib``.
    """
    raw = os.environ.get(MEMORY_CAP_ENV, "").strip()
    if not raw:
        return None
    try:
        cap = float(raw)
    except ValueError:
        cap = float("nan")
    if not cap > 0 or cap == float("inf"):
        raise ValueError(f"{MEMORY_CAP_ENV}={raw!r} is not a memory size: set it to the GiB to allow, e.g. "
                         f"{MEMORY_CAP_ENV}=16, or unset it to use the whole GPU.")
    return cap


# Less than this missing from the card, beyond this process's allocator, is taken for this process's own footprint
# outside the allocator: the CUDA context (0.3-0.6 GiB) and the library modules it loads lazily as cuDNN, cuBLAS and
# Triton kernels first run (without NVML, which the series does not install, a process cannot read its own total).
OTHERS_MIN_GIB = 2.0


def gpu_memory_gib(device: torch.device | str | None = None) -> float:
    """The GPU memory this run may use, in GiB: the card's; less where other processes hold some of it (a second
    kernel on a shared hosted GPU, another job: ``OTHERS_MIN_GIB`` or more not free, beyond what this process's
    allocator holds); and less again where ``DDPM_GPU_MEMORY_GB`` caps it."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    free, _ = torch.cuda.mem_get_info(device)
    available = (free + torch.cuda.memory_reserved(device)) / 2**30  # what this process's allocator holds is ours
    usable = total if total - available < OTHERS_MIN_GIB else available
    cap = memory_cap_gib()
    return usable if cap is None else min(usable, cap)


def apply_memory_cap(device: torch.device | str) -> float | None:
    """On a GPU, make the allocator refuse more than ``DDPM_GPU_MEMORY_GB``; returns the cap (GiB) or None."""
    device = torch.device(device)
    if memory_cap_gib() is None or device.type != "cuda":
        return None
    if device.index is None:  # set_per_process_memory_fraction wants an index: plain "cuda" is the current GPU
        device = torch.device("cuda", torch.cuda.current_device())
    usable = gpu_memory_gib(device)
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    torch.cuda.set_per_process_memory_fraction(usable / total, device)
    return usable


def describe(device: torch.device | str | None = None) -> dict[str, str]:
    """Versions and device as a dict (printed by every notebook's environment cell)."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda (build)": str(torch.version.cuda),
        "device": str(device),
        "device name": device_name(device),
        "gpus visible": str(torch.cuda.device_count()),
        "cpu cores": str(os.cpu_count()),
        "smoke mode": str(os.environ.get("DDPM_SMOKE") == "1"),
    }
    if device.type == "cpu":
        info["cpu vector unit"] = torch.backends.cpu.get_cpu_capability()
        info["cpu bf16 instructions"] = ("yes" if cpu_bf16()[0] else
                                         "no (AVX512: oneDNN converts bf16 to fp32)" if onednn_bf16() else
                                         "no (bf16 falls back to slow kernels here)")
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except Exception as e:  # noqa: BLE001 - report, do not fail the environment cell
        info["torchvision"] = f"import failed: {e}"
    if device.type == "cuda":
        info["cudnn"] = str(torch.backends.cudnn.version())
        info["compute capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        info["bf16 hardware"] = "yes" if gpu_bf16(device)[0] else "no (its mixed precision is fp16 + GradScaler)"
        total, usable, cap = (torch.cuda.get_device_properties(device).total_memory / 2**30, gpu_memory_gib(device),
                              memory_cap_gib())
        info["gpu memory"] = (f"{total:.1f} GiB" if usable >= total else
                              f"{usable:g} GiB of {total:.1f} GiB (capped by {MEMORY_CAP_ENV})" if usable == cap else
                              f"{usable:.1f} GiB of {total:.1f} GiB (other processes hold the rest; close them, or "
                              "expect the batch sizes chosen from memory to be smaller)")
    return info


def show(device: torch.device | str | None = None) -> tuple[torch.device, str]:
    """The environment cell of every notebook: print the label every figure and table is titled
    with, display the versions and the device as a table, and return ``(device, label)``.
    ``device`` None: the GPU if there is one, else the CPU."""
    import pandas as pd
    from IPython.display import display

    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        check_gpu_build(device)  # a GPU this torch has no kernels for (a V100 under a CUDA 13 build): the fix, before any work
    apply_memory_cap(device)  # a bad DDPM_GPU_MEMORY_GB is an error here, before any work
    if not torch.cuda.is_available():
        # A CUDA build of torch on a machine with a CUDA toolkit but no GPU warns "No CUDA runtime is found, using
        # CUDA_HOME=..." the first time torch.compile builds C++ for the CPU: true, harmless, and a red box in JupyterLab.
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # Tables show their sentences whole (a verdict, a source, a break reason): pandas cuts a cell at 50 characters
    # with "...", and JupyterLab wraps a long cell within the output area instead.
    pd.set_option("display.max_colwidth", 300)
    global _RUN_LABEL
    text = _RUN_LABEL = label(device)
    print(text)
    display(pd.Series(describe(device), name="value").to_frame())
    return device, text


def measured_on(label: str, what: str = "Measured") -> "object":
    """The caption a table of measurements is shown under, naming the device and torch version:
    ``display(env.measured_on(LABEL))``. A Markdown object (plain text where IPython is absent)."""
    text = f"*{what} on {label}:*"
    try:
        from IPython.display import Markdown
    except ImportError:  # pragma: no cover - IPython comes with the notebooks' dependencies
        return text
    return Markdown(text)
