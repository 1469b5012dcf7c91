"""Sample-efficiency study: reward vs reward queries for DDPO and its two additions.

    python -m research.bench.study [--suite ablation weighting replay] [--seeds 3] [--epochs 20]
        [--reward jpeg_compressibility jpeg_incompressibility] [--size tiny|full] [--out DIR] [key.sub=value ...]

Suites (every variant has the same hyperparameters except the named axis):
  ablation   baseline (DDPO: uniform weights, no replay) / +weighting (latent_sq) / +hardmine / +both
  weighting  uniform, latent_sq, latent_abs, ddim_std, gaussian_early, gaussian_mid, gaussian_late (no replay)
  replay     none, hardmine, random (uniform weights)
  headline   baseline / +weighting (latent_sq) only: the claim at a third of the ablation's cost
  compute    DDPO (all steps), DDPO random 0.5, and the method (ddim_std weighting, the weighting
             suite's best) at all steps, with hard-mining, and training a share of the steps:
             weighted 0.5 / 0.25, top 0.25, window 0.25 (train.timestep_selection / _fraction)
  baselines  DDPO, DPOK, B2-DiffuRL, GRPO beside the method (all steps, and top 0.25)
  evidence   DDPO, every weighting scheme (oracle included), hard-mining, random replay, ddim_std + hard-mining

Each (reward, variant, seed) runs the single-process reference loop (fastest on a few cores) and
is saved to <out>/runs/<reward>/<scheme>__<replay>[__<selection><fraction>]/seed<k>.json (the
suffix only for a timestep selection other than DDPO's random subset of all steps) the moment
it finishes; a file
that exists is reused, so an interrupted study continues where it stopped, and the DDPO baseline
(uniform + none) is run once and shared by all suites. Runs go seed by seed (all variants of seed
0, then of seed 1, ...) so that a partial study is still a fair comparison.

Outputs per suite and reward: <suite>_<reward>.png (seed-mean reward vs reward queries, band =
+-1 standard error over seeds), <suite>_<reward>.json and .md (the table below).

"Queries to reach the baseline": smooth each variant's seed-mean reward curve with a trailing
3-epoch moving average (epoch i averages epochs max(0, i-2)..i, so reaching it at epoch i uses
no later data); the target is the baseline's smoothed value at its last epoch; a variant's
number is the reward queries used up to the first epoch whose smoothed mean is >= the target.
The ratio is baseline / variant (> 1: the variant needs fewer queries). The same on the two other
axes: learner passes (trajectory-steps trained: a UNet forward+backward of one sample at one
step) and the wall-clock seconds of the runs' epochs, each to the same first epoch. A variant that never gets
there is reported as not reached, with the bound ratio < baseline / (its total queries). If the baseline
ends no better than its first epoch, there is no bar to reach and the table says so (no ratio).
After the last epoch the trained policy samples the held-out prompts (prompts.eval) with fixed
noise seeds (the same for every variant and seed: a paired comparison) and a separate reward
server scores them, so these queries are not counted as training queries.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from diffrlhf.actors.reference_loop import run_reference
from diffrlhf.actors.settings import build_policy, reward_server, sampling_settings
from diffrlhf.buffer.replay import MODES as REPLAY_MODES
from research.bench.common import TINY_OVERRIDES, log, machine, out_dir, pyplot, write_json
from diffrlhf.deploy.config import Config, flatten, load_config
from diffrlhf.learner.timesteps import num_trained_steps
from diffrlhf.learner.weighting import SCHEMES
from diffrlhf.policy.prompts import load_prompts
from diffrlhf.policy.sampler import sample_trajectories
from diffrlhf.tinyworld import weights as tiny_world_weights
from research.controls import reward_spec, short_name

# Named sets of further overrides a variant can carry as its 5th axis (the other algorithms), each
# at the same reward-query budget: 32 images an epoch, every branch and group sample scored.
ALGORITHM_VARIANTS = {
    "dpok": ("algorithm.name=dpok",),  # KL to the pretrained model, beta = algorithm.kl_coef's default
    # B2-DiffuRL: 8 prefixes x 4 branches an epoch; the first stage trains the last 70% of the steps (the reference's 14 of 20)
    "b2diffurl": ("algorithm.name=b2diffurl", "sample.samples_per_prompt=4"),
    "grpo": ("advantage.mode=group", "sample.samples_per_prompt=4"),  # 8 prompts x 4 samples, advantages within the group
}
# suite -> {variant label: (weighting.scheme, replay.mode[, train.timestep_selection, train.timestep_fraction
# [, an ALGORITHM_VARIANTS name]])}; the first variant is the suite's baseline.
SUITES = {
    "ablation": {"baseline": ("uniform", "none"), "+weighting": ("latent_sq", "none"),
                 "+hardmine": ("uniform", "hardmine"), "+both": ("latent_sq", "hardmine")},
    "weighting": {s: (s, "none") for s in SCHEMES},
    "replay": {m: ("uniform", m) for m in REPLAY_MODES},
    # The claim in two runs per seed: for a second reward, where the full ablation costs too much.
    "headline": {"baseline": ("uniform", "none"), "+weighting": ("latent_sq", "none")},
    # Fewer learner passes: which steps are trained at all (learner/timesteps.py).
    "compute": {"ddpo": ("uniform", "none"), "ddpo random 0.5": ("uniform", "none", "random", 0.5),
                "method": ("ddim_std", "none"), "method+hardmine": ("ddim_std", "hardmine"),
                "method weighted 0.5": ("ddim_std", "none", "weighted", 0.5),
                "method weighted 0.25": ("ddim_std", "none", "weighted", 0.25),
                "method top 0.25": ("ddim_std", "none", "top", 0.25), "method window 0.25": ("ddim_std", "none", "window", 0.25)},
    # The paper's baselines in this system (issue 21): same rewards, seeds, query budget and accounting.
    "baselines": {"ddpo": ("uniform", "none"), "dpok": ("uniform", "none", "random", 1.0, "dpok"),
                  "b2diffurl": ("uniform", "none", "backward", 0.7, "b2diffurl"),
                  "grpo": ("uniform", "none", "random", 1.0, "grpo"),
                  "method": ("ddim_std", "none"), "method top 0.25": ("ddim_std", "none", "top", 0.25)},
    # Issue 20's study, for a reward where the ablation and weighting suites have not run (the alignment
    # reward): DDPO, every weighting scheme, the measured-variance oracle (its probe's queries counted),
    # hard-mining against random replay, and the method with hard-mining.
    "evidence": {"ddpo": ("uniform", "none"), "latent_sq": ("latent_sq", "none"), "latent_abs": ("latent_abs", "none"),
                 "ddim_std": ("ddim_std", "none"), "gaussian_early": ("gaussian_early", "none"),
                 "gaussian_mid": ("gaussian_mid", "none"), "gaussian_late": ("gaussian_late", "none"),
                 "oracle": ("oracle", "none"), "hardmine": ("uniform", "hardmine"), "random replay": ("uniform", "random"),
                 "ddim_std+hardmine": ("ddim_std", "hardmine")},
}
DDPO_STEPS = ("random", 1.0)  # DDPO's selection: every step, in random order (today's runs' paths carry no suffix)


def full_axes(axes) -> tuple:
    """(scheme, replay, selection, fraction[, algorithm variant]) of a suite entry of 2, 4 or 5 axes."""
    return tuple(axes) if len(axes) >= 4 else (*axes, *DDPO_STEPS)
SMOOTH_WINDOW = 3
EVAL_SEED_BASE = 987_654_321  # held-out noise seeds: fixed, disjoint from training seeds of small run seeds
RUN_SIZES = {  # what --size sets (epochs, seeds, held-out samples, config overrides); the command line wins
    "tiny": dict(epochs=2, seeds=1, eval_samples=4, overrides=TINY_OVERRIDES),
    "full": dict(epochs=20, seeds=3, eval_samples=32, overrides=["model.device=cpu", "run.image_grid_every=0", "run.tensorboard=false"]),
}


# ----------------------------------------------------------------------------- the analysis (pure; tested)


def smooth(y, window: int = SMOOTH_WINDOW) -> np.ndarray:
    """Trailing moving average: out[i] = mean(y[max(0, i-window+1) .. i])."""
    y = np.asarray(y, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(y)])
    i = np.arange(len(y))
    lo = np.maximum(0, i - window + 1)
    return (c[i + 1] - c[lo]) / (i + 1 - lo)


def first_reach(queries, y, target: float, window: int = SMOOTH_WINDOW):
    """Queries at the first epoch whose smoothed y is >= target, or None."""
    hit = np.nonzero(smooth(y, window) >= target)[0]
    return int(queries[hit[0]]) if len(hit) else None


def queries_to_reach(base_q, base_y, var_q, var_y, window: int = SMOOTH_WINDOW) -> dict:
    """Reward queries a variant needs to reach the baseline's final smoothed reward (see module doc).

    base_y / var_y are seed-mean reward per epoch, base_q / var_q the cumulative queries at each.
    """
    target = float(smooth(base_y, window)[-1])
    start = float(base_y[0])
    if target <= start:
        # A baseline that ends no better than it began sets no bar: every variant "reaches" it at
        # epoch 0, and a ratio of 1.00 would read as "no gain" when the truth is "no learning".
        return {"target": target, "window": window, "baseline_queries": None, "queries": None, "reached": None,
                "total_queries": int(var_q[-1]), "ratio": None, "ratio_upper_bound": None,
                "undefined": f"the baseline did not improve (epoch 0 {start:.4f}, final smoothed {target:.4f})"}
    qb = first_reach(base_q, base_y, target, window)  # always found: the last epoch equals the target
    qv = first_reach(var_q, var_y, target, window)
    out = {"target": target, "window": window, "baseline_queries": qb, "queries": qv, "reached": qv is not None,
           "total_queries": int(var_q[-1])}
    out["ratio"] = qb / qv if qv else None
    out["ratio_upper_bound"] = None if qv else qb / int(var_q[-1])  # not reached: ratio < this
    return out


def seed_matrix(runs: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(queries per epoch, rewards [seed, epoch]) over the runs of one variant, cut to the shortest."""
    n = min(len(r["records"]) for r in runs)
    q = np.array([rec["reward_queries"] for rec in runs[0]["records"][:n]])
    y = np.array([[rec["reward_mean"] for rec in r["records"][:n]] for r in runs])
    return q, y


