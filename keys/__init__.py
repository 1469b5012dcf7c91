"""Every config key, declared once: type, default, allowed values or range, one line of meaning, and
the roles that read it. The lowest layer of the package, so every role imports its defaults and
vocabularies from here (`default("train.lr")`, `choices("replay.mode")`, `check("replay.k", k)`),
and `deploy/config.py` builds the config sections, validation and messages from it;
`diffrlhf config keys` prints it as the README's table.

A key's range is data (at_least / above / at_most / multiple_of / excluded), so the message and
the docs say the same thing the check does. Relations between keys (a batch size that must divide
another) stay in deploy/config.py's `validate`, next to each other.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

ROLES = ("sampler", "reward", "buffer", "learner", "driver")


class KeyValueError(ValueError):
    """A value outside its key's declared type, choices or range; the message names key, value and what is allowed."""


@dataclasses.dataclass(frozen=True)
class Key:
    name: str                       # section.leaf
    type: Any                       # int, float, str, bool, list, or typing.Any
    default: Any
    doc: str
    roles: tuple[str, ...]
    choices: tuple | None = None
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    multiple_of: int | None = None
    excluded: float | None = None
    why: str = ""                   # why the range, said in the error

    @property
    def section(self) -> str:
        return self.name.split(".")[0]

    @property
    def leaf(self) -> str:
        return self.name.split(".", 1)[1]

    def allowed(self) -> str:
        """What the key takes, in words ('' when any value of its type)."""
        if self.choices is not None:
            return " | ".join(map(str, self.choices))
        parts = []
        if self.above is not None and self.at_most is not None:
            parts.append(f"in ({self.above:g}, {self.at_most:g}]")
        else:
            if self.at_least is not None:
                parts.append(f">= {self.at_least:g}")
            if self.above is not None:
                parts.append(f"> {self.above:g}")
            if self.at_most is not None:
                parts.append(f"<= {self.at_most:g}")
        if self.multiple_of is not None:
            parts.append(f"a multiple of {self.multiple_of}")
        if self.excluded is not None:
            parts.append(f"!= {self.excluded:g}")
        return " and ".join(parts)

    def problem(self, value) -> str | None:
        """Why `value` is not allowed (None when it is)."""
        if self.choices is not None:
            return None if value in self.choices else f"is not allowed; choose one of {', '.join(map(str, self.choices))}"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        bad = ((self.at_least is not None and value < self.at_least) or (self.above is not None and value <= self.above)
               or (self.at_most is not None and value > self.at_most)
               or (self.multiple_of is not None and (value < self.multiple_of or value % self.multiple_of))
               or (self.excluded is not None and value == self.excluded))
        return f"is out of range; must be {self.allowed()}{f' ({self.why})' if self.why else ''}" if bad else None

    def check(self, value):
        """`value` if allowed, else KeyValueError naming the key, the value and what is allowed."""
        why = self.problem(value)
        if why:
            raise KeyValueError(f"config key {self.name!r}: value {value!r} {why}")
        return value


def _k(name, type_, default, doc, roles, **kw) -> Key:
    return Key(name, type_, default, doc, tuple(roles.split()), **kw)


