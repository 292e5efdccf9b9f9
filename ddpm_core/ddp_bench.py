"""Throughput of the DDP training step, one process per GPU (or per CPU worker), under torchrun.

    torchrun --nproc_per_node=2 -m ddpm_core.ddp_bench --model tiny --batch-size 8 --out n2.json --trace-dir traces/n2

Every rank times the same number of steps on its own fixed batch; rank 0 writes the global
images/s to ``--out`` (JSON, atomically). With ``--trace-dir`` each rank also writes a profiler
trace of a few steps (``rank<R>.pt.trace.json.gz``) for ``ddpm_core.traces.analyze``. With
``--grid-batch-sizes`` (and ``--grid-precisions``) the same process group also times every batch
size in every precision, for notebook 08's training-time-vs-batch-size figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from .atomic import atomic_write_text
from .env import device_name
from .text import plural
from .train import TrainConfig, _init_distributed, _release_group, build, exit_worker


def launch_device_name(device: torch.device, world_size: int) -> str:
    """What one launch ran on: the GPU's name, or on a CPU what ran there, "CPU (<processor>, 1 thread per process,
    2 processes)": ``device_name`` counts one process's threads, and a launch of N processes uses N times as many."""
    name = device_name(device)
    if device.type != "cpu" or not name.endswith(")"):
        return name
    return name[:-1] + f" per process, {plural(world_size, 'process', 'processes')})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpm_core.ddp_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", required=True, help="JSON file for the result (rank 0)")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--ddp-bucket-cap-mb", type=float, default=None, help="DDP's gradient bucket size (default: DDP's, 25 MiB)")
    p.add_argument("--grid-batch-sizes", type=int, nargs="+", default=None, metavar="B",
                   help="also time every batch size per process in this list ...")
    p.add_argument("--grid-precisions", nargs="+", default=None, metavar="P",
                   help="... in each of these precisions (one trainer per precision); written under 'grid' in --out")
    args = p.parse_args(argv)

    cfg = TrainConfig(model=args.model, batch_size=args.batch_size, precision=args.precision, device=args.device,
                      dataset="synthetic", ddp_bucket_cap_mb=args.ddp_bucket_cap_mb)
    started = _init_distributed(cfg)
    t = gt = None
    try:
        t = build(cfg)
        g = torch.Generator().manual_seed(t.rank)
        x = (torch.rand(args.batch_size, 3, 32, 32, generator=g) * 2 - 1).to(t.device)

        def sync() -> None:
            if t.device.type == "cuda":
                torch.cuda.synchronize(t.device)
            if t.world_size > 1:
                dist.barrier()

        def timed(trainer, batch) -> list[float]:
            """``args.warmup`` untimed steps, then ``args.steps`` steps, each synchronized on every rank (ms)."""
            for _ in range(args.warmup):
                trainer.train_step(batch)
            sync()
            out = []
            for _ in range(args.steps):
                start = time.perf_counter()
                trainer.train_step(batch)
                sync()
                out.append(1e3 * (time.perf_counter() - start))
            return out

        times = timed(t, x)
        median = statistics.median(times)
        if args.trace_dir:
            from .profiling import capture

            capture(t.train_step, x, out_dir=args.trace_dir, wait=1, warmup=1, active=2)
        grid = []
        if args.grid_batch_sizes:
            for precision in args.grid_precisions or [args.precision]:
                gt = t if precision == args.precision else build(
                    TrainConfig(model=args.model, batch_size=max(args.grid_batch_sizes), precision=precision,
                                device=args.device, dataset="synthetic"))
                for b in args.grid_batch_sizes:
                    ts = timed(gt, (torch.rand(b, 3, 32, 32, generator=g) * 2 - 1).to(t.device))
                    med = statistics.median(ts)
                    grid.append({"batch_per_process": b, "precision": precision, "median_ms": med, "times_ms": ts,
                                 "images_per_s": b * t.world_size / (med / 1e3)})
        if t.rank == 0:
            result = {"grid": grid, "world_size": t.world_size, "batch_per_process": args.batch_size,
                      "global_batch": args.batch_size * t.world_size, "median_ms": median,
                      "images_per_s": args.batch_size * t.world_size / (median / 1e3),
                      "backend": dist.get_backend() if t.world_size > 1 else "none",
                      "device_name": launch_device_name(t.device, t.world_size), "torch_version": torch.__version__,
                      "model": args.model, "precision": args.precision, "times_ms": times,
                      "threads_per_process": torch.get_num_threads(),
                      "ddp_bucket_cap_mb": t.net.bucket_bytes_cap / 2**20 if t.world_size > 1 else None}
            atomic_write_text(args.out, json.dumps(result, indent=1))
            # this launch's own timing (a notebook's table pools the steps of several launches), then its grid's rows
            print(f"world {t.world_size}: {median:.1f} ms/step, {result['images_per_s']:.1f} img/s (this launch)", flush=True)
            for r in grid:
                print(f"world {t.world_size}, batch {r['batch_per_process']} per process, {r['precision']}: "
                      f"{r['median_ms']:.1f} ms/step, {r['images_per_s']:.1f} img/s", flush=True)
    finally:
        if started:  # every DDP wrapper dropped first (train._release_group says why)
            _release_group(t, gt)
    return 0


if __name__ == "__main__":
    exit_worker(main())  # no interpreter finalization under torchrun (exit_worker says why)
