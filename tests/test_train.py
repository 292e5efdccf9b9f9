import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ddpm_core.train import TrainConfig, build, list_checkpoints, load_checkpoint_file, main, train
from helpers import tiny_config


# ------------------------------------------------------------------------------ config checks
def test_unknown_precision_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown precision 'fp8'; valid values: 'fp32', 'tf32', 'bf16', 'fp16'"):
        TrainConfig(precision="fp8")


def test_fp16_on_cpu_explains_and_suggests_bf16():
    with pytest.raises(ValueError, match=r"fp16.*GradScaler.*CUDA.*precision='bf16'"):
        build(TrainConfig(model="tiny", device="cpu", precision="fp16"))


@pytest.mark.parametrize("kw, match", [
    (dict(compile="fast"), r"unknown compile 'fast'; valid values: None, 'default', 'reduce-overhead', 'max-autotune'"),
    (dict(attention="flash"), r"unknown attention 'flash'"),
    (dict(device="tpu"), r"unknown device 'tpu'"),
    (dict(batch_size=0), r"batch_size must be >= 1"),
    (dict(optimizer="adadelta", fused_optimizer=True), r"fused_optimizer is available for"),
    (dict(dataset="folder"), r"image_folder="),
    (dict(model="big"), r"unknown model 'big'"),
    (dict(max_seconds=0), r"max_seconds must be > 0 or None"),
])
def test_invalid_config_values_get_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_requested_without_a_gpu_says_so():
    with pytest.raises(ValueError, match=r"no CUDA GPU.*device='cpu'"):
        build(TrainConfig(model="tiny", device="cuda"))


# ------------------------------------------------------------------------------ the step
def _fixed_eval_loss(t, x, seed=123):
    g = torch.Generator().manual_seed(seed)
    ts = torch.randint(0, 1000, (x.shape[0] * 4,), generator=g)
    noise = torch.randn((x.shape[0] * 4, *x.shape[1:]), generator=g)
    t.model.eval()
    with torch.no_grad():
        return t.diffusion.loss(t.model, x.repeat(4, 1, 1, 1), ts, noise).item()


def test_sixty_steps_on_a_fixed_batch_lower_the_loss_by_at_least_60_percent(tmp_path, synthetic_batch):
    x = synthetic_batch[:8]  # one batch of tiny_config's size: 60 steps on it take about 14 s on 2 cores (16 images: 31 s)
    t = build(tiny_config(tmp_path, lr=2e-3))
    before = _fixed_eval_loss(t, x)
    losses = [float(t.train_step(x)) for _ in range(60)]
    after = _fixed_eval_loss(t, x)
    assert before == pytest.approx(1.0, abs=0.1)  # zero-init output: loss = E[eps^2]
    assert after < 0.4 * before, (before, after)
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    assert t.step == 60


def test_train_step_moves_cpu_batches_and_returns_a_detached_scalar(tmp_path, synthetic_batch):
    t = build(tiny_config(tmp_path))
    loss = t.train_step(synthetic_batch[:4].double().float())
    assert loss.ndim == 0 and not loss.requires_grad and torch.isfinite(loss)
    assert t.model is not None and t.diffusion.timesteps == 1000 and isinstance(t.optimizer, torch.optim.Adam)


def test_bf16_path_runs_on_cpu_under_autocast(tmp_path, synthetic_batch):
    t = build(tiny_config(tmp_path, precision="bf16"))
    seen = []
    hook = t.model.conv_in.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    before = [p.detach().clone() for p in t.model.parameters()]
    # two images: bf16 convolutions on a CPU without bf16 instructions take a slow fallback (16 images: 18-25 s)
    losses = [float(t.train_step(synthetic_batch[:2])) for _ in range(3)]
    hook.remove()
    assert seen == [torch.bfloat16] * 3  # convolutions really ran in bf16
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(p.dtype == torch.float32 for p in t.model.parameters())  # master weights stay fp32
    assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters()))


