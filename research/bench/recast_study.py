"""Does ReCAST move the two-reward front outward? (issue 60) The plan, its runs and their status.

    python -m research.bench.recast_study plan      # the pre-registered plan and its digest (RESULTS, "Several rewards: does ReCAST move the front?")
    python -m research.bench.recast_study status    # done / left per method and weight, CPU hours left
    nohup python -m research.bench.recast_study run --jobs 2 --max-runs 12 > recast.log 2>&1 &   # a chunk
    nohup python -m research.bench.recast_study run --weight 0.5 > recast.log 2>&1 &   # one lambda's 30 runs: its 4 comparisons complete first
    nohup python -m research.bench.recast_study run --weight 0.5 --method weighted_sum recast_pre > recast.log 2>&1 &   # 20 runs: 2 comparisons

PLAN is fixed before any of its runs and quoted in RESULTS by digest (tests/test_recast_study.py).
Each run is the single-process reference loop on the embedded default with a weighted_sum of the
two rewards, saved as one file per (method, weight, seed, real/control) under
research/results/recast_study/runs/... (with each reward's held-out mean), reused when it exists.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np

from research.bench.common import RESULTS_DIR

PLAN = {
    "rewards": ["jpeg_compressibility", "tinyworld_alignment"],
    # the shuffled-reward drift controls of each term (research/controls.py), summed with the same weights
    "controls": {"jpeg_compressibility": "research.controls:ShuffledJpegCompressibility",
                 "tinyworld_alignment": "research.controls:ShuffledTinyWorldAlignment"},
    "weights_on_first": [0.25, 0.5, 0.75],  # lambda on JPEG compressibility; the alignment reward gets 1 - lambda
    "methods": {"weighted_sum": {"recast.mode": "off"}, "recast_pre": {"recast.mode": "pre"}, "recast_loss": {"recast.mode": "loss"}},
    # every method: the tiny preset's ddim_std weighting and lr/clip, batch advantages (ReCAST's
    # requirement, so the weighted sum uses them too), 30 epochs of 32 samples
    "common": ["advantage.mode=batch", "train.epochs=30"],
    # the probe (recast.*'s defaults: 4 trajectories x 4 branches x 20 steps + 4 = 324 queries, once)
    # counts in ReCAST's queries; the weighted sum makes none
    "seeds": [300, 301, 302, 303, 304],  # fresh: used by nothing else
    "measures": ["each reward's mean over the last 3 epochs minus epoch 0, net of the same seed's control run, at equal total reward queries "
                 "(the weighted sum's curve read at ReCAST's total, probe included)",
                 # amendment 1, before any run: the reading above cannot be made (ReCAST's total, its probe
                 # included, exceeds the weighted sum's whole run); what it means, made explicit
                 "amendment 1: 'at equal total reward queries' is read so: every run's curve at its last epoch whose cumulative reward "
                 "queries (the probe's included) are at most the weighted sum's total at its end (same lambda and seed); the 3 epochs "
                 "ending there; the control read the same way (research/bench/recast_answer.py)",
                 "each reward's held-out mean (prompts.eval, fixed noise), net of the control's"],
    "comparisons": "each ReCAST mode against the weighted sum at the same lambda, per reward (2 modes x 3 weights x 2 rewards = 12)",
    "test": "paired t-test over the 5 seeds of the net training gain difference, two-sided",
    "correction": "Holm across the 12 comparisons at family-wise 0.05",
    "front": "ReCAST moves the front outward at a lambda if it is above the weighted sum on one reward (Holm) and not below it on the other "
             "(the difference's 95% interval reaches 0 or above)",
    "pictures": "the Pareto picture (mean net gain of reward 1 against reward 2, per method and lambda, seed 95% intervals); W and the gains per reward",
}


def plan_digest() -> str:
    return hashlib.sha256(json.dumps(PLAN, sort_keys=True).encode()).hexdigest()[:16]


def spec(weight: float, control: bool = False) -> dict:
    """The weighted_sum reward spec of one lambda (the controls' terms for a control run)."""
    names = [PLAN["controls"][r] if control else r for r in PLAN["rewards"]]
    return {"name": "weighted_sum", "terms": [{"name": names[0], "weight": weight}, {"name": names[1], "weight": round(1 - weight, 10)}]}


def jobs(weights: list[float] | None = None, methods: list[str] | None = None) -> list[dict]:
    """Every run (or those of the given lambdas and methods), seed-major (all methods and weights of a
    seed, each beside its control, before the next seed)."""
    return [{"method": m, "weight": w, "seed": s, "control": c}
            for s in PLAN["seeds"] for m in PLAN["methods"] for w in PLAN["weights_on_first"] for c in (False, True)
            if (weights is None or w in weights) and (methods is None or m in methods)]


def run_path(out: Path, job: dict) -> Path:
    kind = "control" if job["control"] else "real"
    return out / "runs" / job["method"] / f"lambda{job['weight']:g}" / kind / f"seed{job['seed']}.json"


def overrides(job: dict) -> list[str]:
    return [*PLAN["common"], *(f"{k}={v}" for k, v in PLAN["methods"][job["method"]].items()),
            f"reward.spec={json.dumps(spec(job['weight'], job['control']))}", f"run.seed={job['seed']}"]


PRIOR_RUN_S = 6.0 * 60  # the alignment reward's 30-epoch runs took ~5.8 min at one thread; two rewards score both


def status(out: Path) -> dict:
    cells, walls = {}, []
    for job in jobs():
        key = f"{job['method']} / lambda {job['weight']:g}"
        c = cells.setdefault(key, {"done": 0, "left": 0})
        path = run_path(out, job)
        if path.exists():
            c["done"] += 1
            walls.append(json.loads(path.read_text()).get("wall_s", PRIOR_RUN_S))
        else:
            c["left"] += 1
    per_run = float(np.median(walls)) if walls else PRIOR_RUN_S
    left = sum(c["left"] for c in cells.values())
    return {"cells": cells, "done": sum(c["done"] for c in cells.values()), "left": left, "cpu_hours_left": left * per_run / 3600,
            "seconds_per_run": per_run, "measured": bool(walls)}


SIZES = {  # what --size runs: the plan's runs, or a check that the runner works (numbers mean nothing)
    "full": dict(extra=["model.device=cpu", "run.image_grid_every=0", "run.tensorboard=false"], eval_samples=32),
    "tiny": dict(extra=["model.name=tiny-random", "model.device=cpu", "sample.num_steps=3", "sample.resolution=32",
                        "sample.batch_size=4", "sample.batches_per_epoch=1", "train.batch_size=4", "train.epochs=2",
                        "recast.trajectories=2", "recast.branches=2", "run.image_grid_every=0", "run.tensorboard=false"],
                 eval_samples=4),
}
EVAL_SEED_BASE = 987_654_321  # the study's held-out noise seeds (research/bench/study.py): the same for every run


def heldout_terms(components, negative_embeds, cfg, n: int, version: int) -> dict:
    """Each reward's held-out mean: n images of prompts.eval (cycled, fixed noise), scored by the run's
    weighted_sum server (not counted as training queries)."""
    from diffrlhf.actors.settings import reward_server, sampling_settings
    from diffrlhf.policy.prompts import load_prompts
    from diffrlhf.policy.sampler import sample_trajectories

    prompts = load_prompts(cfg.prompts.eval)
    server, bs, terms, names = reward_server(cfg), cfg.sample.batch_size, [], None
    for s in range(0, n, bs):
        ids = list(range(s, min(n, s + bs)))
        batch = sample_trajectories(components, [prompts[i % len(prompts)] for i in ids], [EVAL_SEED_BASE + i for i in ids],
                                    sampling_settings(cfg), version, ids, negative_embeds)
        res = server.score(ids, batch.images.numpy(), batch.prompts)
        terms.append(res.terms)
        names = res.term_names
    t = np.concatenate(terms)
    return {"samples": n, "term_names": names, "term_means": t.mean(0).tolist()}


def run_job(out: Path, job: dict, size: str = "full", threads: int = 1, nice: int = 19) -> str:
    """One run of the plan (the reference loop), saved the moment it ends; an existing file is kept."""
    import os
    import time

    import torch

    from diffrlhf.actors.reference_loop import run_reference
    from diffrlhf.deploy.config import load_config
    from diffrlhf.deploy.runlog import recast_record
    from research.bench.common import log, machine, write_json

    path = run_path(out, job)
    if path.exists():
        return str(path)
    os.nice(max(0, nice - os.nice(0)))
    torch.set_num_threads(threads)
    cfg = load_config("tiny", overrides=[*overrides(job), *SIZES[size]["extra"]])  # a size may shorten the plan's runs
    evals, t0 = {}, time.time()
    tag = f"{job['method']} lambda {job['weight']:g} seed {job['seed']}{' control' if job['control'] else ''}"

    class ProbeRecords:  # the reference loop's logger, as far as it is used here: each ReCAST probe's W and gains
        def __init__(self):
            self.probes = []

        def log(self, rec):
            pass

        def log_recast(self, result):
            self.probes.append(recast_record(result))

    probes = ProbeRecords()

    def on_epoch(epoch, batch, learner):
        log("recast_study", f"{tag} epoch {epoch + 1}/{cfg.train.epochs} ({time.time() - t0:.0f}s)")
        if epoch == cfg.train.epochs - 1:
            evals.update(heldout_terms(learner.c, learner.negative_embeds, cfg, SIZES[size]["eval_samples"], learner.version))

    records = run_reference(cfg, logger=probes, progress=False, on_epoch=on_epoch)
    path.parent.mkdir(parents=True, exist_ok=True)
    # recast_probes: W and the per-step gains of each probe (the plan's W pictures); none for the weighted sum
    write_json(path, {"job": job, "plan_digest": plan_digest(), "config": cfg.to_dict(), "records": records, "eval": evals,
                      "recast_probes": probes.probes, "wall_s": time.time() - t0, "machine": machine()})
    return str(path)


def _run_job_star(args):
    return run_job(*args)


def run_jobs(out: Path, todo: list[dict], n_jobs: int, size: str) -> list[str]:
    import multiprocessing

    if n_jobs <= 1:
        return [run_job(out, j, size) for j in todo]
    with multiprocessing.get_context("spawn").Pool(n_jobs, maxtasksperchild=1) as pool:
        return list(pool.imap_unordered(_run_job_star, [(out, j, size) for j in todo]))


def plan_markdown() -> str:
    p = PLAN
    return "\n".join([
        f"Plan digest `{plan_digest()}` (`python -m research.bench.recast_study plan`).", "",
        f"- Rewards: {p['rewards'][0]} (weight lambda) and {p['rewards'][1]} (1 - lambda), lambda in {p['weights_on_first']}.",
        "- Methods: " + "; ".join(f"`{m}` ({', '.join(f'{k}={v}' for k, v in o.items())})" for m, o in p["methods"].items())
        + f"; every run: {', '.join(p['common'])}, the tiny preset otherwise; ReCAST's probe queries count in its total.",
        f"- Seeds {p['seeds']}, fresh; each real run beside a control run whose terms are the shuffled rewards "
        f"({', '.join(p['controls'].values())}) at the same weights.",
        "- Measures: " + "; ".join(p["measures"]) + ".",
        f"- Comparisons: {p['comparisons']}. Test: {p['test']}; correction: {p['correction']}.",
        f"- The front: {p['front']}.",
        f"- Pictures: {p['pictures']}.",
        f"- Runs: {len(jobs())} (3 methods x 3 weights x 5 seeds, each with its control)."])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m research.bench.recast_study", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["plan", "status", "run"])
    ap.add_argument("--out", default=str(RESULTS_DIR / "recast_study"))
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time, one torch thread each, at nice 19")
    ap.add_argument("--max-runs", type=int, help="stop after this many runs (a chunk)")
    ap.add_argument("--weight", type=float, nargs="+", choices=PLAN["weights_on_first"],
                    help="only these lambdas' runs: a chunk whose comparisons complete within it (the default order completes none before its last seed)")
    ap.add_argument("--method", nargs="+", choices=list(PLAN["methods"]),
                    help="only these methods' runs (with --weight: the weighted sum and one mode complete that mode's comparisons)")
    args = ap.parse_args(argv)
    if args.command == "plan":
        print(plan_markdown())
        return PLAN
    if args.command == "run":
        todo = [j for j in jobs(args.weight, args.method) if not run_path(Path(args.out), j).exists()][:args.max_runs]
        return run_jobs(Path(args.out), todo, args.jobs, args.size)
    st = status(Path(args.out))
    for k, c in st["cells"].items():
        print(f"{k:<32} done {c['done']:>3}  left {c['left']:>3}")
    print(f"total: {st['done']} done, {st['left']} left; about {st['cpu_hours_left']:.1f} CPU hours left at "
          f"{st['seconds_per_run'] / 60:.1f} min a run{'' if st['measured'] else ' (prior)'}")
    return st


if __name__ == "__main__":
    main()
