"""The measurement probes on the run's actors: the `oracle` weighting's per-step variance
(actors/oracle.py) and ReCAST's W (actors/recast_probe.py). Each samples on sampler 0, branches over
every sampler, scores on reward actor 0, hands its result to the learners (and the buffer), and
returns the reward queries it made, which count as the run's."""
from __future__ import annotations

import numpy as np
import ray
import torch

from diffrlhf.actors import oracle, recast_probe
from diffrlhf.actors.ray_errors import error_text
from diffrlhf.actors.scheduler import RunFailed
from diffrlhf.policy.prompts import BatchPlan


def probe_callables(samplers: list, rewards: list, round_: int, weights, branches: int, timeout_s: float):
    """sample, branch_all and score of a probe with the policy `weights` (an object ref of (version,
    flat LoRA)): the branches over every sampler, the scores on reward actor 0."""

    def sample(prompts, seeds, ids):  # the recorded batch with its images (the probe scores them)
        plan = BatchPlan(-1, round_, prompts, seeds, ids)
        reward_input, batch = ray.get(samplers[0].sample.options(num_returns=3).remote(plan, weights)[1:], timeout=timeout_s)
        return batch.with_(images=torch.from_numpy(np.asarray(reward_input["images"])))

    def branch_all(batch, jobs):
        refs = [samplers[i % len(samplers)].branch.remote(batch, k, branches, seeds, weights) for i, (k, seeds) in enumerate(jobs)]
        return ray.get(refs, timeout=timeout_s)

    def score(ids, images, prompts):
        return ray.get(rewards[0].score.remote({"ids": ids, "images": images, "prompts": prompts}), timeout=timeout_s)

    return sample, branch_all, score


def oracle_probe(cfg, prompts: list[str], round_: int, weights, samplers: list, rewards: list, learners: list) -> int:
    """The oracle weighting's probe: the profile to every learner rank; returns its queries."""
    t = cfg.system.idle_timeout_s
    try:
        profile, _, queries = oracle.measure(cfg, prompts, round_,
                                             *probe_callables(samplers, rewards, round_, weights, cfg.weighting.oracle_branches, t))
    except (ray.exceptions.RayError, ValueError) as e:
        raise RunFailed(f"the oracle weighting's probe after {round_} updates failed: {error_text(e)}") from None
    ray.get([a.set_timestep_profile.remote(profile) for a in learners], timeout=t)
    return queries


def recast_weights_probe(cfg, prompts: list[str], round_: int, weights, samplers: list, rewards: list, learners: list,
                         buffer, logger=None) -> int:
    """ReCAST's probe: W to the buffer and every learner rank, logged; returns its queries."""
    t = cfg.system.idle_timeout_s
    try:
        result, queries = recast_probe.measure(cfg, prompts, round_,
                                               *probe_callables(samplers, rewards, round_, weights, cfg.recast.branches, t))
    except (ray.exceptions.RayError, ValueError, RuntimeError) as e:
        raise RunFailed(f"ReCAST's probe after {round_} updates failed: {error_text(e)}") from None
    w = result["weights"]
    ray.get([a.set_recast_weights.remote(w) for a in learners] + [buffer.set_recast_weights.remote(w)], timeout=t)
    if logger is not None:
        logger.log_recast(result)
    return queries


def probes_at(cfg, prompts: list[str], round_: int, weights, samplers: list, rewards: list, learners: list, buffer, logger) -> int:
    """The probes due at this round (before its checkpoint, which then holds the new profile or W);
    the reward queries they made."""
    queries = 0
    if round_ in oracle.probe_rounds(cfg):
        queries += oracle_probe(cfg, prompts, round_, weights, samplers, rewards, learners)
    if round_ in recast_probe.probe_rounds(cfg):
        queries += recast_weights_probe(cfg, prompts, round_, weights, samplers, rewards, learners, buffer, logger)
    return queries
