"""Branching a recorded trajectory, B2-DiffuRL's branch sampling, and the per-step reward variance
that branching measures.

Branching: keep a recorded trajectory's first k DDIM steps (its latents z_T .. the state after
step k, bit for bit) and continue the chain from there with fresh noise, M times. The
continuation is the sampler's own loop (policy/sampler.py run_chain: the same UNet call, the same
DDIM step and log-prob, eta > 0 as in training), so a branch is a draw from the policy given the
prefix. All branches of a call run in one batch.

The variance: with R the final reward and F_k what the prefix fixes (k = -1: only the prompt,
k = 0: also the initial noise z_T, k >= 1: the state after step k), the law of total variance
gives Var(R | prompt) = sum over the levels of E[Var(R | F_{k-1})] - E[Var(R | F_k)], with
Var(R | F_T) = 0 after the last step (a deterministic decoder and reward). Each difference is the
reward variance that one source of noise contributes: the initial noise, then each DDIM step.
`per_step_variance` estimates them from a grid rewards[P, L, M] (P recorded trajectories, L
nested levels, M branches each) with the unbiased within-group variance (ddof=1), so a finite M
adds no bias, and the standard error over the P trajectories (independent draws).
"""
from __future__ import annotations

import numpy as np
import torch

from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.policy.prompts import BatchPlan
from diffrlhf.policy.sampler import SamplingSettings, gaussian_noise, run_chain, sample_trajectories

FRESH = -1  # branch step meaning "share only the prompt": each branch draws its own initial noise (a full sample)


def branch_seed(seed: int, trajectory: int, step: int, branch: int) -> int:
    """The noise seed of one branch: distinct for every (trajectory, step, branch), fixed by `seed`."""
    return int(np.random.SeedSequence([int(seed), 0x6272, int(trajectory), int(step) + 1, int(branch)]).generate_state(1)[0])


@torch.no_grad()
def branch_trajectories(components, batch: TrajectoryBatch, step: int, num_branches: int, seeds, settings: SamplingSettings,
                        negative_embeds: torch.Tensor | None = None, sample_ids=None) -> TrajectoryBatch:
    """Continue every row of a recorded `batch` from its state after `step` DDIM steps, `num_branches` times.

    step: 0..T, the number of steps the branches share (0: the initial noise z_T; T: the whole chain,
        so every branch is the recorded trajectory); FRESH (-1): only the prompt, each branch starts
        from its own initial noise (an independent full sample of the prompt, as sample_trajectories
        with the branch's seed gives).
    seeds: one noise seed per branch, len(batch) * num_branches, row-major (a row's branches are
        consecutive); each branch draws its steps' noise (and for FRESH its initial noise) from a
        generator seeded with it, as the sampler does.
    Returns len(batch) * num_branches trajectories in the same order: latents and log-probs of the
    first `step` steps copied from the recorded row (so a branch group shares its prefix exactly),
    the rest sampled; images decoded from each branch's final latents; the recorded prompts,
    embeddings and policy version; `seeds` as seeds; sample_ids (default 0..n-1).
    """
    n_steps = batch.num_steps
    if n_steps != settings.num_steps:
        raise ValueError(f"the batch has {n_steps} DDIM steps, the settings {settings.num_steps}")
    if not FRESH <= step <= n_steps:
        raise ValueError(f"branch step must be in {FRESH}..{n_steps} (steps shared), got {step}")
    if num_branches < 1:
        raise ValueError(f"num_branches must be >= 1, got {num_branches}")
    n = len(batch) * num_branches
    seeds = [int(s) for s in seeds]
    if len(seeds) != n:
        raise ValueError(f"{len(batch)} rows x {num_branches} branches need {n} seeds, got {len(seeds)}")
    unet, scheduler = components.unet, components.scheduler
    device, dtype = components.device, unet.dtype
    scheduler.set_timesteps(settings.num_steps, device="cpu")
    timesteps = scheduler.timesteps.clone()
    if not torch.equal(batch.timesteps, timesteps.long().unsqueeze(0).expand(len(batch), -1)):
        raise ValueError(f"the batch's timesteps are not this scheduler's for {settings.num_steps} steps")
    rep = lambda t: t.repeat_interleave(num_branches, dim=0)  # noqa: E731  (row-major: a row's branches together)
    prompt_embeds = rep(batch.prompt_embeds).to(device, dtype)
    if negative_embeds is None:
        negative_embeds = components.encode_prompts([settings.negative_prompt])
    gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    shared = max(step, 0)  # recorded steps kept
    if step == FRESH:
        z = gaussian_noise(gens, tuple(batch.latents.shape[2:]), device, dtype) * scheduler.init_noise_sigma
        prefix = [z.float().cpu()]
    else:
        prefix = list(rep(batch.latents[:, : step + 1]).unbind(1))
        z = prefix[-1].to(device, dtype)
    latents, logps = run_chain(components, z, timesteps[shared:], prompt_embeds, negative_embeds, settings, gens)
    all_latents = torch.stack(prefix + [x.float().cpu() for x in latents], dim=1)
    new_logp = [x.float().cpu() for x in logps]
    log_probs = torch.cat([rep(batch.log_probs[:, :shared])] + ([torch.stack(new_logp, dim=1)] if new_logp else []), dim=1)
    return TrajectoryBatch(
        prompts=[p for p in batch.prompts for _ in range(num_branches)],
        latents=all_latents,
        timesteps=rep(batch.timesteps),
        log_probs=log_probs,
        prompt_embeds=rep(batch.prompt_embeds),
        images=components.decode_images(all_latents[:, -1].to(device, dtype)),
        seeds=torch.as_tensor(seeds, dtype=torch.long),
        policy_version=rep(batch.policy_version),
        sample_ids=torch.as_tensor(list(range(n)) if sample_ids is None else list(sample_ids), dtype=torch.long),
        meta={**settings.meta(), "branch_step": int(step)},
    )


