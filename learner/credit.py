"""The learner's half of a credit scheme (buffer/credit.py has the other): the advantages each
trained (row, step) gets, as K terms whose clipped losses are summed.

step_advantages(batch, rows, steps) -> [n, K]: n = len(rows), steps [n] the step each row trains.
The learner multiplies them by the step's weight c * w(t) (selection coefficient times timestep
weight) and sums ppo_clipped_loss over the K columns. Because that loss is positively
homogeneous in the advantage, weighting reward i's loss at step s by (T W)_i,s is the same as
scaling its advantage, which is how the loss mode is written here.
"""
from __future__ import annotations

import torch

from diffrlhf.buffer.credit import RECAST_MODES, check_weights
from diffrlhf.buffer.trajectory import TrajectoryBatch


class FinalCredit:
    """DDPO: every step of a row trains on the row's one advantage (K = 1)."""

    name = "off"

    def step_advantages(self, batch: TrajectoryBatch, rows, steps) -> torch.Tensor:
        return batch.advantages[rows][:, None]


class RecastPreCredit:
    """ReCAST's "pre": step s trains on the advantage of that step's mixed reward (K = 1)."""

    name = "pre"

    def step_advantages(self, batch: TrajectoryBatch, rows, steps) -> torch.Tensor:
        if batch.term_advantages.shape[1] != batch.num_steps:
            raise ValueError(f"recast mode pre needs per-step advantages [B, {batch.num_steps}], the batch has "
                             f"{tuple(batch.term_advantages.shape)}: the buffer was not finalizing with ReCAST")
        return batch.term_advantages[rows, steps][:, None]


class RecastLossCredit:
    """ReCAST's "loss": reward i's advantage at step s weighted by (T W)_i,s (K = R terms)."""

    name = "loss"

    def __init__(self, weights):
        w = torch.as_tensor(weights, dtype=torch.float64)
        self.mix = (w.shape[1] * w).float()  # T W [R, T]: each step's weights over the rewards sum to 1

    def step_advantages(self, batch: TrajectoryBatch, rows, steps) -> torch.Tensor:
        if batch.term_advantages.shape[1] != self.mix.shape[0]:
            raise ValueError(f"recast mode loss has weights for {self.mix.shape[0]} rewards, the batch's term advantages are "
                             f"{tuple(batch.term_advantages.shape)}")
        return batch.term_advantages[rows] * self.mix[:, steps].T


def build_credit(mode: str, weights=None):
    """The credit part of recast mode `mode` (one of buffer.credit.RECAST_MODES); "loss" needs W [R, T]."""
    if mode == "off":
        return FinalCredit()
    if mode == "pre":
        return RecastPreCredit()
    if mode == "loss":
        if weights is None:
            raise RuntimeError("ReCAST's loss mode has no weights yet: the run's probe sets them before the first update")
        w = torch.as_tensor(weights, dtype=torch.float64)
        check_weights(w.numpy(), w.shape[0], w.shape[1])
        return RecastLossCredit(w)
    raise ValueError(f"unknown recast mode {mode!r}; choose one of {', '.join(RECAST_MODES)}")
