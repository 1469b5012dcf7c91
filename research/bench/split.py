"""SIMULATED: sampler:learner GPU splits of this system against colocated layouts, from per-image costs.

    python -m research.bench.split [--budgets 4 8 16 64] [--fractions 1 0.5 0.25] [--rewards 0 0.1 0.5]
        [--figure-budget 16] [--mfu 0.4] [--broadcast-s S] [--out DIR]

Nothing is run on a GPU: every figure is a closed-form model (no Ray, no torch), labelled SIMULATED.

Per SD1.5 image (512 px, 50 DDIM steps, CFG), on one GPU:
  S  sampling: 50 guided UNet forwards. 1.61 TFLOP per guided forward (torch.utils.flop_counter on
     SD1.5's UNet, cond + uncond, issue 18) x 50 = 80.5 TFLOP; seconds = TFLOP / (--peak-tflops x
     --mfu), an ASSUMED achieved rate (default 40% of 989 TFLOP/s, H100/H200 bf16 dense).
  U  update: 3.43 TFLOP per guided forward+backward x 50 x train.timestep_fraction, i.e.
     U = (3.43 / 1.61) S f = 2.13 S f. The tiny world measured on this machine's CPU gives 2.08
     (research/results/systems/systems.json: update s/sample over sampling s/sample, all steps trained).
  R  reward: --rewards, in units of S (0, 0.1 S, 0.5 S).
Overheads: B, the weight broadcast per policy version (every sampler loads it once per epoch; default
the measured flat broadcast of the rank-4 LoRA to 16 actors, the record's section 6); A(n), one gradient
all-reduce per optimizer step over n ranks (ring: 2(n-1) latency steps + 2(n-1)/n x bytes / bus
bandwidth, NVLink inside a node of --gpus-per-node, the network across nodes; the rank-4 LoRA's
797,184 fp32 gradients = 3.2 MB); k optimizer steps per epoch of N samples (sd15-ddpo: N = 256, k = 4).

Layouts, for a budget of G GPUs:
  disaggregated (this system: sd15-ddpo + system.num_learners): g_s sampler GPUs and g_l learner
     GPUs, g_s + g_l = G, pipelined by max_policy_lag=1, so an epoch takes the slower stage:
     samplers N (S + R') / g_s + B, learners N U / g_l + k A(g_l); throughput N / max(...). Every
     integer split is tried; the best is reported.
  colocated DDP (ddpo-pytorch): every GPU samples, scores, then trains, in sequence:
     N (S + R + U) / G + k A(G).
  colocated on Ray (deploy/presets/sd15-colocated.yaml): a sampler and a learner share each GPU
     (0.5 GPU each); with lag 1 the next epoch's sampling overlaps this epoch's training only by
     time-sharing the GPU, so it is sequential like DDP: N (S + R' + U) / G + B + k A(G).
Where the reward runs (--placements):
  separate  reward actors on hardware outside the budget (CPU nodes for JPEG, or a reward GPU),
            enough of them: R' = 0 (scored asynchronously, hidden by the pipeline); DDP still pays R
            in sequence on its training GPUs.
  shared    the reward runs on the budget's GPUs: R' = R (on the sampler GPUs in the disaggregated
            layout, on every GPU in the colocated ones).

Writes split.json, split.md and split.png (throughput against the split for --figure-budget) into
research/results/split/ or --out.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

FORWARD_TFLOP = 1.61  # one guided UNet call (cond + uncond), one 512 px image, forward (issue 18, FlopCounterMode)
FORWARD_BACKWARD_TFLOP = 3.43  # the same call, forward + backward with LoRA gradients
STEPS = 50
UPDATE_OVER_SAMPLE = FORWARD_BACKWARD_TFLOP / FORWARD_TFLOP  # 2.13: U / S at timestep_fraction 1
SD15_LORA_RANK4_PARAMS = 797_184  # research/bench/systems.py sd15_lora_shapes(4) (tests/test_benchmarks.py checks it)
FLAT_BROADCAST_16_S = 0.0518  # the record's section 6 (git show c1efc50:RESULTS.md): flat rank-4 broadcast to 16 actors, median, on the 2-core CPU machine
PLACEMENTS = ("separate", "shared")
LAYOUTS = ("disaggregated", "colocated_ddp", "colocated_ray")


@dataclass(frozen=True)
class AllReduce:
    """Seconds of one ring all-reduce of `nbytes` over n ranks (0 for one rank), or `fixed_s` for every n > 1."""

    nbytes: float = SD15_LORA_RANK4_PARAMS * 4
    latency_s: float = 10e-6  # per ring step inside a node
    inter_latency_s: float = 20e-6  # per ring step once the ranks span nodes
    intra_gbps: float = 150.0  # NVLink bus bandwidth, GB/s
    inter_gbps: float = 25.0  # network bus bandwidth per GPU across nodes, GB/s
    gpus_per_node: int = 8
    fixed_s: float | None = None

    def __call__(self, n: int) -> float:
        if n <= 1:
            return 0.0
        if self.fixed_s is not None:
            return self.fixed_s
        inside = n <= self.gpus_per_node
        lat, gbps = (self.latency_s, self.intra_gbps) if inside else (self.inter_latency_s, self.inter_gbps)
        return 2 * (n - 1) * lat + 2 * (n - 1) / n * self.nbytes / (gbps * 1e9)


@dataclass(frozen=True)
class Costs:
    """One GPU's seconds per image and the per-epoch overheads (see the module docstring)."""

    sample_s: float  # S
    update_s: float  # U (already scaled by timestep_fraction)
    reward_s: float = 0.0  # R
    broadcast_s: float = 0.0  # B, per policy version
    allreduce: AllReduce = AllReduce(nbytes=0.0, latency_s=0.0, inter_latency_s=0.0)
    epoch_samples: int = 256  # N
    steps_per_epoch: int = 4  # k
    placement: str = "separate"

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement {self.placement!r}: choose one of {PLACEMENTS}")

    @property
    def reward_on_budget_s(self) -> float:
        """R': the reward time the budget's GPUs pay in the pipelined layouts."""
        return self.reward_s if self.placement == "shared" else 0.0


