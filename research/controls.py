"""The shuffled-reward drift controls: research-only rewards, addressed as custom rewards.

    reward.spec=research.controls:ShuffledJpegCompressibility

CONTROLS maps the study's short names (its run folders are named by them) to those specs.
"""
from __future__ import annotations

import numpy as np

from diffrlhf.rewards.jpeg import JpegCompressibility
from diffrlhf.rewards.tinyworld_alignment import TinyWorldAlignment


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


class ShuffledJpegCompressibility(ShuffledControl, JpegCompressibility):
    """A control, not an objective: each image gets the compressibility of the NEXT image in the
    same call (cyclic). The rewards keep their distribution and each call's mean (so the logged
    reward mean is still the samples' mean compressibility), but none carries information about
    its own image, so the expected policy gradient is zero. Training on it measures how far an
    update rule moves the JPEG size with no reward signal at all (drift), to subtract from a
    run on the real reward."""

    name = "jpeg_compressibility_shuffled"


class ShuffledTinyWorldAlignment(ShuffledControl, TinyWorldAlignment):
    """A control, not an objective (as jpeg_compressibility_shuffled): each image gets the
    alignment score of the NEXT image in the same call (cyclic), scored against that image's own
    caption. Same rewards, distribution and per-call mean; none carries information about its own
    image, so training on it measures an update rule's drift with no reward signal."""

    name = "tinyworld_alignment_shuffled"


CONTROLS = {"jpeg_compressibility_shuffled": "research.controls:ShuffledJpegCompressibility",
            "tinyworld_alignment_shuffled": "research.controls:ShuffledTinyWorldAlignment"}


def reward_spec(name: str) -> str:
    """The spec a study passes to the product for one of its reward names (a control or a product reward)."""
    return CONTROLS.get(name, name)


def short_name(spec):
    """The inverse of reward_spec, for a spec string; other specs pass through."""
    return next((k for k, v in CONTROLS.items() if v == spec), spec)
