"""Reward functions for diffrlhf.

Contract: a reward is ``fn(images: np.ndarray uint8 [B,H,W,3], prompts: list[str]) -> np.ndarray
float32 [B]``, higher is better. ``build_reward(spec)`` makes one from a name or a dict
``{"name": ..., **kwargs}``; see rewards/README.md for every name, its kwargs, where weights are
looked up, and the custom-callable rule.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any, Callable, Mapping, Union

import numpy as np

from ._weights import MissingWeightsError, hf_cached_file
from .environments import BY_REWARD, check, requirement_lines

RewardFn = Callable[[np.ndarray, "list[str]"], np.ndarray]
Spec = Union[str, Mapping[str, Any]]

__all__ = ["as_rewards", "build_reward", "check_prompts", "RewardContractError", "trial_call", "uses_prompts", "check_spec", "default_runtime_env", "MissingWeightsError", "NonFiniteRewardError", "RewardFn",
           "RewardSpecError", "WeightedSum", "REWARD_NAMES", "spec_name"]


# name -> (module, attribute): the callable that takes the spec's kwargs. Heavy modules (torch
# models) are imported only when their reward is built or checked.
_BUILTINS: dict[str, tuple[str, str]] = {
    "jpeg_compressibility": ("jpeg", "JpegCompressibility"),
    "jpeg_incompressibility": ("jpeg", "JpegIncompressibility"),
    "tinyworld_alignment": ("tinyworld_alignment", "TinyWorldAlignment"),
    "aesthetic": ("aesthetic", "AestheticScorer.from_spec"),
    "imagereward": ("imagereward", "ImageRewardScorer.from_spec"),
    "imagereward_pkg": ("imagereward", "PackageImageReward"),
    "hpsv2": ("hpsv2", "HPSv2Scorer.from_spec"),
    "hpsv2_pkg": ("hpsv2", "PackageHPSv2"),
}
# The learned rewards of the core environment: their module's find_weights(...) locates the weight
# file without loading a model. (_pkg rewards run in their own environment, where files may differ.)
_WEIGHT_LOOKUPS = ("aesthetic", "imagereward", "hpsv2")


def _attr(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _builtin(name: str) -> Callable[..., RewardFn]:
    mod, attr = _BUILTINS[name]
    return _attr(importlib.import_module(f".{mod}", __name__), attr)


REWARD_NAMES = tuple(_BUILTINS) + ("weighted_sum",)

# What the package-backed rewards need in their own environment. Kept in sync with
# rewards/envs/*-requirements.txt (the test suite checks that).


def spec_name(spec: Spec) -> str:
    return spec if isinstance(spec, str) else str(spec["name"])


def _split(spec: Spec) -> tuple[str, dict]:
    if isinstance(spec, str):
        return spec, {}
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ValueError(f"reward spec must be a name or a dict with 'name', got {spec!r}")
    kw = dict(spec)
    return str(kw.pop("name")), kw


CONTRACT = "a reward returns one number per image (an array of B floats, higher is better)"


class RewardContractError(ValueError):
    """A reward returned something that is not one number per image."""


def as_rewards(name: str, values, n: int) -> np.ndarray:
    """values as float32 [n], or a RewardContractError naming the reward and the contract. Strings
    are refused even when they parse as numbers ("1.5"): numpy would convert them silently."""
    raw = np.asarray(values)
    if raw.dtype.kind == "O":  # e.g. a list mixing numbers and other things: look at each
        bad = [v for v in raw.reshape(-1) if isinstance(v, (str, bytes)) or not isinstance(v, (int, float, np.number))]
        if bad:
            bad = bad[0]
            raise RewardContractError(f"reward {name!r} returned a {type(bad).__name__} ({bad!r}); {CONTRACT}")
    elif raw.dtype.kind not in "biuf":
        kind = {"U": "str", "S": "bytes"}.get(raw.dtype.kind, raw.dtype.name)
        example = raw.reshape(-1)[0].item() if raw.size else ""
        raise RewardContractError(f"reward {name!r} returned {kind} values ({example!r}); {CONTRACT}")
    out = raw.astype(np.float32).reshape(-1)
    if out.shape != (n,):
        raise RewardContractError(f"reward {name!r} returned {out.shape[0]} values for {n} images; {CONTRACT}")
    return out


class _Checked:
    """Wraps any reward so the contract holds at the boundary: one float32 per image."""

    def __init__(self, fn: RewardFn, name: str):
        self.fn, self.name = fn, name

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"reward {self.name!r}: images must be uint8 [B,H,W,3], got {images.dtype} {images.shape}")
        prompts = list(prompts)
        if len(prompts) != len(images):
            raise ValueError(f"reward {self.name!r}: {len(images)} images but {len(prompts)} prompts")
        return as_rewards(self.name, self.fn(images, prompts), len(images))

    def __getattr__(self, item):  # expose the scorer's attributes (e.g. .model, .components)
        if item == "fn":  # not set yet (e.g. during unpickling): avoid infinite recursion
            raise AttributeError(item)
        return getattr(self.fn, item)

    def __repr__(self):
        return f"<reward {self.name}>"


class WeightedSum:
    """sum_i weight_i * reward_i(images, prompts). Terms are full specs plus a "weight" (default 1)."""

    name = "weighted_sum"

    def __init__(self, terms):
        if not terms:
            raise ValueError("weighted_sum needs at least one term")
        self.terms = []
        for t in terms:
            t = {"name": t} if isinstance(t, str) else dict(t)
            w = float(t.pop("weight", 1.0))
            self.terms.append((spec_name(t), w, build_reward(t)))

    def components(self, images, prompts) -> dict[str, np.ndarray]:
        """Each term's unweighted reward (for logging), keyed name, name#2, ... if repeated."""
        return dict(zip(self.term_names, self.term_scores(images, prompts)))

    @property
    def term_names(self) -> list[str]:
        """Each term's name, name#2, ... if repeated (the keys of `components`)."""
        return _distinct([name for name, _, _ in self.terms])

    @property
    def weights(self) -> list[float]:
        return [w for _, w, _ in self.terms]

    def term_scores(self, images, prompts) -> list[np.ndarray]:
        """Each term's unweighted reward, in term order: one query of each term per image."""
        return [np.asarray(fn(images, prompts)) for _, _, fn in self.terms]

    def total(self, scores: list[np.ndarray]) -> np.ndarray:
        """The weighted sum of `term_scores`' arrays, float32 (summed in float64, in term order)."""
        total = np.zeros(len(scores[0]), dtype=np.float64)
        for (_, w, _), r in zip(self.terms, scores):
            total += w * r.astype(np.float64)
        return total.astype(np.float32)

    def __call__(self, images, prompts) -> np.ndarray:
        return self.total(self.term_scores(images, prompts))