def learner_passes(run: dict) -> np.ndarray:
    """Trajectory-steps trained per epoch. Runs from before the learner counted them (all of them
    DDPO's selection) get (rows trained) x round(T * fraction) x inner_epochs from their config,
    which is what the learner counts (tests/test_study.py checks the two agree)."""
    recs = run["records"]
    if all("learner_passes" in r for r in recs):
        return np.array([r["learner_passes"] for r in recs], dtype=np.float64)
    c = run["config"]
    k = num_trained_steps(c["sample"]["num_steps"], c["train"]["timestep_fraction"])
    return np.array([(r["samples"] + r.get("num_replayed", 0)) * k * c["train"]["inner_epochs"] for r in recs], dtype=np.float64)


def cost_axes(runs: list[dict], n: int) -> dict[str, np.ndarray]:
    """Seed-mean cumulative cost at each of the first n epochs: reward queries, learner passes,
    wall-clock seconds of the epochs (sampling, scoring, update)."""
    out = {"queries": np.array([rec["reward_queries"] for rec in runs[0]["records"][:n]], dtype=np.float64)}
    try:  # an axis the saved runs cannot give is left out
        out["passes"] = np.mean([np.cumsum(learner_passes(r))[:n] for r in runs], axis=0)
        out["wall_s"] = np.mean([np.cumsum([rec["time_epoch"] for rec in r["records"]])[:n] for r in runs], axis=0)
    except KeyError:
        pass
    return out


