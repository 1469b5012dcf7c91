"""REAL (measured on this machine's CPU): a learner group of 2 against one learner, and the all-reduce.

    python -m research.bench.learner_group [--quick] [--repeats 3] [--threads 1] [--allreduce-repeats 20] [--out DIR]

Update throughput (trajectories/s) of
  1 learner x T torch threads   (PolicyLearner.update on the whole batch), against
  2 learners x T threads each   (two processes, one torch.distributed group over gloo on loopback:
                                 learner/distributed.py init_group + Group; each rank trains its rows of
                                 the plan of buffer/sharding.py shard_batch, gradients summed before
                                 every optimizer step, as the learner actors do),
on the same batches, side by side in one run: two processes are spawned once; rank 0 also holds the
single learner, and first samples the batches with the untrained policy (seeded advantages). Per repeat, on the same batch, the single learner's update (rank 1 waits in a
barrier) and the group's update (a barrier before and after; time = the slower rank's), their order
alternating between repeats. The first batch is a warm-up for both and is not timed. The single
learner and the group see the same batches in the same order, so their LoRAs should stay equal to
float tolerance (checked: `lora_max_abs_diff`).
Then the all-reduce time per optimizer step (Group.sum_grads_: flatten, all_reduce, copy back; and
Group.sum_ on the flat tensor alone) for fp32 gradients of the tiny model's LoRA and SD1.5's rank-4
and rank-32 LoRA on its attention projections (research/bench/systems.py sd15_lora_shapes: 797,184
and 6,377,472 parameters), median over repeats of the slower rank, after 2 warm-ups.

Default: the `tiny` preset (tiny-world model, 20 DDIM steps, 64 px, 32 trajectories per update in
mini-batches of 8). --quick: the tiny random model, 3 steps, 32 px, 8 trajectories per update,
2 repeats (checks the script; its numbers mean little). On a shared 2-core CPU, the two ranks get at
most the 2 cores; the machine's load average is recorded before and after.

Writes learner_group.json and learner_group.md into research/results/learner_group/ or --out.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from diffrlhf.actors.settings import build_policy, sampling_settings
from diffrlhf.buffer.sharding import shard_batch
from diffrlhf.buffer.trajectory import TrajectoryBatch
from research.bench.common import log, machine, median, out_dir, write_json
from research.bench.systems import sd15_lora_shapes
from diffrlhf.deploy.config import load_config
from diffrlhf.learner.distributed import Group, free_port, init_group
from diffrlhf.policy.prompts import load_prompts, plan_batch
from diffrlhf.policy.sampler import sample_trajectories

QUICK_OVERRIDES = ["model.name=tiny-random", "model.device=cpu", "sample.num_steps=3", "sample.resolution=32",
                   "sample.batch_size=4", "sample.batches_per_epoch=2", "train.batch_size=4", "run.image_grid_every=0",
                   "run.tensorboard=false"]
FULL_OVERRIDES = ["model.device=cpu", "run.image_grid_every=0", "run.tensorboard=false"]
SD15_RANKS = (4, 32)


def _cfg(overrides):

    return load_config("tiny", overrides=list(overrides))


def make_batches(cfg, comps, learner, n: int, folder: Path) -> list[str]:
    """n update batches (one epoch of samples each) sampled by the model before any update, with seeded advantages."""

    settings, prompts, paths = sampling_settings(cfg), load_prompts(cfg.prompts.train), []
    s = cfg.sample
    for epoch in range(n):
        parts = []
        for bi in range(s.batches_per_epoch):
            plan = plan_batch(prompts, cfg.run.seed, epoch, bi, s.batch_size, s.batches_per_epoch, s.samples_per_prompt)
            parts.append(sample_trajectories(comps, plan.prompts, plan.seeds, settings, 0, plan.sample_ids, learner.negative_embeds))
        batch = TrajectoryBatch.cat(parts)
        batch.rewards = torch.zeros(len(batch))
        batch.advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(epoch))
        paths.append(str(folder / f"batch{epoch}.arrow"))
        batch.save(paths[-1])
    return paths


def _grads(shapes) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.zeros(s))
        p.grad = torch.randn(s, generator=gen)
        params.append(p)
    return params


def _allreduce_times(group, shapes, repeats: int) -> dict:
    """This rank's seconds per call of Group.sum_grads_ (what an optimizer step does) and of Group.sum_
    on one flat tensor of the same size (the collective alone)."""
    import torch.distributed as dist

    params = _grads(shapes)
    flat = torch.randn(sum(p.numel() for p in params))
    out = {"params": int(flat.numel()), "tensors": len(params), "sum_grads_s": [], "flat_sum_s": []}
    for i in range(repeats + 2):
        for key, fn in (("sum_grads_s", lambda: group.sum_grads_(params)), ("flat_sum_s", lambda: group.sum_(flat))):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i >= 2:  # two warm-ups
                out[key].append(dt)
    return out


def _worker(rank: int, world: int, port: int, overrides, n_batches: int, threads: int, allreduce_repeats: int, folder: str) -> None:
    import torch.distributed as dist


    torch.set_num_threads(threads)
    cfg = _cfg(overrides)
    _, member = build_policy(cfg)
    solo_comps, solo = build_policy(cfg) if rank == 0 else (None, None)  # the single learner: a world of 1 (its own Group())
    init_group("127.0.0.1", port, rank, world, "cpu", timeout_s=1800)
    member.group = Group.current()
    if rank == 0:  # the batches, sampled once by the untrained policy (with its torch threads) and read by both ranks
        t0 = time.perf_counter()
        make_batches(cfg, solo_comps, solo, n_batches, Path(folder))
        Path(folder, "sampling_s").write_text(str(time.perf_counter() - t0))
    dist.barrier()
    paths = [str(Path(folder, f"batch{i}.arrow")) for i in range(n_batches)]
    rows = []
    for i, path in enumerate(paths):
        batch = TrajectoryBatch.load(path)
        part, shard = shard_batch(batch, cfg.train.batch_size, world, cfg.run.seed, member.version)[rank]
        order = ("solo", "group") if i % 2 == 0 else ("group", "solo")
        rec = {"batch": i, "rows": len(batch), "order": list(order), "warmup": i == 0}
        for phase in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if phase == "group":
                stats = member.update(part, shard)
            elif solo is not None:
                stats = solo.update(batch)
            else:
                stats = None  # rank 1 waits in the barrier below while the single learner trains
            work_s = time.perf_counter() - t0
            dist.barrier()
            # the group's time includes waiting for the other rank; the single learner's is its own update
            rec[f"{phase}_s"] = work_s if phase == "solo" else time.perf_counter() - t0
            rec[f"{phase}_cpu_s"] = time.process_time() - c0
            if stats is not None:
                rec[f"{phase}_stats"] = {k: stats[k] for k in ("optimizer_steps", "learner_passes", "learner_calls", "loss") if k in stats}
        rows.append(rec)
    out = {"rank": rank, "rows": rows, "threads": torch.get_num_threads()}
    if solo is not None:
        diff = max((solo.lora_state()[n] - t).abs().max().item() for n, t in member.lora_state().items())
        out["lora_max_abs_diff"] = diff
        out["lora_max_abs_value"] = max(t.abs().max().item() for t in member.lora_state().values())
    tiny_shapes = [p.shape for p in member.params]
    out["allreduce"] = {"tiny": _allreduce_times(member.group, tiny_shapes, allreduce_repeats)}
    for r in SD15_RANKS:
        out["allreduce"][f"sd15_rank{r}"] = _allreduce_times(member.group, list(sd15_lora_shapes(r).values()), allreduce_repeats)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def summarize(ranks: list[dict]) -> dict:
    """Per repeat: the single learner's time (rank 0), the group's (the slower rank's); medians over repeats."""

    r0, r1 = ranks
    reps = []
    for a, b in zip(r0["rows"], r1["rows"]):
        if a["warmup"]:
            continue
        group_s = max(a["group_s"], b["group_s"])
        reps.append({"batch": a["batch"], "rows": a["rows"], "order": a["order"], "single_s": a["solo_s"], "group_s": group_s,
                     "single_traj_per_s": a["rows"] / a["solo_s"], "group_traj_per_s": a["rows"] / group_s,
                     "speedup": a["solo_s"] / group_s, "idle_rank_cpu_s_during_single": b["solo_cpu_s"],
                     # CPU seconds: the work itself, whatever share of the cores other jobs left (the group's: both ranks)
                     "single_cpu_s": a["solo_cpu_s"], "group_cpu_s": a["group_cpu_s"] + b["group_cpu_s"],
                     "single_stats": a.get("solo_stats"), "group_stats": a.get("group_stats")})
    single, group = median([r["single_traj_per_s"] for r in reps]), median([r["group_traj_per_s"] for r in reps])
    allreduce = {}
    for key in r0["allreduce"]:
        a, b = r0["allreduce"][key], r1["allreduce"][key]
        allreduce[key] = {"params": a["params"], "tensors": a["tensors"], "mbytes_fp32": a["params"] * 4 / 1e6,
                          **{f"{k[:-2]}_median_s": median([max(x, y) for x, y in zip(a[k], b[k])]) for k in ("sum_grads_s", "flat_sum_s")},
                          **{f"{k[:-2]}_min_s": min(max(x, y) for x, y in zip(a[k], b[k])) for k in ("sum_grads_s", "flat_sum_s")},
                          "repeats": len(a["sum_grads_s"])}
    return {"repeats": reps, "single_traj_per_s_median": single, "group_traj_per_s_median": group, "speedup_median": group / single,
            "speedup_per_repeat_median": median([r["speedup"] for r in reps]), "efficiency": group / single / 2,
            "lora_max_abs_diff": r0.get("lora_max_abs_diff"), "lora_max_abs_value": r0.get("lora_max_abs_value"),
            "allreduce": allreduce}


def _loads(xs) -> str:
    return "/".join(f"{x:.1f}" for x in xs) if xs else "?"


def markdown(res: dict) -> str:
    s, c = res["summary"], res["config"]
    lines = [
        f"# Learner group on this machine's CPU: 1 learner x {c['threads']} thread vs 2 learners x {c['threads']} thread (REAL, {res['mode']})",
        "",
        f"`python -m research.bench.learner_group{' --quick' if res['mode'] == 'quick' else ''}`. Model {c['model']}, "
        f"{c['num_steps']} DDIM steps, {c['resolution']} px; {c['rows_per_update']} trajectories per update in mini-batches of "
        f"{c['train_batch_size']} (x{c['grad_accum_steps']} accumulation), timestep_fraction {c['timestep_fraction']:g}, "
        f"weighting {c['weighting']}. torch.distributed gloo over loopback, 2 processes. Machine: {res['machine']['cpu_count']} CPUs, "
        f"load average {_loads(res['machine']['load_average'])} before, {_loads(res['load_average_after'])} after "
        "(other jobs share the cores: compare the CPU seconds too).",
        "",
        "| repeat (batch) | order | 1 learner s | 2 learners s | 1 learner traj/s | 2 learners traj/s | speedup | "
        "CPU s: 1 learner | CPU s: 2 learners (both ranks) | idle rank CPU s while 1 learner ran |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in s["repeats"]:
        lines.append(f"| {r['batch']} | {' then '.join('1' if o == 'solo' else '2' for o in r['order'])} | {r['single_s']:.2f} | "
                     f"{r['group_s']:.2f} | {r['single_traj_per_s']:.2f} | {r['group_traj_per_s']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['single_cpu_s']:.2f} | {r['group_cpu_s']:.2f} | {r['idle_rank_cpu_s_during_single']:.3f} |")
    lines += [
        "",
        f"Median: 1 learner {s['single_traj_per_s_median']:.2f} trajectories/s, 2 learners {s['group_traj_per_s_median']:.2f} "
        f"trajectories/s: **{s['speedup_median']:.2f}x** ({100 * s['efficiency']:.0f}% of linear). The single learner's and the "
        f"group's LoRA after the same updates differ by at most {s['lora_max_abs_diff']:.2e} (largest LoRA value "
        f"{s['lora_max_abs_value']:.2e}).",
        "",
        "All-reduce per optimizer step (fp32 gradients; median of the slower rank over "
        f"{next(iter(s['allreduce'].values()))['repeats']} repeats, gloo, 2 processes on one machine):",
        "",
        "| gradients | params | MB | Group.sum_grads_ (flatten + all_reduce + copy back) | all_reduce of the flat tensor alone |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key, a in s["allreduce"].items():
        name = {"tiny": "the tiny model's LoRA"}.get(key, key.replace("sd15_rank", "SD1.5 LoRA rank "))
        lines.append(f"| {name} | {a['params']:,} | {a['mbytes_fp32']:.1f} | {a['sum_grads_median_s'] * 1e3:.2f} ms | "
                     f"{a['flat_sum_median_s'] * 1e3:.2f} ms |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny random model, 2 repeats: checks the script in well under 2 minutes")
    ap.add_argument("--repeats", type=int, help="timed updates per layout (default 3, quick 2), after one warm-up")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per learner process")
    ap.add_argument("--allreduce-repeats", type=int, help="default 20 (quick 5)")
    ap.add_argument("--out", help="default research/results/learner_group")
    ap.add_argument("overrides", nargs="*", help="config overrides on the tiny preset, key.sub=value")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from research.bench import learner_group as this  # spawned processes import the worker by this name

    mode = "quick" if args.quick else "full"
    overrides = [*(QUICK_OVERRIDES if args.quick else FULL_OVERRIDES), *args.overrides]
    repeats = args.repeats or (2 if args.quick else 3)
    ar_repeats = args.allreduce_repeats or (5 if args.quick else 20)
    cfg = _cfg(overrides)
    res = {"REAL": True, "mode": mode, "machine": machine(), "overrides": overrides,
           "config": {"model": cfg.model.name, "num_steps": cfg.sample.num_steps, "resolution": cfg.sample.resolution,
                      "rows_per_update": cfg.samples_per_epoch(), "train_batch_size": cfg.train.batch_size,
                      "grad_accum_steps": cfg.train.grad_accum_steps, "timestep_fraction": cfg.train.timestep_fraction,
                      "weighting": cfg.weighting.scheme, "threads": args.threads, "world": 2, "backend": "gloo",
                      "repeats": repeats, "warmup_updates": 1}}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="diffrlhf-lgroup-") as tmp:
        log("learner_group", f"{mode}: 2 learner processes x {args.threads} thread(s); rank 0 samples {repeats + 1} batches of "
                             f"{cfg.samples_per_epoch()} trajectories ({cfg.model.name}), then {repeats + 1} updates per layout")
        mp.spawn(this._worker, args=(2, free_port(), overrides, repeats + 1, args.threads, ar_repeats, tmp), nprocs=2, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
        res["sampling_s"] = float(Path(tmp, "sampling_s").read_text())
    res["load_average_after"] = list(os.getloadavg())
    res["summary"] = summary = summarize(ranks)
    res["ranks"] = ranks
    res["wall_s"] = time.time() - t0
    out = out_dir("learner_group", args.out)
    write_json(out / "learner_group.json", res)
    (out / "learner_group.md").write_text(markdown(res))
    for r in summary["repeats"]:
        log("learner_group", f"batch {r['batch']}: 1 learner {r['single_traj_per_s']:.2f} traj/s, 2 learners {r['group_traj_per_s']:.2f} "
                             f"traj/s ({r['speedup']:.2f}x)")
    log("learner_group", f"median: 1 learner {summary['single_traj_per_s_median']:.2f}, 2 learners {summary['group_traj_per_s_median']:.2f} "
                         f"trajectories/s ({summary['speedup_median']:.2f}x); LoRA max |diff| {summary['lora_max_abs_diff']:.2e}")
    for key, a in summary["allreduce"].items():
        log("learner_group", f"all-reduce {key} ({a['params']:,} params): sum_grads_ {a['sum_grads_median_s'] * 1e3:.2f} ms, "
                             f"flat all_reduce {a['flat_sum_median_s'] * 1e3:.2f} ms (median)")
    log("learner_group", f"wrote {out / 'learner_group.json'} and learner_group.md in {res['wall_s']:.0f}s")
    return res


if __name__ == "__main__":
    main()
