"""The interface and the registry (see the package docstring)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

_REGISTRY: dict[str, "Algorithm"] = {}


@dataclasses.dataclass
class StepContext:
    """One trained step of a mini-batch, as the update hands it to `step_loss`.

    logp, old: [n] log-probs of the taken step under the policy and the old policy; advantages
    [n, K]: the credit's K advantage terms, times c * w(t) (K = 1 unless ReCAST's `loss` mode);
    coef [n]: the step selection's unbiasing coefficients c; mean, std: the policy's step Gaussian;
    mean_pretrained: the pretrained model's step mean (only when `uses_pretrained`); settings: the
    learner's UpdateSettings."""
    logp: torch.Tensor
    old: torch.Tensor
    advantages: torch.Tensor
    coef: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    settings: Any
    mean_pretrained: torch.Tensor | None = None


class Algorithm:
    name: str = ""
    defaults: dict[str, Any] = {}
    uses_pretrained: bool = False
    supports_recast: bool = False  # its step_loss uses every credit term (ReCAST's per-reward advantages)
    # per-row statistics step_loss returns in its info beyond approx_kl and clipfrac, recorded as
    # epoch means (e.g. DPOK's kl_pretrained)
    records: tuple[str, ...] = ()

    def check(self, cfg) -> str | None:
        """A message naming the key and what this algorithm needs of it, or None."""
        return None

    def branch_step(self, cfg, epoch: int) -> int | None:
        return None

    def train_rows(self, cfg) -> Callable | None:
        return None

    def step_loss(self, ctx: StepContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError


def register(cls):
    """Class decorator: make `cls` (an Algorithm subclass with a unique `name`) choosable as algorithm.name."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"algorithm {cls.__name__} needs a unique name, got {cls.name!r}")
    _REGISTRY[cls.name] = cls()
    return cls


def get(name: str) -> Algorithm:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(_REGISTRY)}") from None


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)
