"""Fault injection on the Ray system: kill a role at a random moment, finish the run, compare
it with an uninterrupted run of the same config and seed.

    python -m research.bench.faults [--size full|tiny] [--epochs 4] [--n 2]
        [--kinds sampler reward learner driver] [--seed 0] [--window 0.15 0.85] [--when any|busy]
        [--out DIR] [--runs DIR] [--report-only] [key.sub=value ...]

One reference run (the `tiny` preset: 2 samplers, 1 reward actor, max_policy_lag 1, on CPU), then
for each fault kind N runs in their own run folders, each with one fault injected from a
background thread at a seeded random moment, uniform over --window of the reference's wall time
after the actors started:

  sampler  ray.kill(driver.samplers[i], no_restart=False), i random: Ray restarts it, the driver
           re-sends its batches;
  reward   ray.kill(driver.rewards[i], no_restart=False), likewise;
  learner  ray.kill(driver.learner): the driver restores the learner and buffer from the last checkpoint
           within the run (system.max_core_restarts). With system.max_core_restarts=0 (as the
           committed faults.json ran, before the restore existed) the run stops with RunFailed naming
           `--resume`, and a new Driver(resume=True) continues from the last checkpoint (or starts
           over when the stop says no checkpoint was written yet, as its message tells the user to);
  driver   _thread.interrupt_main(): a KeyboardInterrupt inside Driver.run() (delivered when the
           main thread next runs Python, at most one ray.wait slice later; the run gets Python's
           SIGINT handler, which a background job lacks); driver.shutdown() then kills its actors
           as a dead job's actors die, and a new Driver(resume=True) continues. An interrupt that
           did not stop the run is reported as not injected.

Per fault: survived (all epochs trained), batches dropped, reward queries of the trained epochs
vs the reference per epoch (equal = none lost, none counted twice), queries counted twice
(total - trained), queries re-made after the stop (the stopped driver's untrained epochs), the
per-epoch reward means and the final LoRA (checkpoint/state.pt) against the reference (1e-6),
recovery (elapsed time, resumes and actor start-ups included, minus the reference's; and kill ->
next completed epoch, beside the same offset -> next epoch in the reference), and where the kill
landed. A fault whose moment came after the run had finished is reported as not injected.
--when busy (sampler and reward kinds) holds a kill, once its moment has come, until a call of the
chosen actor is running, so the driver sees the death and re-sends (a kill between calls is only
seen by Ray, which restarts the actor); the default `any` kills at the moment, as a crash would.

Writes faults.json, faults.md (one row per fault, one summary row per kind) and faults.png (epoch
completion timelines) into research/results/faults/ or --out. --size tiny (tiny-random model, 4 DDIM
steps, 32 px, 2 batches of 4 per epoch) checks the command end to end in about 20 s per run.
"""
from __future__ import annotations

import _thread
import argparse
import json
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import ray

from diffrlhf.actors.checkpoint import latest_checkpoint, load_checkpoint
from diffrlhf.actors.driver import Driver, RunFailed, init_ray, ray_restarts
from diffrlhf.deploy.config import load_config
from research.bench.common import TINY_OVERRIDES, log, machine, out_dir, pyplot, write_json

KINDS = ["sampler", "reward", "learner", "driver"]
RESUMED = ("learner", "driver")  # faults the run cannot survive in place: it stops and is resumed
SIZES = {
    "full": ["model.device=cpu", "run.image_grid_every=0", "run.tensorboard=false"],
    # 2 batches per epoch (not TINY_OVERRIDES' 1) so both samplers have work to lose
    "tiny": TINY_OVERRIDES + ["sample.num_steps=4", "sample.batches_per_epoch=2"],
}
ATOL = 1e-6  # "equal" for per-epoch reward means and the final LoRA


# ----------------------------------------------------------------------------- the injector


