"""Time per stage at SD1.5's size on this CPU, beside the FLOP model's prediction (issue 55 item 4).

    research/capped.sh 12G python -m research.bench.stage_time --run RUN_DIR [--out DIR]

RUN_DIR: a finished `diffrlhf train` run folder of `model.name=sd15-random` (its config.yaml,
metrics.jsonl and roles.json), made on this machine; its weights are read from DIFFRLHF_CACHE.

- Work per stage, from the run's config: FLOPs counted with torch's FlopCounterMode on the meta
  device (SD1.5's UNet with the run's LoRA, CLIP ViT-L/14's text encoder, SD1.5's VAE decoder). A
  sampler call: the batch's prompts encoded, `num_steps` guided UNet calls (2 x batch rows), one VAE
  decode of the batch. A learner epoch: `learner_passes` (sample, step) pairs, each a guided UNet
  forward and the backward the LoRA's gradient needs (frozen weights get no gradient).
- The FLOP model's prediction: FLOPs / this machine's fp32 matmul rate at the run's torch threads
  (measured here: the rate the model assumes every operation runs at).
- Measured: in the run, the sampler's busy seconds per call (roles.json) and the learner's seconds
  per epoch (metrics.jsonl learner_s, median of the epochs after the first); alone in this process,
  the same UNet calls timed with the run's weights (to tell a slow operation mix from the system's
  overhead: Ray, data movement, the rest of each call).
Random weights: the times are real, the images mean nothing. CPU only; a GPU's ratios differ.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from research.bench import gpu_memory
from research.bench.common import log, machine, out_dir, torch_threads, write_report

THRESHOLD = 0.25  # |measured / predicted - 1| above this is explained in the table


def flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def unet_on_meta(lora_rank: int):
    return gpu_memory.unet_on_meta(lora_rank, torch.float32)  # fp32 like the CPU runs (FLOPs do not depend on it)


def unet_call(unet, rows: int, latent: int, device: str, train: bool) -> None:
    x = torch.randn(rows, 4, latent, latent, device=device)
    ctx = torch.randn(rows, 77, 768, device=device)
    t = torch.full((rows,), 500, device=device, dtype=torch.long)
    if train:
        unet(x, t, encoder_hidden_states=ctx).sample.float().sum().backward()
    else:
        with torch.no_grad():
            unet(x, t, encoder_hidden_states=ctx)


def counted_work(cfg, learner_passes: int) -> dict:
    """FLOPs of one sampler call and of one learner epoch of the run's config."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffrlhf.tinyworld.architecture import SD15_TEXT, SD15_VAE

    s, latent = cfg.sample, cfg.sample.resolution // 8
    unet = unet_on_meta(cfg.model.lora_rank)
    guided = flops(lambda: unet_call(unet, 2 * s.batch_size, latent, "meta", train=False))
    per_pair = flops(lambda: unet_call(unet, 2 * cfg.train.batch_size, latent, "meta", train=True)) / cfg.train.batch_size
    with torch.device("meta"):
        vae = AutoencoderKL(**SD15_VAE)
        text = CLIPTextModel(CLIPTextConfig(**SD15_TEXT))
    with torch.no_grad():
        decode = flops(lambda: vae.decode(torch.randn(s.batch_size, 4, latent, latent, device="meta")))
        encode = flops(lambda: text(torch.zeros(s.batch_size, 77, dtype=torch.long, device="meta")))
    return {"unet_guided_call": guided, "sampler_unet": s.num_steps * guided, "vae_decode": decode, "text_encode": encode,
            "sampler_call": s.num_steps * guided + decode + encode, "learner_pair": per_pair,
            "learner_epoch": learner_passes * per_pair}


def matmul_rate(threads: int, n: int = 1024, seconds: float = 3.0) -> float:
    """fp32 FLOP/s of an n x n matmul at `threads` torch threads (best of repeated timings)."""
    with torch_threads(threads):
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best, t_end = float("inf"), time.time() + seconds
        while time.time() < t_end:
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def run_unet(cfg):
    """The run's UNet with its weights from the cache (loaded once: 3.4 GB in fp32)."""
    from diffusers import UNet2DConditionModel

    from diffrlhf.policy.models import resolve_model

    return UNet2DConditionModel.from_pretrained(resolve_model(cfg.model.name), subfolder="unet")


