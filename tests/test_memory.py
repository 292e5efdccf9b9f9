"""What a training step holds: the fixed state, the saved activations, activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from ddpm_core import bench, memory
from ddpm_core.model import AttnBlock
from ddpm_core.train import build
from helpers import tiny_config


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    t = build(tiny_config(tmp_path_factory.mktemp("mem"), batch_size=4))
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    t.train_step(x)
    return t, x


def test_the_fixed_state_is_five_fp32_copies_of_the_weights_counted_and_measured(stepped):
    t, _ = stepped
    df = memory.fixed_state(t)
    n = sum(p.numel() for p in t.model.parameters())
    assert df["what"].tolist() == ["weights", "gradients", "Adam first moment (m)", "Adam second moment (v)", "EMA weights"]
    assert (df["computed"] == 4 * n).all()  # the independent count: parameters x 4 bytes
    assert (df["measured"] == df["computed"]).all()  # the tensors the trainer really holds
    fresh = memory.fixed_state(build(tiny_config(__import__("pathlib").Path(t.cfg.out_dir))))  # before a step: no gradients, no moments yet
    assert fresh.set_index("what").loc["gradients", "measured"] == 0


def test_saved_bytes_are_attributed_to_modules_and_add_up_to_the_total(stepped):
    t, x = stepped
    df = memory.saved_by_module(t.model, t.train_step, x)
    total, _ = bench.saved_tensor_bytes(t.train_step, x)
    assert df["bytes"].sum() == total
    kinds = memory.group_saved(df, "kind", batch_size=4)
    assert {"convolution inputs", "GroupNorm", "attention (scores, softmax, weighted sum)"} <= set(kinds["kind"])
    assert kinds["share"].sum() == pytest.approx(1.0)
    assert kinds["KiB_per_image"].sum() == pytest.approx(total / 4 / 1024)
    blocks = memory.group_saved(df, "block")
    assert any(b.startswith("down.") for b in blocks["block"]) and any(b.startswith("up.") for b in blocks["block"])
    # one image saves a quarter of what four save
    assert memory.saved_by_module(t.model, t.train_step, x[:1])["bytes"].sum() == pytest.approx(total / 4, rel=0.05)  # (a few small tensors do not scale)


def test_sdpa_saves_less_attention_than_the_math_path(tmp_path):
    x = torch.rand(4, 3, 32, 32) * 2 - 1
    got = {}
    for attention in ("math", "sdpa"):
        t = build(tiny_config(tmp_path, batch_size=4, attention=attention))
        kinds = memory.group_saved(memory.saved_by_module(t.model, t.train_step, x), "kind").set_index("kind")
        got[attention] = kinds.loc["attention (scores, softmax, weighted sum)", "bytes"]
    assert got["sdpa"] < got["math"]


def test_activation_checkpointing_learns_the_same_weights_and_saves_most_activations(tmp_path):
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    t_ = torch.tensor([10, 200, 500, 900])
    noise = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    runs = {}
    for ac in (False, True):
        t = build(tiny_config(tmp_path, batch_size=4, activation_checkpointing=ac))  # dropout 0.1 is on
        torch.manual_seed(3)
        loss = float(t.train_step(x, t_, noise))
        saved, _ = bench.saved_tensor_bytes(t.train_step, x)
        runs[ac] = (loss, [p.detach().clone() for p in t.model.parameters()], saved)
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))  # the dropout masks were replayed
    assert runs[True][2] < 0.5 * runs[False][2]
    # checkpoint_blocks narrows it to some kinds of block (03b, Exercise 2): the attention blocks alone save less
    t = build(tiny_config(tmp_path, batch_size=4, activation_checkpointing=True))
    t.model.checkpoint_blocks = (AttnBlock,)
    torch.manual_seed(3)
    assert float(t.train_step(x, t_, noise)) == runs[False][0]
    saved, _ = bench.saved_tensor_bytes(t.train_step, x)
    assert runs[True][2] < saved < runs[False][2]


def test_batch_that_fits_is_the_budget_left_by_the_fixed_state():
    assert memory.batch_that_fits(1000, 200, 8) == 100
    assert memory.batch_that_fits(100, 200, 8) == 0
    with pytest.raises(ValueError):
        memory.batch_that_fits(1000, 200, 0)


def test_the_gpu_only_tools_say_so_on_a_cpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        memory.cuda_timeline(lambda: None, device="cpu")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        memory.h2d_copy(torch.zeros(2), device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_allocator_timeline_of_a_step_peaks_above_the_fixed_state(tmp_path):
    t = build(tiny_config(tmp_path, batch_size=32, device="cuda"))
    x = torch.rand(32, 3, 32, 32, device="cuda") * 2 - 1
    t.train_step(x)
    tl = memory.cuda_timeline(t.train_step, x, device="cuda")
    fixed = int(memory.fixed_state(t)["measured"].sum())
    assert len(tl) > 10 and set(tl["action"]) <= {"alloc", "free_completed"}
    assert tl["allocated"].max() > fixed
    copy = memory.h2d_copy(x, "cuda", repeats=3)
    assert copy["host memory"].tolist() == ["pageable", "pinned"] and (copy["GB_per_s"] > 0).all()


def test_a_linear_layers_saved_weight_view_is_weights_not_activations(tmp_path):
    """nn.Linear saves weight.t() for its backward: a view sharing the parameter's storage, no memory of its own.
    Counted as an activation it added the DDPM's 10.8 MiB of time-embedding weights to every measurement, whatever the
    batch, so the bytes per image measured at batch 2 (03b's estimate of the batch that fits) read 11% high."""
    lin = torch.nn.Linear(512, 256)
    x = torch.randn(2, 512)
    saved, _ = bench.saved_tensor_bytes(lambda: lin(x).sum().backward())
    assert saved == x.numel() * 4  # the input only
    assert bench.is_parameter(lin.weight) and bench.is_parameter(lin.weight.t()) and not bench.is_parameter(x[:1])
    t = build(tiny_config(tmp_path, batch_size=4))
    x = torch.rand(4, 3, 32, 32) * 2 - 1
    per_image = [bench.saved_tensor_bytes(t.train_step, x[:b])[0] / b for b in (1, 4)]
    assert per_image[0] == pytest.approx(per_image[1], rel=1e-3)  # nothing batch-independent left in the count
