"""One typed, validated run config: YAML presets/files plus dotted command-line overrides.

    cfg = load_config("tiny", overrides=["train.lr=0.01", "replay.mode=hardmine"])

A wrong key or value raises ConfigError naming the key, the value and what is allowed, before
anything starts. Allowed values and defaults have one home each, the module that implements them
(weighting schemes, replay and advantage modes, log-prob modes, NaN policies, dtypes/devices, the
learner's and sampler's settings, LoRA targets); this layer only reads them.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from diffrlhf.buffer import advantages, replay
from diffrlhf.buffer.credit import RECAST_MODES
from diffrlhf.learner import recast
from diffrlhf.learner.lora import DEFAULT_RANK, DEFAULT_TARGETS
from diffrlhf.learner.timesteps import SELECTIONS
from diffrlhf.learner.update import ALGORITHMS, LOGPROB_MODES, UpdateSettings
from diffrlhf.learner.weighting import SCHEMES
from diffrlhf.policy.models import DEVICES, DTYPES
from diffrlhf.policy.sampler import SamplingSettings
from diffrlhf.rewards import weighted_sum_weights
from diffrlhf.rewards.serving import NAN_POLICIES

PRESET_DIR = Path(__file__).parent / "presets"


class ConfigError(ValueError):
    pass


_SAMPLING, _UPDATE = SamplingSettings(), UpdateSettings()  # the defaults of sample.*, train.* and friends


def _default(cls, name: str):
    """The default of a constructor argument: the class that implements a setting owns its default."""
    return inspect.signature(cls).parameters[name].default


@dataclass
class ModelConfig:
    name: str = "tiny-world"  # tiny-world | tiny-random[:seed] | local diffusers folder | hub id (local cache only)
    dtype: str = "float32"  # float32 | float16 | bfloat16 (base model; LoRA weights stay fp32)
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    lora_rank: int = DEFAULT_RANK
    lora_alpha: float = 0.0  # 0 means = rank
    lora_targets: list = field(default_factory=lambda: list(DEFAULT_TARGETS))


@dataclass
class SampleConfig:
    num_steps: int = _SAMPLING.num_steps
    eta: float = _SAMPLING.eta
    guidance_scale: float = _SAMPLING.guidance_scale
    resolution: int = _SAMPLING.resolution
    negative_prompt: str = _SAMPLING.negative_prompt
    batch_size: int = 8  # trajectories per sampler call
    batches_per_epoch: int = 4  # epoch size = batch_size * batches_per_epoch
    samples_per_prompt: int = 1  # k samples of each prompt in a batch (needed >= 2 for advantage.mode=group)


@dataclass
class PromptConfig:
    train: str = "tiny-world-train"  # builtin list name or a text file (one prompt a line)
    eval: str = "tiny-world-eval"


@dataclass
class RewardConfig:
    spec: typing.Any = "jpeg_compressibility"  # name, or {name: ..., **kwargs}; see rewards/README.md
    nan_policy: str = "raise"  # raise | drop
    batch_size: int = 8
    # Ray runtime_env of the reward actors: none (the core environment), a mapping, or "auto": the
    # environment the reward needs (rewards.default_runtime_env; actors.settings.reward_runtime_env).
    runtime_env: typing.Any = None


@dataclass
class AdvantageConfig:
    mode: str = _default(advantages.AdvantageComputer, "mode")  # per_prompt (DDPO tracker) | batch | group (GRPO)
    buffer_size: int = _default(advantages.AdvantageComputer, "buffer_size")
    min_count: int = _default(advantages.AdvantageComputer, "min_count")
    clip_max: float = _default(advantages.AdvantageComputer, "clip_max")


@dataclass
class WeightingConfig:
    scheme: str = _UPDATE.weighting  # one of learner.weighting.SCHEMES
    gaussian_width: float = _UPDATE.gaussian_width
    # oracle: the probe that measures the per-step reward variance (actors/oracle.py); its
    # trajectories x steps x branches reward queries count in the run's budget
    oracle_trajectories: int = 4
    oracle_branches: int = 4
    oracle_every: int = 0  # re-measure after every this many updates (0: once, before the first)


@dataclass
class RecastConfig:
    # ReCAST (several rewards, each weighted at the steps where it informs; learner/recast.py,
    # buffer/credit.py): off | pre (per-step mixed reward) | loss (per-reward losses). Needs a
    # weighted_sum reward of >= 2 terms; their weights are the budgets lambda_i.
    mode: str = _UPDATE.recast
    alpha: float = _default(recast.recast_weights, "alpha")  # the Renyi divergence's order
    temperature: float = _default(recast.recast_weights, "temperatures")  # tau: Sinkhorn kernel exp(g_hat / tau)
    sinkhorn_iterations: int = _default(recast.recast_weights, "iterations")
    sinkhorn_tolerance: float = _default(recast.recast_weights, "tolerance")
    # the probe (actors/recast_probe.py): P trajectories, M fresh samples of each prompt and M
    # branches at each step; its P * M * T + P reward queries count in the run's budget
    trajectories: int = 4
    branches: int = 4
    every: int = 0  # re-measure W after every this many updates (0: once, before the first)


@dataclass
class ReplayConfig:
    mode: str = _default(replay.ReplayBuffer, "mode")  # none | hardmine | random
    max_epochs: int = _default(replay.ReplayBuffer, "max_epochs")  # past epochs kept for replay (the off-policy bound)
    k: int = _default(replay.ReplayBuffer, "k")  # replayed trajectories per update
    logprob_mode: str = _UPDATE.logprob_mode  # recorded (sampling-time log-probs) | recompute (policy at update start)


@dataclass
class AlgorithmConfig:
    name: str = _UPDATE.algorithm  # one of learner.update.ALGORITHMS: ddpo | dpok | b2diffurl
    kl_coef: float = _UPDATE.kl_coef  # dpok: beta, weight of the per-step KL to the pretrained model
    reward_scale: float = _UPDATE.reward_scale  # dpok: alpha, scale of the advantage
    # b2diffurl: a branch group's best row is trained if its advantage is >= this, its worst if < the
    # negative one (the reference's run_process.sh values)
    b2_pos_threshold: float = 0.5
    b2_neg_threshold: float = -0.5


@dataclass
class TrainConfig:
    epochs: int = 10
    lr: float = _UPDATE.lr
    adam_beta1: float = _UPDATE.adam_beta1
    adam_beta2: float = _UPDATE.adam_beta2
    weight_decay: float = _UPDATE.weight_decay
    adam_eps: float = _UPDATE.adam_eps
    clip_range: float = _UPDATE.clip_range
    max_grad_norm: float = _UPDATE.max_grad_norm
    timestep_fraction: float = _UPDATE.timestep_fraction  # share of the T steps trained per trajectory
    timestep_selection: str = _UPDATE.timestep_selection  # which steps: all | random | weighted | top | window | backward
    inner_epochs: int = _UPDATE.inner_epochs
    batch_size: int = _UPDATE.batch_size
    grad_accum_steps: int = _UPDATE.grad_accum_steps  # optimizer step every grad_accum_steps batches (x trained timesteps), as DDPO


@dataclass
class SystemConfig:
    num_samplers: int = 2
    num_reward_actors: int = 1
    sampler_gpus: float = 0.0
    sampler_cpus: float = 1.0
    reward_gpus: float = 0.0
    reward_cpus: float = 0.5
    learner_gpus: float = 0.0  # per learner
    learner_cpus: float = 1.0  # per learner
    num_learners: int = 1  # a data-parallel learner group (torch.distributed: NCCL on GPU, gloo on CPU)
    colocate: bool = False  # sampler i and learner i share one placement bundle (one GPU): num_samplers == num_learners
    max_policy_lag: int = 1  # 0 = synchronous DDPO schedule
    max_inflight_per_sampler: int = 1
    idle_timeout_s: float = 600.0  # nothing finished for this long: the run stops, saying what it waits on
    start_timeout_s: float = 900.0  # an actor that has not started (model loaded) by then is an error
    max_actor_restarts: int = 3  # Ray restarts of a dead sampler or reward actor
    max_batch_retries: int = 2  # re-runs of a batch whose sampler/reward actor died; then it is dropped (counted)
    use_role_resources: bool = False  # ask custom resources "sampler"/"reward"/"learner" (cluster worker groups)
    checkpoint_timeout_s: float = 600.0
    torch_threads: int = 1  # per actor, so actors on one node don't oversubscribe its cores


@dataclass
class RunConfig:
    seed: int = 0
    out_dir: str = "runs"
    name: str = ""  # default: <preset>-<timestamp>
    save_every: int = 1
    image_grid_every: int = 5
    tensorboard: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    prompts: PromptConfig = field(default_factory=PromptConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    weighting: WeightingConfig = field(default_factory=WeightingConfig)
    recast: RecastConfig = field(default_factory=RecastConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    run: RunConfig = field(default_factory=RunConfig)
    preset: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def samples_per_epoch(self) -> int:
        return self.sample.batch_size * self.sample.batches_per_epoch


_CHOICES = {
    "model.dtype": DTYPES,
    "model.device": DEVICES,
    "reward.nan_policy": NAN_POLICIES,
    "advantage.mode": advantages.MODES,
    "weighting.scheme": SCHEMES,
    "replay.mode": replay.MODES,
    "replay.logprob_mode": LOGPROB_MODES,
    "train.timestep_selection": SELECTIONS,
    "algorithm.name": ALGORITHMS,
    "recast.mode": RECAST_MODES,
}
# key -> (predicate, what is allowed)
_RANGES = {
    "sample.num_steps": (lambda v: v >= 1, ">= 1"),
    "sample.eta": (lambda v: v > 0, "> 0 (eta = 0 is deterministic DDIM: no policy log-prob)"),
    "sample.guidance_scale": (lambda v: v >= 1, ">= 1"),
    "sample.resolution": (lambda v: v >= 8 and v % 8 == 0, "a multiple of 8"),
    "sample.batch_size": (lambda v: v >= 1, ">= 1"),
    "sample.batches_per_epoch": (lambda v: v >= 1, ">= 1"),
    "sample.samples_per_prompt": (lambda v: v >= 1, ">= 1"),
    "model.lora_rank": (lambda v: v >= 1, ">= 1"),
    "model.lora_alpha": (lambda v: v >= 0, ">= 0"),
    "reward.batch_size": (lambda v: v >= 1, ">= 1"),
    "advantage.buffer_size": (lambda v: v >= 1, ">= 1"),
    "advantage.min_count": (lambda v: v >= 0, ">= 0"),
    "advantage.clip_max": (lambda v: v > 0, "> 0"),
    "weighting.gaussian_width": (lambda v: v > 0, "> 0"),
    "weighting.oracle_trajectories": (lambda v: v >= 2, ">= 2 (the standard error is over trajectories)"),
    "weighting.oracle_branches": (lambda v: v >= 2, ">= 2 (a variance needs two branches)"),
    "weighting.oracle_every": (lambda v: v >= 0, ">= 0 (0: measure once)"),
    "recast.alpha": (lambda v: v > 0 and v != 1, "> 0 and != 1 (1 is the KL limit, not the Renyi formula)"),
    "recast.temperature": (lambda v: v > 0, "> 0"),
    "recast.sinkhorn_iterations": (lambda v: v >= 1, ">= 1"),
    "recast.sinkhorn_tolerance": (lambda v: v > 0, "> 0"),
    "recast.trajectories": (lambda v: v >= 1, ">= 1"),
    "recast.branches": (lambda v: v >= 2, ">= 2 (a conditional mean over one branch is the reward itself)"),
    "recast.every": (lambda v: v >= 0, ">= 0 (0: measure once)"),
    "replay.max_epochs": (lambda v: v >= 0, ">= 0"),
    "replay.k": (lambda v: v >= 0, ">= 0"),
    "train.epochs": (lambda v: v >= 0, ">= 0"),
    "train.lr": (lambda v: v > 0, "> 0"),
    "train.clip_range": (lambda v: v > 0, "> 0 (use a large value such as 1e9 to turn clipping off)"),
    "train.max_grad_norm": (lambda v: v > 0, "> 0"),
    "train.timestep_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "train.inner_epochs": (lambda v: v >= 1, ">= 1"),
    "train.batch_size": (lambda v: v >= 1, ">= 1"),
    "train.grad_accum_steps": (lambda v: v >= 1, ">= 1"),
    "algorithm.kl_coef": (lambda v: v >= 0, ">= 0 (0: no KL term)"),
    "algorithm.reward_scale": (lambda v: v > 0, "> 0"),
    "system.num_samplers": (lambda v: v >= 1, ">= 1"),
    "system.num_learners": (lambda v: v >= 1, ">= 1"),
    "system.num_reward_actors": (lambda v: v >= 1, ">= 1"),
    "system.max_policy_lag": (lambda v: v >= 0, ">= 0"),
    "system.max_inflight_per_sampler": (lambda v: v >= 1, ">= 1"),
    "system.idle_timeout_s": (lambda v: v > 0, "> 0"),
    "system.start_timeout_s": (lambda v: v > 0, "> 0"),
    "system.torch_threads": (lambda v: v >= 1, ">= 1"),
    "system.max_actor_restarts": (lambda v: v >= 0, ">= 0"),
    "system.max_batch_retries": (lambda v: v >= 0, ">= 0"),
    "system.sampler_gpus": (lambda v: v >= 0, ">= 0"),
    "system.reward_gpus": (lambda v: v >= 0, ">= 0"),
    "system.learner_gpus": (lambda v: v >= 0, ">= 0"),
    "run.save_every": (lambda v: v >= 1, ">= 1"),
    "run.image_grid_every": (lambda v: v >= 0, ">= 0 (0: never)"),
}


def _coerce(key: str, value, typ):
    """Check/convert one value to its field's declared type, or raise ConfigError."""
    if typ is typing.Any:
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is list and isinstance(value, (list, tuple)):
        return list(value)
    if typ is bool and isinstance(value, bool):
        return value
    if typ in (int, float, str) and isinstance(value, typ) and not isinstance(value, bool):
        return value
    raise ConfigError(f"config key {key!r}: value {value!r} is a {type(value).__name__}, expected {typ.__name__}")


