"""One home for each allowed value and default, the key table (diffrlhf.keys): the implementing
modules and the config read them from it, the role settings carry every config key they mean, and
reward.runtime_env=auto resolves."""
import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

from diffrlhf.actors.settings import REWARD_PYTHON_ENV, reward_runtime_env, sampling_settings, update_settings
from diffrlhf.buffer import advantages, replay
from diffrlhf.buffer.credit import RECAST_MODES
from diffrlhf.deploy import config
from diffrlhf.keys import KEYS
from diffrlhf.learner import algorithms
from research.bench import study
from diffrlhf.deploy.config import Config, ConfigError, flatten, load_config
from diffrlhf.learner import timesteps, weighting
from diffrlhf.learner.lora import DEFAULT_RANK, DEFAULT_TARGETS
from diffrlhf.learner.update import ALGORITHMS, LOGPROB_MODES, PolicyLearner, UpdateSettings
from diffrlhf.policy import models
from diffrlhf.policy.sampler import SamplingSettings
from diffrlhf.rewards.serving import NAN_POLICIES

ROOT = Path(__file__).resolve().parents[1]

# UpdateSettings fields whose config key is not train.<same name>.
UPDATE_KEYS_ELSEWHERE = {"weighting": "weighting.scheme", "gaussian_width": "weighting.gaussian_width",
                         "logprob_mode": "replay.logprob_mode", "eta": "sample.eta", "guidance_scale": "sample.guidance_scale",
                         "total_epochs": "train.epochs", "algorithm": "algorithm.name", "kl_coef": "algorithm.kl_coef",
                         "reward_scale": "algorithm.reward_scale", "recast": "recast.mode"}
NOT_SHARED_DEFAULT = {"total_epochs"}  # the run's length: the learner alone has no default but 0 (no window schedule)
NOT_LEARNER = {"epochs"}  # train.* keys the driver reads, not the learner
NOT_SAMPLER = {"batch_size", "batches_per_epoch", "samples_per_prompt"}  # sample.* keys of the driver's schedule


def fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def update_key(field: str) -> str:
    return UPDATE_KEYS_ELSEWHERE.get(field, f"train.{field}")


def test_the_implementing_modules_vocabularies_are_the_key_tables():
    expected = {"model.dtype": models.DTYPES, "model.device": models.DEVICES, "reward.nan_policy": NAN_POLICIES,
                "advantage.mode": advantages.MODES, "weighting.scheme": weighting.SCHEMES, "replay.mode": replay.MODES,
                "replay.logprob_mode": LOGPROB_MODES, "train.timestep_selection": timesteps.SELECTIONS,
                "recast.mode": RECAST_MODES}
    assert {k for k, key in KEYS.items() if key.choices is not None} == expected.keys()
    # algorithm.name: the registered algorithms (learner/algorithms), which the config checks against
    assert ALGORITHMS == algorithms.names() == ("ddpo", "dpok", "b2diffurl")
    with pytest.raises(ConfigError, match="'algorithm.name': value 'ppo' is not allowed; choose one of ddpo, dpok, b2diffurl"):
        load_config(None, overrides=["algorithm.name=ppo"])
    for key, allowed in expected.items():
        assert KEYS[key].choices is allowed, f"{key}: the module restates its allowed values instead of reading the table"
    # ... and the study's suites cover exactly them
    assert tuple(study.SUITES["weighting"]) == weighting.SCHEMES
    assert tuple(study.SUITES["replay"]) == replay.MODES
    for scheme in weighting.SCHEMES:
        assert load_config(None, overrides=[f"weighting.scheme={scheme}"]).weighting.scheme == scheme
    with pytest.raises(ConfigError, match="choose one of " + ", ".join(weighting.SCHEMES)):
        load_config(None, overrides=["weighting.scheme=latent_cube"])


def test_update_settings_carry_every_learner_key_of_the_config():
    train_keys = set(fields(config.TrainConfig)) - NOT_LEARNER
    update_fields = set(fields(UpdateSettings))
    assert train_keys - update_fields == set(), "train.* keys the learner never receives"
    assert {f for f in update_fields - train_keys if f not in UPDATE_KEYS_ELSEWHERE} == set(), "UpdateSettings fields with no config key"
    # weighting.oracle_*: the oracle's probe (actors/oracle.py) reads them, not the learner.
    probe_keys = {k for k in fields(config.WeightingConfig) if k.startswith("oracle_")}
    oracle_src = (Path(__file__).resolve().parents[1] / "actors" / "oracle.py").read_text()
    assert probe_keys and all(f"cfg.weighting.{k}" in oracle_src for k in probe_keys)
    assert {f"weighting.{k}" for k in set(fields(config.WeightingConfig)) - probe_keys} <= {update_key(f) for f in update_fields}
    # recast.*: the learner takes the mode; the probe (actors/recast_probe.py) reads every other key.
    recast_src = (Path(__file__).resolve().parents[1] / "actors" / "recast_probe.py").read_text()
    assert all(f"cfg.recast.{k}" in recast_src for k in set(fields(config.RecastConfig)) - {"mode"})
    # Every field gets its key's value: set each key to a value unlike its default.
    values = {"lr": 0.0123, "adam_beta1": 0.81, "adam_beta2": 0.987, "weight_decay": 0.0021, "adam_eps": 3e-7,
              "clip_range": 0.07, "max_grad_norm": 2.5, "timestep_fraction": 0.6, "timestep_selection": "weighted",
              "total_epochs": 17, "inner_epochs": 3, "batch_size": 16,
              "grad_accum_steps": 3, "weighting": "gaussian_mid", "gaussian_width": 0.33, "logprob_mode": "recompute",
              "eta": 0.7, "guidance_scale": 3.5, "algorithm": "dpok", "kl_coef": 0.05, "reward_scale": 2.0}
    assert values.keys() == update_fields - {"recast"}  # recast needs ddpo and a weighted_sum: set on its own below
    defaults = flatten(Config().to_dict())
    assert all(values[f] != defaults[update_key(f)] for f in values), "pick values that differ from the defaults"
    cfg = load_config(None, overrides=[f"{update_key(f)}={v}" for f, v in values.items()])
    s = update_settings(cfg)
    assert {f: getattr(s, f) for f in values} == values
    two = "reward.spec={name: weighted_sum, terms: [jpeg_compressibility, tinyworld_alignment]}"
    assert update_settings(load_config(None, overrides=[two, "advantage.mode=batch", "recast.mode=loss"])).recast == "loss"
    # One set of defaults: the config's are the learner's.
    shared = update_fields - NOT_SHARED_DEFAULT
    assert {f: defaults[update_key(f)] for f in shared} == {f: getattr(UpdateSettings(), f) for f in shared}