def held_from(y, target: float, window: int = SMOOTH_WINDOW):
    """The first epoch from which the smoothed y stays >= target to the end of the run, or None if
    it ends below it."""
    below = np.nonzero(smooth(y, window) < target)[0]
    if not len(below):
        return 0
    return None if below[-1] == len(y) - 1 else int(below[-1] + 1)


def cost_to_reach(base: dict, base_y, var: dict, var_y, window: int = SMOOTH_WINDOW) -> dict:
    """For each cost axis: the baseline's and the variant's cost at the first epoch whose smoothed
    seed-mean reward reaches the baseline's final one, and the ratio baseline / variant.

    A curve that crosses the target on its way up and falls back reads as cheap by the first
    crossing; "held_variant" is the variant's cost at the first epoch from which it stays at or above
    the target to its end (None if it ends below it), and "held_ratio" the baseline's first-crossing
    cost over it: conservative, since the baseline is not held to the same (its own late dips below
    its final value would make its held cost its total)."""
    target = float(smooth(base_y, window)[-1])
    if target <= float(base_y[0]):
        return {}
    ib = int(np.nonzero(smooth(base_y, window) >= target)[0][0])
    hit = np.nonzero(smooth(var_y, window) >= target)[0]
    hv = held_from(var_y, target, window)
    out = {}
    for axis in [a for a in base if a in var]:
        if len(hit):
            out[axis] = {"baseline": float(base[axis][ib]), "variant": float(var[axis][hit[0]]),
                         "ratio": float(base[axis][ib] / var[axis][hit[0]])}
        else:  # not reached: the ratio is below baseline / (the variant's total)
            out[axis] = {"baseline": float(base[axis][ib]), "variant": None, "ratio": None,
                         "ratio_upper_bound": float(base[axis][ib] / var[axis][-1])}
        out[axis].update(held_variant=None if hv is None else float(var[axis][hv]),
                         held_ratio=None if hv is None else float(base[axis][ib] / var[axis][hv]))
    return out