def _distinct(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        key, k = name, 2
        while key in out:
            key, k = f"{name}#{k}", k + 1
        out.append(key)
    return out


def weighted_sum_names(spec) -> list[str] | None:
    """The term names of a weighted_sum spec (name, name#2, ... if repeated), or None for any other spec."""
    if weighted_sum_weights(spec) is None:
        return None
    return _distinct([spec_name(t) for t in spec["terms"]])


def weighted_sum_weights(spec) -> list[float] | None:
    """The weights of a weighted_sum spec's terms, in order (ReCAST's budgets), or None for any other spec."""
    if not (isinstance(spec, Mapping) and spec.get("name") == "weighted_sum" and isinstance(spec.get("terms"), list)):
        return None
    return [float(t.get("weight", 1.0)) if isinstance(t, Mapping) else 1.0 for t in spec["terms"]]


def _custom_target(name: str):
    """"pkg.module:attr" -> the object it names (imported, not called)."""
    mod_name, _, attr = name.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"custom reward must be 'package.module:callable', got {name!r}")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise ImportError(f"custom reward {name!r}: cannot import module {mod_name!r}: {e}") from e
    try:
        return _attr(obj, attr)
    except AttributeError as e:
        raise ImportError(f"custom reward {name!r}: module {mod_name!r} has no attribute {attr!r}") from e


