"""Loading Stable Diffusion 1.5 components, real or tiny, through one code path.

A model spec is one of:
  * ``tiny-random``            a tiny SD1.5-architecture model with seeded random weights, built
                               offline into the cache on first use (fast; for tests);
  * ``tiny-world``             the embedded default: the tiny model pretrained by this project on
                               its procedural image set (see learner/tinyworld.py);
  * a local folder             in diffusers format (unet/, vae/, text_encoder/, tokenizer/, scheduler/);
  * a hub id                   e.g. ``runwayml/stable-diffusion-v1-5``, resolved from the local
                               Hugging Face cache only (never downloaded during a run).

All of them are then loaded by :func:`load_components` from a folder, so the tiny model exercises
exactly the code that real SD1.5 runs. A missing model is an error that says where we looked;
there is no silent fallback to the tiny model.
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

TINY_RANDOM = "tiny-random"
TINY_WORLD = "tiny-world"

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


def cache_dir() -> Path:
    """Where built tiny models live: $DIFFRLHF_CACHE, else ~/.cache/diffrlhf."""
    return Path(os.environ.get("DIFFRLHF_CACHE", Path.home() / ".cache" / "diffrlhf"))


# ----------------------------------------------------------------------------- tokenizer


def _clip_bpe_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("clip")  # the openai-clip package; not imported (it needs torchvision)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "The CLIP BPE vocabulary comes from the `openai-clip` package, which is not installed: "
            "pip install openai-clip"
        )
    path = Path(spec.submodule_search_locations[0]) / "bpe_simple_vocab_16e6.txt.gz"
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing from the openai-clip package; reinstall it")
    return path


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2/CLIP's reversible byte -> printable unicode map.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_clip_tokenizer(folder: Path, bpe_path: str | Path | None = None) -> Path:
    """Write OpenAI CLIP's real tokenizer (vocab.json, merges.txt) in transformers' format.

    Built from the BPE file exactly as CLIP's SimpleTokenizer does, so ids match OpenAI CLIP's.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    merges = gzip.open(bpe_path or _clip_bpe_path()).read().decode("utf-8").split("\n")
    merges = [tuple(m.split()) for m in merges[1 : 49152 - 256 - 2 + 1]]
    vocab = list(_bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    special = dict(bos_token="<|startoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    (folder / "special_tokens_map.json").write_text(json.dumps(special))
    # model_max_length must be set here: transformers 5 otherwise leaves it huge and the pipeline overflows.
    cfg = dict(special, model_max_length=77, do_lower_case=True, tokenizer_class="CLIPTokenizer")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def load_tokenizer(folder: Path):
    from transformers import CLIPTokenizer

    # from_pretrained, not CLIPTokenizer(vocab_file=...): the latter silently ignores the files in transformers 5.
    return CLIPTokenizer.from_pretrained(str(folder), model_max_length=77)


# ----------------------------------------------------------------------------- tiny model


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
        tokenizer=load_tokenizer(tok_dir),
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return folder


def ensure_tiny_random(seed: int = 0) -> Path:
    """Build (once) and return the folder of the seeded random tiny model."""
    folder = cache_dir() / f"tiny-random-seed{seed}-v1"
    if not (folder / "model_index.json").exists():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        save_components_folder(tmp, *build_tiny_components(seed))
        try:
            tmp.rename(folder)  # atomic: concurrent builders (several Ray actors) never see half a folder
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return folder


# ----------------------------------------------------------------------------- resolution and loading


def resolve_model(spec: str) -> Path:
    """Turn a model spec into a local diffusers folder, or raise ModelNotFoundError saying why."""
    if spec == TINY_RANDOM or spec.startswith(TINY_RANDOM + ":"):
        seed = int(spec.split(":", 1)[1]) if ":" in spec else 0
        return ensure_tiny_random(seed)
    if spec == TINY_WORLD:
        from diffrlhf.learner.tinyworld import ensure_tiny_world

        return ensure_tiny_world()
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


def load_components(spec: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> SDComponents:
    """Load UNet, VAE, text encoder, tokenizer and a DDIM scheduler from a model spec."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    folder = resolve_model(spec)
    unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet", torch_dtype=dtype)
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae", torch_dtype=dtype)
    text_encoder = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder", torch_dtype=dtype)
    tokenizer = load_tokenizer(folder / "tokenizer")
    # Always DDIM (the MDP's policy), configured from the model's own scheduler config.
    scheduler = DDIMScheduler.from_pretrained(folder, subfolder="scheduler")
    for m in (unet, vae, text_encoder):
        m.requires_grad_(False)
        m.eval()
        m.to(device)
    return SDComponents(unet, vae, text_encoder, tokenizer, scheduler, str(folder))