def mean_se(values) -> tuple[float, float]:
    """(mean, standard error); the error is None for a single value (no spread to report)."""
    v = np.asarray(values, dtype=np.float64)
    se = float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else None
    return float(v.mean()), se


# ----------------------------------------------------------------------------- running


def run_path(out: Path, reward: str, axes: tuple, seed: int) -> Path:
    scheme, replay, selection, fraction, *algo = full_axes(axes)
    steps = "" if (selection, fraction) == DDPO_STEPS else f"__{selection}{fraction:g}"
    return out / "runs" / reward / f"{scheme}__{replay}{steps}{''.join(f'__{a}' for a in algo)}" / f"seed{seed}.json"


def make_config(size: str, reward: str, epochs: int, overrides: list[str], axes=("uniform", "none"), seed: int = 0):
    # The variant's axes and the seed come last: a stray override cannot blur the comparison.
    scheme, replay, selection, fraction, *algo = full_axes(axes)
    extra = [o for a in algo for o in ALGORITHM_VARIANTS[a]]
    return load_config("tiny", overrides=[*RUN_SIZES[size]["overrides"], f"reward.spec={reward_spec(reward)}", f"train.epochs={epochs}",
                                          *overrides, f"weighting.scheme={scheme}", f"replay.mode={replay}",
                                          f"train.timestep_selection={selection}", f"train.timestep_fraction={fraction}",
                                          *extra, f"run.seed={seed}"])