def costs_for(timestep_fraction: float, reward_over_sample: float = 0.0, *, sample_s: float = 1.0,
              update_over_sample: float = UPDATE_OVER_SAMPLE, **overheads) -> Costs:
    """Costs of SD1.5 at this timestep_fraction and reward cost (in units of S)."""
    return Costs(sample_s=sample_s, update_s=update_over_sample * timestep_fraction * sample_s,
                 reward_s=reward_over_sample * sample_s, **overheads)


def sample_seconds(peak_tflops: float = 989.0, mfu: float = 0.4) -> float:
    """S in seconds: 50 guided forwards at an assumed achieved fraction of the GPU's peak."""
    return STEPS * FORWARD_TFLOP / (peak_tflops * mfu)


# ----------------------------------------------------------------------------- the layouts


def disaggregated(c: Costs, g_s: int, g_l: int) -> dict:
    """Sampler and learner GPUs pipelined (max_policy_lag=1): the slower stage sets the pace."""
    if g_s < 1 or g_l < 1:
        raise ValueError("the disaggregated layout needs at least one sampler GPU and one learner GPU")
    n = c.epoch_samples
    sampler = n * (c.sample_s + c.reward_on_budget_s) / g_s + c.broadcast_s
    learner = n * c.update_s / g_l + c.steps_per_epoch * c.allreduce(g_l)
    epoch = max(sampler, learner)
    return {"samplers": g_s, "learners": g_l, "sampler_stage_s": sampler, "learner_stage_s": learner,
            "bound_by": "samplers" if sampler >= learner else "learners", "samples_per_s": n / epoch}


def splits(c: Costs, budget: int) -> list[dict]:
    return [disaggregated(c, g_s, budget - g_s) for g_s in range(1, budget)]


def best_split(c: Costs, budget: int) -> dict:
    """The integer split with the highest throughput (ties: the one with more samplers)."""
    return max(splits(c, budget), key=lambda r: (r["samples_per_s"], r["samplers"]))


