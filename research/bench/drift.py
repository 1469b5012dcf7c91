"""Drift control: how much of a variant's reward gain it also gets from a reward with no information.

    python -m research.bench.study --suite weighting --reward jpeg_compressibility_shuffled \\
        --only uniform latent_sq ddim_std gaussian_early gaussian_mid --seeds 3 --epochs 15 --threads 2
    python -m research.bench.drift [--study research/results/study] [--reward jpeg_compressibility]
        [--control jpeg_compressibility_shuffled] [--variants uniform latent_sq ... | --suite compute [--only ...]]

`jpeg_compressibility_shuffled` gives each image the compressibility of another image of its
batch: same rewards, same mean (so its logged reward is still the samples' mean compressibility),
but no information about the image it is credited to. Whatever an update rule gains on it is
drift: a change of the images that comes from the update rule itself, not from the reward. This
reads the study's saved runs of the same variants and seeds on the reward and on the control and
reports, per variant, seed by seed (the runs are paired: same seed, same first epoch):
gain = final smoothed reward - epoch 0 reward; drift = the same on the control; net = gain - drift.
Held-out: trained - untrained policy on the held-out prompts, and net = reward run - control run.
Then each variant against the first (the baseline), paired by seed: a paired t-test on the per-seed
differences of net gain (and of held-out net, and of the raw held-out reward, no control involved),
with its 95% confidence interval and p.
Writes drift_<reward>.md, .json and .png into the study folder; with --suite S (the variants of a
study suite, as labelled there), drift_<S>_<reward>.*.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from research.bench.common import paired_test, pyplot, write_json
from research.bench.study import SCHEMES, SUITES, YLABEL, cost_axes, cost_to_reach, mean_se, run_path, seed_matrix, smooth


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
        row["per_seed"] = {s: {"net": g[s]["gain"] - d[s]["gain"],
                               "heldout_net": (g[s]["heldout"] - d[s]["heldout"]) if g[s]["heldout"] is not None and d[s]["heldout"] is not None else None,
                               "heldout": g[s]["heldout"]}
                           for s in seeds}
        rows.append(row)
    compare_to_baseline(rows)
    return rows


def compare_to_baseline(rows: list[dict]) -> None:
    """Each variant's net gain against the first row's (the baseline), paired by seed: a paired
    t-test on the per-seed differences (row["vs_baseline"], and the same for held-out net)."""
    base = rows[0].get("per_seed", {}) if rows else {}
    for row in rows[1:]:
        mine = row.get("per_seed", {})
        seeds = sorted(set(mine) & set(base))
        row["vs_baseline"] = paired_test([mine[s]["net"] - base[s]["net"] for s in seeds])
        held = [s for s in seeds if mine[s]["heldout_net"] is not None and base[s]["heldout_net"] is not None]
        row["heldout_vs_baseline"] = paired_test([mine[s]["heldout_net"] - base[s]["heldout_net"] for s in held])
        # The trained policies' held-out rewards themselves, no control subtracted: "above the baseline's
        # same-seed run on held-out prompts" is read here, with nothing a control could move.
        raw = [s for s in seeds if mine[s]["heldout"] is not None and base[s]["heldout"] is not None]
        row["heldout_raw_vs_baseline"] = paired_test([mine[s]["heldout"] - base[s]["heldout"] for s in raw])


def net_curves(real: list[dict], control: list[dict]) -> tuple[list[dict], np.ndarray]:
    """The reward runs that have a control run of the same seed, and their net curves [seed, epoch]:
    reward - (control - control's epoch 0), i.e. each epoch's reward less the drift so far."""
    by_seed = {r["seed"]: r for r in control}
    runs = [r for r in sorted(real, key=lambda r: r["seed"]) if r["seed"] in by_seed]
    if not runs:
        return [], np.zeros((0, 0))
    n = min(min(len(r["records"]), len(by_seed[r["seed"]]["records"])) for r in runs)
    y = np.array([[x["reward_mean"] for x in r["records"][:n]] for r in runs])
    c = np.array([[x["reward_mean"] for x in by_seed[r["seed"]]["records"][:n]] for r in runs])
    return runs, y - (c - c[:, :1])


def net_cost_rows(real: dict[str, list[dict]], control: dict[str, list[dict]]) -> list[dict]:
    """Queries / learner passes / wall-clock to reach the baseline's (first variant's) final net
    reward, on the seed-mean net curves (study.cost_to_reach on net instead of raw rewards)."""
    labels = list(real)
    curves = {label: net_curves(real[label], control.get(label, [])) for label in labels}
    base_runs, base_y = curves[labels[0]]
    rows = []
    if not base_runs:
        return rows
    n_base = base_y.shape[1]
    for label in labels:
        runs, y = curves[label]
        if not runs:
            rows.append({"variant": label, "seeds": []})
            continue
        reach = cost_to_reach(cost_axes(base_runs, n_base), base_y.mean(0), cost_axes(runs, y.shape[1]), y.mean(0))
        rows.append({"variant": label, "seeds": [r["seed"] for r in runs], "final_net": float(smooth(y.mean(0))[-1]),
                     "target": float(smooth(base_y.mean(0))[-1]), "reach": reach})
    return rows


def net_cost_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    lines = ["", f"Cost to reach {rows[0]['variant']}'s final net reward (seed-mean net curve: each epoch's reward less its "
             "control's drift so far; trailing 3-epoch average), paired seeds only. First crossing, then \"held\": "
             "the variant's cost from the first epoch after which its curve stays at or above the target to the end, "
             "against the baseline's first crossing:", "",
             "| variant | seeds | final net (smoothed) | queries (ratio) | learner passes (ratio) | wall-clock s (ratio) "
             "| queries, held to the end (ratio) | learner passes, held (ratio) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if not r["seeds"]:
            lines.append(f"| {r['variant']} | 0 | - | - | - | - | - | - |")
            continue
        cells = []
        for axis in ("queries", "passes", "wall_s"):
            a = r["reach"].get(axis)
            if a is None:
                cells.append("no bar" if not r["reach"] else "-")
            elif a["variant"] is None:
                cells.append(f"not reached (< {a['ratio_upper_bound']:.2f}x)")
            else:
                cells.append(f"{a['variant']:.0f} ({a['ratio']:.2f}x)")
        for axis in ("queries", "passes"):
            a = r["reach"].get(axis)
            if a is None or "held_variant" not in a:
                cells.append("no bar" if not r["reach"] else "-")
            else:
                cells.append("not reached" if a["variant"] is None else "falls below by the end" if a["held_variant"] is None
                             else f"{a['held_variant']:.0f} ({a['held_ratio']:.2f}x)")
        lines.append(f"| {r['variant']} | {len(r['seeds'])} | {r['final_net']:+.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""])


def signed_pm(v) -> str:
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
        lines.append(f"| {r['variant']} | {len(r['seeds'])} | {signed_pm(r.get('gain'))} | {signed_pm(r.get('drift'))} | {signed_pm(r.get('net'))} | "
                     f"{signed_pm(r.get('heldout_gain'))} | {signed_pm(r.get('heldout_drift'))} | {signed_pm(r.get('heldout_net'))} |")
    if len(rows) > 1:
        lines += ["", f"Paired by seed against {rows[0]['variant']}: per seed, the variant's net gain minus the baseline's "
                  "(each net of its own shuffled-reward run); mean, 95% confidence interval (Student's t over seeds), "
                  "two-sided p of a paired t-test, and the seeds where the variant is ahead.", "",
                  f"| variant | seeds | net - {rows[0]['variant']} | 95% CI | p | seeds ahead | held-out net - {rows[0]['variant']} | 95% CI | p | seeds ahead |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows[1:]:
            a, h = r.get("vs_baseline") or {}, r.get("heldout_vs_baseline") or {}
            lines.append(f"| {r['variant']} | {a.get('n', 0)} | {_paired(a)} | {h.get('n', 0) and _paired(h)} |")
        if any((r.get("heldout_raw_vs_baseline") or {}).get("n") for r in rows[1:]):
            lines += ["", f"Held-out reward of the trained policy (raw, no control subtracted) against {rows[0]['variant']}'s "
                      "run of the same seed, paired by seed:", "",
                      f"| variant | seeds | held-out - {rows[0]['variant']} | 95% CI | p | seeds ahead |", "| --- | --- | --- | --- | --- | --- |"]
            for r in rows[1:]:
                t = r.get("heldout_raw_vs_baseline") or {}
                lines.append(f"| {r['variant']} | {t.get('n', 0)} | {_paired(t)} |")
    return "\n".join(lines + [""])


def _paired(t: dict) -> str:
    """mean | CI | p | seeds ahead, as four table cells."""
    if not t.get("n"):
        return "- | - | - | -"
    ci = f"[{t['ci95'][0]:+.3f}, {t['ci95'][1]:+.3f}]" if t.get("ci95") else "-"
    p = f"{t['p']:.3f}" if t.get("p") is not None else "-"
    return f"{t['mean']:+.3f} | {ci} | {p} | {t['above']}/{t['n']}"


def plot(real: dict, control: dict, path: Path, reward: str, control_name: str) -> None:
    plt = pyplot()
    many = len(real) > 5  # one legend entry per variant, outside the axes, so the curves stay visible
    fig, ax = plt.subplots(figsize=(9, 4.6) if many else (7, 4.2))
    # Past the default cycle's 10 colours two variants would share one: tab20's 10 hues, then their light shades.
    tab20 = plt.get_cmap("tab20").colors
    palette = [tab20[i] for i in (*range(0, 20, 2), *range(1, 20, 2))] if len(real) > 10 else None
    for i, (label, rs) in enumerate(real.items()):
        color = palette[i % len(palette)] if palette else None
        for runs, style, tag in ((rs, "-", reward), (control.get(label, []), "--", control_name)):
            if not runs:
                continue
            q, y = seed_matrix(runs)
            name = f"{label}, {tag}" if not many else (label if style == "-" else None)
            line, = ax.plot(q, np.array([smooth(v) for v in y]).mean(0), style, color=color, label=name)
            color = line.get_color()
    ax.set_xlabel("reward queries")
    ax.set_ylabel(YLABEL.get(reward, reward))
    ax.set_title("solid: the reward; dashed: the same runs with the reward shuffled (no information)\n"
                 "seed-mean of the 3-epoch trailing average", fontsize=8)
    if many:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="solid: reward, dashed: control", title_fontsize=7)
    else:
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
    ap.add_argument("--study", type=Path, default=Path("research/results/study"))
    ap.add_argument("--reward", default="jpeg_compressibility")
    ap.add_argument("--control", default="jpeg_compressibility_shuffled")
    ap.add_argument("--variants", nargs="+", default=["uniform", "latent_sq", "ddim_std", "gaussian_early", "gaussian_mid"], choices=SCHEMES,
                    help="weighting schemes (no replay) run on both rewards")
    ap.add_argument("--suite", choices=sorted(SUITES), help="instead of --variants: every variant of this study suite")
    ap.add_argument("--only", nargs="+", metavar="VARIANT", help="with --suite: only these of its variants (the suite's "
                    "baseline stays first: the paired tests are against it)")
    ap.add_argument("--baseline", metavar="VARIANT", help="pair the others against this variant instead of the first "
                    "(e.g. ddim_std, to ask whether hard-mining adds to it); the files get _vs_<variant>")
    args = ap.parse_args(argv)
    variants = dict(SUITES[args.suite]) if args.suite else {v: (v, "none") for v in args.variants}
    if args.only:
        if not args.suite:
            ap.error("--only needs --suite")
        unknown = sorted(set(args.only) - set(variants))
        if unknown:
            ap.error(f"--only: {', '.join(unknown)} not in suite {args.suite}; its variants: {', '.join(variants)}")
        first = next(iter(variants))
        variants = {k: v for k, v in variants.items() if k == first or k in args.only}
    if args.baseline:
        if args.baseline not in variants:
            ap.error(f"--baseline: {args.baseline} is not among the variants ({', '.join(variants)})")
        variants = {args.baseline: variants[args.baseline], **{k: v for k, v in variants.items() if k != args.baseline}}
    real, control = load_runs(args.study, args.reward, variants), load_runs(args.study, args.control, variants)
    missing = [f"{rw}/{label}" for rw, runs in ((args.reward, real), (args.control, control)) for label, rs in runs.items() if not rs]
    if missing:
        raise SystemExit(f"no saved runs for {', '.join(missing)} under {args.study}/runs; run the study first (see --help)")
    base = args.study / "runs" / args.reward / "base_policy_eval.json"
    untrained = json.loads(base.read_text())["reward_mean"] if base.exists() else None
    rows = drift_rows(real, control, untrained)
    reach = net_cost_rows(real, control)
    stem = args.study / (f"drift_{args.suite}_{args.reward}" if args.suite else f"drift_{args.reward}")
    if args.baseline:
        stem = stem.with_name(f"{stem.name}_vs_{re.sub(r'[^A-Za-z0-9]+', '_', args.baseline)}")  # no dots: the suffix stays .md
    write_json(stem.with_suffix(".json"), {"reward": args.reward, "control": args.control, "untrained_heldout": untrained, "rows": rows,
                                           "net_cost_to_reach": reach})
    text = table_markdown(args.reward, args.control, rows) + net_cost_markdown(reach)
    stem.with_suffix(".md").write_text(text)
    plot(real, control, stem.with_suffix(".png"), args.reward, args.control)
    print(text)
    return rows


if __name__ == "__main__":
    main()
