"""Against a tuned DDPO (issue 59): every variant tuned over the same grid on its own seeds, then
confirmed at its best setting on fresh seeds beside shuffled-reward controls.

    python -m research.bench.tuning plan                       # the pre-registered plan, as RESULTS quotes it
    python -m research.bench.tuning status [--stage tune]      # done / left per reward and variant, CPU time left
    python -m research.bench.tuning run --stage tune [--reward R ...] [--variant V ...] [--jobs 2] [--max-runs N]
    python -m research.bench.tuning run --stage confirm [...]  # the chosen settings on the confirm seeds, with controls
    python -m research.bench.tuning report                     # the tuning table (and each variant's chosen setting)

PLAN is the plan: written and committed before any confirmatory run, never edited after (its
digest is printed by `plan` and quoted in RESULTS). Each run is the study's single-process
reference loop (research/bench/study.py), saved the moment it finishes to
<out>/<stage>/<setting>/runs/<reward>/<scheme>__<replay>/seed<k>.json and reused when it exists
(the study checks that the saved config is this one), so a chunk can be stopped and resumed.
`--jobs 2` runs two runs at a time, each a process with one torch thread.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing
import time
from pathlib import Path

import numpy as np

from research.bench.common import RESULTS_DIR, log, pyplot, write_json

# The plan. Rewards, variants, the grid and the seeds are fixed here before the runs; the
# confirmatory seeds are used by nothing else.
PLAN = {
    "rewards": ["jpeg_compressibility", "tinyworld_alignment"],
    "epochs": 30,  # 32 samples an epoch: 960 reward queries per run
    "eval_samples": 32,  # held-out images per run (prompts.eval, fixed noise; not training queries)
    # variant -> (weighting.scheme, replay.mode); "ddpo" is the baseline every comparison is against
    "variants": {"ddpo": ["uniform", "none"], "ddim_std": ["ddim_std", "none"], "latent_sq": ["latent_sq", "none"],
                 "hardmine": ["uniform", "hardmine"]},
    # The same grid, so the same tuning budget, for every variant: learning rate x PPO clip range,
    # a factor of 3 either side of the tiny preset's 0.01 / 0.01.
    "grid": {"train.lr": [0.003, 0.01, 0.03], "train.clip_range": [0.003, 0.01, 0.03]},
    "tuning_seeds": [100, 101, 102],
    "confirm_seeds": [200, 201, 202, 203, 204],
    # Tuning picks, per reward and variant, the setting with the highest mean gain over the tuning
    # seeds (gain = final 3-epoch trailing mean - epoch 0 mean, on the training reward; the study's
    # definition). Ties: the smaller lr, then the smaller clip range.
    "selection": "highest mean training gain over the tuning seeds",
    # Confirmatory runs: each variant at its chosen setting, on the confirm seeds, each seed beside
    # its shuffled-reward control run (research/controls.py) at the same setting. net = gain - the
    # same seed's control gain. The comparisons are every non-baseline variant against tuned DDPO,
    # per reward (6), paired by seed.
    "primary": ("reward queries to reach the target, target = half of tuned DDPO's mean net gain at the full "
                "budget (on the seed-mean net curve, 3-epoch trailing mean; first epoch from which it stays at "
                "or above the target to the end); ratio = DDPO's queries / the variant's, with a seed-bootstrap "
                "95% interval (10,000 resamples of the confirm seeds, paired)"),
    "secondary": ["area under the net curve (mean net reward over the 30 epochs), paired difference against DDPO with its 95% t interval",
                  "final net gain, paired difference against DDPO",
                  "raw held-out reward, paired difference against DDPO"],
    # The hypothesis test behind each comparison (the ratio above is its effect size, with its interval):
    "test": "paired t-test over the confirm seeds of the AUC difference (variant - DDPO), two-sided",
    "correction": "Holm across the 6 comparisons (3 variants x 2 rewards) at family-wise 0.05",
    "report": "only comparisons that survive Holm are stated as findings in README, presets and RESULTS' summary",
    # Amendment 1 (2026-12-06, after 155 of 216 tuning runs, before any confirmatory run): the first
    # complete cell (ddpo on JPEG) chose a setting at the grid's edge in both keys, so a better DDPO
    # may lie outside the grid. The same rule for every cell, applied once:
    "edge_rule": ("where a cell's best setting on the grid (all tuning seeds done) lies at a key's smallest or "
                  "largest value, that cell's grid is extended one factor-3 step beyond that edge, crossed with "
                  "the other key's grid values (and the corner when both keys are at an edge), on the same tuning "
                  "seeds; the choice is then made over the grid and its extension"),
}


def plan_digest() -> str:
    return hashlib.sha256(json.dumps(PLAN, sort_keys=True).encode()).hexdigest()[:16]


def settings() -> list[dict]:
    """The grid's settings, in a fixed order (each a dict of override key -> value)."""
    keys = sorted(PLAN["grid"])
    return [dict(zip(keys, values)) for values in itertools.product(*(PLAN["grid"][k] for k in keys))]


