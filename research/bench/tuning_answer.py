"""The answer to issue 59, computed as its plan says (research/bench/tuning.py::PLAN), from the
confirmatory run files: every variant at its chosen setting against tuned DDPO, per reward.

    python -m research.bench.tuning_answer [--out research/results/tuning] [--resamples 10000]

Per reward and method, from the confirm seeds' runs and their shuffled-reward controls (same seed,
same setting): the net curve of each seed, reward - (control - control's epoch 0) (drift.net_curves).

- Primary: reward queries to reach the target, target = half of tuned DDPO's mean net gain at the
  full budget (net gain: the net curve's final 3-epoch trailing mean - its epoch 0). Each method's
  seed-mean net curve, less its epoch 0, 3-epoch trailing mean: the first epoch from which it stays at
  or above the target to the end; queries = the cumulative reward queries there. Ratio = DDPO's
  queries / the variant's. Interval: 10,000 paired seed-bootstrap resamples (the same resampled seeds
  for both), percentile 95%; a resample where DDPO's net gain is not positive, or the variant never
  stays above the target, has no ratio and is counted.
- Secondary: area under the net curve (mean net reward over the epochs) and the final net gain, each
  a paired difference against DDPO with its 95% t interval; the raw held-out reward, paired.
- Test: the paired t-test of the AUC difference, two-sided; Holm across the plan's 6 comparisons at
  family-wise 0.05 (while some wait for their runs, each counts as p = 1: never less correction).
A cell whose confirmatory runs are not all there is listed as waiting, and no comparison uses it.
Writes <out>/answer.md, <out>/answer.json and <out>/answer_curves.png (the net curves per reward).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from research.bench import tuning
from research.bench.common import RESULTS_DIR, paired_test, pyplot, write_report
from research.bench.study import SMOOTH_WINDOW, smooth

ALPHA = 0.05


def holm(pvalues: list[float], family: int | None = None) -> list[float]:
    """Holm's step-down adjusted p-values, in the input's order: the i-th smallest p times (m - i),
    made monotone and capped at 1. m = family (the planned comparisons) when some are not there yet:
    a missing one counts as p = 1, so a partial table is never corrected less than the whole."""
    m = len(pvalues) if family is None else family
    if m < len(pvalues):
        raise ValueError(f"holm: {len(pvalues)} p-values for a family of {m}")
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def family_size() -> int:
    """The plan's comparisons: every variant but DDPO, on every reward (6)."""
    return len(tuning.PLAN["rewards"]) * (len(tuning.PLAN["variants"]) - 1)


def held_from(curve: np.ndarray, target: float) -> int | None:
    """The first index from which curve stays >= target to the end, or None."""
    below = np.nonzero(curve < target)[0]
    if not len(below):
        return 0
    first = int(below[-1]) + 1
    return first if first < len(curve) else None


def net_gains(net: np.ndarray) -> np.ndarray:
    """Per seed: the net curve's final 3-epoch trailing mean less its epoch 0."""
    return np.array([smooth(row, SMOOTH_WINDOW)[-1] - row[0] for row in net])


def queries_to_target(net: np.ndarray, queries: np.ndarray, target: float) -> int | None:
    """The queries at which the smoothed seed-mean net curve reaches `target` and stays; None if never."""
    curve = smooth(mean_net_curve(net)[0], SMOOTH_WINDOW)
    i = held_from(curve, target)
    return None if i is None else int(queries[i])


def primary(base: np.ndarray, var: np.ndarray, queries: np.ndarray, resamples: int, seed: int = 0) -> dict:
    """The plan's primary measure on net curves [seed, epoch] paired by row (the same seeds)."""
    def ratio(b, v):
        target = 0.5 * float(net_gains(b).mean())
        if target <= 0:
            return None, (None, None), target
        qb, qv = queries_to_target(b, queries, target), queries_to_target(v, queries, target)
        return (qb / qv if qb and qv else None), (qb, qv), target

    point, (qb, qv), target = ratio(base, var)
    rng = np.random.default_rng(seed)
    n, values, missing = base.shape[0], [], 0
    for _ in range(resamples):
        idx = rng.integers(0, n, n)
        r, _, _ = ratio(base[idx], var[idx])
        if r is None:
            missing += 1
        else:
            values.append(r)
    ci = [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))] if values else None
    return {"target": target, "ddpo_queries": qb, "variant_queries": qv, "ratio": point, "ci95": ci,
            "resamples": resamples, "resamples_without_ratio": missing,
            "note": None if point is not None else ("DDPO's mean net gain is not positive: no target" if target <= 0
                                                    else "the variant never stays at or above the target")}


def cell_runs(out: Path, reward: str, variant: str) -> tuple[list[dict], list[dict]] | None:
    """The chosen setting's confirmatory runs and controls of one cell, or None while any is missing."""
    jobs, waiting = tuning.confirm_jobs(out, [reward], [variant])
    if waiting or not jobs or not all(tuning.job_path(out, j).exists() for j in jobs):
        return None
    runs = [json.loads(tuning.job_path(out, j).read_text()) for j in jobs]
    real = [r for j, r in zip(jobs, runs) if not j["reward"].endswith("_shuffled")]
    control = [r for j, r in zip(jobs, runs) if j["reward"].endswith("_shuffled")]
    return real, control


