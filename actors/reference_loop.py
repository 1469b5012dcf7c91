"""The single-process reference loop: sample -> score -> advantages -> replay -> update, repeat.

It calls exactly the functions the distributed system's actors wrap, in the synchronous DDPO
order, and is the correctness baseline (the Ray system with max_policy_lag=0 must reproduce its
numbers) and the yardstick for the system's overhead. With pin_versions=True it samples epoch e
with the policy version the Ray driver pins for it, max(0, e - system.max_policy_lag)
(actors/scheduler.py): an asynchronous run's numbers without its timing.
"""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from diffrlhf.actors import oracle, recast_probe
from diffrlhf.actors.settings import (advantage_computer, build_policy, plan_for, recast_credit, replay_buffer, reward_server,
                                      sampling_settings, train_rows)
from diffrlhf.buffer.epoch import attach_rewards, epoch_record, finalize_epoch
from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.learner.lora import FlatLoRA, flat_lora_state, load_flat_lora
from diffrlhf.policy.branching import sample_plan
from diffrlhf.policy.prompts import load_prompts


def run_reference(cfg, logger=None, progress: bool = True, on_epoch=None, pin_versions: bool = False) -> list[dict]:
    """Run cfg.train.epochs epochs in this process; returns one record per epoch. pin_versions:
    sample as the Ray driver does with system.max_policy_lag (else every epoch with the current policy)."""
    torch.manual_seed(cfg.run.seed)
    comps, learner = build_policy(cfg)
    settings = sampling_settings(cfg)
    rewards = reward_server(cfg)
    advantages = advantage_computer(cfg)
    buffer = replay_buffer(cfg)
    credit = recast_credit(cfg)
    prompt_list = load_prompts(cfg.prompts.train)
    records = []
    bar = _progress(cfg.train.epochs, progress)
    rounds = oracle.probe_rounds(cfg)

    def probe(round_):  # the oracle weighting's measurement, on the policy that samples next
        profile, _, _ = oracle.local_probe(cfg, prompt_list, round_, comps, settings, learner.version, learner.negative_embeds,
                                           rewards.score)
        learner.set_timestep_profile(profile)

    recast_rounds = recast_probe.probe_rounds(cfg)

    def probe_recast(round_):  # ReCAST's W, on the policy that samples next
        result, _ = recast_probe.local_probe(cfg, prompt_list, round_, comps, settings, learner.version, learner.negative_embeds,
                                             rewards.score)
        learner.set_recast_weights(result["weights"])
        credit.set_weights(result["weights"])
        if logger is not None:
            logger.log_recast(result)

    if 0 in rounds:
        probe(0)
    if 0 in recast_rounds:
        probe_recast(0)
    lag = cfg.system.max_policy_lag if pin_versions else 0
    older: dict[int, FlatLoRA] = {}  # with a lag: the versions an epoch yet to be sampled may use
    for epoch in range(cfg.train.epochs):
        t0 = time.time()
        version = max(0, epoch - lag) if lag else learner.version
        if lag:
            older = {v: w for v, w in older.items() if v >= version}
            older[learner.version] = flat_lora_state(comps.unet)
        if version != learner.version:
            load_flat_lora(comps.unet, older[version])
        parts = []
        for bi in range(cfg.sample.batches_per_epoch):
            plan = plan_for(cfg, prompt_list, epoch, bi)
            parts.append(sample_plan(comps, plan, settings, version, learner.negative_embeds))
        if version != learner.version:
            load_flat_lora(comps.unet, older[learner.version])  # back to the policy the learner trains
        t_sample = time.time() - t0
        sampled = TrajectoryBatch.cat(parts)
        score = rewards.score(sampled.sample_ids.tolist(), sampled.images.numpy(), sampled.prompts)
        t_score = time.time() - t0 - t_sample
        batch, summary = finalize_epoch(epoch, [attach_rewards(sampled, score.ids, score.rewards, score.terms)], advantages, buffer,
                                        train_rows(cfg), credit)
        upd = learner.update(buffer.training_batch(epoch))
        if epoch + 1 in rounds:
            probe(epoch + 1)
        if epoch + 1 in recast_rounds:
            probe_recast(epoch + 1)
        rec = epoch_record(epoch, batch.rewards, rewards.num_queries, upd, batch.reward_terms, score.term_names,
                           reward_dropped=rewards.num_dropped,
                           samples_trained=summary["samples_trained"],
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

    return tqdm(total=total, desc="reference epochs", unit="epoch")
