"""The four roles as plain classes; the driver turns each into a Ray actor with `ray.remote`.

Each is a thin shell around the tested functions (sampling, rewards, advantages + replay,
update), plus the bookkeeping the system needs: versions, busy time, state for checkpoints.
They run unchanged in-process, which is how tests exercise them without Ray.
"""
from __future__ import annotations

import os
import time

import torch

from diffrlhf.actors.reward_worker import RewardRoleConfig, RewardWorker  # noqa: F401  (the roles' one import place)
from diffrlhf.actors.role import Role, timed
from diffrlhf.actors.settings import (advantage_computer, build_policy, load_model, recast_credit, replay_buffer,
                                      sampling_settings, train_rows)
from diffrlhf.buffer.epoch import attach_rewards, finalize_epoch
from diffrlhf.buffer.sharding import shard_batch
from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.learner.distributed import Group, free_port, init_group
from diffrlhf.learner.lora import FlatLoRA, add_lora, flat_lora_state, load_flat_lora, save_lora, tile_lora_parameters
from diffrlhf.policy.branching import branch_trajectories, sample_plan


class SamplerWorker(Role):
    """Holds the base pipeline plus the LoRA; samples planned batches with the version it is given."""

    def __init__(self, cfg, rank: int = 0):
        self._init_role(cfg, f"sampler-{rank}")
        self.components = load_model(cfg)
        add_lora(self.components.unet, cfg.model.lora_rank, cfg.model.lora_alpha or None, tuple(cfg.model.lora_targets), seed=cfg.run.seed)
        tile_lora_parameters(self.components.unet)  # the LoRA in one tensor: each new version loads with one copy
        self.settings = sampling_settings(cfg)
        self.negative_embeds = self.components.encode_prompts([cfg.sample.negative_prompt])
        self.version = -1  # no weights yet: the first call always loads the ones it is given

    def set_weights(self, version: int, lora: FlatLoRA) -> None:
        load_flat_lora(self.components.unet, lora)
        self.version = version

    def forget_weights(self) -> None:
        """After an in-run restore: the next call loads the weights it is given, whatever their version."""
        self.version = -1

    @timed
    def sample(self, plan, weights: tuple[int, FlatLoRA]):
        """Returns (info, reward input, batch): the reward actors (and the image grid) get the images,
        prompts and ids; the batch for the buffer and learners leaves the images out.

        `weights` is (version, flat LoRA), resolved by Ray from the learner's one broadcast object
        (its buffer a zero-copy view of the store); it is loaded only when the version changed.
        """
        t0 = time.perf_counter()
        version, lora = weights
        if version != self.version:
            self.set_weights(version, lora)
        batch = sample_plan(self.components, plan, self.settings, self.version, self.negative_embeds)
        reward_input = {"ids": batch.sample_ids.tolist(), "images": batch.images.numpy(), "prompts": batch.prompts}
        info = {"version": self.version, "rows": len(batch), "sample_s": time.perf_counter() - t0, "pid": os.getpid()}
        return info, reward_input, batch.without_images()

    @timed
    def branch(self, batch: TrajectoryBatch, step: int, num_branches: int, seeds, weights: tuple[int, FlatLoRA] | None = None):
        """Continue each recorded row from its state after `step` steps, num_branches times with the
        given noise seeds (policy.branching.branch_trajectories), with the policy version `weights`
        (None: the weights loaded now; before any, the untrained adapter). The per-step variance
        bench's branches (research/bench/variance.py --ray)."""
        if weights is not None and weights[0] != self.version:
            self.set_weights(*weights)
        return branch_trajectories(self.components, batch, step, num_branches, seeds, self.settings, self.negative_embeds)


