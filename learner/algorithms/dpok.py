"""DPOK (Fan et al. 2023): the clipped policy-gradient term on alpha * A plus beta times the per-step
KL of the policy's DDIM step to the pretrained model's (algorithm.kl_coef = beta,
algorithm.reward_scale = alpha)."""
from __future__ import annotations

import torch

from diffrlhf.learner.algorithms.base import Algorithm, StepContext, register
from diffrlhf.learner.loss import gaussian_kl_equal_std, ppo_clipped_loss


def dpok_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float | None,
    kl: torch.Tensor, kl_coef: float, reward_scale: float, kl_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPOK's per-step loss: the clipped policy-gradient term with advantage alpha * A plus beta * KL.

    loss = ppo_clipped_loss(logp, old, reward_scale * A) + kl_coef * mean(kl_weights * kl)

    `kl` [B] is gaussian_kl_equal_std of the policy's step mean and the pretrained model's (the
    latter without gradient, so the KL's gradient flows through the policy mean only). `kl_weights`
    (default 1) are the step selection's unbiasing coefficients c (learner/timesteps.py); the
    timestep weights w(t) redistribute the reward's credit and are in `advantages`, not here.
    kl_coef = 0 and reward_scale = 1 give ppo_clipped_loss exactly (DDPO).
    """
    adv = advantages if reward_scale == 1 else reward_scale * advantages
    loss, info = ppo_clipped_loss(log_prob, old_log_prob, adv, clip_range)
    if kl_coef:
        kl_term = kl if kl_weights is None else kl_weights.to(kl) * kl
        loss = loss + kl_coef * kl_term.mean()
    info["kl_pretrained"] = kl.mean().detach()
    return loss, info


@register
class DPOK(Algorithm):
    name = "dpok"
    uses_pretrained = True
    records = ("kl_pretrained",)

    def step_loss(self, ctx: StepContext):
        s = ctx.settings
        kl = gaussian_kl_equal_std(ctx.mean, ctx.mean_pretrained, ctx.std)
        return dpok_loss(ctx.logp, ctx.old, ctx.advantages[:, 0], s.clip_range, kl, s.kl_coef, s.reward_scale, kl_weights=ctx.coef)
