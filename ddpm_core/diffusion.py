"""Gaussian diffusion of Ho et al. 2020: the forward process, the training loss, ancestral sampling.

Notation (the paper's): beta_t is the noise schedule, alpha_t = 1 - beta_t and
alpha_bar_t = prod_{s<=t} alpha_s. Timesteps are 0-indexed here: t = 0 .. T-1 stands for the
paper's t = 1 .. T.

What it matches: ``GaussianDiffusion2`` of the paper's official code
(``diffusion_tf/diffusion_utils_2.py`` of github.com/hojonathanho/diffusion) with the CIFAR-10
settings of ``scripts/run_cifar.py``: linear betas 1e-4 .. 0.02, T = 1000, eps prediction, MSE
loss, and sampling with the "fixedlarge" variance (sigma_t^2 = beta_t) and x_0 clipped to [-1, 1].
``tests/test_diffusion.py`` checks the schedule against the closed form and one reverse step
against the posterior mean plus sigma_t z.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# The reverse-process variance sigma_t^2 of p(x_{t-1} | x_t) (the official code's model_var_type):
#   "fixedlarge": sigma_t^2 = beta_t (the official CIFAR-10 setting, and the published results);
#   "fixedsmall": sigma_t^2 = beta_tilde_t, the variance of the posterior q(x_{t-1} | x_t, x_0).
VARIANCE_CHOICES = ("fixedlarge", "fixedsmall")


def _extract(buf: torch.Tensor, t: torch.Tensor, ndim: int) -> torch.Tensor:
    """Gather buf[t] and reshape to (B, 1, 1, ...) so it broadcasts over an image batch."""
    return buf.gather(0, t).reshape(-1, *([1] * (ndim - 1)))


class GaussianDiffusion(nn.Module):
    """The DDPM forward/reverse process with a linear beta schedule.

    All schedule tensors are computed in float64 and stored as float32 buffers, so they move
    with ``.to(device)``. ``variance`` is the sampling variance (``VARIANCE_CHOICES``); its default,
    "fixedlarge", is the official CIFAR-10 choice.
    """

    def __init__(self, timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02,
                 variance: str = "fixedlarge"):
        super().__init__()
        _check_variance(variance)
        self.variance = variance
        if timesteps < 1:
            raise ValueError(f"timesteps must be >= 1, got {timesteps}")
        if not 0.0 < beta_start <= beta_end < 1.0:
            raise ValueError(
                f"need 0 < beta_start <= beta_end < 1, got beta_start={beta_start}, beta_end={beta_end}"
            )
        self.timesteps = timesteps
        # beta_t: linear from 1e-4 to 0.02 (paper, Sec. 4).
        betas = torch.linspace(beta_start, beta_end, timesteps, dtype=torch.float64)
        self._register_schedule(betas)

    def _register_schedule(self, betas: torch.Tensor) -> None:
        self._betas_f64 = betas  # float64 on the CPU, for re-deriving strided schedules exactly
        alphas = 1.0 - betas  # alpha_t = 1 - beta_t
        alphas_cumprod = torch.cumprod(alphas, dim=0)  # alpha_bar_t = prod_{s<=t} alpha_s
        alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        # Posterior q(x_{t-1} | x_t, x_0) = N(mu_tilde, beta_tilde I)  (paper eq. 6-7):
        #   beta_tilde_t = (1 - alpha_bar_{t-1}) / (1 - alpha_bar_t) * beta_t
        #   mu_tilde_t   = coef1 * x_0 + coef2 * x_t with
        #   coef1 = sqrt(alpha_bar_{t-1}) beta_t / (1 - alpha_bar_t),
        #   coef2 = sqrt(alpha_t) (1 - alpha_bar_{t-1}) / (1 - alpha_bar_t)
        posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        buffers = {
            "betas": betas,
            "alphas": alphas,
            "alphas_cumprod": alphas_cumprod,
            "alphas_cumprod_prev": alphas_cumprod_prev,
            # q(x_t | x_0) = N(sqrt(alpha_bar_t) x_0, (1 - alpha_bar_t) I)  (paper eq. 4)
            "sqrt_alphas_cumprod": alphas_cumprod.sqrt(),
            "sqrt_one_minus_alphas_cumprod": (1.0 - alphas_cumprod).sqrt(),
            # x_0 = sqrt(1/alpha_bar_t) x_t - sqrt(1/alpha_bar_t - 1) eps
            "sqrt_recip_alphas_cumprod": (1.0 / alphas_cumprod).sqrt(),
            "sqrt_recipm1_alphas_cumprod": (1.0 / alphas_cumprod - 1.0).sqrt(),
            "posterior_variance": posterior_variance,
            # beta_tilde_0 = 0, so the log is clipped to the next value (as in the paper's code).
            "posterior_log_variance_clipped": torch.log(
                torch.cat([posterior_variance[1:2], posterior_variance[1:]])
            ),
            # "fixedlarge" sigma_t^2: beta_t, except beta_tilde at the paper's t = 1 (index 0), as in
            # the official code: np.append(posterior_variance[1], betas[1:]). The sampler adds no
            # noise at that last step, so the exception only matters for likelihoods.
            "fixedlarge_variance": _fixedlarge(betas, posterior_variance),
            "posterior_mean_coef1": betas * alphas_cumprod_prev.sqrt() / (1.0 - alphas_cumprod),
            "posterior_mean_coef2": (1.0 - alphas_cumprod_prev) * alphas.sqrt() / (1.0 - alphas_cumprod),
        }
        for name, value in buffers.items():
            self.register_buffer(name, value.float(), persistent=False)

    # ----------------------------------------------------------------------------- forward process
    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Sample x_t ~ q(x_t | x_0) = N(sqrt(alpha_bar_t) x_0, (1 - alpha_bar_t) I)."""
        if noise is None:
            noise = torch.randn_like(x0)
        return (
            _extract(self.sqrt_alphas_cumprod, t, x0.ndim).to(x0.dtype) * x0
            + _extract(self.sqrt_one_minus_alphas_cumprod, t, x0.ndim).to(x0.dtype) * noise
        )

    def sample_timesteps(self, n: int, device: torch.device | str, generator: torch.Generator | None = None) -> torch.Tensor:
        """Uniform t ~ U{0, ..., T-1}, as in Algorithm 1."""
        return torch.randint(0, self.timesteps, (n,), device=device, generator=generator)

    def loss(
        self,
        model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        x0: torch.Tensor,
        t: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Algorithm 1 of Ho et al. 2020: || eps - eps_theta(sqrt(a_bar) x0 + sqrt(1-a_bar) eps, t) ||^2.

        ``t`` (uniform) and ``noise`` (standard normal) are drawn when not given. Returns the
        mean over batch and pixels (the paper's L_simple).
        """
        if t is None:
            t = self.sample_timesteps(x0.shape[0], x0.device)
        if noise is None:
            noise = torch.randn_like(x0)
        x_t = self.q_sample(x0, t, noise)
        return F.mse_loss(model(x_t, t).float(), noise.float())

    # ----------------------------------------------------------------------------- reverse process
    def strided_schedule(self, steps: int, variance: str | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Timesteps, posterior coefficients and sampling variance for sampling with ``steps`` <= T steps.

        Keeps an evenly spaced subset tau of the T timesteps and re-derives the betas of that
        shorter chain from alpha_bar: beta'_i = 1 - alpha_bar_{tau_i} / alpha_bar_{tau_{i-1}}
        (the respacing of Nichol & Dhariwal 2021). With steps == T it is the original chain.
        ``c["var"]`` is sigma_i^2 of that chain: beta'_i for "fixedlarge" (beta_tilde'_1 at i = 0,
        as the official code does on the full chain), beta_tilde'_i for "fixedsmall". This is what
        Nichol & Dhariwal's respaced sampler does, and equals the official values when steps == T.
        """
        variance = variance or self.variance
        _check_variance(variance)
        taus = torch.linspace(0, self.timesteps - 1, steps).round().long().unique()
        a_bar = torch.cumprod(1.0 - self._betas_f64, dim=0)[taus]
        a_bar_prev = torch.cat([torch.ones(1, dtype=torch.float64), a_bar[:-1]])
        betas = 1.0 - a_bar / a_bar_prev
        post_var = betas * (1.0 - a_bar_prev) / (1.0 - a_bar)
        coefs = {
            "betas": betas,
            "sqrt_recip": (1.0 / a_bar).sqrt(),
            "sqrt_recipm1": (1.0 / a_bar - 1.0).sqrt(),
            "coef1": betas * a_bar_prev.sqrt() / (1.0 - a_bar),
            "coef2": (1.0 - a_bar_prev) * (1.0 - betas).sqrt() / (1.0 - a_bar),
            "post_var": post_var,
            "var": _fixedlarge(betas, post_var) if variance == "fixedlarge" else post_var,
        }
        return taus, {k: v.float() for k, v in coefs.items()}

    @torch.no_grad()
    def sample(
        self,
        model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        n: int,
        *,
        image_size: int = 32,
        channels: int = 3,
        steps: int | None = None,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
        progress: bool = True,
        return_trajectory: bool = False,
        trajectory_every: int | None = None,
        variance: str | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
        """Algorithm 2 of Ho et al. 2020: ancestral sampling from x_T ~ N(0, I) down to x_0.

        Each step forms x_0 = (x_t - sqrt(1 - a_bar_t) eps_theta) / sqrt(a_bar_t), clips it to
        [-1, 1] and draws x_{t-1} = mu_tilde_t(x_t, x_0) + sigma_t z, the posterior mean plus
        noise of variance sigma_t^2 = beta_t ("fixedlarge", the default and the official CIFAR-10
        setting) or beta_tilde_t ("fixedsmall"); no noise at the last step. Without the clip this
        is exactly the update of Algorithm 2; with it, it is the official code's ``p_sample``.

        Args:
            model: eps-prediction network (put it in eval mode; the EMA model samples best).
            n: number of images.
            steps: None for the full T-step chain; fewer for a strided preview (quick, blurrier).
            generator: for reproducible samples.
            progress: show a tqdm progress bar.
            return_trajectory: also return [(t, x_t), ...] snapshots of the reverse process, t in the paper's
                indexing (x_T the starting noise, t = T, first; x_0 the sample, t = 0, last). The network's timesteps
                are 0-based: x_t is what it denoises at its timestep t - 1, so a snapshot is taken before a step and
                labelled by the state it shows (labelled by the step just taken, the first column "t = 999" was
                already one step from the noise).
            trajectory_every: snapshot spacing in steps (default: about 10 snapshots).
            variance: "fixedlarge" or "fixedsmall" (default: this diffusion's ``variance``).

        Returns:
            Images in [-1, 1], shape (n, channels, image_size, image_size) [, trajectory].
        """
        from tqdm.auto import tqdm

        if device is None:
            device = self.betas.device
        steps = self.timesteps if steps is None else int(steps)
        if not 1 <= steps <= self.timesteps:
            raise ValueError(f"steps must be in 1..{self.timesteps}, got {steps}")
        taus, c = self.strided_schedule(steps, variance)
        c = {k: v.to(device) for k, v in c.items()}
        x = torch.randn(n, channels, image_size, image_size, device=device, generator=generator)
        every = trajectory_every or max(1, len(taus) // 10)
        trajectory: list[tuple[int, torch.Tensor]] = []
        for i in tqdm(range(len(taus) - 1, -1, -1), desc="sampling", disable=not progress, leave=False):
            if return_trajectory and ((len(taus) - 1 - i) % every == 0):  # x_t before the step at timestep t - 1
                trajectory.append((int(taus[i]) + 1, x.detach().cpu()))
            t = torch.full((n,), int(taus[i]), device=device, dtype=torch.long)
            eps = model(x, t).float()
            x0 = (c["sqrt_recip"][i] * x - c["sqrt_recipm1"][i] * eps).clamp(-1.0, 1.0)
            mean = c["coef1"][i] * x0 + c["coef2"][i] * x
            if i > 0:
                z = torch.randn(x.shape, device=device, generator=generator)
                x = mean + c["var"][i].sqrt() * z
            else:
                x = mean  # no noise at the last step
        x = x.clamp(-1.0, 1.0)
        if return_trajectory:
            trajectory.append((0, x.detach().cpu()))  # x_0: the sample
        return (x, trajectory) if return_trajectory else x


def _check_variance(variance: str) -> None:
    if variance not in VARIANCE_CHOICES:
        raise ValueError(f"variance must be one of {VARIANCE_CHOICES} (sigma_t^2 = beta_t or beta_tilde_t), "
                         f"got {variance!r}")


def _fixedlarge(betas: torch.Tensor, posterior_variance: torch.Tensor) -> torch.Tensor:
    """sigma_t^2 = beta_t, with beta_tilde at index 0 (the official ``np.append(posterior_variance[1], betas[1:])``)."""
    var = betas.clone()
    if len(var) > 1:
        var[0] = posterior_variance[1]
    return var
