"""DDP on CPU: two gloo processes must do exactly what one process does on the whole batch."""

import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpm_core.train import build, load_checkpoint_file, list_checkpoints
from helpers import tiny_config

STEPS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch():
    g = torch.Generator().manual_seed(7)
    x = torch.rand(8, 3, 32, 32, generator=g) * 2 - 1
    t = torch.randint(0, 1000, (8,), generator=g)
    noise = torch.randn(8, 3, 32, 32, generator=g)
    return x, t, noise


def _cfg(tmp_path):
    # SGD: DDP is about gradients; Adam would amplify last-bit differences of tiny gradients.
    return tiny_config(tmp_path, dropout=0.0, optimizer="sgd", lr=0.05, ema_decay=None)


def _worker(rank: int, world: int, port: int, tmp_path, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        t = build(_cfg(tmp_path))
        assert t.world_size == world and type(t.net).__name__ == "DistributedDataParallel"
        x, ts, noise = _batch()
        shard = slice(rank * 8 // world, (rank + 1) * 8 // world)
        for _ in range(STEPS):
            t.train_step(x[shard], ts[shard], noise[shard])
        if rank == 0:
            torch.save(t.model.state_dict(), out)
    finally:
        dist.destroy_process_group()


def test_ddp_with_two_gloo_processes_matches_one_process_on_the_concatenated_batch(tmp_path):
    out = str(tmp_path / "ddp.pt")
    mp.spawn(_worker, args=(2, _free_port(), tmp_path, out), nprocs=2, join=True)
    ddp_state = torch.load(out)

    single = build(_cfg(tmp_path))
    initial = {k: v.clone() for k, v in single.model.state_dict().items()}
    x, ts, noise = _batch()
    for _ in range(STEPS):
        single.train_step(x, ts, noise)
    moved = 0
    for name, p in single.model.state_dict().items():
        assert (p - ddp_state[name]).abs().max().item() < 1e-5, name
        moved += not torch.equal(p, initial[name])
    assert moved > 10  # the step really changed the weights


def _torchrun(args, out_dir, steps, env_extra=None, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", *args,
           "-m", "ddpm_core.train", "--model", "tiny", "--device", "cpu", "--dataset", "synthetic",
           "--synthetic-size", "64", "--batch-size", "4", "--steps", str(steps), "--warmup-steps", "0",
           "--checkpoint-every", "2", "--log-every", "1", "--no-progress", "--out-dir", str(out_dir)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _final_weights(out_dir):
    return load_checkpoint_file(list_checkpoints(out_dir)[-1])["model"]


def test_two_torchrun_agents_on_localhost_form_one_two_node_job(tmp_path):
    port = _free_port()
    rdzv = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
            "--rdzv_id=ddpm-test"]
    nodes = [_torchrun(rdzv, tmp_path / "run", 4) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), "\n".join(outs)
    assert sum(o.count("done: step 4") for o in outs) == 1  # one global rank 0 across both nodes
    ckpt = load_checkpoint_file(list_checkpoints(tmp_path / "run")[-1])
    assert ckpt["step"] == 4 and len(ckpt["rng"]) == 2


def test_a_killed_worker_is_restarted_and_training_resumes_without_losing_steps(tmp_path):
    # 3 restarts, as in notebook 08. A finished worker used to abort at interpreter exit now and then ("terminate
    # called without an active exception": the gloo group, still held by DDP, torn down in finalization; see
    # test_train_releases_ddp_before_destroying_the_group), and torchrun counts that as a crash. With restarts to
    # spare, any such failure is restarted too, resumes from the newest checkpoint, and must still end with
    # exactly the weights of the uninterrupted run.
    # The two jobs run at once, each on its own rendezvous port: most of a launch is starting Python and torch.
    # The clean one also checks the plain torchrun entry point: rank 0 alone logs, and every rank's random streams
    # are saved. (A relaunch that resumes is the restart below: new worker processes that find the checkpoint.)
    with socket.socket() as a, socket.socket() as b:  # two distinct free ports, both held until both are known
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        ports = a.getsockname()[1], b.getsockname()[1]

    def args(port):
        return ["--nproc_per_node=2", "--max-restarts=3", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}"]

    faulty = _torchrun(args(ports[0]), tmp_path / "faulty", 8, {"DDPM_KILL_AT": "1:5"})
    clean = _torchrun(args(ports[1]), tmp_path / "clean", 8)
    out, clean_out = faulty.communicate(timeout=300)[0], clean.communicate(timeout=300)[0]
    assert faulty.returncode == 0, out
    assert "rank 1: killed at step 5 on purpose" in out
    assert "resuming from" in out and "step-00000004.pt" in out and "done: step 8" in out
    assert clean.returncode == 0, clean_out
    assert clean_out.count("done: step 8") == 1 and "resuming from" not in clean_out  # rank 0 alone logs
    ckpt = load_checkpoint_file(list_checkpoints(tmp_path / "clean")[-1])
    assert ckpt["step"] == 8 and len(ckpt["rng"]) == 2  # every rank's random streams are saved
    a, b = _final_weights(tmp_path / "faulty"), _final_weights(tmp_path / "clean")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the restarted run ends exactly where an uninterrupted one does


def test_ddp_bench_times_a_grid_of_batch_sizes_and_precisions(tmp_path, capsys):
    import json

    from ddpm_core import ddp_bench, plots

    out = tmp_path / "grid.json"
    assert ddp_bench.main(["--model", "tiny", "--device", "cpu", "--batch-size", "2", "--steps", "2", "--warmup", "1",
                           "--out", str(out), "--grid-batch-sizes", "2", "4", "--grid-precisions", "fp32", "bf16",
                           "--ddp-bucket-cap-mb", "5"]) == 0  # one process: no DDP, so no buckets to report
    grid = json.loads(out.read_text())["grid"]
    assert [(r["batch_per_process"], r["precision"]) for r in grid] == [(2, "fp32"), (4, "fp32"), (2, "bf16"), (4, "bf16")]
    assert all(r["images_per_s"] > 0 and len(r["times_ms"]) == 2 for r in grid)
    assert json.loads(out.read_text())["ddp_bucket_cap_mb"] is None
    # it prints its own timing, marked as this launch's (08's table pools several launches), then the grid's rows, the
    # numbers the notebook's figure shows (08 once printed the warm-up timing in their place)
    printed = capsys.readouterr().out.splitlines()
    assert [l.split(":")[0] for l in printed if l.startswith("world")] == ["world 1"] + [
        f"world 1, batch {r['batch_per_process']} per process, {r['precision']}" for r in grid]
    assert next(l for l in printed if l.startswith("world")).endswith("img/s (this launch)")
    assert f"{grid[0]['median_ms']:.1f} ms/step" in printed[-4]
    import pandas as pd

    fig = plots.epoch_time_vs_batch(pd.DataFrame([{**r, "world_size": 1} for r in grid]), label="test")
    assert len(fig.axes[0].lines) == 2  # one line per (processes, precision)


def test_train_releases_ddp_before_destroying_the_group(tmp_path, monkeypatch):
    """DDP's reducer holds the gloo group: left in the trainer, the group outlives destroy_process_group and is
    torn down at interpreter exit, where it can abort a finished worker (SIGABRT, "terminate called without an
    active exception"), which torchrun reports as a crash. train() drops the wrapper and destroys the group."""
    import weakref

    from ddpm_core import train as train_module

    def one_process_group(cfg):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return True

    monkeypatch.setattr(train_module, "_init_distributed", one_process_group)
    monkeypatch.setattr(train_module, "_dist_info", lambda: (0, 2))  # build() wraps the model in DDP, as for rank 0 of 2
    wrappers = []  # a weak reference to the DDP wrapper that build() made
    real_build = train_module.build

    def build_and_watch(cfg):
        tb = real_build(cfg)
        assert type(tb.net).__name__ == "DistributedDataParallel"
        wrappers.append(weakref.ref(tb.net))
        return tb

    monkeypatch.setattr(train_module, "build", build_and_watch)
    result = train_module.train(tiny_config(tmp_path, steps=2, synthetic_size=32, batch_size=4, ema_decay=None))
    assert not dist.is_initialized()
    assert result.trainer.net is result.trainer.model  # sampling and checkpoints need only the plain model
    assert wrappers and wrappers[0]() is None  # the DDP wrapper is gone, and with it its hold on the group


_EXIT_PROBE = """
import atexit, sys
from ddpm_core.train import exit_worker
atexit.register(lambda: print("finalized", file=sys.stderr))
sys.stdout.write("last line, not yet flushed")
exit_worker(3)
"""


def test_a_torchrun_worker_exits_without_finalization_and_keeps_its_last_output():
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "PYTHONUNBUFFERED")}
    worker = subprocess.run([sys.executable, "-c", _EXIT_PROBE], env={**env, "LOCAL_RANK": "0"},
                            capture_output=True, text=True, timeout=120)
    assert worker.returncode == 3 and worker.stdout == "last line, not yet flushed"
    assert "finalized" not in worker.stderr  # finalization (where the abort happened) is skipped
    plain = subprocess.run([sys.executable, "-c", _EXIT_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 3 and "finalized" in plain.stderr  # outside torchrun: a normal exit


def test_a_cpu_launch_is_labelled_with_its_threads_per_process_and_its_process_count():
    """08 labelled its 2-process row "CPU (AMD EPYC, 1 thread)": one process's threads, while the launch used two cores."""
    from ddpm_core.ddp_bench import launch_device_name
    from ddpm_core.env import device_name

    two = launch_device_name(torch.device("cpu"), 2)
    assert two.startswith(device_name("cpu")[:-1]) and two.endswith(" per process, 2 processes)")
    assert launch_device_name(torch.device("cpu"), 1).endswith(" per process, 1 process)")
