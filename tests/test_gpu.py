"""The GPU-only paths of the series, run where a CUDA GPU is at hand (skipped without one).

CUDA graphs (``reduce-overhead``, ``max-autotune``), fp16 with a GradScaler, TF32, every SDPA
backend on the model's own attention, the out-of-memory sweep, the CUDA-graphs stage of notebook
09 and NCCL DDP: each test uses the tiny model and a few steps (under a minute on an H100, the
compiled ones included). Their CPU counterparts, which catch the same defects without a GPU, are
in test_train.py, test_bench.py and test_model.py.
"""

from __future__ import annotations

import math
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpm_core import bench, data, env
from ddpm_core.train import build, list_checkpoints, train
from helpers import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TF32_ERROR = 5e-5  # mean relative error above which a fp32 matmul ran on TF32 tensor cores
SDPA_BACKENDS = ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def _batch(n: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, 32, 32, generator=g) * 2 - 1).cuda()


def _tf32_flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.fixture(autouse=True)
def _restore_backend_flags():
    """A failing test must not leave TF32, cuDNN autotuning or a memory cap behind for the next one."""
    saved = (*_tf32_flags(), torch.backends.cudnn.benchmark)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = saved
    torch.cuda.set_per_process_memory_fraction(1.0)
    bench.free_memory("cuda")