def edge_extension(best: dict) -> list[dict]:
    """PLAN['edge_rule'] for a cell whose best grid setting is `best`: the settings one factor-3 step
    beyond each key at its grid's edge, crossed with the other key's grid values, and the corner when
    both are at an edge (none when the best is inside the grid in every key)."""
    grid, beyond = PLAN["grid"], {}
    for k, v in best.items():
        if v == min(grid[k]):
            beyond[k] = round(v / 3, 6)
        elif v == max(grid[k]):
            beyond[k] = round(v * 3, 6)
    out = []
    for k, v in beyond.items():
        (other,) = [j for j in grid if j != k]
        out += [{k: v, other: w} for w in grid[other]]
    if len(beyond) == 2:
        out.append(dict(beyond))
    return [dict(sorted(s.items())) for s in out]


def setting_tag(setting: dict) -> str:
    return "_".join(f"{k.split('.')[-1]}{v:g}" for k, v in sorted(setting.items()))


def overrides_of(setting: dict) -> list[str]:
    return [f"{k}={v:g}" for k, v in sorted(setting.items())]


def tuning_jobs(rewards=None, variants=None, out: Path | None = None) -> list[dict]:
    """Every tuning run, seed-major (all settings and variants of the first seed first), so a partial
    chunk still covers every cell once before any cell twice; then, given the results folder `out`,
    the edge extensions (PLAN['edge_rule']) of the cells whose grid is complete."""
    jobs = []
    for seed in PLAN["tuning_seeds"]:
        for reward in rewards or PLAN["rewards"]:
            for variant in variants or PLAN["variants"]:
                for s in settings():
                    jobs.append({"stage": "tune", "reward": reward, "variant": variant, "setting": s, "seed": seed})
    if out is not None:
        table = tuning_table(out)
        for seed in PLAN["tuning_seeds"]:
            for reward in rewards or PLAN["rewards"]:
                for variant in variants or PLAN["variants"]:
                    for s in table[f"{reward} / {variant}"]["extension"]:
                        jobs.append({"stage": "tune", "reward": reward, "variant": variant, "setting": s, "seed": seed})
    return jobs


def confirm_jobs(out: Path, rewards=None, variants=None) -> tuple[list[dict], list[str]]:
    """The confirmatory runs (PLAN): each variant at the setting tuning chose for it, on every confirm
    seed, each beside its shuffled-reward control at the same setting; seed-major like tuning. Also
    the reward / variant cells whose tuning is not complete (no confirmatory run for them yet)."""
    table = tuning_table(out)
    jobs, waiting = [], []
    for seed in PLAN["confirm_seeds"]:
        for reward in rewards or PLAN["rewards"]:
            for variant in variants or PLAN["variants"]:
                cell = table[f"{reward} / {variant}"]
                if cell["chosen"] is None:
                    if seed == PLAN["confirm_seeds"][0]:
                        waiting.append(f"{reward} / {variant}")
                    continue
                setting = next(r["setting"] for r in cell["rows"] if r["tag"] == cell["chosen"])
                for scored in (reward, f"{reward}_shuffled"):  # the run, then its drift control
                    jobs.append({"stage": "confirm", "reward": scored, "variant": variant, "setting": setting, "seed": seed})
    return jobs, waiting


