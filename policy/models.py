"""Loading Stable Diffusion 1.5 components, real or tiny, through one code path.

A model spec is one of:
  * ``tiny-random``            a tiny SD1.5-architecture model with seeded random weights, built
                               offline into the cache on first use (fast; for tests);
  * ``sd15-random``            SD1.5's architecture and size (860 M-parameter UNet) with seeded random
                               weights, built offline into the cache on first use (~4.3 GB; for
                               testing the roles at SD1.5's size; never what a preset falls back to);
  * ``tiny-world``             the embedded default: the tiny model pretrained by this project on
                               its procedural image set (see tinyworld/);
  * a local folder             in diffusers format (unet/, vae/, text_encoder/, tokenizer/, scheduler/);
  * a hub id                   e.g. ``runwayml/stable-diffusion-v1-5``, resolved from the local
                               Hugging Face cache only (never downloaded during a run).

All of them are then loaded by :func:`load_components` from a folder, so the tiny model exercises
exactly the code that real SD1.5 runs. A missing model is an error that says where we looked;
there is no silent fallback to the tiny model.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrlhf.keys import choices
from diffrlhf.rewards.clip_tokenizer import load_tokenizer_folder
from diffrlhf.tinyworld.architecture import ensure_sd15_random, ensure_tiny_random
from diffrlhf.tinyworld.weights import TinyWorldWeightsError, ensure_tiny_world

TINY_RANDOM = "tiny-random"
SD15_RANDOM = "sd15-random"  # SD1.5's size, random weights: the name says so in the config, the log and the run folder
TINY_WORLD = "tiny-world"
DTYPES = choices("model.dtype")  # the base model's torch dtype (LoRA stays fp32)
DEVICES = choices("model.device")  # see resolve_device

class ModelNotFoundError(FileNotFoundError):
    """The model weights are not on this machine."""


@dataclass
class SDComponents:
    """The parts of an SD pipeline that RL fine-tuning needs (no safety checker)."""

    unet: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: object
    scheduler: object  # diffusers.DDIMScheduler
    source: str  # the folder the weights came from

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def device(self) -> torch.device:
        return next(self.unet.parameters()).device

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        ids = self.tokenizer(
            list(prompts),
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids.to(self.device)
        return self.text_encoder(ids)[0]

    @torch.no_grad()
    def decode_images(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> uint8 images [B, H, W, 3]."""
        x = self.vae.decode(latents.to(self.vae.dtype) / self.vae.config.scaling_factor).sample
        x = ((x.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return x.permute(0, 2, 3, 1).cpu()


# ----------------------------------------------------------------------------- resolution and loading


def resolve_model(spec: str) -> Path:
    """Turn a model spec into a local diffusers folder, or raise ModelNotFoundError saying why."""
    if spec == TINY_RANDOM or spec.startswith(TINY_RANDOM + ":"):
        seed = int(spec.split(":", 1)[1]) if ":" in spec else 0
        return ensure_tiny_random(seed)
    if spec == SD15_RANDOM or spec.startswith(SD15_RANDOM + ":"):
        seed = int(spec.split(":", 1)[1]) if ":" in spec else 0
        return ensure_sd15_random(seed)
    if spec == TINY_WORLD:
        try:
            return ensure_tiny_world()
        except TinyWorldWeightsError as e:
            raise ModelNotFoundError(str(e)) from None
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "unet").is_dir():
            raise ModelNotFoundError(
                f"model folder {path} exists but is not a diffusers Stable Diffusion folder "
                "(expected unet/, vae/, text_encoder/, tokenizer/, scheduler/ inside)"
            )
        return path
    if spec.startswith(("/", ".", "~")) or spec.count("/") != 1:
        raise ModelNotFoundError(f"model path {spec!r} does not exist (looked at {path.resolve()})")
    # A hub id: only the local Hugging Face cache, never a download during a run.
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(spec, local_files_only=True))
    except Exception as e:  # LocalEntryNotFoundError and friends
        raise ModelNotFoundError(
            f"model {spec!r} is not in the local Hugging Face cache (looked in {constants.HF_HUB_CACHE}; "
            "set HF_HOME or HF_HUB_CACHE to change where). Download it on a machine with internet, "
            f"e.g. `huggingface-cli download {spec}`, and copy the cache or the folder here, or pass "
            f"a local diffusers folder as model.name. ({type(e).__name__})"
        ) from None


@contextlib.contextmanager
def quiet_loading():
    """diffusers' and transformers' chatter while a model loads (progress bars, transformers' note that
    torchvision is absent, diffusers' "No LoRA keys ... text_encoder" for a UNet-only LoRA): none of it
    concerns the user. Errors still show; the libraries' settings are restored afterwards."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    levels = dlog.get_verbosity(), tlog.get_verbosity()
    bars = dlog.is_progress_bar_enabled(), tlog.is_progress_bar_enabled()
    dlog.set_verbosity_error(), tlog.set_verbosity_error(), dlog.disable_progress_bar(), tlog.disable_progress_bar()
    try:
        yield
    finally:
        dlog.set_verbosity(levels[0]), tlog.set_verbosity(levels[1])
        if bars[0]:
            dlog.enable_progress_bar()
        if bars[1]:
            tlog.enable_progress_bar()


def load_components(spec: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> SDComponents:
    """Load UNet, VAE, text encoder, tokenizer and a DDIM scheduler from a model spec."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    folder = resolve_model(spec)
    with quiet_loading():
        unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet", dtype=dtype)
        vae = AutoencoderKL.from_pretrained(folder, subfolder="vae", dtype=dtype)
        text_encoder = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder", dtype=dtype)
    tokenizer = load_tokenizer_folder(folder / "tokenizer")
    # Always DDIM (the MDP's policy), configured from the model's own scheduler config.
    scheduler = DDIMScheduler.from_pretrained(folder, subfolder="scheduler")
    for m in (unet, vae, text_encoder):
        m.requires_grad_(False)
        m.eval()
        m.to(device)
    return SDComponents(unet, vae, text_encoder, tokenizer, scheduler, str(folder))


def resolve_device(name: str) -> str:
    """model.device -> a torch device name; 'cuda' without a GPU is an error, never a silent CPU run."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device is 'cuda' but torch sees no GPU here; use model.device=cpu or auto")
    return name