def _graph_pool_bytes() -> int:
    """Bytes the caching allocator holds in private pools (CUDA graphs) rather than the default one."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))


# ------------------------------------------------------------------------------ CUDA graphs
@pytest.mark.slow
@pytest.mark.parametrize("mode, precision", [("reduce-overhead", "half"),
                                             pytest.param("max-autotune", "tf32", marks=pytest.mark.autotune)])
def test_train_under_cuda_graphs_keeps_every_steps_loss(tmp_path, mode, precision):
    """train() holds 20 losses before it reads them. They used to be views of the graph's one output
    buffer, all overwritten by the last replay; max-autotune with TF32 used to raise in Inductor. "half": the GPU's
    16-bit autocast (bf16; fp16 with the GradScaler on a GPU without bf16)."""
    torch._dynamo.reset()
    precision = env.mixed_precision("cuda") if precision == "half" else precision
    flags = _tf32_flags()
    cfg = tiny_config(tmp_path, device="cuda", compile=mode, precision=precision, steps=20, log_every=20,
                      checkpoint_every=20)
    result = train(cfg)
    steps, losses = zip(*result.losses)
    assert list(steps) == list(range(1, 21))
    assert all(math.isfinite(v) for v in losses), losses
    assert len(set(losses)) == 20, losses  # a random t and noise per step: 20 different values
    assert _tf32_flags() == flags  # restored after every step, and still readable through the legacy API
    torch.get_float32_matmul_precision()
    assert len(list_checkpoints(cfg.out_dir)) == 1


@pytest.mark.slow
def test_compile_optimizer_beside_a_cuda_graph_step_trains_like_the_eager_update(tmp_path):
    """compile_optimizer=True compiles clipping, Adam (its lr a CPU tensor the warm-up changes) and the EMA, after a
    forward and backward replayed from CUDA graphs (reduce-overhead): the pairing TrainConfig.fast() would use. Its
    losses follow the eager update's, step by step, within bf16's rounding, and the lr moves without a recompile."""
    torch._dynamo.reset()
    kw = dict(device="cuda", precision=env.mixed_precision("cuda"), dropout=0.0, warmup_steps=4, optimizer="adam")
    eager = build(tiny_config(tmp_path, **kw))
    fast = build(tiny_config(tmp_path, **kw, compile="reduce-overhead", compile_optimizer=True))
    x = _batch(8)
    for i in range(6):
        g = torch.Generator().manual_seed(i)
        ts, noise = torch.randint(0, 1000, (8,), generator=g), torch.randn(8, 3, 32, 32, generator=g)
        a, b = float(eager.train_step(x, ts, noise)), float(fast.train_step(x, ts, noise))
        assert math.isfinite(b) and b == pytest.approx(a, rel=5e-2), (i, a, b)
        assert float(fast.optimizer.param_groups[0]["lr"]) == pytest.approx(eager.optimizer.param_groups[0]["lr"])
    for p, q in zip(eager.ema.model.parameters(), fast.ema.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-2, atol=1e-3)
    assert fast.optimizer.param_groups[0]["capturable"]  # Adam's step counters on the GPU, as the compiled step wants
    # resumed across the switch, each side keeps its own Adam: fused with its counters on the GPU, or capturable
    fused = build(tiny_config(tmp_path, **kw, fused_optimizer=True))
    fused.load_checkpoint(fast.save_checkpoint(tmp_path / "compiled"))
    assert fused.optimizer.param_groups[0]["fused"] and not fused.optimizer.param_groups[0].get("capturable")
    assert all(s["step"].device.type == "cuda" for s in fused.optimizer.state.values())
    assert math.isfinite(float(fused.train_step(x)))
    fast.load_checkpoint(eager.save_checkpoint(tmp_path / "eager"))
    assert fast.optimizer.param_groups[0]["capturable"] and not fast.optimizer.param_groups[0]["fused"]
    assert all(s["step"].device.type == "cuda" for s in fast.optimizer.state.values())
    assert math.isfinite(float(fast.train_step(x)))
    del eager, fast, fused
    bench.free_memory("cuda", compiled=True)


# ------------------------------------------------------------------------------ fp16, TF32
@pytest.mark.parametrize("fused", [False, True], ids=["foreach-adam", "fused-adam"])
def test_fp16_with_grad_scaler_trains_and_skips_an_overflowing_step(tmp_path, fused):
    t = build(tiny_config(tmp_path, device="cuda", precision="fp16", fused_optimizer=fused))
    assert t.scaler.is_enabled() and t.optimizer.defaults.get("fused") is (True if fused else None)
    x = _batch()
    start = [p.detach().clone() for p in t.model.parameters()]
    losses = [float(t.train_step(x)) for _ in range(8)]
    assert all(math.isfinite(v) for v in losses), losses
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(start, t.model.parameters()))

    # A loss scale of 2^40 overflows fp16 gradients: the scaler must skip the update and back off.
    t.scaler.update(2.0 ** 40)
    before = [p.detach().clone() for p in t.model.parameters()]
    t.train_step(x)
    assert all(torch.equal(a, p) for a, p in zip(before, t.model.parameters()))
    assert t.scaler.get_scale() == 2.0 ** 39


@pytest.mark.parametrize("precision, tf32", [("tf32", True), ("fp32", False)])
def test_tf32_is_on_exactly_during_the_steps_of_a_tf32_trainer(tmp_path, precision, tf32):
    """Checked on the numbers, not only the flags: TF32 keeps 10 mantissa bits (mean relative error
    of a 1024-long dot product ~4e-4), IEEE fp32 23 (~1e-7; a Winograd convolution ~1e-6)."""
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip(f"{torch.cuda.get_device_name()} has no TF32 (needs Ampere or newer)")
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(1024, 1024, device="cuda", generator=g) for _ in range(2))
    img, w = torch.randn(8, 64, 32, 32, device="cuda", generator=g), torch.randn(64, 64, 3, 3, device="cuda", generator=g)
    mm_ref, conv_ref = a.double() @ b.double(), F.conv2d(img.double(), w.double(), padding=1)

    def errors() -> tuple[float, float]:
        rel = lambda out, ref: ((out.double() - ref).abs().mean() / ref.abs().mean()).item()  # noqa: E731
        return rel(a @ b, mm_ref), rel(F.conv2d(img, w, padding=1), conv_ref)

    t = build(tiny_config(tmp_path, device="cuda", precision=precision))
    seen = {}
    eager = t.loss_fn

    def spy(*args):
        seen.update(flags=_tf32_flags(), errors=errors())
        return eager(*args)

    t.loss_fn = spy
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32  # the opposite
    t.train_step(_batch())
    assert seen["flags"] == (tf32, tf32)
    after = errors()
    assert _tf32_flags() == (not tf32, not tf32)  # restored after the step
    # Matmuls: TF32 inside a tf32 step and IEEE after it, IEEE inside an fp32 step and TF32 after.
    assert (seen["errors"][0] > TF32_ERROR, after[0] > TF32_ERROR) == (tf32, not tf32), (seen, after)
    # Convolutions: with TF32 off they must be IEEE (with it on, cuDNN may still pick an fp32 kernel).
    assert (seen["errors"][1] if not tf32 else after[1]) < TF32_ERROR, (seen, after)


# ------------------------------------------------------------------------------ GroupNorm in 16 bits
def test_cuda_autocast_runs_groupnorm_in_fp32_and_group16_in_16_bits_saving_fewer_bytes(tmp_path):
    """The premise of norm="group16": on CUDA, autocast upcasts group_norm to fp32 (on a CPU it does not, so only a GPU
    can test this). group16 keeps it in the autocast type, and the same step then saves fewer bytes for backward."""
    from ddpm_core.model import GroupNorm16

    half = HALF_DTYPE[env.mixed_precision("cuda")]
    gn = GroupNorm16(32, 64, eps=1e-6).cuda()
    h = torch.randn(4, 64, 16, 16, device="cuda", dtype=half)
    with torch.autocast("cuda", dtype=half):
        assert torch.nn.GroupNorm.forward(gn, h).dtype == torch.float32
        out = gn(h)
    assert out.dtype == half
    torch.testing.assert_close(out.float(), F.group_norm(h.float(), 32, gn.weight, gn.bias, 1e-6), atol=3e-2, rtol=2e-2)
    saved = {}
    for norm in ("group", "group16"):
        t = build(tiny_config(tmp_path / norm, device="cuda", precision=env.mixed_precision("cuda"), norm=norm,
                              batch_size=8))
        saved[norm], _ = bench.saved_tensor_bytes(t.train_step, _batch(8))
    assert saved["group16"] < 0.95 * saved["group"], saved


# ------------------------------------------------------------------------------ SDPA
HALF_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the GPU's 16-bit autocast: env.mixed_precision


def _attention_trainer(tmp_path, model: str):
    cfg = tiny_config(tmp_path, model=model, device="cuda", precision=env.mixed_precision("cuda"), attention="sdpa",
                      batch_size=4)
    return build(cfg)


@pytest.mark.parametrize("model", ["tiny", "ddpm-cifar10"])
def test_the_dispatcher_picks_a_fused_kernel_for_the_models_own_bf16_attention(tmp_path, model):
    """Before the token-major layout, q/k/v had head-dim stride N and every fused kernel refused them."""
    from torch.nn.attention import SDPBackend

    t = _attention_trainer(tmp_path, model)
    q, k, v = bench.attention_inputs(t, _batch(4))
    assert q.dtype == HALF_DTYPE[env.mixed_precision("cuda")] and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert torch._fused_sdp_choice(q, k, v) != int(SDPBackend.MATH)
    table = bench.sdpa_backends(q, k, v)
    assert table.loc[table["default choice"], "backend"].tolist() != ["MATH"], table


@pytest.mark.parametrize("model", ["tiny", "ddpm-cifar10"])
@pytest.mark.parametrize("backend", SDPA_BACKENDS)
def test_each_sdpa_backend_runs_the_models_own_bf16_attention(tmp_path, model, backend):
    """Each backend forced on the model's q/k/v (same values as fp32 math attention, to bf16
    precision) and for a whole training step, forward and backward. A backend this GPU cannot run
    for these shapes is a skip that says why, not a failure."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    t = _attention_trainer(tmp_path, model)
    x = _batch(4)
    q, k, v = bench.attention_inputs(t, x)
    qf, kf, vf = q.float(), k.float(), v.float()
    ref = torch.softmax(qf @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ vf
    with warnings.catch_warnings(record=True) as caught, sdpa_kernel(getattr(SDPBackend, backend)):
        warnings.simplefilter("always")
        try:
            out = F.scaled_dot_product_attention(q, k, v)
            loss = t.train_step(x)
            torch.cuda.synchronize()
        except RuntimeError as e:
            if "No available kernel" not in str(e) and "No viable backend" not in str(e):
                raise
            why = " ".join(str(w.message) for w in caught) or str(e)
            pytest.skip(f"{backend} cannot run {model}'s bf16 attention {tuple(q.shape)} on "
                        f"{torch.cuda.get_device_name()}: {why[:400]}")
    assert out.dtype == HALF_DTYPE[env.mixed_precision("cuda")]
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    assert math.isfinite(float(loss))


# ------------------------------------------------------------------------------ memory
def test_the_out_of_memory_sweep_survives_and_gives_the_memory_back(tmp_path):
    """Capped at 2 GiB above what the trainer holds, so out-of-memory comes after a few doublings."""
    t = build(tiny_config(tmp_path, device="cuda"))

    def step(b: int) -> None:
        t.train_step(torch.rand(b, 3, 32, 32, device="cuda") * 2 - 1)
        torch.cuda.synchronize()

    step(8)  # gradients and Adam's moments exist from here on
    bench.free_memory("cuda")
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((reserved + 2 * 2**30) / total)
    try:
        best, hit = bench.largest_batch(step, 8, 2**16, "cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert hit, f"no out-of-memory up to batch {best} under a 2 GiB cap"
    assert best is not None and 8 <= best < 2**16
    assert torch.cuda.memory_allocated() <= allocated + 16 * 2**20  # the failed batch's tensors are gone
    assert torch.cuda.memory_reserved() <= reserved + 64 * 2**20  # and the cache is given back
    step(best)  # the GPU is still usable at the largest batch that fitted


@pytest.mark.slow
def test_the_cuda_graphs_stage_of_notebook_09_reports_memory_with_its_graph_pool(tmp_path):
    """Notebook 09's last stage. max_memory_allocated misses the activations that live in the
    graphs' private pool; the measurement must report a peak that holds that pool."""
    torch._dynamo.reset()
    probe = build(tiny_config(tmp_path, device="cuda", batch_size=2))
    flops_per_image = bench.count_flops(probe.train_step, _batch(2)) / 2
    del probe
    half = env.mixed_precision("cuda")  # bf16; fp16 on a GPU without bf16 hardware
    cfg = tiny_config(tmp_path, device="cuda", batch_size=64, compile="reduce-overhead", precision=half,
                      attention="sdpa", channels_last=True, fused_optimizer=True, loader="device")
    t = build(cfg)
    dataset = data.get_dataset("synthetic", synthetic_size=cfg.synthetic_size, verbose=False)
    batches = data.forever(data.make_loader(dataset, cfg.batch_size, device=t.device, mode=cfg.loader, seed=0))
    m = bench.measure(lambda: t.train_step(next(batches)), batch_size=cfg.batch_size, warmup=3, iters=10,
                      flops=int(flops_per_image * cfg.batch_size), precision=cfg.precision, device=t.device,
                      cuda_graphs=True, name="+ CUDA graphs (reduce-overhead)")
    pool = _graph_pool_bytes()
    assert pool > 0, "reduce-overhead ran no CUDA graph"
    assert "CUDA-graph" in m.memory_kind and m.peak_memory_bytes == m.reserved_bytes >= pool
    assert m.tflops > 0 and m.precision == half
    peak, _ = bench.peak_for_name(m.device_name, "bf16")
    if peak is not None and half == "bf16":
        assert m.mfu_bf16 == pytest.approx(m.tflops / peak.tflops) and m.mfu == pytest.approx(m.mfu_bf16)
        assert "MFU vs bf16 peak" in bench.summary_table([m]).columns

    # Timing t.train_step itself: measure reads the trainer's compile mode and precision.
    m2 = bench.measure(t.train_step, next(batches), batch_size=cfg.batch_size, warmup=2, iters=5)
    assert "CUDA-graph" in m2.memory_kind and m2.precision == half


# ------------------------------------------------------------------------------ resume, processes
@pytest.mark.parametrize("fused", [False, True], ids=["foreach-adam", "fused-adam"])
def test_resume_on_the_gpu_keeps_adam_step_counters_where_adam_wants_them(tmp_path, fused):
    """Non-fused Adam reads `step` with .item(): on the GPU that is two syncs per parameter per step.
    Fused Adam keeps it on the device."""
    cfg = tiny_config(tmp_path, device="cuda", steps=2, checkpoint_every=2, fused_optimizer=fused)
    train(cfg)
    t = build(cfg)
    assert t.resume_latest(cfg.out_dir) is not None and t.step == 2
    steps = [s["step"] for s in t.optimizer.state.values()]
    assert steps and {s.device.type for s in steps} == {t.device.type if fused else "cpu"}
    moments = [s["exp_avg"] for s in t.optimizer.state.values()]
    assert all(m.device == p.device for m, p in zip(moments, t.model.parameters()))
    assert all(p.device == t.device for p in t.ema.model.parameters())
    assert math.isfinite(float(t.train_step(_batch())))


def test_a_local_rank_beyond_the_visible_gpus_is_a_clear_error(monkeypatch):
    from ddpm_core.train import resolve_device

    n = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_RANK", str(n))
    with pytest.raises(ValueError, match=rf"LOCAL_RANK {n} but only {n} GPU.*--nproc_per_node={n}"):
        resolve_device("auto")


def test_one_process_nccl_ddp_step_matches_the_plain_step(tmp_path):
    """DDP over NCCL with world size 1: the gradient all-reduce runs and changes nothing."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        # SGD without dropout or EMA: the comparison is about gradients.
        cfg = tiny_config(tmp_path, device="cuda", dropout=0.0, optimizer="sgd", lr=0.05, ema_decay=None)
        plain, wrapped = build(cfg), build(cfg)
        wrapped.net = DDP(wrapped.model, device_ids=[wrapped.device])
        g = torch.Generator().manual_seed(1)
        x = _batch(8)
        steps, noise = torch.randint(0, 1000, (8,), generator=g).cuda(), torch.randn(8, 3, 32, 32, generator=g).cuda()
        a, b = plain.train_step(x, steps, noise), wrapped.train_step(x, steps, noise)
        assert dist.get_backend() == "nccl"
        torch.testing.assert_close(b, a)
        for p, q in zip(plain.model.parameters(), wrapped.model.parameters()):
            torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4)
        ones = torch.ones(4, device="cuda")
        dist.all_reduce(ones)
        assert ones.tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # compiles (reduce-overhead): the reference runs it in its gpu-tests-slow part
def test_compare_on_cuda_interleaves_an_eager_and_a_cuda_graph_step_and_reports_their_memory(tmp_path):
    """bench.compare with a reduce-overhead trainer beside an eager one: interleaving two CUDA-graph
    trees' worth of calls must not re-record or crash, and each variant reports its own memory."""
    x = _batch(8)
    eager = build(tiny_config(tmp_path, device="cuda", batch_size=8))
    graphs = build(tiny_config(tmp_path, device="cuda", batch_size=8, compile="reduce-overhead"))
    c = bench.compare([bench.Variant("eager", eager.train_step, (x,), 8),
                       bench.Variant("graphs", graphs.train_step, (x,), 8)], rounds=3, iters=2, warmup=3, progress=False)
    e, g = c.measurements
    assert e.memory_kind.startswith("peak allocated, CUDA") and e.peak_memory_bytes > 0 and e.reserved_bytes >= e.peak_memory_bytes
    # each row is its own step: the other trainer's state (about its fixed state) is left out of it
    own = bench.owned_bytes(eager.train_step, (x,), device=torch.device("cuda"))
    assert own <= e.peak_memory_bytes < torch.cuda.max_memory_reserved() and "alone" in e.memory_kind
    assert "CUDA-graph" in g.memory_kind and g.peak_memory_bytes > 0
    assert all(len(m.times_ms) == 6 and m.median_ms > 0 for m in c.measurements)
    assert "reserved (MiB)" in c.table().columns


def test_a_lone_process_after_a_training_step_does_not_count_itself_as_others(tmp_path, monkeypatch):
    """gpu_memory_gib takes what is missing from the card beyond this process's allocator for other processes' once it
    reaches OTHERS_MIN_GIB: this process's own context and the modules cuDNN, cuBLAS and SDPA load must stay below it,
    or every notebook past its first step would size its batches as if the GPU were shared."""
    t = build(tiny_config(tmp_path, device="cuda", precision=env.mixed_precision("cuda"), attention="sdpa",
                          cudnn_benchmark=True))
    t.train_step(_batch(8))
    torch.cuda.synchronize()
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    free, _ = torch.cuda.mem_get_info(0)
    outside = total - (free + torch.cuda.memory_reserved(0)) / 2**30
    print(f"outside the allocator after a step: {outside:.2f} GiB")
    assert outside < env.OTHERS_MIN_GIB, outside
    monkeypatch.delenv(env.MEMORY_CAP_ENV, raising=False)  # a capped reference run sets it for every test
    assert env.gpu_memory_gib("cuda") == pytest.approx(total)


def test_a_16_gb_cap_makes_the_gpu_refuse_more_and_the_fast_preset_size_for_it(monkeypatch):
    """DDPM_GPU_MEMORY_GB=16 rehearses a 16 GB card (a T4) on a bigger one: env.show applies it."""
    from ddpm_core import env
    from ddpm_core.train import TrainConfig

    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if total < 24:
        pytest.skip(f"this GPU has {total:.0f} GiB: nothing to cap")
    monkeypatch.setenv(env.MEMORY_CAP_ENV, "16")
    monkeypatch.setattr("IPython.display.display", lambda *a, **k: None)
    env.show("cuda")
    assert env.gpu_memory_gib("cuda") == 16 and TrainConfig.fast(device="cuda").batch_size == 256
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(int(20 * 2**30), dtype=torch.uint8, device="cuda")
    torch.empty(int(8 * 2**30), dtype=torch.uint8, device="cuda")  # under the cap: fine


def test_the_ceiling_on_the_gpu_times_the_models_convs_in_bf16_and_names_the_datasheet(tmp_path):
    """Notebook 09b's ceiling: CUDA-event timing of each conv shape with cuDNN autotuning; its conv FLOPs are
    the step's (the CPU test checks the same), and a known GPU gets its datasheet peak beside it."""
    from ddpm_core import ceiling

    c = ceiling.measure("tiny", batch_size=8, device="cuda", iters=3, warmup=1, matmul_n=1024, progress=False)
    assert c.precision == env.mixed_precision("cuda") and 0 < c.conv_flops < c.step_flops
    assert math.isfinite(c.tflops) and c.tflops > 0 and c.matmul_tflops > 0
    if bench.peak_for("cuda", c.precision)[0] is not None:
        assert c.datasheet is not None and c.mfu(c.tflops)["vs_datasheet"] < 1


@pytest.mark.slow
def test_bench_peers_and_the_quality_check_run_on_the_gpu_with_the_compiled_fast_step(tmp_path, capsys, synthetic_folder,
                                                                                      data_root):
    """09b's two long paths on a GPU: TrainConfig.fast() compiles with CUDA graphs there (not on a CPU)."""
    from ddpm_core import bench_peers, quality, results

    out = tmp_path / "peers.csv"
    assert bench_peers.main(["--smoke", "--device", "cuda", "--fast-batch", "8", "--out", str(out)]) == 0
    rows = results.load(out)
    assert {"ours (baseline)", "ours (fast)", "ours (fast, batch 8)"} <= set(rows["variant"]), capsys.readouterr().out
    assert not rows["device_name"].str.startswith("CPU").any()
    r = quality.run(model="tiny", steps=12, batch_size=4, lr=1e-3, warmup_steps=0, ema_decay=0.9, dataset="synthetic",
                    data_root=data_root, synthetic_size=256, heldout_batches=1, n_samples=4, sample_steps=5, device="cuda",
                    out_dir=tmp_path / "q", progress=False)
    fast = [a for a in r.arms.values() if a["kind"] == "fast"][0]
    assert fast["precision"] == env.mixed_precision("cuda") and all(len(c) == 12 for c in r.curves.values())
    assert all(math.isfinite(v) for v in r.heldout["loss"]) and r.verdict()


def test_cudnn_autotuning_is_timed_in_fresh_processes_on_the_gpu():
    """Notebooks 02 and 03 time cudnn.benchmark off and on with compare_in_processes: each launch builds its trainer
    on the GPU, times it with CUDA events and reports the allocator's peak."""
    fields = {"model": "tiny", "device": "cuda", "precision": "fp32", "attention": "math"}
    cmp = bench.compare_in_processes({f"cudnn.benchmark={f}": {**fields, "cudnn_benchmark": f} for f in (False, True)},
                                     batch_size=16, rounds=1, iters=3, warmup=3, flops=10**9, progress=False)
    assert all(m.device.startswith("cuda") and m.memory_kind.startswith("peak allocated, CUDA") and m.iters == 3
               and m.tflops is not None for m in cmp.measurements)
