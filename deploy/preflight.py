"""A run's inputs, checked before anything starts: no run folder, no Ray, no model loaded.

    warnings = check_run_inputs(cfg)   # raises an InputError naming the config key and the fix

Errors: a reward spec that cannot be built (unknown name, a custom callable that is not importable
or not fn(images, prompts), kwargs the reward does not take, a weighted_sum term, missing weights),
a prompt list (train or eval) that is missing or empty or that the reward cannot read (a
tinyworld_alignment caption outside the tiny world's grammar), a model that is not on this machine.
Warnings: inputs that run, but not as written (replay.k above what the replay window holds, prompts
that the text encoder truncates).
"""
from __future__ import annotations

import os

import numpy as np

from diffrlhf.actors.scheduler import local_resources, resource_problems, role_requests
from diffrlhf.actors.settings import reward_runtime_env
from diffrlhf.policy.models import ModelNotFoundError, resolve_model
from diffrlhf.policy.prompts import load_prompts
from diffrlhf.rewards import (MissingWeightsError, NonFiniteTrialError, RewardContractError, RewardSpecError, check_spec, custom_names, package_reward_names,
                              trial_call, uses_prompts)
from diffrlhf.rewards import check_prompts as check_reward_reads_prompts
from diffrlhf.rewards.hpsv2 import find_weights as find_hpsv2_weights
from diffrlhf.rewards.imagereward import find_weights as find_imagereward_weights
from diffrlhf.rewards.clip_tokenizer import CONTEXT_LENGTH, tokenize


class InputError(ValueError):
    """A run input that cannot work. The message names the config key, the value and what to do."""


class RewardInputError(InputError):
    pass


class PromptInputError(InputError):
    pass


class ModelInputError(InputError):
    pass


class ResourceInputError(InputError):
    pass


def check_run_inputs(cfg) -> list[str]:
    """Raise an InputError for the first input that cannot work; return the warnings (say them once)."""
    warnings = check_reward(cfg) + check_reward_env(cfg)
    prompt_lists = check_prompts(cfg)
    try:
        resolve_model(cfg.model.name)
    except ModelNotFoundError as e:
        raise ModelInputError(f"model.name={cfg.model.name}: {e}") from None
    warnings += check_custom_reward_output(cfg, prompt_lists["prompts.train"])
    check_local_resources(cfg)
    warnings += replay_warnings(cfg) + tracker_warnings(cfg, len(prompt_lists["prompts.train"]))
    for key, prompts in prompt_lists.items():
        warnings += long_prompt_warnings(key, prompts)
    return warnings


def check_reward(cfg) -> list[str]:
    spec = cfg.reward.spec
    # Served in its own environment or on other nodes, the reward's files and modules need not be
    # here: what is missing from this process is then a warning, not an error.
    local = not os.environ.get("RAY_ADDRESS") and cfg.reward.runtime_env in (None, "auto")
    try:
        check_spec(spec, local=True)
        return []
    except (RewardSpecError, MissingWeightsError) as e:
        if local:
            raise RewardInputError(f"reward.spec={spec}: {e}") from None
        missing_here = e
    try:
        check_spec(spec, local=False)
    except RewardSpecError as e:
        raise RewardInputError(f"reward.spec={spec}: {e}") from None
    where = "its reward.runtime_env" if cfg.reward.runtime_env not in (None, "auto") else "the cluster's reward nodes"
    return [f"reward.spec={spec}: not usable from this process ({missing_here}); the reward actors run in {where}, "
            "which must have it"]


def check_reward_env(cfg) -> list[str]:
    """reward.runtime_env=auto for a package reward: its venv is built and made for this Python and
    Ray (else one line naming `diffrlhf reward-env build NAME`); a warning when it will score with
    random weights because no weight file is on this machine."""
    if cfg.reward.runtime_env != "auto":
        return []
    try:
        reward_runtime_env(cfg)
    except ValueError as e:
        raise RewardInputError(str(e)) from None
    warnings = []
    finders = {"imagereward_pkg": ("imagereward", find_imagereward_weights), "hpsv2_pkg": ("hpsv2", find_hpsv2_weights)}
    for name in package_reward_names(cfg.reward.spec):
        fetch, find = finders[name]
        try:
            find()
        except MissingWeightsError:
            warnings.append(f"reward {name}: no weight file on this machine (`diffrlhf fetch-weights {fetch}`): "
                            "the reward actors score with the package's model on random weights")
    return warnings


