"""The DDPM UNet of Ho et al. 2020 (CIFAR-10 configuration), in plain PyTorch.

What it matches: the paper's official TensorFlow code, ``diffusion_tf/models/unet.py`` and
``diffusion_tf/nn.py`` of github.com/hojonathanho/diffusion, function for function: a
Wide-ResNet style UNet with GroupNorm(32, eps 1e-6), SiLU ("swish"), dropout, the sinusoidal
timestep embedding (sin half then cos half, frequencies 10000^(-i/(half-1))) injected into every
residual block, single-head self-attention at 16x16, stride-2 downsampling with TensorFlow's
``padding='SAME'`` (0 pixels before, 1 after, for even sizes), and the official initialization
(Xavier-uniform, zero biases, near-zero last layers). ``preset("ddpm-cifar10")`` is the paper's
35.7M-parameter model (35,746,307 parameters, exactly the official count).

How that is tested (``tests/test_pretrained.py``, ``tests/test_model.py``): diffusers'
``UNet2DModel``, built with the published configuration of the paper's converted CIFAR-10
checkpoint (``google/ddpm-cifar10-32``, converted from the official TF weights by diffusers), is
filled with random weights, mapped onto ``preset("ddpm-cifar10")`` by ``ddpm_core.pretrained``,
and both must give the same output on the same x and t to 1e-4 (fp32, CPU). The downsampling is
checked against an explicit asymmetric pad followed by a padding-free convolution, and the
initialization statistics against the Xavier-uniform values.

Every optimization the series teaches is a switch on this one code path:
``attention="math" | "sdpa"`` picks the slow reference attention or PyTorch's fused
``scaled_dot_product_attention``; the same weights give the same outputs either way.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_CHOICES = ("math", "sdpa")
NORM_CHOICES = ("group", "group16", "none")


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of integer timesteps (Transformer-style, as in the DDPM code).

    emb[:, i] = sin(t * f_i) for the first half and cos(t * f_i) for the second half,
    with f_i = max_period ** (-i / (half - 1)).
    """
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / (half - 1)
    )
    args = t.float()[:, None] * freqs[None, :]
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


def _norm(kind: str, channels: int, groups: int) -> nn.Module:
    if kind == "none":
        return nn.Identity()
    if channels % groups:
        raise ValueError(
            f"GroupNorm needs channels divisible by groups, got {channels} channels and "
            f"{groups} groups; choose base_channels/channel_mult so every width is a multiple of "
            f"norm_groups, or lower norm_groups."
        )
    return (GroupNorm16 if kind == "group16" else nn.GroupNorm)(groups, channels, eps=1e-6)


