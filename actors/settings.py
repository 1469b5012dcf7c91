"""The one place a run config becomes the roles' objects; every entry point (the Ray workers,
the reference loop, the benchmarks) builds them here, so the roles agree on what a config means.
"""
from __future__ import annotations

import os

import torch

from diffrlhf.actors.reward_worker import reward_server  # noqa: F401  (settings is where the roles' builders are found)
from diffrlhf.buffer.advantages import AdvantageComputer
from diffrlhf.buffer.credit import RecastCredit
from diffrlhf.buffer.replay import ReplayBuffer
from diffrlhf.learner import algorithms
from diffrlhf.learner.update import PolicyLearner, UpdateSettings
from diffrlhf.policy.models import SDComponents, load_components, resolve_device
from diffrlhf.policy.prompts import BatchPlan, plan_batch
from diffrlhf.policy.sampler import SamplingSettings
from diffrlhf.rewards import default_runtime_env, spec_name, weighted_sum_weights
from diffrlhf.rewards.environments import RewardEnvError

# The interpreter of a prebuilt venv for a package-backed reward (e.g. /opt/venvs/hpsv2/bin/python on
# a cluster image), read by reward.runtime_env=auto before the venvs `diffrlhf reward-env build` makes.
REWARD_PYTHON_ENV = "DIFFRLHF_REWARD_PYTHON"


def sampling_settings(cfg) -> SamplingSettings:
    s = cfg.sample
    return SamplingSettings(num_steps=s.num_steps, eta=s.eta, guidance_scale=s.guidance_scale, resolution=s.resolution,
                            negative_prompt=s.negative_prompt)


def update_settings(cfg) -> UpdateSettings:
    # Every field from the config key of the same meaning; tests/test_config_sources.py checks both ways.
    t = cfg.train
    return UpdateSettings(
        lr=t.lr, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, weight_decay=t.weight_decay,
        adam_eps=t.adam_eps, clip_range=t.clip_range, max_grad_norm=t.max_grad_norm,
        timestep_fraction=t.timestep_fraction, timestep_selection=t.timestep_selection, total_epochs=t.epochs,
        inner_epochs=t.inner_epochs, batch_size=t.batch_size,
        grad_accum_steps=t.grad_accum_steps, weighting=cfg.weighting.scheme,
        gaussian_width=cfg.weighting.gaussian_width, logprob_mode=cfg.replay.logprob_mode,
        eta=cfg.sample.eta, guidance_scale=cfg.sample.guidance_scale, algorithm=cfg.algorithm.name,
        kl_coef=cfg.algorithm.kl_coef, reward_scale=cfg.algorithm.reward_scale, recast=cfg.recast.mode,
    )


def load_model(cfg, device: str | None = None) -> SDComponents:
    return load_components(cfg.model.name, resolve_device(device or cfg.model.device), getattr(torch, cfg.model.dtype))


def build_policy(cfg, device: str | None = None) -> tuple[SDComponents, PolicyLearner]:
    """Base model + LoRA learner, as every role builds it (same seed -> same starting adapter)."""
    comps = load_model(cfg, device)
    learner = PolicyLearner(
        comps, update_settings(cfg), lora_rank=cfg.model.lora_rank,
        lora_alpha=cfg.model.lora_alpha or None, lora_targets=tuple(cfg.model.lora_targets),
        seed=cfg.run.seed, negative_prompt=cfg.sample.negative_prompt,
    )
    return comps, learner


def reward_runtime_env(cfg) -> dict | None:
    """The Ray runtime_env of the reward actors: reward.runtime_env as given, or for "auto" the one
    the reward needs (rewards.default_runtime_env: None for the rewards that run in the core
    environment; for the `*_pkg` ones the venv `diffrlhf reward-env build` made, or the interpreter
    named by $DIFFRLHF_REWARD_PYTHON). Raises one line naming the fix when that venv is not usable."""
    env = cfg.reward.runtime_env
    if env != "auto":
        return env or None
    try:
        return default_runtime_env(cfg.reward.spec, python=os.environ.get(REWARD_PYTHON_ENV) or None)
    except (ValueError, RewardEnvError) as e:
        raise ValueError(f"reward.runtime_env=auto for reward {spec_name(cfg.reward.spec)!r}: {e} (or set {REWARD_PYTHON_ENV} "
                         "to a prebuilt venv's python on every node)") from None


def advantage_computer(cfg) -> AdvantageComputer:
    a = cfg.advantage
    return AdvantageComputer(a.mode, a.clip_max, a.buffer_size, a.min_count)


def recast_credit(cfg) -> RecastCredit | None:
    """The buffer's half of ReCAST (None with recast.mode=off): the weighted_sum's weights as budgets."""
    if cfg.recast.mode == "off":
        return None
    return RecastCredit(cfg.recast.mode, weighted_sum_weights(cfg.reward.spec))


def replay_buffer(cfg) -> ReplayBuffer:
    r = cfg.replay
    return ReplayBuffer(r.max_epochs, r.mode, r.k, seed=cfg.run.seed)


def branch_step(cfg, epoch: int) -> int | None:
    """Where the samplers of `epoch` branch each prompt's samples (the algorithm's; None: plain trajectories)."""
    return algorithms.get(cfg.algorithm.name).branch_step(cfg, epoch)


def plan_for(cfg, prompt_list: list[str], epoch: int, batch_index: int) -> BatchPlan:
    """The plan of batch `batch_index` of `epoch` (policy/prompts.py plan_batch) under this config."""
    s = cfg.sample
    return plan_batch(prompt_list, cfg.run.seed, epoch, batch_index, s.batch_size, s.batches_per_epoch, s.samples_per_prompt,
                      branch_step(cfg, epoch))


def train_rows(cfg):
    """The buffer's choice of an epoch's rows to train: all (None), or the algorithm's."""
    return algorithms.get(cfg.algorithm.name).train_rows(cfg)
