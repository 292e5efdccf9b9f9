"""The paper's CIFAR-10 weights on ``preset("ddpm-cifar10")``, from the checkpoint diffusers publishes.

    make weights                                  # = python -m ddpm_core.pretrained download (143 MB, needs internet)

    from ddpm_core import pretrained
    if pretrained.available():
        model = pretrained.load()                 # a UNet in eval mode holding the paper's weights

What is loaded: ``google/ddpm-cifar10-32`` on the Hugging Face Hub, the official TensorFlow
CIFAR-10 checkpoint of Ho et al. 2020 converted by the diffusers project into its ``UNet2DModel``
layout (``config.json`` + ``diffusion_pytorch_model.safetensors``). ``convert`` renames its
tensors onto ours and fuses the separate q, k, v projections into our one 1x1 conv. The files go
to ``data/pretrained/ddpm-cifar10-32/`` (git-ignored; ``$DDPM_PRETRAINED_DIR`` overrides it) and
are downloaded only when asked, through ``huggingface_hub`` (imported then, so this module imports
without it).

How it is tested (``tests/test_pretrained.py``, offline): diffusers' ``UNet2DModel`` is built with
the published configuration below and random weights, saved with ``save_pretrained``, loaded
here, and both models must agree to 1e-4 (fp32, CPU) on the same x and t; the converted model
also round-trips through our training checkpoints. The download is tested with the Hub blocked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from .model import UNet, preset
from .paths import data_dir

REPO_ID = "google/ddpm-cifar10-32"
PRESET = "ddpm-cifar10"
WEIGHTS_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")  # preferred first
# The published config.json of google/ddpm-cifar10-32 (diffusers' UNet2DModel arguments). Checked
# against copies of it in public code; the Hub itself is not reachable from where the tests run.
CONFIG: dict[str, Any] = {
    "sample_size": 32, "in_channels": 3, "out_channels": 3, "center_input_sample": False,
    "time_embedding_type": "positional", "flip_sin_to_cos": False, "freq_shift": 1,
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"],
    "block_out_channels": [128, 256, 256, 256], "layers_per_block": 2, "mid_block_scale_factor": 1,
    "downsample_padding": 0, "act_fn": "silu", "attention_head_dim": None, "norm_num_groups": 32,
    "norm_eps": 1e-06,
}
# What has to match for ``convert`` to be exact: the rest (dropout, versions) does not change outputs.
_ARCH_DEFAULTS = {"resnet_time_scale_shift": "default", "mid_block_type": "UNetMidBlock2D",
                  "downsample_type": "conv", "upsample_type": "conv", "class_embed_type": None,
                  "add_attention": True}
# Old diffusers checkpoints name the attention projections differently (diffusers renames them on load too).
_LEGACY_ATTENTION = {".query.": ".to_q.", ".key.": ".to_k.", ".value.": ".to_v.", ".proj_attn.": ".to_out.0."}


class PretrainedUnavailable(RuntimeError):
    """The paper's weights are not on this machine and cannot be downloaded here."""


def default_dir() -> Path:
    """Where the weights live: ``$DDPM_PRETRAINED_DIR`` if set, else ``<data dir>/pretrained/ddpm-cifar10-32``."""
    return Path(os.environ.get("DDPM_PRETRAINED_DIR") or data_dir() / "pretrained" / "ddpm-cifar10-32")


def how_to_get(path: Path | None = None) -> str:
    """One paragraph: where the weights are expected and the exact command that fetches them."""
    path = Path(path) if path is not None else default_dir()
    return (f"The paper's CIFAR-10 weights ({REPO_ID}, 143 MB) are not in {path}. Get them with `make weights` "
            f"(= `python -m ddpm_core.pretrained download`; needs internet access to the Hugging Face Hub), or "
            f"copy that folder from a machine that has them, or point DDPM_PRETRAINED_DIR at one.")


def _files(path: Path) -> tuple[Path, Path] | None:
    """(config.json, weights file) in ``path`` or in its ``unet/`` subfolder (a pipeline's layout)."""
    for folder in (path, path / "unet"):
        config = folder / "config.json"
        weights = next((folder / w for w in WEIGHTS_FILES if (folder / w).is_file()), None)
        if config.is_file() and weights is not None:
            return config, weights
    return None


def available(path: str | os.PathLike | None = None) -> bool:
    """Whether the weights (config.json and a weights file) are in ``path`` (default: ``default_dir()``)."""
    return _files(Path(path) if path is not None else default_dir()) is not None