def test_sampling_settings_carry_every_sampler_key_of_the_config():
    assert set(fields(config.SampleConfig)) - NOT_SAMPLER == set(fields(SamplingSettings))
    values = {"num_steps": 7, "eta": 0.5, "guidance_scale": 2.0, "resolution": 48, "negative_prompt": "blurry"}
    assert values.keys() == set(fields(SamplingSettings))
    defaults = flatten(Config().to_dict())
    assert all(values[f] != defaults[f"sample.{f}"] for f in values)
    s = sampling_settings(load_config(None, overrides=[f"sample.{f}={v}" for f, v in values.items()]))
    assert dataclasses.asdict(s) == values
    assert {f: defaults[f"sample.{f}"] for f in values} == dataclasses.asdict(SamplingSettings())
    # the learner scores the sampler's policy: same eta and guidance by default
    assert (UpdateSettings().eta, UpdateSettings().guidance_scale) == (SamplingSettings().eta, SamplingSettings().guidance_scale)


def test_lora_defaults_are_the_lora_modules():
    m = Config().model
    assert (m.lora_targets, m.lora_rank) == (list(DEFAULT_TARGETS), DEFAULT_RANK)
    params = inspect.signature(PolicyLearner).parameters
    assert params["lora_targets"].default is DEFAULT_TARGETS and params["lora_rank"].default == DEFAULT_RANK


def _settings_calls():
    """(file, line, class name, {keyword: constant}) of every SamplingSettings/UpdateSettings call with arguments."""
    for layer in ("deploy", "actors", "learner", "policy", "tinyworld", "rewards", "buffer", "research"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id in ("SamplingSettings", "UpdateSettings") and (node.args or node.keywords)):
                    consts = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
                    yield str(path.relative_to(ROOT)), node.lineno, node.func.id, consts


def test_settings_are_built_from_a_config_in_one_place_and_never_restate_defaults():
    calls = list(_settings_calls())
    # actors/settings.py builds them from a config; the GPU benchmark passes SD1.5's explicit values.
    assert {f for f, *_ in calls} == {"actors/settings.py", "research/bench/gpu.py"}, calls
    defaults = {"SamplingSettings": SamplingSettings(), "UpdateSettings": UpdateSettings()}
    restated = [(f, line, k) for f, line, cls, consts in calls for k, v in consts.items() if getattr(defaults[cls], k) == v]
    assert not restated, f"keyword arguments equal to the default (leave them out): {restated}"


# ----------------------------------------------------------------------------- reward.runtime_env


def test_reward_runtime_env_given_or_none():
    assert reward_runtime_env(load_config(None)) is None
    env = {"env_vars": {"A": "1"}}
    assert reward_runtime_env(load_config(None, overrides=["reward.runtime_env={env_vars: {A: '1'}}"])) == env
    with pytest.raises(ConfigError, match="reward.runtime_env"):
        load_config(None, overrides=["reward.runtime_env=5"])


def test_reward_runtime_env_auto(monkeypatch, tmp_path):
    monkeypatch.delenv(REWARD_PYTHON_ENV, raising=False)
    monkeypatch.setenv("DIFFRLHF_REWARD_ENVS", str(tmp_path / "none"))
    auto = ["reward.runtime_env=auto"]
    # rewards that run in the core environment need none
    assert reward_runtime_env(load_config(None, overrides=auto)) is None
    assert reward_runtime_env(load_config(None, overrides=[*auto, "reward.spec={name: hpsv2}"])) is None
    # a package reward without its built venv: an error naming the key, the build command and the variable
    for spec, env_name in (("hpsv2_pkg", "hpsv2"), ("imagereward_pkg", "imagereward")):
        with pytest.raises(ValueError, match=f"reward.runtime_env=auto for reward '{spec}'.*diffrlhf reward-env build {env_name}.*{REWARD_PYTHON_ENV}"):
            reward_runtime_env(load_config(None, overrides=[*auto, f"reward.spec={spec}"]))
    monkeypatch.setenv(REWARD_PYTHON_ENV, "/opt/venvs/hpsv2/bin/python")
    for spec in ("hpsv2_pkg", "imagereward_pkg"):
        env = reward_runtime_env(load_config(None, overrides=[*auto, f"reward.spec={spec}"]))
        assert env["py_executable"] == "/opt/venvs/hpsv2/bin/python" and "pip" not in env
        assert env["env_vars"]["HF_HUB_OFFLINE"] == "1"