class Injector(threading.Thread):
    """Waits until the driver's actors have started (Driver.run sets t_run), then `delay` seconds,
    then injects `kind` once, unless the run has finished or stop() was called."""

    def __init__(self, driver: Driver, kind: str, delay: float, index: int, when: str = "any"):
        super().__init__(daemon=True)
        self.d, self.kind, self.delay, self.index, self.when = driver, kind, delay, index, when
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.at: dict | None = None  # where the fault landed, once injected

    def run(self) -> None:
        while not self.d.t_run:  # set once the actors have started (Driver.run)
            if self.stopped.wait(0.05):
                return
        if self.stopped.wait(self.delay):
            return
        while self.when == "busy" and self.kind in ("sampler", "reward") and not self._target_busy():
            if self.stopped.wait(0.005) or self.d.sched.finished:
                return
        with self.lock:  # stop() waits for an injection in progress: the caller then knows whether it happened
            if self.stopped.is_set() or self.d.sched.finished:
                return
            self.at = {"epochs_done": self.d.sched.epochs_done, "t": time.time()}
            if self.kind == "sampler":
                ray.kill(self.d.samplers[self.index], no_restart=False)
            elif self.kind == "reward":
                ray.kill(self.d.rewards[self.index], no_restart=False)
            elif self.kind == "learner":
                ray.kill(self.d.learner)
            else:
                _thread.interrupt_main()

    def stop(self) -> None:
        with self.lock:
            self.stopped.set()

    def _target_busy(self) -> bool:
        """A call of the chosen actor is submitted and has not returned (Ray's wait, not the driver's view)."""
        try:
            refs = [ref for ref, (t, *_) in list(self.d.pending.items())
                    if getattr(t, "role", None) == self.kind and getattr(t, "actor", None) == self.index]
        except (AttributeError, RuntimeError):  # not running yet, or the dict changed while copied
            return False
        return bool(refs) and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs)


# ----------------------------------------------------------------------------- one run


def run_once(cfg, run_dir: Path, kind: str | None = None, delay: float = 0.0, index: int = 0, when: str = "any") -> dict:
    """One run to the end (kind None: the reference), resumed once after a learner or driver fault.
    Returns records per epoch (the latest part's record wins), epoch completion times, the final
    LoRA, timings and what happened at the stop."""
    done_at: dict[int, float] = {}  # epoch -> when its update, log and checkpoint were done

    def hook(driver, epoch):
        done_at[epoch] = time.time()

    records: dict[int, dict] = {}
    out = {"kind": kind, "injected": False, "stops": [], "resumes": 0}
    t0, resume, t_start = time.time(), False, None
    for part in range(2):
        d = Driver(cfg, run_dir, progress=False, resume=resume, on_update=hook)
        inj = Injector(d, kind, delay, index, when) if kind and part == 0 else None
        # interrupt_main() does nothing while SIGINT is ignored, as it is in a background job of a
        # non-interactive shell: give the run Python's handler (restored below).
        sigint = signal.signal(signal.SIGINT, signal.default_int_handler) if kind == "driver" and inj else None
        if inj:
            inj.start()
        stop = None
        try:
            try:
                d.run()
            finally:
                if inj:
                    inj.stop()  # no fault after this point
        except (RunFailed, KeyboardInterrupt, ray.exceptions.RayError) as e:
            if inj:
                inj.stop()  # again: the interrupt may have landed inside the first stop()
            stop = e
        finally:
            if sigint is not None:
                signal.signal(signal.SIGINT, sigint)
            t_start = t_start or getattr(d, "t_run", None)
            records.update({r["epoch"]: r for r in d.records})
            untrained = sum(d.sched.epoch_queries.values())  # queries of epochs this driver scored but never trained
            if inj and inj.at and kind in ("sampler", "reward"):
                inj.at["ray_restarts"] = ray_restarts((d.samplers if kind == "sampler" else d.rewards)[index])
            d.shutdown()
        if inj and inj.at:
            if kind == "driver" and not isinstance(stop, KeyboardInterrupt):
                out["note"] = "the interrupt reached no Python code of the run before it ended"
            else:
                out.update(injected=True, at=inj.at)
        if stop is None:
            break
        text = str(stop).strip() or type(stop).__name__
        hint = None if isinstance(stop, KeyboardInterrupt) else "--resume" in text  # a dead driver says nothing
        out["stops"].append({"error_type": type(stop).__name__, "error": text, "names_resume": hint,
                             "epochs_done": d.sched.epochs_done, "queries_untrained": untrained})
        log("faults", f"  the run stopped ({type(stop).__name__}: {text.splitlines()[0][:160]})")
        if kind not in RESUMED or part:
            break
        resume = latest_checkpoint(run_dir) is not None  # else the stop said: start the run again
        out["resumes"] += 1
        log("faults", f"  {'resuming from ' + str(latest_checkpoint(run_dir)[0]) if resume else 'no checkpoint yet: starting over'}")
    out["elapsed_s"] = time.time() - t0
    recs = [records[e] for e in sorted(records)]
    out["records"] = recs
    out["epoch_done_s"] = {e: t - t_start for e, t in sorted(done_at.items())} if t_start else {}
    out["survived"] = stop is None and len(recs) == cfg.train.epochs
    out["lora"] = load_checkpoint(run_dir, log=lambda m: None)["learner"]["lora"] if out["survived"] else None
    if out["injected"]:
        out["at"]["s_after_start"] = out["at"]["t"] - t_start
    return out


