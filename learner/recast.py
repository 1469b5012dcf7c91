"""ReCAST (Reward Credit Assignment across Timesteps): a reward-by-step weight matrix W [R, T].

For R rewards and a T-step denoising chain:
  1. discriminability D_i(t): the Renyi divergence of rho_i(x_t) = E[r_i | x_t] / E[r_i | prompt]
     over observed states, at the state after step t (D_i(0) = 0 at pure noise);
  2. gains g_i(t) = max(D_i(t) - D_i(t-1), 0): how much step t tells about reward i;
  3. W by Sinkhorn on the kernel exp(g_hat / tau_i), g_hat = each reward's gains over their mean,
     with row sums lambda_i / sum(lambda) (the user's budgets) and column sums 1 / T.
Training uses T * W: each step's weights over the rewards sum to 1.

Pure functions on torch tensors, float64 inside. After yhangchen/ReCAST-code, recast/weighting.py.
"""
from __future__ import annotations

import math

import torch

from diffrlhf.keys import check, default


class SinkhornError(RuntimeError):
    """Sinkhorn did not meet its marginals within the iterations it was given."""


def _float64(x, name: str) -> torch.Tensor:
    x = torch.as_tensor(x, dtype=torch.float64)
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} must be finite, got {x.tolist()}")
    return x


def renyi_divergence(ratios: torch.Tensor, alpha: float = default("recast.alpha")) -> torch.Tensor:
    """Renyi divergence of order alpha from density ratios, over the last dim (the observed states):
    log(mean(ratios ** alpha)) / (alpha - 1)."""
    if not math.isfinite(alpha):
        raise ValueError(f"alpha must be finite, got {alpha}")
    check("recast.alpha", alpha)  # > 0 and != 1
    ratios = torch.as_tensor(ratios, dtype=torch.float64)
    if ratios.ndim == 0 or ratios.shape[-1] == 0:
        raise ValueError(f"ratios need a non-empty last dim (the observed states), got shape {tuple(ratios.shape)}")
    if not torch.isfinite(ratios).all():
        raise ValueError("ratios must be finite")
    if (ratios < 0).any():
        raise ValueError(f"ratios must be non-negative (density ratios), min is {ratios.min().item()}")
    # the clamp keeps an all-zero set of ratios finite (log 0 = -inf)
    return torch.log((ratios**alpha).mean(-1).clamp(min=1e-30)) / (alpha - 1)


def discriminability(conditional_means: torch.Tensor, prompt_means: torch.Tensor, alpha: float = default("recast.alpha")) -> torch.Tensor:
    """D [R, T]: the Renyi divergence of rho = E[r_i | x_t] / E[r_i | prompt] over N probe trajectories.

    conditional_means [R, T, N]: E[r_i | state after step t = 1..T of trajectory n];
    prompt_means [R, N]: E[r_i | prompt of trajectory n]. D(0) = 0 (pure noise) is implicit."""
    cond = _float64(conditional_means, "conditional_means")
    prompt = _float64(prompt_means, "prompt_means")
    if cond.ndim != 3 or prompt.ndim != 2 or prompt.shape != (cond.shape[0], cond.shape[2]):
        raise ValueError(f"need conditional_means [R, T, N] and prompt_means [R, N], got "
                         f"{tuple(cond.shape)} and {tuple(prompt.shape)}")
    if (cond < 0).any():
        raise ValueError("conditional_means must be non-negative: shift the rewards with `nonnegative` first")
    if (prompt <= 0).any():
        raise ValueError("prompt_means must be > 0 (rho divides by them): make the rewards non-negative "
                         "with `nonnegative` first, and probe prompts whose mean reward is not 0")
    return renyi_divergence(cond / prompt[:, None, :], alpha)


def timestep_gains(d: torch.Tensor) -> torch.Tensor:
    """Per-step gains [R, T] of discriminability D [R, T]: max(D(t) - D(t-1), 0), with D(0) = 0.

    For a non-decreasing D they telescope: sum_t g(t) = D(T)."""
    d = _float64(d, "discriminability")
    if d.ndim != 2:
        raise ValueError(f"need D [R, T], got shape {tuple(d.shape)}")
    # a dip (estimation noise) is a step that adds nothing, not negative credit
    return torch.diff(d, dim=-1, prepend=torch.zeros_like(d[:, :1])).clamp(min=0)