class GroupNorm16(nn.GroupNorm):
    """``nn.GroupNorm`` that runs in autocast's 16-bit type (bf16, or fp16) where autocast is on.

    On CUDA, autocast runs ``group_norm`` in fp32 whatever its input (it is on autocast's fp32 list): its output, the
    SiLU after it and what both save for backward are fp32, although the convolution that follows casts its input to
    16 bits anyway. This module casts the input, weight and bias to the autocast type and runs ``F.group_norm`` with
    autocast off. The statistics still accumulate in fp32 (CUDA's and the CPU's kernels accumulate in fp32 for 16-bit
    inputs); what changes is that the output is rounded to 16 bits one SiLU earlier than the convolution would round it.
    On a CPU, autocast already runs ``group_norm`` in its input's type, so there the two are the same step.

    Outside autocast it is ``nn.GroupNorm``: the same parameters, the same ``state_dict``, the same output.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            return super().forward(x)
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return F.group_norm(x.to(dtype), self.num_groups, self.weight.to(dtype), self.bias.to(dtype), self.eps)


class ResBlock(nn.Module):
    """GroupNorm -> SiLU -> conv3x3 (+ timestep projection) -> GroupNorm -> SiLU -> dropout -> conv3x3."""

    def __init__(self, in_ch: int, out_ch: int, temb_ch: int, dropout: float, norm: str, groups: int):
        super().__init__()
        self.norm1 = _norm(norm, in_ch, groups)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.temb_proj = nn.Linear(temb_ch, out_ch)
        self.norm2 = _norm(norm, out_ch, groups)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        # The reference code uses a 1x1 "NIN" projection on the skip path when widths differ.
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.skip(x) + h


class AttnBlock(nn.Module):
    """Self-attention over the H*W positions of a feature map, with a residual connection.

    ``attention="math"`` materializes the (HW x HW) score matrix softmax(QK^T / sqrt(d)) and
    multiplies it by V, exactly as the paper's code does. ``attention="sdpa"`` calls
    ``F.scaled_dot_product_attention``, which may dispatch to flash / memory-efficient / cuDNN
    kernels that never store the score matrix. Both compute the same function.
    """

    def __init__(self, channels: int, attention: str, norm: str, groups: int, heads: int = 1):
        super().__init__()
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
        if channels % heads:
            raise ValueError(f"attention heads ({heads}) must divide the channels ({channels})")
        self.attention = attention
        self.heads = heads
        self.norm = _norm(norm, channels, groups)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)  # the three 1x1 NIN projections, fused
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, hgt, wid = x.shape
        q, k, v = self.qkv_tokens(x)  # each B x heads x N x d, last dim contiguous
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)  # B x heads x N x N
            out = torch.matmul(scores.softmax(dim=-1), v)
        out = out.permute(0, 1, 3, 2).reshape(b, c, hgt, wid)  # B x heads x d x N -> B x C x H x W
        # That view is strided like channels_last. Copy it to x's layout, or proj_out would run (and
        # write its weight gradient) in the other one: a layout switch per block, and DDP's
        # "grad strides do not match bucket view strides" copy.
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        out = out.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        return x + self.proj_out(out)

    def qkv_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of shape B x heads x N x d, each with a contiguous last dimension.

        The fused kernels of ``scaled_dot_product_attention`` (flash, memory-efficient, cuDNN) need
        the head dimension contiguous (stride 1). The 1x1 conv writes channels first (B x 3C x H x W,
        so d has stride N): slicing q, k, v out of it and transposing would hand SDPA views that
        every fused kernel refuses, and the dispatcher would silently fall back to the math kernel.
        One transpose-copy to token-major B x N x 3C fixes the layout for all three at once.
        """
        b, c, hgt, wid = x.shape
        n, d = hgt * wid, c // self.heads
        qkv = self.qkv(self.norm(x)).reshape(b, 3 * c, n).transpose(1, 2).contiguous()  # B x N x 3C
        qkv = qkv.reshape(b, n, 3, self.heads, d).permute(2, 0, 3, 1, 4)  # 3 x B x heads x N x d
        return qkv[0], qkv[1], qkv[2]


