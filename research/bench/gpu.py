"""SD1.5-size throughput on one GPU, with random weights (no hub access needed).

    python -m research.bench.gpu [--size full|tiny] [--dtypes float16 bfloat16] [--sample-batches 1 2 4 8 16]
        [--update-batches 1 2 4 8] [--steps 50] [--peak-tflops 989] [--out DIR]

Builds SD1.5's UNet (block_out_channels 320/640/1280/1280, 2 layers per block, cross-attention
768, head dim 8), its VAE and a 12-layer 768-wide CLIP text encoder with random weights (speed
does not depend on the values), attaches the rank-4 LoRA the learner trains, sets PyTorch SDPA
attention, and measures at 512 px, 50 DDIM steps, CFG 7.5:
  * sampling images/s through policy/sampler.py::sample_trajectories (the sampler's code path,
    including text encoding and VAE decoding) per batch size;
  * update images/s through learner/update.py::PolicyLearner.update (every timestep trained, CFG,
    optimizer steps included) per train batch size;
  * the achieved fraction of --peak-tflops (default 989: dense bf16/fp16 of an H100/H200 SXM).
    FLOPs are counted with torch.utils.flop_counter.FlopCounterMode on one guided UNet call at
    batch 1 (cond + uncond), forward only for sampling and forward + backward (LoRA grads) for
    the update, times images x steps. VAE and text-encoder FLOPs are not counted (their time is),
    so the fraction is a slight underestimate.
Also writes calib_<dtype>.json for `systems --parts scale --calib ...` (per-batch sampling and
JPEG scoring time, update time per sample, tensor shapes) to simulate SD1.5-on-GPU scaling.

--size tiny runs the tiny random model on the CPU (2 steps, 32 px) to check the script.
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from research.bench.common import log, machine, median, out_dir, write_json
from diffrlhf.learner.lora import DEFAULT_RANK
from diffrlhf.learner.update import PolicyLearner, UpdateSettings
from diffrlhf.policy.ddim import guided_noise_pred
from diffrlhf.policy.models import SDComponents
from diffrlhf.policy.sampler import SamplingSettings, sample_trajectories
from diffrlhf.rewards.clip_tokenizer import load_tokenizer_folder, write_clip_tokenizer
from diffrlhf.rewards.serving import RewardServer
from diffrlhf.tinyworld.architecture import SD15_SCHEDULER_CONFIG, SD15_TEXT, SD15_UNET, SD15_VAE, build_tiny_components

MODEL_SIZES = {  # what --size measures: SD1.5's shapes on the GPU, or the tiny random model on the CPU
    "full": dict(resolution=512, steps=50, sample_batches=[1, 2, 4, 8, 16], update_batches=[1, 2, 4, 8],
                 dtypes=["float16", "bfloat16"], device="cuda"),
    "tiny": dict(resolution=32, steps=2, sample_batches=[2], update_batches=[2], dtypes=["float32", "bfloat16"], device="cpu"),
}
PROMPT = "a photo of a cat sitting on a wooden table"


def build_components(size: str, device: str, dtype):
    """SDComponents with random weights: SD1.5's shapes (full) or the tiny model (tiny)."""
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor2_0
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    if size == "full":
        with torch.device(device):  # initialise on the GPU: 1.1 B random parameters on a CPU take minutes
            unet, vae = UNet2DConditionModel(**SD15_UNET), AutoencoderKL(**SD15_VAE)
            text = CLIPTextModel(CLIPTextConfig(**SD15_TEXT))
        scheduler = DDIMScheduler(**SD15_SCHEDULER_CONFIG)
    else:
        unet, vae, text, scheduler = build_tiny_components(0)
    for m in (unet, vae, text):
        m.requires_grad_(False)
        m.eval()
        m.to(device, dtype)
    unet.set_attn_processor(AttnProcessor2_0())  # SDPA (flash / memory-efficient kernels where available)
    vae.set_attn_processor(AttnProcessor2_0())
    tokenizer = load_tokenizer_folder(write_clip_tokenizer(Path(tempfile.mkdtemp()) / "tokenizer"))
    return SDComponents(unet, vae, text, tokenizer, scheduler, source=f"random weights ({size})")


def sd15_learner(comps, guidance: float, timestep_fraction: float | None = None) -> PolicyLearner:
    """The learner the benchmarks measure: the learner's defaults (LoRA rank and targets, clip range,
    eta) but lr, the CFG scale and the trained fraction."""
    extra = {} if timestep_fraction is None else {"timestep_fraction": timestep_fraction}
    return PolicyLearner(comps, UpdateSettings(lr=1e-4, guidance_scale=guidance, **extra))


