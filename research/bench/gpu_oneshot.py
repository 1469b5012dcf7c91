"""The GPU run in one command (issue 58): what a lent GPU machine's few minutes measure, unattended.

    python -m research.bench.gpu_oneshot --out DIR                 # on the GPU: SD1.5's shapes, random weights, < 8 min
    python -m research.bench.gpu_oneshot --size tiny --out DIR     # the same parts on the CPU with the tiny model (a test)

Prepare the machine's wheels first with `python -m research.bench.gpu_prepare` (it prints the exact
command to run there). Parts, in order, each under its own time budget (a part that runs out stops
at the last finished measurement), each appended to DIR/gpu_oneshot.json the moment it ends, so a
failure keeps everything before it:
  env        the card, torch, CUDA, the SDPA backends
  sampling   images/s per batch size, 512 px, 50 DDIM steps, CFG 7.5, bf16 and fp16, with the
             fraction of peak from the FLOP model and peak GPU memory (the sampler's)
  update     images/s per train batch size (every step trained), bf16 and fp16, with peak GPU
             memory (the learner's at that micro-batch)
  rewards    peak GPU memory and images/s of reward models of ImageReward's size (BLIP ViT-L/16 +
             BERT-base) and HPSv2's (ViT-H-14), random weights, fp16, batch 8 at 512 px
  lora_io    the LoRA's flat broadcast form: flatten, serialise to bytes and back, load into the UNet
  reference  the single-process reference loop (actors/reference_loop.py) at SD1.5's size, random
             weights saved as a diffusers folder, 2 epochs of 16 samples, JPEG compressibility
Ray cannot travel to the machine (its wheel is ~79 MB), so Ray's own overhead is measured on CPU
(RESULTS, "What does the distributed system cost?"). Sampling and update reuse research/bench/gpu.py's measurements.
"""
from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from diffrlhf.policy.sampler import sample_trajectories
from research.bench import gpu
from research.bench.common import log, machine, out_dir, write_json

# Seconds per part: the whole stays under 8 minutes on an H100/H200 (model builds included).
BUDGET_S = {"env": 10, "sampling": 75, "update": 75, "rewards": 60, "lora_io": 20, "reference": 100}
SIZES = {
    "full": dict(device="cuda", dtypes=["bfloat16", "float16"], sample_batches=[1, 4, 16], update_batches=[1, 4, 8],
                 reward_dtype="float16", reward_batch=8, reward_px=512, reference=dict(resolution=512, steps=50, batch=8, batches=2)),
    "tiny": dict(device="cpu", dtypes=["float32"], sample_batches=[2, 4], update_batches=[2], reward_dtype="float32",
                 reward_batch=2, reward_px=64, reference=dict(resolution=32, steps=3, batch=4, batches=1)),
}
# Tiny reward shapes for the CPU mode (the same classes as the full-size models).
TINY_BLIP = (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=16),
             dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=64))
TINY_CLIP = (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=16),
             dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=49408), 16)


class Budget:
    """A part's clock: `left()` seconds remain; measurements stop once it is spent."""

    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


def part_env(args, budget) -> dict:
    out = {"machine": machine(), "torch": torch.__version__, "cuda": torch.version.cuda, "device": args.device}
    if args.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_memory_gb=p.total_memory / 2**30, multiprocessors=p.multi_processor_count,
                   sdpa_flash=torch.backends.cuda.flash_sdp_enabled(), sdpa_mem_efficient=torch.backends.cuda.mem_efficient_sdp_enabled())
    return out


