"""Validate the tinyworld_alignment reward before it is used (issue 20):

    python -m research.bench.alignment_check [--n-real 300] [--n-rec 128] [--n-study 64] [--n-full 32] [--threads 1]

writes research/results/alignment_check.json, .md and alignment_check_samples.png (or --out DIR).

1. Prompt lists: every caption of tiny-world-train (48) and tiny-world-eval (16) parses.
2. Real rendered images (tinyworld.scenes.render of random scenes, every attribute known and
   stated): per attribute, top-1 (the true value's attribute score is strictly the highest of all
   values') and pairwise (the reward of the scene's own caption is strictly above that of each
   caption that changes this attribute only; texture with attributes=all, the rest with the default
   reward); the own caption's reward.
3. The same on the VAE's reconstructions of those images: what the tiny world's autoencoder can
   draw, the ceiling of what a policy can be rewarded for.
4. The pretrained tiny world's own samples (DDIM 20 steps, eta 1, CFG 5, as RL samples): the
   reward's distribution on the study's prompts (held-out and training); and on fully stated
   captions (plain backgrounds), the same top-1 / pairwise rates (here they measure the model and
   the scorer together) and the agreement of the colour reading with scenes.colour_check.
5. Cost: ms per image through build_reward, batches of 8, 64 and 512 px, wall and CPU time.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from research.bench.common import RESULTS_DIR, log, machine, write_json
from diffrlhf.policy.prompts import load_prompts
from diffrlhf.rewards import build_reward
from research.controls import reward_spec
from diffrlhf.rewards import tinyworld_alignment as ta
from diffrlhf.tinyworld import scenes as tw
from diffrlhf.tinyworld import weights as tww
from diffrlhf.tinyworld.evaluate import load_pipeline, reconstruct, sample, save_grid

VALUES = {"colour": tw.COLOURS, "shape": tw.SHAPES, "count": tw.COUNTS, "size": tw.SHAPE_SIZES,
          "texture": tw.TEXTURES, "background": tw.BACKGROUNDS}


def caption_attrs(scene: tw.Scene, **change) -> ta.CaptionAttributes:
    d = dict(colour=scene.colour, shape=scene.shape, count=scene.count, size=scene.size,
             texture=None if scene.texture == "plain" else scene.texture, background=scene.background)
    d.update(change)
    return ta.CaptionAttributes(**d)


def dist(x) -> dict:
    x = np.asarray(x, np.float64)
    if not x.size:
        return {"n": 0}
    q = np.percentile(x, [10, 25, 50, 75, 90])
    return {"n": int(x.size), "mean": float(x.mean()), "std": float(x.std()), "min": float(x.min()),
            "p10": q[0], "p25": q[1], "median": q[2], "p75": q[3], "p90": q[4], "max": float(x.max()),
            "histogram_0_1_by_0.1": np.histogram(x, bins=10, range=(0, 1))[0].tolist()}


def attribute_checks(images, scenes, attributes=tuple(VALUES)) -> dict:
    """Per attribute: top-1 and pairwise rates, the mean margin, and the own caption's scores."""
    default, full = ta.TinyWorldAlignment(), ta.TinyWorldAlignment(attributes=ta.ATTRIBUTES)
    top1 = {a: [] for a in attributes}
    pair = {a: [] for a in attributes}
    margin = {a: [] for a in attributes}
    own_attr = {a: [] for a in attributes}
    own_reward, own_reward_full, readings = [], [], []
    for im, s in zip(images, scenes):
        rd = full.read(im)
        readings.append(rd)
        own = caption_attrs(s)
        own_reward.append(default.score_reading(rd, own))
        own_reward_full.append(full.score_reading(rd, own))
        for a in attributes:
            reward = full if a == "texture" else default
            r_own = reward.score_reading(rd, own)
            tv = getattr(s, a)
            scores = {v: ta.attribute_scores(rd, caption_attrs(s, **{a: v}), ta.ATTRIBUTES)[a] for v in VALUES[a]}
            own_attr[a].append(scores[tv])
            top1[a].append(all(scores[tv] > x for v, x in scores.items() if v != tv))
            for v in VALUES[a]:
                if v == tv or (a == "texture" and v == "plain"):  # captions never say "plain"
                    continue
                r = reward.score_reading(rd, caption_attrs(s, **{a: v}))
                pair[a].append(r_own > r)
                margin[a].append(r_own - r)
    return {
        "n_images": len(images),
        "per_attribute": {a: {"top1": float(np.mean(top1[a])), "pairwise": float(np.mean(pair[a])), "pairs": len(pair[a]),
                              "mean_margin": float(np.mean(margin[a])), "own_attribute_score": dist(own_attr[a])}
                          for a in attributes},
        "own_caption_reward_default": dist(own_reward),
        "own_caption_reward_all_attributes": dist(own_reward_full),
        "colour_check": colour_agreement(images, scenes, readings),
    }


