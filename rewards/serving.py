"""The plain (non-Ray) core of a reward server; the lead wraps it in a Ray actor.

RewardServer scores (id, image, prompt) triples in chunks of `batch_size`, counts reward queries
exactly (each distinct sample id once, however often it is re-scored), and refuses NaN/inf
rewards unless told to drop them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from diffrlhf.keys import choices

from . import Spec, WeightedSum, build_reward, spec_name

NAN_POLICIES = choices("reward.nan_policy")  # what RewardServer does with a NaN/inf reward


class NonFiniteRewardError(FloatingPointError):
    """A reward came back NaN or inf. Names the reward, the sample id, and its prompt."""

    def __init__(self, reward: str, sample_id, prompt: str, value: float):
        self.reward, self.sample_id, self.prompt, self.value = reward, sample_id, prompt, value
        super().__init__(f"reward {reward!r} returned {value} for sample id {sample_id} (prompt {prompt!r}); "
                         f"set the config key reward.nan_policy=drop to skip such samples instead "
                         f"(RewardServer(nan_policy='drop') in Python)")

    def __reduce__(self):  # picklable with its fields: Ray re-raises it in the caller's process
        return (type(self), (self.reward, self.sample_id, self.prompt, self.value))


@dataclass
class ScoreResult:
    ids: list            # ids of the samples that got a finite reward, in input order
    rewards: np.ndarray  # float32, aligned with ids
    dropped_ids: list = field(default_factory=list)  # non-finite ones (nan_policy="drop" only)
    # A weighted_sum reward's terms, unweighted: [len(ids), R] float32 aligned with ids, and their names
    # (None for a single reward). `rewards` is their weighted sum, exactly as WeightedSum computes it.
    terms: np.ndarray | None = None
    term_names: list | None = None

    def as_dict(self) -> dict:
        return dict(zip(self.ids, self.rewards.tolist()))


class RewardServer:
    """Parameters
    spec: reward spec for build_reward, or an already built reward callable.
    nan_policy: "raise" -> NonFiniteRewardError on the first NaN/inf; "drop" -> such samples are
        left out of the result, listed in dropped_ids, and counted in num_dropped.
    batch_size: images per reward call (bounds peak memory of the learned models).

    Counting: num_queries is the number of distinct sample ids ever scored (dropped ones
    included: the reward model was queried for them). A re-scored id is not counted again. The
    set of seen ids costs about 60-70 bytes per id (1 M samples ~ 70 MB). A sample scored by a
    weighted_sum of k rewards is one query (the image is judged once, by k models); k * num_queries
    is the number of reward-model calls per image (`term_queries` in stats).
    """

    def __init__(self, spec: Spec, nan_policy: str = "raise", batch_size: int = 8):
        if nan_policy not in ("raise", "drop"):
            raise ValueError(f"nan_policy must be 'raise' or 'drop', got {nan_policy!r}")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.reward = build_reward(spec)
        # a weighted_sum (behind build_reward's contract check; each of its terms is checked itself)
        inner = getattr(self.reward, "fn", self.reward)
        self.terms = inner if isinstance(inner, WeightedSum) else None
        self.reward_name = spec_name(spec) if isinstance(spec, (str, dict)) else getattr(self.reward, "name", "custom")
        self.nan_policy, self.batch_size = nan_policy, int(batch_size)
        self._seen: set = set()
        self._dropped: set = set()
        self.num_calls = 0          # reward-function invocations (chunks)
        self.seconds = 0.0          # time spent inside the reward function

    @property
    def num_queries(self) -> int:
        return len(self._seen)

    @property
    def num_dropped(self) -> int:
        return len(self._dropped)

    def stats(self) -> dict:
        return {"reward": self.reward_name, "num_queries": self.num_queries, "num_dropped": self.num_dropped,
                "num_calls": self.num_calls, "seconds": self.seconds,
                "term_queries": self.num_queries * (len(self.terms.terms) if self.terms else 1),
                "images_per_s": (self.num_queries / self.seconds) if self.seconds else None}

    def score(self, ids: list, images, prompts: list[str]) -> ScoreResult:
        ids, prompts = list(ids), list(prompts)
        images = np.asarray(images)
        if not (len(ids) == len(images) == len(prompts)):
            raise ValueError(f"got {len(ids)} ids, {len(images)} images, {len(prompts)} prompts")
        keep_ids, keep_r, keep_terms, dropped = [], [], [], []
        for s in range(0, len(ids), self.batch_size):
            chunk = slice(s, s + self.batch_size)
            t0 = time.perf_counter()
            if self.terms is not None:  # each term once; the total from them, as WeightedSum.__call__
                scores = self.terms.term_scores(images[chunk], prompts[chunk])
                r = self.terms.total(scores)
                term_rows = np.stack([np.asarray(x, dtype=np.float32) for x in scores], axis=1)
            else:
                r = self.reward(images[chunk], prompts[chunk])
            self.seconds += time.perf_counter() - t0
            self.num_calls += 1
            # Count before checking values: the model was queried even if the answer is unusable.
            self._seen.update(ids[chunk])
            for j, (sid, prompt, v) in enumerate(zip(ids[chunk], prompts[chunk], r)):
                if np.isfinite(v):
                    keep_ids.append(sid)
                    keep_r.append(v)
                    if self.terms is not None:
                        keep_terms.append(term_rows[j])
                elif self.nan_policy == "raise":
                    raise NonFiniteRewardError(self.reward_name, sid, prompt, float(v))
                else:
                    dropped.append(sid)
                    self._dropped.add(sid)
        if self.terms is None:
            return ScoreResult(keep_ids, np.asarray(keep_r, dtype=np.float32), dropped)
        n_terms = len(self.terms.terms)
        terms = np.stack(keep_terms).astype(np.float32) if keep_terms else np.zeros((0, n_terms), np.float32)
        return ScoreResult(keep_ids, np.asarray(keep_r, dtype=np.float32), dropped, terms, self.terms.term_names)