def identity(cfg) -> dict:
    """What must match for a saved run to be reused (everything but the seed and output names)."""
    d = cfg.to_dict()
    d["run"] = {k: v for k, v in d["run"].items() if k not in ("seed", "out_dir", "name")}
    d["reward"]["spec"] = short_name(d["reward"]["spec"])  # the controls' runs were saved under their short names
    if d["model"]["name"] == "tiny-world":
        # The name stays when the committed weights are retrained; runs on other weights don't mix.
        d["model"]["weights_sha256"] = tiny_world_weights.recorded_digest()[:16]
    return d


def check_reusable(path: Path, saved: dict, cfg) -> None:
    """A saved run is reused if its config is this one. A key added to the config after the run was
    saved counts as equal at its default: defaults of new keys keep the old behaviour (checked for
    train.timestep_selection by tests/test_timesteps.py, bit for bit against a saved run)."""
    a, b = flatten(saved["config"]), flatten(identity(cfg))
    defaults = flatten(Config().to_dict())
    a.update({k: defaults[k] for k in set(b) - set(a) if k in defaults})
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    if diff:
        raise SystemExit(f"{path} was made with a different config ({', '.join(f'{k}: {a.get(k)!r} -> {b.get(k)!r}' for k in diff[:5])}); "
                         "use another --out, or delete the file to re-run it")


def heldout_reward(components, negative_embeds, cfg, n: int, version: int = -1) -> dict:
    """Sample n held-out images (prompts.eval, cycled; fixed noise seeds) and score them."""
    prompts = load_prompts(cfg.prompts.eval)
    all_prompts = [prompts[i % len(prompts)] for i in range(n)]
    server = reward_server(cfg)
    rewards = []
    bs = cfg.sample.batch_size
    for s in range(0, n, bs):
        ids = list(range(s, min(n, s + bs)))
        batch = sample_trajectories(components, [all_prompts[i] for i in ids], [EVAL_SEED_BASE + i for i in ids],
                                    sampling_settings(cfg), version, ids, negative_embeds)
        rewards += server.score(ids, batch.images.numpy(), batch.prompts).rewards.tolist()
    m, se = mean_se(rewards)
    return {"prompts": cfg.prompts.eval, "samples": n, "reward_mean": m, "reward_se": se}


def run_one(cfg, path: Path, eval_samples: int, tag: str, algo: tuple = ()) -> dict:
    evals, seen = {}, [0]
    t0 = time.time()

    def on_epoch(epoch, batch, learner):
        seen[0] += len(batch)
        log("study", f"{tag} epoch {epoch + 1}/{cfg.train.epochs} queries {seen[0]} reward {batch.rewards.double().mean():.4f} "
                     f"({time.time() - t0:.0f}s)")
        if epoch == cfg.train.epochs - 1 and eval_samples:
            evals.update(heldout_reward(learner.c, learner.negative_embeds, cfg, eval_samples, learner.version))
            log("study", f"{tag} held-out reward {_pm((evals['reward_mean'], evals['reward_se']))}")

    records = run_reference(cfg, progress=False, on_epoch=on_epoch)
    axes = [cfg.weighting.scheme, cfg.replay.mode]
    if (cfg.train.timestep_selection, cfg.train.timestep_fraction) != DDPO_STEPS or algo:
        axes += [cfg.train.timestep_selection, cfg.train.timestep_fraction, *algo]
    result = {"seed": cfg.run.seed, "axes": axes, "reward": short_name(cfg.reward.spec),
              "config": identity(cfg), "records": records, "eval": evals or None, "wall_s": time.time() - t0, "machine": machine()}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result)
    return result