def timed_alone(cfg, unet, threads: int, repeats: int = 3) -> dict:
    """The run's UNet timed alone: a sampler call's guided UNet calls and one learner (sample, step)
    pair, forward and backward with the run's LoRA, added here (median of `repeats`)."""
    from diffrlhf.learner.lora import add_lora

    s, latent = cfg.sample, cfg.sample.resolution // 8
    unet.requires_grad_(False)
    add_lora(unet, rank=cfg.model.lora_rank)

    def median_s(fn):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    with torch_threads(threads):
        guided = median_s(lambda: unet_call(unet, 2 * s.batch_size, latent, "cpu", train=False))
        pair = median_s(lambda: unet_call(unet, 2 * cfg.train.batch_size, latent, "cpu", train=True)) / cfg.train.batch_size
    return {"unet_guided_call_s": guided, "sampler_unet_s": s.num_steps * guided, "learner_pair_s": pair}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def resolution_scan(cfg, unet, threads: int, resolutions: list[int]) -> list[dict]:
    """One guided UNet call of one image (2 rows) alone at each resolution (the run's UNet, before
    timed_alone adds its LoRA): counted FLOPs, seconds, and the achieved rate against the matmul rate
    (how far the FLOP model's assumption holds)."""
    meta = unet_on_meta(cfg.model.lora_rank)
    out = []
    with torch_threads(threads):
        for px in resolutions:
            f = flops(lambda: unet_call(meta, 2, px // 8, "meta", train=False))
            unet_call(unet, 2, px // 8, "cpu", train=False)  # warm-up
            t0 = time.perf_counter()
            unet_call(unet, 2, px // 8, "cpu", train=False)
            s = time.perf_counter() - t0
            out.append({"resolution": px, "flops": f, "seconds": s, "achieved_gflops": f / s / 1e9})
    return out


def in_run(run: Path) -> dict:
    roles = json.loads((run / "roles.json").read_text())
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    samplers = [r for r in roles if r["role"].startswith("sampler")]
    later = records[1:] or records
    return {"sampler_call_s": statistics.median(r["busy_s"] / r["calls"] for r in samplers),
            "sampler_calls": sum(r["calls"] for r in samplers),
            "learner_epoch_s": statistics.median(r["learner_s"] for r in later),
            "learner_epoch_s_first": records[0]["learner_s"],
            "learner_passes": statistics.median(r["learner_passes"] for r in later), "epochs": len(records)}


def rows(work: dict, rate: float, alone: dict, run: dict, cfg) -> list[dict]:
    """One row per stage: FLOPs, predicted seconds, measured seconds (alone and in the run)."""
    s = cfg.sample
    out = [
        {"stage": f"sampler: {s.num_steps} guided UNet calls ({2 * s.batch_size} rows, {s.resolution} px)",
         "flops": work["sampler_unet"], "alone_s": alone["sampler_unet_s"], "run_s": None},
        {"stage": f"sampler: one call (text encode, UNet, VAE decode of {s.batch_size})",
         "flops": work["sampler_call"], "alone_s": None, "run_s": run["sampler_call_s"]},
        {"stage": "learner: one (sample, step) pair, forward + backward",
         "flops": work["learner_pair"], "alone_s": alone["learner_pair_s"], "run_s": None},
        {"stage": f"learner: one epoch ({int(run['learner_passes'])} pairs)",
         "flops": work["learner_epoch"], "alone_s": alone["learner_pair_s"] * run["learner_passes"], "run_s": run["learner_epoch_s"]},
    ]
    for r in out:
        r["predicted_s"] = r["flops"] / rate
        measured = r["run_s"] if r["run_s"] is not None else r["alone_s"]
        r["measured_over_predicted"] = measured / r["predicted_s"]
    return out


def markdown(res: dict) -> str:
    lines = [f"Time per stage at SD1.5's size on this CPU ({res['cpu']}), run `{res['run']}`: "
             f"{res['config']['resolution']} px, {res['config']['num_steps']} DDIM steps, torch threads {res['threads']}.",
             f"FLOP model: FLOPs (FlopCounterMode, meta device) / fp32 matmul rate here "
             f"{res['matmul_gflops']:.1f} GFLOP/s (n=1024, {res['threads']} thread(s)).", "",
             "| stage | GFLOP | predicted s | measured alone s | measured in the run s | measured / predicted |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(f"| {r['stage']} | {r['flops'] / 1e9:.1f} | {r['predicted_s']:.2f} | {f(r['alone_s'])} | {f(r['run_s'])} | "
                     f"{r['measured_over_predicted']:.2f} |")
    lines += ["", "One guided UNet call of one image (2 rows) alone, by resolution: the achieved rate against the matmul rate.", "",
              "| resolution | GFLOP | seconds | achieved GFLOP/s | fraction of the matmul rate |", "| --- | --- | --- | --- | --- |"]
    for r in res["scan"]:
        lines.append(f"| {r['resolution']} px | {r['flops'] / 1e9:.1f} | {r['seconds']:.2f} | {r['achieved_gflops']:.1f} | "
                     f"{r['achieved_gflops'] / res['matmul_gflops']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="a finished sd15-random run folder made on this machine")
    p.add_argument("--out", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scan", type=int, nargs="*", default=[64, 128, 256], help="resolutions of the achieved-rate scan")
    a = p.parse_args(argv)
    import argparse as ap

    from diffrlhf.deploy.cli import load_cfg

    run = Path(a.run)
    cfg = load_cfg(ap.Namespace(resume=str(run), overrides=[]))  # the run's config as it ran
    if not cfg.model.name.startswith("sd15"):
        raise SystemExit(f"--run {run}: model.name is {cfg.model.name!r}; this measures SD1.5's size (model.name=sd15-random)")
    threads = cfg.system.torch_threads
    measured = in_run(run)
    log("stage_time", f"counting FLOPs ({cfg.sample.resolution} px, {cfg.sample.num_steps} steps)")
    work = counted_work(cfg, int(measured["learner_passes"]))
    log("stage_time", "measuring the matmul rate")
    rate = matmul_rate(threads)
    unet = run_unet(cfg)
    log("stage_time", f"the achieved rate at {a.scan} px")
    scan = resolution_scan(cfg, unet, threads, a.scan)
    log("stage_time", "timing the run's UNet alone")
    alone = timed_alone(cfg, unet, threads, a.repeats)
    res = {"run": str(run), "machine": machine(), "cpu": cpu_model(), "threads": threads, "matmul_gflops": rate / 1e9,
           "config": {"resolution": cfg.sample.resolution, "num_steps": cfg.sample.num_steps, "batch_size": cfg.sample.batch_size,
                      "train_batch_size": cfg.train.batch_size, "lora_rank": cfg.model.lora_rank},
           "work_flops": work, "alone": alone, "in_run": measured, "rows": rows(work, rate, alone, measured, cfg),
           "scan": scan, "threshold": THRESHOLD}
    return write_report(out_dir("stage_time", a.out), "stage_time", res, markdown(res))


if __name__ == "__main__":
    main()
