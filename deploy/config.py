"""One typed, validated run config: YAML presets/files plus dotted command-line overrides.

    cfg = load_config("tiny", overrides=["train.lr=0.01", "replay.mode=hardmine"])

A wrong key or value raises ConfigError naming the key, the value and what is allowed, before
anything starts. Each key's type, default, allowed values or range and meaning are declared once,
in diffrlhf.keys (the lowest layer, which the implementing modules read too); this module builds the
sections from it and adds the checks that relate several keys.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from diffrlhf.keys import KEYS, SECTIONS, section_keys
from diffrlhf.learner import algorithms
from diffrlhf.rewards import weighted_sum_weights

PRESET_DIR = Path(__file__).parent / "presets"


class ConfigError(ValueError):
    pass


def _section_class(section: str):
    """The dataclass of one config section, its fields declared in diffrlhf.keys (type, default)."""
    fields = []
    for k in section_keys(section):
        default = field(default_factory=lambda k=k: list(k.default)) if isinstance(k.default, list) else field(default=k.default)
        fields.append((k.leaf, k.type, default))
    cls = dataclasses.make_dataclass(f"{section.capitalize()}Config", fields)
    cls.__module__ = __name__
    cls.__doc__ = f"The config's {section}.* keys (declared in diffrlhf.keys)."
    return cls


# One class per section, named so pickling (Ray ships the config to actors) finds them here.
ModelConfig, SampleConfig, PromptsConfig, RewardConfig, AdvantageConfig, WeightingConfig, RecastConfig, ReplayConfig, \
    TrainConfig, AlgorithmConfig, SystemConfig, RunConfig = (_section_class(s) for s in SECTIONS)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
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
    for key, declared in KEYS.items():
        why = declared.problem(flat[key])
        if why:
            raise ConfigError(f"config key {key!r}: value {flat[key]!r} {why}")
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
    if cfg.algorithm.name not in algorithms.names():
        raise ConfigError(f"config key 'algorithm.name': value {cfg.algorithm.name!r} is not allowed; choose one of "
                          f"{', '.join(algorithms.names())}")
    algorithm = algorithms.get(cfg.algorithm.name)
    why = algorithm.check(cfg)
    if why:
        raise ConfigError(why)
    if cfg.recast.mode != "off" and not algorithm.supports_recast:
        raise ConfigError(f"config key 'algorithm.name': recast.mode={cfg.recast.mode} needs an algorithm whose loss takes "
                          f"each reward's credit (ddpo), got {cfg.algorithm.name!r}; set algorithm.name=ddpo or recast.mode=off")
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


def unflatten(flat: dict) -> dict:
    """{'train.lr': 0.1} -> {'train': {'lr': 0.1}}."""
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
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
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give a YAML file (config sections, e.g. train: {{lr: 0.001}})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (PermissionError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} cannot be read ({type(e).__name__}: {e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
        raise ConfigError(f"config file {where}: not valid YAML: {what}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_config(preset: str | None = "tiny", path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Key table < the algorithm's defaults < preset < YAML file < overrides; validated."""
    return resolve_config(preset, path, overrides)[0]


def resolve_config(preset: str | None = "tiny", path: str | Path | None = None,
                   overrides: list[str] = ()) -> tuple[Config, dict[str, str]]:
    """The validated config, and where each key's value came from: "default" (diffrlhf.keys),
    "algorithm NAME" (its own defaults), "preset NAME", "file PATH" or "override" (the last layer
    that set it)."""
    cfg = Config()
    layers = []
    if preset:
        p = PRESET_DIR / f"{preset}.yaml"
        if not p.exists():
            raise ConfigError(f"unknown preset {preset!r}; available: {', '.join(presets())}")
        layers.append((f"preset {preset}", _load_yaml(p)))
        cfg.preset = preset
    if path:
        layers.append((f"file {path}", _load_yaml(Path(path))))
    layers += [("override", parse_override(o)) for o in overrides]
    # The algorithm's own defaults sit between the key table and the preset: the last layer that
    # names algorithm.name picks it.
    name = next((layer["algorithm"]["name"] for _, layer in reversed(layers)
                 if isinstance(layer.get("algorithm"), dict) and "name" in layer["algorithm"]), KEYS["algorithm.name"].default)
    if isinstance(name, str) and name in algorithms.names() and algorithms.get(name).defaults:
        layers.insert(0, (f"algorithm {name}", unflatten(algorithms.get(name).defaults)))
    sources = dict.fromkeys(KEYS, "default")
    for source, layer in layers:
        apply_overrides(cfg, layer)
        sources.update(dict.fromkeys(flatten(layer), source))
    return validate(cfg), sources


def keys_table() -> str:
    """Every key as a markdown table (what `diffrlhf config keys` prints and README embeds)."""
    rows = ["| key | type | default | allowed | meaning | read by |", "| --- | --- | --- | --- | --- | --- |"]
    for k in KEYS.values():
        typ = "any" if k.type is typing.Any else k.type.__name__
        default = yaml.safe_dump(k.default, default_flow_style=True, width=1000).strip().removesuffix("...").strip()
        cells = [f"`{k.name}`", typ, f"`{default}`", k.allowed() + (f" ({k.why})" if k.why else ""), k.doc, ", ".join(k.roles)]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def show_config(cfg: Config, sources: dict[str, str]) -> str:
    """The resolved config as YAML, each value with its source (Hydra's --cfg job, with provenance)."""
    flat, lines, section = flatten(cfg.to_dict()), [], None
    for key in KEYS:
        sec, leaf = key.split(".", 1)
        if sec != section:
            lines.append(f"{sec}:")
            section = sec
        value = yaml.safe_dump(flat[key], default_flow_style=True, width=1000).strip().removesuffix("...").strip()
        lines.append(f"  {leaf + ':':<28} {value:<40} # {sources[key]}")
    return "\n".join(lines) + "\n"


def config_from_dict(d: dict) -> Config:
    cfg = Config()
    apply_overrides(cfg, d)
    return validate(cfg)