def job_path(out: Path, job: dict) -> Path:
    from research.bench.study import run_path

    return run_path(out / job["stage"] / setting_tag(job["setting"]), job["reward"], tuple(PLAN["variants"][job["variant"]]), job["seed"])


# Background runs yield the CPU to interactive work (tests, builds): Ray's own workers run at nice 15,
# so a study at nice 0 would starve a test suite's actors on a shared machine.
NICE = 19


def run_job(out: Path, job: dict, threads: int = 1, nice: int = NICE) -> str:
    """One run (in this process, at the given niceness); returns its file."""
    import os

    import torch

    from research.bench.study import get_run

    os.nice(max(0, nice - os.nice(0)))
    torch.set_num_threads(threads)
    get_run(out / job["stage"] / setting_tag(job["setting"]), "full", job["reward"], PLAN["epochs"], overrides_of(job["setting"]),
            tuple(PLAN["variants"][job["variant"]]), job["seed"], PLAN["eval_samples"])
    return str(job_path(out, job))


def _run_job_star(args):
    return run_job(*args)


# Measured medians of the committed 30-epoch runs at one thread (issue 59): a first guess until runs finish here.
PRIOR_RUN_S = {"jpeg_compressibility": 3.8 * 60, "tinyworld_alignment": 5.8 * 60}


def status(out: Path, jobs: list[dict]) -> dict:
    """Done and left per (reward, variant), and the CPU time left (median wall of the done runs per reward)."""
    cells, walls = {}, {}
    for job in jobs:
        path = job_path(out, job)
        key = (job["reward"], job["variant"])
        c = cells.setdefault(key, {"done": 0, "left": 0})
        if path.exists():
            c["done"] += 1
            walls.setdefault(job["reward"], []).append(json.loads(path.read_text())["wall_s"])
        else:
            c["left"] += 1
    per_run = {r: float(np.median(walls[r])) if r in walls else PRIOR_RUN_S.get(r, 300.0) for r in {k[0] for k in cells}}
    left_s = sum(c["left"] * per_run[r] for (r, _), c in cells.items())
    return {"cells": {f"{r} / {v}": c for (r, v), c in cells.items()}, "done": sum(c["done"] for c in cells.values()),
            "left": sum(c["left"] for c in cells.values()), "cpu_hours_left": left_s / 3600,
            "seconds_per_run": per_run, "measured": sorted(walls)}


def status_text(st: dict) -> str:
    lines = [f"{'reward / variant':<40} done  left"]
    lines += [f"{k:<40} {c['done']:>4}  {c['left']:>4}" for k, c in st["cells"].items()]
    per = ", ".join(f"{r} {s / 60:.1f} min" + ("" if r in st["measured"] else " (prior)") for r, s in sorted(st["seconds_per_run"].items()))
    lines.append(f"total: {st['done']} done, {st['left']} left; about {st['cpu_hours_left']:.1f} CPU hours left "
                 f"(one thread a run; per run: {per})")
    return "\n".join(lines)


def run_jobs(out: Path, jobs: list[dict], n_jobs: int, max_runs: int | None) -> list[str]:
    todo = [j for j in jobs if not job_path(out, j).exists()][:max_runs]
    log("tuning", f"{len(todo)} runs to do ({len(jobs) - len([j for j in jobs if not job_path(out, j).exists()])} of {len(jobs)} done), "
                  f"{n_jobs} at a time")
    if n_jobs <= 1:
        return [run_job(out, j) for j in todo]
    # spawn: each run is a fresh interpreter with one torch thread (no forked torch state)
    with multiprocessing.get_context("spawn").Pool(n_jobs, maxtasksperchild=1) as pool:
        done = []
        for path in pool.imap_unordered(_run_job_star, [(out, j) for j in todo]):
            done.append(path)
            log("tuning", f"finished {len(done)}/{len(todo)}: {path}")
        return done


# ----------------------------------------------------------------------------- the tuning table