def download(path: str | os.PathLike | None = None) -> Path:
    """Fetch ``google/ddpm-cifar10-32`` into ``path`` (default: ``default_dir()``) with huggingface_hub.

    Only the config files and the safetensors weights are fetched (the legacy .bin only if the
    repository has no safetensors file). Raises ``PretrainedUnavailable`` naming the cause and the
    fix when huggingface_hub is missing or the Hub cannot be reached.
    """
    path = Path(path) if path is not None else default_dir()
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise PretrainedUnavailable(
            f"downloading {REPO_ID} needs huggingface_hub, which is not installed ({e}). "
            f"Fix: `pip install huggingface_hub` (or `make setup`), then `make weights`.") from e
    path.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(REPO_ID, local_dir=str(path), allow_patterns=["*.json", "*.safetensors"])
        if not available(path):
            snapshot_download(REPO_ID, local_dir=str(path), allow_patterns=["*.json", "*.bin"])
    except Exception as e:  # noqa: BLE001 - connection, DNS, proxy, offline mode, HTTP: all mean the same here
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") else ""
        raise PretrainedUnavailable(
            f"could not download {REPO_ID} from the Hugging Face Hub into {path}: {type(e).__name__}: "
            f"{str(e).rstrip('. ')}. This machine seems to have no network access to huggingface.co{offline}. "
            f"Fix: run `make weights` on a "
            f"machine with internet access and copy its data/pretrained/ddpm-cifar10-32/ folder to {path} "
            f"(or point DDPM_PRETRAINED_DIR at it).") from e
    if not available(path):
        raise PretrainedUnavailable(f"{REPO_ID} was downloaded into {path} but holds no config.json with "
                                    f"{' or '.join(WEIGHTS_FILES)}; the repository layout may have changed.")
    return path


def check_config(config: dict[str, Any]) -> None:
    """Raise a ValueError if a diffusers UNet2DModel config is not the architecture of ``preset("ddpm-cifar10")``."""
    wrong = {k: (config.get(k), v) for k, v in CONFIG.items()
             if k not in ("center_input_sample",) and config.get(k, v) != v}
    wrong |= {k: (config[k], v) for k, v in _ARCH_DEFAULTS.items() if k in config and config[k] != v}
    if config.get("center_input_sample"):
        wrong["center_input_sample"] = (True, False)
    if wrong:
        desc = ", ".join(f"{k}: {a!r} (expected {b!r})" for k, (a, b) in wrong.items())
        raise ValueError(f"this diffusers checkpoint is not the paper's CIFAR-10 model ({desc}); "
                         f"ddpm_core.pretrained maps only {REPO_ID}.")