def colocated_ddp(c: Costs, budget: int) -> float:
    """ddpo-pytorch: every GPU samples, scores and trains its share, in sequence, plus its all-reduce."""
    n = c.epoch_samples
    return n / (n * (c.sample_s + c.reward_s + c.update_s) / budget + c.steps_per_epoch * c.allreduce(budget))


def colocated_ray(c: Costs, budget: int) -> float:
    """A sampler and a learner per GPU, time-sharing it; the reward scored by reward actors."""
    n = c.epoch_samples
    per_gpu = n * (c.sample_s + c.reward_on_budget_s + c.update_s) / budget
    return n / (per_gpu + c.broadcast_s + c.steps_per_epoch * c.allreduce(budget))


def continuous_optimum_learners(c: Costs, budget: int) -> float:
    """g_l that balances the two stages with no overheads: g_l / g_s = U / (S + R')."""
    s = c.sample_s + c.reward_on_budget_s
    return budget * c.update_s / (s + c.update_s)


def compare(c: Costs, budget: int) -> dict:
    best = best_split(c, budget)
    ddp, ray_co = colocated_ddp(c, budget), colocated_ray(c, budget)
    return {"budget": budget, "best_split": f"{best['samplers']}:{best['learners']}", **{k: best[k] for k in ("samplers", "learners", "bound_by")},
            "disaggregated_samples_per_s": best["samples_per_s"], "colocated_ddp_samples_per_s": ddp,
            "colocated_ray_samples_per_s": ray_co, "disaggregated_over_ddp": best["samples_per_s"] / ddp,
            "colocated_ray_over_ddp": ray_co / ddp, "continuous_optimum_learners": continuous_optimum_learners(c, budget)}


def table(budgets, fractions, rewards, placement: str, **base) -> list[dict]:
    rows = []
    for f in fractions:
        for r in rewards:
            c = costs_for(f, r, placement=placement, **base)
            for g in budgets:
                rows.append({"timestep_fraction": f, "reward_over_sample": r, "placement": placement, **compare(c, g)})
    return rows


# ----------------------------------------------------------------------------- report