def sd15_sampling(steps: int, guidance: float, resolution: int) -> SamplingSettings:
    return SamplingSettings(num_steps=steps, guidance_scale=guidance, resolution=resolution)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def count_flops(learner, resolution: int, guidance: float) -> dict:
    """FLOPs of one guided UNet call (cond + uncond) for one image: forward, and forward + backward."""

    c = learner.c
    h = resolution // c.vae_scale_factor
    z = torch.randn(1, c.unet.config.in_channels, h, h, device=c.device, dtype=c.unet.dtype)
    t = torch.tensor([500], device=c.device)
    emb = c.encode_prompts([PROMPT])

    def call():
        return guided_noise_pred(c.unet, z, t, emb, learner.negative_embeds, guidance)

    with torch.no_grad(), FlopCounterMode(display=False) as fwd:
        call()
    with FlopCounterMode(display=False) as train:
        call().float().pow(2).mean().backward()
    learner.optimizer.zero_grad(set_to_none=True)
    return {"forward": int(fwd.get_total_flops()), "forward_backward": int(train.get_total_flops())}


def median_seconds(fn, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return median(times)


def peak_memory_gb(device: str):
    if device != "cuda":
        return None
    gb = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return gb


def measure_sampling(learner, settings, batches, repeats, device, flops, peak) -> tuple[list, dict]:
    c, rows, last = learner.c, [], {}
    for b in batches:
        def run(s=settings, b=b):
            return sample_trajectories(c, [PROMPT] * b, list(range(b)), s, 0, list(range(b)), learner.negative_embeds)

        try:
            run(replace(settings, num_steps=2))  # warm-up: kernels and allocator for this batch shape
            peak_memory_gb(device)
            dt = median_seconds(run, device, repeats)
        except Exception as e:  # an OOM at a large batch is a result, not a crash
            rows.append({"batch": b, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            log("gpu", f"sampling batch {b}: {rows[-1]['error']}")
            _free(device)
            continue
        tflops = b * settings.num_steps * flops["forward"] / dt / 1e12
        rows.append({"batch": b, "seconds": dt, "images_per_s": b / dt, "unet_tflops_per_s": tflops,
                     "fraction_of_peak": tflops / peak, "peak_memory_gb": peak_memory_gb(device)})
        last = {"batch": b, "seconds": dt}
        log("gpu", f"sampling batch {b}: {b / dt:.2f} images/s, {tflops:.1f} TFLOP/s ({100 * tflops / peak:.1f}% of peak)")
    return rows, last


def measure_update(learner, batch, batches, repeats, device, flops, peak, timestep_fraction) -> list:
    rows = []
    n_t = max(1, int(round(batch.num_steps * timestep_fraction)))
    for b in batches:
        if b > len(batch):
            continue
        sub = batch.select(slice(0, b))
        learner.s.batch_size = b

        def run(sub=sub):
            learner.update(sub)

        try:
            learner.s.timestep_fraction = 1 / batch.num_steps  # warm-up: one timestep
            run()
            learner.s.timestep_fraction = timestep_fraction
            peak_memory_gb(device)
            dt = median_seconds(run, device, repeats)
        except Exception as e:
            rows.append({"batch": b, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            log("gpu", f"update batch {b}: {rows[-1]['error']}")
            _free(device)
            continue
        tflops = b * n_t * flops["forward_backward"] / dt / 1e12
        rows.append({"batch": b, "trained_timesteps": n_t, "seconds": dt, "images_per_s": b / dt, "unet_tflops_per_s": tflops,
                     "fraction_of_peak": tflops / peak, "peak_memory_gb": peak_memory_gb(device)})
        log("gpu", f"update batch {b}: {b / dt:.2f} images/s, {tflops:.1f} TFLOP/s ({100 * tflops / peak:.1f}% of peak)")
    return rows


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def scoring_seconds(batch) -> float:
    """JPEG compressibility on this batch's images (CPU): the reward stage for the scale simulation."""
    server = RewardServer("jpeg_compressibility", batch_size=len(batch))
    t0 = time.perf_counter()
    server.score(batch.sample_ids.tolist(), batch.images.numpy(), batch.prompts)
    return time.perf_counter() - t0


def bench_dtype(args, dtype_name: str, device: str, peak: float) -> dict:
    t0 = time.time()
    comps = build_components(args.size, device, getattr(torch, dtype_name))
    # The learner's defaults (LoRA rank and targets, clip range, eta) but lr, SD1.5's CFG scale and the trained fraction.
    learner = sd15_learner(comps, args.guidance, args.timestep_fraction)
    n_params = {k: sum(p.numel() for p in m.parameters()) for k, m in (("unet", comps.unet), ("vae", comps.vae), ("text_encoder", comps.text_encoder))}
    log("gpu", f"{dtype_name}: built in {time.time() - t0:.0f}s, params {n_params}")
    flops = count_flops(learner, args.resolution, args.guidance)
    log("gpu", f"{dtype_name}: guided UNet call, 1 image: {flops['forward'] / 1e9:.2f} GFLOP forward, "
               f"{flops['forward_backward'] / 1e9:.2f} GFLOP forward+backward")
    settings = sd15_sampling(args.steps, args.guidance, args.resolution)
    sampling, last = measure_sampling(learner, settings, args.sample_batches, args.repeats, device, flops, peak)
    # The update trains on real trajectories of the policy: one batch of the largest update size.
    nb = max(args.update_batches)
    batch = sample_trajectories(comps, [PROMPT] * nb, list(range(nb)), settings, 0, list(range(nb)), learner.negative_embeds)
    batch.rewards = torch.randn(nb)
    batch.advantages = torch.randn(nb)
    update = measure_update(learner, batch, args.update_batches, args.repeats, device, flops, peak, args.timestep_fraction)
    calib = None
    ok_updates = [r for r in update if "error" not in r]
    if last and ok_updates:
        u = ok_updates[-1]
        calib = {"source": f"research.bench.gpu {args.size} {dtype_name} on {machine()['gpu'] or 'cpu'}", "batch_size": last["batch"],
                 "sample_s_per_batch": last["seconds"],
                 "score_s_per_batch": scoring_seconds(batch) * last["batch"] / len(batch),
                 "update_s_per_sample": u["seconds"] / u["batch"],
                 "shapes": {"latents": list(batch.latents.shape[1:]), "prompt_embeds": list(batch.prompt_embeds.shape[1:]),
                            "images": list(batch.images.shape[1:])}}
    del learner, comps, batch
    _free(device)
    return {"dtype": dtype_name, "params": n_params, "flops_per_image_per_step": flops, "sampling": sampling, "update": update,
            "calibration": calib}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(MODEL_SIZES), default="full")
    ap.add_argument("--dtypes", nargs="+")
    ap.add_argument("--sample-batches", type=int, nargs="+")
    ap.add_argument("--update-batches", type=int, nargs="+")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--resolution", type=int)
    ap.add_argument("--guidance", type=float, default=7.5)
    ap.add_argument("--timestep-fraction", type=float, default=UpdateSettings.timestep_fraction,
                    help="fraction of timesteps trained per update (default: the learner's, all of them, as DDPO)")
    ap.add_argument("--repeats", type=int, default=1, help="timed repeats per measurement (median), after one warm-up")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16/fp16 peak (H100/H200 SXM: 989)")
    ap.add_argument("--device", help="default cuda (full), cpu (tiny)")
    ap.add_argument("--out", help="default research/results/gpu")
    args = ap.parse_args(argv)
    d = MODEL_SIZES[args.size]
    for k in ("dtypes", "sample_batches", "update_batches", "steps", "resolution", "device"):
        if getattr(args, k) is None:
            setattr(args, k, d[k])

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible; use --size tiny (CPU) to check the script")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    out = out_dir("gpu", args.out)
    res = {"machine": machine(), "size": args.size, "device": args.device, "resolution": args.resolution, "steps": args.steps,
           "guidance_scale": args.guidance, "timestep_fraction": args.timestep_fraction, "repeats": args.repeats,
           "peak_tflops": args.peak_tflops, "sdpa": "AttnProcessor2_0 (torch scaled_dot_product_attention)", "lora_rank": DEFAULT_RANK,
           "cuda": torch.version.cuda, "results": []}
    if args.device == "cuda":
        res["sdpa_backends"] = {"flash": torch.backends.cuda.flash_sdp_enabled(), "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled()}
    path = out / "gpu.json"
    for dt in args.dtypes:
        r = bench_dtype(args, dt, args.device, args.peak_tflops)
        res["results"].append(r)
        if r["calibration"]:
            write_json(out / f"calib_{dt}.json", r["calibration"])
        write_json(path, res)  # after each dtype: a later crash keeps what was measured
    log("gpu", f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