def colour_agreement(images, scenes, readings) -> dict:
    """The scorer's colour reading (named colour = argmax) against scenes.colour_check, plain backgrounds."""
    rows = []
    for im, s, rd in zip(images, scenes, readings):
        if s.background == "gradient":
            continue
        fg_ok, bg_ok = tw.colour_check(im, s)
        shape_read = bool(rd.areas) and ta.COLOURS[int(np.argmax(rd.colour_fg[:8]))] == s.colour
        bg_read = ta.COLOURS[int(np.argmax(rd.colour_bg[:8]))] == s.background
        rows.append((fg_ok, shape_read, bg_ok, bg_read))
    r = np.array(rows, bool).reshape(-1, 4)
    return {"n": len(r), "colour_check_shape_ok": float(r[:, 0].mean()), "scorer_shape_colour_ok": float(r[:, 1].mean()),
            "shape_agreement": float((r[:, 0] == r[:, 1]).mean()), "colour_check_background_ok": float(r[:, 2].mean()),
            "scorer_background_ok": float(r[:, 3].mean()), "background_agreement": float((r[:, 2] == r[:, 3]).mean())}


def sample_all(pipe, prompts, seed, batch=16):
    return np.concatenate([sample(pipe, prompts[i : i + batch], seed + i)[0] for i in range(0, len(prompts), batch)])


def cost(images, captions, repeats=3, batch=8) -> list[dict]:
    fn = build_reward("tinyworld_alignment")
    out = []
    for size in (64, 512):
        ims = images[:batch] if size == 64 else np.stack([np.asarray(Image.fromarray(im).resize((size, size), Image.BICUBIC))
                                                         for im in images[:batch]])
        fn(ims, captions[:batch])  # warm-up
        wall, cpu = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            fn(ims, captions[:batch])
            wall.append((time.perf_counter() - t0) / batch * 1000)
            cpu.append((time.process_time() - c0) / batch * 1000)
        out.append({"size": size, "batch": batch, "repeats": repeats, "ms_per_image_wall": wall, "ms_per_image_cpu": cpu,
                    "median_ms_wall": float(np.median(wall)), "median_ms_cpu": float(np.median(cpu))})
    return out


def table(rows: dict, attributes) -> list[str]:
    lines = ["| attribute | top-1 | pairwise (pairs) | mean margin | own attribute score, mean |", "|---|---|---|---|---|"]
    for a in attributes:
        r = rows["per_attribute"][a]
        lines.append(f"| {a} | {r['top1']:.1%} | {r['pairwise']:.1%} ({r['pairs']}) | {r['mean_margin']:+.3f} | "
                     f"{r['own_attribute_score']['mean']:.3f} |")
    return lines


def fmt(d: dict) -> str:
    if not d.get("n"):
        return "no samples"
    return (f"mean {d['mean']:.3f} (std {d['std']:.3f}), p10 {d['p10']:.3f}, median {d['median']:.3f}, "
            f"p90 {d['p90']:.3f}, min {d['min']:.3f}, max {d['max']:.3f}; histogram over [0, 1] by 0.1: {d['histogram_0_1_by_0.1']}")


