"""Does a weighting's closeness to the measured per-step variance predict its gain? (issue 20)

    python -m research.bench.closeness --reward tinyworld_alignment --suite evidence
        [--study research/results/study] [--variance research/results/variance/variance_<reward>.json] [--threads 1]
        [the study's overrides, key.sub=value ...]

For each weighting variant of the suite (weights only: no replay, DDPO's steps) with runs on the
reward and on its shuffled control (`<reward>_shuffled`), two numbers:
- closeness: Pearson r of its w(t) profile with the measured sigma_t^2 of section 11 (the 64 x 8
  branching measurement of the untrained policy; `latent_sq` / `latent_abs` as measured there, on
  the recorded trajectories). For `oracle`, each run's own probe is recomputed: the round-0 probe
  measures the untrained policy with prompts and noise seeds fixed by the run seed, so
  actors/oracle.py local_probe (the function the run called) gives the profile that run trained
  with, and r is per seed;
- gain net of drift, per seed (drift.drift_rows: final smoothed reward - epoch 0, less the same
  on the control run of the same seed).
Then the rank correlation across variants (few points: read it as a direction, not a test), and for
`oracle` the correlation across its seeds (a probe that happened to measure better: more gain?).
Writes closeness_<reward>.md, .json and .png into the study folder.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from diffrlhf.actors import oracle
from diffrlhf.actors.settings import build_policy, reward_server, sampling_settings
from research.bench.common import log, pyplot, write_json
from research.bench.drift import signed_pm as _pm, drift_rows, load_runs
from research.bench.study import DDPO_STEPS, RUN_SIZES, SUITES, check_reusable, full_axes, make_config
from diffrlhf.policy.branching import pearson, spearman
from diffrlhf.policy.prompts import load_prompts


def weighting_variants(suite: str) -> dict[str, tuple]:
    """The suite's variants that differ from DDPO by their weighting only."""
    return {label: ax for label, ax in SUITES[suite].items()
            if full_axes(ax)[1] == "none" and tuple(full_axes(ax)[2:4]) == DDPO_STEPS and len(full_axes(ax)) == 4}


def config_of(run: dict, overrides: list[str] = ()):
    """The config a saved study run was made with (one of the study's sizes and these overrides), or stop."""
    for size in RUN_SIZES:
        cfg = make_config(size, run["reward"], run["config"]["train"]["epochs"], list(overrides), tuple(run["axes"]), run["seed"])
        try:
            check_reusable(Path(f"seed{run['seed']}"), run, cfg)
            return cfg
        except SystemExit:
            continue
    raise SystemExit(f"closeness: the {run['reward']} run {'+'.join(map(str, run['axes']))} seed {run['seed']} was made with "
                     "other config overrides than these (pass the study's overrides); its probe cannot be recomputed here")


def oracle_probe_profile(run: dict, overrides: list[str] = ()) -> np.ndarray:
    """The w(t) a finished `oracle` run trained with (its round-0 probe, recomputed; needs oracle_every = 0)."""
    c = run["config"]
    if c["weighting"]["oracle_every"]:
        raise SystemExit("closeness: this oracle run re-probed during training (weighting.oracle_every > 0); only its "
                         "first profile could be recomputed here")
    cfg = config_of(run, overrides)
    torch.manual_seed(cfg.run.seed)  # as the reference loop does before building the policy
    comps, learner = build_policy(cfg)
    profile, _, _ = oracle.local_probe(cfg, load_prompts(cfg.prompts.train), 0, comps, sampling_settings(cfg), learner.version,
                                       learner.negative_embeds, reward_server(cfg).score)
    return profile.numpy()


def analyse(real: dict, control: dict, variants: dict, variance: dict, oracle_profiles: dict[int, np.ndarray]) -> dict:
    steps = np.asarray(variance["analysis"]["step_shares"], np.float64)
    corr = variance["analysis"]["correlation"]
    rows = {r["variant"]: r for r in drift_rows(real, control, None)}
    out = []
    for label, ax in variants.items():
        row, scheme = rows.get(label, {}), full_axes(ax)[0]
        if not row.get("seeds"):
            continue
        item = {"variant": label, "scheme": scheme, "seeds": row["seeds"], "net": row["net"], "heldout_net": row.get("heldout_net"),
                "per_seed_net": {s: v["net"] for s, v in row["per_seed"].items()}}
        if scheme == "oracle":
            per_seed = {s: pearson(oracle_profiles[s], steps) for s in row["seeds"] if s in oracle_profiles}
            item["r_per_seed"] = per_seed
            item["r"] = float(np.mean(list(per_seed.values()))) if per_seed else None
        else:
            c = corr.get(scheme, {})
            item["r"], item["r_ci95"] = c.get("pearson"), c.get("pearson_ci95")
        out.append(item)
    ranked = [i for i in out if i["r"] is not None and np.isfinite(i["r"])]
    res = {"reward": variance["reward"], "rows": out,
           "across_variants": {"n": len(ranked), "spearman": spearman([i["r"] for i in ranked], [i["net"][0] for i in ranked])
                               if len(ranked) >= 3 else None, "pearson": pearson([i["r"] for i in ranked], [i["net"][0] for i in ranked])
                               if len(ranked) >= 3 else None}}
    orc = next((i for i in out if i["scheme"] == "oracle" and i.get("r_per_seed")), None)
    if orc and len(orc["r_per_seed"]) >= 3:
        s = sorted(orc["r_per_seed"])
        x, y = [orc["r_per_seed"][k] for k in s], [orc["per_seed_net"][k] for k in s]
        res["oracle_across_seeds"] = {"n": len(s), "pearson": pearson(x, y), "spearman": spearman(x, y)}
    return res


