"""DDPO's JPEG rewards (kvablack/ddpo-pytorch, ddpo_pytorch/rewards.py): the size of the image
saved as JPEG at quality 95 by PIL, in kB (bytes / 1000). Incompressibility rewards large files,
compressibility rewards small ones (the negated size)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image



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