def _import_custom(name: str, kw: dict) -> RewardFn:
    """"pkg.module:attr" -> callable. Rule (also in README.md):
    - attr is a class: instantiated with the spec's kwargs; the instance is the reward.
    - attr is a function and the spec has kwargs (or "factory": true): it is a factory, called
      with the kwargs; what it returns is the reward.
    - attr is a function and the spec has no kwargs: it is the reward itself."""
    obj = _custom_target(name)
    factory = bool(kw.pop("factory", False))
    if inspect.isclass(obj) or factory or kw:
        obj = obj(**kw)
    if not callable(obj):
        raise TypeError(f"custom reward {name!r} did not give a callable (got {type(obj).__name__})")
    return obj


def build_reward(spec: Spec) -> RewardFn:
    """Build a reward from a name or {"name": ..., **kwargs}. See README.md for the names."""
    if callable(spec) and not isinstance(spec, (str, Mapping)):
        return _Checked(spec, getattr(spec, "name", getattr(spec, "__name__", "callable")))
    name, kw = _split(spec)
    if name == "weighted_sum":
        fn: RewardFn = WeightedSum(**kw)
    elif name in _BUILTINS:
        fn = _builtin(name)(**kw)
    elif ":" in name:
        fn = _import_custom(name, kw)
    else:
        raise ValueError(f"unknown reward {name!r}; known: {', '.join(REWARD_NAMES)}, or 'package.module:callable'")
    return _Checked(fn, name)


class RewardSpecError(ValueError):
    """A reward spec that cannot work: unknown name, kwargs the reward does not take, a custom
    callable that cannot be imported or called as fn(images, prompts)."""