def _fmt_rows(rows: list[dict]) -> list[str]:
    out = ["| GPUs | timestep_fraction | reward R / S | best split (samplers:learners) | bound by | disaggregated samples/s | "
           "colocated DDP samples/s | ratio | colocated on Ray samples/s | ratio |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        below = " **(below)**" if r["disaggregated_over_ddp"] < 1 else ""
        out.append(f"| {r['budget']} | {r['timestep_fraction']:g} | {r['reward_over_sample']:g} | {r['best_split']} | {r['bound_by']} | "
                   f"{r['disaggregated_samples_per_s']:.2f} | {r['colocated_ddp_samples_per_s']:.2f} | "
                   f"{r['disaggregated_over_ddp']:.2f}x{below} | {r['colocated_ray_samples_per_s']:.2f} | {r['colocated_ray_over_ddp']:.2f}x |")
    return out


def _below(rows: list[dict]) -> str:
    lo = [r for r in rows if r["disaggregated_over_ddp"] < 1]
    if not lo:
        return "The best disaggregated split is at or above colocated DDP in every row."
    where = "; ".join(f"{r['budget']} GPUs f={r['timestep_fraction']:g} R={r['reward_over_sample']:g}S "
                      f"({r['disaggregated_over_ddp']:.2f}x)" for r in lo)
    return f"The best disaggregated split is BELOW colocated DDP in {len(lo)} of {len(rows)} rows: {where}."


def markdown(res: dict) -> str:
    p = res["parameters"]
    lines = [
        "# SIMULATED: disaggregated sampler/learner GPUs vs colocated layouts (SD1.5, LoRA rank 4)",
        "",
        "Every number here is SIMULATED: a closed-form model of per-image GPU costs, not a measurement "
        "(`python -m research.bench.split`; model: `research/bench/split.py`). Calibration comes from FLOP counts "
        f"(SD1.5 UNet, one guided call: {FORWARD_TFLOP} TFLOP forward, {FORWARD_BACKWARD_TFLOP} TFLOP forward+backward, "
        f"torch's FlopCounterMode, issue 18) and CPU-measured ratios (the tiny world's update/sampling cost per sample on "
        f"2 CPU cores: {p['cpu_update_over_sample']}), not from a GPU: no GPU has run this system.",
        "",
        f"- S = {p['sample_s']:.4f} s per image sampled (50 x {FORWARD_TFLOP} TFLOP at an ASSUMED {p['mfu']:.0%} of "
        f"{p['peak_tflops']:g} TFLOP/s); U = {p['update_over_sample']:.3f} x S x timestep_fraction; R = the reward column x S.",
        f"- Epoch: N = {p['epoch_samples']} samples, k = {p['steps_per_epoch']} optimizer steps (the sd15-ddpo preset); "
        f"broadcast B = {p['broadcast_s'] * 1e3:.1f} ms per version; all-reduce per optimizer step: "
        + ", ".join(f"{n} ranks {t * 1e3:.3f} ms" for n, t in p["allreduce_s_examples"].items()) + ".",
        "- Disaggregated: throughput = N / max(N (S + R') / g_s + B, N U / g_l + k A(g_l)) over every integer split; "
        "colocated DDP (ddpo-pytorch): N / (N (S + R + U) / G + k A(G)); colocated on Ray (a sampler and a learner "
        "time-sharing each GPU): N / (N (S + R' + U) / G + B + k A(G)).",
        "- Not modelled: GPU efficiency at small per-rank batches (a group of g_l learners splits each mini-batch g_l ways; "
        "the config needs train.batch_size >= num_learners), memory, the sampler's batch granularity, start-up, and "
        "ddpo-pytorch scoring a CPU reward in a thread pool while it samples (which would hide R for DDP too).",
        "",
    ]
    for placement, rows in res["tables"].items():
        what = {"separate": "Reward on its own hardware (R' = 0: hidden by the pipeline; DDP pays R in sequence)",
                "shared": "Reward on the budget's GPUs (R' = R: on the sampler GPUs, or on every GPU when colocated)"}[placement]
        lines += [f"## {what}", "", *_fmt_rows(rows), "", _below(rows), ""]
    if res.get("sensitivity"):
        s = res["sensitivity"]
        lines += [f"## Sensitivity: {s['what']}", "", *_fmt_rows(s["rows"]), "", _below(s["rows"]), ""]
    lines += ["## Findings", "", *[f"- {x}" for x in res["findings"]], ""]
    return "\n".join(lines)


def findings(res: dict) -> list[str]:
    sep, sh = res["tables"]["separate"], res["tables"]["shared"]
    out = []
    zero = [r for r in sep if r["reward_over_sample"] == 0]
    out.append("With no reward cost the best disaggregated split reaches "
               f"{min(r['disaggregated_over_ddp'] for r in zero):.2f}-{max(r['disaggregated_over_ddp'] for r in zero):.2f}x "
               "colocated DDP: with the same work per image, splitting GPUs between two stages can at best match "
               "every GPU doing both (G / (S + U)); whole GPUs round the ideal ratio g_l / g_s = U / S, and small budgets "
               "lose most.")
    for rows, name in ((sep, "reward on its own hardware"), (sh, "reward on the budget's GPUs")):
        lo = [r for r in rows if r["disaggregated_over_ddp"] < 1]
        out.append(f"{name}: disaggregated below 1.0x DDP in {len(lo)} of {len(rows)} rows "
                   f"(range {min(r['disaggregated_over_ddp'] for r in rows):.2f}-{max(r['disaggregated_over_ddp'] for r in rows):.2f}x).")
    co = [r["colocated_ray_over_ddp"] for r in sep]
    out.append(f"Colocated on Ray vs DDP, reward on its own hardware: {min(co):.2f}-{max(co):.2f}x (it gains what DDP spends "
               "scoring in sequence and loses the broadcast); with the reward on the budget's GPUs: "
               f"{min(r['colocated_ray_over_ddp'] for r in sh):.2f}-{max(r['colocated_ray_over_ddp'] for r in sh):.2f}x.")
    over = [(r["disaggregated_over_ddp"] / r["colocated_ray_over_ddp"], r) for r in sep]
    above = [f"{r['budget']} GPUs f={r['timestep_fraction']:g} R={r['reward_over_sample']:g}S ({x:.3f}x)" for x, r in over if x > 1]
    out.append(f"Disaggregated vs colocated on Ray, both with the reward on its own hardware: {min(x for x, _ in over):.2f}-"
               f"{max(x for x, _ in over):.2f}x; above 1.0x in {len(above)} of {len(over)} rows"
               + (f" ({'; '.join(above)}: the broadcast and a G-rank all-reduce sit in line with the colocated layout's short epoch, while the pipeline hides part of them)" if above else "")
               + ". Time-sharing each GPU needs no sampler:learner ratio; a split of whole GPUs loses what rounding U : S costs.")
    return out


def plot(res: dict, path: Path) -> None:
    from research.bench.common import pyplot

    plt = pyplot()
    fig_data = res["figure"]
    panels = fig_data["panels"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False, sharey=True)
    for ax, panel in zip(axes[0], panels):
        for line in panel["lines"]:
            xs = [r["learners"] for r in line["splits"]]
            l, = ax.plot(xs, [r["samples_per_s"] for r in line["splits"]], "o-", ms=3, label=f"disaggregated, f={line['timestep_fraction']:g}")
            ax.axhline(line["colocated_ddp"], color=l.get_color(), ls="--", lw=1, label=f"colocated DDP, f={line['timestep_fraction']:g}")
            ax.axhline(line["colocated_ray"], color=l.get_color(), ls=":", lw=1, label=f"colocated on Ray, f={line['timestep_fraction']:g}")
            best = max(line["splits"], key=lambda r: (r["samples_per_s"], r["samplers"]))
            ax.plot([best["learners"]], [best["samples_per_s"]], "*", ms=11, color=l.get_color())
        ax.set_xlabel(f"learner GPUs (of {fig_data['budget']}; the rest sample)")
        ax.set_title(f"SIMULATED, {fig_data['budget']} GPUs, reward R = {panel['reward_over_sample']:g} S ({panel['placement']})", fontsize=9)
        ax.set_xticks(range(1, fig_data["budget"], max(1, fig_data["budget"] // 8)))
    axes[0][0].set_ylabel("samples/s (SD1.5, SIMULATED)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(panels[0]["lines"]), fontsize=7)
    fig.suptitle("SIMULATED throughput vs sampler:learner split (FLOP-count calibration, no GPU run); star = best split", fontsize=9)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def cpu_ratio(systems_json: Path) -> float | None:
    """Update over sampling seconds per sample of the tiny world on this machine's CPU (all steps trained)."""
    try:
        cal = json.loads(systems_json.read_text())["overhead"]["calibration"]
        return cal["update_s_per_sample"] / (cal["sample_s_per_batch"] / cal["batch_size"])
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None


def run(budgets=(4, 8, 16, 64), fractions=(1.0, 0.5, 0.25), rewards=(0.0, 0.1, 0.5), figure_budget: int = 16,
        peak_tflops: float = 989.0, mfu: float = 0.4, broadcast_s: float = FLAT_BROADCAST_16_S, epoch_samples: int = 256,
        steps_per_epoch: int = 4, allreduce: AllReduce = AllReduce(), cpu_update_over_sample: float | None = None,
        sensitivity_allreduce_s: float | None = 0.05, sensitivity_broadcast_s: float = 0.5) -> dict:
    s = sample_seconds(peak_tflops, mfu)
    base = dict(sample_s=s, broadcast_s=broadcast_s, allreduce=allreduce, epoch_samples=epoch_samples, steps_per_epoch=steps_per_epoch)
    res = {"SIMULATED": True,
           "calibration": "FLOP counts of SD1.5's UNet (torch FlopCounterMode, issue 18) and CPU-measured ratios of the tiny world; "
                          "no GPU measurement",
           "parameters": {"sample_s": s, "peak_tflops": peak_tflops, "mfu": mfu, "forward_tflop": FORWARD_TFLOP,
                          "forward_backward_tflop": FORWARD_BACKWARD_TFLOP, "steps": STEPS, "update_over_sample": UPDATE_OVER_SAMPLE,
                          "cpu_update_over_sample": None if cpu_update_over_sample is None else round(cpu_update_over_sample, 3),
                          "broadcast_s": broadcast_s, "epoch_samples": epoch_samples, "steps_per_epoch": steps_per_epoch,
                          "allreduce": asdict(allreduce), "allreduce_s_examples": {n: allreduce(n) for n in (2, 4, 8, 16, 64)}},
           "tables": {p: table(budgets, fractions, rewards, p, **base) for p in PLACEMENTS}}
    if sensitivity_allreduce_s is not None:
        slow = replace(allreduce, fixed_s=sensitivity_allreduce_s)
        rows = table(budgets, fractions[:1], rewards[:1], "separate", **{**base, "allreduce": slow, "broadcast_s": sensitivity_broadcast_s})
        res["sensitivity"] = {"what": f"slow collectives: all-reduce {sensitivity_allreduce_s * 1e3:g} ms per optimizer step at any n > 1, "
                                      f"broadcast {sensitivity_broadcast_s * 1e3:g} ms per version "
                                      f"(timestep_fraction {fractions[0]:g}, R = {rewards[0]:g} S, reward separate)", "rows": rows}
    panels = []
    for r in rewards:
        lines = []
        for f in fractions:
            c = costs_for(f, r, placement="separate", **base)
            lines.append({"timestep_fraction": f, "splits": splits(c, figure_budget), "colocated_ddp": colocated_ddp(c, figure_budget),
                          "colocated_ray": colocated_ray(c, figure_budget)})
        panels.append({"reward_over_sample": r, "placement": "separate", "lines": lines})
    res["figure"] = {"budget": figure_budget, "panels": panels}
    res["findings"] = findings(res)
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 64])
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25], help="train.timestep_fraction values")
    ap.add_argument("--rewards", type=float, nargs="+", default=[0.0, 0.1, 0.5], help="reward cost per image, in units of S")
    ap.add_argument("--figure-budget", type=int, default=16)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--mfu", type=float, default=0.4, help="ASSUMED achieved fraction of the peak (sets S in seconds)")
    ap.add_argument("--broadcast-s", type=float, default=FLAT_BROADCAST_16_S)
    ap.add_argument("--allreduce-s", type=float, help="a fixed all-reduce time per optimizer step instead of the ring model")
    ap.add_argument("--preset", default="sd15-ddpo", help="N and k (samples and optimizer steps per epoch) from this preset")
    ap.add_argument("--out", help="default research/results/split")
    args = ap.parse_args(argv)
    from research.bench.common import RESULTS_DIR, log, out_dir, write_json
    from diffrlhf.deploy.config import load_config

    cfg = load_config(args.preset)
    n = cfg.samples_per_epoch()
    k = cfg.train.inner_epochs * math.ceil(n / (cfg.train.batch_size * cfg.train.grad_accum_steps))
    try:
        from research.bench.systems import sd15_lora_shapes

        params = sum(a * b for a, b in sd15_lora_shapes(cfg.model.lora_rank).values())
    except ImportError:
        params = SD15_LORA_RANK4_PARAMS
    allreduce = AllReduce(nbytes=params * 4, fixed_s=args.allreduce_s)
    res = run(args.budgets, args.fractions, args.rewards, args.figure_budget, args.peak_tflops, args.mfu, args.broadcast_s, n, k,
              allreduce, cpu_ratio(RESULTS_DIR / "systems" / "systems.json"))
    res["parameters"].update(preset=args.preset, lora_params=params)
    out = out_dir("split", args.out)
    write_json(out / "split.json", res)
    (out / "split.md").write_text(markdown(res))
    plot(res, out / "split.png")
    for line in res["findings"]:
        log("split", "SIMULATED: " + line)
    log("split", f"wrote {out / 'split.json'}, split.md, split.png")
    return res


if __name__ == "__main__":
    main()