def check_custom_reward_output(cfg, prompts: list[str]) -> list[str]:
    """A custom reward, called once on test images here: its contract (one finite number per image)
    is checked before Ray and the actors start. Skipped where its actors run elsewhere."""
    if not custom_names(cfg.reward.spec) or os.environ.get("RAY_ADDRESS") or cfg.reward.runtime_env not in (None, "auto"):
        return []
    try:
        trial_call(cfg.reward.spec, prompts, cfg.sample.resolution)
    except NonFiniteTrialError as e:
        if cfg.reward.nan_policy == "drop" and np.isfinite(e.values).any():
            return [f"reward.spec: {e}"]
        if cfg.reward.nan_policy == "drop":  # dropping every sample trains on nothing: say so before Ray
            raise RewardInputError(f"reward.spec={cfg.reward.spec}: scored nothing finite on the {len(e.values)} test images "
                                   f"({e.values.tolist()}), so reward.nan_policy=drop would drop every sample; fix the reward") from None
        raise RewardInputError(f"reward.spec={cfg.reward.spec}: {e}") from None
    except RewardContractError as e:
        raise RewardInputError(f"reward.spec={cfg.reward.spec}: {e}") from None
    return []


def check_local_resources(cfg) -> None:
    """A local run (no RAY_ADDRESS) on this machine: a request it can never place is an input error
    before Ray starts. On a cluster the driver checks against the cluster (which may autoscale)."""
    if os.environ.get("RAY_ADDRESS"):
        return
    have = local_resources(cfg)
    problems = resource_problems(role_requests(cfg), have, [have])
    if problems:
        raise ResourceInputError(f"this machine ({have.get('CPU', 0):g} CPU, {have.get('GPU', 0):g} GPU) can never start "
                                 f"every actor the config asks for: {'; '.join(problems)}")


def check_prompts(cfg) -> dict[str, list[str]]:
    lists = {}
    for key in ("prompts.train", "prompts.eval"):
        source = getattr(cfg.prompts, key.split(".")[1])
        try:
            lists[key] = load_prompts(source)
        except (FileNotFoundError, ValueError) as e:
            raise PromptInputError(f"{key}={source}: {e}") from None
        try:  # a reward that parses its prompts (tinyworld_alignment) must be able to read every one
            check_reward_reads_prompts(cfg.reward.spec, lists[key])
        except ValueError as e:
            raise PromptInputError(f"{key}={source} with reward.spec={cfg.reward.spec}: {e}") from None
    return lists


def replay_warnings(cfg) -> list[str]:
    r, s = cfg.replay, cfg.sample
    window = r.max_epochs * cfg.samples_per_epoch()
    if r.mode == "none" or r.k <= window:
        return []
    return [f"replay.k={r.k} is more than the replay window holds (replay.max_epochs x sample.batch_size x "
            f"sample.batches_per_epoch = {r.max_epochs} x {s.batch_size} x {s.batches_per_epoch} = {window}): "
            f"at most {window} trajectories are replayed per update. Lower replay.k or raise replay.max_epochs."]


def tracker_warnings(cfg, num_prompts: int) -> list[str]:
    """DDPO's per-prompt tracker normalises by a prompt's own history only once it holds
    advantage.min_count rewards; a run that never gets there trains on batch statistics throughout."""
    a = cfg.advantage
    per_prompt = cfg.train.epochs * cfg.samples_per_epoch() / max(num_prompts, 1)
    if a.mode != "per_prompt" or per_prompt >= a.min_count or not uses_prompts(cfg.reward.spec):
        return []  # a reward that ignores the prompt loses nothing by batch statistics
    return [f"advantage.mode=per_prompt: {cfg.samples_per_epoch()} samples an epoch over the {num_prompts} prompts of "
            f"prompts.train give a prompt about {per_prompt:.1f} rewards in {cfg.train.epochs} epochs, fewer than "
            f"advantage.min_count={a.min_count}: the run normalises by the batch's mean and std throughout (DDPO's "
            "fallback), and on a prompt-dependent reward those advantages mostly rank prompts, not samples "
            "(RESULTS.md, \"Does per-step weighting beat DDPO\"). Use advantage.mode=group with sample.samples_per_prompt >= 2, or a lower advantage.min_count."]


def long_prompts(prompts: list[str]) -> list[str]:
    """The prompts longer than CLIP's 77 tokens (start and end token included), in order."""
    # A prompt has at most one BPE token per UTF-8 byte (lower-casing may add a few bytes), so
    # short prompts cannot overflow and need no tokenizer.
    maybe = [p for p in prompts if len(p.encode()) * 3 // 2 > CONTEXT_LENGTH - 2]
    if not maybe:
        return []
    # One slot more than CLIP holds: the end token lands in the extra slot only for a longer prompt.
    ids = tokenize(maybe, CONTEXT_LENGTH + 1)
    return [p for p, row in zip(maybe, ids) if row[CONTEXT_LENGTH] != 0]


def long_prompt_warnings(key: str, prompts: list[str]) -> list[str]:
    try:
        long = long_prompts(prompts)
    except (OSError, ImportError) as e:  # no CLIP vocabulary here: say so, the run itself does not need it
        return [f"{key}: prompt lengths not checked ({e})"]
    if not long:
        return []
    first = long[0] if len(long[0]) <= 120 else long[0][:117] + "..."
    return [f"{key}: {len(long)} of {len(prompts)} prompts are longer than {CONTEXT_LENGTH} CLIP tokens and are "
            f"truncated to {CONTEXT_LENGTH} (the text encoder reads no more); the first: {first!r}"]
