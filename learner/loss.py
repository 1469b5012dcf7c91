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
