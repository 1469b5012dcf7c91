"""Per-step reward variance, measured by branching (issue 20), against the timestep weightings.

    python -m research.bench.variance [--reward jpeg_compressibility tinyworld_alignment]
        [--trajectories 8] [--branches 4] [--lora runs/<name>/lora/epoch_XXXX] [--ray [--samplers 2]]
        [--quick] [--threads 1] [--out DIR] [key.sub=value ...]
    python -m research.bench.variance --probe-noise research/results/variance/variance_*.json

P trajectories are sampled (prompts drawn from prompts.train, tiny-world-train on the tiny preset)
and recorded. For each trajectory and each level k the chain is branched M times
(policy/branching.py: the recorded latents up to the state after k steps are kept, the rest is
sampled again with fresh noise, eta as in training): k = fresh (only the prompt: M independent
full samples), k = 0 (the initial noise z_T kept), k = 1 .. T-1 (the state after step k kept).
After the last step the variance is 0 (no branch needed). Every branch is decoded and scored by
each --reward (the same images for every reward), giving rewards[P, T+1, M] per reward, and
policy.branching.per_step_variance turns it into the variance each source of noise adds, by the law
of total variance: the initial noise's share, then sigma_t^2 for each DDIM step t = 1..T
(sigma_t^2 = E[Var(R | after step t-1)] - E[Var(R | after step t)]); they add up to
E[Var(R | prompt)]. Unbiased within-group variances (ddof=1), standard errors over trajectories.

Each timestep weighting of learner/weighting.py (latent_sq and latent_abs measured on the P
recorded trajectories, as the learner measures them on a batch) is scaled to the same sum as the
steps' sigma_t^2 and compared with it: Pearson and Spearman correlation, with 95% bootstrap
intervals over trajectories (the shares and the measured profiles resampled together).

Outputs in research/results/variance/ (or --out): variance_<reward>.json (everything, with the raw
reward grid), .md (the table) and .png (sigma_t^2 against the schemes' profiles). --quick: the
tiny random model, 3 steps, 32 px, P = M = 3, into <out>/quick (checks the command; the numbers
mean nothing). --lora: the policy after training, a LoRA folder a run saved (its run's
config.yaml, when found two folders up, gives the model and sampling settings). --ray: the
branches run on SamplerWorker actors of a local Ray (the system's samplers; SamplerWorker.branch),
the recording and the scoring here; the untrained policy only.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from diffrlhf.actors.driver import init_ray
from diffrlhf.actors.settings import load_model, sampling_settings
from diffrlhf.actors.workers import SamplerWorker
from research.bench.common import TINY_OVERRIDES, log, machine, out_dir, pyplot, write_json
from diffrlhf.deploy.config import load_config
from diffrlhf.deploy.evaluate import components_of, load_pipeline
from diffrlhf.learner.weighting import SCHEMES as ALL_SCHEMES, latent_change, oracle_profile, timestep_weights
from diffrlhf.policy.branching import (FRESH, branch_seed, branch_trajectories, conditional_variances, pearson,
                                       per_step_variance, spearman)
from diffrlhf.policy.prompts import load_prompts
from diffrlhf.policy.sampler import sample_trajectories
from diffrlhf.rewards import build_reward
from research.controls import reward_spec

QUICK = dict(trajectories=3, branches=3)
BOOTSTRAP = 2000

# The schemes compared with the measured variance (`oracle` is that measurement, made into weights).
SCHEMES = tuple(x for x in ALL_SCHEMES if x != "oracle")


def trajectory_seed(seed: int, p: int) -> int:
    return int(np.random.SeedSequence([int(seed), 0x7472, int(p)]).generate_state(1)[0])


def choose_prompts(prompts: list[str], n: int, seed: int) -> list[str]:
    """n prompts: a seeded permutation of the list, cycled if n is longer."""
    order = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[order[i % len(prompts)]] for i in range(n)]


def sample_steps(num_trajectories: int, num_branches: int, num_steps: int) -> int:
    """UNet sample-steps of a measurement: M branches of T steps (fresh and z_T) and of T - k (k = 1..T-1) per trajectory."""
    return num_trajectories * num_branches * (num_steps + num_steps * (num_steps + 1) // 2)


# ----------------------------------------------------------------------------- the measurement


class LocalBrancher:
    def __init__(self, components, settings, negative_embeds):
        self.c, self.settings, self.neg = components, settings, negative_embeds

    def submit(self, job):
        """job: (rows batch, step, M, seeds); run when its result is asked for (get)."""
        return job

    def get(self, job):
        b, step, m, seeds = job
        return branch_trajectories(self.c, b, step, m, seeds, self.settings, self.neg)

    def close(self):
        pass


class RayBrancher:
    """The branches on the run's sampler actors (SamplerWorker.branch), one local Ray."""

    def __init__(self, cfg, num_samplers: int):
        import ray

        self.ray = ray
        self.started = not ray.is_initialized()
        init_ray(cfg)
        cls = ray.remote(SamplerWorker).options(num_cpus=cfg.system.sampler_cpus)
        self.actors = [cls.remote(cfg, rank) for rank in range(num_samplers)]
        ray.get([a.ping.remote() for a in self.actors])

    def submit(self, job):
        """Every job is submitted at once (round robin over the actors), so all samplers work."""
        self.n = getattr(self, "n", 0) + 1
        return self.actors[self.n % len(self.actors)].branch.remote(*job)

    def get(self, ref):
        return self.ray.get(ref)

    def close(self):
        for a in self.actors:
            self.ray.kill(a)
        if self.started:
            self.ray.shutdown()


