"""Which of a trajectory's T steps the learner trains, and with what correction.

The full weighted update of one trajectory b is the mean over its T steps of the clipped PPO
term with step advantage w_i * A_b. Training k < T steps cuts the learner's UNet passes by k/T;
each selection returns, per trajectory, the k step indices and a coefficient c per chosen step,
and the update averages c * (term with advantage w_i * A_b) over the k steps. Since the clipped
term is positively homogeneous in the advantage, c can multiply the advantage.

  all       every step (DDPO); k must be T. Same draws and order as `random` at fraction 1.
  random    DDPO's `timestep_fraction`: k steps uniformly without replacement, c = 1. Every
            step is in with probability k/T, so the mean over k is unbiased for the mean over T.
  weighted  k steps drawn without replacement with inclusion probability pi_i proportional to w_i
            (capped at 1, the excess spread over the rest), by systematic sampling on a random
            order of the steps, which hits every pi_i exactly. c_i = k / (T pi_i) (Horvitz-
            Thompson): E[sum_{i in S} c_i x_i] / k = sum_i pi_i k/(T pi_i) x_i / k = mean_i x_i,
            so the expected gradient is the all-steps weighted gradient. Uncapped, c_i = 1 / w_i:
            the chosen steps are trained with the plain advantage A; the weights decide *which*
            steps are trained instead of how much. Steps with w_i = 0 contribute nothing to the
            full update and are never drawn (k shrinks if fewer than k steps have w_i > 0).
  top       the k steps with the largest w_i, c = 1 (deterministic and biased: the greedy end).
  window    MixGRPO's sliding window: k consecutive steps starting at
            floor(p * (T - k + 1)) (capped at T - k), p = updates done / train.epochs, so the
            window moves from the first (noisiest) steps to the last over training and spends
            an equal share of the epochs at each position; c = 1.
  backward  B2-DiffuRL's backward progressive training: the last k_p steps, in a random order per
            trajectory, c = 1, where k_p = backward_trained_steps(T, k, p) grows from k (the first
            stage, k = round(T * fraction)) to T over training: k_p = min(T, k + floor(p (T - k + 1))),
            p = updates done / train.epochs (the reference's stage schedule, one stage per epoch).
            Under algorithm.name=b2diffurl the samplers branch at step T - k_p of the same epoch.
"""
from __future__ import annotations

import torch

from diffrlhf.keys import choices
SELECTIONS = choices("train.timestep_selection")


def num_trained_steps(num_steps: int, fraction: float) -> int:
    """k = round(T * fraction), at least 1."""
    return max(1, int(round(num_steps * fraction)))


def backward_trained_steps(num_steps: int, first: int, progress: float) -> int:
    """B2-DiffuRL's stage schedule: how many of the last steps are trained at `progress` in [0, 1]
    (updates done / epochs), from `first` at the start to all num_steps in the last stage."""
    if not 1 <= first <= num_steps:
        raise ValueError(f"the first stage trains 1..{num_steps} steps, got {first}")
    # + 1e-9: progress is epoch / epochs, and a float like 6.999999 must floor as the integer schedule's 7
    return min(num_steps, first + int(progress * (num_steps - first + 1) + 1e-9))


def inclusion_probabilities(w: torch.Tensor, k: int) -> torch.Tensor:
    """pi [T] with sum k, pi_i = min(1, c w_i) for the c that makes them sum to k (float64).

    k is first cut to the number of positive weights (zero-weight steps are never drawn)."""
    w = w.double().clamp(min=0)
    k = min(k, int((w > 0).sum()))
    if k == 0:
        raise ValueError(f"timestep weights must have a positive entry, got {w.tolist()}")
    capped = torch.zeros_like(w, dtype=torch.bool)
    while True:  # at most T rounds: each round caps at least one more step or stops
        free = (~capped) & (w > 0)
        pi = torch.where(capped, torch.ones_like(w), w * (k - int(capped.sum())) / w[free].sum())
        over = (pi > 1) & ~capped
        if not over.any():
            return pi.clamp(max=1.0)
        capped |= over


def systematic_sample(pi: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """round(sum pi) distinct indices, index i included with probability exactly pi_i (all <= 1).

    The steps are put in a random order, laid end to end as intervals of length pi_i on [0, k),
    and one uniform u picks the intervals holding u, u+1, ..., u+k-1 (Madow's systematic PPS)."""
    k = int(round(float(pi.sum())))
    order = torch.randperm(pi.numel(), generator=gen)
    ends = torch.cumsum(pi[order], 0)
    points = torch.rand(1, generator=gen, dtype=torch.float64) + torch.arange(k, dtype=torch.float64)
    picks = torch.searchsorted(ends, points, right=True).clamp(max=pi.numel() - 1)
    return order[picks]


def select_timesteps(selection: str, w: torch.Tensor, batch_size: int, k: int, gen: torch.Generator,
                     progress: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(steps [B, k'] long, coef [B, k'] float32) for B trajectories; k' = k except for `weighted`
    with fewer than k positive weights. Column j is the j-th trained step of each trajectory.
    `progress` in [0, 1] places the `window`."""
    t = w.numel()
    if selection in ("all", "random"):
        if selection == "all" and k != t:
            raise ValueError(f"timestep selection 'all' trains every step: train.timestep_fraction must be 1 (got k={k} of {t})")
        # DDPO's draws: one permutation of the steps per trajectory, the first k trained.
        steps = torch.stack([torch.randperm(t, generator=gen) for _ in range(batch_size)])[:, :k]
        return steps, torch.ones(batch_size, k)
    if selection == "weighted":
        pi = inclusion_probabilities(w, k)
        steps = torch.stack([systematic_sample(pi, gen) for _ in range(batch_size)])
        k_eff = steps.shape[1]
        return steps, (k_eff / (t * pi[steps])).float()
    if selection == "top":
        top = torch.topk(w.double(), k).indices.sort().values
        return top.expand(batch_size, k).clone(), torch.ones(batch_size, k)
    if selection == "window":
        start = min(t - k, int(progress * (t - k + 1)))
        return torch.arange(start, start + k).expand(batch_size, k).clone(), torch.ones(batch_size, k)
    if selection == "backward":
        kp = backward_trained_steps(t, k, progress)
        # The reference trains the segment's steps in a fresh random order per trajectory.
        steps = torch.stack([t - kp + torch.randperm(kp, generator=gen) for _ in range(batch_size)])
        return steps, torch.ones(batch_size, kp)
    raise ValueError(f"unknown timestep selection {selection!r}; choose one of {', '.join(SELECTIONS)}")
