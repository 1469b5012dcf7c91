"""Reward functions for diffrlhf.

Contract: a reward is ``fn(images: np.ndarray uint8 [B,H,W,3], prompts: list[str]) -> np.ndarray
float32 [B]``, higher is better. ``build_reward(spec)`` makes one from a name or a dict
``{"name": ..., **kwargs}``; see rewards/README.md for every name, its kwargs, where weights are
looked up, and the custom-callable rule.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping, Union

import numpy as np

from ._weights import MissingWeightsError

RewardFn = Callable[[np.ndarray, "list[str]"], np.ndarray]
Spec = Union[str, Mapping[str, Any]]

__all__ = ["build_reward", "default_runtime_env", "MissingWeightsError", "NonFiniteRewardError", "RewardFn",
           "WeightedSum", "REWARD_NAMES", "spec_name"]


def _jpeg_incompressibility(**kw):
    from .jpeg import JpegIncompressibility

    return JpegIncompressibility(**kw)


def _jpeg_compressibility(**kw):
    from .jpeg import JpegCompressibility

    return JpegCompressibility(**kw)


def _jpeg_compressibility_shuffled(**kw):
    from .jpeg import ShuffledJpegCompressibility

    return ShuffledJpegCompressibility(**kw)


def _aesthetic(**kw):
    from .aesthetic import AestheticScorer

    return AestheticScorer.from_spec(**kw)


def _imagereward(**kw):
    from .imagereward import ImageRewardScorer

    return ImageRewardScorer.from_spec(**kw)


def _imagereward_pkg(**kw):
    from .imagereward import PackageImageReward

    return PackageImageReward(**kw)


def _hpsv2(**kw):
    from .hpsv2 import HPSv2Scorer

    return HPSv2Scorer.from_spec(**kw)


def _hpsv2_pkg(**kw):
    from .hpsv2 import PackageHPSv2

    return PackageHPSv2(**kw)


# Heavy modules (torch models) are imported only when their reward is built.
_BUILDERS: dict[str, Callable[..., RewardFn]] = {
    "jpeg_compressibility": _jpeg_compressibility,
    "jpeg_incompressibility": _jpeg_incompressibility,
    "jpeg_compressibility_shuffled": _jpeg_compressibility_shuffled,
    "aesthetic": _aesthetic,
    "imagereward": _imagereward,
    "imagereward_pkg": _imagereward_pkg,
    "hpsv2": _hpsv2,
    "hpsv2_pkg": _hpsv2_pkg,
}
REWARD_NAMES = tuple(_BUILDERS) + ("weighted_sum",)

# What the package-backed rewards need in their own environment. Kept in sync with
# rewards/envs/*-requirements.txt (the test suite checks that).
_PKG_ENVS = {"imagereward_pkg": "imagereward-requirements.txt", "hpsv2_pkg": "hpsv2-requirements.txt"}


def spec_name(spec: Spec) -> str:
    return spec if isinstance(spec, str) else str(spec["name"])


def _split(spec: Spec) -> tuple[str, dict]:
    if isinstance(spec, str):
        return spec, {}
    if not isinstance(spec, Mapping) or "name" not in spec:
        raise ValueError(f"reward spec must be a name or a dict with 'name', got {spec!r}")
    kw = dict(spec)
    return str(kw.pop("name")), kw


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
        out = np.asarray(self.fn(images, prompts), dtype=np.float32).reshape(-1)
        if out.shape != (len(images),):
            raise ValueError(f"reward {self.name!r} returned {out.shape[0]} values for {len(images)} images")
        return out

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
        out = {}
        for name, _, fn in self.terms:
            key, k = name, 2
            while key in out:
                key, k = f"{name}#{k}", k + 1
            out[key] = fn(images, prompts)
        return out

    def __call__(self, images, prompts) -> np.ndarray:
        total = np.zeros(len(images), dtype=np.float64)
        for _, w, fn in self.terms:
            total += w * fn(images, prompts).astype(np.float64)
        return total.astype(np.float32)


def _import_custom(name: str, kw: dict) -> RewardFn:
    """"pkg.module:attr" -> callable. Rule (also in README.md):
    - attr is a class: instantiated with the spec's kwargs; the instance is the reward.
    - attr is a function and the spec has kwargs (or "factory": true): it is a factory, called
      with the kwargs; what it returns is the reward.
    - attr is a function and the spec has no kwargs: it is the reward itself."""
    mod_name, _, attr = name.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"custom reward must be 'package.module:callable', got {name!r}")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as e:
        raise ImportError(f"custom reward {name!r}: cannot import module {mod_name!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ImportError(f"custom reward {name!r}: module {mod_name!r} has no attribute {attr!r}") from e
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
    elif name in _BUILDERS:
        fn = _BUILDERS[name](**kw)
    elif ":" in name:
        fn = _import_custom(name, kw)
    else:
        raise ValueError(f"unknown reward {name!r}; known: {', '.join(REWARD_NAMES)}, or 'package.module:callable'")
    return _Checked(fn, name)


def requirements(name: str) -> list[str]:
    """Pinned requirement lines for a package-backed reward's own environment."""
    from pathlib import Path

    path = Path(__file__).with_name("envs") / _PKG_ENVS[name]
    lines = [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("-")]


def default_runtime_env(spec: Spec, python: str | None = None) -> dict | None:
    """Suggested Ray runtime_env for the actor that serves this reward; None when the reward runs
    in the core environment (jpeg_*, aesthetic, and the native imagereward / hpsv2).

    Package-backed rewards get {"py_executable": python} when a prebuilt venv's interpreter is
    given (recommended: same Python and Ray version as the cluster, diffrlhf installed with
    --no-deps); without one, imagereward_pkg gets {"pip": <rewards/envs/imagereward-requirements.txt>}
    for Ray to build per node, and hpsv2_pkg raises (it needs a --no-deps install step).
    HF_HUB_OFFLINE=1 keeps the packages' hub calls to the local cache (runs never download)."""
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
    if name not in _PKG_ENVS:
        return None
    env: dict = {"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}}
    if python:
        env["py_executable"] = python
    elif name == "hpsv2_pkg":
        # hpsv2x must be installed with --no-deps (its protobuf<4 pin breaks Ray), which a Ray
        # "pip" runtime_env cannot express: a prebuilt venv is the only supported route.
        raise ValueError("hpsv2_pkg needs a prebuilt environment: build it as described in "
                         "rewards/envs/hpsv2-requirements.txt and pass python='/path/to/venv/bin/python'")
    else:
        env["pip"] = {"packages": requirements(name), "pip_check": False}
    return env


from .serving import NonFiniteRewardError  # noqa: E402  (serving imports build_reward from here)
