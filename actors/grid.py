"""The epoch's image grid, from the reward inputs the driver already holds: images reach the reward
actors and this grid only; the buffer, the learners and the checkpoints never carry them."""
from __future__ import annotations

import numpy as np
import ray

GRID_ROWS = 16


def grid_due(cfg, epoch: int) -> bool:
    g = cfg.run.image_grid_every
    return bool(g) and (epoch % g == 0 or epoch == cfg.train.epochs - 1)


def grid_rows(inputs: dict, timeout_s: float) -> tuple[np.ndarray, list[str]]:
    """The epoch's first GRID_ROWS images and prompts in batch order, from {batch index: reward-input ref}."""
    images, prompts = [], []
    for b in sorted(inputs):
        x = ray.get(inputs[b], timeout=timeout_s)
        images.append(np.asarray(x["images"]))
        prompts += list(x["prompts"])
        if len(prompts) >= GRID_ROWS:
            break
    return np.concatenate(images)[:GRID_ROWS], prompts[:GRID_ROWS]
