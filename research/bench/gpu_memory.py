"""GPU memory per role at SD1.5's size, 512 px, 50 steps, bf16: COUNTED on the meta device, not
measured on a GPU (issue 55 item 5).

    python -m research.bench.gpu_memory [--out DIR]

SD1.5's UNet (the real config, tinyworld/architecture.py) is built on the meta device in bf16 with
the run's rank-4 LoRA (fp32, learner/lora.py), so no weights are allocated and every count is exact
for its shapes and dtypes:

  weights      parameters x bytes (UNet, CLIP text encoder, VAE in bf16; LoRA, its gradient and
               Adam's two moments in fp32)
  activations  the learner: the bytes autograd saves for backward in one UNet forward at the
               configured micro-batch (x2 for classifier-free guidance), counted with
               torch.autograd.graph.saved_tensors_hooks; attention is counted as a fused (flash /
               memory-efficient) kernel saves it (q, k, v, out, and a float32 log-sum-exp per row and
               head), not as the [L, L] matrix the meta device's math path would build.
               The sampler: the peak of live tensor bytes during one guided UNet call and one VAE
               decode under no_grad (a dispatch mode that follows every output until it is freed).

Not counted: the CUDA context and allocator slack (about 0.5-1.5 GB a process in practice), cuDNN /
cuBLAS workspaces, fragmentation. Writes gpu_memory.json and .md into research/results/sd15_size/.
"""
from __future__ import annotations

import argparse
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from research.bench.common import log, machine, out_dir, write_json

GB = 1e9


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def param_bytes(module: torch.nn.Module, trainable: bool | None = None) -> int:
    return sum(nbytes(p) for p in module.parameters() if trainable is None or p.requires_grad == trainable)


class LivePeak(TorchDispatchMode):
    """The peak of the bytes of tensors the ops create that are still alive (inputs not counted)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and not t._is_view():
                n = nbytes(t)
                self.live += n
                weakref.finalize(t, self._free, n)
        self.peak = max(self.peak, self.live)
        return out


def fused_attention_counter(saved: list):
    """F.scaled_dot_product_attention as a fused kernel: its output without the [L, L] matrix, and
    what such a kernel saves for backward (q, k, v, out, a float32 log-sum-exp per row and head)."""

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        out = q.clone() if v.shape[-1] == q.shape[-1] else q[..., : v.shape[-1]].clone()
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            saved.append(nbytes(q) + nbytes(k) + nbytes(v) + nbytes(out) + q.shape[0] * q.shape[1] * q.shape[2] * 4)
        return out

    return sdpa


def unet_on_meta(lora_rank: int, dtype: torch.dtype = torch.bfloat16):
    """SD1.5's UNet (the real config) with a LoRA of the given rank, on the meta device: shapes only."""
    from diffusers import UNet2DConditionModel

    from diffrlhf.learner.lora import add_lora
    from diffrlhf.tinyworld.architecture import SD15_UNET

    with torch.device("meta"):
        unet = UNet2DConditionModel(**SD15_UNET).to(dtype)
    add_lora(unet, rank=lora_rank)
    return unet


def learner_activations(unet, rows: int, latent: int) -> dict:
    """Saved-for-backward bytes of one UNet forward on `rows` rows (the micro-batch, x2 with CFG)."""
    import torch.nn.functional as F

    saved, attention = [], []
    real_sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fused_attention_counter(attention)
    try:
        x = torch.empty(rows, 4, latent, latent, device="meta", dtype=torch.bfloat16)
        ctx = torch.empty(rows, 77, 768, device="meta", dtype=torch.bfloat16)
        t = torch.full((rows,), 500, device="meta", dtype=torch.long)
        params = {id(q) for q in unet.parameters()}

        def pack(s):  # a layer that saves its own weight (or a view of it) holds nothing new
            if id(s) not in params and id(getattr(s, "_base", None)) not in params:
                saved.append(nbytes(s))
            return s

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
            unet(x, t, encoder_hidden_states=ctx).sample.float().sum()
    finally:
        F.scaled_dot_product_attention = real_sdpa
    return {"rows": rows, "saved_bytes": sum(saved) + sum(attention), "attention_bytes": sum(attention), "tensors": len(saved)}