@pytest.mark.slow
def test_compile_path_runs_on_cpu_and_matches_eager(tmp_path, synthetic_batch, monkeypatch):
    # Dynamo's capture and AOTAutograd's forward/backward split run for real; Inductor's code generation is swapped
    # for the aot_eager backend, which skips the C++ compiler (a cold Inductor compile of this step takes 65-110 s on
    # 2 cores). Inductor itself compiles this step cold, on CPU, in notebook 04 of the smoke run (smoke_reference).
    asked = []
    real_compile = torch.compile

    def aot_eager(fn, mode=None, **kw):
        asked.append(mode)
        return real_compile(fn, backend="aot_eager", **kw)

    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", aot_eager)
    torch._dynamo.reset()
    counters.clear()
    x = synthetic_batch[:4]
    ts, noise = torch.tensor([3, 300, 600, 900]), torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    eager = build(tiny_config(tmp_path, dropout=0.0))
    compiled = build(tiny_config(tmp_path, dropout=0.0, compile="default"))
    assert asked == ["default"]
    for _ in range(2):
        a, b = eager.train_step(x, ts, noise), compiled.train_step(x, ts, noise)
        assert float(b) == pytest.approx(float(a), rel=1e-3, abs=1e-5)
    assert compiled.loss_fn is not compiled.loss_eager
    assert counters["stats"]["unique_graphs"] >= 1  # Dynamo really captured the step


@pytest.mark.parametrize("optimizer, lr, kw", [
    ("sgd", 0.05, dict(channels_last=True)),
    ("sgd", 0.05, dict(attention="sdpa")),
    ("adam", 1e-4, dict(fused_optimizer=True)),
])
def test_speed_switches_do_not_change_the_math(tmp_path, synthetic_batch, optimizer, lr, kw):
    # SGD for the model-side switches, and a small lr for Adam: Adam divides by sqrt(v), which
    # turns last-bit differences of near-zero gradients into differences of up to lr per step.
    x = synthetic_batch[:4]
    ts, noise = torch.tensor([3, 300, 600, 900]), torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    ref = build(tiny_config(tmp_path, dropout=0.0, optimizer=optimizer, lr=lr))
    alt = build(tiny_config(tmp_path, dropout=0.0, optimizer=optimizer, lr=lr, **kw))
    for _ in range(3):
        assert float(alt.train_step(x, ts, noise)) == pytest.approx(float(ref.train_step(x, ts, noise)), rel=1e-4, abs=1e-6)
    for (name, p), q in zip(ref.model.named_parameters(), alt.model.parameters()):
        assert (p - q).abs().max().item() < 1e-4, name


def test_ema_follows_the_weights(tmp_path, synthetic_batch):
    t = build(tiny_config(tmp_path, ema_decay=0.5))
    t.train_step(synthetic_batch)
    # after one step the weights have moved and the EMA (decay 0.5) lags halfway behind them
    w, e = t.model.conv_out.weight, t.ema.model.conv_out.weight
    assert not torch.equal(w, e) and not e.requires_grad
    assert torch.isfinite(t.sample(2, steps=3, progress=False)).all()


# ------------------------------------------------------------------------------ loop, checkpoints
def test_resumed_run_continues_exactly_like_an_uninterrupted_one(tmp_path):
    full = train(tiny_config(tmp_path / "full", steps=10, checkpoint_every=5))
    first = train(tiny_config(tmp_path / "split", steps=5, checkpoint_every=5))
    second = train(tiny_config(tmp_path / "split", steps=10, checkpoint_every=5))
    assert second.resumed_from is not None and second.resumed_from.name == "step-00000005.pt"
    assert [s for s, _ in second.losses] == list(range(6, 11))
    assert [v for _, v in first.losses + second.losses] == [v for _, v in full.losses]
    for p, q in zip(full.trainer.model.parameters(), second.trainer.model.parameters()):
        assert torch.equal(p, q)


def test_max_seconds_ends_the_run_after_the_step_that_reaches_it_and_checkpoints_there(tmp_path):
    result = train(tiny_config(tmp_path, steps=100_000, max_seconds=1.0, checkpoint_every=100_000, log_every=100_000))
    steps = result.trainer.step
    assert result.stopped_by_time and 1 <= steps < 100_000 and result.seconds >= 1.0
    assert [s for s, _ in result.losses] == list(range(1, steps + 1))
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == [f"step-{steps:08d}.pt"]
    assert result.dataset == "256 generated synthetic images"
    assert not train(tiny_config(tmp_path / "short", steps=3, max_seconds=600)).stopped_by_time


def test_a_time_budget_shows_a_bar_of_seconds_not_of_a_far_step_bound(tmp_path, capsys):
    train(tiny_config(tmp_path, steps=100_000, max_seconds=1.0, checkpoint_every=100_000, log_every=5, progress=True))
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "training (1 s budget): 100%" in bar and "/1 s [" in bar and "step=" in bar, bar
    assert "100000" not in bar and "100,000" not in bar


