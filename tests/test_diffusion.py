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
    assert ts[0] == 50 and ts[-1] == 0 and ts == sorted(ts, reverse=True)  # x_T, the starting noise, first; x_0 last
    assert torch.equal(traj[-1][1], x)  # the last snapshot is the sample itself
    again = d.sample(model, 2, steps=10, progress=False, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, again)
    with pytest.raises(ValueError, match="steps must be in 1..50"):
        d.sample(model, 1, steps=51, progress=False)


def test_strided_schedule_with_all_steps_is_the_original_chain():
    d = GaussianDiffusion(timesteps=100)
    taus, c = d.strided_schedule(100)
    assert torch.equal(taus, torch.arange(100))
    assert torch.allclose(c["betas"], d.betas, rtol=1e-5)
    assert torch.allclose(c["post_var"], d.posterior_variance, rtol=1e-4, atol=1e-10)
    assert torch.allclose(c["var"], d.fixedlarge_variance, rtol=1e-4, atol=1e-10)
    _, small = d.strided_schedule(100, "fixedsmall")
    assert torch.equal(small["var"], small["post_var"])


def test_the_default_sampling_variance_is_beta_t_as_in_the_official_cifar10_code(tmp_path):
    """model_var_type='fixedlarge': log(append(posterior_variance[1], betas[1:]))."""
    d = GaussianDiffusion()
    assert d.variance == "fixedlarge"
    assert torch.equal(d.fixedlarge_variance[1:], d.betas[1:])
    assert d.fixedlarge_variance[0] == d.posterior_variance[1]
    assert (d.fixedlarge_variance[1:] > d.posterior_variance[1:]).all()  # "large": beta_t > beta_tilde_t
    # strided: beta'_i of the respaced chain, the same rule
    taus, c = d.strided_schedule(50)
    assert torch.allclose(c["var"][1:], c["betas"][1:]) and c["var"][0] == c["post_var"][1]
    # where the trainer (and so every notebook) samples
    from ddpm_core.train import TrainConfig, build

    assert build(TrainConfig(model="tiny", device="cpu", out_dir=str(tmp_path))).diffusion.variance == "fixedlarge"


@pytest.mark.parametrize("variance", ["fixedlarge", "fixedsmall"])
def test_one_reverse_step_is_the_posterior_mean_plus_sigma_z(variance):
    """x_{t-1} = mu_tilde(x_t, clip(x_0)) + sigma_t z, computed here in float64 from the betas alone."""
    T, seed = 10, 3
    d = GaussianDiffusion(timesteps=T, variance=variance)

    def eps_model(x, t):  # a stand-in noise predictor that depends on x and t
        return 0.3 * x + 0.01 * t.float()[:, None, None, None]

    _, traj = d.sample(eps_model, 2, image_size=4, progress=False, return_trajectory=True, trajectory_every=1,
                       generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)  # replay the sampler's draws: x_T, then one z per step
    x_T = torch.randn(2, 3, 4, 4, generator=g).double()
    z = torch.randn(2, 3, 4, 4, generator=g).double()

    betas = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
    a_bar = torch.cumprod(1 - betas, 0)
    t = T - 1
    eps = 0.3 * x_T + 0.01 * t
    x0 = ((x_T - (1 - a_bar[t]).sqrt() * eps) / a_bar[t].sqrt()).clamp(-1, 1)
    mean = (a_bar[t - 1].sqrt() * betas[t] / (1 - a_bar[t]) * x0
            + (1 - betas[t]).sqrt() * (1 - a_bar[t - 1]) / (1 - a_bar[t]) * x_T)
    sigma2 = betas[t] if variance == "fixedlarge" else betas[t] * (1 - a_bar[t - 1]) / (1 - a_bar[t])
    # each snapshot is labelled by the state it shows (the paper's x_t): x_T itself, then x_{T-1} after one step
    assert traj[0][0] == T and torch.allclose(traj[0][1].double(), x_T)
    assert traj[1][0] == t and len(traj) == T + 1 and traj[-1][0] == 0
    assert (traj[1][1].double() - (mean + sigma2.sqrt() * z)).abs().max().item() < 1e-5
    assert (traj[1][1].double() - mean).abs().max().item() > 0.05  # the noise term is really there


def test_an_unknown_variance_is_rejected():
    with pytest.raises(ValueError, match="variance must be one of"):
        GaussianDiffusion(variance="learned")
    with pytest.raises(ValueError, match="variance must be one of"):
        GaussianDiffusion(timesteps=5).sample(lambda x, t: x, 1, steps=2, progress=False, variance="large")


def test_bad_schedule_is_rejected():
    with pytest.raises(ValueError, match="beta_start"):
        GaussianDiffusion(beta_start=0.1, beta_end=0.01)