def table_markdown(res: dict) -> str:
    lines = [f"### closeness to the measured per-step variance, and gain: {res['reward']}", "",
             "r: Pearson correlation of the scheme's w(t) with the measured sigma_t^2 (64 x 8 branching, untrained policy; "
             "oracle: each run's own probe, recomputed, mean over seeds). Net gain: final smoothed reward - epoch 0, less the "
             "same on the shuffled-reward run of the same seed (mean ± s.e. over seeds).", "",
             "| variant | r with sigma_t^2 | seeds | net gain | held-out net |", "| --- | --- | --- | --- | --- |"]
    for i in res["rows"]:
        if i["r"] is None or not np.isfinite(i["r"]):
            r = "undefined (flat profile)"
        elif i.get("r_per_seed"):
            r = f"{i['r']:.2f} (per seed {' / '.join(f'{v:.2f}' for _, v in sorted(i['r_per_seed'].items()))})"
        else:
            r = f"{i['r']:.2f}" + (f" [{i['r_ci95'][0]:.2f}, {i['r_ci95'][1]:.2f}]" if i.get("r_ci95") else "")
        lines.append(f"| {i['variant']} | {r} | {len(i['seeds'])} | {_pm(i['net'])} | {_pm(i['heldout_net'])} |")
    a = res["across_variants"]
    lines += ["", f"Across the {a['n']} non-uniform variants: " + (
        f"Spearman {a['spearman']:+.2f}, Pearson {a['pearson']:+.2f} between r and net gain." if a["spearman"] is not None
        else "too few to correlate.")]
    if res.get("oracle_across_seeds"):
        o = res["oracle_across_seeds"]
        lines.append(f"`oracle` across its {o['n']} seeds (each its own probe): Pearson {o['pearson']:+.2f}, "
                     f"Spearman {o['spearman']:+.2f} between the probe's r and the seed's net gain.")
    return "\n".join(lines + [""])


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    flat = [i for i in res["rows"] if i["r"] is None or not np.isfinite(i["r"])]
    for i in res["rows"]:
        if i in flat:
            continue
        bar = ax.errorbar(i["r"], i["net"][0], yerr=i["net"][1] or 0, fmt="o", capsize=3, label=i["variant"])
        if i.get("r_per_seed"):  # in the mean's colour
            ax.scatter(list(i["r_per_seed"].values()), [i["per_seed_net"][s] for s in i["r_per_seed"]], s=14, marker="x",
                       color=bar[0].get_color(), label=f"{i['variant']}, per seed")
    for i in flat:  # uniform: no correlation to place it at; a line at its net gain
        ax.axhline(i["net"][0], color="grey", ls=":", lw=1)
        ax.text(ax.get_xlim()[0], i["net"][0], f" {i['variant']} (flat w, no r)", fontsize=7, va="bottom")
    ax.set_xlabel("Pearson r of w(t) with the measured sigma_t^2")
    ax.set_ylabel("net gain (reward - shuffled control)")
    ax.set_title(f"{res['reward']}: closeness to the measured variance vs gain net of drift\n(mean ± s.e. over seeds)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reward", required=True)
    ap.add_argument("--control", help="default: <reward>_shuffled")
    ap.add_argument("--suite", default="evidence", choices=sorted(SUITES))
    ap.add_argument("--study", type=Path, default=Path("research/results/study"))
    ap.add_argument("--variance", type=Path, help="default: research/results/variance/variance_<reward>.json")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--name", help="the result files' stem in the study folder (default closeness_<reward>); e.g. a second "
                                   "read against another --variance measurement")
    ap.add_argument("overrides", nargs="*", help="the study's config overrides (key.sub=value), to recompute oracle probes")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    variance_path = args.variance or Path("research/results/variance") / f"variance_{args.reward}.json"
    if not variance_path.exists():
        raise SystemExit(f"closeness: no variance measurement {variance_path}; run python -m research.bench.variance "
                         f"--reward {args.reward} first (or pass --variance)")
    variance = json.loads(variance_path.read_text())
    variants = weighting_variants(args.suite)
    real = load_runs(args.study, args.reward, variants)
    control = load_runs(args.study, args.control or f"{args.reward}_shuffled", variants)
    profiles = {}
    for label, ax in variants.items():
        if full_axes(ax)[0] == "oracle":
            for run in real[label]:
                log("closeness", f"recomputing the oracle probe of seed {run['seed']}")
                profiles[run["seed"]] = oracle_probe_profile(run, args.overrides)
    res = analyse(real, control, variants, variance, profiles)
    stem = args.study / (args.name or f"closeness_{args.reward}")
    write_json(stem.with_suffix(".json"), res)
    text = table_markdown(res)
    stem.with_suffix(".md").write_text(text)
    plot(res, stem.with_suffix(".png"))
    print(text)
    return res


if __name__ == "__main__":
    main()