class BufferWorker(Role):
    """Collects scored batches per epoch; when an epoch is complete computes its advantages (the
    tracker lives here, beside the |A|-prioritised replay that needs them), and serves the
    learner's batches: the current epoch plus replay."""

    def __init__(self, cfg):
        self._init_role(cfg, "buffer")
        self.advantages = advantage_computer(cfg)
        self.replay = replay_buffer(cfg)
        self.credit = recast_credit(cfg)  # ReCAST's budgets and W (None with recast.mode=off)
        self.pending: dict[int, dict[int, TrajectoryBatch]] = {}

    @timed
    def add_scored(self, epoch: int, batch_index: int, batch: TrajectoryBatch, score) -> int:
        batch = attach_rewards(batch, score.ids, score.rewards, score.terms)
        self.pending.setdefault(epoch, {})[batch_index] = batch
        return len(batch)

    @timed
    def finalize_epoch(self, epoch: int) -> dict:
        """Advantages over the whole epoch, in batch-index order (as the reference loop), then store."""
        parts = self.pending.pop(epoch, {})
        _, summary = finalize_epoch(epoch, [parts[i] for i in sorted(parts)], self.advantages, self.replay, train_rows(self.cfg),
                                    self.credit)
        return summary

    def set_recast_weights(self, weights) -> None:
        self.credit.set_weights(weights)

    @timed
    def training_batch(self, epoch: int, num_learners: int = 1):
        """The epoch's training rows; for a learner group, one (rows, Shard) per rank (buffer/sharding.py),
        so each learner receives only its own rows."""
        batch = self.replay.training_batch(epoch)
        if num_learners == 1:
            return batch
        # The plan's key is the learner's policy version at this epoch's update: one update per epoch, in order.
        return tuple(shard_batch(batch, self.cfg.train.batch_size, num_learners, self.cfg.run.seed, epoch))

    def state_dict(self) -> dict:
        return {"advantages": self.advantages.state_dict(), "replay": self.replay.state_dict(),
                "recast": self.credit.state_dict() if self.credit else None}

    def load_state_dict(self, state: dict) -> None:
        self.advantages.load_state_dict(state["advantages"])
        self.replay.load_state_dict(state["replay"])
        if self.credit is not None and state.get("recast") is not None:
            self.credit.load_state_dict(state["recast"])
        self.pending = {}


class LearnerWorker(Role):
    """One learner, or rank `rank` of a group of `world` (joined by join_group before any update)."""

    def __init__(self, cfg, rank: int = 0, world: int = 1):
        self._init_role(cfg, "learner" if world == 1 else f"learner-{rank}")
        self.components, self.learner = build_policy(cfg)
        self.rank, self.world = rank, world

    def node_address(self) -> tuple[str, int]:
        """This node's address and a port free on it (rank 0's serve as the group's rendezvous)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def join_group(self, address: str, port: int, timeout_s: float) -> int:
        init_group(address, port, self.rank, self.world, self.components.device, timeout_s)
        self.learner.group = Group.current()
        return self.rank

    @timed
    def update(self, training) -> tuple[dict, tuple[int, FlatLoRA] | None]:
        """One epoch's update on a batch, or on this rank's (rows, Shard); returns (metrics, (new
        version, flat LoRA)). The second return is the broadcast: one object in the store that every
        sampler reads (one contiguous buffer, see learner/lora.py FlatLoRA); a group's rank 0 makes it."""
        batch, shard = training if isinstance(training, tuple) else (training, None)
        metrics = self.learner.update(batch, shard)
        fresh = batch.policy_version[~batch.replayed].double()
        g = self.learner.group
        lag = g.sum_(torch.tensor([fresh.sum().item(), len(fresh)], dtype=torch.float64))
        oldest = g.min_(torch.tensor([fresh.min().item() if len(fresh) else float("inf")], dtype=torch.float64))
        if lag[1] > 0:
            metrics["policy_lag_max"] = int(self.learner.version - 1 - oldest.item())
            metrics["policy_lag_mean"] = float(self.learner.version - 1 - lag[0] / lag[1])
        else:  # no fresh row was trained (the algorithm's train_rows kept none)
            metrics["policy_lag_max"], metrics["policy_lag_mean"] = 0, float("nan")
        return metrics, (self.weights() if self.rank == 0 else None)

    def set_timestep_profile(self, profile) -> None:
        self.learner.set_timestep_profile(profile)

    def set_recast_weights(self, weights) -> None:
        self.learner.set_recast_weights(weights)

    def weights(self) -> tuple[int, FlatLoRA]:
        return self.learner.version, flat_lora_state(self.components.unet)

    def state_dict(self) -> dict:
        return self.learner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.learner.load_state_dict(state)

    def save_lora(self, folder: str) -> str:
        return str(save_lora(self.components.unet, folder))