def markdown(res: dict) -> str:
    m = res["machine"]
    L = ["# tinyworld_alignment: validation", "",
         f"`python -m research.bench.alignment_check {res['args']}` ({m['date']}, {m['cpu_count']} CPUs, "
         f"torch threads {m['torch_threads']}, load average at start {m['load_average'][0]:.1f}, took {res['seconds']:.0f} s).", "",
         "Top-1: the true value's attribute score is strictly the highest of all the attribute's values. Pairwise: the reward "
         "of the image's own caption (every attribute stated) is strictly above that of a caption that changes this attribute "
         "only (texture: reward with all attributes; others: the default reward, texture off).", "",
         "## Prompt lists", ""]
    for k, v in res["prompt_lists"].items():
        L.append(f"- `{k}`: {v['n']} captions, all parse: {v['all_parse']}")
    L.append(f"- held-out (colour, shape) pairs absent from the training list: {res['heldout_pairs_unseen']}")
    for key, title in (("real", "Real rendered images"), ("vae_reconstruction", "VAE reconstructions of those images (what the tiny world can draw)"),
                       ("samples_full_captions", "The tiny world's samples of fully stated captions (model and scorer together)")):
        r = res[key]
        L += ["", f"## {title}: {r['n_images']} images", ""] + table(r, list(VALUES)) + [
            "", f"Own caption's reward (default attributes): {fmt(r['own_caption_reward_default'])}"]
        if "colour_check" in r:
            c = r["colour_check"]
            L.append(f"Against `scenes.colour_check` ({c['n']} plain backgrounds): shape colour right {c['colour_check_shape_ok']:.1%} "
                     f"(scorer's argmax {c['scorer_shape_colour_ok']:.1%}, agreement {c['shape_agreement']:.1%}); background "
                     f"{c['colour_check_background_ok']:.1%} (scorer {c['scorer_background_ok']:.1%}, agreement {c['background_agreement']:.1%}).")
    s = res["samples_study_prompts"]
    L += ["", f"## The tiny world's samples of the study's prompts (DDIM 20 steps, eta 1, CFG 5; one sample each)", ""]
    for k, v in s["lists"].items():
        L.append(f"- `{k}` ({v['n_prompts']} prompts): reward {fmt(v['reward'])}")
        L.append("  - attributes, mean: " + ", ".join(f"{a} {d['mean']:.3f}" for a, d in v["attributes"].items()))
    L.append(f"- shuffled control on the same images: mean {s['shuffled_mean']:.4f} vs {s['reward_mean']:.4f} "
             f"(a permutation: same mean), correlation with the image's own reward {s['shuffled_corr_with_own']:.2f}")
    L += ["", "## Cost (build_reward, batches of 8)", "", "| input | ms/image wall (median) | ms/image CPU (median) |", "|---|---|---|"]
    for c in res["cost"]:
        L.append(f"| {c['size']} px | {c['median_ms_wall']:.1f} | {c['median_ms_cpu']:.1f} |")
    L.append(f"\nSampling the tiny world on the same machine: {res['sampling_s_per_image']:.2f} s per image (so the reward "
             f"adds {res['cost'][0]['median_ms_wall'] / 1000 / res['sampling_s_per_image']:.1%} to a sample's wall time).")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-real", type=int, default=300, help="rendered scenes")
    p.add_argument("--n-rec", type=int, default=128, help="of them, through the VAE")
    p.add_argument("--n-study", type=int, default=64, help="study prompts sampled: the 16 held-out, then training ones (64: all)")
    p.add_argument("--n-full", type=int, default=32, help="fully stated captions sampled (half train, half held-out pairs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on a shared 2-core machine, 2 threads sampled 4-7x slower than 1)")
    p.add_argument("--out", default=None, help=f"folder (default {RESULTS_DIR})")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = Path(a.out) if a.out else RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    res = {"machine": machine(), "args": " ".join(argv) if argv else "(defaults)"}

    # 1. The prompt lists.
    lists = {name: load_prompts(name) for name in ("tiny-world-train", "tiny-world-eval")}
    res["prompt_lists"] = {}
    for name, prompts in lists.items():
        ta.check_captions(prompts)  # raises, naming the caption, if one does not parse
        res["prompt_lists"][name] = {"n": len(prompts), "all_parse": True}
    pairs = lambda ps: {(c.colour, c.shape) for c in map(ta.parse_caption, ps)}  # noqa: E731
    res["heldout_pairs_unseen"] = not (pairs(lists["tiny-world-eval"]) & pairs(lists["tiny-world-train"]))
    log("align", f"prompt lists parse: {res['prompt_lists']}")

    # 2. Real rendered images.
    rng = np.random.default_rng([a.seed, 20])
    scenes = [tw.random_scene(rng, "heldout" if i % 2 else "train") for i in range(a.n_real)]
    real = np.stack([tw.render(s, rng) for s in scenes])
    res["real"] = attribute_checks(real, scenes)
    log("align", "real: " + ", ".join(f"{k} {v['top1']:.3f}/{v['pairwise']:.3f}" for k, v in res["real"]["per_attribute"].items()))

    # 3. Through the VAE.
    pipe = load_pipeline(tww.ensure_tiny_world())
    with torch.no_grad():
        rec = np.concatenate([reconstruct(pipe, real[i : min(i + 64, a.n_rec)]) for i in range(0, a.n_rec, 64)])
    res["vae_reconstruction"] = attribute_checks(rec, scenes[: a.n_rec])
    log("align", "vae: " + ", ".join(f"{k} {v['top1']:.3f}/{v['pairwise']:.3f}" for k, v in res["vae_reconstruction"]["per_attribute"].items()))

    # 4a. Samples of the study's prompts: all held-out ones first, then every k-th training one.
    held, train = lists["tiny-world-eval"], lists["tiny-world-train"]
    n_train = max(0, a.n_study - len(held))
    chosen = {"tiny-world-eval": held[: a.n_study],
              "tiny-world-train": train[:: max(1, len(train) // n_train)][:n_train] if n_train else []}
    prompts = chosen["tiny-world-eval"] + chosen["tiny-world-train"]
    t0 = time.perf_counter()
    samples = sample_all(pipe, prompts, a.seed + 1000)
    s_per_image = (time.perf_counter() - t0) / max(len(prompts), 1)
    fn = build_reward("tinyworld_alignment")
    r = fn(samples, prompts)
    comps = fn.components(samples, prompts)
    study = {"lists": {}, "reward_mean": float(r.mean())}
    i0 = 0
    for name, ps in chosen.items():
        if not ps:
            continue
        sl = slice(i0, i0 + len(ps))
        i0 += len(ps)
        study["lists"][name] = {"n_prompts": len(ps), "prompts": ps, "reward": dist(r[sl]), "rewards": r[sl].tolist(),
                                "attributes": {k: dist(v[sl][np.isfinite(v[sl])]) for k, v in comps.items() if np.isfinite(v[sl]).any()}}
    shuffled = build_reward(reward_spec("tinyworld_alignment_shuffled"))(samples, prompts)
    study["shuffled_mean"] = float(shuffled.mean())
    study["shuffled_corr_with_own"] = float(np.corrcoef(shuffled, r)[0, 1])
    res["samples_study_prompts"] = study
    save_grid(samples[:32], [f"{p} ({v:.2f})" for p, v in zip(prompts, r)], out / "alignment_check_samples.png",
              title="tiny world samples of the study's prompts (held-out first), tinyworld_alignment in brackets")
    log("align", f"study prompts: reward mean {r.mean():.3f}, {s_per_image:.2f} s per sample")

    # 4b. Samples of fully stated captions (plain backgrounds: colour_check applies).
    full_scenes = tw.eval_scenes("train", a.n_full // 2, seed=a.seed + 1) + tw.eval_scenes("heldout", a.n_full - a.n_full // 2, seed=a.seed + 1)
    full = sample_all(pipe, [s.caption() for s in full_scenes], a.seed + 2000)
    res["samples_full_captions"] = attribute_checks(full, full_scenes)
    res["sampling_s_per_image"] = s_per_image

    # 5. Cost.
    res["cost"] = cost(real, [s.caption() for s in scenes])
    log("align", f"cost: {[(c['size'], round(c['median_ms_wall'], 1), round(c['median_ms_cpu'], 1)) for c in res['cost']]} ms/image (wall, CPU)")
    res["machine"]["load_average_end"] = list(os.getloadavg())
    res["seconds"] = time.perf_counter() - t_start
    write_json(out / "alignment_check.json", res)
    (out / "alignment_check.md").write_text(markdown(res))
    log("align", f"wrote {out / 'alignment_check.json'} and .md in {res['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