def test_resume_across_an_epoch_boundary_with_workers(tmp_path):
    # 40 images / batch 8 = 5 steps per epoch: stop in epoch 0, resume into epoch 1
    kw = dict(num_workers=2, checkpoint_every=4, log_every=1, synthetic_size=40)
    full = train(tiny_config(tmp_path / "full", steps=7, **kw))
    train(tiny_config(tmp_path / "split", steps=4, **kw))
    second = train(tiny_config(tmp_path / "split", steps=7, **kw))
    assert len(second.losses) == 3  # steps 5, 6 and 7: the last of epoch 0 and the first two of epoch 1
    assert [v for _, v in second.losses] == [v for _, v in full.losses[4:]]


def test_checkpoints_are_pruned_and_a_mismatched_run_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, steps=6, checkpoint_every=2, keep_checkpoints=2)
    train(cfg)
    assert [p.name for p in list_checkpoints(cfg.out_dir)] == ["step-00000004.pt", "step-00000006.pt"]
    ckpt = load_checkpoint_file(list_checkpoints(cfg.out_dir)[-1])
    assert ckpt["step"] == 6 and ckpt["config"]["model"] == "tiny"
    with pytest.raises(ValueError, match=r"different run \(batch_size: checkpoint 8 vs config 4\).*another out_dir"):
        train(tiny_config(tmp_path, steps=8, batch_size=4))
    with pytest.raises(ValueError, match=r"holds checkpoints of an earlier run.*resume=True"):
        train(tiny_config(tmp_path, steps=8, resume=False))
    assert len(list_checkpoints(cfg.out_dir)) == 2  # nothing was deleted
    with pytest.raises(ValueError, match=r"different run \(norm: checkpoint 'group' vs config 'none'\)"):
        train(tiny_config(tmp_path, steps=8, norm="none"))  # other weights
    r = train(tiny_config(tmp_path, steps=8, norm="group16"))  # GroupNorm's weights, run in 16 bits
    assert r.resumed_from is not None and r.trainer.step == 8


_SLOW_WRITER = textwrap.dedent("""
    import contextlib, sys, time, torch
    from pathlib import Path
    import ddpm_core.train as T
    sys.path.insert(0, sys.argv[2])
    from helpers import tiny_config

    class Stalling:  # a file that stops for good after 1 MB has reached the disk
        def __init__(self, f):
            self.f, self.n = f, 0
        def write(self, b):
            self.f.write(b)
            self.n += len(b)
            if self.n > 1_000_000:
                self.f.flush()
                print("writing", flush=True)
                time.sleep(600)
            return len(b)
        def flush(self):
            self.f.flush()

    t = T.build(tiny_config(Path(sys.argv[1])))
    t.train_step(torch.zeros(2, 3, 32, 32))
    t.save_checkpoint(sys.argv[1])
    print("first saved", flush=True)
    t.train_step(torch.zeros(2, 3, 32, 32))
    real_open = T.atomic_open

    @contextlib.contextmanager
    def stalling_open(path, mode="wb"):
        with real_open(path, mode) as f:
            yield Stalling(f)

    T.atomic_open = stalling_open
    t.save_checkpoint(sys.argv[1])
""")


def test_a_run_killed_while_writing_a_checkpoint_leaves_the_previous_one_loadable(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(_SLOW_WRITER)
    tests_dir = os.path.dirname(__file__)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), tests_dir],
                            stdout=subprocess.PIPE, text=True)
    lines = []
    deadline = time.time() + 120
    while "writing" not in lines and time.time() < deadline:
        lines.append(proc.stdout.readline().strip())
    assert "first saved" in lines and "writing" in lines, lines
    partial = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.endswith(".partial")]
    assert partial and partial[0].stat().st_size > 0  # it was mid-write
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001.pt"]
    t = build(tiny_config(tmp_path))
    assert t.resume_latest(tmp_path).name == "step-00000001.pt" and t.step == 1


def test_command_line_trains_and_writes_a_sample_grid(tmp_path, capsys):
    grid = tmp_path / "grid.png"
    rc = main(["--model", "tiny", "--device", "cpu", "--dataset", "synthetic", "--synthetic-size", "64",
               "--batch-size", "8", "--steps", "3", "--warmup-steps", "0", "--ema-decay", "none",
               "--out-dir", str(tmp_path / "run"), "--no-progress", "--loader", "uint8",
               "--sample-grid", str(grid), "--samples", "4", "--sample-steps", "2"])
    assert rc == 0 and grid.stat().st_size > 1000
    assert "done: step 3" in capsys.readouterr().out
    assert main(["--precision", "fp8"]) == 2
    assert "valid values" in capsys.readouterr().err