def measure(brancher, recorded, rewards: dict, num_branches: int, seed: int, rows_per_call: int) -> dict:
    """rewards[name] [P, T+1, M] for the levels FRESH, 0, 1, ..., T-1; and the seconds spent."""
    p_count, t_count = len(recorded), recorded.num_steps
    levels = [FRESH] + list(range(t_count))
    grid = {name: np.zeros((p_count, len(levels), num_branches)) for name in rewards}
    timing = {"branch_s": 0.0, "score_s": {name: 0.0 for name in rewards}, "per_level_s": []}
    chunks = [list(range(s, min(p_count, s + rows_per_call))) for s in range(0, p_count, rows_per_call)]
    pending = [[brancher.submit((recorded.select(rows), step, num_branches,
                                 [branch_seed(seed, p, step, m) for p in rows for m in range(num_branches)])) for rows in chunks]
               for step in levels]
    for li, step in enumerate(levels):
        t0 = time.perf_counter()
        outs = [brancher.get(h) for h in pending[li]]
        dt = time.perf_counter() - t0  # with Ray: the wait for this level (the actors work on all levels at once)
        timing["branch_s"] += dt
        images = torch.cat([o.images for o in outs]).numpy()
        prompts = [x for o in outs for x in o.prompts]
        for name, fn in rewards.items():
            t1 = time.perf_counter()
            grid[name][:, li, :] = np.asarray(fn(images, prompts), np.float64).reshape(p_count, num_branches)
            timing["score_s"][name] += time.perf_counter() - t1
        timing["per_level_s"].append(dt)
        log("variance", f"level {'fresh' if step == FRESH else f'after {step} steps'}: {p_count} x {num_branches} branches "
                        f"of {t_count - max(step, 0)} steps, {dt:.1f}s")
    return {"levels": levels, "rewards": grid, "timing": timing}


# ----------------------------------------------------------------------------- the analysis


def scheme_profiles(latents: torch.Tensor, timesteps: torch.Tensor, scheduler, eta: float, width: float) -> dict[str, np.ndarray]:
    """Each weighting's w [T] on these trajectories (mean 1, as the learner uses it)."""
    return {s: timestep_weights(s, latents, timesteps, scheduler, eta, width).double().numpy() for s in SCHEMES}


def latent_changes(latents: torch.Tensor) -> dict[str, np.ndarray]:
    """Each trajectory's own latent_sq and latent_abs profile [P, T] (their mean over trajectories is the scheme's)."""
    return {"latent_sq": np.stack([latent_change(latents[i:i + 1], 2).numpy() for i in range(len(latents))]),
            "latent_abs": np.stack([latent_change(latents[i:i + 1], 1).numpy() for i in range(len(latents))])}


