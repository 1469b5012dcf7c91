"""Pretrain the tiny-world model on CPU: the VAE, then the UNet on its latents; then evaluate it.

    python -m diffrlhf.tinyworld.pretrain --out tinyworld/model        # train + write weights
    python -m diffrlhf.tinyworld.pretrain --eval-only --results research/results/tinyworld

Three stages, deterministic for a seed on a given torch build and thread count (2 threads):
the VAE; the text encoder's two transformer layers (to carry each caption's attributes into its
end-of-text and padding tokens, as a pretrained CLIP does; then frozen, like SD's); the UNet on
the VAE's latents. The text encoder's token embedding stays at its seeded random init and is
stored as int8 + one scale (we train against exactly those dequantised values). Everything else
is trained in fp32 and stored in fp16.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from diffrlhf.rewards.clip_tokenizer import load_tokenizer_folder, write_clip_tokenizer
from diffrlhf.tinyworld import scenes as tw
from diffrlhf.tinyworld import weights as tww
from diffrlhf.tinyworld.architecture import (SD15_SCHEDULER_CONFIG, TinySize, build_tiny_components, save_components_folder,
                                             to_vae_input)

# The default TinySize but 4 attention heads (head dim 8/16 instead of 4/8), for faster training.
SIZE = TinySize(attention_head_dim=4)
# The UNet's peak learning rate, chosen over 2e-3 and 8e-3 (trials: research/results/tinyworld/README.md).
UNET_LR = 4e-3


def quantise_text_encoder_(text_encoder) -> None:
    """Round the frozen text encoder to what we store: int8 token embedding, fp16 elsewhere."""
    with torch.no_grad():
        for name, p in text_encoder.named_parameters():
            if name.endswith("token_embedding.weight"):
                scale = p.abs().max() / 127
                p.copy_(torch.round(p / scale).clamp(-127, 127) * scale)
            else:
                p.copy_(p.half().float())


def train_vae(vae, images: np.ndarray, masks: np.ndarray, steps: int, batch: int, seed: int,
              kl_weight: float = 1e-4, shape_weight: float = 2.0):
    """Reconstruction L1 + L2 plus a small KL, on random 32 px crops (4x cheaper; the VAE is convolutional).

    Pixels of the shapes count (1 + shape_weight) times: they are a small part of most images but
    all of what the captions are about, and a plain loss lets the VAE blur their colour away.
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    data = torch.from_numpy(images)  # uint8 [N, H, W, 3], converted per batch
    mdata = torch.from_numpy(masks)
    vae.train()
    bar = tqdm(range(steps), desc="vae", mininterval=5)
    for step in bar:
        idx = torch.randint(len(data), (batch,), generator=g)
        # Finish at full size (40% of the steps): the mid-block's attention then sees all 8x8
        # latents, which getting the shapes' colours right needs.
        crop = 32 if step < int(0.6 * steps) else 64
        if crop == 64:
            idx = idx[: batch // 4]  # same pixels per step
        y0, x0 = torch.randint(0, 64 - crop + 1, (2,), generator=g).tolist()
        x = to_vae_input(data[idx, y0 : y0 + crop, x0 : x0 + crop])
        w = 1 + shape_weight * mdata[idx, None, y0 : y0 + crop, x0 : x0 + crop].float() / 255
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=g)).sample
        kl = post.kl().mean() / post.mean[0].numel()  # per latent element
        err = rec - x
        loss = ((err.abs() + err.pow(2)) * w).mean() / w.mean() + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}", kl=f"{kl.item():.2f}")
    vae.eval()


@torch.no_grad()
def encode_dataset(vae, images: np.ndarray, bs: int = 256):
    """Posterior mean and std of every image (unscaled), to sample latents cheaply during UNet training."""
    means, stds = [], []
    for i in range(0, len(images), bs):
        post = vae.encode(to_vae_input(images[i : i + bs])).latent_dist
        means.append(post.mean)
        stds.append(post.std)
    return torch.cat(means), torch.cat(stds)


CAPTION_ATTRIBUTES = {  # what the text encoder is pretrained to read out of a caption ("-": not said)
    "colour": tw.COLOURS,
    "shape": tw.SHAPES,
    "count": ["1", "2"],
    "size": ["-"] + tw.SHAPE_SIZES,
    "texture": ["-"] + [t for t in tw.TEXTURES if t != "plain"],
    "background": ["-"] + tw.BACKGROUNDS,
}


