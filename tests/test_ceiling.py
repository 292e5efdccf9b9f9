"""The measured ceiling: the model's own conv shapes, timed alone; the arithmetic that turns them into a ceiling."""

from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from ddpm_core import bench, bench_peers, ceiling
from ddpm_core.model import preset


def test_conv_shapes_capture_every_conv_call_and_which_inputs_need_a_gradient():
    model = preset("tiny")
    x, t = torch.randn(2, 3, 32, 32), torch.randint(0, 1000, (2,))
    shapes = ceiling.conv_shapes(model, x, t)
    calls = []
    handles = [m.register_forward_hook(lambda m, a, o: calls.append(m)) for m in model.modules()
               if isinstance(m, torch.nn.Conv2d)]
    model(x, t)
    for h in handles:
        h.remove()
    assert sum(shapes.values()) == len(calls)
    no_grad = [s for s in shapes if not s.input_grad]
    assert len(no_grad) == 1 and no_grad[0].input == (2, 3, 32, 32)  # only the first conv sees the image itself
    assert all(s.input[0] == 2 for s in shapes)


def _fake(**kw) -> ceiling.Ceiling:
    shapes = pd.DataFrame({"shape": ["a"], "count": [2], "GFLOP": [1.0], "ms": [1.0], "spread": [0.0]})
    args = dict(device_name="GPU", label="GPU · torch", model="m", precision="bf16", batch_size=100,
                channels_last=True, shapes=shapes, conv_flops=8 * 10**12, conv_ms=10.0, matmul_n=8192,
                matmul_tflops=1000.0, step_flops=10 * 10**12, datasheet=bench.Peak(2000.0, "X", "bf16"))
    return ceiling.Ceiling(**{**args, **kw})


def test_the_ceiling_charges_convs_their_measured_time_and_the_other_flops_the_matmul_rate():
    c = _fake()
    # 8 TFLOP of convs take 10 ms; the other 2 TFLOP at 1000 TFLOP/s take 2 ms: 10 TFLOP in 12 ms.
    assert c.conv_tflops == pytest.approx(800.0)
    assert c.ceiling_ms == pytest.approx(12.0)
    assert c.tflops == pytest.approx(10 / 12e-3)
    assert c.images_per_s == pytest.approx(100 / 12e-3)
    mfu = c.mfu(416.6666)
    assert mfu["vs_datasheet"] == pytest.approx(416.6666 / 2000) and mfu["vs_ceiling"] == pytest.approx(0.5, rel=1e-4)
    text = c.summary()
    assert "833 TFLOP/s" in text and "42% of the datasheet" in text and "noisy" not in text
    assert ceiling.Ceiling.mfu(_fake(datasheet=None), 1.0)["vs_datasheet"] is None


def test_a_wide_spread_among_the_shapes_is_said():
    c = _fake(shapes=pd.DataFrame({"shape": ["a", "b"], "count": [1, 1], "GFLOP": [1.0, 1.0], "ms": [1.0, 1.0],
                                   "spread": [0.5, 0.1]}))
    assert "1 of the 2 shapes spread by more than 25%" in c.summary() and c.noisy and not _fake().noisy


@pytest.mark.slow
def test_measure_times_the_tiny_model_and_its_conv_flops_match_the_step_count(tmp_path):
    c = ceiling.measure("tiny", batch_size=2, device="cpu", iters=3, warmup=1, matmul_n=128, progress=False)
    assert c.batch_size == 2 and c.datasheet is None and c.conv_ms > 0 and c.matmul_tflops > 0
    assert 0 < c.conv_flops < c.step_flops
    # The shapes timed alone add up to exactly the convolutions of a counted training step, forward and backward.
    from ddpm_core.train import TrainConfig, build

    tr = build(TrainConfig(model="tiny", batch_size=2, device="cpu", progress=False))
    ops = bench.flop_breakdown(tr.train_step, torch.rand(2, 3, 32, 32) * 2 - 1)
    assert c.conv_flops == ops[ops["op"].str.contains("convolution")]["flops"].sum()
    assert c.shapes["share of conv time"].sum() == pytest.approx(1.0)
    assert c.rows()[0]["device_name"].startswith("CPU")


def test_the_ceiling_column_applies_only_to_the_network_it_was_measured_on():
    names, tflops = ["ours (baseline)", "ours (fast)", "diffusers", "lucidrains"], [1.0, 2.0, 1.5, 3.0]
    table = pd.DataFrame({"variant": names, "TFLOP/s": [round(v, 0) for v in tflops]})
    measured = [SimpleNamespace(name=n, tflops=v) for n, v in zip(names, tflops)]
    c = _fake()
    name = bench_peers.ceiling_column(table, c, False, measured)
    share = 100 / c.tflops
    assert list(table[name]) == [f"{share:.1f}%", f"{2 * share:.1f}%", f"{1.5 * share:.1f}%", "n/a (other network)"]
    bench_peers.ceiling_column(table, c, True, measured)
    assert table[name][2] == "n/a (other network)"  # smoke mode: diffusers runs a small UNet of its own


def test_bad_arguments_are_refused_before_any_work(capsys):
    with pytest.raises(SystemExit) as e:
        ceiling.main(["--batch-size", "0"])
    assert e.value.code == 2 and "--batch-size must be >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown precision"):
        ceiling.measure("tiny", precision="int8", device="cpu")


def test_a_noisy_ceiling_is_marked_rough_in_the_column_and_on_both_figures():
    """Timings that spread widely must not print as 71.8% or as a clean chart."""
    from ddpm_core import plots

    names, tflops = ["ours (baseline)", "ours (fast)"], [1.0, 2.0]
    table = pd.DataFrame({"variant": names, "batch": [4, 4], "img/s": [1.0, 2.0], "speedup": ["1.00x", "2.00x"],
                          "TFLOP/s": tflops})
    measured = [SimpleNamespace(name=n, tflops=v) for n, v in zip(names, tflops)]
    noisy = _fake(shapes=pd.DataFrame({"shape": ["a", "b"], "count": [1, 1], "GFLOP": [1.0, 1.0], "ms": [1.0, 1.0],
                                       "spread": [0.5, 0.1], "TFLOP/s": [1.0, 1.0], "share of conv time": [0.5, 0.5]}))
    name = bench_peers.ceiling_column(table, noisy, False, measured)
    assert list(table[name]) == [f"about {100 / noisy.tflops:.0f}%", f"about {200 / noisy.tflops:.0f}%"]

    def red(fig):
        return [t.get_text().replace("\n", " ") for t in fig.texts if t.get_color() == "#b00020"]

    assert "1 of the 2 shapes spread by more than 25%" in " ".join(red(plots.ceiling_figure(noisy, label="t")))
    legend = plots.peers_figure(table, ceiling=noisy, label="t").axes[1].get_legend().get_texts()
    assert any("rough: timed with noisy repeats" in t.get_text() for t in legend)  # a quiet machine: the repeats spread
    quiet = _fake(shapes=noisy.shapes.assign(spread=0.0))
    assert not red(plots.ceiling_figure(quiet, label="t"))
    assert not any("rough" in t.get_text()
                   for t in plots.peers_figure(table, ceiling=quiet, label="t").axes[1].get_legend().get_texts())
