"""B2-DiffuRL (Hu et al. 2025): branch sampling and backward training, with DDPO's loss.

The samplers branch each prompt's samples from one shared prefix after T - k steps, k the steps the
learner's `backward` selection trains at that epoch (so the trained segment is exactly the branched
one); the buffer trains each branch group's extremes: its best row if its advantage is >=
algorithm.b2_pos_threshold, its worst if < algorithm.b2_neg_threshold.

Its defaults: `backward` selection whose first stage trains 0.7 of the steps (with the thresholds
+-0.5 in the key table, the reference's run_process.sh values); 4 branches of each prompt
(sample.samples_per_prompt) and group advantages (the branches of one prefix compared with each
other) are this project's choice, the reference's scripts varying in their branch count."""
from __future__ import annotations

import torch

from diffrlhf.learner.algorithms.base import register
from diffrlhf.learner.algorithms.ddpo import DDPO
from diffrlhf.learner.timesteps import backward_trained_steps, num_trained_steps


def branch_extremes(sample_ids, advantages, group_size: int, pos_threshold: float, neg_threshold: float) -> list[int]:
    """B2-DiffuRL's choice of training rows: in each branch group (the rows whose sample id // group_size
    is equal: one shared prefix), the row of largest advantage if it is >= pos_threshold and the row
    of smallest advantage if it is < neg_threshold; the other rows are not trained. Ties go to the
    first row. Returns row indices in ascending order. A group short of rows (a dropped reward)
    still gives its extremes."""
    ids = torch.as_tensor(sample_ids).tolist()
    adv = torch.as_tensor(advantages, dtype=torch.float64).tolist()
    groups: dict[int, list[int]] = {}
    for row, sid in enumerate(ids):
        groups.setdefault(sid // group_size, []).append(row)
    keep = []
    for rows in groups.values():
        best = max(rows, key=lambda r: adv[r])  # max/min return the first of equal values
        worst = min(rows, key=lambda r: adv[r])
        keep += [best] if adv[best] >= pos_threshold else []
        keep += [worst] if adv[worst] < neg_threshold else []
    return sorted(keep)


@register
class B2DiffuRL(DDPO):
    name = "b2diffurl"
    supports_recast = False  # it trains branch extremes chosen by the weighted sum's advantage
    defaults = {"sample.samples_per_prompt": 4, "train.timestep_selection": "backward", "train.timestep_fraction": 0.7,
                "advantage.mode": "group"}

    def check(self, cfg) -> str | None:
        if cfg.sample.samples_per_prompt < 2:
            return ("config key 'algorithm.name': b2diffurl branches each prompt's samples from a shared prefix, so "
                    f"sample.samples_per_prompt (the branches, now {cfg.sample.samples_per_prompt}) must be >= 2")
        if cfg.train.timestep_selection != "backward":
            return (f"config key 'train.timestep_selection': b2diffurl trains the steps after its branch point, "
                    f"so it must be 'backward' (got {cfg.train.timestep_selection!r}); train.timestep_fraction "
                    "is then the first stage's share of the steps (the reference: 0.7)")
        if cfg.algorithm.b2_neg_threshold >= cfg.algorithm.b2_pos_threshold:
            return (f"config key 'algorithm.b2_neg_threshold': value {cfg.algorithm.b2_neg_threshold} must be "
                    f"below algorithm.b2_pos_threshold ({cfg.algorithm.b2_pos_threshold})")
        return None

    def branch_step(self, cfg, epoch: int) -> int | None:
        t = cfg.sample.num_steps
        first = num_trained_steps(t, cfg.train.timestep_fraction)
        return t - backward_trained_steps(t, first, min(1.0, epoch / cfg.train.epochs))

    def train_rows(self, cfg):
        a, g = cfg.algorithm, cfg.sample.samples_per_prompt
        return lambda batch: branch_extremes(batch.sample_ids, batch.advantages, g, a.b2_pos_threshold, a.b2_neg_threshold)
