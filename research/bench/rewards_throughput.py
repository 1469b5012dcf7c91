"""Reward throughput, images/s at a fixed batch size, for every reward, and FLOPs per image.

    python -m research.bench.rewards_throughput OUT.json [--batch 8] [--sizes 64 512] [--repeats 3]
                                                       [--rewards jpeg_compressibility aesthetic ...]
                                                       [--rewards ... imagereward_pkg hpsv2_pkg]

The package rewards (`*_pkg`) run in their own venv (`diffrlhf reward-env build NAME`): this
script runs itself there for them, one subprocess per reward, and merges the rows. They build the
package's own model on seeded random weights.

Learned models use random weights of the real sizes (no downloads): CLIP ViT-L/14 vision tower
for aesthetic, BLIP ViT-L/16 + BERT-base for ImageReward, open_clip ViT-H-14 (as a transformers
CLIPModel) for HPSv2. Speed does not depend on the weight values. The JSON records the machine
(CPU count, torch threads, load average before and after) because shared machines skew numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import numpy as np
import torch

from diffrlhf.rewards import build_reward
from diffrlhf.rewards.aesthetic import AestheticMLP, AestheticScorer
from diffrlhf.rewards.hpsv2 import HPSv2Scorer, build_clip
from diffrlhf.rewards.imagereward import ImageRewardScorer, build_blip, load_bert_tokenizer

ALL = ["jpeg_compressibility", "jpeg_incompressibility", "aesthetic", "imagereward", "hpsv2"]


def _bert_tokenizer():
    """bert-base-uncased from the HF cache if present; otherwise a stand-in vocabulary (token ids
    differ, the text length - padded to 35 - and so the compute are the same)."""
    try:
        return load_bert_tokenizer(None), "bert-base-uncased (HF cache)"
    except Exception:
        d = tempfile.mkdtemp()
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(97, 123)]
        with open(os.path.join(d, "vocab.txt"), "w") as f:
            f.write("\n".join(words) + "\n")
        return load_bert_tokenizer(d), "stand-in vocabulary"


def build(name: str):
    """Return (reward_fn, params, note)."""
    if name.endswith("_pkg"):
        fn = build_reward({"name": name, "seed": 0})
        return fn, sum(p.numel() for p in fn.model.parameters()), f"the {name[:-4]} package's own model, random weights"
    if name.startswith("jpeg"):
        return build_reward(name), 0, ""
    if name == "aesthetic":
        from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

        cfg = CLIPVisionConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                               patch_size=14, image_size=224, projection_dim=768, hidden_act="quick_gelu")
        clip = CLIPVisionModelWithProjection(cfg)
        fn = AestheticScorer(clip, AestheticMLP())
        return build_reward(fn), sum(p.numel() for p in clip.parameters()), "CLIP ViT-L/14 vision tower + MLP"
    if name == "imagereward":
        vis, txt = build_blip()
        tok, note = _bert_tokenizer()
        fn = ImageRewardScorer(vis, txt, AestheticMLP(768), tok)
        n = sum(p.numel() for m in (vis, txt) for p in m.parameters())
        return build_reward(fn), n, f"BLIP ViT-L/16 + BERT-base cross-attn, {note}"
    if name == "hpsv2":
        model = build_clip()
        return build_reward(HPSv2Scorer(model)), sum(p.numel() for p in model.parameters()), "ViT-H-14 CLIPModel"
    raise ValueError(name)


def flops_per_image(fn, size: int) -> int | None:
    """FLOPs of scoring one image (torch's FlopCounterMode: matmuls and convolutions), None for JPEG."""
    from torch.utils.flop_counter import FlopCounterMode

    ims = np.random.RandomState(0).randint(0, 256, size=(1, size, size, 3), dtype=np.uint8)
    with FlopCounterMode(display=False) as counter:
        fn(ims, ["a photo of an astronaut riding a horse on mars, highly detailed"])
    return int(counter.get_total_flops()) or None


def in_venv(name: str, a) -> list[dict]:
    """Rows for a package reward, measured by this script running in the reward's own venv."""
    import subprocess
    import sys
    from pathlib import Path

    from diffrlhf.rewards.environments import BY_REWARD, check

    python = check(BY_REWARD[name].name)
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        cmd = [str(python), "-m", "research.bench.rewards_throughput", out, "--rewards", name, "--batch", str(a.batch),
               "--sizes", *map(str, a.sizes), "--repeats", str(a.repeats), "--warmup", str(a.warmup)]
        subprocess.run(cmd, cwd=root, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}, check=True)
        with open(out) as f:
            return json.load(f)["results"]


def bench_one(fn, batch: int, size: int, repeats: int, warmup: int = 1, threads: int = 1) -> dict:
    """Wall time per batch, and CPU time of this process per batch: on a shared machine the wall
    figure measures the neighbours too, while images per CPU-second x cores is what an otherwise
    idle machine of this kind would give (an upper bound: it assumes perfect thread scaling)."""
    rs = np.random.RandomState(0)
    ims = rs.randint(0, 256, size=(batch, size, size, 3), dtype=np.uint8)
    prompts = ["a photo of an astronaut riding a horse on mars, highly detailed"] * batch
    for _ in range(warmup):  # allocations, lazy init
        fn(ims, prompts)
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(ims, prompts)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert out.shape == (batch,) and np.isfinite(out).all()
    med, cmed = float(np.median(times)), float(np.median(cpu))
    return {"batch": batch, "size": size, "repeats": repeats, "warmup": warmup, "seconds_per_batch": times,
            "cpu_seconds_per_batch": cpu, "median_s": med, "images_per_s": batch / med,
            "images_per_cpu_s": batch / cmed if cmed else None,
            "images_per_s_if_idle": batch / cmed * threads if cmed else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 512])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rewards", nargs="+", default=ALL)
    p.add_argument("--warmup", type=int, default=1, help="untimed batches before timing (learned models)")
    a = p.parse_args(argv)
    res = {"machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                       "platform": platform.platform(), "loadavg_start": os.getloadavg()},
           "results": []}
    for name in a.rewards:
        if name.endswith("_pkg"):
            try:
                __import__({"imagereward_pkg": "ImageReward", "hpsv2_pkg": "hpsv2"}[name])
            except ImportError:  # not in its venv: run there
                res["results"] += in_venv(name, a)
                continue
        t0 = time.perf_counter()
        fn, nparams, note = build(name)
        build_s = time.perf_counter() - t0
        flops = None if name.startswith("jpeg") else flops_per_image(fn, max(a.sizes))
        for size in a.sizes:
            reps = a.repeats if name.startswith("jpeg") else max(1, a.repeats - 1 if size > 256 else a.repeats)
            warm = 1 if name.startswith("jpeg") else a.warmup
            r = {"reward": name, "params": nparams, "note": note, "build_s": build_s, "flops_per_image": flops,
                 # JPEG encoding is single-threaded; torch models use all intra-op threads
                 **bench_one(fn, a.batch, size, reps, warm,
                             threads=1 if name.startswith("jpeg") else min(torch.get_num_threads(), os.cpu_count() or 1)),
                 "loadavg": os.getloadavg()}
            res["results"].append(r)
            print(f"{name:24s} {size:4d}px batch {a.batch}: {r['images_per_s']:8.2f} img/s wall "
                  f"({r['median_s']:.3f} s/batch), {r['images_per_s_if_idle']:8.2f} img/s from CPU time, "
                  f"{nparams / 1e6:.0f} M params, load {r['loadavg'][0]:.1f}", flush=True)
        del fn
    res["machine"]["loadavg_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