def apply_overrides(obj, data: dict, prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if k not in names:
            raise ConfigError(f"unknown config key {key!r}; allowed here: {', '.join(sorted(names))}")
        cur = getattr(obj, k)
        if dataclasses.is_dataclass(cur):
            if not isinstance(v, dict):
                raise ConfigError(f"config key {key!r} is a section; give a mapping, not {v!r}")
            apply_overrides(cur, v, key + ".")
        else:
            setattr(obj, k, _coerce(key, v, hints[k]))


def validate(cfg: Config) -> Config:
    flat = flatten(cfg.to_dict())
    for key, allowed in _CHOICES.items():
        if flat[key] not in allowed:
            raise ConfigError(f"config key {key!r}: value {flat[key]!r} is not allowed; choose one of {', '.join(allowed)}")
    for key, (ok, what) in _RANGES.items():
        if not ok(flat[key]):
            raise ConfigError(f"config key {key!r}: value {flat[key]!r} is out of range; must be {what}")
    if cfg.sample.batch_size % cfg.sample.samples_per_prompt:
        raise ConfigError(
            f"config key 'sample.batch_size': value {cfg.sample.batch_size} must be a multiple of "
            f"sample.samples_per_prompt ({cfg.sample.samples_per_prompt})"
        )
    env = cfg.reward.runtime_env
    if not (env is None or env == "auto" or isinstance(env, dict)):
        raise ConfigError(f"config key 'reward.runtime_env': value {env!r} must be null, 'auto' or a Ray runtime_env mapping")
    if cfg.advantage.mode == "group" and cfg.sample.samples_per_prompt < 2:
        raise ConfigError("config key 'advantage.mode': 'group' needs sample.samples_per_prompt >= 2")
    if cfg.train.timestep_selection == "all" and cfg.train.timestep_fraction != 1:
        raise ConfigError(f"config key 'train.timestep_fraction': value {cfg.train.timestep_fraction} must be 1 with "
                          "train.timestep_selection=all (every step is trained); for a subset choose random, weighted, top or window")
    if cfg.algorithm.name == "b2diffurl":
        if cfg.sample.samples_per_prompt < 2:
            raise ConfigError("config key 'algorithm.name': b2diffurl branches each prompt's samples from a shared prefix, so "
                              f"sample.samples_per_prompt (the branches, now {cfg.sample.samples_per_prompt}) must be >= 2")
        if cfg.train.timestep_selection != "backward":
            raise ConfigError(f"config key 'train.timestep_selection': b2diffurl trains the steps after its branch point, "
                              f"so it must be 'backward' (got {cfg.train.timestep_selection!r}); train.timestep_fraction "
                              "is then the first stage's share of the steps (the reference: 0.7)")
        if cfg.algorithm.b2_neg_threshold >= cfg.algorithm.b2_pos_threshold:
            raise ConfigError(f"config key 'algorithm.b2_neg_threshold': value {cfg.algorithm.b2_neg_threshold} must be "
                              f"below algorithm.b2_pos_threshold ({cfg.algorithm.b2_pos_threshold})")
    if cfg.train.batch_size < cfg.system.num_learners:
        raise ConfigError(f"config key 'system.num_learners': value {cfg.system.num_learners} is more than train.batch_size "
                          f"({cfg.train.batch_size}); every learner trains a slice of each mini-batch, so lower num_learners "
                          "or raise train.batch_size")
    if cfg.system.colocate and cfg.system.num_samplers != cfg.system.num_learners:
        raise ConfigError(f"config key 'system.colocate': true pairs sampler i with learner i in one bundle (one GPU), so "
                          f"system.num_samplers ({cfg.system.num_samplers}) must equal system.num_learners "
                          f"({cfg.system.num_learners}); set them equal or system.colocate=false")
    if cfg.recast.mode != "off":
        _validate_recast(cfg)
    if cfg.samples_per_epoch() % cfg.train.batch_size:
        raise ConfigError(
            f"config key 'train.batch_size': value {cfg.train.batch_size} must divide the epoch size "
            f"sample.batch_size * sample.batches_per_epoch = {cfg.samples_per_epoch()}"
        )
    return cfg


def _validate_recast(cfg: Config) -> None:
    mode = cfg.recast.mode
    budgets = weighted_sum_weights(cfg.reward.spec)
    if budgets is None or len(budgets) < 2:
        raise ConfigError(f"config key 'recast.mode': {mode!r} weights several rewards, so reward.spec must be a weighted_sum "
                          "of >= 2 terms (their weights are the budgets), e.g. {name: weighted_sum, terms: [{name: "
                          "jpeg_compressibility, weight: 0.5}, {name: tinyworld_alignment, weight: 0.5}]}; or set recast.mode=off")
    if any(b <= 0 for b in budgets):
        raise ConfigError(f"config key 'reward.spec': recast.mode={mode} takes the weighted_sum's weights as budgets, which "
                          f"must all be > 0, got {budgets}")
    if cfg.advantage.mode == "per_prompt":
        raise ConfigError(f"config key 'advantage.mode': recast.mode={mode} normalises each step's (or each reward's) "
                          "rewards over the epoch, so choose group or batch (per_prompt's tracker holds one reward's history)")
    if cfg.algorithm.name != "ddpo":
        raise ConfigError(f"config key 'algorithm.name': recast.mode={mode} is built on ddpo's loss only, got "
                          f"{cfg.algorithm.name!r}; set algorithm.name=ddpo or recast.mode=off")
    if cfg.weighting.scheme == "oracle":
        raise ConfigError(f"config key 'weighting.scheme': recast.mode={mode} runs its own probe; combine it with a "
                          "fixed scheme (uniform, ddim_std, ...), not oracle")


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("spec", "runtime_env"):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_override(text: str) -> dict:
    """'train.lr=1e-3' -> {'train': {'lr': 0.001}} (values parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
        value = raw.strip()  # YAML 1.1 reads off/on/yes/no as booleans; recast.mode=off means the word
    if isinstance(value, str) and _looks_numeric(raw):
        value = float(raw)  # YAML 1.1 reads '1e-3' as a string
    node: dict = {}
    cur = node
    parts = key.strip().split(".")
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return node


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_config(preset: str | None = "tiny", path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults < preset < YAML file < overrides; validated."""
    cfg = Config()
    layers = []
    if preset:
        p = PRESET_DIR / f"{preset}.yaml"
        if not p.exists():
            raise ConfigError(f"unknown preset {preset!r}; available: {', '.join(presets())}")
        layers.append(_load_yaml(p))
        cfg.preset = preset
    if path:
        layers.append(_load_yaml(Path(path)))
    layers += [parse_override(o) for o in overrides]
    for layer in layers:
        apply_overrides(cfg, layer)
    return validate(cfg)


def config_from_dict(d: dict) -> Config:
    cfg = Config()
    apply_overrides(cfg, d)
    return validate(cfg)