def tuning_table(out: Path) -> dict:
    """Per reward and variant: each setting's mean gain (and s.e.) over the tuning seeds that are done,
    and the chosen setting (PLAN['selection']) once every setting has every tuning seed."""
    from research.bench.drift import gains
    from research.bench.study import mean_se

    def row(reward, variant, s):
        runs = []
        for seed in PLAN["tuning_seeds"]:
            p = job_path(out, {"stage": "tune", "reward": reward, "variant": variant, "setting": s, "seed": seed})
            if p.exists():
                runs.append(json.loads(p.read_text()))
        g = [v["gain"] for v in gains(runs).values()]
        m, se = mean_se(g) if g else (None, None)
        return {"setting": s, "tag": setting_tag(s), "seeds": len(g), "gain_mean": m, "gain_se": se}

    def complete(rows):
        return all(r["seeds"] == len(PLAN["tuning_seeds"]) for r in rows)

    table = {}
    for reward in PLAN["rewards"]:
        for variant in PLAN["variants"]:
            rows = [row(reward, variant, s) for s in settings()]
            extension, ext_rows = [], []
            if complete(rows):  # the edge rule, once: from the grid's best, never from an extension's
                best = next(r["setting"] for r in rows if r["tag"] == choose(rows))
                extension = edge_extension(best)
                ext_rows = [row(reward, variant, s) for s in extension]
            done = complete(rows) and complete(ext_rows)
            table[f"{reward} / {variant}"] = {"rows": rows + ext_rows, "extension": extension, "complete": done,
                                              "grid_best": choose(rows) if complete(rows) else None,
                                              "chosen": choose(rows + ext_rows) if done else None}
    return table


def choose(rows: list[dict]) -> str:
    """PLAN['selection']: the highest mean gain; ties to the smaller lr, then the smaller clip range."""
    best = max(rows, key=lambda r: (r["gain_mean"], -r["setting"]["train.lr"], -r["setting"]["train.clip_range"]))
    return best["tag"]


def choices(table: dict) -> list[dict]:
    """Per complete cell: the chosen setting, its gain, how many settings were tried, and which keys it
    sits at the edge of what was tried (a better setting may lie beyond: the edge rule applies once)."""
    out = []
    for key, t in table.items():
        if not t["complete"]:
            continue
        row = next(r for r in t["rows"] if r["tag"] == t["chosen"])
        edges = []
        for k, name in (("train.lr", "lr"), ("train.clip_range", "clip")):
            tried = sorted({r["setting"][k] for r in t["rows"]})
            v = row["setting"][k]
            edges += [f"{name} smallest tried"] if v == tried[0] else [f"{name} largest tried"] if v == tried[-1] else []
        out.append({"cell": key, "chosen": t["chosen"], "setting": row["setting"], "gain_mean": row["gain_mean"], "gain_se": row["gain_se"],
                    "settings_tried": len(t["rows"]), "in_extension": row["setting"] not in settings(), "edges": edges})
    return out


def choices_markdown(rows: list[dict]) -> str:
    lines = ["The choices (cells whose tuning is complete):", "",
             "| reward / variant | chosen | mean gain ± s.e. | settings tried | from | at the edge of what was tried |",
             "| --- | --- | --- | --- | --- | --- |"]
    for c in rows:
        lines.append(f"| {c['cell']} | {c['chosen']} | {c['gain_mean']:+.3f} ± {c['gain_se']:.3f} | {c['settings_tried']} | "
                     f"{'extension' if c['in_extension'] else 'grid'} | {', '.join(c['edges']) or 'no'} |")
    return "\n".join(lines)