def convert(state_dict: dict[str, torch.Tensor], config: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """A diffusers ``UNet2DModel`` state dict of the paper's model, as a state dict of our ``UNet``.

    Renames block by block in the order both models run them (down path with a downsampler per
    level but the last, middle, up path with one block more per level), and concatenates the
    attention's q, k, v Linear weights (C x C each) into our fused 1x1 conv (3C x C x 1 x 1).
    Raises a ValueError listing any tensor left over.
    """
    config = {**CONFIG, **(config or {})}
    sd = {}
    for key, value in state_dict.items():
        for old, new in _LEGACY_ATTENTION.items():
            key = key.replace(old, new)
        sd[key] = value
    out: dict[str, torch.Tensor] = {}

    def move(src: str, dst: str) -> None:
        for p in ("weight", "bias"):
            out[f"{dst}.{p}"] = sd.pop(f"{src}.{p}")

    def resblock(src: str, dst: str) -> None:
        for a, b in (("norm1", "norm1"), ("conv1", "conv1"), ("time_emb_proj", "temb_proj"),
                     ("norm2", "norm2"), ("conv2", "conv2"), ("conv_shortcut", "skip")):
            if f"{src}.{a}.weight" in sd:
                move(f"{src}.{a}", f"{dst}.{b}")

    def attention(src: str, dst: str) -> bool:
        if f"{src}.to_q.weight" not in sd:
            return False
        move(f"{src}.group_norm", f"{dst}.norm")
        for p in ("weight", "bias"):
            qkv = torch.cat([sd.pop(f"{src}.to_{n}.{p}") for n in "qkv"], dim=0)
            out[f"{dst}.qkv.{p}"] = qkv[:, :, None, None] if p == "weight" else qkv
        out[f"{dst}.proj_out.weight"] = sd.pop(f"{src}.to_out.0.weight")[:, :, None, None]
        out[f"{dst}.proj_out.bias"] = sd.pop(f"{src}.to_out.0.bias")
        return True

    move("time_embedding.linear_1", "temb.0")
    move("time_embedding.linear_2", "temb.2")
    move("conv_in", "conv_in")
    levels, per_level = len(config["block_out_channels"]), config["layers_per_block"]
    i = 0
    for level in range(levels):
        for j in range(per_level):
            resblock(f"down_blocks.{level}.resnets.{j}", f"down.{i}.0")
            attention(f"down_blocks.{level}.attentions.{j}", f"down.{i}.1")
            i += 1
        if level != levels - 1:
            move(f"down_blocks.{level}.downsamplers.0.conv", f"down.{i}.0.conv")
            i += 1
    resblock("mid_block.resnets.0", "mid.0")
    attention("mid_block.attentions.0", "mid.1")
    resblock("mid_block.resnets.1", "mid.2")
    i = 0
    for level in range(levels):  # diffusers' up_blocks[0] is the lowest resolution, as our self.up starts
        for j in range(per_level + 1):
            resblock(f"up_blocks.{level}.resnets.{j}", f"up.{i}.0")
            attention(f"up_blocks.{level}.attentions.{j}", f"up.{i}.1")
            i += 1
        if level != levels - 1:
            move(f"up_blocks.{level}.upsamplers.0.conv", f"up.{i}.0.conv")
            i += 1
    move("conv_norm_out", "norm_out")
    move("conv_out", "conv_out")
    if sd:
        raise ValueError(f"{len(sd)} tensors of the diffusers checkpoint have no place in our UNet: "
                         f"{', '.join(sorted(sd)[:8])}{' ...' if len(sd) > 8 else ''}")
    return out


def read_state_dict(weights: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a diffusers weights file (.safetensors, or the legacy pickled .bin)."""
    weights = Path(weights)
    if weights.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise PretrainedUnavailable(f"reading {weights} needs safetensors ({e}). Fix: `pip install safetensors` "
                                        f"(or `make setup`).") from e
        return load_file(str(weights), device="cpu")
    return torch.load(weights, map_location="cpu", weights_only=True)


def load(path: str | os.PathLike | None = None, *, device: torch.device | str = "cpu",
         attention: str = "math", **overrides: Any) -> UNet:
    """``preset("ddpm-cifar10")`` holding the paper's CIFAR-10 weights, in eval mode.

    ``path``: a folder with diffusers' ``config.json`` and weights (default: ``default_dir()``).
    Raises ``FileNotFoundError`` saying how to get them when they are absent.
    """
    path = Path(path) if path is not None else default_dir()
    found = _files(path)
    if found is None:
        raise FileNotFoundError(how_to_get(path))
    config_path, weights = found
    config = json.loads(config_path.read_text())
    check_config(config)
    model = preset(PRESET, attention=attention, **overrides)
    model.load_state_dict(convert(read_state_dict(weights), config))
    return model.to(device).eval()


def trainer(cfg=None, path: str | os.PathLike | None = None):
    """A ``Trainer`` for ``cfg`` (default: the paper's settings, on the CPU) whose model and EMA hold the paper's weights.

    Its ``save_checkpoint`` writes the weights in our checkpoint format; ``sample`` samples them.
    """
    from .train import TrainConfig, build

    cfg = cfg if cfg is not None else TrainConfig(model=PRESET, device="cpu", resume=False)
    if cfg.model != PRESET:
        raise ValueError(f"the paper's weights fit model={PRESET!r}, not {cfg.model!r}")
    t = build(cfg)
    weights = load(path).state_dict()
    t.model.load_state_dict(weights)
    if t.ema is not None:
        t.ema.load_state_dict(weights)
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpm_core.pretrained", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download", help=f"download {REPO_ID} into data/pretrained/ (needs internet)")
    d.add_argument("--dir", default=None, help="target folder (default: $DDPM_PRETRAINED_DIR or data/pretrained/ddpm-cifar10-32)")
    sub.add_parser("where", help="print where the weights are expected and whether they are there")
    args = p.parse_args(argv)
    if args.cmd == "where":
        print(f"{default_dir()}: {'present' if available() else 'absent'}")
        return 0
    target = Path(args.dir) if args.dir else default_dir()
    if available(target):
        print(f"{REPO_ID} is already in {target}")
        return 0
    try:
        out = download(target)
    except PretrainedUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"downloaded {REPO_ID} into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
