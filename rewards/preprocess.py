"""Image preprocessing for the learned rewards, in plain torch (no torchvision: it does not import
beside the CPU torch build the core uses).

All functions take a uint8 batch [B,H,W,3] (numpy or torch) and return float32 NCHW.

Resampling: the reference pipelines resize with PIL's bicubic filter (CLIPImageProcessor for the
aesthetic model, torchvision-on-PIL for ImageReward) or with torchvision's tensor resize (HPSv2).
`F.interpolate(mode="bicubic", antialias=True)` is torch's port of PIL's filter (cubic a=-0.5,
support scaled when downsampling) and exactly what torchvision's tensor resize calls; see
`resize` for how the uint8 PIL path is emulated, and backend="pil" for bit-exact PIL.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def to_nchw_float(images) -> torch.Tensor:
    """uint8 [B,H,W,3] -> float32 [B,3,H,W] in 0..255 (not rescaled yet)."""
    if isinstance(images, np.ndarray):
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"expected uint8 [B,H,W,3] images, got {images.dtype} {images.shape}")
        t = torch.from_numpy(np.ascontiguousarray(images))
    else:
        t = torch.as_tensor(images)
        if t.dtype != torch.uint8 or t.ndim != 4 or t.shape[-1] != 3:
            raise ValueError(f"expected uint8 [B,H,W,3] images, got {t.dtype} {tuple(t.shape)}")
    return t.permute(0, 3, 1, 2).float()


def shortest_side_size(h: int, w: int, size: int) -> tuple[int, int]:
    """Output (h, w) when the shortest side becomes `size`; the long side is truncated with int(),
    as both torchvision.Resize(int) and transformers' get_resize_output_image_size do."""
    if h <= w:
        return size, int(size * w / h)
    return int(size * h / w), size


def resize(x: torch.Tensor, hw: tuple[int, int], quantize: bool) -> torch.Tensor:
    """Bicubic antialiased resize of float NCHW in 0..255.

    quantize=True emulates PIL on a uint8 image: PIL resamples width first, then height, and
    stores the intermediate as rounded, clamped uint8. Doing the same two passes here brings the
    result to within 1-2 levels of PIL with ~0.01 mean error (one float pass: up to 20 levels on
    noisy upsampled images, because PIL clips the overshoot in between). quantize=False is one
    float pass with no rounding, as torchvision's tensor resize (HPSv2's pipeline)."""
    if tuple(x.shape[-2:]) == tuple(hw):
        return x
    if not quantize:
        return F.interpolate(x, size=hw, mode="bicubic", antialias=True, align_corners=False)
    # a bicubic (a=-0.5) pass at scale 1 is the identity, so each call resizes one axis only
    if x.shape[-1] != hw[1]:
        x = F.interpolate(x, size=(x.shape[-2], hw[1]), mode="bicubic", antialias=True, align_corners=False)
        x = x.round().clamp_(0, 255)
    if x.shape[-2] != hw[0]:
        x = F.interpolate(x, size=hw, mode="bicubic", antialias=True, align_corners=False)
        x = x.round().clamp_(0, 255)
    return x


def center_crop(x: torch.Tensor, size: int, rounding: str = "floor") -> torch.Tensor:
    """Crop the centre size x size. `rounding`: "floor" = transformers' center_crop
    ((h - size) // 2); "round" = torchvision.CenterCrop (int(round((h - size) / 2))).
    They differ only when h - size is odd; SD images are square so neither path crops."""
    h, w = x.shape[-2:]
    if h < size or w < size:
        raise ValueError(f"image {h}x{w} smaller than crop {size}")
    if rounding == "floor":
        top, left = (h - size) // 2, (w - size) // 2
    elif rounding == "round":
        top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    else:
        raise ValueError(rounding)
    return x[..., top : top + size, left : left + size]


def normalize(x01: torch.Tensor, mean=CLIP_MEAN, std=CLIP_STD) -> torch.Tensor:
    m = torch.tensor(mean, dtype=x01.dtype, device=x01.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=x01.dtype, device=x01.device).view(1, 3, 1, 1)
    return (x01 - m) / s


def pil_resize(images, hw: tuple[int, int]) -> torch.Tensor:
    """PIL bicubic resize per image (bit-exact with the upstream pipelines), float NCHW 0..255."""

    arr = np.asarray(images)
    if tuple(arr.shape[1:3]) == tuple(hw):
        return to_nchw_float(arr)
    out = np.stack([np.asarray(Image.fromarray(im).resize((hw[1], hw[0]), Image.BICUBIC)) for im in arr])
    return to_nchw_float(out)


def clip_preprocess(images, size: int = 224, crop_rounding: str = "floor", backend: str = "torch") -> torch.Tensor:
    """CLIP convention: shortest side to `size` (bicubic, uint8-quantised like PIL), centre crop,
    /255, CLIP mean/std. Used by the aesthetic scorer (CLIPImageProcessor semantics) and by
    ImageReward (its torchvision Resize+CenterCrop on PIL, crop_rounding="round").
    backend="torch" resizes the batch with F.interpolate (within 1-2 uint8 levels of PIL);
    backend="pil" resizes each image with PIL, bit-exact with the reference implementations."""
    h, w = np.shape(images)[1:3]
    hw = shortest_side_size(h, w, size)
    if backend == "pil":
        x = pil_resize(images, hw)
    elif backend == "torch":
        x = resize(to_nchw_float(images), hw, quantize=True)
    else:
        raise ValueError(f"resize backend must be 'torch' or 'pil', got {backend!r}")
    x = center_crop(x, size, crop_rounding)
    return normalize(x / 255.0)


def resize_longest_pad_preprocess(images, size: int = 224, fill: float = 0.0) -> torch.Tensor:
    """HPSv2's validation transform (its open_clip fork, resize_longest_max=True): ToTensor first,
    then scale so the longest side is `size` (float bicubic, no rounding), pad symmetrically with
    `fill` (left/top get the floor half), then CLIP mean/std."""
    x = to_nchw_float(images) / 255.0
    h, w = x.shape[-2:]
    scale = size / float(max(h, w))
    if scale != 1.0:
        nh, nw = round(h * scale), round(w * scale)
        x = F.interpolate(x, size=(nh, nw), mode="bicubic", antialias=True, align_corners=False)
        ph, pw = size - nh, size - nw
        x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=fill)
    return normalize(x)