def _bind_error(fn, args: tuple, kw: dict) -> str | None:
    """Why fn(*args, **kw) would not bind, or None (also when fn has no inspectable signature)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*args, **kw)
    except TypeError as e:
        return str(e)
    return None


def _check_kwargs(name: str, fn, kw: dict) -> None:
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(kw) - set(params))
    if unknown:
        raise RewardSpecError(f"reward {name!r} does not take {', '.join(map(repr, unknown))}; "
                              f"it takes: {', '.join(params) or 'no kwargs'} (see rewards/README.md)")


def _check_custom(name: str, kw: dict) -> None:
    # The same rule as _import_custom, checked on signatures: nothing is called.
    try:
        obj = _custom_target(name)
    except (ImportError, ValueError) as e:
        raise RewardSpecError(f"{e}. A custom reward is 'package.module:callable', importable here "
                              "(e.g. installed, or on PYTHONPATH)") from None
    kw = dict(kw)
    factory = bool(kw.pop("factory", False))
    if inspect.isclass(obj):
        why = _bind_error(obj, (), kw)
        if why:
            raise RewardSpecError(f"custom reward {name!r} is a class, built with the spec's kwargs {kw}: {why}")
        if not any("__call__" in vars(c) for c in obj.__mro__[:-1]):
            raise RewardSpecError(f"custom reward {name!r}: instances of class {obj.__name__} are not callable; "
                                  f"define __call__(self, images, prompts)")
        why = _bind_error(obj.__call__, (None, None, None), {})
        if why:
            raise RewardSpecError(f"custom reward {name!r}: {obj.__name__}.__call__ must take (images, prompts): {why}")
    elif not callable(obj):
        raise RewardSpecError(f"custom reward {name!r} is a {type(obj).__name__}, not a callable")
    elif factory or kw:  # a factory: what it returns is checked when it is built
        why = _bind_error(obj, (), kw)
        if why:
            raise RewardSpecError(f"custom reward {name!r} is called as a factory with the spec's kwargs {kw}: {why}")
    else:
        why = _bind_error(obj, (None, None), {})
        if why:
            raise RewardSpecError(f"custom reward {name!r} must be fn(images, prompts) -> one float per image, but cannot be called with "
                                  f"(images, prompts): {why}")


def check_spec(spec: Spec, local: bool = True) -> None:
    """Check that a spec can be built, without building it (no model is loaded): the name is known
    or a custom callable importable and callable as fn(images, prompts); the kwargs are ones the
    reward takes; a learned reward's weight file is on this machine (aesthetic: its CLIP too);
    each weighted_sum term likewise. Raises RewardSpecError, or MissingWeightsError (which names
    the file, where it looked and `diffrlhf fetch-weights NAME`).

    local=False checks only what holds everywhere (names, builtin kwargs, weighted_sum terms), for
    rewards served in another environment or on other nodes, where files and modules may differ."""
    if callable(spec) and not isinstance(spec, (str, Mapping)):
        return
    try:
        name, kw = _split(spec)
    except (ValueError, TypeError) as e:
        raise RewardSpecError(str(e)) from None
    if name == "weighted_sum":
        _check_kwargs(name, WeightedSum, kw)
        terms = kw.get("terms")
        if not isinstance(terms, (list, tuple)) or not terms:
            raise RewardSpecError(f"weighted_sum needs 'terms', a non-empty list of reward specs, got {terms!r}")
        for i, t in enumerate(terms):
            t = {"name": t} if isinstance(t, str) else t
            if not isinstance(t, Mapping):
                raise RewardSpecError(f"weighted_sum term {i}: {t!r} is not a reward name or a dict with 'name'")
            t = dict(t)
            w = t.pop("weight", 1.0)
            if isinstance(w, bool) or not isinstance(w, (int, float)):
                raise RewardSpecError(f"weighted_sum term {i}: weight {w!r} is not a number")
            try:
                check_spec(t, local)
            except RewardSpecError as e:
                raise RewardSpecError(f"weighted_sum term {i}: {e}") from None
    elif name in _BUILTINS:
        _check_kwargs(name, _builtin(name), kw)
        if local and name in _WEIGHT_LOOKUPS:
            find = importlib.import_module(f".{_BUILTINS[name][0]}", __name__).find_weights
            try:
                find(**{k: v for k, v in kw.items() if k in inspect.signature(find).parameters})
            except ValueError as e:  # e.g. an unknown hpsv2 version
                raise RewardSpecError(f"reward {name!r}: {e}") from None
        if local and name == "aesthetic":
            _check_pretrained(name, kw.get("clip_model", inspect.signature(_builtin(name)).parameters["clip_model"].default),
                              "CLIP ViT-L/14", "clip_model")
    elif ":" in name:
        if local:
            _check_custom(name, kw)
    else:
        raise RewardSpecError(f"unknown reward {name!r}; known: {', '.join(REWARD_NAMES)}, or 'package.module:callable'")


# Rewards that read only the image. Every other one (custom ones included) may depend on the prompt.
PROMPT_INDEPENDENT = frozenset({"jpeg_compressibility", "jpeg_incompressibility", "aesthetic"})


def uses_prompts(spec: Spec) -> bool:
    """Whether the reward may depend on the prompt (unknown rewards are assumed to)."""
    if callable(spec) and not isinstance(spec, (str, Mapping)):
        return True
    name, kw = _split(spec)
    if name == "weighted_sum":
        return any(uses_prompts({k: v for k, v in t.items() if k != "weight"} if isinstance(t, Mapping) else t)
                   for t in kw.get("terms") or [])
    return name not in PROMPT_INDEPENDENT


def reward_names(spec: Spec) -> list[str]:
    """The names of the rewards a spec builds, weighted_sum terms included ([] for a callable)."""
    if callable(spec) and not isinstance(spec, (str, Mapping)):
        return []
    name, kw = _split(spec)
    if name == "weighted_sum":
        return [n for t in kw.get("terms") or []
                for n in reward_names({k: v for k, v in t.items() if k != "weight"} if isinstance(t, Mapping) else t)]
    return [name]


def package_reward_names(spec: Spec) -> list[str]:
    """The package-backed rewards (served from their own venv) a spec uses."""
    return [n for n in reward_names(spec) if n in BY_REWARD]


def custom_names(spec: Spec) -> list[str]:
    """The custom ('package.module:callable') rewards a spec uses."""
    return [n for n in reward_names(spec) if ":" in n]


class NonFiniteTrialError(RewardContractError):
    """trial_call's test images got NaN/inf scores; `values` holds them."""

    def __init__(self, message: str, values):
        super().__init__(message)
        self.values = np.asarray(values, dtype=np.float64)


