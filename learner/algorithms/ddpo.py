"""DDPO (Black et al. 2023): the PPO-style clipped surrogate on w(t) * A at each trained step."""
from __future__ import annotations

from diffrlhf.learner.algorithms.base import Algorithm, StepContext, register
from diffrlhf.learner.loss import ppo_clipped_loss


@register
class DDPO(Algorithm):
    name = "ddpo"
    supports_recast = True

    def step_loss(self, ctx: StepContext):
        clip = ctx.settings.clip_range
        loss, info = ppo_clipped_loss(ctx.logp, ctx.old, ctx.advantages[:, 0], clip)
        for term in range(1, ctx.advantages.shape[1]):  # ReCAST's `loss` mode: one clipped loss per reward
            loss = loss + ppo_clipped_loss(ctx.logp, ctx.old, ctx.advantages[:, term], clip)[0]
        return loss, info
