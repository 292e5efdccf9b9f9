"""Time the training step of one ``TrainConfig`` in a process of its own (``bench.compare_in_processes`` runs it).

    python -m ddpm_core.step_bench --config '{"model": "tiny", "cudnn_benchmark": true}' --batch-size 8 --out r.json

For settings whose effect outlives a trainer inside one process: cuDNN keeps the algorithm it chose for a
convolution shape for the life of the process, whether it chose by heuristics or by timing the candidates
(``cudnn.benchmark``), and reuses it for every later trainer with that shape. So ``cudnn.benchmark=True``
measured after a ``False`` run of the same shapes in one process reuses the heuristic choices and measures
nothing; each setting needs a fresh process. Writes the step times and memory as JSON (atomically).
"""

from __future__ import annotations

import argparse
import json

import torch

from . import bench, env
from .atomic import atomic_write_text
from .train import TrainConfig, build


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpm_core.step_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="TrainConfig fields as a JSON object")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--warmup", type=int, default=3, help="calls before the timed ones; the first is timed apart")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (the caller's, so every variant gets the same)")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch of images")
    p.add_argument("--out", required=True, help="JSON file for the result")
    args = p.parse_args(argv)
    try:
        fields = json.loads(args.config)
    except json.JSONDecodeError as e:
        p.error(f"--config is not JSON ({e}): pass TrainConfig fields as an object, e.g. '{{\"model\": \"tiny\"}}'")
    if not isinstance(fields, dict):
        p.error(f"--config must be a JSON object of TrainConfig fields, got {type(fields).__name__}")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(**{"dataset": "synthetic", "progress": False, **fields, "batch_size": args.batch_size})
    t = build(cfg)
    # DDPM_GPU_MEMORY_GB (a smaller card rehearsed on a bigger one) holds in this process too, as env.show applies it
    # in the notebook that started it
    env.apply_memory_cap(t.device)
    g = torch.Generator().manual_seed(args.seed)
    x = (torch.rand(args.batch_size, 3, 32, 32, generator=g) * 2 - 1).to(t.device)
    m = bench.measure(t.train_step, x, batch_size=args.batch_size, warmup=args.warmup, iters=args.iters)
    atomic_write_text(args.out, json.dumps({
        "times_ms": m.times_ms, "first_ms": m.first_ms, "device": str(t.device), "precision": cfg.precision,
        "memory_bytes": m.peak_memory_bytes, "memory_kind": m.memory_kind, "reserved_bytes": m.reserved_bytes,
        "threads": torch.get_num_threads(), "torch_version": torch.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