def nonnegative(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift each reward with a negative minimum so that its minimum is 0: (shifted, shifts [R]).

    rewards [R, ...]: row i holds every observation of reward i in the probe; shifted = rewards - shifts,
    shifts = that minimum where it is < 0, else 0. rho needs non-negative rewards, and a shift is a
    monotone transform: it does not change which image a reward prefers, and group/batch advantages
    are invariant to it. Apply the same shift to every estimate of reward i."""
    rewards = _float64(rewards, "rewards")
    if rewards.ndim == 0 or rewards.numel() == 0:
        raise ValueError(f"need rewards [R, ...] with at least one observation, got shape {tuple(rewards.shape)}")
    shifts = rewards.reshape(rewards.shape[0], -1).amin(1).clamp(max=0)
    return rewards - shifts.reshape(-1, *([1] * (rewards.ndim - 1))), shifts


def sinkhorn_weights(gains: torch.Tensor, budgets, temperatures=default("recast.temperature"),
                     iterations: int = default("recast.sinkhorn_iterations"), tolerance: float = default("recast.sinkhorn_tolerance")) -> torch.Tensor:
    """W [R, T] float64 by log-domain Sinkhorn on exp(g_hat / tau): rows budgets / sum(budgets), columns 1 / T.

    gains [R, T] >= 0; budgets [R] > 0; temperatures a float or [R], > 0. g_hat is each row of gains
    over its mean (a row of zeros: all ones). Raises SinkhornError when the marginals are not met to
    `tolerance` (max abs error) within `iterations`."""
    g = _float64(gains, "gains")
    if g.ndim != 2 or g.numel() == 0:
        raise ValueError(f"need gains [R, T], got shape {tuple(g.shape)}")
    n_rewards, n_steps = g.shape
    if (g < 0).any():
        raise ValueError(f"gains must be non-negative, min is {g.min().item()}")
    lam = _float64(budgets, "budgets").reshape(-1)
    if lam.shape != (n_rewards,) or (lam <= 0).any():
        raise ValueError(f"budgets must be {n_rewards} values > 0 (one per reward), got {lam.tolist()}")
    tau = _float64(temperatures, "temperatures").reshape(-1)
    if tau.numel() == 1:
        tau = tau.expand(n_rewards)
    if tau.shape != (n_rewards,) or (tau <= 0).any():
        raise ValueError(f"temperatures must be a float or {n_rewards} values, > 0, got {tau.tolist()}")
    if int(iterations) != iterations or math.isnan(tolerance):
        raise ValueError(f"need an int number of iterations and a number as tolerance, got {iterations} and {tolerance}")
    check("recast.sinkhorn_iterations", iterations), check("recast.sinkhorn_tolerance", tolerance)

    # dividing by the mean makes the kernel free of each reward's scale; tau alone sets its sharpness
    mean = g.mean(1, keepdim=True)
    g_hat = torch.where(mean > 0, g / torch.where(mean > 0, mean, 1.0), torch.ones_like(g))
    log_k = g_hat / tau[:, None]
    rows, cols = lam / lam.sum(), torch.full((n_steps,), 1.0 / n_steps, dtype=torch.float64)
    log_rows, log_cols = rows.log(), cols.log()

    # log domain: exp(g_hat / tau) overflows for small tau, logsumexp does not
    u = torch.zeros(n_rewards, dtype=torch.float64)
    v = torch.zeros(n_steps, dtype=torch.float64)
    for _ in range(int(iterations)):
        u = log_rows - torch.logsumexp(log_k + v[None, :], dim=1)
        v = log_cols - torch.logsumexp(log_k + u[:, None], dim=0)
        w = torch.exp(log_k + u[:, None] + v[None, :])
        residual = max((w.sum(1) - rows).abs().max().item(), (w.sum(0) - cols).abs().max().item())
        if residual <= tolerance:
            return w
    raise SinkhornError(f"Sinkhorn did not converge in {int(iterations)} iterations: marginal residual "
                        f"{residual:.3e} > tolerance {tolerance:.1e} (raise iterations or the temperatures)")


def recast_weights(conditional_means, prompt_means, budgets, alpha=default("recast.alpha"), temperatures=default("recast.temperature"),
                   iterations=default("recast.sinkhorn_iterations"), tolerance=default("recast.sinkhorn_tolerance")) -> dict:
    """The whole ReCAST pass: {"discriminability": D [R, T], "gains": g [R, T], "weights": W [R, T]}."""
    d = discriminability(conditional_means, prompt_means, alpha)
    g = timestep_gains(d)
    return {"discriminability": d, "gains": g,
            "weights": sinkhorn_weights(g, budgets, temperatures, iterations, tolerance)}