# ----------------------------------------------------------------------------- comparing with the reference


def lora_diff(a: dict, b: dict) -> float:
    """Max abs difference over all LoRA tensors; inf if the tensor names or shapes differ."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    return max((float((a[k].float() - b[k].float()).abs().max()) for k in a), default=0.0)


def next_epoch_after(done_s: dict, t: float) -> float | None:
    """Seconds from t to the first epoch completed after it (None if none was)."""
    later = [s for s in done_s.values() if s > t]
    return min(later) - t if later else None


def compare(run: dict, ref: dict, epochs: int) -> dict:
    """One table row: the fault run against the reference."""
    row = {"kind": run["kind"], "injected": run["injected"], "survived": run["survived"] if run["injected"] else None,
           "resumes": run["resumes"], "stops": run["stops"], "note": run.get("note"), "epoch_done_s": run["epoch_done_s"]}
    if run["injected"]:
        at = run["at"]
        row.update(kill_epoch=at["epochs_done"], kill_s=at["s_after_start"], ray_restarts=at.get("ray_restarts"),
                   to_next_epoch_s=next_epoch_after(run["epoch_done_s"], at["s_after_start"]),
                   ref_to_next_epoch_s=next_epoch_after(ref["epoch_done_s"], at["s_after_start"]))
    recs, rrecs = run["records"], ref["records"]
    last = recs[-1] if recs else {}
    row.update(epochs=len(recs), batches_dropped=last.get("batches_dropped"), actor_deaths=last.get("actor_deaths"),
               sample_retries=last.get("sample_retries"), score_retries=last.get("score_retries"),
               reward_queries=last.get("reward_queries"), ref_reward_queries=rrecs[-1]["reward_queries"],
               queries_equal=[r["reward_queries"] for r in recs] == [r["reward_queries"] for r in rrecs],
               # answered twice beyond the re-made epochs (reward_queries_total includes those)
               queries_double=(last["reward_queries_total"] - last["reward_queries"] - last.get("reward_queries_lost", 0)) if recs else None,
               queries_lost_counter=last.get("reward_queries_lost"),
               queries_remade=sum(s["queries_untrained"] for s in run["stops"]),
               reward_means=[r["reward_mean"] for r in recs],
               extra_s=run["elapsed_s"] - ref["elapsed_s"], elapsed_s=run["elapsed_s"])
    same = len(recs) == len(rrecs) == epochs
    diffs = [abs(a["reward_mean"] - b["reward_mean"]) for a, b in zip(recs, rrecs)]
    row["reward_max_diff"] = max(diffs) if same else None
    row["rewards_equal"] = same and max(diffs) <= ATOL
    row["lora_max_diff"] = lora_diff(run["lora"], ref["lora"]) if run["lora"] is not None else None
    row["lora_equal"] = row["lora_max_diff"] is not None and row["lora_max_diff"] <= ATOL
    return row


def summarise(rows: list[dict], kinds: list[str]) -> list[dict]:
    """Per kind: injected, survived, and the worst case of every other column (over injected faults)."""
    out = []
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        inj = [r for r in mine if r["injected"]]

        def mean(key):
            xs = [r[key] for r in inj if r.get(key) is not None]
            return float(np.mean(xs)) if xs else None

        out.append({"kind": kind, "planned": len(mine), "injected": len(inj), "survived": sum(bool(r["survived"]) for r in inj),
                    "batches_dropped": sum(r["batches_dropped"] or 0 for r in inj),
                    "queries_equal": sum(bool(r["queries_equal"]) for r in inj),
                    "queries_double": sum(r["queries_double"] or 0 for r in inj),
                    "queries_remade": sum(r["queries_remade"] for r in inj),
                    "rewards_equal": sum(bool(r["rewards_equal"]) for r in inj), "lora_equal": sum(bool(r["lora_equal"]) for r in inj),
                    "lora_max_diff": max((r["lora_max_diff"] for r in inj if r["lora_max_diff"] is not None), default=None),
                    "extra_s": mean("extra_s"), "to_next_epoch_s": mean("to_next_epoch_s")})
    return out


def _f(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def _yn(x):
    return "-" if x is None else "yes" if x else "**no**"


def table_markdown(res: dict) -> str:
    ref = res["reference"]
    lines = [f"## Fault injection ({res['size']} size, {res['epochs']} epochs, N={res['n']} per kind, seed {res['seed']})", "",
             f"Reference (uninterrupted): {ref['elapsed_s']:.1f} s elapsed, {ref['wall_s']:.1f} s after the actors started, "
             f"{ref['reward_queries']} reward queries, per-epoch reward means "
             f"{', '.join(f'{x:.4f}' for x in ref['reward_means'])}. Faults land uniformly in "
             f"{res['window'][0]:.0%}-{res['window'][1]:.0%} of its {ref['wall_s']:.1f} s after the actors started"
             + ("; sampler and reward kills are held until a call of the actor is running." if res.get("when") == "busy" else "."), "",
             "| fault | # | landed (epochs done, s) | survived | batches dropped | queries = ref | counted twice | re-made (counter) | "
             "rewards = ref | LoRA = ref (max abs diff) | extra time (s) | kill -> next epoch (ref) (s) | deaths / retries / restarts |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(res["rows"]):
        n = sum(x["kind"] == r["kind"] for x in res["rows"][:i + 1])
        if not r["injected"]:
            why = r.get("note") or "the run ended first"
            lines.append(f"| {r['kind']} | {n} | not injected: {why} |" + " - |" * 10)
            continue
        lines.append(
            f"| {r['kind']} | {n} | {r['kill_epoch']}, {r['kill_s']:.1f} | {_yn(r['survived'])} | {r['batches_dropped']} | "
            f"{_yn(r['queries_equal'])} ({r['reward_queries']}/{r['ref_reward_queries']}) | {r['queries_double']} | "
            f"{r['queries_remade']} ({r['queries_lost_counter']}) | "
            f"{_yn(r['rewards_equal'])} | {_yn(r['lora_equal'])} ({_f(r['lora_max_diff'], '{:.1e}')}) | {r['extra_s']:+.1f} | "
            f"{_f(r.get('to_next_epoch_s'))} ({_f(r.get('ref_to_next_epoch_s'))}) | "
            f"{r['actor_deaths']} / {r['sample_retries']}+{r['score_retries']} / {_f(r.get('ray_restarts'), '{}')} |")
    for s in res["summary"]:
        k = s["injected"]
        lines.append(
            f"| **{s['kind']}: all** | {k}/{s['planned']} | injected | {s['survived']}/{k} | {s['batches_dropped']} | "
            f"{s['queries_equal']}/{k} | {s['queries_double']} | {s['queries_remade']} | {s['rewards_equal']}/{k} | "
            f"{s['lora_equal']}/{k} ({_f(s['lora_max_diff'], '{:.1e}')}) | {_f(s['extra_s'], '{:+.1f}')} | {_f(s['to_next_epoch_s'])} | |")
    lines += ["", "Columns: *landed*: epochs trained when the fault was injected, and seconds after the actors started. "
              "*queries = ref*: every trained epoch's reward queries equal the reference's (trained/reference total). "
              "*counted twice*: reward_queries_total - reward_queries at the end. *re-made*: queries of epochs the stopped "
              "driver had scored but not trained (a resume scores them again); in parentheses the run's reward_queries_lost "
              "counter, which counts only those scored before the checkpoint the run resumed from. *extra time*: elapsed "
              "time (resumes and actor start-ups included) minus the reference's. *kill -> next epoch*: until the next "
              "epoch completed, and in parentheses the same for the reference at the same offset. *deaths / retries / "
              "restarts*: actor deaths the driver saw / sample + score retries / Ray's restarts of the killed actor (a kill between calls costs the restart but "
              "no call: Ray holds calls to a restarting actor, so the driver may see no death)."]
    stops = [(r["kind"], s) for r in res["rows"] for s in r["stops"]]
    if stops:
        lines += ["", "Stops (first line of each):"]
        lines += [f"- {k}: {s['error_type']} after {s['epochs_done']} epochs, names `--resume`: {_yn(s['names_resume'])}: "
                  f"`{s['error'].splitlines()[0][:200]}`" for k, s in stops]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    """Epoch completion times per run (dots) and the fault (red x), the reference on top."""
    plt = pyplot()
    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1.6))
    labels = ["reference"]
    ax.plot(list(res["reference"]["epoch_done_s"].values()), [0] * len(res["reference"]["epoch_done_s"]), "ko:", ms=4)
    for y, row in enumerate(rows, start=1):
        labels.append(f"{row['kind']} {sum(r['kind'] == row['kind'] for r in rows[:y])}")
        ts = list(row["epoch_done_s"].values())
        ax.plot(ts, [y] * len(ts), "o:", ms=4, color="grey" if not row["injected"] else "C0" if row["survived"] else "C3")
        if row["injected"]:
            ax.plot([row["kill_s"]], [y], "rx", ms=9, mew=2)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("s after the first actors started (dots: epochs done; x: fault; grey: not injected)", fontsize=8)
    ax.set_title("fault injection: epoch completion timelines", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--n", type=int, default=2, help="faults per kind")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS)
    ap.add_argument("--seed", type=int, default=0, help="seeds the fault moments and the killed actor (run.seed is the runs' own)")
    ap.add_argument("--window", type=float, nargs=2, default=[0.15, 0.85], help="fractions of the reference's wall time")
    ap.add_argument("--when", choices=["any", "busy"], default="any",
                    help="busy: hold a sampler/reward kill until a call of that actor is running")
    ap.add_argument("--out", help="default research/results/faults")
    ap.add_argument("--runs", help="keep the run folders here (default: a temporary folder, deleted)")
    ap.add_argument("--report-only", action="store_true", help="rewrite faults.md and faults.png from faults.json")
    ap.add_argument("overrides", nargs="*", help="config overrides on the tiny preset, key.sub=value")
    args = ap.parse_args(argv)
    overrides = [*SIZES[args.size], f"train.epochs={args.epochs}", *args.overrides]
    cfg = load_config("tiny", overrides=overrides)
    out = out_dir("faults", args.out)
    if args.report_only:
        res = json.loads((out / "faults.json").read_text())
        (out / "faults.md").write_text(table_markdown(res))
        plot(res, out / "faults.png")
        return res
    runs_dir = Path(args.runs) if args.runs else Path(tempfile.mkdtemp(prefix="diffrlhf-faults-"))
    started = not ray.is_initialized()
    init_ray(cfg)
    try:
        log("faults", f"reference: {args.epochs} epochs, uninterrupted")
        ref = run_once(cfg, runs_dir / "reference")
        if not ref["survived"]:
            raise SystemExit(f"the reference run did not finish: {ref['stops']}")
        wall = ref["records"][-1]["wall_s"]
        log("faults", f"reference: {ref['elapsed_s']:.1f}s elapsed, {wall:.1f}s after the actors started")
        res = {"machine": machine(), "size": args.size, "epochs": args.epochs, "n": args.n, "seed": args.seed, "window": args.window,
               "when": args.when,
               "overrides": overrides, "atol": ATOL,
               "reference": {"elapsed_s": ref["elapsed_s"], "wall_s": wall, "reward_queries": ref["records"][-1]["reward_queries"],
                             "reward_means": [r["reward_mean"] for r in ref["records"]], "epoch_done_s": ref["epoch_done_s"],
                             "records": ref["records"]},
               "rows": [], "summary": []}
        for kind in args.kinds:
            for k in range(args.n):
                rng = np.random.default_rng([args.seed, KINDS.index(kind), k])  # the same moment whatever else runs
                delay = float(rng.uniform(*args.window)) * wall
                count = cfg.system.num_samplers if kind == "sampler" else cfg.system.num_reward_actors if kind == "reward" else 1
                index = int(rng.integers(count))
                log("faults", f"{kind} {k + 1}/{args.n}: fault {delay:.1f}s after the actors start"
                              + (f" ({kind}-{index})" if kind in ("sampler", "reward") else ""))
                run = run_once(cfg, runs_dir / f"{kind}_{k}", kind, delay, index, args.when)
                row = compare(run, ref, args.epochs)
                res["rows"].append(row)
                if row["injected"]:
                    log("faults", f"  landed after {row['kill_epoch']} epochs, {row['kill_s']:.1f}s; survived {row['survived']}, "
                                  f"dropped {row['batches_dropped']}, queries equal {row['queries_equal']}, LoRA equal "
                                  f"{row['lora_equal']} (max diff {row['lora_max_diff']}), extra {row['extra_s']:+.1f}s")
                else:
                    log("faults", "  not injected: the run ended first")
                res["summary"] = summarise(res["rows"], args.kinds)
                write_json(out / "faults.json", res)
        (out / "faults.md").write_text(table_markdown(res))
        plot(res, out / "faults.png")
    finally:
        if started:
            ray.shutdown()
        if not args.runs:
            shutil.rmtree(runs_dir, ignore_errors=True)
    log("faults", f"wrote {out / 'faults.json'}, faults.md, faults.png")
    return res


if __name__ == "__main__":
    main()
