"""Systems benchmarks of the Ray pipeline, in one local Ray.

    python -m research.bench.systems [--parts overhead overlap scale broadcast] [--size tiny|full]
        [--epochs 6] [--samplers 1 2 4 8 16] [--rewards 1 2 3 4] [--calib FILE.json] [--out DIR] [key.sub=value ...]

overhead   samples/s of the Ray system vs the single-process reference loop on the same config
           (1 sampler, 1 reward actor, max_policy_lag=0, same torch threads), side by side in one
           run; steady state (the first epoch, with its warm-up, is left out when there are >= 2).
overlap    max_policy_lag 1 and 0: wall time per epoch vs each stage's time per epoch (sampling,
           scoring, buffer, learning = the role's busy time / its actor count / epochs) and every
           role's idle fraction. Perfect overlap: wall = slowest stage; none: wall = sum of stages.
scale      SIMULATED: samplers, reward actors and the learner replaced by subclasses that sleep
           for calibrated times (measured here by a short reference run, or --calib) and return
           synthetic trajectory batches of the real shapes; throughput for each (samplers, reward
           actors) pair vs linear scaling from 1 sampler and vs the pipeline bound
           samples / max(sampling, scoring, learning time per epoch). The learner is a stage too:
           a second sweep sets its time to zero to show the samplers' own scaling.
broadcast  time from one ray.put of a LoRA to N actors (num_cpus=0.01) all holding it (copied
           into their own tensors, as samplers do), for SD1.5's rank-4 LoRA shapes (256 tensors,
           797,184 fp32 params) and rank 32 (8x), in two forms side by side: "dict" (a dict of
           torch tensors, the broadcast before the flat form, copied tensor by tensor) and "flat"
           (learner/lora.py FlatLoRA: one contiguous numpy buffer + names/shapes, read zero-copy
           from the store and copied in one go into tensors that tile one buffer, as a sampler's
           LoRA does; what the system broadcasts now), and beside them Ray's floor ("noop": the
           flat form's reference delivered to a method that loads nothing). Repeats interleave the
           forms (dict, flat, noop, dict, ...); median/min/max of --repeats per form and the ratio
           dict/flat (JSON "schema": 2; schema-1 files hold the dict form only, still plotted).

Writes systems.json (+ scale.png, broadcast.png, overlap.png) into research/results/systems/ or --out.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from diffrlhf.actors.driver import Driver
from diffrlhf.actors.reference_loop import run_reference
from diffrlhf.actors.workers import LearnerWorker, RewardWorker, SamplerWorker, timed
from diffrlhf.buffer.trajectory import TrajectoryBatch
from research.bench.common import TINY_OVERRIDES, log, machine, median, out_dir, pyplot, write_json
from diffrlhf.learner.lora import copy_flat_into, flatten_lora_state, one_tensor_under, tile_in_one_tensor
from diffrlhf.rewards.serving import ScoreResult

PARTS = ["overhead", "overlap", "scale", "broadcast"]
# The driver checkpoints every run.save_every epochs inside its loop; the reference loop never
# does. Timed runs checkpoint only once, after the last epoch's wall time is taken.
NO_CHECKPOINTS = ["run.save_every=1000"]
PART_SIZES = {  # what --size runs: epochs, config overrides and sweep ranges of the parts
    "tiny": dict(epochs=2, overrides=TINY_OVERRIDES + ["system.num_samplers=1"], samplers=[1, 2], rewards=[1],
                 sim_epochs=2, sim_batches=2, learner_free=False, ns=[1, 2], ranks=[4], repeats=2),
    "full": dict(epochs=6, overrides=["model.device=cpu", "run.image_grid_every=0", "run.tensorboard=false"],
                 samplers=[1, 2, 4, 8, 16], rewards=[1, 2, 3, 4], sim_epochs=3, sim_batches=16, learner_free=True,
                 ns=[1, 2, 4, 8, 16], ranks=[4, 32], repeats=7),
}


def config(overrides, *extra):
    from diffrlhf.deploy.config import load_config

    return load_config("tiny", overrides=[*overrides, *extra])


def steady(records: list[dict], key_time) -> tuple[int, float]:
    """(samples, seconds) over the epochs after the first (all, if there is only one)."""
    skip = 1 if len(records) >= 2 else 0
    samples = sum(r["samples"] for r in records[skip:])
    return samples, key_time(records, skip)


def ray_seconds(records, skip):
    return records[-1]["wall_s"] - (records[skip - 1]["wall_s"] if skip else 0.0)


def ref_seconds(records, skip):
    return sum(r["time_epoch"] for r in records[skip:])


# ----------------------------------------------------------------------------- running the system


def run_reference_timed(cfg, on_epoch=None) -> list[dict]:
    """The reference loop with the actors' torch thread count, so both sides use the same kernels."""


    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.system.torch_threads)
    try:
        return run_reference(cfg, progress=False, on_epoch=on_epoch)
    finally:
        torch.set_num_threads(threads)


