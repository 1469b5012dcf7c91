"""Per-timestep weights w(t): the loss at DDIM step i uses w_i * A instead of A.

Every scheme returns a [T] vector over the chain's steps (index 0 = the first, noisiest step),
normalised to mean 1 over the T steps: sum_i w_i = T. With that normalisation `uniform` is
w_i = 1 exactly, so the weighted loss *is* DDPO's loss, and every scheme keeps the total
advantage mass per trajectory that DDPO uses (it only redistributes credit across steps).
"""
from __future__ import annotations

import torch

from diffrlhf.keys import check, choices
from diffrlhf.policy.branching import per_step_variance
from diffrlhf.policy.ddim import ddim_std

SCHEMES = choices("weighting.scheme")
_GAUSSIAN_CENTRES = {"gaussian_early": 0.0, "gaussian_mid": 0.5, "gaussian_late": 1.0}


def normalise_mean_one(w: torch.Tensor) -> torch.Tensor:
    w = w.double()
    total = w.sum()
    if not torch.isfinite(total) or total <= 0:
        raise ValueError(f"timestep weights must be finite and not all zero, got {w.tolist()}")
    return (w * (w.numel() / total)).float()


def latent_change(latents: torch.Tensor, power: int, reduce=None) -> torch.Tensor:
    """Mean over the batch and latent elements of |z_{i+1} - z_i|^power, per step: [T].

    `reduce` (in-place sum over a learner group's ranks) makes it the mean over every rank's rows."""
    d = (latents[:, 1:] - latents[:, :-1]).abs().double() ** power
    dims = tuple(i for i in range(d.ndim) if i != 1)
    if reduce is None:
        return d.mean(dim=dims)
    sums = reduce(torch.cat([d.sum(dim=dims), torch.tensor([d.numel() / d.shape[1]], dtype=torch.float64)]))
    return sums[:-1] / sums[-1]


def oracle_profile(rewards) -> torch.Tensor:
    """The `oracle` weights from a branching probe: rewards[P, T, M], level k = M branches sharing
    the state after k steps (k = 0: the initial noise only). Step i's share of the reward variance
    is E[Var(R | after i steps)] - E[Var(R | after i+1 steps)] (policy/branching.py per_step_variance,
    the law of total variance), the quantity Var(A_t) the weighting wants. A share estimated below 0
    (sampling noise of a small probe) is a step that adds nothing: weight 0. [T] float64, not normalised."""
    shares, _ = per_step_variance(rewards)
    w = shares.clamp(min=0)
    if not (w > 0).any():
        raise ValueError("the oracle probe measured no positive per-step variance (every step's share <= 0); "
                         "raise weighting.oracle_trajectories or weighting.oracle_branches")
    return w


def timestep_weights(
    scheme: str,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    scheduler=None,
    eta: float = 1.0,
    gaussian_width: float = 0.2,
    reduce=None,
    profile: torch.Tensor | None = None,
) -> torch.Tensor:
    """w [T] for `scheme` on a batch with latents [B, T+1, ...] and timesteps [B, T] (or [T]).

    uniform        1 at every step (DDPO).
    latent_sq      mean squared latent change |z_t - z_{t-1}|^2, measured on this batch (dynamic).
    latent_abs     mean absolute latent change |z_t - z_{t-1}|, measured on this batch.
    ddim_std       the sampler's std at t, eta * sqrt(beta_tilde_t) (static; needs the scheduler).
    gaussian_*     exp(-(u - c)^2 / (2 width^2)) with u = i / (T-1) the position in the chain and
                   c = 0 (early, noisy steps), 0.5 (mid) or 1 (late, nearly clean steps).
    oracle         `profile`, the per-step reward variance a branching probe measured on the policy
                   (oracle_profile; actors/oracle.py runs the probe and counts its reward queries).
    """
    t = timesteps[0] if timesteps.ndim == 2 else timesteps
    n = t.numel()
    if scheme == "uniform":
        w = torch.ones(n)
    elif scheme == "latent_sq":
        w = latent_change(latents, 2, reduce)
    elif scheme == "latent_abs":
        w = latent_change(latents, 1, reduce)
    elif scheme == "ddim_std":
        if scheduler is None:
            raise ValueError("timestep weighting 'ddim_std' needs the DDIM scheduler")
        w = ddim_std(scheduler, t.long(), eta)
    elif scheme in _GAUSSIAN_CENTRES:
        check("weighting.gaussian_width", gaussian_width)  # > 0, as the key table declares
        u = torch.linspace(0, 1, n, dtype=torch.float64) if n > 1 else torch.zeros(1, dtype=torch.float64)
        w = torch.exp(-((u - _GAUSSIAN_CENTRES[scheme]) ** 2) / (2 * gaussian_width**2))
    elif scheme == "oracle":
        if profile is None:
            raise ValueError("timestep weighting 'oracle' needs the measured per-step variance profile; the run measures it "
                             "before the first update (actors/oracle.py)")
        if profile.numel() != n:
            raise ValueError(f"the oracle profile has {profile.numel()} steps, the batch {n}")
        w = profile
    else:
        raise ValueError(f"unknown timestep weighting scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    return normalise_mean_one(w)
