"""The tiny world's pretrained weights: committed compactly in tinyworld/model/, assembled on
first use into a standard diffusers folder in the cache (which `policy.models.load_components`
and diffusers' StableDiffusionPipeline both load). A missing or altered file is an error, never
a silent fallback to other weights.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from diffrlhf.rewards._weights import cache_dir
from diffrlhf.rewards.clip_tokenizer import write_clip_tokenizer
from diffrlhf.tinyworld.architecture import build_folder_once

WEIGHTS_DIR = Path(__file__).parent / "model"
PRETRAIN_COMMAND = "python -m diffrlhf.tinyworld.pretrain --out tinyworld/model"


def weight_files(folder: Path | None = None) -> list[Path]:
    return sorted(p for p in Path(folder or WEIGHTS_DIR).rglob("*.safetensors"))


def weights_digest(folder: Path | None = None) -> str:
    """sha256 over the committed weight files' relative paths and bytes."""
    folder = Path(folder or WEIGHTS_DIR)
    h = hashlib.sha256()
    for f in weight_files(folder):
        h.update(f.relative_to(folder).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def recorded_digest(folder: Path | None = None) -> str:
    """The sha256 tinyworld/pretrain.py recorded in info.json when it wrote the weights."""
    return json.loads((Path(folder or WEIGHTS_DIR) / "info.json").read_text())["sha256"]


class TinyWorldWeightsError(FileNotFoundError):
    """The committed tiny-world weights are missing or do not match their recorded sha256."""


def _missing_error(why: str) -> TinyWorldWeightsError:
    return TinyWorldWeightsError(
        f"the tiny-world weights are not usable ({why}; looked in {WEIGHTS_DIR}). Rebuild them "
        f"(about 15 min on 2 CPU cores) with `{PRETRAIN_COMMAND}` from the repository root, "
        "or restore tinyworld/model/ from git."
    )


def assemble_folder(src: Path, dst: Path) -> None:
    """Write a standard fp32 diffusers folder at dst from the compact committed files in src."""

    for sub, name in [("unet", "diffusion_pytorch_model"), ("vae", "diffusion_pytorch_model"), ("text_encoder", "model")]:
        (dst / sub).mkdir(parents=True)
        shutil.copy(src / sub / "config.json", dst / sub / "config.json")
        sd = load_file(str(src / sub / "weights.safetensors"))
        # The token embedding is stored as int8 with one fp32 scale (it is a frozen random init,
        # so this is exact: training used the dequantised values). Everything else is fp16.
        for key in [k for k in sd if k.endswith(".int8")]:
            base = key[: -len(".int8")]
            sd[base] = sd.pop(key).float() * sd.pop(base + ".scale")
        sd = {k: v.float().contiguous() for k, v in sd.items()}
        save_file(sd, str(dst / sub / f"{name}.safetensors"))
    (dst / "scheduler").mkdir()
    shutil.copy(src / "scheduler" / "scheduler_config.json", dst / "scheduler" / "scheduler_config.json")
    write_clip_tokenizer(dst / "tokenizer")
    shutil.copy(src / "model_index.json", dst / "model_index.json")


def ensure_tiny_world() -> Path:
    """Assemble (once) and return the diffusers folder of the pretrained tiny-world model."""
    if len(weight_files()) < 3 or not all((WEIGHTS_DIR / f).exists() for f in ("model_index.json", "info.json")):
        raise _missing_error("weight files missing")
    digest = weights_digest()
    if digest != recorded_digest():
        # E.g. git-lfs pointers instead of the files, or a half-finished retrain.
        raise _missing_error(f"sha256 {digest[:16]} does not match the recorded {recorded_digest()[:16]}")
    return build_folder_once(cache_dir() / f"tiny-world-{digest[:12]}", lambda tmp: assemble_folder(WEIGHTS_DIR, tmp))
