"""The `oracle` timestep weighting's probe: measure the policy's per-step reward variance by branching.

P probe trajectories are sampled (prompts and noise seeds fixed by the run seed and the round,
disjoint from training's); each is branched M times at every level k = 0 .. T-1 (the branches
share the state after k steps; policy/branching.py branch_trajectories) and every branch is
scored. learner/weighting.py oracle_profile turns the rewards [P, T, M] into each step's share of
the reward variance. The probe's P * T * M reward queries are real queries: they go through the
run's reward server (sample ids below 0, so they never meet a training id) and count in the
run's reward_queries, so the curves show the honest cost of knowing these weights.

The run probes before the first update, and with weighting.oracle_every = K > 0 again after every
K-th update (the policy that then samples). The same function runs in the reference loop (local
callables) and on Ray (the driver's sampler and reward actors), so the two measure the same profile.
"""
from __future__ import annotations

import numpy as np
import torch

from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.learner.weighting import oracle_profile
from diffrlhf.policy.branching import branch_seed, branch_trajectories
from diffrlhf.policy.sampler import sample_trajectories


def probe_rounds(cfg) -> list[int]:
    """The updates after which the oracle probes again (0 = before the first one)."""
    if cfg.weighting.scheme != "oracle":
        return []
    k = cfg.weighting.oracle_every
    return [0] + (list(range(k, cfg.train.epochs, k)) if k else [])


def probe_plan(cfg, prompt_list: list[str], round_: int) -> tuple[list[str], list[int], list[int]]:
    """(prompts, noise seeds, sample ids) of the probe trajectories of round `round_` (the update count)."""
    p = cfg.weighting.oracle_trajectories
    rng = np.random.default_rng([cfg.run.seed, 0x6F72, round_])
    prompts = [prompt_list[i] for i in rng.integers(0, len(prompt_list), p)]
    seeds = [int(np.random.SeedSequence([cfg.run.seed, 0x6F72, round_, i]).generate_state(1)[0]) for i in range(p)]
    return prompts, seeds, [-(1 + probe_id(cfg, round_, 0, 0, i)) for i in range(p)]


def probe_id(cfg, round_: int, level: int, trajectory: int, branch: int) -> int:
    """A number unique over the run's probe images (negated and shifted into negative sample ids)."""
    w = cfg.weighting
    per_round = (cfg.sample.num_steps + 1) * w.oracle_trajectories * w.oracle_branches
    return round_ * per_round + (level + 1) * w.oracle_trajectories * w.oracle_branches + trajectory * w.oracle_branches + branch


def measure(cfg, prompt_list: list[str], round_: int, sample, branch_all, score) -> tuple[torch.Tensor, np.ndarray, int]:
    """Run one probe; returns (the oracle profile [T], the reward grid [P, T, M], reward queries made).

    sample(prompts, seeds, ids) -> TrajectoryBatch of the probe trajectories (the current policy);
    branch_all(batch, jobs) -> one TrajectoryBatch per job (step, branch seeds), row-major branches;
    score(ids, images, prompts) -> ScoreResult (ids, rewards) of the run's reward server."""
    p, m, t = cfg.weighting.oracle_trajectories, cfg.weighting.oracle_branches, cfg.sample.num_steps
    prompts, seeds, ids = probe_plan(cfg, prompt_list, round_)
    recorded = sample(prompts, seeds, ids)
    jobs = [(k, [branch_seed(s, i, k, b) for i, s in enumerate(seeds) for b in range(m)]) for k in range(t)]
    branches: list[TrajectoryBatch] = branch_all(recorded, jobs)
    grid = np.zeros((p, t, m))
    for k, out in enumerate(branches):
        bids = [-(1 + probe_id(cfg, round_, k, i, b)) for i in range(p) for b in range(m)]
        res = score(bids, out.images.numpy(), out.prompts)
        got = dict(zip(res.ids, np.asarray(res.rewards, np.float64).tolist()))
        if len(got) != len(bids):
            raise ValueError(f"the oracle probe lost {len(bids) - len(got)} of {len(bids)} rewards at level {k} (non-finite "
                             "rewards dropped): the per-step variance needs every branch; check the reward")
        grid[:, k, :] = np.array([got[i] for i in bids]).reshape(p, m)
    return oracle_profile(grid), grid, p * t * m


def local_probe(cfg, prompt_list: list[str], round_: int, components, settings, version: int, negative_embeds, score):
    """measure() in this process, on the policy `components` holds (the reference loop's probe; and
    the study's, to recompute what a finished run's probe measured)."""
    def branch_all(batch, jobs):
        return [branch_trajectories(components, batch, k, cfg.weighting.oracle_branches, seeds, settings, negative_embeds)
                for k, seeds in jobs]

    return measure(cfg, prompt_list, round_, lambda pr, se, ids: sample_trajectories(
        components, pr, se, settings, version, ids, negative_embeds), branch_all, score)