def mean_net_curve(net: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The seed-mean net curve less its epoch 0 (what the primary measure reads, before smoothing) and
    its standard error over the seeds at each epoch."""
    rows = net - net[:, :1]
    se = rows.std(axis=0, ddof=1) / np.sqrt(len(rows)) if len(rows) > 1 else np.zeros(rows.shape[1])
    return rows.mean(axis=0), se


def answer(out: Path, resamples: int = 10_000, curves: dict | None = None) -> dict:
    """The plan's comparisons; `curves`, when given, gets {reward: {variant: (queries, net)}} of every
    complete cell (for the picture)."""
    from research.bench.drift import net_curves

    comparisons, waiting = [], []
    curves = {} if curves is None else curves
    for reward in tuning.PLAN["rewards"]:
        base = cell_runs(out, reward, "ddpo")
        if base is None:
            waiting.append(f"{reward} / ddpo")
        for variant in [v for v in tuning.PLAN["variants"] if v != "ddpo"]:
            var = cell_runs(out, reward, variant)
            if var is None:
                waiting.append(f"{reward} / {variant}")
            if base is None or var is None:
                continue
            (b_runs, b_net), (v_runs, v_net) = net_curves(*base), net_curves(*var)
            assert [r["seed"] for r in b_runs] == [r["seed"] for r in v_runs], "confirm seeds differ between the two cells"
            n = min(b_net.shape[1], v_net.shape[1])
            b_net, v_net = b_net[:, :n], v_net[:, :n]
            queries = np.array([rec["reward_queries"] for rec in b_runs[0]["records"][:n]])
            curves.setdefault(reward, {"ddpo": (queries, b_net)})[variant] = (queries, v_net)
            heldout = [(v.get("eval") or {}).get("reward_mean", np.nan) - (b.get("eval") or {}).get("reward_mean", np.nan)
                       for b, v in zip(b_runs, v_runs)]
            comparisons.append({
                "reward": reward, "variant": variant, "seeds": [r["seed"] for r in b_runs],
                "primary": primary(b_net, v_net, queries, resamples),
                "auc": paired_test(v_net.mean(axis=1) - b_net.mean(axis=1)),
                "net_gain": paired_test(net_gains(v_net) - net_gains(b_net)),
                "heldout": paired_test([h for h in heldout if np.isfinite(h)]),
            })
    for c, p in zip(comparisons, holm([c["auc"]["p"] for c in comparisons], family_size())):
        c["holm_p"] = p
        c["survives"] = bool(p < ALPHA and c["auc"]["mean"] > 0)
    return {"plan_digest": tuning.plan_digest(), "comparisons": comparisons, "waiting": waiting, "alpha": ALPHA}


def markdown(res: dict) -> str:
    def iv(x):
        return "-" if not x else f"[{x[0]:+.3f}, {x[1]:+.3f}]"

    lines = [f"Against tuned DDPO (plan `{res['plan_digest']}`): confirm seeds, net of each seed's shuffled-reward control.", "",
             "| reward | variant | queries to target (DDPO / variant) | ratio [95% bootstrap] | AUC diff [95% t] | "
             "net gain diff [95% t] | held-out diff | p (AUC) | Holm p | survives |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in res["comparisons"]:
        p = c["primary"]
        ratio = (f"{p['ratio']:.2f} [{p['ci95'][0]:.2f}, {p['ci95'][1]:.2f}]" if p["ratio"] is not None and p["ci95"]
                 else (p["note"] or "-"))
        lines.append(f"| {c['reward']} | {c['variant']} | {p['ddpo_queries']} / {p['variant_queries']} | {ratio} | "
                     f"{c['auc']['mean']:+.3f} {iv(c['auc']['ci95'])} | {c['net_gain']['mean']:+.3f} {iv(c['net_gain']['ci95'])} | "
                     f"{c['heldout']['mean']:+.3f} | {c['auc']['p']:.3g} | {c['holm_p']:.3g} | {'yes' if c['survives'] else 'no'} |")
    if res["waiting"]:
        lines += ["", "Waiting for their confirmatory runs: " + ", ".join(res["waiting"]) + "."]
    return "\n".join(lines) + "\n"


def answer_picture(res: dict, curves: dict, path: Path) -> None:
    """Per reward: each method's seed-mean net curve (less its epoch 0) against reward queries, with a
    ±1 s.e. band over the confirm seeds, and the primary measure's target (half of tuned DDPO's mean net
    gain) dashed."""
    plt = pyplot()
    rewards = list(curves)
    fig, axs = plt.subplots(1, max(1, len(rewards)), figsize=(6.5 * max(1, len(rewards)), 4.3), squeeze=False)
    for ax, reward in zip(axs[0], rewards):
        for variant, (queries, net) in curves[reward].items():
            mean, se = mean_net_curve(net)
            (line,) = ax.plot(queries, mean, label=variant, linewidth=2.2 if variant == "ddpo" else 1.4)
            ax.fill_between(queries, mean - se, mean + se, color=line.get_color(), alpha=0.15)
        target = next(c["primary"]["target"] for c in res["comparisons"] if c["reward"] == reward)
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label="target: half of tuned DDPO's net gain")
        ax.set_xlabel("reward queries")
        ax.set_ylabel("net reward - epoch 0 (seed mean ± s.e.)")
        ax.set_title(f"{reward}: each method at its tuned setting, confirm seeds", fontsize=9)
        ax.legend(fontsize=7)
    if not rewards:
        axs[0][0].text(0.5, 0.5, "no complete comparison yet", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m research.bench.tuning_answer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS_DIR / "tuning"))
    ap.add_argument("--resamples", type=int, default=10_000)
    a = ap.parse_args(argv)
    curves: dict = {}
    res = answer(Path(a.out), a.resamples, curves)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    answer_picture(res, curves, Path(a.out) / "answer_curves.png")
    return write_report(Path(a.out), "answer", res, markdown(res))


if __name__ == "__main__":
    main()