@torch.no_grad()
def sample_branched(components, prompts: list[str], seeds: list[int], settings: SamplingSettings, policy_version: int,
                    sample_ids: list[int], branch_step: int, group_size: int,
                    negative_embeds: torch.Tensor | None = None) -> TrajectoryBatch:
    """B2-DiffuRL's branch sampling: each run of `group_size` consecutive rows (one prompt) shares
    one prefix of `branch_step` DDIM steps, then every row continues with its own noise.

    The prefix is the trajectory sample_trajectories makes from the group's first seed (its initial
    noise and its first branch_step steps' noise); row r's continuation draws its noise from
    branch_seed(seeds[r], 0, branch_step, 0), so it is reproducible in any batch. The prefix runs
    once per group (P * branch_step + B * (T - branch_step) UNet calls instead of B * T); its latents
    and log-probs are copied into every row, so a group shares them bit for bit. branch_step = T
    would make identical rows and is refused; 0 shares only the initial noise.
    """
    n, t_total = len(prompts), settings.num_steps
    if len(seeds) != n or len(sample_ids) != n:
        raise ValueError(f"prompts ({n}), seeds ({len(seeds)}) and sample_ids ({len(sample_ids)}) must match")
    if group_size < 2 or n % group_size:
        raise ValueError(f"branch groups of {group_size} rows need group_size >= 2 dividing the batch ({n} rows)")
    if not 0 <= branch_step < t_total:
        raise ValueError(f"branch_step must be in 0..{t_total - 1} (steps the branches share), got {branch_step}")
    heads = list(range(0, n, group_size))
    for h in heads:
        if len(set(prompts[h:h + group_size])) != 1:
            raise ValueError(f"a branch group must share its prompt, rows {h}..{h + group_size - 1} have {prompts[h:h + group_size]}")
    device, dtype = components.device, components.unet.dtype
    components.scheduler.set_timesteps(t_total, device="cpu")
    timesteps = components.scheduler.timesteps.clone()
    if negative_embeds is None:
        negative_embeds = components.encode_prompts([settings.negative_prompt])
    embeds = components.encode_prompts([prompts[h] for h in heads])
    gens = [torch.Generator("cpu").manual_seed(int(seeds[h])) for h in heads]
    h_lat = settings.resolution // components.vae_scale_factor
    z = gaussian_noise(gens, (components.unet.config.in_channels, h_lat, h_lat), device, dtype) * components.scheduler.init_noise_sigma
    pre_latents, pre_logps = run_chain(components, z, timesteps[:branch_step], embeds, negative_embeds, settings, gens)
    rep = lambda x: x.float().cpu().repeat_interleave(group_size, dim=0)  # noqa: E731
    prefix = [rep(x) for x in [z] + pre_latents]
    z = prefix[-1].to(device, dtype)
    branch_gens = [torch.Generator("cpu").manual_seed(branch_seed(s, 0, branch_step, 0)) for s in seeds]
    embeds = embeds.repeat_interleave(group_size, dim=0)
    latents, logps = run_chain(components, z, timesteps[branch_step:], embeds, negative_embeds, settings, branch_gens)
    all_latents = torch.stack(prefix + [x.float().cpu() for x in latents], dim=1)
    return TrajectoryBatch(
        prompts=list(prompts),
        latents=all_latents,
        timesteps=timesteps.long().unsqueeze(0).repeat(n, 1),
        log_probs=torch.stack([rep(x) for x in pre_logps] + [x.float().cpu() for x in logps], dim=1),
        prompt_embeds=embeds.float().cpu(),
        images=components.decode_images(all_latents[:, -1].to(device, dtype)),
        seeds=torch.as_tensor(seeds, dtype=torch.long),
        policy_version=torch.full((n,), int(policy_version), dtype=torch.long),
        sample_ids=torch.as_tensor(sample_ids, dtype=torch.long),
        meta=settings.meta(),  # no branch step here: replay mixes epochs that branched at different steps
    )


