"""DDPO's PPO-style clipped surrogate, with per-timestep weighted advantages."""
from __future__ import annotations

import torch


def ppo_clipped_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean over rows of max(-A r, -A clip(r, 1-eps, 1+eps)), r = exp(logp - logp_old).

    `advantages` are the per-row step advantages A_t = w(t) * A (already clipped to adv_clip_max).
    clip_range None (or inf) turns clipping off (plain policy gradient through the ratio).
    """
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    if clip_range is None or clip_range == float("inf"):
        loss = unclipped.mean()
        clipfrac = torch.zeros(())
    else:
        clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
        loss = torch.maximum(unclipped, clipped).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_range).float().mean()
    info = {
        "approx_kl": 0.5 * ((log_prob - old_log_prob) ** 2).mean().detach(),
        "clipfrac": clipfrac.detach(),
        "ratio_mean": ratio.mean().detach(),
    }
    return loss, info


def gaussian_kl_equal_std(mu_a: torch.Tensor, mu_b: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mu_a, std^2 I) || N(mu_b, std^2 I)) per row: sum over the non-batch dims of (mu_a - mu_b)^2 / (2 std^2).

    The per-step KL of DPOK's regulariser: two DDIM steps of the same eta share their std (it depends
    only on t), so the KL between the fine-tuned and the pretrained step is the squared distance of
    their means over 2 std^2, summed over the latent's elements (the true KL of the C*h*w-dim
    Gaussian; the log-probs are element means, DDPO's convention). Symmetric in mu_a, mu_b.
    `std` broadcasts against the means ([B, 1, 1, 1] as policy.ddim returns it, or a scalar). [B].
    """
    d = (mu_a - mu_b) ** 2 / (2 * std**2)
    return d.sum(dim=tuple(range(1, d.ndim)))
