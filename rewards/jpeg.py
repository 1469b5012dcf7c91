"""DDPO's JPEG rewards (kvablack/ddpo-pytorch, ddpo_pytorch/rewards.py): the size of the image
saved as JPEG at quality 95 by PIL, in kB (bytes / 1000). Incompressibility rewards large files,
compressibility rewards small ones (the negated size)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from diffrlhf.rewards.control import ShuffledControl


def jpeg_size_kb(image: np.ndarray, quality: int = 95) -> float:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


class JpegIncompressibility:
    name = "jpeg_incompressibility"
    sign = 1.0

    def __init__(self, quality: int = 95):
        self.quality = quality

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        sizes = [jpeg_size_kb(np.asarray(im, dtype=np.uint8), self.quality) for im in images]
        return (self.sign * np.asarray(sizes, dtype=np.float64)).astype(np.float32)


class JpegCompressibility(JpegIncompressibility):
    name = "jpeg_compressibility"
    sign = -1.0


class ShuffledJpegCompressibility(ShuffledControl, JpegCompressibility):
    """A control, not an objective: each image gets the compressibility of the NEXT image in the
    same call (cyclic). The rewards keep their distribution and each call's mean (so the logged
    reward mean is still the samples' mean compressibility), but none carries information about
    its own image, so the expected policy gradient is zero. Training on it measures how far an
    update rule moves the JPEG size with no reward signal at all (drift), to subtract from a
    run on the real reward."""

    name = "jpeg_compressibility_shuffled"
