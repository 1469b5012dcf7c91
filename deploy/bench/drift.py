"""Drift control: how much of a variant's reward gain it also gets from a reward with no information.

    python -m diffrlhf.deploy.bench.study --suite weighting --reward jpeg_compressibility_shuffled \\
        --only uniform latent_sq ddim_std gaussian_early gaussian_mid --seeds 3 --epochs 15 --threads 2
    python -m diffrlhf.deploy.bench.drift [--study deploy/results/study] [--reward jpeg_compressibility]
        [--control jpeg_compressibility_shuffled] [--variants uniform latent_sq ... | --suite compute]

`jpeg_compressibility_shuffled` gives each image the compressibility of another image of its
batch: same rewards, same mean (so its logged reward is still the samples' mean compressibility),
but no information about the image it is credited to. Whatever an update rule gains on it is
drift: a change of the images that comes from the update rule itself, not from the reward. This
reads the study's saved runs of the same variants and seeds on the reward and on the control and
reports, per variant, seed by seed (the runs are paired: same seed, same first epoch):
gain = final smoothed reward - epoch 0 reward; drift = the same on the control; net = gain - drift.
Held-out: trained - untrained policy on the held-out prompts, and net = reward run - control run.
Writes drift_<reward>.md, .json and .png into the study folder; with --suite S (the variants of a
study suite, as labelled there), drift_<S>_<reward>.*.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from diffrlhf.deploy.bench.common import pyplot, write_json
from diffrlhf.deploy.bench.study import SCHEMES, SUITES, YLABEL, mean_se, run_path, seed_matrix, smooth


def gains(runs: list[dict]) -> dict[int, dict]:
    """Per seed: final smoothed reward - epoch 0 reward, and the held-out reward."""
    out = {}
    for r in runs:
        y = np.array([rec["reward_mean"] for rec in r["records"]])
        out[r["seed"]] = {"gain": float(smooth(y)[-1] - y[0]), "heldout": (r.get("eval") or {}).get("reward_mean")}
    return out


def drift_rows(real: dict[str, list[dict]], control: dict[str, list[dict]], untrained_heldout: float | None) -> list[dict]:
    """One row per variant: gain, drift and net (mean, s.e. over the seeds both have), paired by seed."""
    rows = []
    for label in real:
        g, d = gains(real[label]), gains(control.get(label, []))
        seeds = sorted(set(g) & set(d))
        if not seeds:
            rows.append({"variant": label, "seeds": []})
            continue
        row = {"variant": label, "seeds": seeds,
               "gain": mean_se([g[s]["gain"] for s in seeds]), "drift": mean_se([d[s]["gain"] for s in seeds]),
               "net": mean_se([g[s]["gain"] - d[s]["gain"] for s in seeds])}
        if all(g[s]["heldout"] is not None and d[s]["heldout"] is not None for s in seeds):
            row["heldout_net"] = mean_se([g[s]["heldout"] - d[s]["heldout"] for s in seeds])
            if untrained_heldout is not None:
                row["heldout_gain"] = mean_se([g[s]["heldout"] - untrained_heldout for s in seeds])
                row["heldout_drift"] = mean_se([d[s]["heldout"] - untrained_heldout for s in seeds])
        rows.append(row)
    return rows


def _signed_pm(v) -> str:
    if v is None:
        return "-"
    return f"{v[0]:+.3f}" if v[1] is None else f"{v[0]:+.3f} ± {v[1]:.3f}"


def table_markdown(reward: str, control: str, rows: list[dict]) -> str:
    lines = [f"### drift control: {reward} against {control}", "",
             "Mean ± s.e. over seeds, paired by seed. Training: final smoothed reward - epoch 0. "
             "Held-out: trained - untrained policy.", "",
             "| variant | seeds | gain (reward) | drift (control) | net | held-out gain | held-out drift | held-out net |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['variant']} | {len(r['seeds'])} | {_signed_pm(r.get('gain'))} | {_signed_pm(r.get('drift'))} | {_signed_pm(r.get('net'))} | "
                     f"{_signed_pm(r.get('heldout_gain'))} | {_signed_pm(r.get('heldout_drift'))} | {_signed_pm(r.get('heldout_net'))} |")
    return "\n".join(lines + [""])


def plot(real: dict, control: dict, path: Path, reward: str, control_name: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, rs in real.items():
        color = None
        for runs, style, tag in ((rs, "-", reward), (control.get(label, []), "--", control_name)):
            if not runs:
                continue
            q, y = seed_matrix(runs)
            line, = ax.plot(q, np.array([smooth(v) for v in y]).mean(0), style, color=color, label=f"{label}, {tag}")
            color = line.get_color()
    ax.set_xlabel("reward queries")
    ax.set_ylabel(YLABEL.get(reward, reward))
    ax.set_title("solid: the reward; dashed: the same runs with the reward shuffled (no information)\n"
                 "seed-mean of the 3-epoch trailing average", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def load_runs(study: Path, reward: str, variants: dict[str, tuple]) -> dict[str, list[dict]]:
    """variant label -> its saved runs (all seeds), from the label's study axes."""
    out = {}
    for label, axes in variants.items():
        files = sorted(run_path(study, reward, axes, 0).parent.glob("seed*.json"))
        out[label] = [json.loads(f.read_text()) for f in files]
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", type=Path, default=Path("deploy/results/study"))
    ap.add_argument("--reward", default="jpeg_compressibility")
    ap.add_argument("--control", default="jpeg_compressibility_shuffled")
    ap.add_argument("--variants", nargs="+", default=["uniform", "latent_sq", "ddim_std", "gaussian_early", "gaussian_mid"], choices=SCHEMES,
                    help="weighting schemes (no replay) run on both rewards")
    ap.add_argument("--suite", choices=sorted(SUITES), help="instead of --variants: every variant of this study suite")
    args = ap.parse_args(argv)
    variants = dict(SUITES[args.suite]) if args.suite else {v: (v, "none") for v in args.variants}
    real, control = load_runs(args.study, args.reward, variants), load_runs(args.study, args.control, variants)
    missing = [f"{rw}/{label}" for rw, runs in ((args.reward, real), (args.control, control)) for label, rs in runs.items() if not rs]
    if missing:
        raise SystemExit(f"no saved runs for {', '.join(missing)} under {args.study}/runs; run the study first (see --help)")
    base = args.study / "runs" / args.reward / "base_policy_eval.json"
    untrained = json.loads(base.read_text())["reward_mean"] if base.exists() else None
    rows = drift_rows(real, control, untrained)
    stem = args.study / (f"drift_{args.suite}_{args.reward}" if args.suite else f"drift_{args.reward}")
    write_json(stem.with_suffix(".json"), {"reward": args.reward, "control": args.control, "untrained_heldout": untrained, "rows": rows})
    stem.with_suffix(".md").write_text(table_markdown(args.reward, args.control, rows))
    plot(real, control, stem.with_suffix(".png"), args.reward, args.control)
    print(table_markdown(args.reward, args.control, rows))
    return rows


if __name__ == "__main__":
    main()
