"""Credit: how an epoch's rewards become the advantages the learner trains on, step by step.

A credit scheme (config `recast.mode`) is a pair of plain parts that share one contract, the
batch's `term_advantages`: the buffer's `RecastCredit.term_advantages` (here, over a whole epoch)
and the learner's `step_advantages` (learner/credit.py). Three schemes:

- `off` (DDPO, and every run with one reward): one advantage per row from the final reward,
  every step trains on it (times the timestep weight w(t)). No term advantages.
- `pre` (ReCAST's default aggregation): per step s, the mixed reward
  m_s = Lambda * sum_i (T W)_i,s r_i (Lambda = the sum of the budgets, so m_s is in the weighted
  sum's units), normalised into an advantage per step: term_advantages [B, T].
- `loss`: per reward i its own advantage A_i: term_advantages [B, R]; the learner weights
  reward i's loss at step s by (T W)_i,s.

W [R, T] is ReCAST's reward-by-step matrix (learner/recast.py; row sums lambda_i / Lambda, column
sums 1 / T). With W = lambda_i / (Lambda T) everywhere (equal gain profiles) m_s is the weighted
sum's reward at every step, so `pre` then trains exactly as `off` on the weighted sum.
"""
from __future__ import annotations

import numpy as np

from diffrlhf.keys import choices
RECAST_MODES = choices("recast.mode")


def check_weights(weights, num_rewards: int, num_steps: int) -> np.ndarray:
    """W as float64 [R, T], checked against the batch's rewards and steps."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (num_rewards, num_steps):
        raise ValueError(f"ReCAST weights are {w.shape} but the batch has {num_rewards} rewards and {num_steps} steps: "
                         "measure W with the run's reward spec and sample.num_steps")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("ReCAST weights must be finite and non-negative")
    return w


def recast_advantages(mode: str, prompts: list[str], reward_terms, weights, budgets, advantage_fn) -> np.ndarray:
    """term_advantages of one epoch, float32: [B, T] for mode pre, [B, R] for mode loss.

    reward_terms [B, R]: each reward's unweighted value; weights W [R, T]; budgets [R] (lambda);
    advantage_fn(prompts, rewards [B]) -> advantages [B] (the run's group or batch normalisation and clip)."""
    r = np.asarray(reward_terms, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] < 2:
        raise ValueError(f"ReCAST needs several rewards per row, got reward terms of shape {r.shape}")
    if mode == "loss":
        return np.stack([advantage_fn(prompts, r[:, i]) for i in range(r.shape[1])], axis=1).astype(np.float32)
    if mode != "pre":
        raise ValueError(f"recast mode {mode!r} has no term advantages; choose pre or loss")
    lam = np.asarray(budgets, dtype=np.float64)
    w = check_weights(weights, r.shape[1], np.asarray(weights).shape[-1])
    mixed = lam.sum() * (r @ (w.shape[1] * w))  # [B, T]: m_s = Lambda * sum_i (T W)_i,s r_i
    return np.stack([advantage_fn(prompts, mixed[:, s]) for s in range(w.shape[1])], axis=1).astype(np.float32)


class RecastCredit:
    """The buffer's half of a ReCAST credit scheme: its budgets and the W the run's probe measured."""

    def __init__(self, mode: str, budgets):
        if mode not in ("pre", "loss"):
            raise ValueError(f"RecastCredit's mode is pre or loss, got {mode!r}")
        self.mode, self.budgets = mode, [float(b) for b in budgets]
        self.weights: np.ndarray | None = None  # W [R, T], from the probe (actors/recast_probe.py)

    def set_weights(self, weights) -> None:
        self.weights = check_weights(weights, len(self.budgets), np.asarray(weights).shape[-1]).copy()

    def term_advantages(self, prompts: list[str], reward_terms, advantage_fn) -> np.ndarray:
        if self.weights is None:
            raise RuntimeError("ReCAST has no weights yet: the run's probe sets them before the first epoch is finalized")
        return recast_advantages(self.mode, prompts, reward_terms, self.weights, self.budgets, advantage_fn)

    def state_dict(self) -> dict:
        return {"mode": self.mode, "budgets": self.budgets, "weights": self.weights}

    def load_state_dict(self, state: dict) -> None:
        self.mode, self.budgets = state["mode"], list(state["budgets"])
        self.weights = None if state["weights"] is None else np.asarray(state["weights"], dtype=np.float64)