def table_markdown(table: dict) -> str:
    tags = [setting_tag(s) for s in settings()]
    picked = choices(table)
    lines = ([choices_markdown(picked), ""] if picked else []) + [
        "mean training gain over the tuning seeds (± s.e.; seeds done); **bold**: the chosen setting", "",
             "| reward / variant | " + " | ".join(tags) + " |", "| --- |" + " --- |" * len(tags)]
    for key, t in table.items():
        cells = []
        for r in t["rows"]:
            if not r["seeds"]:
                cells.append("-")
                continue
            c = f"{r['gain_mean']:+.3f}" + (f" ± {r['gain_se']:.3f}" if r["gain_se"] is not None else "") + f" ({r['seeds']})"
            cells.append(f"**{c}**" if r["tag"] == t["chosen"] else c)
        lines.append(f"| {key} | " + " | ".join(cells[: len(tags)]) + " |")
    ext = [(key, r, t["chosen"]) for key, t in table.items() for r in t["rows"][len(tags):]]
    if ext:
        lines += ["", "The edge rule's extensions (cells whose grid best lies at an edge; PLAN['edge_rule']):", "",
                  "| reward / variant | setting | mean training gain (± s.e.; seeds done) |", "| --- | --- | --- |"]
        for key, r, chosen in ext:
            c = "-" if not r["seeds"] else (f"{r['gain_mean']:+.3f}" + (f" ± {r['gain_se']:.3f}" if r["gain_se"] is not None else "")
                                              + f" ({r['seeds']})")
            lines.append(f"| {key} | {r['tag']} | {f'**{c}**' if r['tag'] == chosen else c} |")
    return "\n".join(lines)


def gain_grid(cell: dict) -> tuple[list[float], list[float], np.ndarray]:
    """One cell's settings as a matrix: the learning rates (rows) and clip ranges (columns) its grid
    and extension cover, ascending; each setting's mean gain where it has a run, NaN elsewhere."""
    lrs = sorted({r["setting"]["train.lr"] for r in cell["rows"]})
    clips = sorted({r["setting"]["train.clip_range"] for r in cell["rows"]})
    gains = np.full((len(lrs), len(clips)), np.nan)
    for r in cell["rows"]:
        if r["seeds"]:
            gains[lrs.index(r["setting"]["train.lr"]), clips.index(r["setting"]["train.clip_range"])] = r["gain_mean"]
    return lrs, clips, gains


