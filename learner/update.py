"""The timestep-weighted, hard-mined DDPO update (the learner role's work, no Ray).

One call of :meth:`PolicyLearner.update` is one epoch of training on a batch of scored
trajectories (current epoch plus replay), with DDPO's semantics:
  * inner_epochs passes; each shuffles the trajectories and, independently per trajectory,
    the order of its timesteps; the first round(T * timestep_fraction) of them are trained;
  * the batch is split into train.batch_size chunks; every (chunk, timestep) pair is one
    backward; the optimizer steps after grad_accum_steps chunks x trained timesteps backwards,
    the gradient being their mean (like accelerate's accumulation in ddpo-pytorch); a remainder
    at the end of an inner epoch is stepped too, so no sample's gradient is dropped;
  * gradients are clipped to max_grad_norm before each step.
The advantage of step i of trajectory b is w_i * A_b with w from learner/weighting.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrlhf.policy.ddim import ddim_step_with_logprob, guided_noise_pred
from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.learner.lora import DEFAULT_RANK, DEFAULT_TARGETS, add_lora, load_lora_state_dict, lora_parameters, lora_state_dict
from diffrlhf.learner.loss import ppo_clipped_loss
from diffrlhf.learner.weighting import timestep_weights
from diffrlhf.policy.sampler import SamplingSettings

# Old log-probs of replayed rows: recorded at sampling time, or recomputed under the policy at update start.
LOGPROB_MODES = ("recorded", "recompute")


@dataclass
class UpdateSettings:
    """The learner's settings; their defaults are the config's (deploy/config.py reads them from here)."""

    lr: float = 3e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    weight_decay: float = 1e-4
    adam_eps: float = 1e-8
    clip_range: float | None = 1e-4
    max_grad_norm: float = 1.0
    timestep_fraction: float = 1.0
    inner_epochs: int = 1
    batch_size: int = 8
    grad_accum_steps: int = 1
    weighting: str = "uniform"  # one of learner.weighting.SCHEMES
    gaussian_width: float = 0.2
    logprob_mode: str = "recorded"  # one of LOGPROB_MODES
    # The learner evaluates the sampler's policy, so it takes the sampler's eta and guidance.
    eta: float = SamplingSettings.eta
    guidance_scale: float = SamplingSettings.guidance_scale


class PolicyLearner:
    """Holds the LoRA-adapted UNet and its optimizer; `version` counts completed updates."""

    def __init__(self, components, settings: UpdateSettings, lora_rank: int = DEFAULT_RANK, lora_alpha: float | None = None,
                 lora_targets=DEFAULT_TARGETS, seed: int = 0, negative_prompt: str = ""):
        self.c, self.s, self.seed = components, settings, seed
        add_lora(components.unet, rank=lora_rank, alpha=lora_alpha, targets=lora_targets, seed=seed)
        self.params = lora_parameters(components.unet)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2),
            weight_decay=settings.weight_decay, eps=settings.adam_eps,
        )
        self.negative_embeds = components.encode_prompts([negative_prompt])
        self.version = 0

    # ------------------------------------------------------------------ policy evaluation

    def step_log_prob(self, latents, timesteps, next_latents, prompt_embeds) -> torch.Tensor:
        """log p(next | latents) under the current weights for one step per row: [B]."""
        dev, dt = self.c.device, self.c.unet.dtype
        eps = guided_noise_pred(self.c.unet, latents.to(dev, dt), timesteps.to(dev), prompt_embeds.to(dev, dt),
                                self.negative_embeds, self.s.guidance_scale)
        _, logp, _, _ = ddim_step_with_logprob(self.c.scheduler, eps, timesteps.to(dev), latents.to(dev, dt),
                                               self.s.eta, prev_sample=next_latents.to(dev, dt))
        return logp

    @torch.no_grad()
    def recompute_log_probs(self, batch: TrajectoryBatch) -> torch.Tensor:
        """All T log-probs of each recorded transition under the current weights: [B, T]."""
        self._set_schedule(batch)
        out = torch.empty_like(batch.log_probs)
        for i in range(batch.num_steps):
            out[:, i] = self.step_log_prob(batch.latents[:, i], batch.timesteps[:, i], batch.latents[:, i + 1],
                                           batch.prompt_embeds).float().cpu()
        return out

    def _set_schedule(self, batch: TrajectoryBatch) -> None:
        # The step size t -> t_prev comes from the scheduler's number of inference steps.
        if self.c.scheduler.num_inference_steps != batch.num_steps:
            self.c.scheduler.set_timesteps(batch.num_steps)

    # ------------------------------------------------------------------ the update

    def update(self, batch: TrajectoryBatch) -> dict:
        """Train one epoch on `batch` (fresh rows and rows marked `replayed`); bumps version."""
        s = self.s
        if torch.isnan(batch.advantages).any():
            raise ValueError("PolicyLearner.update needs advantages for every trajectory")
        self._set_schedule(batch)
        b, t_total = len(batch), batch.num_steps
        old_logp = batch.log_probs.clone()
        is_replay = batch.replayed.clone()
        num_replayed = int(is_replay.sum())
        if num_replayed:
            if s.logprob_mode == "recompute":
                old_logp[is_replay] = self.recompute_log_probs(batch.select(torch.nonzero(is_replay).flatten()))
        w = timestep_weights(s.weighting, batch.latents, batch.timesteps, self.c.scheduler, s.eta, s.gaussian_width)
        n_train_t = max(1, int(round(t_total * s.timestep_fraction)))
        accum = s.grad_accum_steps * n_train_t
        # Shuffles come from a generator keyed by (seed, version): reproducible, nothing to checkpoint.
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.version)
        stats = {"loss": [], "approx_kl": [], "clipfrac": [], "clipfrac_replay": [], "clipfrac_fresh": [], "grad_norm": []}
        self.c.unet.train()
        micro = 0
        for _ in range(s.inner_epochs):
            perm = torch.randperm(b, generator=gen)
            t_perm = torch.stack([torch.randperm(t_total, generator=gen) for _ in range(b)])  # [B, T] step indices
            for start in range(0, b, s.batch_size):
                rows = perm[start:start + s.batch_size]
                adv = batch.advantages[rows]
                for j in range(n_train_t):
                    steps = t_perm[rows, j]
                    logp = self.step_log_prob(batch.latents[rows, steps], batch.timesteps[rows, steps],
                                              batch.latents[rows, steps + 1], batch.prompt_embeds[rows])
                    step_adv = (w[steps] * adv).to(logp.device)
                    old = old_logp[rows, steps].to(logp.device)
                    loss, info = ppo_clipped_loss(logp, old, step_adv, s.clip_range)
                    (loss / accum).backward()
                    micro += 1
                    stats["loss"].append(loss.item())
                    stats["approx_kl"].append(info["approx_kl"].item())
                    stats["clipfrac"].append(info["clipfrac"].item())
                    clipped = ((torch.exp(logp - old) - 1).abs() > (s.clip_range or float("inf"))).float().cpu()
                    rep = is_replay[rows]
                    if rep.any():
                        stats["clipfrac_replay"].append(clipped[rep].mean().item())
                    if (~rep).any():
                        stats["clipfrac_fresh"].append(clipped[~rep].mean().item())
                    if micro % accum == 0:
                        stats["grad_norm"].append(self._optimizer_step())
            if micro % accum:  # flush the remainder of this inner epoch
                stats["grad_norm"].append(self._optimizer_step(scale=accum / (micro % accum)))
                micro = 0
        self.c.unet.eval()
        self.version += 1
        out = {k: (sum(v) / len(v) if v else float("nan")) for k, v in stats.items()}
        out.update(optimizer_steps=len(stats["grad_norm"]), num_replayed=num_replayed, policy_version=self.version,
                   timestep_weights=[round(x, 4) for x in w.tolist()])
        return out

    def _optimizer_step(self, scale: float = 1.0) -> float:
        if scale != 1.0:  # a partial accumulation: make it a mean over the backwards it had
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.s.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ------------------------------------------------------------------ weights and state

    def lora_state(self) -> dict[str, torch.Tensor]:
        return lora_state_dict(self.c.unet)

    def state_dict(self) -> dict:
        return {"lora": self.lora_state(), "optimizer": self.optimizer.state_dict(), "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        load_lora_state_dict(self.c.unet, state["lora"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
