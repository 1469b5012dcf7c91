"""Using a run's result: `diffrlhf sample` (base vs LoRA grids) and `diffrlhf eval` (rewards, CLIP score).

A run's LoRA folders are stock diffusers LoRA folders, loaded here exactly as a user would:

    pipe = StableDiffusionPipeline.from_pretrained(model_folder)
    pipe.load_lora_weights("runs/<run>/lora/epoch_0012")
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch
import yaml

from diffrlhf.actors.settings import sampling_settings
from diffrlhf.policy.models import SDComponents, quiet_loading, resolve_model
from diffrlhf.policy.prompts import load_prompts
from diffrlhf.policy.sampler import sample_trajectories
from diffrlhf.rewards import build_reward
from diffrlhf.rewards.clip_tokenizer import load_tokenizer_folder
from diffrlhf.rewards.preprocess import clip_preprocess  # CLIP's resize/crop/normalise, torch only


def run_config(run_dir: Path):
    from diffrlhf.deploy.config import config_from_dict

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} is not a run folder (no config.yaml); give the folder `diffrlhf train` printed")
    return config_from_dict(yaml.safe_load(path.read_text()))


def lora_folder(run_dir: Path, which: str = "latest") -> Path:
    folders = sorted((Path(run_dir) / "lora").glob("epoch_*"))
    if not folders:
        raise FileNotFoundError(f"no LoRA checkpoints in {Path(run_dir) / 'lora'}; the run saved none yet")
    if which == "latest":
        return folders[-1]
    path = Path(run_dir) / "lora" / which
    if not path.exists():
        raise FileNotFoundError(f"LoRA {which!r} not in {Path(run_dir) / 'lora'}; have: {', '.join(f.name for f in folders)}")
    return path


def load_pipeline(cfg, device: str = "cpu"):
    folder = resolve_model(cfg.model.name)
    with quiet_loading():
        from diffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None, requires_safety_checker=False,
                                                       dtype=getattr(torch, cfg.model.dtype))
    pipe.tokenizer = load_tokenizer_folder(folder / "tokenizer")  # model_max_length=77 (transformers 5 trap)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def components_of(pipe, folder) -> SDComponents:
    from diffusers import DDIMScheduler

    return SDComponents(pipe.unet, pipe.vae, pipe.text_encoder, pipe.tokenizer, DDIMScheduler.from_config(pipe.scheduler.config), str(folder))


def sample_base_and_lora(run_dir, prompts: list[str], n_per_prompt: int = 2, which: str = "latest", seed: int = 1234, device="cpu"):
    """Images from the base model and from the run's LoRA on the same noise: (base, tuned, captions)."""
    cfg = run_config(run_dir)
    pipe = load_pipeline(cfg, device)
    comps = components_of(pipe, cfg.model.name)
    settings = sampling_settings(cfg)
    ps = [p for p in prompts for _ in range(n_per_prompt)]
    seeds = [seed + i for i in range(len(ps))]
    base = sample_trajectories(comps, ps, seeds, settings, 0, list(range(len(ps))))
    with quiet_loading():  # a UNet-only LoRA: diffusers notes the text encoder has no keys
        pipe.load_lora_weights(str(lora_folder(run_dir, which)))
    tuned = sample_trajectories(comps, ps, seeds, settings, 1, list(range(len(ps))))
    return base, tuned, ps


def cmd_sample(run_dir, prompts_source: str, out: str | None, n: int, which: str) -> Path:
    from diffrlhf.deploy.runlog import save_image_grid

    prompts = load_prompts(prompts_source)[:16]
    base, tuned, ps = sample_base_and_lora(run_dir, prompts, n, which)
    # rows alternate: base images, then the LoRA's on the same noise
    cols = min(8, len(ps))
    imgs, caps = [], []
    for start in range(0, len(ps), cols):
        sl = slice(start, start + cols)
        imgs += [base.images[sl], tuned.images[sl]]
        caps += ["base: " + p for p in ps[sl]] + ["lora: " + p for p in ps[sl]]
    out = Path(out) if out else Path(run_dir) / "samples.png"
    save_image_grid(torch.cat(imgs).numpy(), caps, out, cols=cols)
    return out


@functools.lru_cache(maxsize=2)
def _clip(name: str):
    """CLIP from a local folder or the HF cache, loaded once per name; None (said once) when absent."""
    from transformers import CLIPModel, CLIPTokenizer

    try:
        with quiet_loading():
            return CLIPModel.from_pretrained(name, local_files_only=True).eval(), CLIPTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as e:
        print(f"[diffrlhf] CLIP score skipped: no CLIP weights at {name!r} on this machine ({type(e).__name__}); "
              "pass --clip PATH to a local CLIP folder")
        return None


def clip_score(images: np.ndarray, prompts: list[str], clip_path: str | None) -> float | None:
    """Mean CLIP image-text cosine x 100, when CLIP weights are on this machine; else None."""
    loaded = _clip(clip_path or "openai/clip-vit-large-patch14")
    if loaded is None:
        return None
    model, tok = loaded

    with torch.no_grad():
        pix = clip_preprocess(images, model.config.vision_config.image_size)
        img = torch.nn.functional.normalize(model.get_image_features(pixel_values=pix), dim=-1)
        ids = tok(prompts, padding=True, truncation=True, return_tensors="pt")
        txt = torch.nn.functional.normalize(model.get_text_features(**ids), dim=-1)
    return float((img * txt).sum(-1).mean() * 100)


def cmd_eval(run_dir, which: str = "latest", n: int = 4, clip: str | None = None, out: str | None = None) -> dict:
    cfg = run_config(run_dir)
    reward = build_reward(cfg.reward.spec)
    result = {"run": str(run_dir), "lora": lora_folder(run_dir, which).name, "reward": str(cfg.reward.spec), "splits": {}}
    for split, source in (("train", cfg.prompts.train), ("heldout", cfg.prompts.eval)):
        prompts = load_prompts(source)[:16]
        base, tuned, ps = sample_base_and_lora(run_dir, prompts, n, which)
        rb = reward(base.images.numpy(), ps)
        rt = reward(tuned.images.numpy(), ps)
        result["splits"][split] = {
            "prompts": source, "samples": len(ps),
            "reward_base": float(np.mean(rb)), "reward_lora": float(np.mean(rt)),
            "reward_gain": float(np.mean(rt) - np.mean(rb)),
            "reward_gain_se": float(np.std(rt - rb, ddof=1) / np.sqrt(len(ps))) if len(ps) > 1 else 0.0,
            "clip_base": clip_score(base.images.numpy(), ps, clip),
            "clip_lora": clip_score(tuned.images.numpy(), ps, clip),
        }
    path = Path(out) if out else Path(run_dir) / "eval.json"
    path.write_text(json.dumps(result, indent=1))
    result["path"] = str(path)
    return result


def format_table(result: dict) -> str:
    head = ["split", "samples", "reward base", "reward LoRA", "gain (± s.e.)", "CLIP base", "CLIP LoRA"]
    rows = []
    for split, r in result["splits"].items():
        rows.append([split, str(r["samples"]), f"{r['reward_base']:.4f}", f"{r['reward_lora']:.4f}",
                     f"{r['reward_gain']:+.4f} ± {r['reward_gain_se']:.4f}",
                     "n/a" if r["clip_base"] is None else f"{r['clip_base']:.2f}",
                     "n/a" if r["clip_lora"] is None else f"{r['clip_lora']:.2f}"])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    left = {0, 4}  # text left, numbers right

    def line(cells):
        return " | ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [line(head), "-|-".join("-" * w for w in widths)] + [line(r) for r in rows]
    return "\n".join(lines)