def get_run(out: Path, size: str, reward: str, epochs: int, overrides, axes, seed: int, eval_samples: int, run: bool = True):
    cfg = make_config(size, reward, epochs, overrides, axes, seed)
    path = run_path(out, reward, axes, seed)
    tag = f"{reward} {'+'.join(str(a) for a in axes)} seed {seed}"
    if path.exists():
        saved = json.loads(path.read_text())
        check_reusable(path, saved, cfg)
        log("study", f"{tag}: done before, reusing {path}")
        return saved
    if not run:
        return None
    log("study", f"{tag}: running {epochs} epochs")
    return run_one(cfg, path, eval_samples, tag, tuple(full_axes(axes)[4:]))


def base_eval(out: Path, size: str, reward: str, overrides, eval_samples: int, run: bool = True) -> dict | None:
    """The held-out reward of the untrained policy (LoRA B = 0): the reference point for the evals.

    The saved one if it matches; else computed, unless run is False (--report-only)."""
    if not eval_samples:
        return None
    cfg = make_config(size, reward, 1, overrides)
    path = out / "runs" / reward / "base_policy_eval.json"
    key = {k: identity(cfg)[k] for k in ("model", "sample", "prompts", "reward")}
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key and saved.get("samples") == eval_samples:
            return saved
    if not run:
        return None
    comps, learner = build_policy(cfg)
    res = heldout_reward(comps, learner.negative_embeds, cfg, eval_samples, 0)
    res["key"] = key
    write_json(path, res)
    log("study", f"{reward} base policy held-out reward {_pm((res['reward_mean'], res['reward_se']))}")
    return res


# ----------------------------------------------------------------------------- reporting


def summarise_suite(suite: str, reward: str, runs: dict[str, list[dict]], base: dict | None) -> dict:
    """Table rows for one suite: final reward, held-out reward, queries to reach the baseline."""
    baseline = next(iter(SUITES[suite]))
    if not runs.get(baseline):
        return {"suite": suite, "reward": reward, "rows": [], "note": "baseline has no finished runs yet"}
    bq, by = seed_matrix(runs[baseline])
    b_cost = cost_axes(runs[baseline], len(bq))
    rows = []
    for label, rs in runs.items():
        if not rs:
            rows.append({"variant": label, "seeds": 0})
            continue
        q, y = seed_matrix(rs)
        finals = [smooth(r)[-1] for r in y]
        evals = [r["eval"]["reward_mean"] for r in rs if r.get("eval")]
        row = {"variant": label, "axes": rs[0]["axes"], "seeds": len(rs), "seed_ids": [r["seed"] for r in rs],
               "epochs": len(q), "final_smoothed": mean_se(finals), "heldout": mean_se(evals) if evals else None,
               **queries_to_reach(bq, by.mean(0), q, y.mean(0)),
               "cost_to_reach": cost_to_reach(b_cost, by.mean(0), cost_axes(rs, len(q)), y.mean(0)),
               "passes_per_epoch": float(cost_axes(rs, len(q)).get("passes", [np.nan])[-1] / len(q)),
               "wall_s_per_run": float(np.mean([r["wall_s"] for r in rs]))}
        rows.append(row)
    return {"suite": suite, "reward": reward, "baseline": baseline, "smoothing": f"trailing {SMOOTH_WINDOW}-epoch moving average",
            "base_policy_heldout": base and [base["reward_mean"], base["reward_se"]], "rows": rows}


def _pm(v) -> str:
    if not v:
        return "-"
    return f"{v[0]:.4f}" if v[1] is None else f"{v[0]:.4f} +- {v[1]:.4f}"


def _reach(c: dict | None, fmt: str) -> str:
    if not c:
        return "-"
    if c["ratio"] is None:
        return f"not reached (< {c['ratio_upper_bound']:.2f})"
    return f"{fmt.format(c['variant'])} ({c['ratio']:.2f})"


