"""The tiny model: Stable Diffusion 1.5's architecture (diffusers UNet2DConditionModel,
AutoencoderKL, CLIP text encoder, the real CLIP tokenizer, SD1.5's DDIM schedule) at a size that
trains and samples on a laptop CPU. Built offline and deterministically from a seed; the tiny
world's pretraining starts from it and `model.name=tiny-random` samples from it untrained.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrlhf.rewards._weights import cache_dir
from diffrlhf.rewards.clip_tokenizer import load_tokenizer_folder, write_clip_tokenizer

# SD1.5's scheduler (runwayml/stable-diffusion-v1-5/scheduler/scheduler_config.json).
SD15_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
    prediction_type="epsilon",
)


@dataclass(frozen=True)
class TinySize:
    """Sizes of the tiny SD1.5-architecture model (same block types as SD1.5, fewer channels)."""

    unet_channels: tuple[int, ...] = (32, 64)
    unet_layers_per_block: int = 1
    attention_head_dim: int = 8
    cross_attention_dim: int = 32
    norm_num_groups: int = 8
    vae_channels: tuple[int, ...] = (8, 16, 32, 32)  # 4 blocks -> scale factor 8, like SD
    vae_norm_num_groups: int = 4
    vae_scaling_factor: float = 0.18215
    text_layers: int = 2
    text_heads: int = 4
    text_intermediate: int = 64
    resolution: int = 64


def build_tiny_components(seed: int = 0, size: TinySize = TinySize()):
    """The tiny SD1.5-architecture model with seeded random weights, deterministic for a seed."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    n = len(size.unet_channels)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        sample_size=size.resolution // 8,
        in_channels=4,
        out_channels=4,
        block_out_channels=size.unet_channels,
        layers_per_block=size.unet_layers_per_block,
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
        cross_attention_dim=size.cross_attention_dim,
        attention_head_dim=size.attention_head_dim,
        norm_num_groups=size.norm_num_groups,
    )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(size.vae_channels),
        up_block_types=("UpDecoderBlock2D",) * len(size.vae_channels),
        block_out_channels=size.vae_channels,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=size.vae_norm_num_groups,
        sample_size=size.resolution,
        scaling_factor=size.vae_scaling_factor,
    )
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=49408,
            hidden_size=size.cross_attention_dim,
            intermediate_size=size.text_intermediate,
            num_attention_heads=size.text_heads,
            num_hidden_layers=size.text_layers,
            max_position_embeddings=77,
            bos_token_id=49406,
            eos_token_id=49407,
            pad_token_id=49407,
        )
    )
    scheduler = DDIMScheduler(**SD15_SCHEDULER_CONFIG)
    return unet, vae, text_encoder, scheduler


def save_components_folder(folder: Path, unet, vae, text_encoder, scheduler) -> Path:
    """Save in diffusers' StableDiffusionPipeline layout so stock tools load the folder too."""
    from diffusers import StableDiffusionPipeline

    tok_dir = write_clip_tokenizer(folder / "tokenizer")
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=load_tokenizer_folder(tok_dir),
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return folder


def build_folder_once(folder: Path, build) -> Path:
    """Build `folder` with build(tmp) once, atomically: concurrent builders (several Ray actors on
    a node) never see half a folder, and the loser of a race discards its copy."""
    if (folder / "model_index.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    try:
        tmp.rename(folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process got there first
    return folder


def ensure_tiny_random(seed: int = 0) -> Path:
    """Build (once) and return the folder of the seeded random tiny model."""
    return build_folder_once(cache_dir() / f"tiny-random-seed{seed}-v1",
                             lambda tmp: save_components_folder(tmp, *build_tiny_components(seed)))


# SD1.5's own shapes (runwayml/stable-diffusion-v1-5's configs): a random-weight model of the real
# size, for testing the roles at SD1.5's size without hub weights (model.name=sd15-random).
SD15_UNET = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
                 down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, cross_attention_dim=768, attention_head_dim=8)
SD15_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4, sample_size=512, scaling_factor=0.18215)
SD15_TEXT = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                 max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)


def _seeded_init(module: torch.nn.Module, gen: torch.Generator) -> None:
    """A cheap, seeded init of a module built on the meta device: norms at 1 / 0, biases 0, every other
    tensor N(0, 0.02) (fan-in-scaled inits of 1.1 B parameters take minutes on a CPU; this takes seconds)."""
    for name, p in sorted(module.named_parameters()):
        with torch.no_grad():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name.split(".")[-2]:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def build_sd15_random_components(seed: int = 0):
    """(unet, vae, text_encoder, scheduler) with SD1.5's architecture and seeded random weights, fp32.
    Built on the meta device, then materialised and filled: seconds, not minutes."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        unet, vae = UNet2DConditionModel(**SD15_UNET), AutoencoderKL(**SD15_VAE)
        text = CLIPTextModel(CLIPTextConfig(**SD15_TEXT))
    out = []
    for m in (unet, vae, text):
        m = m.to_empty(device="cpu")
        _seeded_init(m, gen)
        for name, b in m.named_buffers():  # e.g. CLIP's position ids: rebuilt from their definition
            if name.endswith("position_ids"):
                b.copy_(torch.arange(b.shape[-1]).expand_as(b))
        out.append(m.eval())
    return (*out, DDIMScheduler(**SD15_SCHEDULER_CONFIG))


def ensure_sd15_random(seed: int = 0) -> Path:
    """Build (once) and return the folder of SD1.5's architecture with seeded random weights (~4.3 GB)."""
    return build_folder_once(cache_dir() / f"sd15-random-seed{seed}-v1",
                             lambda tmp: save_components_folder(tmp, *build_sd15_random_components(seed)))


def to_vae_input(images) -> torch.Tensor:
    """uint8 images [B, H, W, 3] (numpy or torch) -> float [B, 3, H, W] in the VAE's range [-1, 1]."""
    return torch.as_tensor(images).permute(0, 3, 1, 2).float() / 127.5 - 1
