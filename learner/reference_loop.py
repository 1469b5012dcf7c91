"""The single-process reference loop: sample -> score -> advantages -> replay -> update, repeat.

It calls exactly the functions the distributed system's actors wrap, in the synchronous DDPO
order, and is the correctness baseline (the Ray system with max_policy_lag=0 must reproduce its
numbers) and the yardstick for the system's overhead.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from diffrlhf.actors.models import load_components
from diffrlhf.actors.prompts import load_prompts, plan_batch
from diffrlhf.actors.sampler import SamplingSettings, sample_trajectories
from diffrlhf.buffer.advantages import AdvantageComputer
from diffrlhf.buffer.replay import ReplayBuffer
from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.learner.update import PolicyLearner, UpdateSettings


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device is 'cuda' but torch sees no GPU here; use model.device=cpu or auto")
    return name


def build_policy(cfg, device: str | None = None):
    """Base model + LoRA learner, as every role builds it (same seed -> same starting adapter)."""
    dtype = getattr(torch, cfg.model.dtype)
    comps = load_components(cfg.model.name, resolve_device(device or cfg.model.device), dtype)
    learner = PolicyLearner(
        comps, UpdateSettings.from_config(cfg), lora_rank=cfg.model.lora_rank,
        lora_alpha=cfg.model.lora_alpha or None, lora_targets=tuple(cfg.model.lora_targets),
        seed=cfg.run.seed, negative_prompt=cfg.sample.negative_prompt,
    )
    return comps, learner


def sampling_settings(cfg) -> SamplingSettings:
    s = cfg.sample
    return SamplingSettings(s.num_steps, s.eta, s.guidance_scale, s.resolution, s.negative_prompt)


def score_batch(reward_server, batch: TrajectoryBatch) -> TrajectoryBatch:
    """Rewards onto the batch; rows whose reward was dropped (nan_policy=drop) are removed."""
    res = reward_server.score(batch.sample_ids.tolist(), batch.images.numpy(), batch.prompts)
    by_id = dict(zip(res.ids, res.rewards))
    keep = [i for i, sid in enumerate(batch.sample_ids.tolist()) if sid in by_id]
    batch = batch.select(keep)
    batch.rewards = torch.tensor([by_id[s] for s in batch.sample_ids.tolist()], dtype=torch.float32)
    return batch


def epoch_record(epoch: int, batch: TrajectoryBatch, queries: int, update: dict, **extra) -> dict:
    r = batch.rewards.double().numpy()
    rec = {
        "epoch": epoch,
        "reward_queries": queries,
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()),
        "reward_se": float(r.std(ddof=1) / np.sqrt(len(r))) if len(r) > 1 else 0.0,
        "samples": len(r),
    }
    rec.update({k: v for k, v in update.items() if k != "timestep_weights"})
    rec.update(extra)
    return rec


def run_reference(cfg, logger=None, progress: bool = True, on_epoch=None) -> list[dict]:
    """Run cfg.train.epochs epochs in this process; returns one record per epoch."""
    from diffrlhf.rewards.serving import RewardServer

    torch.manual_seed(cfg.run.seed)
    comps, learner = build_policy(cfg)
    settings = sampling_settings(cfg)
    rewards = RewardServer(cfg.reward.spec, nan_policy=cfg.reward.nan_policy, batch_size=cfg.reward.batch_size)
    advantages = AdvantageComputer(cfg.advantage.mode, cfg.advantage.clip_max, cfg.advantage.buffer_size, cfg.advantage.min_count)
    buffer = ReplayBuffer(cfg.replay.max_epochs, cfg.replay.mode, cfg.replay.k, seed=cfg.run.seed)
    prompt_list = load_prompts(cfg.prompts.train)
    records = []
    bar = _progress(cfg.train.epochs, progress)
    for epoch in range(cfg.train.epochs):
        t0 = time.time()
        parts = []
        for bi in range(cfg.sample.batches_per_epoch):
            plan = plan_batch(prompt_list, cfg.run.seed, epoch, bi, cfg.sample.batch_size,
                              cfg.sample.batches_per_epoch, cfg.sample.samples_per_prompt)
            parts.append(sample_trajectories(comps, plan.prompts, plan.seeds, settings, learner.version,
                                             plan.sample_ids, learner.negative_embeds))
        t_sample = time.time() - t0
        batch = score_batch(rewards, TrajectoryBatch.cat(parts))
        t_score = time.time() - t0 - t_sample
        batch.advantages = torch.from_numpy(advantages(batch.prompts, batch.rewards.numpy()))
        buffer.add(epoch, batch)
        train_batch, n_replayed = buffer.training_batch(epoch)
        upd = learner.update(train_batch, n_replayed)
        rec = epoch_record(epoch, batch, rewards.num_queries, upd, reward_dropped=rewards.num_dropped,
                           time_sample=t_sample, time_score=t_score, time_update=time.time() - t0 - t_sample - t_score,
                           time_epoch=time.time() - t0)
        records.append(rec)
        if logger is not None:
            logger.log(rec)
            if cfg.run.image_grid_every and epoch % cfg.run.image_grid_every == 0:
                logger.save_grid(batch.images[:16].numpy(), batch.prompts[:16], f"epoch_{epoch:04d}")
        if on_epoch is not None:
            on_epoch(epoch, batch, learner)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(queries=rewards.num_queries, reward=f"{rec['reward_mean']:.4f}")
    if bar is not None:
        bar.close()
    return records


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="reference epochs", unit="epoch")