def table_markdown(summary: dict) -> str:
    lines = [f"### {summary['suite']} / {summary['reward']}", ""]
    if not summary["rows"]:
        return "\n".join(lines + [summary.get("note", ""), ""])
    target = summary["rows"][0].get("target")
    costs = summary["suite"] in ("compute", "baselines")  # suites where learner compute differs show its other axes
    lines += [f"Target: the baseline's ({summary['baseline']}) final smoothed seed-mean reward, {target:.4f} "
              f"({summary['smoothing']}). Held-out: mean +- s.e. over seeds"
              + (f"; untrained policy {_pm(summary['base_policy_heldout'])}." if summary.get("base_policy_heldout") else "."), "",
              "| variant | seeds | epochs | final reward (smoothed) | held-out reward | queries to reach target | ratio baseline/variant |"
              + (" learner passes / epoch | passes to reach (ratio) | wall-clock s to reach (ratio) |" if costs else ""),
              "| --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- | --- |" if costs else "")]
    for r in summary["rows"]:
        if not r.get("seeds"):
            lines.append(f"| {r['variant']} | 0 | - | - | - | - | - |" + (" - | - | - |" if costs else ""))
            continue
        if r.get("undefined"):
            reach, ratio = "undefined: " + r["undefined"], "-"
        elif r["reached"]:
            reach, ratio = str(r["queries"]), f"{r['ratio']:.2f}"
        else:
            reach, ratio = f"not reached in {r['total_queries']}", f"< {r['ratio_upper_bound']:.2f}"
        line = f"| {r['variant']} | {r['seeds']} | {r['epochs']} | {_pm(r['final_smoothed'])} | {_pm(r['heldout'])} | {reach} | {ratio} |"
        if costs:
            c = r.get("cost_to_reach") or {}
            line += f" {r['passes_per_epoch']:.0f} | {_reach(c.get('passes'), '{:.0f}')} | {_reach(c.get('wall_s'), '{:.0f}')} |"
        lines.append(line)
    return "\n".join(lines + [""])


