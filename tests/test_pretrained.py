"""ddpm_core.pretrained maps the paper's CIFAR-10 checkpoint (as diffusers publishes it) onto preset("ddpm-cifar10").

Offline: a diffusers ``UNet2DModel`` built with the published configuration and random weights
stands in for the downloaded checkpoint (same layout, same tensor names). No test touches the network.
"""

from __future__ import annotations

import importlib
import json
import math
import sys

import pytest
import torch

from ddpm_core import pretrained


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch):
    """Belt and braces: huggingface_hub must not reach the network from any test here."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-zero random weights at a scale that keeps activations O(1): a mapping error shows up as O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def diffusers_checkpoint(tmp_path_factory):
    """(diffusers model, folder): the published config with random weights, saved as the Hub repository holds it."""
    from diffusers import UNet2DModel  # test-only dependency (the dev extra)

    torch.manual_seed(0)
    ref = UNet2DModel(**pretrained.CONFIG).eval()
    _randomize(ref)
    folder = tmp_path_factory.mktemp("ddpm-cifar10-32")
    ref.save_pretrained(folder)
    assert pretrained.available(folder)
    return ref, folder


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 32, 32, generator=g), torch.tensor([3, 742])


def test_the_published_config_is_the_paper_model():
    from ddpm_core.model import count_parameters, preset

    cfg = pretrained.CONFIG
    assert cfg["block_out_channels"] == [128, 256, 256, 256] and cfg["layers_per_block"] == 2
    assert cfg["downsample_padding"] == 0 and cfg["flip_sin_to_cos"] is False and cfg["freq_shift"] == 1
    assert cfg["norm_eps"] == 1e-6 and cfg["norm_num_groups"] == 32 and cfg["attention_head_dim"] is None
    assert count_parameters(preset(pretrained.PRESET)) == 35_746_307


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_the_diffusers_checkpoint_maps_onto_our_unet_to_1e_4(diffusers_checkpoint, attention):
    ref, folder = diffusers_checkpoint
    ours = pretrained.load(folder, attention=attention)
    assert not ours.training
    x, t = _inputs()
    with torch.no_grad():
        expected, got = ref(x, t).sample, ours(x, t)
    assert expected.abs().max() > 0.5  # random weights give O(1) outputs: a wrong mapping cannot hide
    diff = (expected - got).abs().max().item()
    print(f"max |diffusers - ours| = {diff:.2e} ({attention})")
    assert diff < 1e-4


def test_legacy_attention_names_convert_to_the_same_weights(diffusers_checkpoint):
    ref, _ = diffusers_checkpoint
    sd = ref.state_dict()
    legacy = {k.replace(".to_q.", ".query.").replace(".to_k.", ".key.").replace(".to_v.", ".value.")
              .replace(".to_out.0.", ".proj_attn."): v for k, v in sd.items()}
    assert legacy.keys() != sd.keys()
    a, b = pretrained.convert(sd), pretrained.convert(legacy)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_left_over_tensors_and_other_architectures_are_refused(diffusers_checkpoint):
    ref, _ = diffusers_checkpoint
    sd = dict(ref.state_dict())
    sd["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="no place in our UNet: extra.weight"):
        pretrained.convert(sd)
    with pytest.raises(ValueError, match=r"not the paper's CIFAR-10 model \(block_out_channels"):
        pretrained.check_config({**pretrained.CONFIG, "block_out_channels": [128, 256, 512, 512]})
    with pytest.raises(ValueError, match="downsample_padding: 1"):  # the padding this issue was about
        pretrained.check_config({**pretrained.CONFIG, "downsample_padding": 1})


def test_the_converted_model_round_trips_through_our_checkpoint_format(diffusers_checkpoint, tmp_path):
    from ddpm_core.train import TrainConfig, build

    ref, folder = diffusers_checkpoint
    cfg = TrainConfig(model="ddpm-cifar10", device="cpu", out_dir=str(tmp_path / "run"), resume=False, progress=False)
    t = pretrained.trainer(cfg, folder)
    path = t.save_checkpoint(cfg.out_dir)
    del t
    fresh = build(cfg)
    fresh.load_checkpoint(path)
    x, steps = _inputs()
    with torch.no_grad():
        expected = ref(x, steps).sample
        for model in (fresh.model.eval(), fresh.ema.model):
            assert (model(x, steps) - expected).abs().max().item() < 1e-4


def test_load_without_weights_says_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPM_PRETRAINED_DIR", str(tmp_path / "nothing-here"))
    assert pretrained.default_dir() == tmp_path / "nothing-here" and not pretrained.available()
    with pytest.raises(FileNotFoundError, match=r"not in .*nothing-here\. Get them with `make weights`"):
        pretrained.load()


def test_without_network_the_download_fails_naming_the_problem_and_the_command(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    calls = []

    def offline(repo_id, **kw):
        calls.append((repo_id, kw.get("allow_patterns")))
        raise huggingface_hub.errors.LocalEntryNotFoundError("Cannot reach https://huggingface.co: offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(pretrained.PretrainedUnavailable) as err:
        pretrained.download(tmp_path / "w")
    message = str(err.value)
    assert "could not download google/ddpm-cifar10-32" in message and "no network access" in message
    assert "Fix: run `make weights` on a machine with internet access" in message
    assert calls == [("google/ddpm-cifar10-32", ["*.json", "*.safetensors"])]
    # the command behind `make weights` exits non-zero with the same message
    assert pretrained.main(["download", "--dir", str(tmp_path / "w")]) == 1
    assert "`make weights`" in capsys.readouterr().err


def test_the_module_imports_without_huggingface_hub_and_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed
    try:
        module = importlib.reload(pretrained)
        with pytest.raises(module.PretrainedUnavailable, match=r"needs huggingface_hub.*`pip install huggingface_hub`"):
            module.download(tmp_path)
    finally:
        monkeypatch.undo()
        importlib.reload(pretrained)


@pytest.mark.slow
def test_notebook_01_samples_the_paper_model_when_its_weights_are_present(diffusers_checkpoint, tmp_path, monkeypatch):
    """The weights-present path of notebook 01, run for real on a locally built checkpoint (tiny settings)."""
    from ddpm_core import series

    _, folder = diffusers_checkpoint
    monkeypatch.setenv("DDPM_PRETRAINED_DIR", str(folder))
    monkeypatch.setenv("DDPM_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("DDPM_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("DDPM_REFERENCE_DIR", str(tmp_path / "no-reference"))
    nb = next(p for p in series.list_notebooks() if p.name.startswith("01_"))
    run = series.run_notebook(nb, tmp_path / "out", smoke=True, figures=tmp_path / "figures",
                              parameters={"STEPS": 2, "DATASET": "synthetic", "PRETRAINED_SAMPLES": 2,
                                          "PRETRAINED_STEPS": 3})
    cells = json.loads(run.executed.read_text())["cells"]
    samples = next(c for c in cells if "samples" in c["metadata"].get("tags", []))
    text = json.dumps(samples["outputs"])
    assert "2 samples of the paper's model, trained on CIFAR-10 by Ho et al. (weights google/ddpm-cifar10-32)" in text
    assert "3 sampling steps (strided)" in text and "make weights" not in text
    for fig in ("01_samples.png", "01_reverse_process.png"):
        assert (tmp_path / "figures" / fig).stat().st_size > 5000