def tuning_picture(table: dict, path: Path) -> None:
    """The tuning table as heat maps: one panel per reward (row) and variant (column), lr x clip, the
    mean gain written in each cell (seeds done in brackets when not all), the chosen setting boxed in
    black (the grid's best in grey while its extension runs). One colour scale per reward: gains on two
    rewards are in different units."""
    plt = pyplot()
    rewards, variants = PLAN["rewards"], list(PLAN["variants"])
    fig, axs = plt.subplots(len(rewards), len(variants), figsize=(3.3 * len(variants) + 1, 4.0 * len(rewards) + 0.6), squeeze=False,
                            layout="constrained")
    n_seeds = len(PLAN["tuning_seeds"])
    for i, reward in enumerate(rewards):
        cells = [table[f"{reward} / {v}"] for v in variants]
        grids = [gain_grid(c) for c in cells]
        values = np.concatenate([g[2].ravel() for g in grids])
        lo, hi = (np.nanmin(values), np.nanmax(values)) if np.isfinite(values).any() else (0.0, 1.0)
        for ax, variant, cell, (lrs, clips, gains) in zip(axs[i], variants, cells, grids):
            image = ax.imshow(np.ma.masked_invalid(gains), cmap="viridis", vmin=lo, vmax=hi, origin="lower")
            seeds = {(r["setting"]["train.lr"], r["setting"]["train.clip_range"]): r["seeds"] for r in cell["rows"]}
            for (a, lr), (b, clip) in itertools.product(enumerate(lrs), enumerate(clips)):
                if np.isfinite(gains[a, b]):
                    n = seeds[(lr, clip)]
                    ax.text(b, a, f"{gains[a, b]:+.3f}" + ("" if n == n_seeds else f"\n({n})"), ha="center", va="center", fontsize=7,
                            color="white" if gains[a, b] < (lo + hi) / 2 else "black")
            for tag, colour in ((cell["chosen"], "black"), (None if cell["chosen"] else cell["grid_best"], "grey")):
                r = next((r for r in cell["rows"] if r["tag"] == tag), None)
                if r is not None:
                    a, b = lrs.index(r["setting"]["train.lr"]), clips.index(r["setting"]["train.clip_range"])
                    ax.add_patch(plt.Rectangle((b - 0.5, a - 0.5), 1, 1, fill=False, edgecolor=colour, linewidth=2.5))
            ax.set_xticks(range(len(clips)), [f"{c:g}" for c in clips], fontsize=7)
            ax.set_yticks(range(len(lrs)), [f"{v:g}" for v in lrs], fontsize=7)
            ax.set_xlabel("train.clip_range", fontsize=8)
            if ax is axs[i][0]:
                ax.set_ylabel("train.lr", fontsize=8)
            ax.set_title(f"{reward}\n{variant}" + ("" if cell["complete"] else " (in progress)"), fontsize=8)
        fig.colorbar(image, ax=list(axs[i]), shrink=0.8, label="mean training gain")
    fig.suptitle("Tuning: mean training gain over the tuning seeds (blank: no run yet; boxed: chosen, grey: grid best)", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan_markdown() -> str:
    p = PLAN
    lines = [f"Plan digest `{plan_digest()}` (`python -m research.bench.tuning plan`).", "",
             f"- Rewards: {', '.join(p['rewards'])}; {p['epochs']} epochs of 32 samples ({32 * p['epochs']} reward queries a run).",
             "- Variants: " + "; ".join(f"`{v}` ({s}, replay {r})" for v, (s, r) in p["variants"].items()) + "; the baseline is `ddpo`.",
             "- Grid, the same for every variant: " + " x ".join(f"`{k}` in {v}" for k, v in p["grid"].items())
             + f" ({len(settings())} settings).",
             f"- Tuning seeds {p['tuning_seeds']}; confirmatory seeds {p['confirm_seeds']}, used for nothing else.",
             f"- Selection: {p['selection']} (ties: smaller lr, then smaller clip).",
             f"- Edge rule (amendment 1, before any confirmatory run): {p['edge_rule']}.",
             f"- Primary measure: {p['primary']}.",
             "- Secondary: " + "; ".join(p["secondary"]) + ".",
             f"- Test: {p['test']}; correction: {p['correction']}.",
             f"- Reporting: {p['report']}."]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m research.bench.tuning", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["plan", "status", "run", "report"])
    ap.add_argument("--stage", choices=["tune", "confirm"], default="tune",
                    help="confirm: each variant at its chosen setting on the confirm seeds, with controls (once its tuning is complete)")
    ap.add_argument("--reward", nargs="+", choices=PLAN["rewards"])
    ap.add_argument("--variant", nargs="+", choices=list(PLAN["variants"]))
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time, one torch thread each")
    ap.add_argument("--max-runs", type=int, help="stop after this many runs (a chunk)")
    ap.add_argument("--out", default=str(RESULTS_DIR / "tuning"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    jobs = tuning_jobs(args.reward, args.variant, out)
    if args.stage == "confirm" and args.command in ("status", "run"):
        jobs, waiting = confirm_jobs(out, args.reward, args.variant)
        if waiting:
            log("tuning", "tuning not complete, no confirmatory runs yet for: " + ", ".join(waiting))
    if args.command == "plan":
        print(plan_markdown())
        return PLAN
    if args.command == "status":
        st = status(out, jobs)
        print(status_text(st))
        return st
    if args.command == "run":
        t0, done = time.time(), []
        while True:  # tuning: a grid completed by this call queues its edge extension, run by this call too
            new = run_jobs(out, jobs, args.jobs, None if args.max_runs is None else args.max_runs - len(done))
            done += new
            if not new or args.stage != "tune" or (args.max_runs is not None and len(done) >= args.max_runs):
                break
            jobs = tuning_jobs(args.reward, args.variant, out)
        log("tuning", f"{len(done)} runs in {time.time() - t0:.0f}s")
        print(status_text(status(out, jobs)))
        return done
    table = tuning_table(out)
    md = table_markdown(table)
    (out / "tuning_table.md").parent.mkdir(parents=True, exist_ok=True)
    (out / "tuning_table.md").write_text(md + "\n")
    write_json(out / "tuning_table.json", {"plan_digest": plan_digest(), "table": table})
    tuning_picture(table, out / "tuning_grid.png")
    print(md)
    return table


if __name__ == "__main__":
    main()
