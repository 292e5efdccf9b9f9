"""A GPU-shaped profiler trace made from a real CPU trace, for testing HTA's GPU analyses on CPU.

Every compute operator of the CPU trace gets a ``cudaLaunchKernel`` runtime call nested in it and a
kernel on stream 7 of GPU 0, linked by correlation id, with the layout torch.profiler writes on a
GPU (kernel names of real cuDNN/cuBLAS kernels). HTA parses it like a real GPU trace.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

LAUNCHED = ("aten::convolution", "aten::convolution_backward", "aten::addmm", "aten::mm", "aten::bmm",
            "aten::native_group_norm", "aten::silu", "aten::add_", "aten::mul")


def gpu_trace_from_cpu(src: Path, dst: Path, *, kernel_us: float = 40.0, launch_us: float = 6.0,
                       gap_us: float = 2.0, drop_step_markers: bool = False, driver_every: int = 0) -> Path:
    """``driver_every=N``: every Nth launch is a CUDA driver call (``cuLaunchKernel``, category ``cuda_driver``), as
    Triton kernels of a compiled step are launched, instead of a runtime ``cudaLaunchKernel``."""
    with gzip.open(src, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    cpu_pid = next(e["pid"] for e in events if e.get("cat") == "cpu_op")
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e["name"] in LAUNCHED), key=lambda e: e["ts"])
    gpu_free, added = 0.0, []
    for i, op in enumerate(ops):
        corr = 100_000 + i
        launch_ts = op["ts"] + min(1.0, op.get("dur", 2) / 4)
        driver = driver_every and i % driver_every == 0
        added.append({"ph": "X", "cat": "cuda_driver" if driver else "cuda_runtime",
                      "name": "cuLaunchKernel" if driver else "cudaLaunchKernel", "pid": cpu_pid, "tid": op["tid"],
                      "ts": launch_ts, "dur": launch_us,
                      "args": {"correlation": corr, "External id": op["args"]["External id"], "cbid": 211}})
        start = max(launch_ts + launch_us + gap_us, gpu_free + gap_us)
        name = ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc" if "conv" in op["name"] else
                "ampere_sgemm_128x64_nn" if "mm" in op["name"] else
                f"void at::native::vectorized_elementwise_kernel<{op['name']}>")
        added.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": start, "dur": kernel_us,
                      "args": {"device": 0, "stream": 7, "correlation": corr, "External id": op["args"]["External id"],
                               "registers per thread": 32, "shared memory": 0, "blocks per SM": 1.0,
                               "warps per SM": 4.0, "grid": [64, 1, 1], "block": [256, 1, 1],
                               "est. achieved occupancy %": 50}})
        gpu_free = start + kernel_us
    # Kineto mirrors each record_function span that launched GPU work onto the GPU's row (category
    # gpu_user_annotation), ProfilerStep#N included: a second event of that name per step, which a step count must skip
    for step in (e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")):
        inside = [k for k in added if k["cat"] == "kernel" and step["ts"] <= k["ts"] - launch_us - gap_us <= step["ts"] + step["dur"]]
        if inside:
            added.append({"ph": "X", "cat": "gpu_user_annotation", "name": step["name"], "pid": 0, "tid": 7,
                          "ts": inside[0]["ts"], "dur": inside[-1]["ts"] + kernel_us - inside[0]["ts"],
                          "args": {"External id": step.get("args", {}).get("External id", 0)}})
    events += added + [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python"}},
                       {"ph": "M", "name": "process_labels", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}}]
    if drop_step_markers:
        events = [e for e in events if not str(e.get("name", "")).startswith("ProfilerStep")]
    trace["traceEvents"] = events
    trace["deviceProperties"] = [{"id": 0, "name": "synthetic GPU", "totalGlobalMem": 85e9,
                                  "computeMajor": 9, "computeMinor": 0, "numSms": 132}]
    dst.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(dst, "wt") as f:
        json.dump(trace, f)
    return dst
