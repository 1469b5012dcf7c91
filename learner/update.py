"""The timestep-weighted, hard-mined DDPO update (the learner role's work, no Ray).

One call of :meth:`PolicyLearner.update` is one epoch of training on a batch of scored
trajectories (current epoch plus replay), with DDPO's semantics:
  * the rows are shuffled once and split into train.batch_size chunks (buffer/sharding.py: the
    plan a learner group shares); each of inner_epochs passes re-orders the chunks (the first keeps
    the shuffle's order) and picks, independently per trajectory, k = round(T * timestep_fraction)
    of its steps and their order (learner/timesteps.py: `random` is DDPO's uniform subset;
    `weighted` draws by w(t) with an unbiasing coefficient);
  * every (chunk, timestep) pair is one
    backward; the optimizer steps after grad_accum_steps chunks x trained timesteps backwards,
    the gradient being their mean (like accelerate's accumulation in ddpo-pytorch); a remainder
    at the end of an inner epoch is stepped too, so no sample's gradient is dropped;
  * gradients are clipped to max_grad_norm before each step.
The advantage of step i of trajectory b is c_bi * w_i * A_b with w from learner/weighting.py and
c the selection's coefficient (1 except for `weighted`). Under ReCAST (settings.recast, from
recast.mode; learner/credit.py) A_b is replaced by the credit part's terms: step i's own advantage
A_b,i (pre), or one clipped loss per reward r with advantage c_bi * w_i * (T W)_r,i * A_b,r (loss).
The algorithm (`algorithm.name`, learner/algorithms/) gives the loss at each trained step
(`step_loss`: DDPO's clipped surrogate, DPOK's with its KL to the pretrained model, ...) and says
whether the pretrained model's step mean is needed (computed here with the LoRA bypassed,
learner/lora.py adapter_disabled: one extra forward without gradient) and which statistics it
records. An update may have no rows (an algorithm that trains some rows only, when none qualified):
the version still advances, so the schedule stays in step with the epochs, and nothing is trained.
Compute is counted: `learner_passes` = trajectory-steps trained (one UNet forward+backward of one
sample at one step, on CFG's doubled input), `learner_calls` = UNet forward+backward calls (a chunk
of rows at one step), `learner_forward_passes` = forward-only trajectory-steps (log-prob
recomputation of replayed rows; with an algorithm that uses the pretrained model, also its
prediction at every trained row and step), `learner_s` = the update's seconds; an algorithm's own
records (e.g. `kl_pretrained`) are means over the trained (row, step)s.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from diffrlhf.buffer.sharding import Shard, chunk_share, update_chunks, update_generator
from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.keys import choices, default
from diffrlhf.learner import algorithms
from diffrlhf.learner.algorithms import StepContext
from diffrlhf.learner.credit import build_credit
from diffrlhf.learner.distributed import Group
from diffrlhf.learner.lora import (DEFAULT_RANK, DEFAULT_TARGETS, adapter_disabled, add_lora, load_lora_state_dict,
                                   lora_parameters, lora_state_dict)
from diffrlhf.learner.timesteps import num_trained_steps, select_timesteps
from diffrlhf.learner.weighting import timestep_weights
from diffrlhf.policy.ddim import ddim_step_mean_std, ddim_step_with_logprob, guided_noise_pred
from diffrlhf.policy.sampler import SamplingSettings

# Old log-probs of replayed rows: recorded at sampling time, or recomputed under the policy at update start.
LOGPROB_MODES = choices("replay.logprob_mode")
# The policy-gradient algorithms the update can run (algorithm.name): learner/algorithms/.
ALGORITHMS = algorithms.names()


@dataclass
class UpdateSettings:
    """The learner's settings (train.*, weighting.*, algorithm.* and friends; defaults declared in diffrlhf.keys)."""

    lr: float = default("train.lr")
    adam_beta1: float = default("train.adam_beta1")
    adam_beta2: float = default("train.adam_beta2")
    weight_decay: float = default("train.weight_decay")
    adam_eps: float = default("train.adam_eps")
    clip_range: float | None = default("train.clip_range")
    max_grad_norm: float = default("train.max_grad_norm")
    timestep_fraction: float = default("train.timestep_fraction")
    timestep_selection: str = default("train.timestep_selection")  # one of learner.timesteps.SELECTIONS
    total_epochs: int = 0  # the run's train.epochs: where the `window` selection is in its schedule
    inner_epochs: int = default("train.inner_epochs")
    batch_size: int = default("train.batch_size")
    grad_accum_steps: int = default("train.grad_accum_steps")
    weighting: str = default("weighting.scheme")  # one of learner.weighting.SCHEMES
    gaussian_width: float = default("weighting.gaussian_width")
    logprob_mode: str = default("replay.logprob_mode")  # one of LOGPROB_MODES
    # The learner evaluates the sampler's policy, so it takes the sampler's eta and guidance.
    eta: float = SamplingSettings.eta
    guidance_scale: float = SamplingSettings.guidance_scale
    algorithm: str = default("algorithm.name")  # one of ALGORITHMS
    # DPOK's beta: weight of the per-step KL (summed over latent elements) to the pretrained model.
    kl_coef: float = default("algorithm.kl_coef")
    reward_scale: float = default("algorithm.reward_scale")  # DPOK's alpha: the advantage's scale in the policy-gradient term
    recast: str = default("recast.mode")  # one of buffer.credit.RECAST_MODES: ReCAST's per-reward credit over the steps (off: DDPO's)


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
        self.group = Group()  # a single learner; a learner group's rank sets its own (learner/distributed.py)
        self.passes_total = 0  # trajectory-steps trained over the run (the compute axis of the curves)
        self.timestep_profile: torch.Tensor | None = None  # the `oracle` weighting's measured per-step variance
        self.recast_weights: torch.Tensor | None = None  # ReCAST's W [R, T], measured by the run's probe

    # ------------------------------------------------------------------ policy evaluation

    def step_log_prob(self, latents, timesteps, next_latents, prompt_embeds) -> torch.Tensor:
        """log p(next | latents) under the current weights for one step per row: [B]."""
        return self.step(latents, timesteps, next_latents, prompt_embeds)[0]

    def step(self, latents, timesteps, next_latents, prompt_embeds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log p(next | latents) [B], the step's mean, its std [B,1,1,1]) under the current weights."""
        dev, dt = self.c.device, self.c.unet.dtype
        eps = guided_noise_pred(self.c.unet, latents.to(dev, dt), timesteps.to(dev), prompt_embeds.to(dev, dt),
                                self.negative_embeds, self.s.guidance_scale)
        _, logp, mean, std = ddim_step_with_logprob(self.c.scheduler, eps, timesteps.to(dev), latents.to(dev, dt),
                                                    self.s.eta, prev_sample=next_latents.to(dev, dt))
        return logp, mean, std

    @torch.no_grad()
    def pretrained_step_mean(self, latents, timesteps, prompt_embeds) -> torch.Tensor:
        """The pretrained model's DDIM step mean at each row's step (the LoRA bypassed; no gradient)."""
        dev, dt = self.c.device, self.c.unet.dtype
        with adapter_disabled(self.c.unet):
            eps = guided_noise_pred(self.c.unet, latents.to(dev, dt), timesteps.to(dev), prompt_embeds.to(dev, dt),
                                    self.negative_embeds, self.s.guidance_scale)
        return ddim_step_mean_std(self.c.scheduler, eps, timesteps.to(dev), latents.to(dev, dt), self.s.eta)[0]

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

    def update(self, batch: TrajectoryBatch, shard: Shard | None = None) -> dict:
        """Train one epoch on `batch` (fresh rows and rows marked `replayed`); bumps version.

        In a learner group, `batch` holds this rank's rows and `shard` says where they sit in the
        whole update (buffer/sharding.py); every rank draws the same plan for all rows, trains its
        slice of each mini-batch, and the gradients are summed over ranks before each step."""
        s, g, t_start = self.s, self.group, time.perf_counter()
        shard = shard or Shard.whole(len(batch))
        if shard.world != g.world or (shard.world > 1 and shard.rank != g.rank):
            raise ValueError(f"a shard for rank {shard.rank} of {shard.world} reached rank {g.rank} of a group of {g.world}")
        if shard.key is not None and shard.key != (self.seed, self.version):
            raise ValueError(f"the shard was planned for (seed, policy version) {shard.key} but this learner is at "
                             f"{(self.seed, self.version)}: the buffer and the learner disagree on the epoch")
        if torch.isnan(batch.advantages).any():
            raise ValueError("PolicyLearner.update needs advantages for every trajectory")
        algorithm = algorithms.get(s.algorithm)
        credit = build_credit(s.recast, self.recast_weights)
        if shard.num_rows == 0:
            return self._empty_update(t_start)
        self._set_schedule(batch)
        b, t_total = shard.num_rows, batch.num_steps
        local = torch.full((b,), -1, dtype=torch.long)  # global row -> row of `batch`
        local[shard.row_ids] = torch.arange(len(batch))
        old_logp = batch.log_probs.clone()
        is_replay = batch.replayed.clone()
        forward_passes = 0
        if is_replay.any() and s.logprob_mode == "recompute":
            old_logp[is_replay] = self.recompute_log_probs(batch.select(torch.nonzero(is_replay).flatten()))
            forward_passes = int(is_replay.sum()) * t_total
        w = timestep_weights(s.weighting, batch.latents, batch.timesteps, self.c.scheduler, s.eta, s.gaussian_width,
                             reduce=g.sum_ if g.world > 1 else None, profile=self.timestep_profile)
        n_train_t = num_trained_steps(t_total, s.timestep_fraction)
        progress = min(1.0, self.version / s.total_epochs) if s.total_epochs else 0.0
        gen = update_generator(self.seed, self.version)
        chunks = update_chunks(b, s.batch_size, gen)
        # Per mini-batch x step ("micro"), this rank's sums: rows, loss, kl, clipfrac (x rows),
        # clipped replayed rows, replayed rows, clipped fresh rows, fresh rows, then the algorithm's
        # own records (x rows). Summed over ranks at the end.
        width = 8 + len(algorithm.records)
        micro_sums, grad_norms = [], []
        self.c.unet.train()
        micro = calls = passes = 0
        for inner in range(s.inner_epochs):
            order = range(len(chunks)) if inner == 0 else torch.randperm(len(chunks), generator=gen).tolist()
            chosen, coef = select_timesteps(s.timestep_selection, w, b, n_train_t, gen, progress)  # [B, k] each, all rows
            k = chosen.shape[1]  # `weighted` trains fewer if fewer than k steps have weight
            accum = s.grad_accum_steps * k
            for ci in order:
                mine = chunk_share(chunks[ci], g.rank, g.world)
                share = len(mine) / len(chunks[ci])  # the rank's part of the mini-batch mean
                rows = local[mine]
                for j in range(k):
                    micro += 1
                    if len(mine):
                        steps = chosen[mine, j]
                        z, ts, emb = batch.latents[rows, steps], batch.timesteps[rows, steps], batch.prompt_embeds[rows]
                        mean_pre = None
                        if algorithm.uses_pretrained:  # the pretrained model's step, before the policy's graph exists
                            mean_pre = self.pretrained_step_mean(z, ts, emb)
                            forward_passes += len(rows)
                        logp, mean, std = self.step(z, ts, batch.latents[rows, steps + 1], emb)
                        calls, passes = calls + 1, passes + len(rows)
                        # [n, K]: the credit's K advantage terms of each (row, step), times c * w(t)
                        step_adv = ((coef[mine, j] * w[steps])[:, None] * credit.step_advantages(batch, rows, steps)).to(logp.device)
                        old = old_logp[rows, steps].to(logp.device)
                        loss, info = algorithm.step_loss(StepContext(logp, old, step_adv, coef[mine, j], mean, std, s, mean_pre))
                        (loss * share / accum).backward()
                        clipped = ((torch.exp(logp - old) - 1).abs() > (s.clip_range or float("inf"))).double().cpu()
                        rep, n = is_replay[rows], len(rows)
                        micro_sums.append([n, loss.item() * n, info["approx_kl"].item() * n, info["clipfrac"].item() * n,
                                           clipped[rep].sum().item(), rep.sum().item(), clipped[~rep].sum().item(), (~rep).sum().item(),
                                           *(info[r].item() * n for r in algorithm.records)])
                    else:
                        micro_sums.append([0.0] * width)
                    if micro % accum == 0:
                        grad_norms.append(self._optimizer_step())
            if micro % accum:  # flush the remainder of this inner epoch
                grad_norms.append(self._optimizer_step(scale=accum / (micro % accum)))
                micro = 0
        self.c.unet.eval()
        m = g.sum_(torch.tensor(micro_sums, dtype=torch.float64).reshape(-1, width))
        counts = g.sum_(torch.tensor([calls, passes, forward_passes, int(is_replay.sum())], dtype=torch.float64)).long().tolist()
        calls, passes, forward_passes, num_replayed = counts
        self.version += 1
        self.passes_total += passes

        def mean_of(num, den):  # mean over micros of num/den, where den > 0
            ok = m[:, den] > 0
            return float((m[ok, num] / m[ok, den]).mean()) if ok.any() else float("nan")

        out = {"loss": mean_of(1, 0), "approx_kl": mean_of(2, 0), "clipfrac": mean_of(3, 0), "clipfrac_replay": mean_of(4, 5),
               "clipfrac_fresh": mean_of(6, 7), "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")}
        out.update(optimizer_steps=len(grad_norms), num_replayed=num_replayed, policy_version=self.version,
                   timestep_weights=[round(x, 4) for x in w.tolist()], steps_trained=k, learner_calls=calls,
                   learner_passes=passes, learner_passes_total=self.passes_total, learner_forward_passes=forward_passes,
                   learner_s=time.perf_counter() - t_start, learners=g.world)
        out.update({r: mean_of(8 + i, 0) for i, r in enumerate(algorithm.records)})
        return out

    def _empty_update(self, t_start: float) -> dict:
        """An update with no rows to train (the algorithm's train_rows kept none)."""
        self.version += 1
        nan = float("nan")
        return {"loss": nan, "approx_kl": nan, "clipfrac": nan, "clipfrac_replay": nan, "clipfrac_fresh": nan, "grad_norm": nan,
                "optimizer_steps": 0, "num_replayed": 0, "policy_version": self.version, "timestep_weights": [], "steps_trained": 0,
                "learner_calls": 0, "learner_passes": 0, "learner_passes_total": self.passes_total, "learner_forward_passes": 0,
                "learner_s": time.perf_counter() - t_start, "learners": self.group.world}

    def _optimizer_step(self, scale: float = 1.0) -> float:
        self.group.sum_grads_(self.params)  # every rank takes the same step
        if scale != 1.0:  # a partial accumulation: make it a mean over the backwards it had
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.s.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ------------------------------------------------------------------ weights and state

    def set_timestep_profile(self, profile) -> None:
        """The `oracle` weighting's per-step variance, measured by the run's probe (actors/oracle.py)."""
        self.timestep_profile = torch.as_tensor(profile, dtype=torch.float64).clone()

    def set_recast_weights(self, weights) -> None:
        """ReCAST's W [R, T], measured by the run's probe (actors/recast_probe.py)."""
        self.recast_weights = torch.as_tensor(weights, dtype=torch.float64).clone()

    def lora_state(self) -> dict[str, torch.Tensor]:
        return lora_state_dict(self.c.unet)

    def state_dict(self) -> dict:
        return {"lora": self.lora_state(), "optimizer": self.optimizer.state_dict(), "version": self.version,
                "passes_total": self.passes_total, "timestep_profile": self.timestep_profile,
                "recast_weights": self.recast_weights}

    def load_state_dict(self, state: dict) -> None:
        load_lora_state_dict(self.c.unet, state["lora"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
        self.passes_total = state.get("passes_total", 0)  # checkpoints from before passes were counted
        self.timestep_profile = state.get("timestep_profile")
        self.recast_weights = state.get("recast_weights")