def same_padding(size: int, kernel: int = 3, stride: int = 2) -> tuple[int, int]:
    """(before, after) padding of TensorFlow's ``padding='SAME'`` along one axis of ``size`` pixels.

    TensorFlow pads ``max((ceil(size/stride) - 1) * stride + kernel - size, 0)`` pixels in all and
    puts the odd one after: for a 3x3 stride-2 conv on an even size that is 0 before and 1 after,
    where ``Conv2d(padding=1)`` would pad 1 on both sides and read a shifted window.
    """
    total = max((-(-size // stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class Downsample(nn.Module):
    """3x3 convolution with stride 2 (halves H and W), padded as the official code pads it.

    The official ``conv2d(stride=2, padding='SAME')`` pads 0 pixels at the top and left and 1 at
    the bottom and right of an even-sized map (``same_padding``). PyTorch's ``Conv2d`` only pads
    symmetrically, so the pad is an explicit ``F.pad`` before a padding-free convolution: one
    extra (cheap, FLOP-free) op in every training step, visible in the profiles of notebook 02.
    """

    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, bottom = same_padding(x.shape[-2])
        left, right = same_padding(x.shape[-1])
        return self.conv(F.pad(x, (left, right, top, bottom)))


class Upsample(nn.Module):
    """Nearest-neighbour 2x upsampling followed by a 3x3 convolution."""

    def __init__(self, ch: int):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class UNet(nn.Module):
    """The DDPM noise-prediction network eps_theta(x_t, t).

    Args:
        image_size: input height and width (32 for CIFAR-10).
        in_channels / out_channels: image channels.
        base_channels: width of the first level (128 in the paper).
        channel_mult: width multiplier per resolution level ((1, 2, 2, 2) in the paper).
        num_res_blocks: residual blocks per level on the way down (the way up has one more).
        attn_resolutions: feature-map sizes that get a self-attention block ((16,) in the paper).
        dropout: dropout inside residual blocks (0.1 for CIFAR-10).
        attention: "math" (explicit softmax(QK^T/sqrt(d))V) or "sdpa".
        norm: "group" (GroupNorm, as in the paper), "group16" (the same GroupNorm run in 16 bits under autocast:
            ``GroupNorm16``) or "none" (for the normalization ablation).
        norm_groups: GroupNorm groups (32).
        attn_heads: attention heads (1 in the paper).

    Attributes:
        activation_checkpointing: recompute each block's insides in backward instead of keeping them (set by
            ``TrainConfig(activation_checkpointing=True)``).
        checkpoint_blocks: the kinds of block activation checkpointing applies to, ``(ResBlock, AttnBlock)`` by
            default; ``(AttnBlock,)`` checkpoints the attention blocks only.
    """

    def __init__(
        self,
        *,
        image_size: int = 32,
        in_channels: int = 3,
        out_channels: int = 3,
        base_channels: int = 128,
        channel_mult: Sequence[int] = (1, 2, 2, 2),
        num_res_blocks: int = 2,
        attn_resolutions: Sequence[int] = (16,),
        dropout: float = 0.1,
        attention: str = "math",
        norm: str = "group",
        norm_groups: int = 32,
        attn_heads: int = 1,
    ):
        super().__init__()
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
        if norm not in NORM_CHOICES:
            raise ValueError(f"norm must be one of {NORM_CHOICES}, got {norm!r}")
        if image_size % (2 ** (len(channel_mult) - 1)):
            raise ValueError(
                f"image_size {image_size} must be divisible by 2**{len(channel_mult) - 1} "
                f"for {len(channel_mult)} resolution levels"
            )
        self.config: dict[str, Any] = dict(
            image_size=image_size, in_channels=in_channels, out_channels=out_channels,
            base_channels=base_channels, channel_mult=tuple(channel_mult),
            num_res_blocks=num_res_blocks, attn_resolutions=tuple(attn_resolutions),
            dropout=dropout, attention=attention, norm=norm, norm_groups=norm_groups,
            attn_heads=attn_heads,
        )
        ch, temb_ch = base_channels, base_channels * 4
        self.base_channels = ch
        self.temb = nn.Sequential(nn.Linear(ch, temb_ch), nn.SiLU(), nn.Linear(temb_ch, temb_ch))
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)

        def block(i: int, o: int) -> ResBlock:
            return ResBlock(i, o, temb_ch, dropout, norm, norm_groups)

        def attn(c: int) -> AttnBlock:
            return AttnBlock(c, attention, norm, norm_groups, attn_heads)

        # Down path: remember the width of every feature map pushed onto the skip stack.
        self.down = nn.ModuleList()
        skip_chs, cur, res = [ch], ch, image_size
        for level, mult in enumerate(channel_mult):
            out = ch * mult
            for _ in range(num_res_blocks):
                layers = nn.ModuleList([block(cur, out)])
                if res in attn_resolutions:
                    layers.append(attn(out))
                self.down.append(layers)
                cur = out
                skip_chs.append(cur)
            if level != len(channel_mult) - 1:
                self.down.append(nn.ModuleList([Downsample(cur)]))
                res //= 2
                skip_chs.append(cur)

        self.mid = nn.ModuleList([block(cur, cur), attn(cur), block(cur, cur)])

        # Up path: num_res_blocks + 1 blocks per level, each consuming one skip connection.
        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(channel_mult))):
            out = ch * mult
            for _ in range(num_res_blocks + 1):
                layers = nn.ModuleList([block(cur + skip_chs.pop(), out)])
                if res in attn_resolutions:
                    layers.append(attn(out))
                self.up.append(layers)
                cur = out
            if level != 0:
                self.up.append(nn.ModuleList([Upsample(cur)]))
                res *= 2

        self.norm_out = _norm(norm, cur, norm_groups)
        self.conv_out = nn.Conv2d(cur, out_channels, 3, padding=1)
        self._init_weights()

    def _init_weights(self) -> None:
        """The official initialization (``diffusion_tf/nn.py``: ``default_init(scale)``).

        Every conv and dense weight is ``variance_scaling(scale, 'fan_avg', 'uniform')``, i.e.
        Xavier-uniform with gain sqrt(scale), and every bias is zero. Scale is 1, except for the
        last conv of each residual branch, the attention output projection and the output conv,
        where the official code asks for 0 and gets 1e-10 (``default_init`` replaces 0 by 1e-10):
        each block starts as (nearly) the identity and the untrained model predicts eps ~ 0, so the
        initial loss is E[eps^2] = 1. The fused q/k/v projection is initialized as three separate
        C x C layers, as the official code has them. GroupNorm starts at weight 1, bias 0.
        """
        def xavier(weight: torch.Tensor, scale: float = 1.0) -> None:
            nn.init.xavier_uniform_(weight, gain=math.sqrt(scale))

        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                xavier(m.weight)
                nn.init.zeros_(m.bias)
        near_zero = 1e-10
        for m in self.modules():
            if isinstance(m, ResBlock):
                xavier(m.conv2.weight, near_zero)
            elif isinstance(m, AttnBlock):
                c = m.proj_out.weight.shape[0]
                for i in range(3):  # q, k, v: three C x C layers in the official code
                    xavier(m.qkv.weight[i * c:(i + 1) * c])
                xavier(m.proj_out.weight, near_zero)
        xavier(self.conv_out.weight, near_zero)

    def set_attention(self, attention: str) -> None:
        """Switch every attention block between "math" and "sdpa" (weights are untouched)."""
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
        for m in self.modules():
            if isinstance(m, AttnBlock):
                m.attention = attention
        self.config["attention"] = attention

    # Activation checkpointing (``TrainConfig(activation_checkpointing=True)``): each residual and
    # attention block keeps only its inputs for backward and recomputes its insides there
    # (torch.utils.checkpoint, non-reentrant; the dropout masks are replayed exactly).
    activation_checkpointing: bool = False
    # The kinds of block that activation checkpointing applies to: set it to (AttnBlock,) to checkpoint only the
    # attention blocks (03b, Exercise 2).
    checkpoint_blocks: tuple[type[nn.Module], ...] = (ResBlock, AttnBlock)

    def _block(self, module: nn.Module, *args: torch.Tensor) -> torch.Tensor:
        if (self.activation_checkpointing and self.training and torch.is_grad_enabled()
                and isinstance(module, self.checkpoint_blocks)):
            from torch.utils.checkpoint import checkpoint

            return checkpoint(module, *args, use_reentrant=False)
        return module(*args)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Predict the noise in ``x`` (B x C x H x W) at integer timesteps ``t`` (B,)."""
        if t.ndim == 0:
            t = t.expand(x.shape[0])
        temb = self.temb(timestep_embedding(t, self.base_channels))
        h = self.conv_in(x)
        hs = [h]
        block = self._block
        for layers in self.down:
            if isinstance(layers[0], Downsample):
                h = layers[0](h)
            else:
                h = block(layers[0], h, temb)
                if len(layers) > 1:
                    h = block(layers[1], h)
            hs.append(h)
        h = block(self.mid[0], h, temb)
        h = block(self.mid[1], h)
        h = block(self.mid[2], h, temb)
        for layers in self.up:
            if isinstance(layers[0], Upsample):
                h = layers[0](h)
            else:
                h = block(layers[0], torch.cat([h, hs.pop()], dim=1), temb)
                if len(layers) > 1:
                    h = block(layers[1], h)
        return self.conv_out(F.silu(self.norm_out(h)))


PRESETS: dict[str, dict[str, Any]] = {
    # Ho et al. 2020, Appendix B: the CIFAR-10 model (35.7M parameters).
    "ddpm-cifar10": dict(
        base_channels=128, channel_mult=(1, 2, 2, 2), num_res_blocks=2,
        attn_resolutions=(16,), dropout=0.1,
    ),
    # Same architecture, shrunk for CPU smoke runs: still GroupNorm(32), still attention at 16x16.
    "tiny": dict(
        base_channels=32, channel_mult=(1, 2, 2), num_res_blocks=1,
        attn_resolutions=(16,), dropout=0.1,
    ),
}


def preset(name: str, **overrides: Any) -> UNet:
    """Build a UNet from a named preset ("ddpm-cifar10" or "tiny"); keyword overrides win."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return UNet(**{**PRESETS[name], **overrides})


