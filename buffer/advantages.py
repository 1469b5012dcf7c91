"""Advantages from final-image rewards: DDPO's per-prompt tracker, batch and group (GRPO) normalisation."""
from __future__ import annotations

from collections import deque

import numpy as np

from diffrlhf.keys import check, choices, default
MODES = choices("advantage.mode")


class PerPromptStatTracker:
    """DDPO's tracker: normalise each reward by the mean/std of the recent rewards of its prompt.

    Each prompt keeps its last `buffer_size` rewards; until it has `min_count` of them the batch's
    own mean/std is used instead (DDPO's fallback). std gets +1e-6 as in DDPO.
    """

    def __init__(self, buffer_size: int = default("advantage.buffer_size"), min_count: int = default("advantage.min_count")):
        self.buffer_size, self.min_count = buffer_size, min_count
        self.stats: dict[str, deque] = {}

    def update(self, prompts: list[str], rewards: np.ndarray) -> np.ndarray:
        prompts_arr = np.asarray(prompts, dtype=object)
        rewards = np.asarray(rewards, dtype=np.float64)
        adv = np.empty_like(rewards)
        for prompt in dict.fromkeys(prompts):  # first-seen order: deterministic
            mask = prompts_arr == prompt
            hist = self.stats.setdefault(prompt, deque(maxlen=self.buffer_size))
            hist.extend(rewards[mask].tolist())
            ref = rewards if len(hist) < self.min_count else np.asarray(hist)
            adv[mask] = (rewards[mask] - ref.mean()) / (ref.std() + 1e-6)
        return adv

    def state_dict(self) -> dict:
        return {"buffer_size": self.buffer_size, "min_count": self.min_count, "stats": {k: list(v) for k, v in self.stats.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.buffer_size, self.min_count = state["buffer_size"], state["min_count"]
        self.stats = {k: deque(v, maxlen=self.buffer_size) for k, v in state["stats"].items()}


def batch_advantages(rewards: np.ndarray) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    return (r - r.mean()) / (r.std() + 1e-6)


def group_advantages(prompts: list[str], rewards: np.ndarray) -> np.ndarray:
    """GRPO: normalise within the k samples of each prompt in this batch."""
    prompts_arr = np.asarray(prompts, dtype=object)
    r = np.asarray(rewards, dtype=np.float64)
    adv = np.empty_like(r)
    for prompt in dict.fromkeys(prompts):
        mask = prompts_arr == prompt
        if mask.sum() < 2:
            raise ValueError(
                f"group advantages need >= 2 samples per prompt, prompt {prompt!r} has {int(mask.sum())}; "
                "set sample.samples_per_prompt >= 2"
            )
        g = r[mask]
        adv[mask] = (g - g.mean()) / (g.std() + 1e-6)
    return adv


class AdvantageComputer:
    """One object for the three modes, with clipping to +/- clip_max and checkpointable state."""

    def __init__(self, mode: str = default("advantage.mode"), clip_max: float = default("advantage.clip_max"),
                 buffer_size: int = default("advantage.buffer_size"), min_count: int = default("advantage.min_count")):
        check("advantage.mode", mode), check("advantage.clip_max", clip_max)
        self.mode, self.clip_max = mode, clip_max
        self.tracker = PerPromptStatTracker(buffer_size, min_count)

    def __call__(self, prompts: list[str], rewards) -> np.ndarray:
        rewards = np.asarray(rewards, dtype=np.float64)
        if not np.all(np.isfinite(rewards)):
            bad = [prompts[i] for i in np.flatnonzero(~np.isfinite(rewards))[:3]]
            raise ValueError(f"non-finite rewards reached the advantage computation (prompts {bad}); drop or fix them upstream")
        if self.mode == "per_prompt":
            adv = self.tracker.update(prompts, rewards)
        elif self.mode == "batch":
            adv = batch_advantages(rewards)
        else:
            adv = group_advantages(prompts, rewards)
        return np.clip(adv, -self.clip_max, self.clip_max).astype(np.float32)

    def state_dict(self) -> dict:
        return {"mode": self.mode, "clip_max": self.clip_max, "tracker": self.tracker.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.mode, self.clip_max = state["mode"], state["clip_max"]
        self.tracker.load_state_dict(state["tracker"])
