import math

import pytest
import torch

from ddpm_core.diffusion import GaussianDiffusion
from ddpm_core.model import preset


def test_alphas_cumprod_matches_the_closed_form():
    d = GaussianDiffusion(1000, 1e-4, 0.02)
    betas = [1e-4 + (0.02 - 1e-4) * i / 999 for i in range(1000)]
    prod, expected = 1.0, []
    for b in betas:
        prod *= 1.0 - b
        expected.append(prod)
    expected = torch.tensor(expected, dtype=torch.float32)
    assert torch.allclose(d.betas, torch.tensor(betas, dtype=torch.float32), rtol=1e-6, atol=0)
    assert torch.allclose(d.alphas_cumprod, expected, rtol=1e-5, atol=1e-9)
    assert d.alphas_cumprod[-1].item() == pytest.approx(4.04e-5, rel=0.02)  # nearly pure noise at T
    # posterior variance beta_tilde_t = beta_t (1 - a_bar_{t-1}) / (1 - a_bar_t)
    t = 500
    bt = betas[t] * (1 - expected[t - 1].item()) / (1 - expected[t].item())
    assert d.posterior_variance[t].item() == pytest.approx(bt, rel=1e-5)
    assert set(dict(d.named_buffers())) >= {"betas", "alphas_cumprod", "posterior_variance",
                                            "posterior_mean_coef1", "posterior_mean_coef2"}


@pytest.mark.parametrize("t", [0, 100, 500, 999])
def test_q_sample_has_the_right_mean_and_variance(t):
    d = GaussianDiffusion()
    torch.manual_seed(0)
    x0 = torch.full((200_000, 1, 1, 1), 0.7)
    xt = d.q_sample(x0, torch.full((x0.shape[0],), t, dtype=torch.long))
    a_bar = d.alphas_cumprod[t].item()
    assert xt.mean().item() == pytest.approx(math.sqrt(a_bar) * 0.7, abs=0.01)
    assert xt.var().item() == pytest.approx(1 - a_bar, abs=0.01 + 0.01 * (1 - a_bar))


def test_loss_of_an_untrained_model_is_the_noise_variance():
    d = GaussianDiffusion()
    torch.manual_seed(0)
    loss = d.loss(preset("tiny"), torch.rand(32, 3, 32, 32) * 2 - 1)
    assert loss.item() == pytest.approx(1.0, abs=0.05)  # eps_theta = 0 at init, E[eps^2] = 1


def test_sampling_full_and_strided_gives_images_in_range_and_a_trajectory():
    d = GaussianDiffusion(timesteps=50)
    model = preset("tiny").eval()
    x = d.sample(model, 2, steps=None, progress=False)
    assert x.shape == (2, 3, 32, 32) and x.min() >= -1 and x.max() <= 1
    x, traj = d.sample(model, 2, steps=10, progress=False, return_trajectory=True,
                       generator=torch.Generator().manual_seed(0))
    ts = [t for t, _ in traj]
    assert ts[0] == 49 and ts[-1] == 0 and ts == sorted(ts, reverse=True)
    again = d.sample(model, 2, steps=10, progress=False, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, again)
    with pytest.raises(ValueError, match="steps must be in 1..50"):
        d.sample(model, 1, steps=51, progress=False)


def test_strided_schedule_with_all_steps_is_the_original_chain():
    d = GaussianDiffusion(timesteps=100)
    taus, c = d._strided_schedule(100)
    assert torch.equal(taus, torch.arange(100))
    assert torch.allclose(c["betas"], d.betas, rtol=1e-5)
    assert torch.allclose(c["post_var"], d.posterior_variance, rtol=1e-4, atol=1e-10)


def test_bad_schedule_is_rejected():
    with pytest.raises(ValueError, match="beta_start"):
        GaussianDiffusion(beta_start=0.1, beta_end=0.01)
