"""One DDIM step (eta > 0) as a Gaussian policy, with its log-probability.

The same function serves sampling (draw z_{t-1}) and training (score a recorded z_{t-1} under the
current weights), so recomputing a recorded transition with unchanged weights gives ratio 1.
It reads the schedule from diffusers' DDIMScheduler and follows ddpo-pytorch's patch of its step.

Choice for the last step: the transition out of the smallest timestep t has no "previous"
timestep. diffusers then uses ``final_alpha_cumprod`` (1.0 when set_alpha_to_one=True), which makes
the step deterministic (std 0) and its log-prob undefined. Like ddpo-pytorch, we clamp the
previous timestep to 0 and use alpha_bar[0]; for SD1.5 (set_alpha_to_one=False) that is exactly
what diffusers does anyway, so sampling matches ``DDIMScheduler.step`` at every step.
"""
from __future__ import annotations

import math

import torch


def _alpha_bars(scheduler, timestep: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    step = scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    prev = (timestep - step).clamp(min=0)  # see the module docstring: last step uses alpha_bar[0]
    ac = scheduler.alphas_cumprod.to(device=device, dtype=torch.float64)
    return ac[timestep.to(device)], ac[prev.to(device)]


def ddim_std(scheduler, timestep: torch.Tensor, eta: float) -> torch.Tensor:
    """The policy's std at `timestep`: eta * sqrt(beta_tilde_t) (DDIM eq. 16), float64."""
    timestep = torch.as_tensor(timestep).long()
    a_t, a_prev = _alpha_bars(scheduler, timestep, timestep.device)
    variance = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
    return eta * variance.sqrt()


def ddim_step_mean_std(scheduler, noise_pred: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor,
                       eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gaussian of one DDIM step z_t -> z_{t-1} (eta > 0, epsilon prediction): (mean, std [B,1,1,1]).

    In float32 at least (fp16 models still get a precise Gaussian); ddim_step_with_logprob's
    distribution, and what DPOK's KL compares (learner/loss.py gaussian_kl_equal_std).
    """
    if eta <= 0:
        raise ValueError(f"eta must be > 0 for a stochastic policy with a log-prob, got {eta}")
    if scheduler.config.prediction_type != "epsilon":
        raise ValueError(f"only epsilon-prediction models are supported, scheduler has {scheduler.config.prediction_type!r}")
    b = sample.shape[0]
    timestep = torch.as_tensor(timestep, device=sample.device).long().reshape(-1).expand(b)
    a_t, a_prev = _alpha_bars(scheduler, timestep, sample.device)
    shape = (b,) + (1,) * (sample.ndim - 1)
    a_t, a_prev = a_t.reshape(shape), a_prev.reshape(shape)
    std = eta * ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)).sqrt()

    dt = torch.promote_types(sample.dtype, torch.float32)
    x, eps = sample.to(dt), noise_pred.to(dt)
    a_t, a_prev, std = a_t.to(dt), a_prev.to(dt), std.to(dt)
    pred_x0 = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
    mean = a_prev.sqrt() * pred_x0 + (1 - a_prev - std**2).clamp(min=0).sqrt() * eps
    return mean, std


def ddim_step_with_logprob(
    scheduler,
    noise_pred: torch.Tensor,
    timestep: torch.Tensor,
    sample: torch.Tensor,
    eta: float,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DDIM step z_t -> z_{t-1} with eta > 0 for epsilon-prediction models.

    Args:
        noise_pred: epsilon prediction (after guidance), [B, C, h, w].
        timestep: [B] or scalar long tensor, the current timestep t of each sample.
        sample: z_t, [B, C, h, w].
        prev_sample: if given, the transition to score (training); otherwise z_{t-1} is drawn as
            mean + std * noise (sampling), with `noise` required so the caller controls the RNG.
    Returns:
        (prev_sample, log_prob [B], mean, std [B,1,1,1]). log_prob is the Gaussian log-density
        averaged over latent elements (DDPO's convention; a sum would only rescale ratios' logs
        by C*h*w).
    """
    mean, std = ddim_step_mean_std(scheduler, noise_pred, timestep, sample, eta)
    dt = mean.dtype
    if prev_sample is None:
        if noise is None:
            raise ValueError("sampling needs `noise` (drawn by the caller from its per-sample generators)")
        prev_sample = mean + std * noise.to(dt)
    prev = prev_sample.detach().to(dt)
    log_prob = -((prev - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample.to(sample.dtype), log_prob, mean, std


def guided_noise_pred(unet, latents, timestep, prompt_embeds, negative_embeds, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guided epsilon: eps_u + g * (eps_c - eps_u), one UNet call on a doubled batch.

    `negative_embeds` is [1, L, D] (broadcast) or [B, L, D]; `timestep` is scalar or [B].
    """
    b = latents.shape[0]
    timestep = torch.as_tensor(timestep, device=latents.device).reshape(-1).expand(b)
    if guidance_scale == 1.0:
        return unet(latents, timestep, encoder_hidden_states=prompt_embeds).sample
    neg = negative_embeds.expand(b, -1, -1).to(prompt_embeds.dtype)
    out = unet(
        torch.cat([latents, latents]),
        torch.cat([timestep, timestep]),
        encoder_hidden_states=torch.cat([neg, prompt_embeds]),
    ).sample
    eps_u, eps_c = out.chunk(2)
    return eps_u + guidance_scale * (eps_c - eps_u)