def analyse(grid: np.ndarray, change: dict[str, np.ndarray], profiles: dict[str, np.ndarray], seed: int,
            n_boot: int = BOOTSTRAP) -> dict:
    """Shares, conditional variances, the schemes' profiles at sigma_t^2's scale, correlations with bootstrap CIs.
    change: latent_changes of the recorded trajectories (the bootstrap resamples them with the shares)."""
    shares, se = (x.numpy() for x in per_step_variance(grid))
    cond, cond_se = (x.numpy() for x in conditional_variances(grid))
    steps, steps_se = shares[1:], se[1:]
    total_steps = float(steps.sum())
    scaled = {s: (w / w.sum() * total_steps).tolist() for s, w in profiles.items()}
    corr = {s: {"pearson": pearson(w, steps), "spearman": spearman(w, steps)} for s, w in profiles.items()}

    # Bootstrap over trajectories: each resample's shares, and its own measured latent_sq / latent_abs.
    v = torch.as_tensor(grid, dtype=torch.float64).var(dim=2, unbiased=True).numpy()  # [P, L]
    d = v - np.concatenate([v[:, 1:], np.zeros_like(v[:, :1])], axis=1)
    # Quarters of the chain: each one's share of the steps' variance (fewer, less noisy numbers) and each scheme's weight there.
    bins = [b for b in np.array_split(np.arange(len(steps)), min(4, len(steps))) if len(b)]
    binned_d = np.stack([d[:, 1 + b].sum(1) for b in bins], axis=1)  # [P, bins]: per trajectory, so the s.e. is paired
    binned = {"steps": [[int(b[0]) + 1, int(b[-1]) + 1] for b in bins], "share": binned_d.mean(0).tolist(),
              "share_se": (binned_d.std(0, ddof=1) / np.sqrt(len(d))).tolist() if len(d) > 1 else None,
              "scheme_fraction": {s: [float(w[b].sum() / w.sum()) for b in bins] for s, w in profiles.items()}}
    rng = np.random.default_rng(seed)
    boot = {s: {"pearson": [], "spearman": []} for s in profiles}
    for _ in range(n_boot if len(grid) > 2 else 0):
        idx = rng.integers(0, len(grid), len(grid))
        st = d[idx, 1:].mean(0)
        for s, w in profiles.items():
            wb = change[s][idx].mean(0) if s in change else w
            boot[s]["pearson"].append(pearson(wb, st))
            boot[s]["spearman"].append(spearman(wb, st))
    for s in profiles:
        for k in ("pearson", "spearman"):
            b = np.asarray(boot[s][k], np.float64)
            b = b[np.isfinite(b)]
            corr[s][f"{k}_ci95"] = [float(np.percentile(b, 2.5)), float(np.percentile(b, 97.5))] if len(b) >= 20 else None
    return {"var_prompt": float(cond[0]), "var_prompt_se": float(cond_se[0]),
            "init_noise_share": float(shares[0]), "init_noise_share_se": float(se[0]),
            "step_shares": steps.tolist(), "step_shares_se": steps_se.tolist(), "steps_sum": total_steps,
            "shares_sum": float(shares.sum()),
            "conditional_variance": cond.tolist(), "conditional_variance_se": cond_se.tolist(),
            "level_mean_reward": grid.mean(axis=(0, 2)).tolist(),
            "profiles_scaled": scaled, "profiles_mean_one": {s: w.tolist() for s, w in profiles.items()},
            "correlation": corr, "bootstrap_resamples": n_boot if len(grid) > 2 else 0, "binned": binned,
            "latent_change_per_trajectory": {k: np.asarray(v).tolist() for k, v in change.items()}}


def _f(x, digits=4) -> str:
    return "-" if x is None or not np.isfinite(x) else f"{x:.{digits}g}"


def _ci(c) -> str:
    return "" if not c else f" [{c[0]:+.2f}, {c[1]:+.2f}]"