def plot_suite(summary: dict, runs: dict[str, list[dict]], path: Path, ylabel: str) -> None:
    plt = pyplot()
    xaxes = {"queries": "reward queries"}
    if summary["suite"] in ("compute", "baselines"):
        xaxes.update(passes="learner passes (trajectory-steps trained)", wall_s="wall-clock s (this machine, 2 threads)")
    fig, axs = plt.subplots(1, len(xaxes), figsize=(7 * len(xaxes), 4.2), squeeze=False)
    rows = [r for r in summary["rows"] if r.get("seeds")]
    for ax, (axis, xlabel) in zip(axs[0], xaxes.items()):
        for label, rs in runs.items():
            if not rs:
                continue
            _, y = seed_matrix(rs)
            x = cost_axes(rs, y.shape[1])[axis]
            ys = np.array([smooth(r) for r in y])  # the line is what the reach criterion reads
            m = ys.mean(0)
            line, = ax.plot(x, m, "-", label=f"{label} ({len(rs)} seed{'s' if len(rs) > 1 else ''})")
            ax.plot(x, y.mean(0), ".", ms=4, color=line.get_color(), alpha=0.6)
            if len(rs) > 1:
                se = ys.std(0, ddof=1) / np.sqrt(len(rs))
                ax.fill_between(x, m - se, m + se, color=line.get_color(), alpha=0.2)
        if rows:
            ax.axhline(rows[0]["target"], color="k", ls=":", lw=1, label="baseline final (smoothed)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
    ax = axs[0][0]
    ax.set_title(f"{summary['suite']}: line = seed-mean of {SMOOTH_WINDOW}-epoch trailing average, band = +-1 s.e. over seeds,\n"
                 "dots = seed-mean raw epoch reward", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


YLABEL = {"jpeg_compressibility": "JPEG compressibility (-kB)", "jpeg_incompressibility": "JPEG size (kB)",
          "jpeg_compressibility_shuffled": "JPEG compressibility (-kB), reward shuffled",
          "tinyworld_alignment": "caption alignment (0-1)", "tinyworld_alignment_shuffled": "caption alignment (0-1), reward shuffled"}


def report(out: Path, suite: str, reward: str, runs: dict, base) -> dict:
    summary = summarise_suite(suite, reward, runs, base)
    stem = f"{suite}_{reward}"
    write_json(out / f"{stem}.json", summary)
    (out / f"{stem}.md").write_text(table_markdown(summary))
    if summary["rows"]:
        plot_suite(summary, runs, out / f"{stem}.png", YLABEL.get(reward, "reward"))
    print(table_markdown(summary), flush=True)
    return summary


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", nargs="+", default=["ablation"], choices=sorted(SUITES))
    ap.add_argument("--reward", nargs="+", default=["jpeg_compressibility"])
    ap.add_argument("--size", choices=sorted(RUN_SIZES), default="full")
    ap.add_argument("--epochs", type=int, help="default: 20 (full), 2 (tiny)")
    ap.add_argument("--seeds", type=int, help="number of seeds 0..n-1; default 3 (full), 1 (tiny)")
    ap.add_argument("--eval-samples", type=int, help="held-out images per run (0: none); default 32 (full), 4 (tiny)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    ap.add_argument("--report-only", action="store_true", help="only tabulate and plot the runs already saved")
    ap.add_argument("--out", help="default research/results/study")
    ap.add_argument("--only", nargs="+", metavar="VARIANT",
                    help="run only these variants of the suites (labels as in their tables, e.g. uniform ddim_std); "
                         "the report still shows every variant, the others from their saved runs (0 seeds if none)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key.sub=value (on top of the tiny preset)")
    args = ap.parse_args(argv)
    d = RUN_SIZES[args.size]
    epochs, n_seeds = args.epochs or d["epochs"], args.seeds or d["seeds"]
    n_eval = d["eval_samples"] if args.eval_samples is None else args.eval_samples
    out = out_dir("study", args.out)
    if args.threads:

        torch.set_num_threads(args.threads)
    # Distinct (scheme, replay) runs across the chosen suites, so shared ones run once.
    chosen = {label: ax for s in args.suite for label, ax in SUITES[s].items()}
    if args.only:
        unknown = sorted(set(args.only) - set(chosen))
        if unknown:
            ap.error(f"--only: {', '.join(unknown)} not in suite(s) {', '.join(args.suite)}; their variants: {', '.join(chosen)}")
        chosen = {label: ax for label, ax in chosen.items() if label in args.only}
    axes_list = list(dict.fromkeys(full_axes(ax) for ax in chosen.values()))
    # --only runs a part of a suite, but its report stays whole: the other variants come from
    # their saved runs, every seed saved, so a seed-by-seed loop over a few variants never
    # shrinks the committed table to those few.
    reported = list(dict.fromkeys(full_axes(ax) for s in args.suite for ax in SUITES[s].values()))
    log("study", f"{len(args.reward)} reward(s) x {len(axes_list)} variants x {n_seeds} seeds x {epochs} epochs -> {out}")
    summaries = {}
    for reward in args.reward:
        base = base_eval(out, args.size, reward, args.overrides, n_eval, run=not args.report_only)
        done = {}
        for seed in range(n_seeds):
            for axes in axes_list:
                r = get_run(out, args.size, reward, epochs, args.overrides, axes, seed, n_eval, run=not args.report_only)
                if r is not None:
                    done.setdefault(axes, []).append(r)
        for axes in reported:
            if axes in axes_list:
                continue
            seed = 0
            while (r := get_run(out, args.size, reward, epochs, args.overrides, axes, seed, n_eval, run=False)) is not None:
                done.setdefault(axes, []).append(r)
                seed += 1
        for suite in args.suite:
            runs = {label: done.get(full_axes(axes), []) for label, axes in SUITES[suite].items()}
            summaries[f"{suite}_{reward}"] = report(out, suite, reward, runs, base)
    return summaries


if __name__ == "__main__":
    main()