# ------------------------------------------------------------------------------ GPU-path defects, caught on CPU
def test_the_returned_loss_is_a_copy_and_cudagraph_steps_are_marked(tmp_path, monkeypatch):
    """Under CUDA graphs the loss tensor is the graph's output buffer, overwritten by the next replay:
    train() keeps losses across steps, so train_step must return a copy and mark each new step."""
    t = build(tiny_config(tmp_path))
    produced = []
    eager = t.loss_fn

    def spy(*a):
        out = eager(*a)
        produced.append(out)
        return out

    t.loss_fn = spy
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    x = torch.rand(8, 3, 32, 32) * 2 - 1
    loss = t.train_step(x)
    assert loss.untyped_storage().data_ptr() != produced[0].untyped_storage().data_ptr()
    assert torch.equal(loss, produced[0].detach())
    assert marks == []  # eager: nothing to mark
    t.cfg.compile = "reduce-overhead"  # the mark is decided per step from the config
    t.train_step(x)
    t.cfg.compile = "max-autotune"
    t.train_step(x)
    assert marks == [1, 1]


@pytest.mark.parametrize("precision, tf32", [("fp32", False), ("bf16", True)])
@pytest.mark.parametrize("bench_flag", [False, True])
def test_tf32_and_cudnn_benchmark_hold_during_the_step_and_are_restored_after(tmp_path, precision, tf32, bench_flag):
    """TF32 used to be set for good (and only on CUDA): a bf16 trainer left it on for the next fp32 one."""
    t = build(tiny_config(tmp_path, precision=precision, cudnn_benchmark=bench_flag))
    seen = {}
    eager = t.loss_fn

    def spy(*a):
        seen.update(mm=torch.backends.cuda.matmul.allow_tf32, conv=torch.backends.cudnn.allow_tf32,
                    bench=torch.backends.cudnn.benchmark)
        return eager(*a)

    t.loss_fn = spy
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = not tf32  # the opposite of what the step wants
    torch.backends.cudnn.allow_tf32 = not tf32
    try:
        t.train_step(torch.rand(8, 3, 32, 32) * 2 - 1)
        assert seen == {"mm": tf32, "conv": tf32, "bench": bench_flag}
        assert torch.backends.cuda.matmul.allow_tf32 is (not tf32) and torch.backends.cudnn.allow_tf32 is (not tf32)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = before


def test_tf32_flags_stay_readable_through_the_legacy_api_after_a_step(tmp_path):
    """Inductor's max-autotune reads torch.backends.cuda.matmul.allow_tf32; torch >= 2.9 raises on that
    read once the new fp32_precision API was used, which the old _set_tf32 did on every GPU step."""
    t = build(tiny_config(tmp_path, precision="bf16"))
    # Someone (a user, a library) used the new API first: torch now refuses the legacy getters.
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # both the opposite of torch's defaults
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    try:
        t.train_step(torch.rand(8, 3, 32, 32) * 2 - 1)
        assert torch.backends.cuda.matmul.allow_tf32 is True  # must not raise, and the state is restored
        assert torch.backends.cudnn.allow_tf32 is False
        torch.get_float32_matmul_precision()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True  # torch's defaults


def test_resume_loads_the_checkpoint_on_the_cpu_so_adam_step_counters_stay_there(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, steps=2, checkpoint_every=2)
    train(cfg)
    locations = []
    real_load = torch.load

    def spy(*a, **kw):
        locations.append(str(kw.get("map_location")))
        return real_load(*a, **kw)

    monkeypatch.setattr(torch, "load", spy)
    t = build(cfg)
    t.device = torch.device("cuda:0")  # as on a GPU: loading must not send the counters there
    assert t.resume_latest(cfg.out_dir) is not None
    t.device = torch.device("cpu")
    assert locations and set(locations) == {"cpu"}  # was the trainer's device (the readability check maps too)
    steps = [s["step"] for s in t.optimizer.state.values()]
    assert steps and all(s.device.type == "cpu" for s in steps) and all(float(s) == 2 for s in steps)
    assert all(p.device == t.device for p in t.model.parameters())
    saved = load_checkpoint_file(list_checkpoints(cfg.out_dir)[-1])
    assert all(torch.equal(v, saved["ema"][k]) for k, v in t.ema.state_dict().items())  # EMA restored too
    assert torch.equal(t.generator.get_state(), saved["rng"][0]["generator"])  # and the step's random stream