def run_driver(cfg, worker_classes=None, tag="") -> dict:
    """One Driver run in a scratch folder; returns records, role stats, total and start-up seconds."""

    with tempfile.TemporaryDirectory(prefix="diffrlhf-bench-") as tmp:
        d = Driver(cfg, Path(tmp) / "run", progress=False, worker_classes=worker_classes)
        t0 = time.time()
        try:
            records = d.run()
        finally:
            total = time.time() - t0
            d.shutdown()
    wall = records[-1]["wall_s"]
    log("systems", f"{tag}: {len(records)} epochs, {wall:.1f}s after {total - wall:.1f}s of actor start-up")
    return {"records": records, "role_stats": d.role_stats, "total_s": total, "startup_s": total - wall}


def start_bench_ray(num_cpus: int):
    """One local Ray for every part. Logical CPUs are only a placement budget here: the
    simulated actors sleep and the broadcast actors ask for 0.01 CPU."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    return True


# ----------------------------------------------------------------------------- (a) overhead


def overhead(overrides, epochs: int, shapes_out: dict) -> dict:
    cfg = config(overrides, f"train.epochs={epochs}", "system.num_samplers=1", "system.num_reward_actors=1",
                 "system.max_policy_lag=0", *NO_CHECKPOINTS)
    log("systems", "overhead: reference loop")
    ref = run_reference_timed(cfg, on_epoch=lambda e, b, l: shapes_out.update(batch_shapes(b)))
    log("systems", "overhead: Ray system, same config")
    sysrun = run_driver(cfg, tag="overhead Ray")
    n_ref, s_ref = steady(ref, ref_seconds)
    n_ray, s_ray = steady(sysrun["records"], ray_seconds)
    ref_sps, ray_sps = n_ref / s_ref, n_ray / s_ray
    log("systems", f"overhead: reference {ref_sps:.2f} samples/s, Ray {ray_sps:.2f} samples/s (ratio {ray_sps / ref_sps:.3f})")
    return {"config": {"epochs": epochs, "samples_per_epoch": cfg.samples_per_epoch(), "num_samplers": 1,
                       "num_reward_actors": 1, "max_policy_lag": 0, "torch_threads": cfg.system.torch_threads},
            "reference_samples_per_s": ref_sps, "ray_samples_per_s": ray_sps, "ratio_ray_over_reference": ray_sps / ref_sps,
            "ray_startup_s": sysrun["startup_s"], "reference_records": ref, "ray_records": sysrun["records"],
            "calibration": calibration_from(ref, cfg), "_ray_run": sysrun, "_cfg_key": cfg.to_dict()}


def calibration_from(records: list[dict], cfg) -> dict:
    """Per-batch stage times from a reference run (steady-state epochs) for the scale simulation."""
    skip = 1 if len(records) >= 2 else 0
    rs = records[skip:]
    nb, n = cfg.sample.batches_per_epoch, cfg.samples_per_epoch()
    return {"source": "reference loop on this machine", "batch_size": cfg.sample.batch_size,
            "sample_s_per_batch": float(np.mean([r["time_sample"] for r in rs])) / nb,
            "score_s_per_batch": float(np.mean([r["time_score"] for r in rs])) / nb,
            "update_s_per_sample": float(np.mean([r["time_update"] for r in rs])) / n}


def batch_shapes(batch) -> dict:
    return {"shapes": {"latents": list(batch.latents.shape[1:]), "prompt_embeds": list(batch.prompt_embeds.shape[1:]),
                       "images": list(batch.images.shape[1:])}}


# ----------------------------------------------------------------------------- (b) overlap


def stage_times(run: dict, epochs: int) -> dict:
    """Seconds per epoch each stage is busy: role busy time / number of actors of the role / epochs."""
    by_role: dict[str, list[float]] = {}
    for s in run["role_stats"]:
        role = s.get("role", "unknown").split("-")[0]
        by_role.setdefault(role, []).append(s.get("busy_s", float("nan")))
    names = {"sampler": "sampling", "reward": "scoring", "buffer": "buffer", "learner": "learning"}
    return {names.get(r, r): float(np.sum(v)) / len(v) / epochs for r, v in by_role.items()}


def overlap_one(run: dict, lag: int) -> dict:
    recs = run["records"]
    wall = recs[-1]["wall_s"] / len(recs)
    stages = stage_times(run, len(recs))
    slowest = max(stages, key=stages.get)
    return {"max_policy_lag": lag, "epochs": len(recs), "wall_s_per_epoch": wall, "stage_s_per_epoch": stages,
            "slowest_stage": slowest, "wall_over_slowest": wall / stages[slowest], "wall_over_sum": wall / sum(stages.values()),
            "idle_fraction": {s["role"]: s.get("idle_fraction") for s in run["role_stats"]},
            "policy_lag_max": max(r.get("policy_lag_max", 0) for r in recs)}


def overlap(overrides, epochs: int, reuse: dict | None) -> dict:
    out = {}
    for lag in (1, 0):
        cfg = config(overrides, f"train.epochs={epochs}", f"system.max_policy_lag={lag}", *NO_CHECKPOINTS)
        if reuse and reuse["_cfg_key"] == cfg.to_dict():
            run = reuse["_ray_run"]  # the overhead part already ran exactly this
        else:
            run = run_driver(cfg, tag=f"overlap lag {lag}")
        out[f"lag{lag}"] = r = overlap_one(run, lag)
        log("systems", f"overlap lag {lag}: {r['wall_s_per_epoch']:.2f}s/epoch; stages "
                       + ", ".join(f"{k} {v:.2f}s" for k, v in r["stage_s_per_epoch"].items())
                       + f"; wall/slowest {r['wall_over_slowest']:.2f}, wall/sum {r['wall_over_sum']:.2f}")
    out["num_samplers"], out["num_reward_actors"] = cfg.system.num_samplers, cfg.system.num_reward_actors
    return out


# ----------------------------------------------------------------------------- (c) scale simulation


def sim_classes(calib: dict) -> dict:
    """SIMULATED roles: sleep for the calibrated time instead of computing.

    Defined in a function so cloudpickle ships them by value to the actor processes (as the
    system tests do); class attributes carry the calibration.
    """


    shapes = calib["shapes"]

    def synthetic_batch(plan, version: int) -> TrajectoryBatch:
        b, steps = len(plan.prompts), shapes["latents"][0] - 1
        return TrajectoryBatch(
            prompts=list(plan.prompts), latents=torch.zeros(b, *shapes["latents"]),
            timesteps=torch.arange(steps, 0, -1).repeat(b, 1), log_probs=torch.zeros(b, steps),
            prompt_embeds=torch.zeros(b, *shapes["prompt_embeds"]), images=torch.zeros(b, *shapes["images"], dtype=torch.uint8),
            seeds=torch.as_tensor(plan.seeds), policy_version=torch.full((b,), version), sample_ids=torch.as_tensor(plan.sample_ids),
            meta={"simulated": True})

    class SimSampler(SamplerWorker):
        def __init__(self, cfg, rank: int = 0):
            self._init_role(cfg, f"sampler-{rank}")
            self.version = -1

        @timed
        def sample(self, plan, weights):
            t0 = time.perf_counter()
            self.version = weights[0]
            time.sleep(calib["sample_s_per_batch"] * len(plan.prompts) / calib["batch_size"])
            batch = synthetic_batch(plan, self.version)
            rin = {"ids": list(plan.sample_ids), "images": batch.images.numpy(), "prompts": batch.prompts}
            return {"version": self.version, "rows": len(batch), "sample_s": time.perf_counter() - t0, "simulated": True}, rin, batch

    class SimReward(RewardWorker):
        def __init__(self, cfg, rank: int = 0):
            self._init_role(cfg, f"reward-{rank}")
            self.rng = np.random.default_rng(rank)

        @timed
        def score(self, reward_input):
            n = len(reward_input["ids"])
            time.sleep(calib["score_s_per_batch"] * n / calib["batch_size"])
            return ScoreResult(list(reward_input["ids"]), self.rng.standard_normal(n).astype(np.float32))

    class SimLearner(LearnerWorker):
        def __init__(self, cfg):
            self._init_role(cfg, "learner")
            self.version, self.lora = 0, flatten_lora_state({"simulated": torch.zeros(1)})

        @timed
        def update(self, training_batch):
            time.sleep(calib["update_s_per_sample"] * len(training_batch))
            self.version += 1
            fresh = training_batch.policy_version[~training_batch.replayed]
            lag = self.version - 1 - fresh
            return ({"simulated": True, "loss": 0.0, "policy_version": self.version, "policy_lag_max": int(lag.max()),
                     "policy_lag_mean": float(lag.double().mean())}, (self.version, self.lora))

        def weights(self):
            return self.version, self.lora

        def state_dict(self):
            return {"version": self.version}

        def load_state_dict(self, state):
            self.version = state["version"]

        def save_lora(self, folder):
            return str(folder)

    return {"sampler": SimSampler, "reward": SimReward, "learner": SimLearner}


def pipeline_bound(calib: dict, n_samplers: int, n_rewards: int, batches: int) -> float:
    """Samples/s if the slowest stage were busy all the time (lag >= 1 overlaps the stages)."""
    bs = calib["batch_size"]
    sampling = np.ceil(batches / n_samplers) * calib["sample_s_per_batch"]
    scoring = np.ceil(batches / n_rewards) * calib["score_s_per_batch"]
    learning = calib["update_s_per_sample"] * batches * bs
    return batches * bs / max(sampling, scoring, learning)


TIME_KEYS = ("sample_s_per_batch", "score_s_per_batch", "update_s_per_sample")


def scale(overrides, calib: dict, samplers, rewards, epochs: int, batches: int, learner_free: bool, speedup: float = 1.0) -> dict:
    """speedup K > 1 sleeps time/K and reports samples/s / K: shorter runs, and conservative,
    since Ray's own per-batch overhead then weighs K times more than in reality."""
    bs = calib["batch_size"]
    base = [*overrides, f"train.epochs={epochs}", f"sample.batch_size={bs}", f"sample.batches_per_epoch={batches}",
            f"train.batch_size={bs}", "system.max_policy_lag=1", "system.sampler_cpus=0.05", "system.reward_cpus=0.05",
            "system.learner_cpus=0.05", *NO_CHECKPOINTS, "system.max_inflight_per_sampler=1"]
    fast = {**calib, **{k: calib[k] / speedup for k in TIME_KEYS}}
    sweeps = {"learner_calibrated": fast}
    if learner_free:
        sweeps["learner_free"] = {**fast, "update_s_per_sample": 0.0}
    out = {"SIMULATED": True, "calibration": calib, "speedup": speedup, "epochs": epochs, "batches_per_epoch": batches, "sweeps": {}}
    for name, c in sweeps.items():
        classes = sim_classes(c)
        grid = [(n, r) for r in rewards for n in samplers] if name == "learner_calibrated" else [(n, max(rewards)) for n in samplers]
        rows = []
        for n, r in grid:
            cfg = config(base, f"system.num_samplers={n}", f"system.num_reward_actors={r}")
            run = run_driver(cfg, worker_classes=classes, tag=f"SIMULATED {name} samplers={n} rewards={r}")
            k, s = steady(run["records"], ray_seconds)
            rows.append({"samplers": n, "reward_actors": r, "samples_per_s": k / s / speedup,
                         "bound_samples_per_s": pipeline_bound(c, n, r, batches) / speedup, "startup_s": run["startup_s"],
                         "idle_fraction": {st["role"]: st.get("idle_fraction") for st in run["role_stats"]}})
            log("systems", f"SIMULATED {name} samplers={n} rewards={r}: {rows[-1]['samples_per_s']:.2f} samples/s "
                           f"(pipeline bound {rows[-1]['bound_samples_per_s']:.2f})")
        for row in rows:  # linear: the 1-sampler throughput of the same reward-actor count, times N
            one = [x for x in rows if x["reward_actors"] == row["reward_actors"] and x["samplers"] == min(samplers)]
            row["linear_samples_per_s"] = one[0]["samples_per_s"] * row["samplers"] / min(samplers) if one else None
        out["sweeps"][name] = rows
    return out


