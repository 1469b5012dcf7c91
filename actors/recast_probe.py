"""ReCAST's probe: estimate E[r_i | x_t] and E[r_i | prompt] for every reward by branching, then W.

P probe trajectories are sampled (prompts and noise seeds fixed by the run seed and the round,
a stream of their own). For each one:
  * M fresh samples of its prompt (each from its own initial noise): their mean is E[r_i | prompt];
  * M branches from its state after k steps, k = 1 .. T-1 (they share the first k steps,
    policy/branching.py branch_trajectories): their mean is E[r_i | x after k steps];
  * after T steps the state is the final image, so E[r_i | x_0] is the recorded row's own reward.
A weighted_sum reward scores every image once and returns each term, so one probe estimates every
reward at once. Reward queries (one per image, however many terms score it; rewards/serving.py):
P (recorded) + P * M (fresh) + P * M * (T - 1) (branches) = P * M * T + P. They go through the
run's reward server with negative sample ids (never a training id) and count in reward_queries.

rho needs non-negative rewards: a reward whose probe minimum is negative (JPEG compressibility
is -kB) is shifted by that minimum (learner/recast.py nonnegative). A shift is monotone, so it
does not change which image the reward prefers, and group/batch advantages do not see it; it
does change rho's scale, which is why it is the smallest shift that makes rho defined, and it is
logged. The estimates then go to learner/recast.py recast_weights: D, the gains, W.

The run probes before the first update, and with recast.every = K > 0 again after every K-th
update. The same function runs in the reference loop (local callables) and on Ray (the driver's
sampler and reward actors), so the two measure the same W.
"""
from __future__ import annotations

import numpy as np
import torch

from diffrlhf.learner.recast import nonnegative, recast_weights
from diffrlhf.policy.branching import FRESH, branch_seed, branch_trajectories
from diffrlhf.policy.sampler import sample_trajectories
from diffrlhf.rewards import weighted_sum_weights

_STREAM = 0x7263  # "rc": the probe's prompts and seeds, apart from training's and the oracle's


def probe_rounds(cfg) -> list[int]:
    """The updates after which ReCAST probes again (0 = before the first one)."""
    if cfg.recast.mode == "off":
        return []
    k = cfg.recast.every
    return [0] + (list(range(k, cfg.train.epochs, k)) if k else [])


def probe_queries(cfg) -> int:
    """Reward queries of one probe: P * M * T + P."""
    p, m, t = cfg.recast.trajectories, cfg.recast.branches, cfg.sample.num_steps
    return p * m * t + p


def _id(cfg, round_: int, index: int) -> int:
    """The negative sample id of the probe's index-th image of round `round_` (unique over the run)."""
    return -(1 + round_ * probe_queries(cfg) + index)


def probe_plan(cfg, prompt_list: list[str], round_: int) -> tuple[list[str], list[int], list[int]]:
    """(prompts, noise seeds, sample ids) of the probe's recorded trajectories of round `round_`."""
    p = cfg.recast.trajectories
    rng = np.random.default_rng([cfg.run.seed, _STREAM, round_])
    prompts = [prompt_list[i] for i in rng.integers(0, len(prompt_list), p)]
    seeds = [int(np.random.SeedSequence([cfg.run.seed, _STREAM, round_, i]).generate_state(1)[0]) for i in range(p)]
    return prompts, seeds, [_id(cfg, round_, i) for i in range(p)]


def _terms(res, ids: list[int], what: str) -> np.ndarray:
    """[len(ids), R] float64 term rewards of `ids` from a ScoreResult; every one must be there."""
    if res.terms is None:
        raise ValueError("ReCAST's probe needs each reward's value: the reward spec must be a weighted_sum")
    got = {sid: row for sid, row in zip(res.ids, np.asarray(res.terms, dtype=np.float64))}
    if len(got) != len(ids) or any(i not in got for i in ids):
        raise ValueError(f"ReCAST's probe lost {len(ids) - len(got)} of {len(ids)} rewards of its {what} (non-finite rewards "
                         "dropped): the conditional means need every image; check the reward")
    return np.stack([got[i] for i in ids])


def measure(cfg, prompt_list: list[str], round_: int, sample, branch_all, score) -> tuple[dict, int]:
    """Run one probe; returns (result, reward queries made).

    sample(prompts, seeds, ids) -> TrajectoryBatch of the recorded probe trajectories (the current policy);
    branch_all(batch, jobs) -> one TrajectoryBatch per job (step, branch seeds), row-major branches
        (step FRESH: independent samples of each row's prompt);
    score(ids, images, prompts) -> ScoreResult with `terms` (the run's weighted_sum reward server).
    result: weights W [R, T], gains and discriminability [R, T], conditional_means [R, T, P] and
    prompt_means [R, P] (shifted), shifts [R], term_names, round, queries."""
    p, m, t = cfg.recast.trajectories, cfg.recast.branches, cfg.sample.num_steps
    prompts, seeds, ids = probe_plan(cfg, prompt_list, round_)
    recorded = sample(prompts, seeds, ids)
    res = score(ids, recorded.images.numpy(), recorded.prompts)
    final = _terms(res, ids, "recorded trajectories")  # [P, R]
    names = res.term_names
    levels = [FRESH] + list(range(1, t))
    jobs = [(k, [branch_seed(s, i, k, b) for i, s in enumerate(seeds) for b in range(m)]) for k in levels]
    outs = branch_all(recorded, jobs)
    obs = []  # per level: [P, M, R]
    for j, out in enumerate(outs):
        bids = [_id(cfg, round_, p + j * p * m + n) for n in range(p * m)]
        what = "fresh samples" if levels[j] == FRESH else f"branches after {levels[j]} steps"
        obs.append(_terms(score(bids, out.images.numpy(), out.prompts), bids, what).reshape(p, m, -1))
    obs = np.stack(obs)  # [1 + (T-1), P, M, R]
    r = final.shape[1]
    every = np.concatenate([final.T.reshape(r, -1), obs.transpose(3, 0, 1, 2).reshape(r, -1)], axis=1)  # [R, all]
    _, shifts = nonnegative(torch.from_numpy(every))
    shift = shifts.numpy()
    prompt_means = (obs[0].mean(1) - shift).T  # [R, P]
    cond = np.concatenate([obs[1:].mean(2), final[None]], axis=0) - shift  # [T, P, R]
    cond = cond.transpose(2, 0, 1)  # [R, T, P]
    budgets = weighted_sum_weights(cfg.reward.spec)
    out = recast_weights(torch.from_numpy(cond), torch.from_numpy(prompt_means), budgets, cfg.recast.alpha, cfg.recast.temperature,
                         cfg.recast.sinkhorn_iterations, cfg.recast.sinkhorn_tolerance)
    queries = p + p * m * t
    result = {"round": round_, "term_names": list(names), "budgets": budgets, "shifts": shift.tolist(),
              "conditional_means": cond, "prompt_means": prompt_means, "queries": queries,
              **{k: v.numpy() for k, v in out.items()}}
    return result, queries


def local_probe(cfg, prompt_list: list[str], round_: int, components, settings, version: int, negative_embeds, score):
    """measure() in this process, on the policy `components` holds (the reference loop's probe)."""
    def branch_all(batch, jobs):
        return [branch_trajectories(components, batch, k, cfg.recast.branches, seeds, settings, negative_embeds)
                for k, seeds in jobs]

    return measure(cfg, prompt_list, round_, lambda pr, se, ids: sample_trajectories(
        components, pr, se, settings, version, ids, negative_embeds), branch_all, score)
