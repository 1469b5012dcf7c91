"""The shuffled-reward drift control, shared by every reward that has one."""
from __future__ import annotations

import numpy as np


class ShuffledControl:
    """Mixin before a reward class: each image gets the reward of the NEXT image in the same call
    (cyclic). The rewards keep their distribution and each call's mean, but none carries
    information about its own image, so training on it measures an update rule's drift with no
    reward signal. Subclasses set `name`."""

    name = "shuffled"

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        if len(images) < 2:
            raise ValueError(f"{self.name}: a call must score at least 2 images (got {len(images)}), or an image would "
                             "get its own reward; use reward.batch_size >= 2 and sample batches of >= 2")
        return np.roll(super().__call__(images, prompts), -1)
