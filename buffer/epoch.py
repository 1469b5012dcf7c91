"""One epoch's pipeline after sampling, shared by the reference loop and the Ray buffer actor:
attach the rewards to the sampled trajectories, finalize the epoch (advantages over all of it,
then into the replay buffer), and the epoch's record. One implementation, so the two loops
cannot drift apart.
"""
from __future__ import annotations

import numpy as np
import torch

from diffrlhf.buffer.advantages import AdvantageComputer
from diffrlhf.buffer.credit import RecastCredit
from diffrlhf.buffer.replay import ReplayBuffer
from diffrlhf.buffer.trajectory import TrajectoryBatch


def attach_rewards(batch: TrajectoryBatch, ids, rewards, terms=None) -> TrajectoryBatch:
    """The rows of `batch` that got a reward (by sample id), with it set; rows the reward server
    dropped (non-finite, nan_policy=drop) are left out. terms [len(ids), R] (a weighted_sum's
    unweighted rewards, aligned with ids) go to reward_terms."""
    by_id = dict(zip(ids, np.asarray(rewards).tolist()))
    keep = [i for i, sid in enumerate(batch.sample_ids.tolist()) if sid in by_id]
    batch = batch.select(keep)
    batch.rewards = torch.tensor([by_id[s] for s in batch.sample_ids.tolist()], dtype=torch.float32)
    if terms is not None:
        row_of = {sid: j for j, sid in enumerate(ids)}
        terms = torch.as_tensor(np.asarray(terms, dtype=np.float32))
        batch.reward_terms = terms[[row_of[s] for s in batch.sample_ids.tolist()]].reshape(len(batch), terms.shape[1])
    return batch


class EmptyEpochError(RuntimeError):
    """Every trajectory of an epoch was lost before training (dropped rewards or batches)."""


def finalize_epoch(epoch: int, parts: list[TrajectoryBatch], advantages: AdvantageComputer, replay: ReplayBuffer,
                   train_rows=None, credit: RecastCredit | None = None) -> tuple[TrajectoryBatch, dict]:
    """Advantages over the whole epoch (parts in batch-index order), then store it for replay.

    train_rows (optional): batch -> the row indices to train and store (the algorithm's choice,
    learner/algorithms); every row was scored and counts in the summary either way.
    credit (optional, ReCAST): also the term advantages of each row (buffer/credit.py); the row's
    one advantage stays that of the weighted sum, which replay's |A| priority ranks by.
    Returns the scored epoch and its summary (rewards, versions; the image grid comes from the reward
    inputs, actors/grid.py)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        raise EmptyEpochError(f"epoch {epoch} has no scored trajectories left to train on: every reward was dropped "
                              "(reward.nan_policy=drop) or every batch was lost")
    batch = TrajectoryBatch.cat(parts)
    batch.advantages = torch.from_numpy(advantages(batch.prompts, batch.rewards.numpy()))
    if credit is not None:
        batch.term_advantages = torch.from_numpy(credit.term_advantages(batch.prompts, batch.reward_terms.numpy(), advantages))
    trained = batch if train_rows is None else batch.select(train_rows(batch))
    replay.add(epoch, trained)
    summary = {"epoch": epoch, "samples": len(batch), "samples_trained": len(trained), "rewards": batch.rewards.tolist(),
               "policy_versions": batch.policy_version.tolist()}
    if batch.reward_terms.shape[1]:
        summary["reward_terms"] = batch.reward_terms.tolist()
    return batch, summary


def epoch_record(epoch: int, rewards, queries: int, update: dict, reward_terms=None, term_names=None, **extra) -> dict:
    """The metrics line of one trained epoch: reward statistics, the update's metrics, extras.
    reward_terms [B, R] with term_names [R] (several rewards): each reward's mean as reward_mean/<name>."""
    r = np.asarray(rewards, dtype=np.float64)
    rec = {
        "epoch": epoch,
        "reward_queries": queries,
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()),
        "reward_se": float(r.std(ddof=1) / np.sqrt(len(r))) if len(r) > 1 else 0.0,
        "samples": len(r),
    }
    if reward_terms is not None and len(reward_terms) and np.asarray(reward_terms).shape[1]:
        for name, col in zip(term_names, np.asarray(reward_terms, dtype=np.float64).T):
            rec[f"reward_mean/{name}"] = float(col.mean())
    rec.update({k: v for k, v in update.items() if k != "timestep_weights"})
    rec.update(extra)
    return rec