def _finish(plt, fig, ax, title: str, path: Path, **legend) -> None:
    """Title, legend and save: the same ending for every figure of this benchmark."""
    ax.set_title(title, fontsize=9)
    ax.legend(**{"fontsize": 7, **legend})
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_scale(res: dict, path: Path) -> None:
    plt = pyplot()
    sweeps = res["sweeps"]
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5.5 * len(sweeps), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], sweeps.items()):
        for r in sorted({x["reward_actors"] for x in rows}):
            xs = [x for x in rows if x["reward_actors"] == r]
            n = [x["samplers"] for x in xs]
            line, = ax.plot(n, [x["samples_per_s"] for x in xs], "o-", label=f"measured, {r} reward actor(s)")
            ax.plot(n, [x["bound_samples_per_s"] for x in xs], ":", color=line.get_color(), label=f"pipeline bound, {r}")
        first = [x for x in rows if x["reward_actors"] == min(x["reward_actors"] for x in rows)]
        ax.plot([x["samplers"] for x in first], [x["linear_samples_per_s"] for x in first], "k--", lw=1, label="linear")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("samplers")
        ax.set_ylabel("samples/s")
        ax.set_title(f"SIMULATED (calibrated sleeps): {name}", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------- (d) weight broadcast


def sd15_lora_shapes(rank: int) -> dict[str, tuple[int, int]]:
    """SD1.5's UNet LoRA on to_q/to_k/to_v/to_out.0 (peft names), from its architecture without
    building it: 16 transformer blocks (down 2x320, 2x640, 2x1280; mid 1280; up 3x1280, 3x640,
    3x320); self-attention c -> c; cross-attention keys/values 768 -> c. Rank 4: 256 tensors,
    797,184 parameters."""
    blocks = [("down_blocks.0", 320, 2), ("down_blocks.1", 640, 2), ("down_blocks.2", 1280, 2), ("mid_block", 1280, 1),
              ("up_blocks.1", 1280, 3), ("up_blocks.2", 640, 3), ("up_blocks.3", 320, 3)]
    shapes = {}
    for prefix, c, n in blocks:
        for i in range(n):
            for attn, kv_in in (("attn1", c), ("attn2", 768)):
                for proj, fan_in in (("to_q", c), ("to_k", kv_in), ("to_v", kv_in), ("to_out.0", c)):
                    name = f"{prefix}.attentions.{i}.transformer_blocks.0.{attn}.{proj}"
                    shapes[f"{name}.lora_A.weight"] = (rank, fan_in)
                    shapes[f"{name}.lora_B.weight"] = (c, rank)
    return shapes


BROADCAST_FORMS = ("dict", "flat")
# Ray's own floor, measured beside them: the flat form's ObjectRef delivered to a method that loads
# nothing (put, dispatch, fetch and unpickling of the metadata; no copy).
BROADCAST_MEASURED = (*BROADCAST_FORMS, "noop")


def holder_class():
    import ray

    @ray.remote(num_cpus=0.01)
    class Holder:
        """A stand-in sampler: keeps its own copy of the LoRA tensors and loads broadcasts into it.
        Its tensors tile one buffer, as a SamplerWorker's LoRA parameters do (tile_lora_parameters)."""

        def __init__(self, shapes):
            torch.set_num_threads(1)
            self.params = {n: torch.empty(s) for n, s in shapes.items()}
            tile_in_one_tensor(self.params)

        def load_dict(self, weights) -> float:
            version, state = weights  # Ray resolved the ObjectRef argument before this call
            for n, t in state.items():
                self.params[n].copy_(t)
            return time.time()

        def load_flat(self, weights) -> float:
            version, flat = weights
            copy_flat_into(self.params, flat)  # what SamplerWorker.set_weights does (load_flat_lora): one copy
            return time.time()

        def load_noop(self, weights) -> float:
            return time.time()

        def flat_checks(self, weights) -> tuple[bool, bool]:
            """(the buffer this actor got is a read-only view of the store, not its own copy;
            it loads with one copy)."""
            buf = weights[1].buffer
            return not buf.flags.writeable and not buf.flags.owndata, one_tensor_under(self.params, weights[1]) is not None

    return Holder


def _form_stats(times: list[float], puts: list[float]) -> dict:
    return {"median_s": median(times), "min_s": min(times), "max_s": max(times), "put_median_s": median(puts)}


def broadcast(ns, ranks, repeats: int) -> dict:
    import ray

    Holder = holder_class()
    out = {"schema": 2, "machine": machine(), "ranks": {}, "repeats": repeats,
           "forms": {"dict": "(version, {name: torch tensor}): each tensor pickled on its own",
                     "flat": "(version, FlatLoRA): one contiguous numpy buffer + names/shapes/offsets (learner/lora.py)",
                     "noop": "the flat form delivered to a method that loads nothing: Ray's own floor (not a form)"},
           "how": "per repeat, dict then flat then noop: t0 before ray.put((version, payload)); each actor gets the ObjectRef as its "
                  "argument and copies every tensor into its own (tensors that tile one buffer, as a sampler's LoRA: the flat form is "
                  "one copy, the dict form one per tensor); time = last actor's copy done - t0 (same machine clock). "
                  "Packing the payload from the model is outside t0 for both forms (one copy each; flat_pack_median_s)"}
    for rank in ranks:
        shapes = sd15_lora_shapes(rank)
        state = {n: torch.randn(s) for n, s in shapes.items()}
        packs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            flat = flatten_lora_state(state)
            packs.append(time.perf_counter() - t0)
        payloads = {"dict": state, "flat": flat, "noop": flat}
        holders = [Holder.remote(shapes) for _ in range(max(ns))]
        # start-up and first-call costs are not broadcast time
        ray.get([h.load_dict.remote((0, state)) for h in holders] + [h.load_flat.remote((0, flat)) for h in holders])
        flat_ref = ray.put((0, flat))
        checks = ray.get([h.flat_checks.remote(flat_ref) for h in holders])
        del flat_ref
        rows = []
        for n in ns:
            times = {f: [] for f in BROADCAST_MEASURED}
            puts = {f: [] for f in BROADCAST_MEASURED}
            for rep in range(repeats):
                for form in BROADCAST_MEASURED:  # interleaved: a drift in the machine's load hits every form alike
                    t0 = time.time()
                    ref = ray.put((rep + 1, payloads[form]))
                    puts[form].append(time.time() - t0)
                    done = ray.get([getattr(h, f"load_{form}").remote(ref) for h in holders[:n]])
                    times[form].append(max(done) - t0)
                    del ref
            row = {"actors": n, **{f: _form_stats(times[f], puts[f]) for f in BROADCAST_MEASURED}}
            row["dict_over_flat"] = row["dict"]["median_s"] / row["flat"]["median_s"]
            rows.append(row)
            log("systems", f"broadcast rank {rank} to {n} actors: median dict {row['dict']['median_s'] * 1e3:.1f} ms, "
                           f"flat {row['flat']['median_s'] * 1e3:.1f} ms (dict/flat {row['dict_over_flat']:.1f}x; "
                           f"Ray's floor, a no-op call with the flat ref: {row['noop']['median_s'] * 1e3:.1f} ms)")
        out["ranks"][str(rank)] = {"tensors": len(shapes), "params": int(sum(np.prod(s) for s in shapes.values())),
                                   "mbytes_fp32": sum(t.numel() for t in state.values()) * 4 / 1e6,
                                   "flat_pack_median_s": median(packs), "flat_zero_copy_in_actors": all(c[0] for c in checks),
                                   "flat_one_copy_in_actors": all(c[1] for c in checks), "rows": rows}
        for h in holders:
            ray.kill(h)
    return out


def broadcast_medians(rows: list[dict], form: str) -> list[float]:
    """Median seconds per row of one form; schema-1 files (before the flat form) hold the dict form only."""
    if rows and "dict" not in rows[0]:
        return [x["median_s"] for x in rows] if form == "dict" else []
    return [x[form]["median_s"] for x in rows]


def plot_broadcast(res: dict, path: Path) -> None:
    plt = pyplot()
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = {"dict": "o--", "flat": "s-", "noop": ":"}
    for rank, r in res["ranks"].items():
        color = None
        for form in BROADCAST_MEASURED:
            ys = broadcast_medians(r["rows"], form)
            if ys:
                label = (f"Ray's floor (no-op call), rank {rank}" if form == "noop" else
                         f"{form}, rank {rank}: {r['params']:,} params, {r['mbytes_fp32']:.1f} MB")
                line, = ax.plot([x["actors"] for x in r["rows"]], [y * 1e3 for y in ys], styles[form], color=color, label=label)
                color = line.get_color()
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # the two forms differ by an order of magnitude
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
    ax.set_xticks([x["actors"] for r in res["ranks"].values() for x in r["rows"]])
    ax.set_ylim(top=ax.get_ylim()[1] * 6)  # free space on top for the legend
    ax.set_xlabel("actors holding the weights")
    ax.set_ylabel("ms until all hold the new version (median)")
    _finish(plt, fig, ax, "LoRA weight broadcast through Ray's object store (one node):\n"
                          "dict of tensors vs one flat buffer (same run, interleaved)", path, ncol=2, fontsize=6, loc="upper left")


def plot_overlap(res: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    lags = [k for k in ("lag0", "lag1") if k in res]
    stages = sorted({s for k in lags for s in res[k]["stage_s_per_epoch"]})
    width = 0.8 / (len(stages) + 1)
    for i, s in enumerate(stages + ["wall"]):
        vals = [res[k]["wall_s_per_epoch"] if s == "wall" else res[k]["stage_s_per_epoch"].get(s, 0) for k in lags]
        ax.bar(np.arange(len(lags)) + i * width, vals, width, label=s, color="k" if s == "wall" else None)
    ax.set_xticks(np.arange(len(lags)) + width * len(stages) / 2)
    ax.set_xticklabels([f"max_policy_lag={k[3:]}" for k in lags])
    ax.set_ylabel("seconds per epoch")
    _finish(plt, fig, ax, "stage busy time per epoch vs epoch wall time", path)


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS)
    ap.add_argument("--size", choices=sorted(PART_SIZES), default="full")
    ap.add_argument("--epochs", type=int, help="epochs of the overhead/overlap runs (default 6 full, 2 tiny)")
    ap.add_argument("--samplers", type=int, nargs="+")
    ap.add_argument("--rewards", type=int, nargs="+", help="reward-actor counts for the scale simulation")
    ap.add_argument("--calib", help="JSON with sample_s_per_batch, score_s_per_batch, update_s_per_sample, batch_size "
                                    "and shapes {latents, prompt_embeds, images} (default: measured by the overhead run)")
    ap.add_argument("--sim-speedup", type=float, default=1.0, help="scale simulation: sleep calibrated time / K (see scale())")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--out", help="default research/results/systems")
    ap.add_argument("overrides", nargs="*", help="config overrides on the tiny preset, key.sub=value")
    args = ap.parse_args(argv)
    d = PART_SIZES[args.size]
    overrides = [*d["overrides"], *args.overrides]
    epochs = args.epochs or d["epochs"]
    out = out_dir("systems", args.out)
    path = out / "systems.json"
    # Earlier parts' results stay in the file when only some parts are re-run.
    res = json.loads(path.read_text()) if path.exists() else {}
    res.update(machine=machine(), size=args.size, overrides=overrides)
    samplers, rewards = args.samplers or d["samplers"], args.rewards or d["rewards"]
    # Logical CPUs: the real runs need sampler 1 + reward 0.5 + learner 1 each; everything else asks
    # for fractions. Few logical CPUs also means few workers prestarted by ray.init.
    started = start_bench_ray(max(4, int(np.ceil(config(overrides).system.num_samplers + 2.5))))
    try:
        shapes: dict = {}
        oh = None
        if "overhead" in args.parts or ("scale" in args.parts and not args.calib):
            oh = overhead(overrides, epochs, shapes)
            res["overhead"] = {k: v for k, v in oh.items() if not k.startswith("_")}
            write_json(path, res)
        if "overlap" in args.parts:
            res["overlap"] = overlap(overrides, epochs, oh)
            plot_overlap(res["overlap"], out / "overlap.png")
            write_json(path, res)
        if "scale" in args.parts:
            calib = json.loads(Path(args.calib).read_text()) if args.calib else {**oh["calibration"], **shapes}
            res["scale"] = scale(overrides, calib, samplers, rewards, d["sim_epochs"], d["sim_batches"], d["learner_free"],
                                 args.sim_speedup)
            plot_scale(res["scale"], out / "scale.png")
            write_json(path, res)
        if "broadcast" in args.parts:
            res["broadcast"] = broadcast(args.samplers or d["ns"], d["ranks"], args.repeats or d["repeats"])
            plot_broadcast(res["broadcast"], out / "broadcast.png")
            write_json(path, res)
    finally:
        if started:
            import ray

            ray.shutdown()
    log("systems", f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