def part_throughput(args, budget, kind: str) -> dict:
    """Sampling or update images/s per batch size and dtype, the batch sizes in increasing order until
    the budget runs out (what was measured stays)."""
    out = {}
    per_dtype = budget.seconds / len(args.dtypes)
    for dt in args.dtypes:
        b = Budget(min(per_dtype, budget.left()))
        comps = gpu.build_components(args.size, args.device, getattr(torch, dt))
        learner = gpu.sd15_learner(comps, args.guidance)
        flops = gpu.count_flops(learner, args.resolution, args.guidance)
        settings = gpu.sd15_sampling(args.steps, args.guidance, args.resolution)
        rows = []
        if kind == "sampling":
            for n in args.sample_batches:
                if b.left() <= 0:
                    rows.append({"batch": n, "skipped": "time budget spent"})
                    continue
                rows += gpu.measure_sampling(learner, settings, [n], 1, args.device, flops, args.peak_tflops)[0]
        else:
            nb = max(args.update_batches)
            batch = sample_trajectories(comps, [gpu.PROMPT] * nb, list(range(nb)), settings, 0, list(range(nb)), learner.negative_embeds)
            batch.rewards, batch.advantages = torch.randn(nb), torch.randn(nb)
            for n in args.update_batches:
                if b.left() <= 0:
                    rows.append({"batch": n, "skipped": "time budget spent"})
                    continue
                rows += gpu.measure_update(learner, batch, [n], 1, args.device, flops, args.peak_tflops, 1.0)
        out[dt] = {"flops_per_image_per_step": flops, "rows": rows}
        del learner, comps
        gpu._free(args.device)
    return out


def part_rewards(args, budget) -> dict:
    """Peak GPU memory and images/s of the learned reward models at their real sizes (random weights)."""
    from diffrlhf.rewards.aesthetic import AestheticMLP
    from diffrlhf.rewards.hpsv2 import HPSv2Scorer, build_clip
    from diffrlhf.rewards.imagereward import ImageRewardScorer, build_blip
    from research.bench.rewards_throughput import _bert_tokenizer

    tiny = args.size == "tiny"
    dtype = getattr(torch, args.reward_dtype)
    images = np.random.RandomState(0).randint(0, 256, size=(args.reward_batch, args.reward_px, args.reward_px, 3), dtype=np.uint8)
    prompts = ["a photo of a cat sitting on a wooden table"] * args.reward_batch
    out = {}
    builders = {
        "imagereward": lambda: (lambda v, t: ImageRewardScorer(v, t, AestheticMLP(t.config.hidden_size), _bert_tokenizer()[0],
                                                               device=args.device, dtype=dtype))(*build_blip(*(TINY_BLIP if tiny else (None, None)))),
        "hpsv2": lambda: HPSv2Scorer(build_clip(*TINY_CLIP) if tiny else build_clip(), device=args.device, dtype=dtype),
    }
    for name, build in builders.items():
        if budget.left() <= 0:
            out[name] = {"skipped": "time budget spent"}
            continue
        gpu._free(args.device)
        gpu.peak_memory_gb(args.device)
        t0 = time.perf_counter()
        with torch.device(args.device):  # initialise on the GPU: a billion random parameters on a CPU take minutes
            scorer = build()
        build_s = time.perf_counter() - t0
        scorer(images, prompts)  # warm-up
        gpu.sync(args.device)
        t0 = time.perf_counter()
        scores = scorer(images, prompts)
        gpu.sync(args.device)
        dt = time.perf_counter() - t0
        params = sum(p.numel() for p in (scorer.model.parameters() if name == "hpsv2" else
                                         list(scorer.vision.parameters()) + list(scorer.text.parameters())))
        out[name] = {"params": params, "dtype": args.reward_dtype, "batch": args.reward_batch, "px": args.reward_px, "build_s": build_s,
                     "seconds": dt, "images_per_s": args.reward_batch / dt, "peak_memory_gb": gpu.peak_memory_gb(args.device),
                     "finite": bool(np.isfinite(np.asarray(scores)).all())}
        log("gpu_oneshot", f"reward {name}: {out[name]['images_per_s']:.1f} images/s, peak {out[name]['peak_memory_gb']} GB")
        del scorer
    return out


