"""bench_peers in smoke mode: every contender builds, trains and is measured side by side."""

import pytest
import torch

from ddpm_core import bench_peers, results


@pytest.mark.slow
def test_bench_peers_runs_in_smoke_mode_and_writes_one_row_per_contender(tmp_path, capsys):
    out = tmp_path / "peers.csv"
    assert bench_peers.main(["--smoke", "--fast-batch", "6", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = results.load(out)
    assert list(rows["variant"]) == ["ours (baseline)", "ours (fast)", "ours (fast, batch 6)", "diffusers", "lucidrains"], printed
    assert list(rows["batch_size"]) == [4, 4, 6, 4, 4]
    assert (rows["flops_per_step"] > 0).all() and rows["device_name"].notna().all()
    assert "skipped" not in printed
    # the measured ceiling: our two steps as a share of it; the other networks have none. A step can pass the
    # ceiling only by noise, and a ceiling timed on a busy machine, or with repeats that spread, says so (then only
    # the sign is checked).
    share = rows["of_ceiling"].iloc[:3]
    assert (share > 0).all() and rows["of_ceiling"].iloc[3:].isna().all(), printed
    assert "take these rates as rough" in printed or share.le(1.5).all(), printed
    assert "The step's ceiling is" in printed


def test_bench_peers_refuses_a_bad_batch_size_before_building_anything(capsys):
    for flag in ("--batch-size", "--fast-batch"):
        with pytest.raises(SystemExit) as e:
            bench_peers.main([flag, "0"])
        assert e.value.code == 2 and f"{flag} must be >= 1" in capsys.readouterr().err


def test_a_peer_that_fails_to_build_is_skipped_with_its_error_and_ours_are_still_measured(monkeypatch):
    """diffusers turns a failed import of a dependency into a RuntimeError (its lazy modules): the benchmark
    reports that peer as skipped, with the error, and measures the others; an error in our own step is raised."""
    from ddpm_core import bench_peers

    def broken(*args, **kwargs):
        raise RuntimeError("Failed to import diffusers.models.unets.unet_2d because of the following error:\nboom")

    monkeypatch.setattr(bench_peers, "diffusers_step", broken)
    variants, skipped = bench_peers.contenders(2, torch.device("cpu"), smoke=True)
    assert [v.name for v in variants if v.name.startswith("ours")] == ["ours (baseline)", "ours (fast)"]
    assert "diffusers" not in [v.name for v in variants]
    assert any(s.startswith("diffusers: could not be built here (RuntimeError: Failed to import") for s in skipped), skipped
    monkeypatch.setattr(bench_peers, "ours", broken)
    with pytest.raises(RuntimeError, match="Failed to import"):
        bench_peers.contenders(2, torch.device("cpu"), smoke=True)


@pytest.mark.parametrize("make", [bench_peers.diffusers_step, bench_peers.lucidrains_step], ids=["diffusers", "lucidrains"])
def test_a_peer_in_fp16_trains_through_a_grad_scaler_as_accelerate_does(make, monkeypatch):
    """On a GPU without bf16 (a T4) the peers run fp16 autocast with a GradScaler: scale, unscale before clipping,
    step and update. The same code runs here under the CPU's fp16 autocast: the scaler is on, its scale is used, and
    the steps give finite losses."""
    scalers = []
    real = bench_peers._scaler

    def keep(device, precision):
        scalers.append(real(device, precision))
        return scalers[-1]

    monkeypatch.setattr(bench_peers, "_scaler", keep)
    step = make(2, torch.device("cpu"), True, "fp16")
    (scaler,) = scalers
    assert scaler.is_enabled()
    losses = [float(step()) for _ in range(3)]
    assert all(loss == loss and abs(loss) < 1e3 for loss in losses), losses
    assert scaler._scale is not None  # the loss went through scaler.scale(): the scale was made and used
    assert not bench_peers._scaler(torch.device("cpu"), "bf16").is_enabled()