S, R, B, L, D = "sampler", "reward", "buffer", "learner", "driver"
_TABLE = [
    # model: the base pipeline and the LoRA on its UNet
    _k("model.name", str, "tiny-world", "`tiny-world` (default), `tiny-random[:seed]`, `sd15-random` (SD1.5's architecture and size, "
       "seeded random weights, built into the cache on first use), a local diffusers folder, or a hub id read from the local HF "
       "cache only (never downloaded during a run)", "sampler learner driver"),
    _k("model.dtype", str, "float32", "the base model's torch dtype (the LoRA stays fp32)", "sampler learner",
       choices=("float32", "float16", "bfloat16")),
    _k("model.device", str, "auto", "auto: cuda when available", "sampler learner", choices=("auto", "cpu", "cuda")),
    _k("model.lora_rank", int, 4, "rank of the LoRA on the UNet's attention projections", "sampler learner", at_least=1),
    _k("model.lora_alpha", float, 0.0, "LoRA alpha (0: equal to the rank)", "sampler learner", at_least=0),
    _k("model.lora_targets", list, ["to_q", "to_k", "to_v", "to_out.0"], "the UNet modules that get a LoRA", "sampler learner"),
    # sample: how trajectories are drawn
    _k("sample.num_steps", int, 20, "DDIM steps T of a trajectory", "sampler learner", at_least=1),
    _k("sample.eta", float, 1.0, "DDIM eta (> 0: each step is a Gaussian policy with a log-prob)", "sampler learner", above=0,
       why="eta = 0 is deterministic DDIM: no policy log-prob"),
    _k("sample.guidance_scale", float, 5.0, "classifier-free guidance scale", "sampler learner", at_least=1),
    _k("sample.resolution", int, 64, "image side in pixels", "sampler", multiple_of=8),
    _k("sample.negative_prompt", str, "", "the unconditional prompt of guidance", "sampler learner"),
    _k("sample.batch_size", int, 8, "trajectories per sampler call", "sampler driver", at_least=1),
    _k("sample.batches_per_epoch", int, 4, "sampler calls per epoch (epoch size = batch_size x batches_per_epoch)", "driver",
       at_least=1),
    _k("sample.samples_per_prompt", int, 1, "k samples of each prompt in a batch (>= 2 for advantage.mode=group)", "sampler driver",
       at_least=1),
    # prompts
    _k("prompts.train", str, "tiny-world-train", "builtin prompt list name or a text file (one prompt a line)", "driver"),
    _k("prompts.eval", str, "tiny-world-eval", "held-out prompts for `diffrlhf eval` (a name or a file)", "driver"),
    # reward
    _k("reward.spec", typing.Any, "jpeg_compressibility", "the reward: a name or {name: ..., **kwargs}, a weighted_sum, or "
       "`my_pkg.module:score` (rewards/README.md)", "reward driver"),
    _k("reward.nan_policy", str, "raise", "a NaN/inf reward: raise (stop, naming the sample) or drop (leave the sample out, counted)",
       "reward", choices=("raise", "drop")),
    _k("reward.batch_size", int, 8, "images per call of the reward model (bounds its peak memory)", "reward", at_least=1),
    _k("reward.runtime_env", typing.Any, None, "Ray runtime_env of the reward actors: null (the core environment), a mapping, or "
       "auto (a package reward's venv from `diffrlhf reward-env build`)", "driver"),
    # advantage
    _k("advantage.mode", str, "per_prompt", "per_prompt (DDPO's per-prompt tracker), batch, or group (GRPO: within each prompt's "
       "samples of the batch)", "buffer", choices=("per_prompt", "batch", "group")),
    _k("advantage.buffer_size", int, 16, "per_prompt: rewards kept per prompt", "buffer", at_least=1),
    _k("advantage.min_count", int, 16, "per_prompt: a prompt's history is used from this many rewards on (else the batch's)",
       "buffer", at_least=0),
    _k("advantage.clip_max", float, 5.0, "advantages are clipped to [-clip_max, clip_max]", "buffer", above=0),
    # weighting: w(t), the per-step weight of the policy-gradient term
    _k("weighting.scheme", str, "uniform", "w(t): uniform (DDPO), latent_sq (the paper's best), latent_abs, ddim_std, "
       "gaussian_early/mid/late, or oracle (the per-step reward variance measured by branching)", "learner",
       choices=("uniform", "latent_sq", "latent_abs", "ddim_std", "gaussian_early", "gaussian_mid", "gaussian_late", "oracle")),
    _k("weighting.gaussian_width", float, 0.2, "width of the gaussian_* schemes, as a share of the chain", "learner", above=0),
    _k("weighting.oracle_trajectories", int, 4, "oracle probe: trajectories branched (its queries count in the run's)", "driver",
       at_least=2, why="the standard error is over trajectories"),
    _k("weighting.oracle_branches", int, 4, "oracle probe: branches per step", "driver", at_least=2,
       why="a variance needs two branches"),
    _k("weighting.oracle_every", int, 0, "oracle probe: re-measure after every this many updates (0: once)", "driver", at_least=0),
    # recast: several rewards, each credited at the steps where it informs
    _k("recast.mode", str, "off", "ReCAST: off, pre (per-step mixed reward) or loss (per-reward losses); needs a weighted_sum "
       "of >= 2 rewards (their weights are the budgets)", "buffer learner driver", choices=("off", "pre", "loss")),
    _k("recast.alpha", float, 2.0, "order of the Renyi divergence", "driver", above=0, excluded=1,
       why="1 is the KL limit, not the Renyi formula"),
    _k("recast.temperature", float, 1.0, "tau of the Sinkhorn kernel exp(gain / tau)", "driver", above=0),
    _k("recast.sinkhorn_iterations", int, 1000, "Sinkhorn iterations at most", "driver", at_least=1),
    _k("recast.sinkhorn_tolerance", float, 1e-9, "Sinkhorn stops when the marginals are this close", "driver", above=0),
    _k("recast.trajectories", int, 4, "probe: trajectories P (P x M x T + P queries, counted in the run's)", "driver", at_least=1),
    _k("recast.branches", int, 4, "probe: fresh samples and branches M per step", "driver", at_least=2,
       why="a conditional mean over one branch is the reward itself"),
    _k("recast.every", int, 0, "re-measure W after every this many updates (0: once)", "driver", at_least=0),
    # replay
    _k("replay.mode", str, "none", "none, hardmine (the top-|A| trajectories of the window) or random", "buffer",
       choices=("none", "hardmine", "random")),
    _k("replay.max_epochs", int, 2, "past epochs kept for replay (the off-policy bound)", "buffer", at_least=0),
    _k("replay.k", int, 8, "trajectories replayed per update", "buffer", at_least=0),
    _k("replay.logprob_mode", str, "recorded", "old log-probs of the ratio: recorded (at sampling) or recompute (the policy at "
       "the update's start)", "learner", choices=("recorded", "recompute")),
    # train: the learner's update
    _k("train.epochs", int, 10, "epochs of the run (sample, score, update)", "driver learner", at_least=0),
    _k("train.lr", float, 3e-4, "AdamW learning rate", "learner", above=0),
    _k("train.adam_beta1", float, 0.9, "AdamW beta1", "learner"),
    _k("train.adam_beta2", float, 0.999, "AdamW beta2", "learner"),
    _k("train.weight_decay", float, 1e-4, "AdamW weight decay", "learner"),
    _k("train.adam_eps", float, 1e-8, "AdamW epsilon", "learner"),
    _k("train.clip_range", float, 1e-4, "PPO clip of the likelihood ratio", "learner", above=0,
       why="use a large value such as 1e9 to turn clipping off"),
    _k("train.max_grad_norm", float, 1.0, "gradient norm clip", "learner", above=0),
    _k("train.timestep_fraction", float, 1.0, "share of the T steps trained per trajectory", "learner", above=0, at_most=1),
    _k("train.timestep_selection", str, "random", "which steps train: random (DDPO's subset), all, weighted (drawn by w(t), "
       "importance-corrected), top (largest w(t)), window (MixGRPO), backward (B2-DiffuRL)", "learner",
       choices=("all", "random", "weighted", "top", "window", "backward")),
    _k("train.inner_epochs", int, 1, "passes over an epoch's samples per update", "learner", at_least=1),
    _k("train.batch_size", int, 8, "trajectories per learner mini-batch", "learner buffer", at_least=1),
    _k("train.grad_accum_steps", int, 1, "optimizer step every this many mini-batches (x trained steps), as DDPO", "learner",
       at_least=1),
    # algorithm
    _k("algorithm.name", str, "ddpo", "a registered algorithm (learner/algorithms/; `diffrlhf config show` lists them): ddpo, "
       "dpok (KL to the pretrained model), b2diffurl (branch sampling, backward training); it brings its own defaults",
       "sampler buffer learner driver"),
    _k("algorithm.kl_coef", float, 0.01, "dpok: beta, weight of the per-step KL to the pretrained model", "learner", at_least=0,
       why="0: no KL term"),
    _k("algorithm.reward_scale", float, 1.0, "dpok: alpha, scale of the advantage", "learner", above=0),
    _k("algorithm.b2_pos_threshold", float, 0.5, "b2diffurl: a branch group's best row trains if its advantage is >= this",
       "buffer"),
    _k("algorithm.b2_neg_threshold", float, -0.5, "b2diffurl: its worst row trains if its advantage is < this", "buffer"),
    # system: actors, resources, faults
    _k("system.num_samplers", int, 2, "sampler actors", "driver", at_least=1),
    _k("system.num_reward_actors", int, 1, "reward actors", "driver", at_least=1),
    _k("system.sampler_gpus", float, 0.0, "GPUs per sampler", "driver", at_least=0),
    _k("system.sampler_cpus", float, 1.0, "CPUs per sampler", "driver", at_least=0),
    _k("system.reward_gpus", float, 0.0, "GPUs per reward actor", "driver", at_least=0),
    _k("system.reward_cpus", float, 0.5, "CPUs per reward actor", "driver", at_least=0),
    _k("system.learner_gpus", float, 0.0, "GPUs per learner", "driver", at_least=0),
    _k("system.learner_cpus", float, 1.0, "CPUs per learner", "driver", at_least=0),
    _k("system.num_learners", int, 1, "a data-parallel learner group (torch.distributed: NCCL on GPU, gloo on CPU)",
       "driver learner", at_least=1),
    _k("system.colocate", bool, False, "sampler i and learner i share one placement bundle (one GPU)", "driver"),
    _k("system.max_policy_lag", int, 1, "epochs sampled ahead of the learner (0: synchronous DDPO)", "driver", at_least=0),
    _k("system.max_inflight_per_sampler", int, 1, "sampler calls in flight per sampler", "driver", at_least=1),
    _k("system.idle_timeout_s", float, 600.0, "nothing finished for this long: the run stops, saying what it waits on", "driver",
       above=0),
    _k("system.start_timeout_s", float, 900.0, "an actor not started (model loaded) by then is an error", "driver", above=0),
    _k("system.max_actor_restarts", int, 3, "Ray restarts of a dead sampler or reward actor", "driver", at_least=0),
    _k("system.max_core_restarts", int, 2, "restores of the learner and buffer from the last checkpoint, within the run, when "
       "one dies (samplers and reward actors kept unless colocated; 0: the run stops and names the resume command)", "driver", at_least=0),
    _k("system.max_batch_retries", int, 2, "re-runs of a batch whose actor died; then it is dropped (counted)", "driver",
       at_least=0),
    _k("system.use_role_resources", bool, False, "ask custom resources sampler/reward/learner (cluster worker groups)", "driver"),
    _k("system.checkpoint_timeout_s", float, 600.0, "a checkpoint save that takes longer is an error", "driver", above=0),
    _k("system.torch_threads", int, 1, "torch threads per actor (actors on one node must not oversubscribe its cores)",
       "sampler reward buffer learner", at_least=1),
    # run: the run folder and logging
    _k("run.seed", int, 0, "seed of sampling noise, LoRA init and replay draws", "sampler buffer learner driver"),
    _k("run.out_dir", str, "runs", "where run folders go", "driver"),
    _k("run.name", str, "", "the run folder's name (default: <preset>-<timestamp>)", "driver"),
    _k("run.save_every", int, 1, "checkpoint every this many epochs", "driver", at_least=1),
    _k("run.image_grid_every", int, 5, "sample grid every this many epochs (0: never)", "driver", at_least=0),
    _k("run.tensorboard", bool, True, "write TensorBoard event files beside metrics.jsonl", "driver"),
]

KEYS: dict[str, Key] = {k.name: k for k in _TABLE}
SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(k.section for k in _TABLE))


def default(name: str):
    """A key's default (a fresh list for list keys)."""
    d = KEYS[name].default
    return list(d) if isinstance(d, list) else d


def choices(name: str) -> tuple:
    return KEYS[name].choices


def check(name: str, value):
    return KEYS[name].check(value)


def section_keys(section: str) -> list[Key]:
    return [k for k in _TABLE if k.section == section]