def caption_attributes(caption: str) -> dict[str, int]:
    """Class index of each attribute that a tiny-world caption states (see Scene.caption)."""
    words = caption.split()
    head, _, bg = caption.partition(" on a")
    hw = head.split()
    plural = {v: k for k, v in tw.PLURAL.items()}
    shape = next(plural.get(w, w) for w in hw if plural.get(w, w) in tw.SHAPES)
    found = dict(
        colour=next(w for w in hw if w in tw.COLOURS), shape=shape, count="2" if words[0] == "two" else "1",
        size=next((w for w in hw if w in tw.SHAPE_SIZES), "-"), texture=next((w for w in hw if w in tw.TEXTURES), "-"),
        background=bg.split()[-2] if bg else "-",
    )
    return {k: CAPTION_ATTRIBUTES[k].index(v) for k, v in found.items()}


def pretrain_text_encoder(text_encoder, cap_ids: torch.Tensor, uniq: list[str], steps: int, seed: int, batch: int = 256):
    """Teach the text encoder's transformer layers to carry the caption into every token after it.

    SD1.5's CLIP text encoder arrives pretrained, and its end-of-text/padding tokens summarise the
    whole prompt; a random one's do not, and a UNet that must find the one colour word among 77
    tokens learns no conditioning in this budget. So, before the UNet, linear probes on every
    position from the end-of-text token on are trained to read the caption's attributes (colour,
    shape, count, size, texture, background); the probes are then thrown away and the encoder is
    frozen. The token embedding stays frozen (it is stored as int8).
    """
    ids = cap_ids[: len(uniq)]  # tokenize_captions' rows: the unique captions, then "" (not trained on)
    labels = torch.tensor([[caption_attributes(c)[k] for k in CAPTION_ATTRIBUTES] for c in uniq])
    eot = ids.argmax(-1)  # CLIP's end-of-text id 49407 is the largest
    after_eot = torch.arange(ids.shape[1])[None, :] >= eot[:, None]
    torch.manual_seed(seed)
    width = text_encoder.config.hidden_size
    heads = torch.nn.ModuleList(torch.nn.Linear(width, len(v)) for v in CAPTION_ATTRIBUTES.values())
    layers = [p for n, p in text_encoder.named_parameters() if "token_embedding" not in n]
    text_encoder.requires_grad_(False)
    for p in layers:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(layers + list(heads.parameters()), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    text_encoder.train()
    bar = tqdm(range(steps), desc="text", mininterval=5)
    for step in bar:
        idx = torch.randint(len(uniq), (batch,), generator=g)
        h = text_encoder(ids[idx])[0]  # [B, 77, width]
        mask = after_eot[idx]
        target = labels[idx][:, None, :].expand(-1, h.shape[1], -1)[mask]  # [tokens, attributes]
        loss = sum(torch.nn.functional.cross_entropy(head(h[mask]), target[:, i]) for i, head in enumerate(heads)) / len(heads)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
    text_encoder.requires_grad_(False).eval()
    return float(loss.detach())


def tokenize_captions(tokenizer, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Token ids [U + 1, 77] of the U unique captions plus "" (last row), each caption's row, and
    the unique captions (sorted)."""
    uniq = sorted(set(captions))
    pos = {c: i for i, c in enumerate(uniq)}
    ids = tokenizer(uniq + [""], padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    return ids, torch.tensor([pos[c] for c in captions]), uniq


@torch.no_grad()
def embed_captions(text_encoder, cap_ids: torch.Tensor, bs: int = 512) -> torch.Tensor:
    """The frozen text encoder's output for every row of cap_ids (computed once, not per step)."""
    return torch.cat([text_encoder(cap_ids[i : i + bs])[0] for i in range(0, len(cap_ids), bs)])


def min_snr_weights(alphas_cumprod: torch.Tensor, t: torch.Tensor, gamma: float) -> torch.Tensor:
    """Min-SNR-gamma loss weights for the epsilon objective: min(SNR(t), gamma) / SNR(t).

    (Hang et al. 2023.) 1 at high noise, gamma/SNR at low noise: the nearly clean steps, whose
    noise is hard to see and whose loss would otherwise dominate the gradient, count less; the
    noisy steps, where layout and colour are decided, count fully. gamma <= 0: plain epsilon loss.
    SNR straight from alphas_cumprod: diffusers.training_utils.compute_snr gives the same values
    through square roots, 1 ulp apart at 203 of the 1000 timesteps, which would change the
    committed weights' bytes (their sha256 is what makes them reproducible).
    """
    if gamma <= 0:
        return torch.ones(t.shape)
    snr = alphas_cumprod[t] / (1 - alphas_cumprod[t])
    return snr.clamp(max=gamma) / snr


def train_unet(unet, cap_embs, lat_mean, lat_std, scaling, cap_idx, steps, batch, seed, p_uncond=0.1, min_snr_gamma=1.0,
               lr=UNET_LR):
    """Epsilon objective on SD1.5's noise schedule, with caption dropout for classifier-free guidance
    and min-SNR weighting (gamma 1) of a uniform draw of t; gamma and lr were chosen by the trials
    in research/results/tinyworld/README.md (stage 3).

    cap_embs: the frozen text encoder's output per unique caption, "" last (embed_captions).
    """
    from diffusers import DDPMScheduler

    # Same betas as the DDIM sampler (DDPM has no set_alpha_to_one/steps_offset; they only affect sampling).
    cfg = {k: v for k, v in SD15_SCHEDULER_CONFIG.items() if k not in ("set_alpha_to_one", "steps_offset")}
    noise_sched = DDPMScheduler(**cfg)
    g = torch.Generator().manual_seed(seed)
    params = list(unet.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    # An EMA of the weights samples much better than the last iterate after a short noisy run.
    ema = [p.detach().clone() for p in params]
    empty_row = torch.tensor(len(cap_embs) - 1)
    unet.train()
    bar = tqdm(range(steps), desc="unet", mininterval=5)
    for step in bar:
        idx = torch.randint(len(lat_mean), (batch,), generator=g)
        z0 = (lat_mean[idx] + lat_std[idx] * torch.randn(lat_mean[idx].shape, generator=g)) * scaling
        drop = torch.rand(batch, generator=g) < p_uncond
        emb = cap_embs[torch.where(drop, empty_row, cap_idx[idx])]
        noise = torch.randn(z0.shape, generator=g)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (batch,), generator=g)
        zt = noise_sched.add_noise(z0, noise, t)
        err = (unet(zt, t, emb).sample - noise).pow(2).mean((1, 2, 3))
        loss = (err * min_snr_weights(noise_sched.alphas_cumprod, t, min_snr_gamma)).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        decay = min(0.995, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.lerp_(p, 1 - decay)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
    with torch.no_grad():
        for e, p in zip(ema, params):
            p.copy_(e)
    unet.eval()


def write_compact(full: Path, out: Path) -> None:
    """From a saved diffusers folder, write the committed layout: configs + compact weights.safetensors."""

    out.mkdir(parents=True, exist_ok=True)
    for sub, fname in [("unet", "diffusion_pytorch_model"), ("vae", "diffusion_pytorch_model"), ("text_encoder", "model")]:
        (out / sub).mkdir(exist_ok=True)
        shutil.copy(full / sub / "config.json", out / sub / "config.json")
        sd = load_file(str(full / sub / f"{fname}.safetensors"))
        compact = {}
        for k, v in sd.items():
            if k.endswith("token_embedding.weight"):
                scale = v.abs().max() / 127
                compact[k + ".int8"] = torch.round(v / scale).clamp(-127, 127).to(torch.int8)
                compact[k + ".scale"] = scale.reshape(())
            else:
                compact[k] = v.half()
        save_file(compact, str(out / sub / "weights.safetensors"))
    (out / "scheduler").mkdir(exist_ok=True)
    shutil.copy(full / "scheduler" / "scheduler_config.json", out / "scheduler" / "scheduler_config.json")
    shutil.copy(full / "model_index.json", out / "model_index.json")


def pretrain(out: Path, seed: int, n_images: int, vae_steps: int, unet_steps: int, text_steps: int = 200,
             min_snr_gamma: float = 1.0, unet_lr: float = UNET_LR) -> dict:
    torch.manual_seed(seed)
    t0 = time.time()
    images, captions, _, masks = tw.make_dataset(n_images, seed=seed, split="train", return_masks=True)
    t_data = time.time() - t0
    unet, vae, text_encoder, scheduler = build_tiny_components(seed, SIZE)
    quantise_text_encoder_(text_encoder)
    text_encoder.requires_grad_(False).eval()

    t1 = time.time()
    train_vae(vae, images, masks, vae_steps, batch=64, seed=seed + 10)
    t_vae = time.time() - t1
    lat_mean, lat_std = encode_dataset(vae, images)
    g = torch.Generator().manual_seed(seed + 11)
    z = lat_mean + lat_std * torch.randn(lat_mean.shape, generator=g)
    # Like SD's 0.18215: scale latents to unit std so the noise schedule means what it says.
    scaling = float(1.0 / z.std())
    vae.register_to_config(scaling_factor=scaling)

    tmp_tok = Path(tempfile.mkdtemp())
    tokenizer = load_tokenizer_folder(write_clip_tokenizer(tmp_tok / "tokenizer"))
    cap_ids, cap_idx, uniq = tokenize_captions(tokenizer, captions)
    t2 = time.time()
    text_loss = pretrain_text_encoder(text_encoder, cap_ids, uniq, text_steps, seed=seed + 30)
    t_text = time.time() - t2
    quantise_text_encoder_(text_encoder)  # the UNet learns on exactly the stored (fp16) text encoder
    t3 = time.time()
    cap_embs = embed_captions(text_encoder, cap_ids)
    train_unet(unet, cap_embs, lat_mean, lat_std, scaling, cap_idx, unet_steps, batch=64, seed=seed + 20,
               min_snr_gamma=min_snr_gamma, lr=unet_lr)
    t_unet = time.time() - t3

    full = tmp_tok / "full"
    save_components_folder(full, unet, vae, text_encoder, scheduler)
    write_compact(full, out)
    shutil.rmtree(tmp_tok, ignore_errors=True)
    info = dict(
        seed=seed, n_images=n_images, vae_steps=vae_steps, text_steps=text_steps, unet_steps=unet_steps,
        min_snr_gamma=min_snr_gamma, unet_lr=unet_lr, size=str(SIZE),
        vae_scaling_factor=scaling, text_probe_loss=text_loss,
        seconds=dict(data=t_data, vae=t_vae, text=t_text, unet=t_unet, total=time.time() - t0),
        torch=torch.__version__, threads=torch.get_num_threads(), sha256=tww.weights_digest(out),
        date=time.strftime("%Y-%m-%d"),
    )
    (out / "info.json").write_text(json.dumps(info, indent=2))
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=tww.WEIGHTS_DIR, help="where to write the compact weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--images", type=int, default=10000)
    ap.add_argument("--vae-steps", type=int, default=1000)
    ap.add_argument("--text-steps", type=int, default=200)
    ap.add_argument("--unet-steps", type=int, default=1400)
    ap.add_argument("--min-snr-gamma", type=float, default=1.0, help="min-SNR loss weighting of the UNet (<= 0: off)")
    ap.add_argument("--unet-lr", type=float, default=UNET_LR, help="the UNet's peak AdamW learning rate (cosine decay)")
    ap.add_argument("--results", type=Path, default=None, help="also evaluate and write pictures/stats here")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the committed weights (ensure_tiny_world)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    if not args.eval_only:
        info = pretrain(args.out, args.seed, args.images, args.vae_steps, args.unet_steps, args.text_steps, args.min_snr_gamma,
                        args.unet_lr)
        print(json.dumps(info, indent=2))
        print(f"wrote {args.out} (sha256 {info['sha256'][:16]}, recorded in info.json)")
    if args.results or args.eval_only:
        folder = Path(tempfile.mkdtemp()) / "tiny-world"
        tww.assemble_folder(args.out, folder)  # evaluate exactly what was written
        from diffrlhf.tinyworld.evaluate import evaluate

        stats = evaluate(folder, args.results or Path("research/results/tinyworld"))
        print(json.dumps({k: v for k, v in stats.items() if k not in ("per_step", "jpeg_kb_by_texture")}, indent=2))
        for tex, v in stats["jpeg_kb_by_texture"].items():
            print(f"JPEG kB, {tex:9s}: real {v['real']:.3f}  VAE reconstruction {v['vae_reconstruction']:.3f}  sampled {v['sampled']:.3f}")
        for r in stats["per_step"]:
            print(f"{r['step']:3d} t={r['t']:4d}  mean|dz|^2={r['mean_sq_change']:.4f}  ddim_std={r['ddim_std']:.4f}")


if __name__ == "__main__":
    main()