def sample_plan(components, plan: BatchPlan, settings: SamplingSettings, policy_version: int,
                negative_embeds: torch.Tensor | None = None) -> TrajectoryBatch:
    """What a sampler runs for a planned batch: independent samples, or branch groups when the plan
    says so (the algorithm's branch_step). The reference loop and the sampler actors both call this."""
    if plan.branch_step is None:
        return sample_trajectories(components, plan.prompts, plan.seeds, settings, policy_version, plan.sample_ids,
                                   negative_embeds)
    return sample_branched(components, plan.prompts, plan.seeds, settings, policy_version, plan.sample_ids,
                           plan.branch_step, plan.group_size, negative_embeds)


# ----------------------------------------------------------------------------- the estimator (pure)


def _group_variances(rewards) -> torch.Tensor:
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.ndim != 3 or r.shape[2] < 2:
        raise ValueError(f"rewards must be [P trajectories, L levels, M >= 2 branches], got {tuple(r.shape)}")
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite")
    return r.var(dim=2, unbiased=True)  # [P, L]: the unbiased variance of each branch group


def _mean_se(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over the first axis (trajectories) and its standard error (NaN for one trajectory)."""
    p = x.shape[0]
    se = x.std(dim=0, unbiased=True) / p**0.5 if p > 1 else torch.full(x.shape[1:], float("nan"), dtype=x.dtype)
    return x.mean(dim=0), se


def conditional_variances(rewards) -> tuple[torch.Tensor, torch.Tensor]:
    """E[Var(R | F_l)] for each level l of rewards[P, L, M], and its standard error over the P trajectories.

    rewards[p, l, :] are M rewards of branches that share trajectory p's prefix at level l (levels
    nested, coarsest first); their unbiased variance (ddof=1) is an unbiased estimate of
    Var(R | F_l) at trajectory p's state, and the mean over trajectories of E[Var(R | F_l)]."""
    return _mean_se(_group_variances(rewards))


def per_step_variance(rewards) -> tuple[torch.Tensor, torch.Tensor]:
    """The variance each level adds: shares[l] = E[Var(R | F_l)] - E[Var(R | F_{l+1})], with
    E[Var(R | F_L)] = 0 after the last level; (shares [L], standard errors [L]) in float64.

    The shares add up to the first level's E[Var(R | F_0)] exactly (law of total variance). The
    standard error is over trajectories, of each trajectory's own difference (the levels of one
    trajectory are paired)."""
    v = _group_variances(rewards)
    d = v - torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    return _mean_se(d)


def pearson(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties get their mean rank."""
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x), np.float64)
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tie = x == v
        if tie.sum() > 1:
            r[tie] = r[tie].mean()
    return r


def spearman(x, y) -> float:
    """Spearman's rank correlation: Pearson's on the ranks (ties averaged)."""
    return pearson(_ranks(np.asarray(x, np.float64)), _ranks(np.asarray(y, np.float64)))