def trial_call(spec: Spec, prompts: list[str], resolution: int, n: int = 2) -> None:
    """Build the reward and score n test images (mid-grey plus noise, fixed seed) with the first
    prompts, so a custom reward that breaks the contract (strings, NaN/inf, a wrong length) fails
    here, before a run starts, with the reward's name. Raises RewardContractError."""
    rng = np.random.default_rng(0)
    images = np.clip(128 + rng.normal(0, 40, (n, resolution, resolution, 3)), 0, 255).astype(np.uint8)
    prompts = [prompts[i % len(prompts)] for i in range(n)] if prompts else [""] * n
    fn = build_reward(spec)
    try:
        out = fn(images, prompts)
    except RewardContractError:
        raise
    except Exception as e:
        raise RewardContractError(f"reward {spec_name(spec)!r} failed on {n} test images ({type(e).__name__}: {e}); {CONTRACT}") from e
    if not np.isfinite(out).all():
        raise NonFiniteTrialError(f"reward {spec_name(spec)!r} returned non-finite values {out.tolist()} for {n} test images; {CONTRACT} "
                                  "(finite; reward.nan_policy=drop drops occasional NaN/inf in a run)", out)


def check_prompts(spec: Spec, prompts: list[str]) -> None:
    """Raise the reward's own error (a ValueError naming the prompt) if it cannot read one of these
    prompts, without building it: for the builtin rewards that parse their prompts (a class with a
    check_prompts(prompts) static method, e.g. tinyworld_alignment), also as weighted_sum terms."""
    if callable(spec) and not isinstance(spec, (str, Mapping)):
        return
    name, kw = _split(spec)
    if name == "weighted_sum":
        for t in kw.get("terms") or []:
            check_prompts({k: v for k, v in t.items() if k != "weight"} if isinstance(t, Mapping) else t, prompts)
    elif name in _BUILTINS and hasattr(_builtin(name), "check_prompts"):
        _builtin(name).check_prompts(prompts)


def _check_pretrained(reward: str, name_or_path: str, what: str, kwarg: str) -> None:
    """A model loaded with from_pretrained(local_files_only=True): a local folder, or in the HF cache."""
    if Path(name_or_path).expanduser().is_dir():
        return
    searched = [f"{name_or_path} as a local folder"]
    if hf_cached_file(name_or_path, "config.json", searched) is None:
        raise MissingWeightsError(reward, f"{name_or_path} ({what})", searched,
                                  hint=f"or pass a local folder as {{'name': '{reward}', '{kwarg}': '/path/to/folder'}}.")


def requirements(name: str) -> list[str]:
    """Pinned requirement lines of a package-backed reward's own environment (rewards/envs/)."""
    return requirement_lines(BY_REWARD[name])


def default_runtime_env(spec: Spec, python: str | None = None) -> dict | None:
    """Ray runtime_env of the actor that serves this reward; None when the reward runs in the core
    environment (jpeg_*, aesthetic, the native imagereward / hpsv2, ...).

    A package-backed reward (imagereward_pkg, hpsv2_pkg) runs in its own venv's interpreter
    ({"py_executable": ...}): `python` when given, else the venv `diffrlhf reward-env build` made
    (rewards.environments.check: RewardEnvError naming that command when it is missing, half-built
    or made for another Python or Ray). HF_HUB_OFFLINE=1 keeps the packages' hub calls to the local
    cache (runs never download)."""
    name, kw = _split(spec)
    if name == "weighted_sum":
        envs = [default_runtime_env(t if isinstance(t, str) else {k: v for k, v in t.items() if k != "weight"}, python)
                for t in kw.get("terms", [])]
        envs = [e for e in envs if e is not None]
        if not envs:
            return None
        if any(e != envs[0] for e in envs[1:]):
            raise ValueError("weighted_sum mixes rewards that need different environments; serve them as separate actors")
        return envs[0]
    if name not in BY_REWARD:
        return None
    return {"py_executable": str(python or check(BY_REWARD[name].name)),
            "env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}}


from .serving import NonFiniteRewardError  # noqa: E402  (serving imports build_reward from here)
