"""LAION aesthetic predictor v2 ("improved-aesthetic-predictor", sac+logos+ava1-l14-linearMSE.pth),
as DDPO uses it (ddpo_pytorch/aesthetic_scorer.py): CLIP ViT-L/14 image embedding, L2-normalised,
into a 5-layer MLP with no nonlinearities. Prompt-independent.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from ._weights import find_weight_file, from_pretrained_offline
from .preprocess import clip_preprocess

WEIGHTS_FILE = "sac+logos+ava1-l14-linearMSE.pth"
WEIGHTS_URL = (
    "https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/sac%2Blogos%2Bava1-l14-linearMSE.pth"
)
DEFAULT_CLIP = "openai/clip-vit-large-patch14"


class AestheticMLP(nn.Module):
    """Layer list and attribute name `layers` match the published state dict
    (keys layers.0/2/4/6/7.weight|bias); the dropouts keep the indices aligned."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embed: torch.Tensor) -> torch.Tensor:
        return self.layers(embed)


def find_weights(weights=None) -> str:
    """The MLP's .pth on this machine (MissingWeightsError if absent); nothing is loaded."""
    return find_weight_file(
        "aesthetic",
        WEIGHTS_FILE,
        explicit=weights,
        # ImageReward's load_score("Aesthetic") saves the URL basename, still %-encoded.
        local_dirs=["~/.cache/ImageReward", "~/.cache/aesthetic"],
        alt_names=["sac%2Blogos%2Bava1-l14-linearMSE.pth"],
        hf_repos=["camenduru/improved-aesthetic-predictor"],
    )


class AestheticScorer:
    name = "aesthetic"

    def __init__(self, clip_model, mlp: AestheticMLP, device="cpu", dtype=torch.float32, image_size: int | None = None,
                 resize: str = "torch"):
        # clip_model: a transformers CLIPVisionModelWithProjection (or CLIPModel); only the vision
        # tower and its projection are used, which is what CLIPModel.get_image_features computes.
        self.clip = clip_model.to(device=device, dtype=dtype).eval()
        self.mlp = mlp.to(device=device, dtype=dtype).eval()
        self.device, self.dtype = torch.device(device), dtype
        cfg = getattr(clip_model.config, "vision_config", clip_model.config)
        self.image_size = image_size or cfg.image_size
        self.resize = resize  # "torch" (batched) or "pil" (bit-exact with CLIPImageProcessor)

    @classmethod
    def from_spec(cls, weights=None, clip_model: str = DEFAULT_CLIP, device="cpu", dtype="float32", resize="torch"):
        from transformers import AutoConfig, CLIPVisionModelWithProjection

        path = find_weights(weights)
        mlp = AestheticMLP()
        mlp.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        # Only the vision tower + projection is loaded (what get_image_features uses). From a full
        # CLIP checkpoint, the projection width lives in the top-level config, not vision_config.
        cfg = from_pretrained_offline(AutoConfig, clip_model, "aesthetic", "CLIP ViT-L/14 config")
        if hasattr(cfg, "vision_config"):
            vcfg = cfg.vision_config
            vcfg.projection_dim = cfg.projection_dim
        else:
            vcfg = cfg
        clip = from_pretrained_offline(CLIPVisionModelWithProjection, clip_model, "aesthetic", "CLIP ViT-L/14 vision tower",
                                       config=vcfg)
        return cls(clip, mlp, device=device, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
                   resize=resize)

    def preprocess(self, images: np.ndarray) -> torch.Tensor:
        # CLIPImageProcessor semantics (transformers' center_crop uses floor offsets).
        return clip_preprocess(images, self.image_size, crop_rounding="floor", backend=self.resize)

    @torch.no_grad()
    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        px = pixel_values.to(self.device, self.dtype)
        if hasattr(self.clip, "get_image_features"):  # a full CLIPModel
            out = self.clip.get_image_features(pixel_values=px)
            emb = out if isinstance(out, torch.Tensor) else out.pooler_output  # transformers 5 returns an output object
        else:
            emb = self.clip(pixel_values=px).image_embeds
        return emb / torch.linalg.vector_norm(emb, dim=-1, keepdim=True)

    @torch.no_grad()
    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        return self.mlp(self.embed(self.preprocess(images))).squeeze(1).float().cpu().numpy()