def test_more_processes_than_gpus_get_a_clear_error_before_any_work(monkeypatch):
    from ddpm_core import train as train_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match=r"LOCAL_RANK 1 but only 1 GPU.*--nproc_per_node=1.*--device cpu"):
        train_mod.resolve_device("auto")
    with pytest.raises(ValueError, match=r"cuda:3.*only 1 GPU"):
        train_mod.resolve_device("cuda:3")
    # Under torchrun the check runs when joining the group, before torch.cuda.set_device and NCCL.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) before the check"))
    with pytest.raises(ValueError, match=r"LOCAL_RANK 1 but only 1 GPU"):
        train_mod._init_distributed(TrainConfig(model="tiny", device="auto"))


# ------------------------------------------------------------------------------ the fast configuration
PAPER_SEMANTICS = ("model", "norm", "dropout", "optimizer", "lr", "warmup_steps", "grad_clip", "ema_decay", "timesteps")


def test_the_fast_configuration_changes_how_the_step_runs_not_what_it_trains():
    base, fast = TrainConfig(), TrainConfig.fast()
    for name in PAPER_SEMANTICS:
        assert getattr(fast, name) == getattr(base, name), name
    assert fast.attention == "sdpa" and fast.channels_last and fast.fused_optimizer and fast.loader == "device"
    assert fast.cudnn_benchmark
    assert TrainConfig.fast(batch_size=8, compile=None).batch_size == 8  # overrides win


def test_fast_changes_lists_the_fields_fast_sets_and_the_semantics_it_keeps():
    """09b's and 09c's first table and sentence: every field that differs, nothing else, at the settings given."""
    import dataclasses

    from ddpm_core import train as train_mod

    assert set(train_mod.TRAINING_SEMANTICS) <= set(PAPER_SEMANTICS)
    shared = dict(model="tiny", batch_size=8, lr=1e-3, warmup_steps=3, ema_decay=0.9)
    changed, said = TrainConfig.fast_changes(**shared)
    base, fast = TrainConfig(**shared), TrainConfig.fast(**shared)
    assert list(changed["field"]) == [f.name for f in dataclasses.fields(TrainConfig)
                                      if getattr(base, f.name) != getattr(fast, f.name)]
    assert {"attention", "channels_last", "fused_optimizer", "loader"} <= set(changed["field"])
    assert said.startswith("It keeps `optimizer='adam'`, `lr=0.001`, `warmup_steps=3`") and "changes" not in said
    assert "`dropout=None` (None: the model preset's own)" in said


def test_the_fast_step_trains_the_same_function_as_the_baseline(tmp_path):
    """Same weights, batch, t and noise: the fast configuration (in fp32 here, so that the numbers can
    be compared) gives the baseline's loss, and after one step with clipping and EMA, its weights."""
    import dataclasses

    kw = {k: v for k, v in dataclasses.asdict(tiny_config(tmp_path, dropout=0.0, grad_clip=0.5)).items()
          if k not in ("attention", "channels_last", "fused_optimizer", "cudnn_benchmark", "loader", "precision", "compile")}
    base = build(TrainConfig(**kw))
    fast = build(TrainConfig.fast(**kw, precision="fp32", compile=None))
    g = torch.Generator().manual_seed(0)
    x = torch.rand(8, 3, 32, 32, generator=g) * 2 - 1
    t = torch.randint(0, 1000, (8,), generator=g)
    noise = torch.randn(8, 3, 32, 32, generator=g)
    lb, lf = float(base.train_step(x, t, noise)), float(fast.train_step(x, t, noise))
    assert lf == pytest.approx(lb, rel=1e-4)
    for (name, pb), pf in zip(base.model.named_parameters(), fast.model.parameters()):
        torch.testing.assert_close(pf, pb, atol=1e-5, rtol=1e-4, msg=name)
    for pb, pf in zip(base.ema.model.parameters(), fast.ema.model.parameters()):
        torch.testing.assert_close(pf, pb, atol=1e-5, rtol=1e-4)


