"""One typed, validated run config: YAML presets/files plus dotted command-line overrides.

    cfg = load_config("tiny", overrides=["train.lr=0.01", "replay.mode=hardmine"])

A wrong key or value raises ConfigError naming the key, the value and what is allowed, before
anything starts.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

PRESET_DIR = Path(__file__).parent / "presets"


class ConfigError(ValueError):
    pass


@dataclass
class ModelConfig:
    name: str = "tiny-world"  # tiny-world | tiny-random[:seed] | local diffusers folder | hub id (local cache only)
    dtype: str = "float32"  # float32 | float16 | bfloat16 (base model; LoRA weights stay fp32)
    device: str = "auto"  # auto (cuda if available) | cpu | cuda
    lora_rank: int = 4
    lora_alpha: float = 0.0  # 0 means = rank
    lora_targets: list = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])


@dataclass
class SampleConfig:
    num_steps: int = 20
    eta: float = 1.0
    guidance_scale: float = 5.0
    resolution: int = 64
    negative_prompt: str = ""
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
    runtime_env: typing.Any = None  # Ray runtime_env for the reward actors (own venv/pip for image-reward, hpsv2)


@dataclass
class AdvantageConfig:
    mode: str = "per_prompt"  # per_prompt (DDPO tracker) | batch | group (GRPO)
    buffer_size: int = 16
    min_count: int = 16
    clip_max: float = 5.0


@dataclass
class WeightingConfig:
    scheme: str = "uniform"  # uniform | latent_sq | latent_abs | ddim_std | gaussian_early | gaussian_mid | gaussian_late
    gaussian_width: float = 0.2


@dataclass
class ReplayConfig:
    mode: str = "none"  # none | hardmine | random
    max_epochs: int = 2  # past epochs kept for replay (the off-policy bound)
    k: int = 8  # replayed trajectories per update
    logprob_mode: str = "recorded"  # recorded (sampling-time log-probs) | recompute (policy at update start)


@dataclass
class TrainConfig:
    epochs: int = 10
    lr: float = 3e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    weight_decay: float = 1e-4
    adam_eps: float = 1e-8
    clip_range: float = 1e-4
    max_grad_norm: float = 1.0
    timestep_fraction: float = 1.0
    inner_epochs: int = 1
    batch_size: int = 8
    grad_accum_steps: int = 1  # optimizer step every grad_accum_steps batches (x trained timesteps), as DDPO


@dataclass
class SystemConfig:
    num_samplers: int = 2
    num_reward_actors: int = 1
    sampler_gpus: float = 0.0
    sampler_cpus: float = 1.0
    reward_gpus: float = 0.0
    reward_cpus: float = 0.5
    learner_gpus: float = 0.0
    learner_cpus: float = 1.0
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
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    run: RunConfig = field(default_factory=RunConfig)
    preset: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def samples_per_epoch(self) -> int:
        return self.sample.batch_size * self.sample.batches_per_epoch


_CHOICES = {
    "model.dtype": ("float32", "float16", "bfloat16"),
    "model.device": ("auto", "cpu", "cuda"),
    "reward.nan_policy": ("raise", "drop"),
    "advantage.mode": ("per_prompt", "batch", "group"),
    "weighting.scheme": ("uniform", "latent_sq", "latent_abs", "ddim_std", "gaussian_early", "gaussian_mid", "gaussian_late"),
    "replay.mode": ("none", "hardmine", "random"),
    "replay.logprob_mode": ("recorded", "recompute"),
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
    "system.num_samplers": (lambda v: v >= 1, ">= 1"),
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


def _apply(obj, data: dict, prefix: str = "") -> None:
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
            _apply(cur, v, key + ".")
        else:
            setattr(obj, k, _coerce(key, v, hints[k]))


def validate(cfg: Config) -> Config:
    flat = _flatten(cfg.to_dict())
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
    if cfg.advantage.mode == "group" and cfg.sample.samples_per_prompt < 2:
        raise ConfigError("config key 'advantage.mode': 'group' needs sample.samples_per_prompt >= 2")
    if cfg.samples_per_epoch() % cfg.train.batch_size:
        raise ConfigError(
            f"config key 'train.batch_size': value {cfg.train.batch_size} must divide the epoch size "
            f"sample.batch_size * sample.batches_per_epoch = {cfg.samples_per_epoch()}"
        )
    return cfg


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("spec", "runtime_env"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_override(text: str) -> dict:
    """'train.lr=1e-3' -> {'train': {'lr': 0.001}} (values parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
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
        _apply(cfg, layer)
    return validate(cfg)


def config_from_dict(d: dict) -> Config:
    cfg = Config()
    _apply(cfg, d)
    return validate(cfg)
