"""The bounded, |A|-prioritised replay of recent epochs (historical hard-mining).

The buffer keeps the scored trajectories of the last `max_epochs` epochs (policy versions) and
nothing older: older trajectories are far off-policy, and the bound is what keeps replay helpful.
Each update trains on the current epoch plus `k` past trajectories chosen by `mode`:
  none      no replay (DDPO);
  hardmine  the k past trajectories with the largest |advantage| (ties: newest first, then order);
  random    k past trajectories uniformly at random (the ablation).
Memory is bounded by max_epochs + 1 epochs (one without replay), whatever the number of epochs run.
"""
from __future__ import annotations

import torch

from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.keys import check, choices, default

MODES = choices("replay.mode")


class ReplayBuffer:
    def __init__(self, max_epochs: int = default("replay.max_epochs"), mode: str = default("replay.mode"), k: int = default("replay.k"),
                 seed: int = 0):
        check("replay.mode", mode), check("replay.max_epochs", max_epochs), check("replay.k", k)
        self.max_epochs, self.mode, self.k = max_epochs, mode, k
        self.epochs: dict[int, TrajectoryBatch] = {}
        self.rng = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return sum(len(b) for b in self.epochs.values())

    def add(self, epoch: int, batch: TrajectoryBatch) -> None:
        """Store a scored epoch (advantages set) and evict epochs that left the window."""
        if torch.isnan(batch.advantages).any():
            raise ValueError("ReplayBuffer.add needs trajectories with advantages computed")
        self.epochs[epoch] = TrajectoryBatch.cat([self.epochs[epoch], batch]) if epoch in self.epochs else batch
        self.evict(current_epoch=epoch)

    def evict(self, current_epoch: int) -> None:
        # Keep the current epoch and the max_epochs epochs before it; without replay (mode none or
        # k 0) nothing past is ever read, so only the current epoch (the checkpoint holds what is kept).
        window = self.max_epochs if self.mode != "none" and self.k > 0 else 0
        for e in [e for e in self.epochs if e < current_epoch - window]:
            del self.epochs[e]

    def past(self, current_epoch: int) -> TrajectoryBatch | None:
        """All stored trajectories from epochs allowed for replay (inside the window, before now)."""
        keep = sorted((e for e in self.epochs if current_epoch - self.max_epochs <= e < current_epoch), reverse=True)
        return TrajectoryBatch.cat([self.epochs[e] for e in keep]) if keep else None

    def sample_hardmined(self, current_epoch: int, k: int | None = None) -> TrajectoryBatch | None:
        """The k past trajectories with the largest |A|; stable order: newest epoch first on ties."""
        past = self.past(current_epoch)
        if past is None or not len(past):
            return None
        k = min(self.k if k is None else k, len(past))
        order = torch.argsort(past.advantages.abs(), descending=True, stable=True)
        return past.select(order[:k])

    def sample_random(self, current_epoch: int, k: int | None = None) -> TrajectoryBatch | None:
        past = self.past(current_epoch)
        if past is None or not len(past):
            return None
        k = min(self.k if k is None else k, len(past))
        return past.select(torch.randperm(len(past), generator=self.rng)[:k])

    def sample_replay(self, current_epoch: int) -> TrajectoryBatch | None:
        if self.mode == "none" or self.k == 0:
            return None
        return self.sample_hardmined(current_epoch) if self.mode == "hardmine" else self.sample_random(current_epoch)

    def training_batch(self, current_epoch: int) -> TrajectoryBatch:
        """The current epoch's trajectories, then the replayed ones, marked `replayed`."""
        current = self.epochs.get(current_epoch)
        if current is None:
            raise KeyError(f"no trajectories stored for epoch {current_epoch}")
        replay = self.sample_replay(current_epoch)
        if replay is None:
            return current
        replay.replayed = torch.ones(len(replay), dtype=torch.bool)
        return TrajectoryBatch.cat([current, replay])

    def state_dict(self) -> dict:
        return {"max_epochs": self.max_epochs, "mode": self.mode, "k": self.k, "rng": self.rng.get_state(),
                "epochs": {e: b.to_ipc_bytes() for e, b in self.epochs.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.max_epochs, self.mode, self.k = state["max_epochs"], state["mode"], state["k"]
        self.rng.set_state(state["rng"])
        self.epochs = {int(e): TrajectoryBatch.from_ipc_bytes(b) for e, b in state["epochs"].items()}