def test_the_command_line_preset_fast_is_trainconfig_fast_with_given_options_winning(monkeypatch, tmp_path):
    from ddpm_core import train as T

    seen = []

    def fake_train(cfg):
        seen.append(cfg)
        raise ValueError("stop here")

    monkeypatch.setattr(T, "train", fake_train)
    common = ["--model", "tiny", "--device", "cpu", "--out-dir", str(tmp_path / "run")]
    assert T.main(["--preset", "fast", *common, "--precision", "fp32", "--no-channels-last"]) == 2
    fast, expected = seen[-1], TrainConfig.fast(model="tiny", device="cpu", out_dir=str(tmp_path / "run"),
                                                precision="fp32", channels_last=False)
    assert fast == expected  # fp32 given explicitly wins, though it is the field's default
    assert fast.attention == "sdpa" and fast.fused_optimizer and fast.loader == "device"
    assert T.main(common) == 2 and seen[-1] == TrainConfig(model="tiny", device="cpu", out_dir=str(tmp_path / "run"))


def test_exercise_switches_reach_the_step(tmp_path, monkeypatch):
    """The fields the exercises use instead of edits to the package: drop_last, grad_scaler, ddp_bucket_cap_mb."""
    import torch.distributed as dist

    from ddpm_core import train as T

    cfg = tiny_config(tmp_path, drop_last=False, synthetic_size=20, batch_size=8, steps=3, checkpoint_every=100)
    assert len(train(cfg).losses) == 3  # epochs of 3 batches (8, 8, 4): the short one is trained on
    assert build(tiny_config(tmp_path, grad_scaler=False)).scaler.is_enabled() is False
    with pytest.raises(ValueError, match="ddp_bucket_cap_mb must be > 0"):
        tiny_config(tmp_path, ddp_bucket_cap_mb=0)
    with pytest.raises(TypeError, match="grad_scaler"):
        tiny_config(tmp_path, grad_scaler="no")
    # DDP receives the bucket size: a one-process group, wrapped as a launch of several processes is (ddp=True, 08's
    # Exercise 2), or with the trainer told it is one of two (what ddp=None decides from).
    with pytest.raises(ValueError, match="needs a process group"):
        build(tiny_config(tmp_path), ddp=True)  # before any work: no group yet
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert type(build(tiny_config(tmp_path)).net).__name__ == "UNet"  # one process: no DDP unless asked
        t = build(tiny_config(tmp_path, ddp_bucket_cap_mb=5.0), ddp=True)
        assert type(t.net).__name__ == "DistributedDataParallel" and t.net.bucket_bytes_cap == 5 * 1024 * 1024
        monkeypatch.setattr(T, "_dist_info", lambda: (0, 2))
        assert type(build(tiny_config(tmp_path)).net).__name__ == "DistributedDataParallel"
        assert type(build(tiny_config(tmp_path), ddp=False).net).__name__ == "UNet"
    finally:
        dist.destroy_process_group()


def test_a_deleted_trainer_gives_its_memory_back_without_the_garbage_collector(tmp_path):
    """`del trainer` frees its weights, gradients and optimizer state at once: no reference cycle holds them until
    the garbage collector runs (the trainer once stored its own bound loss_eager; 03b on the H200 then found 4.2 GiB
    allocated beyond the trainers it kept). Swapping loss_fn and swapping it back keeps that true."""
    import gc
    import weakref

    build(tiny_config(tmp_path))  # the process's first optimizer imports Dynamo, whose import frames hold it once
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    gc.collect()
    gc.disable()
    try:
        for kw in ({}, {"precision": "bf16", "channels_last": True}, {"activation_checkpointing": True, "ema_decay": None}):
            t = build(tiny_config(tmp_path, batch_size=2, **kw))
            t.train_step(x)
            t.loss_fn = lambda *a: t.loss_eager(*a)  # 04 swaps in another callable...
            t.loss_fn = t.loss_eager  # ...and back: the default is not stored
            assert t._loss_fn is None and t.loss_fn == t.loss_eager
            held = [weakref.ref(o) for o in (t, t.model, t.optimizer)]
            del t
            assert [r() is None for r in held] == [True] * 3, kw
    finally:
        gc.enable()