def register_preset(name: str, base: str = "ddpm-cifar10", **overrides: Any) -> str:
    """Add a named preset: `base`'s settings with `overrides` (any `UNet` keyword) on top; returns `name`.

    Afterwards `preset(name)` builds it and `TrainConfig(model=name)` accepts it, in this process (a new
    process, such as a `torchrun` worker or a resumed run, registers it again before using it). Registering
    the same settings under the same name again does nothing, so a notebook cell that does it can be rerun;
    other settings under a name already taken are refused. The settings are checked by building the model
    once, so a wrong one fails here, with its reason, rather than in the first training step."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a preset needs a non-empty name, got {name!r}")
    if base not in PRESETS:
        raise ValueError(f"unknown base preset {base!r}; choose one of {sorted(PRESETS)}")
    defaults = {k: p.default for k, p in inspect.signature(UNet.__init__).parameters.items() if k != "self"}
    accepted = list(defaults)
    unknown = sorted(set(overrides) - set(accepted))
    if unknown:
        raise TypeError(f"register_preset({name!r}): {', '.join(unknown)} is not a UNet setting; "
                        f"the settings are {', '.join(accepted)}")
    settings = {**PRESETS[base], **overrides}
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
    if name in PRESETS:
        if PRESETS[name] == settings:
            return name
        raise ValueError(f"preset {name!r} already exists with other settings ({PRESETS[name]}); "
                         "register these under another name")
    full = {**defaults, **settings}  # what UNet will build: its own defaults under the preset's settings
    resolutions = [full["image_size"] // 2**i for i in range(len(full["channel_mult"]))]
    missing = sorted(set(full["attn_resolutions"]) - set(resolutions))
    if missing:
        raise ValueError(f"register_preset({name!r}): attn_resolutions {missing} match no level of this UNet; "
                         f"its feature maps are {resolutions} pixels wide")
    with torch.device("meta"):
        UNet(**settings)  # raises on a setting UNet refuses; on the meta device nothing is allocated
    PRESETS[name] = settings
    return name


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def layer_table(model: UNet, image_size: int | None = None):
    """One row per block of the UNet: stage, block types, output shape, parameters.

    Runs one forward pass of a single image to read the output shapes.
    """
    import pandas as pd

    size = image_size or model.config["image_size"]
    rows, hooks = [], []

    def record(stage: str, module: nn.Module):
        def hook(_m, _inp, out):
            rows.append({"stage": stage, "block": " + ".join(type(m).__name__ for m in module) if isinstance(module, nn.ModuleList) else type(module).__name__,
                         "output": "x".join(map(str, out.shape[1:])), "params": count_parameters(module)})
        return hook

    named = [("time embedding", model.temb), ("input conv", model.conv_in)]
    named += [(f"down {i}", layers) for i, layers in enumerate(model.down)]
    named += [("middle", model.mid[0]), ("middle", model.mid[1]), ("middle", model.mid[2])]
    named += [(f"up {i}", layers) for i, layers in enumerate(model.up)]
    named += [("output norm + conv", model.conv_out)]
    for stage, module in named:
        target = module[-1] if isinstance(module, nn.ModuleList) else module  # output of the last layer
        hooks.append(target.register_forward_hook(record(stage, module)))
    try:
        with torch.no_grad():
            model(torch.zeros(1, model.config["in_channels"], size, size, device=next(model.parameters()).device),
                  torch.zeros(1, dtype=torch.long, device=next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    df = pd.DataFrame(rows)
    df.loc[df["stage"] == "output norm + conv", "params"] = count_parameters(model.conv_out) + count_parameters(model.norm_out)
    return df