def part_lora_io(args, budget) -> dict:
    """The LoRA's broadcast form at this size: flatten, serialise, and load into a second UNet."""
    from diffrlhf.learner.lora import flat_lora_state, load_flat_lora

    comps = gpu.build_components(args.size, args.device, getattr(torch, args.dtypes[0]))
    learner = gpu.sd15_learner(comps, args.guidance)
    t0 = time.perf_counter()
    flat = flat_lora_state(comps.unet)
    t_flat = time.perf_counter() - t0
    buf = io.BytesIO()
    t0 = time.perf_counter()
    torch.save(flat.to_state_dict(), buf)
    t_save = time.perf_counter() - t0
    size = buf.tell()
    buf.seek(0)
    t0 = time.perf_counter()
    state = torch.load(buf, weights_only=True)
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    load_flat_lora(comps.unet, flat)
    gpu.sync(args.device)
    t_load = time.perf_counter() - t0
    del learner, comps
    gpu._free(args.device)
    return {"tensors": len(state), "bytes": size, "flatten_s": t_flat, "serialise_s": t_save, "deserialise_s": t_read, "load_s": t_load}


def part_reference(args, budget) -> dict:
    """Two epochs of the reference loop at this size: random weights written as a diffusers folder
    (what model.name reads), JPEG compressibility."""
    from diffrlhf.actors.reference_loop import run_reference
    from diffrlhf.deploy.config import load_config
    from diffrlhf.tinyworld.architecture import save_components_folder

    r = args.reference
    folder = Path(tempfile.mkdtemp()) / "model"
    dtype = args.dtypes[0]
    comps = gpu.build_components(args.size, args.device, getattr(torch, dtype))
    t0 = time.perf_counter()
    save_components_folder(folder, comps.unet, comps.vae, comps.text_encoder, comps.scheduler)  # the project's own writer
    save_s = time.perf_counter() - t0
    del comps
    gpu._free(args.device)
    cfg = load_config("tiny", overrides=[f"model.name={folder}", f"model.device={args.device}", f"model.dtype={dtype}",
                                         "reward.spec=jpeg_compressibility", "train.epochs=2", f"sample.num_steps={r['steps']}",
                                         f"sample.resolution={r['resolution']}", f"sample.batch_size={r['batch']}",
                                         f"sample.batches_per_epoch={r['batches']}", f"train.batch_size={r['batch']}",
                                         "run.tensorboard=false", "run.image_grid_every=0"])
    gpu.peak_memory_gb(args.device)
    t0 = time.perf_counter()
    records = run_reference(cfg, progress=False)
    wall = time.perf_counter() - t0
    return {"model_save_s": save_s, "wall_s": wall, "peak_memory_gb": gpu.peak_memory_gb(args.device),
            "epochs": [{k: rec.get(k) for k in ("epoch", "reward_mean", "reward_queries", "loss", "clipfrac", "time_sample",
                                                "time_update", "time_epoch")} for rec in records]}


PARTS = {"env": part_env, "sampling": lambda a, b: part_throughput(a, b, "sampling"),
         "update": lambda a, b: part_throughput(a, b, "update"), "rewards": part_rewards, "lora_io": part_lora_io,
         "reference": part_reference}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m research.bench.gpu_oneshot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16/fp16 peak (H100/H200 SXM: 989)")
    ap.add_argument("--out", help="default research/results/gpu_oneshot")
    args = ap.parse_args(argv)
    for k, v in SIZES[args.size].items():
        setattr(args, k, v)
    args.resolution, args.steps, args.guidance = (512, 50, 7.5) if args.size == "full" else (32, 2, 7.5)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU visible; --size tiny runs the same parts on the CPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    out = out_dir("gpu_oneshot", args.out)
    path = out / "gpu_oneshot.json"
    res = {"size": args.size, "budgets_s": BUDGET_S, "parts": {}}
    t_all = time.perf_counter()
    for name in args.parts:
        budget = Budget(BUDGET_S[name])
        log("gpu_oneshot", f"{name} (budget {BUDGET_S[name]} s)")
        try:
            res["parts"][name] = {"result": PARTS[name](args, budget)}
        except Exception as e:  # one part's failure is a result; the next part still runs
            res["parts"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            log("gpu_oneshot", f"{name} failed: {res['parts'][name]['error']}")
        res["parts"][name]["seconds"] = BUDGET_S[name] - budget.left()
        res["total_s"] = time.perf_counter() - t_all
        write_json(path, res)  # part by part: a crash later keeps this
    log("gpu_oneshot", f"wrote {path} in {res['total_s']:.0f} s")
    return res


if __name__ == "__main__":
    main()