@pytest.mark.slow
def test_compile_optimizer_matches_the_eager_update_through_the_warm_up(tmp_path, synthetic_batch, monkeypatch):
    # Clipping, Adam and the EMA compiled in one function (Dynamo for real, aot_eager instead of Inductor's C++, as
    # above), the lr a tensor the warm-up changes at every step: the same weights and EMA as the eager update, and no
    # recompilation as the lr moves (a float lr would be a constant in the graph, and each new value would recompile).
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real_compile(fn, backend="aot_eager", **kw))
    torch._dynamo.reset()
    x = synthetic_batch[:4]
    # SGD with momentum: its step is linear in the clipped gradient, so a clipping or lr that differs shows in the weights
    # (Adam divides by sqrt(v) and so hides a gradient's scale, while magnifying rounding where v is near zero)
    kw = dict(dropout=0.0, optimizer="sgd", lr=0.05, warmup_steps=5, grad_clip=0.1)
    eager, compiled = build(tiny_config(tmp_path, **kw)), build(tiny_config(tmp_path, **kw, compile_optimizer=True))
    assert eager.update_fn is None and compiled.update_fn is not None
    assert isinstance(compiled.optimizer.param_groups[0]["lr"], torch.Tensor)
    for i in range(6):
        # the second step compiles once more: SGD's momentum buffers exist from the first step on; after that, none
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", i >= 2)
        g = torch.Generator().manual_seed(i)
        ts, noise = torch.randint(0, 1000, (4,), generator=g), torch.randn(4, 3, 32, 32, generator=g)
        a, b = eager.train_step(x, ts, noise), compiled.train_step(x, ts, noise)
        assert float(b) == pytest.approx(float(a), rel=1e-4, abs=1e-6)
        assert float(compiled.optimizer.param_groups[0]["lr"]) == pytest.approx(eager.optimizer.param_groups[0]["lr"])
    for p, q in zip(eager.model.parameters(), compiled.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)
    for p, q in zip(eager.ema.model.parameters(), compiled.ema.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)
    assert eager.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)  # the warm-up ran to its end in both
    for t in (eager, compiled):  # clipping engaged in both: the gradients left in place have the clipped norm
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in t.model.parameters() if p.grad is not None]))
        assert float(norm) == pytest.approx(0.1, rel=1e-3)

    # A checkpoint resumes across the switch: each side gets the lr in the type its update needs.
    path = compiled.save_checkpoint(tmp_path / "c")
    eager2 = build(tiny_config(tmp_path, **kw))
    eager2.load_checkpoint(path)
    assert isinstance(eager2.optimizer.param_groups[0]["lr"], float)
    eager2.train_step(x)
    path = eager.save_checkpoint(tmp_path / "e")
    compiled.load_checkpoint(path)
    assert isinstance(compiled.optimizer.param_groups[0]["lr"], torch.Tensor)
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", False)  # a new lr tensor is a new guard
    compiled.train_step(x)


def test_a_checkpoint_resumes_across_compile_optimizer_with_this_configs_own_adam(tmp_path, synthetic_batch):
    """load_state_dict copies each saved param group whole: a fused fast() checkpoint came back fused into a
    compile_optimizer trainer (the pairing TrainConfig refuses), and the reverse lost fused. The implementation flags
    and the lr's type are this config's, whichever run wrote the checkpoint."""
    x = synthetic_batch[:4]
    fused = build(tiny_config(tmp_path, optimizer="adam", fused_optimizer=True))
    fused.train_step(x)
    path = fused.save_checkpoint(tmp_path / "fused")
    compiled = build(tiny_config(tmp_path, optimizer="adam", compile_optimizer=True))
    compiled.load_checkpoint(path)
    g = compiled.optimizer.param_groups[0]
    assert not g["fused"] and isinstance(g["lr"], torch.Tensor) and not g["capturable"]  # capturable: on a GPU only
    again = build(tiny_config(tmp_path, optimizer="adam", fused_optimizer=True))
    again.load_checkpoint(compiled.save_checkpoint(tmp_path / "compiled"))
    g = again.optimizer.param_groups[0]
    assert g["fused"] and isinstance(g["lr"], float)
    again.train_step(x)  # the fused step runs on the restored state


@pytest.mark.parametrize("kw, message", [
    (dict(compile_optimizer=True, fused_optimizer=True), "set fused_optimizer=False, or compile_optimizer=False"),
    (dict(compile_optimizer=True, precision="fp16"), "use precision='bf16'"),
])
def test_compile_optimizer_refuses_what_it_cannot_compile(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**kw)
    TrainConfig(compile_optimizer=True, precision="fp16", grad_scaler=False)  # without the scaler, fp16 compiles
