"""The answer to issue 60, computed as its plan says (research/bench/recast_study.py::PLAN), from the
study's run files: does ReCAST move the two-reward front outward against the weighted sum?

    python -m research.bench.recast_answer [--out research/results/recast_study]

Per method, lambda and seed, each reward's net training gain at equal total reward queries: every
run's curve of that reward (its term of the weighted sum) is read at its last epoch whose reward
queries, the probe's included, are at most the weighted sum's total at the end (same lambda and
seed); gain = the mean of the 3 epochs ending there less epoch 0; net = the real run's gain less its
shuffled-reward control's (same method, lambda and seed, read the same way).

- Comparisons (12 when complete): each ReCAST mode against the weighted sum at the same lambda, per
  reward: the paired difference of net gains over the seeds, its 95% t interval and the two-sided
  paired t-test; Holm across the plan's 12 comparisons at family-wise 0.05 (one still waiting
  for its runs counts as p = 1).
- The front moves outward at a lambda (per mode) if ReCAST is above on one reward (Holm) and not
  below on the other (that difference's 95% interval reaches 0 or above).
- Also: each reward's held-out mean, net of the control's, paired against the weighted sum (at each
  run's end: ReCAST has then spent its probe's queries too); the probe's share of ReCAST's queries.
- Pictures: the Pareto picture (net gain of reward 1 against reward 2, per method and lambda, seed
  95% intervals) and, per lambda, the first probe's W and gains (means over the ReCAST runs).
A cell (method, lambda) whose runs are not all there is listed as waiting; no comparison uses it.
Writes <out>/answer.md, answer.json, pareto.png and recast_weights_lambda<l>.png.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from research.bench import recast_study as rs
from research.bench.common import RESULTS_DIR, paired_test, pyplot, write_report
from research.bench.tuning_answer import holm

ALPHA, WINDOW = 0.05, 3  # family-wise level; epochs in the gain's trailing mean
BASE = "weighted_sum"
MODES = [m for m in rs.PLAN["methods"] if m != BASE]


def read_at(records: list[dict], budget: int) -> int:
    """The index of the last epoch whose reward queries (cumulative, the probe's included) are at most budget."""
    within = [i for i, r in enumerate(records) if r["reward_queries"] <= budget]
    if not within:
        raise ValueError(f"no epoch within {budget} reward queries (the first has {records[0]['reward_queries']})")
    return within[-1]


def gain(records: list[dict], term: str, at: int) -> float:
    """The term's mean reward over the WINDOW epochs ending at index `at`, less epoch 0's."""
    curve = [r[f"reward_mean/{term}"] for r in records]
    return float(np.mean(curve[max(0, at - WINDOW + 1):at + 1]) - curve[0])


def terms(control: bool) -> list[str]:
    return [rs.PLAN["controls"][r] if control else r for r in rs.PLAN["rewards"]]


def load(out: Path, method: str, weight: float, seed: int) -> tuple[dict, dict] | None:
    """(real, control) run files of one method, lambda and seed, or None while either is missing."""
    paths = [rs.run_path(out, {"method": method, "weight": weight, "seed": seed, "control": c}) for c in (False, True)]
    if not all(p.exists() for p in paths):
        return None
    return tuple(json.loads(p.read_text()) for p in paths)


def net_gains(real: dict, control: dict, budget: int) -> list[float]:
    """Each reward's net gain of one run pair, both read at `budget` queries."""
    at_r, at_c = read_at(real["records"], budget), read_at(control["records"], budget)
    return [gain(real["records"], t, at_r) - gain(control["records"], c, at_c) for t, c in zip(terms(False), terms(True))]


def heldout_net(real: dict, control: dict) -> list[float]:
    return [a - b for a, b in zip(real["eval"]["term_means"], control["eval"]["term_means"])]


def answer(out: Path) -> dict:
    seeds, rewards = rs.PLAN["seeds"], rs.PLAN["rewards"]
    cells, waiting, comparisons = {}, [], []
    for weight in rs.PLAN["weights_on_first"]:
        runs = {m: [load(out, m, weight, s) for s in seeds] for m in rs.PLAN["methods"]}
        if any(r is None for r in runs[BASE]):
            waiting += [f"{m} / lambda {weight:g}" for m in rs.PLAN["methods"]]
            continue
        budgets = [base[0]["records"][-1]["reward_queries"] for base in runs[BASE]]
        for m in rs.PLAN["methods"]:
            if any(r is None for r in runs[m]):
                waiting.append(f"{m} / lambda {weight:g}")
                continue
            net = np.array([net_gains(real, control, b) for (real, control), b in zip(runs[m], budgets)])  # seeds x rewards
            held = np.array([heldout_net(real, control) for real, control in runs[m]])
            probe = [real["records"][0]["reward_queries"] - base[0]["records"][0]["reward_queries"]
                     for (real, _), base in zip(runs[m], runs[BASE])]
            cells[(m, weight)] = {"net": net, "held": held, "probe_queries": probe,
                                  "total_queries": [real["records"][-1]["reward_queries"] for real, _ in runs[m]],
                                  "probes": [real.get("recast_probes") or [] for real, _ in runs[m]]}
    for m in MODES:
        for weight in rs.PLAN["weights_on_first"]:
            if (m, weight) not in cells or (BASE, weight) not in cells:
                continue
            for i, reward in enumerate(rewards):
                d = cells[(m, weight)]["net"][:, i] - cells[(BASE, weight)]["net"][:, i]
                dh = cells[(m, weight)]["held"][:, i] - cells[(BASE, weight)]["held"][:, i]
                comparisons.append({"mode": m, "weight": weight, "reward": reward, "net_gain": paired_test(d),
                                    "heldout": paired_test(dh)})
    family = len(MODES) * len(rs.PLAN["weights_on_first"]) * len(rewards)  # the plan's 12, whether all are there or not
    for c, p in zip(comparisons, holm([c["net_gain"]["p"] for c in comparisons], family)):
        c["p_holm"] = p
        c["above"] = p < ALPHA and c["net_gain"]["mean"] > 0
    fronts = []
    for m in MODES:
        for weight in rs.PLAN["weights_on_first"]:
            pair = [c for c in comparisons if c["mode"] == m and c["weight"] == weight]
            if len(pair) == 2:
                moved = any(a["above"] and b["net_gain"]["ci95"][1] >= 0 for a, b in (pair, pair[::-1]))
                fronts.append({"mode": m, "weight": weight, "moves_outward": moved})
    return {"plan_digest": rs.plan_digest(), "waiting": waiting, "comparisons": comparisons, "fronts": fronts,
            "cells": {f"{m} / lambda {w:g}": {"net_mean": c["net"].mean(0).tolist(), "net_ci95_halfwidth": _half(c["net"]),
                                               "heldout_net_mean": c["held"].mean(0).tolist(),
                                               "probe_share": float(np.mean(c["probe_queries"]) / np.mean(c["total_queries"]))}
                      for (m, w), c in cells.items()},
            "_cells": cells}


def _half(x: np.ndarray) -> list[float]:
    return [paired_test(col)["ci95"][1] - paired_test(col)["mean"] for col in x.T]


def pictures(res: dict, out: Path) -> list[Path]:
    """The Pareto picture and, per lambda, the mean first-probe W and gains of the ReCAST runs."""
    from diffrlhf.deploy.runlog import save_recast_picture

    cells, paths = res["_cells"], []
    if not cells:
        return paths
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 5))
    for m, marker in zip(rs.PLAN["methods"], "osD"):
        pts = [(w, c) for (mm, w), c in sorted(cells.items(), key=lambda kv: kv[0][1]) if mm == m]
        if not pts:
            continue
        xs, ys = [c["net"][:, 0].mean() for _, c in pts], [c["net"][:, 1].mean() for _, c in pts]
        xe, ye = zip(*[_half(c["net"]) for _, c in pts])
        ax.errorbar(xs, ys, xerr=xe, yerr=ye, marker=marker, capsize=3, label=m)
        for (w, _), x, y in zip(pts, xs, ys):
            ax.annotate(f"{w:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel(f"net gain: {rs.PLAN['rewards'][0]}")
    ax.set_ylabel(f"net gain: {rs.PLAN['rewards'][1]}")
    ax.set_title("each method at equal reward queries (lambda beside each point; seed 95% intervals)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "pareto.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    for weight in rs.PLAN["weights_on_first"]:
        first = [p[0] for m in MODES for p in cells.get((m, weight), {}).get("probes", []) if p]
        if first:
            mean = {"round": 0, "term_names": first[0]["term_names"], "weights": np.mean([p["weights"] for p in first], axis=0),
                    "gains": np.mean([p["gains"] for p in first], axis=0)}
            paths.append(save_recast_picture(mean, out / f"recast_weights_lambda{weight:g}.png"))
    return paths


def markdown(res: dict) -> str:
    def ci(t):
        return "n/a" if t["ci95"] is None else f"{t['mean']:+.4f} [{t['ci95'][0]:+.4f}, {t['ci95'][1]:+.4f}]"

    lines = [f"Plan digest `{res['plan_digest']}`. Net gain at equal reward queries: ReCAST mode - weighted sum, "
             "paired over the seeds (95% t interval); p two-sided, Holm across the plan's 12 (a waiting one as p = 1).", "",
             "| mode | lambda | reward | net gain difference | p | p (Holm) | above | held-out difference |", "|---|---|---|---|---|---|---|---|"]
    for c in res["comparisons"]:
        p = c["net_gain"]["p"]
        lines.append(f"| {c['mode']} | {c['weight']:g} | {c['reward']} | {ci(c['net_gain'])} | "
                     f"{'n/a' if p is None else f'{p:.3g}'} | {c['p_holm']:.3g} | {'yes' if c['above'] else 'no'} | {ci(c['heldout'])} |")
    lines += ["", "| mode | lambda | front moves outward |", "|---|---|---|"]
    lines += [f"| {f['mode']} | {f['weight']:g} | {'yes' if f['moves_outward'] else 'no'} |" for f in res["fronts"]]
    lines += ["", f"Waiting (runs missing): {', '.join(res['waiting']) or 'none'}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m research.bench.recast_answer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS_DIR / "recast_study"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    res = answer(out)
    pictures(res, out)
    res.pop("_cells")
    return write_report(out, "answer", res, markdown(res))


if __name__ == "__main__":
    main()
