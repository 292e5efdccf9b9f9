"""Helpers shared by the tests."""

from __future__ import annotations


def tiny_config(tmp_path, **kw):
    from ddpm_core.train import TrainConfig

    base = dict(model="tiny", device="cpu", dataset="synthetic", synthetic_size=256, batch_size=8,
                lr=1e-3, warmup_steps=0, ema_decay=0.99, steps=10, out_dir=str(tmp_path / "run"),
                checkpoint_every=5, log_every=1, progress=False)
    base.update(kw)
    return TrainConfig(**base)