def table_markdown(res: dict) -> str:
    a, meta = res["analysis"], res["setup"]
    lines = [f"### Per-step reward variance: {res['reward']}", "",
             f"{meta['trajectories']} trajectories x {meta['branches']} branches per level, {meta['num_steps']} DDIM steps "
             f"(eta {meta['eta']}), model {meta['model']}{' + LoRA ' + meta['lora'] if meta['lora'] else ' (untrained policy)'}, "
             f"prompts {meta['prompts']}; branches on {meta['backend']}; {res['timing']['total_s']:.0f} s.", "",
             f"- E[Var(R | prompt)] = {_f(a['var_prompt'])} +- {_f(a['var_prompt_se'])} (s.e. over trajectories)",
             f"- initial noise z_T: {_f(a['init_noise_share'])} +- {_f(a['init_noise_share_se'])}"
             f" ({_f(100 * a['init_noise_share'] / a['var_prompt'], 3) if a['var_prompt'] else '-'}%)",
             f"- the {meta['num_steps']} DDIM steps: {_f(a['steps_sum'])} (sum of sigma_t^2); all shares add up to "
             f"{_f(a['shares_sum'])} = E[Var(R | prompt)]", "",
             "| step t | timestep | E[Var(R after t)] | sigma_t^2 (+- s.e.) | " + " | ".join(SCHEMES) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in SCHEMES) + " |"]
    cond = a["conditional_variance"] + [0.0]
    for i, (s, e) in enumerate(zip(a["step_shares"], a["step_shares_se"])):
        lines.append(f"| {i + 1} | {meta['timesteps'][i]} | {_f(cond[i + 2], 3)} | {_f(s, 3)} +- {_f(e, 2)} | "
                     + " | ".join(_f(a["profiles_scaled"][k][i], 3) for k in SCHEMES) + " |")
    lines += ["", "Schemes scaled to the same sum as the steps' sigma_t^2. Correlation with sigma_t^2 over the steps "
              "(95% bootstrap interval over trajectories" + ("; with so few trajectories the bootstrap intervals are too narrow, "
                                                               "read them as rough" if meta["trajectories"] < 20 else "") + "):", "",
              "| scheme | Pearson | Spearman |", "| --- | --- | --- |"]
    for k in SCHEMES:
        c = a["correlation"][k]
        lines.append(f"| {k} | {_f(c['pearson'], 3)}{_ci(c.get('pearson_ci95'))} | {_f(c['spearman'], 3)}{_ci(c.get('spearman_ci95'))} |")
    b = a["binned"]
    lines += ["", "By quarter of the chain: the variance its steps add (+- s.e.; % of the steps' sum) and the share of "
              "each scheme's weight there:", "",
              "| steps | variance added | " + " | ".join(SCHEMES) + " |", "| --- | --- | " + " | ".join("---" for _ in SCHEMES) + " |"]
    for i, (lo, hi) in enumerate(b["steps"]):
        se_txt = f" +- {_f(b['share_se'][i], 2)}" if b["share_se"] else ""
        frac = f" ({100 * b['share'][i] / a['steps_sum']:.0f}%)" if a["steps_sum"] else ""
        lines.append(f"| {lo}-{hi} | {_f(b['share'][i], 3)}{se_txt}{frac} | "
                     + " | ".join(f"{100 * b['scheme_fraction'][k][i]:.0f}%" for k in SCHEMES) + " |")
    t = res["timing"]
    images = meta["trajectories"] * meta["branches"] * (meta["num_steps"] + 1)
    big_branch = t["s_per_sample_step"] * sample_steps(64, 8, meta["num_steps"])
    big_score = t["score_s"][res["reward"]] / images * 64 * 8 * (meta["num_steps"] + 1)
    lines += ["", f"Time: {t['total_s']:.0f} s in all ({t['load_s']:.0f} s loading, {t['record_s']:.1f} s recording, "
              f"{t['branch_s']:.0f} s branching {t['sample_steps']} sample-steps = {1000 * t['s_per_sample_step']:.1f} ms each, "
              f"{t['score_s'][res['reward']]:.1f} s scoring). "
              f"A run of P trajectories x M branches costs P M (T + T(T+1)/2) sample-steps and P M (T+1) images scored; "
              f"at these rates P=64, M=8 would take {big_branch / 60:.0f} min branching + {big_score / 60:.0f} min scoring.", ""]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    a, meta = res["analysis"], res["setup"]
    t = np.arange(1, meta["num_steps"] + 1)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    ax.errorbar(t, a["step_shares"], yerr=a["step_shares_se"], fmt="ko", ms=4, capsize=2, label="sigma_t^2 (+- s.e.)", zorder=5)
    for k in SCHEMES:
        c = a["correlation"][k]
        ax.plot(t, a["profiles_scaled"][k], "-", lw=1.2, alpha=0.8,
                label=f"{k} (r {_f(c['pearson'], 2)}, rho {_f(c['spearman'], 2)})")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xticks(t)
    ax.set_xlabel("DDIM step t (1 = first, noisiest)")
    ax.set_ylabel("reward variance added by the step")
    ax.set_title(f"{res['reward']}: per-step variance by branching vs weighting schemes (same sum)\n"
                 f"P={meta['trajectories']} trajectories, M={meta['branches']} branches, {meta['model']}"
                 f"{' + LoRA' if meta['lora'] else ' untrained'}", fontsize=8)
    ax.legend(fontsize=6.5)
    cond = np.array(a["conditional_variance"] + [0.0])
    cse = np.array(a["conditional_variance_se"] + [0.0])
    x = np.concatenate([[-3], np.arange(0, meta["num_steps"] + 1)])  # the prompt level a little apart, for its label
    ax2.errorbar(x, cond, yerr=cse, fmt="o-", ms=3, capsize=2)
    every = 1 if meta["num_steps"] < 10 else 5
    ax2.set_xticks([-3, 0] + list(range(every, meta["num_steps"] + 1, every)))
    ax2.set_xticklabels(["prompt", "z_T"] + [str(i) for i in range(every, meta["num_steps"] + 1, every)])
    ax2.set_xlabel("what the branches share (steps taken)")
    ax2.set_ylabel("E[Var(R | shared prefix)]")
    ax2.set_title("conditional variance of the final reward", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line


def build_config(args):
    overrides = list(TINY_OVERRIDES) if args.quick else ["model.device=cpu"]
    overrides += [f"system.torch_threads={args.threads or 1}", f"system.num_samplers={args.samplers}", *args.overrides]
    run_yaml = Path(args.lora).resolve().parents[1] / "config.yaml" if args.lora else None
    if run_yaml is not None and run_yaml.exists():
        return load_config(None, run_yaml, overrides), run_yaml
    return load_config("tiny", overrides=overrides), None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reward", nargs="+", default=["jpeg_compressibility", "tinyworld_alignment"],
                    help="rewards to score the same branches with (one output set each)")
    ap.add_argument("--trajectories", "-P", type=int, help="recorded trajectories P (default 8; --quick 3)")
    ap.add_argument("--branches", "-M", type=int, help="branches per trajectory and level M >= 2 (default 4; --quick 3)")
    ap.add_argument("--quick", action="store_true", help="tiny random model, 3 steps, 32 px, P = M = 3: checks the command")
    ap.add_argument("--lora", help="a LoRA folder a run saved (runs/<name>/lora/epoch_XXXX): measure the trained policy")
    ap.add_argument("--ray", action="store_true", help="branch on SamplerWorker actors of a local Ray")
    ap.add_argument("--samplers", type=int, default=2, help="sampler actors with --ray")
    ap.add_argument("--rows-per-call", type=int, default=16, help="trajectories per branch call (x M branches in one batch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch threads here (default: torch's own) and in each sampler actor (default 1)")
    ap.add_argument("--out", help="default research/results/variance (--quick: its quick/ folder)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key.sub=value (on top of the tiny preset or the LoRA's run)")
    ap.add_argument("--reanalyse", nargs="+", metavar="JSON", help="only analyse saved variance_<reward>.json files again")
    ap.add_argument("--probe-noise", nargs="+", metavar="JSON",
                    help="how close an `oracle` probe of P x M gets to saved variance_<reward>.json grids (no sampling)")
    args = ap.parse_args(argv)
    if args.reanalyse:
        return {str(f): reanalyse(Path(f)) for f in args.reanalyse}
    if args.probe_noise:
        return probe_noise_report([Path(f) for f in args.probe_noise], Path(args.out or "research/results/variance"))
    p_count = args.trajectories or (QUICK["trajectories"] if args.quick else 8)
    m = args.branches or (QUICK["branches"] if args.quick else 4)
    if m < 2 or p_count < 1:
        ap.error("need --branches >= 2 (a variance per branch group) and --trajectories >= 1")
    if args.ray and args.lora:
        ap.error("--ray measures the untrained policy only (the samplers take the learner's broadcast, not a LoRA folder); "
                 "drop --ray to measure a LoRA")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else out_dir("variance", None) / ("quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    cfg, run_yaml = build_config(args)
    settings = sampling_settings(cfg)
    rewards = {name: build_reward(reward_spec(name)) for name in args.reward}

    t_start = time.perf_counter()
    if args.lora:
        pipe = load_pipeline(cfg, "cpu")
        comps = components_of(pipe, cfg.model.name)
        pipe.load_lora_weights(str(args.lora))
    else:
        comps = load_model(cfg)
    negative = comps.encode_prompts([settings.negative_prompt])
    prompts = choose_prompts(load_prompts(cfg.prompts.train), p_count, args.seed)
    load_s = time.perf_counter() - t_start
    log("variance", f"{p_count} trajectories x {m} branches x {settings.num_steps + 1} levels on {cfg.model.name}"
                    f"{' + ' + args.lora if args.lora else ''}; rewards {', '.join(args.reward)} -> {out}")

    t0 = time.perf_counter()
    recorded = sample_trajectories(comps, prompts, [trajectory_seed(args.seed, p) for p in range(p_count)], settings, 0,
                                   list(range(p_count)), negative)
    record_s = time.perf_counter() - t0
    brancher = RayBrancher(cfg, args.samplers) if args.ray else LocalBrancher(comps, settings, negative)
    try:
        t0 = time.perf_counter()
        meas = measure(brancher, recorded, rewards, m, args.seed, args.rows_per_call)
        branch_wall = time.perf_counter() - t0
    finally:
        brancher.close()
    total_s = time.perf_counter() - t_start

    comps.scheduler.set_timesteps(settings.num_steps, device="cpu")
    profiles = scheme_profiles(recorded.latents, recorded.timesteps, comps.scheduler, settings.eta, cfg.weighting.gaussian_width)
    change = latent_changes(recorded.latents)
    steps_n = sample_steps(p_count, m, settings.num_steps)
    setup = {"trajectories": p_count, "branches": m, "num_steps": settings.num_steps, "eta": settings.eta,
             "guidance_scale": settings.guidance_scale, "resolution": settings.resolution, "model": cfg.model.name,
             "lora": args.lora, "run_config": run_yaml, "prompts": cfg.prompts.train, "trajectory_prompts": prompts,
             "seed": args.seed, "timesteps": recorded.timesteps[0].tolist(), "levels": meas["levels"],
             "levels_meaning": "branch step: -1 = only the prompt shared (independent full samples), 0 = z_T shared, "
                               "k = the state after k DDIM steps shared; after T steps the variance is 0",
             "backend": f"Ray, {args.samplers} SamplerWorker actors" if args.ray else "this process",
             "quick": args.quick, "gaussian_width": cfg.weighting.gaussian_width, "torch_threads": torch.get_num_threads()}
    results = {}
    for name in args.reward:
        grid = meas["rewards"][name]
        timing = {"total_s": total_s, "load_s": load_s, "record_s": record_s, "branch_s": meas["timing"]["branch_s"],
                  "branch_wall_s": branch_wall, "score_s": meas["timing"]["score_s"], "per_level_s": meas["timing"]["per_level_s"],
                  "sample_steps": steps_n, "s_per_sample_step": meas["timing"]["branch_s"] / steps_n}
        res = {"reward": name, "setup": setup, "analysis": analyse(grid, change, profiles, args.seed),
               "timing": timing, "recorded_rewards": np.asarray(rewards[name](recorded.images.numpy(), recorded.prompts)).tolist(),
               "rewards_grid": grid.tolist(), "machine": machine()}
        results[name] = report(res, out)
    return results


def report(res: dict, out: Path) -> dict:
    name = res["reward"]
    write_json(out / f"variance_{name}.json", res)
    md = table_markdown(res)
    (out / f"variance_{name}.md").write_text(md)
    plot(res, out / f"variance_{name}.png")
    print(md, flush=True)
    return res


def reanalyse(path: Path) -> dict:
    """Analyse a saved variance_<reward>.json again (its reward grid, measured latent changes and scheme
    profiles) and rewrite its .json, .md and .png: no sampling."""
    res = json.loads(Path(path).read_text())
    a = res["analysis"]
    res["analysis"] = analyse(np.array(res["rewards_grid"]), {k: np.array(v) for k, v in a["latent_change_per_trajectory"].items()},
                              {k: np.array(v) for k, v in a["profiles_mean_one"].items()}, res["setup"]["seed"])
    return report(res, Path(path).parent)


# ----------------------------------------------------------------------------- the oracle's probe size

PROBE_SIZES = ((4, 4), (8, 4), (16, 8), (32, 8))  # (P, M) of an `oracle` probe; (4, 4) is the config's default


def probe_noise(grid: np.ndarray, sizes=PROBE_SIZES, draws: int = 200, seed: int = 0) -> list[dict]:
    """How close an `oracle` probe of P trajectories x M branches gets to the profile of the whole grid:
    draw P of its trajectories and M of its branches (without replacement) `draws` times, take
    learner/weighting.py oracle_profile of the sub-grid and of the whole (levels 0..T-1), both
    normalised to mean 1, and report their Pearson r (mean and 5-95% range) and mean |w - w_full|.
    A sub-grid shares trajectories with the whole, so large P overstates the agreement."""
    steps = np.asarray(grid, np.float64)[:, 1:, :]  # drop the FRESH level: the probe branches at 0..T-1
    full = oracle_profile(steps).numpy()
    full = full / full.mean()
    rng = np.random.default_rng(seed)
    rows = []
    for p, m in sizes:
        if p > steps.shape[0] or m > steps.shape[2]:
            continue
        cors, dev, flat = [], [], 0
        for _ in range(draws):
            sub = steps[rng.choice(steps.shape[0], p, replace=False)][:, :, rng.choice(steps.shape[2], m, replace=False)]
            try:
                w = oracle_profile(sub).numpy()
            except ValueError:  # no positive share measured: the probe would stop the run
                flat += 1
                continue
            w = w / w.mean()
            cors.append(pearson(w, full))
            dev.append(float(np.abs(w - full).mean()))
        rows.append({"P": p, "M": m, "queries": p * steps.shape[1] * m, "r_mean": float(np.mean(cors)),
                     "r_p5": float(np.percentile(cors, 5)), "r_p95": float(np.percentile(cors, 95)),
                     "mean_abs_dev": float(np.mean(dev)), "flat_probes": flat, "draws": draws})
    return rows


def probe_noise_report(paths: list[Path], out: Path) -> dict:
    """probe_noise for saved variance_<reward>.json files; writes oracle_probe.md and .json into out."""
    res = {}
    lines = ["# The `oracle` weighting's probe size against the measured profile", "",
             "Sub-grids of the saved measurement (P trajectories x M branches drawn from it, 200 times): Pearson r",
             "of the probe's profile with the whole grid's, and mean |w - w_full| (weights of mean 1). Queries = P x T x M.", ""]
    for path in paths:
        saved = json.loads(Path(path).read_text())
        grid = np.array(saved["rewards_grid"])
        rows = probe_noise(grid)
        res[saved["reward"]] = {"grid_shape": list(grid.shape), "rows": rows}
        lines += [f"## {saved['reward']} (whole grid: P = {grid.shape[0]}, M = {grid.shape[2]})", "",
                  "| P | M | queries | r with the whole grid (5-95%) | mean abs. deviation |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['P']} | {r['M']} | {r['queries']} | {r['r_mean']:.2f} [{r['r_p5']:.2f}, {r['r_p95']:.2f}] | {r['mean_abs_dev']:.2f} |"
                  for r in rows]
        lines.append("")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "oracle_probe.json", {"results": res, "machine": machine()})
    (out / "oracle_probe.md").write_text("\n".join(lines))
    print("\n".join(lines), flush=True)
    return res


if __name__ == "__main__":
    main()
