"""The reward role. It may run in a package reward's own venv (image-reward, hpsv2: see
rewards/environments.py), where the core's transformers, diffusers and peft are absent or other
versions, so it imports only torch, numpy and diffrlhf.rewards, and receives the slice of the config
it reads as plain dataclasses (unpickling the run's Config would import every role's modules)."""
from __future__ import annotations

import dataclasses
from typing import Any

from diffrlhf.actors.role import Role, timed
from diffrlhf.rewards.serving import RewardServer


@dataclasses.dataclass(frozen=True)
class RewardSection:
    spec: Any
    nan_policy: str
    batch_size: int


@dataclasses.dataclass(frozen=True)
class SystemSection:
    torch_threads: int


@dataclasses.dataclass(frozen=True)
class RewardRoleConfig:
    """cfg.reward and cfg.system as the reward actor reads them (same attribute paths)."""
    reward: RewardSection
    system: SystemSection

    @classmethod
    def of(cls, cfg) -> "RewardRoleConfig":
        r = cfg.reward
        return cls(RewardSection(r.spec, r.nan_policy, r.batch_size), SystemSection(cfg.system.torch_threads))


def reward_server(cfg) -> RewardServer:
    """The reward function of cfg.reward.spec behind its query-counting server (also the reference loop's)."""
    return RewardServer(cfg.reward.spec, nan_policy=cfg.reward.nan_policy, batch_size=cfg.reward.batch_size)


class RewardWorker(Role):
    def __init__(self, cfg, rank: int = 0):
        self._init_role(cfg, f"reward-{rank}")
        self.server = reward_server(cfg)

    def stats(self) -> dict:
        """The role's busy time plus this actor's reward-query counts (distinct sample ids scored)."""
        return {**super().stats(), **{k: v for k, v in self.server.stats().items() if k in ("num_queries", "num_dropped")}}

    @timed
    def score(self, reward_input: dict):
        return self.server.score(reward_input["ids"], reward_input["images"], reward_input["prompts"])