def sampler_peak(unet, rows: int, latent: int) -> dict:
    """Peak live bytes of one guided UNet call (2 x rows) and of one VAE decode of `rows` images."""
    import torch.nn.functional as F
    from diffusers import AutoencoderKL

    from diffrlhf.tinyworld.architecture import SD15_VAE

    real_sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fused_attention_counter([])
    try:
        with torch.no_grad():
            mode = LivePeak()
            with mode:
                x = torch.empty(2 * rows, 4, latent, latent, device="meta", dtype=torch.bfloat16)
                ctx = torch.empty(2 * rows, 77, 768, device="meta", dtype=torch.bfloat16)
                unet(x, torch.full((2 * rows,), 500, device="meta", dtype=torch.long), encoder_hidden_states=ctx)
            unet_peak = mode.peak
            with torch.device("meta"):
                vae = AutoencoderKL(**SD15_VAE).to(torch.bfloat16)
            mode = LivePeak()
            with mode:
                vae.decode(torch.empty(rows, 4, latent, latent, device="meta", dtype=torch.bfloat16))
            vae_peak = mode.peak
    finally:
        F.scaled_dot_product_attention = real_sdpa
    return {"rows": rows, "unet_call_peak_bytes": unet_peak, "vae_decode_peak_bytes": vae_peak, "vae_params": param_bytes(vae)}


def text_encoder_bytes() -> int:
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffrlhf.tinyworld.architecture import SD15_TEXT

    with torch.device("meta"):
        text = CLIPTextModel(CLIPTextConfig(**SD15_TEXT)).to(torch.bfloat16)
    return param_bytes(text)


def main(argv=None) -> None:
    from diffrlhf.deploy.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = load_config("sd15-ddpo")
    latent = cfg.sample.resolution // 8
    unet = unet_on_meta(cfg.model.lora_rank)
    lora = param_bytes(unet, trainable=True)
    unet_weights = param_bytes(unet, trainable=False)
    text = text_encoder_bytes()
    log("gpu_memory", f"UNet bf16 {unet_weights / GB:.2f} GB, LoRA fp32 {lora / 1e6:.1f} MB, text encoder {text / GB:.2f} GB")
    micro = cfg.train.batch_size
    learner = learner_activations(unet, 2 * micro if cfg.sample.guidance_scale > 1 else micro, latent)
    log("gpu_memory", f"learner: saved activations {learner['saved_bytes'] / GB:.2f} GB at {learner['rows']} rows")
    per_row = learner_activations(unet, 2, latent)
    sampler = sampler_peak(unet, cfg.sample.batch_size, latent)
    log("gpu_memory", f"sampler: UNet call peak {sampler['unet_call_peak_bytes'] / GB:.2f} GB, VAE decode {sampler['vae_decode_peak_bytes'] / GB:.2f} GB")
    trajectory = cfg.sample.batch_size * (cfg.sample.num_steps + 1) * 4 * latent * latent * 4  # fp32 latents kept per step
    roles = {
        "learner": {"weights": unet_weights + text, "lora_grad_adam": 4 * lora, "activations": learner["saved_bytes"]},
        "sampler": {"weights": unet_weights + lora + text + sampler["vae_params"], "activations":
                    max(sampler["unet_call_peak_bytes"], sampler["vae_decode_peak_bytes"]), "trajectory_latents": trajectory},
    }
    for r in roles.values():
        r["total"] = sum(r.values())
    folder = out_dir("sd15_size", args.out)
    write_json(folder / "gpu_memory.json", {"machine": machine(), "command": "python -m research.bench.gpu_memory",
                                            "config": {"preset": "sd15-ddpo", "resolution": cfg.sample.resolution,
                                                       "steps": cfg.sample.num_steps, "sample_batch": cfg.sample.batch_size,
                                                       "train_micro_batch": micro, "lora_rank": cfg.model.lora_rank},
                                            "learner_activations": learner, "learner_activations_per_2_rows": per_row,
                                            "sampler": sampler, "roles": roles})
    md = ["| role | weights (GB) | LoRA + grad + Adam (GB) | activations (GB) | latents kept (GB) | total, counted (GB) |",
          "| --- | --- | --- | --- | --- | --- |"]
    for name, r in roles.items():
        md.append(f"| {name} | {r['weights'] / GB:.2f} | {r.get('lora_grad_adam', 0) / GB:.3f} | {r['activations'] / GB:.2f} | "
                  f"{r.get('trajectory_latents', 0) / GB:.3f} | {r['total'] / GB:.2f} |")
    md += ["", f"sd15-ddpo: 512 px, {cfg.sample.num_steps} steps, sampling batch {cfg.sample.batch_size} (x2 rows for guidance), "
           f"training micro-batch {micro} (x2); learner activations {learner['saved_bytes'] / GB:.2f} GB "
           f"({per_row['saved_bytes'] / GB:.2f} GB per 2 rows; attention {learner['attention_bytes'] / GB:.2f} GB of it). "
           "Counted on the meta device; CUDA context, workspaces and allocator slack not included."]
    (folder / "gpu_memory.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
