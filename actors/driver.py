"""The single controller: builds the actors from the config, runs the asynchronous loop, reports.

Flow of one batch:  plan -> SamplerActor.sample -> (info, reward input, trajectories)
                    reward input -> RewardActor.score -> rewards keyed by sample id
                    trajectories + rewards -> BufferActor.add_scored
When all batches of an epoch are in: BufferActor.finalize_epoch (advantages, replay) ->
BufferActor.training_batch -> LearnerActor.update -> (metrics, weights). The weights come back
as one object in Ray's object store with its version; every later sample call carries that
reference, so samplers (also restarted ones) always hold the newest weights before sampling.

Asynchrony is bounded: epoch e may be sampled only once the policy version is >= e - max_policy_lag
(0 = DDPO's synchronous schedule), and each sampler has at most max_inflight_per_sampler batches
in flight, so no queue grows without bound when a role is slow.
"""
from __future__ import annotations

import collections
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffrlhf.policy.prompts import load_prompts, plan_batch
from diffrlhf.actors.observe import RunMetrics, Watchdog
from diffrlhf.actors.workers import BufferWorker, LearnerWorker, RewardWorker, SamplerWorker


class RunFailed(RuntimeError):
    """The run cannot go on (a dead learner or buffer, a bad reward, nothing progressing)."""


@dataclass
class _Pending:
    kind: str  # sample | score | add | update | finalize
    epoch: int
    batch_index: int = -1
    actor: int = -1
    attempt: int = 0
    since: float = field(default_factory=time.time)
    refs: tuple = ()


def init_ray(cfg, num_gpus: float | None = None, quiet: bool = True):
    """Connect to RAY_ADDRESS (cluster, `ray job submit`) or start a local Ray sized for the config."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=not quiet)
        return
    s = cfg.system
    # Logical CPUs: enough for every actor to be placed; torch threads per actor keep real use in check.
    need = s.num_samplers * s.sampler_cpus + s.num_reward_actors * s.reward_cpus + s.learner_cpus + 1
    # The dashboard (and the metrics it shows) costs ~0.5 GB: opt in locally with DIFFRLHF_DASHBOARD=1.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), num_gpus=num_gpus,
             include_dashboard=os.environ.get("DIFFRLHF_DASHBOARD") == "1", log_to_driver=not quiet)


class Driver:
    def __init__(self, cfg, run_dir: str | Path, logger=None, progress: bool = True, resume: bool = False,
                 worker_classes: dict | None = None, on_update=None):
        """worker_classes overrides a role's class (tests inject failing samplers); on_update(driver,
        epoch) is called after each update (tests kill actors there)."""
        self.cfg, self.run_dir, self.logger, self.progress = cfg, Path(run_dir), logger, progress
        self.worker_classes, self.on_update = worker_classes or {}, on_update
        self.ckpt_dir = self.run_dir / "checkpoint"
        self.resume = resume
        self.prompts = load_prompts(cfg.prompts.train)  # a bad prompt list fails before any actor starts
        # reward_queries: queries that produced the trained epochs (the x-axis of sample efficiency);
        # reward_queries_total: every query made, including epochs in flight and work lost to faults.
        self.counters = dict(epochs_done=0, reward_queries=0, reward_queries_total=0, reward_dropped=0, batches_dropped=0,
                             sample_retries=0, score_retries=0, actor_deaths=0)
        self.records: list[dict] = []
        self.role_stats: list[dict] = []

        self.metrics = RunMetrics()
        self.watchdog = Watchdog(role_timeout_s=cfg.system.idle_timeout_s / 2, queue_timeout_s=cfg.system.idle_timeout_s / 2)

    # ------------------------------------------------------------------ actors

    def _options(self, role: str, cpus: float, gpus: float, restarts: int = 0) -> dict:
        opts = dict(num_cpus=cpus, num_gpus=gpus, max_restarts=restarts, max_task_retries=0)
        if self.cfg.system.use_role_resources:
            opts["resources"] = {role: 0.001}
        return opts

    def start_actors(self) -> None:
        import ray


        s, cfg = self.cfg.system, self.cfg
        classes = {**dict(sampler=SamplerWorker, reward=RewardWorker, buffer=BufferWorker, learner=LearnerWorker), **self.worker_classes}
        self.Sampler, self.Reward = ray.remote(classes["sampler"]), ray.remote(classes["reward"])
        self.learner = ray.remote(classes["learner"]).options(**self._options("learner", s.learner_cpus, s.learner_gpus)).remote(cfg)
        self.buffer = ray.remote(classes["buffer"]).options(**self._options("buffer", 0, 0)).remote(cfg)
        self.samplers = [self.Sampler.options(**self._options("sampler", s.sampler_cpus, s.sampler_gpus, s.max_actor_restarts)).remote(cfg, i)
                         for i in range(s.num_samplers)]
        ropts = self._options("reward", s.reward_cpus, s.reward_gpus, s.max_actor_restarts)
        if cfg.reward.runtime_env:
            ropts["runtime_env"] = cfg.reward.runtime_env
        self.rewards = [self.Reward.options(**ropts).remote(cfg, i) for i in range(s.num_reward_actors)]
        # Fail early and clearly if a role cannot even start (bad weights, missing packages).
        for name, actor in [("learner", self.learner), ("buffer", self.buffer)] + [(f"sampler-{i}", a) for i, a in enumerate(self.samplers)] + [(f"reward-{i}", a) for i, a in enumerate(self.rewards)]:
            try:
                ray.get(actor.ping.remote(), timeout=s.start_timeout_s)
            except Exception as e:
                raise RunFailed(f"the {name} actor failed to start: {_short(e)}") from None

    # ------------------------------------------------------------------ checkpoint

    def save_checkpoint(self) -> None:
        import ray

        tmp = self.run_dir / "checkpoint.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        learner_state, buffer_state = ray.get([self.learner.state_dict.remote(), self.buffer.state_dict.remote()],
                                              timeout=self.cfg.system.checkpoint_timeout_s)
        torch.save({"learner": learner_state, "buffer": buffer_state, "counters": dict(self.counters),
                    "torch_rng": torch.get_rng_state(), "config": self.cfg.to_dict()}, tmp / "state.pt")
        old = self.run_dir / "checkpoint.old"
        shutil.rmtree(old, ignore_errors=True)
        if self.ckpt_dir.exists():
            self.ckpt_dir.rename(old)
        tmp.rename(self.ckpt_dir)  # the previous checkpoint stays valid until this rename
        shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self) -> None:
        import ray

        path = self.ckpt_dir / "state.pt"
        if not path.exists():
            raise RunFailed(f"cannot resume: no checkpoint at {path}")
        state = torch.load(path, weights_only=False)
        ray.get([self.learner.load_state_dict.remote(state["learner"]), self.buffer.load_state_dict.remote(state["buffer"])])
        self.counters.update(state["counters"])
        torch.set_rng_state(state["torch_rng"])

    # ------------------------------------------------------------------ the loop

    def run(self) -> list[dict]:
        import ray

        cfg, s = self.cfg, self.cfg.system
        self.start_actors()
        if self.resume:
            self.load_checkpoint()
            if self.logger is not None:
                self.logger.truncate(self.counters["epochs_done"])
        total = cfg.train.epochs
        start = self.counters["epochs_done"]
        self.weights_ref = self.learner.weights.remote()  # version + LoRA of the current policy
        self.version = start
        todo = collections.deque((e, b, 0) for e in range(start, total) for b in range(cfg.sample.batches_per_epoch))
        pending: dict = {}  # ObjectRef -> _Pending
        inflight = [0] * len(self.samplers)
        reward_load = [0] * len(self.rewards)
        batches_in: collections.Counter = collections.Counter()
        epoch_queries: collections.Counter = collections.Counter()
        self.dropped_in = collections.Counter()
        # Actors that failed are "down" until a ping answers (Ray restarts them); "dead" once restarts are spent.
        self.down = {"sampler": set(), "reward": set()}
        self.dead = {"sampler": set(), "reward": set()}
        next_train = start
        updating = False
        bar = _bar(total, start, self.progress)
        t_run = time.time()
        try:
            while self.counters["epochs_done"] < total:
                # 1. dispatch sampling within the lag bound and the per-sampler in-flight bound
                while todo and todo[0][0] <= self.version + s.max_policy_lag:
                    free = [i for i in self._usable("sampler") if inflight[i] < s.max_inflight_per_sampler]
                    if not free:
                        break
                    i = min(free, key=lambda j: inflight[j])
                    e, b, attempt = todo.popleft()
                    plan = plan_batch(self.prompts, cfg.run.seed, e, b, cfg.sample.batch_size, cfg.sample.batches_per_epoch,
                                      cfg.sample.samples_per_prompt)
                    info, rin, traj = self.samplers[i].sample.options(num_returns=3).remote(plan, self.weights_ref)
                    pending[info] = _Pending("sample", e, b, i, attempt, refs=(rin, traj))
                    inflight[i] += 1
                for role in ("sampler", "reward"):
                    if len(self.dead[role]) == len(self._actors(role)):
                        raise RunFailed(f"every {role} actor is dead (system.max_actor_restarts={s.max_actor_restarts} spent). "
                                        f"Last checkpoint: {self.ckpt_dir}; resume with: diffrlhf train --resume {self.run_dir}")
                # 2. start the next update when its epoch is complete
                if not updating and next_train < total and batches_in[next_train] >= cfg.sample.batches_per_epoch:
                    summary = self.buffer.finalize_epoch.remote(next_train)
                    tb = self.buffer.training_batch.remote(next_train)
                    metrics, weights = self.learner.update.options(num_returns=2).remote(tb)
                    pending[metrics] = _Pending("update", next_train, refs=(weights, summary))
                    updating = True
                # 3. report, then wait for anything (in slices, so the watchdog speaks while we wait)
                self._observe(todo, pending, batches_in, next_train, updating)
                ready = self._wait(pending)
                ref = ready[0]
                p = pending.pop(ref)
                self.watchdog.work_done({"sample": "samplers", "score": "rewards", "add": "buffer", "update": "learner"}.get(p.kind, "driver"))
                if p.kind == "sample":
                    inflight[p.actor] -= 1
                    try:
                        ray.get(ref)
                    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                        self._mark_down(pending, "sampler", p.actor)
                        self._retry_or_drop(todo, batches_in, p, "sample", e)
                        continue
                    except ray.exceptions.RayTaskError as e:
                        raise RunFailed(f"sampler-{p.actor} failed on epoch {p.epoch} batch {p.batch_index}: {_short(e)}") from None
                    self._dispatch_score(pending, reward_load, p.epoch, p.batch_index, *p.refs, attempt=0)
                elif p.kind == "score":
                    reward_load[p.actor] -= 1
                    try:
                        score = ray.get(ref)
                    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                        self._mark_down(pending, "reward", p.actor)
                        if p.attempt < s.max_batch_retries:
                            self.counters["score_retries"] += 1
                            self._dispatch_score(pending, reward_load, p.epoch, p.batch_index, *p.refs, attempt=p.attempt + 1)
                        else:
                            self._drop(batches_in, p, "score", e)
                        continue
                    except ray.exceptions.RayTaskError as e:
                        raise RunFailed(f"reward actor failed on epoch {p.epoch} batch {p.batch_index}: {_short(e)}") from None
                    # each scored image is one query, counted once: a batch's result arrives once
                    n_scored = len(score.ids) + len(score.dropped_ids)
                    self.counters["reward_queries_total"] += n_scored
                    epoch_queries[p.epoch] += n_scored
                    self.counters["reward_dropped"] += len(score.dropped_ids)
                    add = self.buffer.add_scored.remote(p.epoch, p.batch_index, p.refs[1], score)
                    pending[add] = _Pending("add", p.epoch, p.batch_index)
                elif p.kind == "ping":
                    self._on_ping(pending, ref, p)
                elif p.kind == "add":
                    self._get_core(ref, "buffer", p)
                    batches_in[p.epoch] += 1
                elif p.kind == "update":
                    metrics = self._get_core(ref, "learner", p)
                    summary = self._get_core(p.refs[1], "buffer", p)
                    self.weights_ref = p.refs[0]
                    self.version = p.epoch + 1
                    updating = False
                    next_train += 1
                    self.counters["epochs_done"] = p.epoch + 1
                    self.counters["reward_queries"] += epoch_queries.pop(p.epoch)
                    self._after_update(p.epoch, metrics, summary, time.time() - t_run, bar)
                    if self.on_update is not None:
                        self.on_update(self, p.epoch)
        finally:
            if bar is not None:
                bar.close()
        self.role_stats = self._collect_role_stats()
        return self.records

    # ------------------------------------------------------------------ helpers

    def _wait(self, pending) -> list:
        import ray

        waited = 0.0
        while True:
            step = min(10.0, self.cfg.system.idle_timeout_s - waited)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(step, 0.01))
            if ready:
                return ready
            waited += step
            for warning in self.watchdog.check():
                print(f"[diffrlhf] watchdog: {warning}")
            if waited >= self.cfg.system.idle_timeout_s:
                raise RunFailed(self._describe_stall(pending))

    def _observe(self, todo, pending, batches_in, next_train, updating) -> None:
        kinds = collections.Counter(p.kind for p in pending.values())
        depths = {"to_sample": len(todo), "sampling": kinds["sample"], "scoring": kinds["score"],
                  "buffering": kinds["add"], "epochs_ready": int(not updating and batches_in[next_train] >= self.cfg.sample.batches_per_epoch)}
        self.metrics.queues(depths)
        cap = len(self.samplers) * self.cfg.system.max_inflight_per_sampler
        self.watchdog.queue("sampling", kinds["sample"], cap)
        self.watchdog.queue("scoring", kinds["score"], cap)
        if todo and todo[0][0] > self.version + self.cfg.system.max_policy_lag:
            self.watchdog.waiting("samplers", f"the learner: epoch {todo[0][0]} needs policy version >= {todo[0][0] - self.cfg.system.max_policy_lag}, have {self.version}")
        else:
            self.watchdog.waiting("samplers", "free sampler slots" if todo else "nothing (all epochs planned)")
        self.watchdog.waiting("learner", f"epoch {next_train}: {batches_in[next_train]}/{self.cfg.sample.batches_per_epoch} batches scored and buffered")

    def _actors(self, role):
        return self.samplers if role == "sampler" else self.rewards

    def _usable(self, role) -> list[int]:
        return [i for i in range(len(self._actors(role))) if i not in self.down[role] and i not in self.dead[role]]

    def _mark_down(self, pending, role, i) -> None:
        """A sampler/reward actor failed: keep work away from it until Ray has restarted it."""
        if i in self.down[role] or i in self.dead[role]:
            return
        self.counters["actor_deaths"] += 1
        self.down[role].add(i)
        pending[self._actors(role)[i].ping.remote()] = _Pending("ping", -1, actor=i, refs=(role,))

    def _on_ping(self, pending, ref, p) -> None:
        import ray

        role, i = p.refs[0], p.actor
        try:
            ray.get(ref)
            self.down[role].discard(i)  # restarted; it reloads the newest weights on its next call
        except ray.exceptions.ActorUnavailableError:  # still restarting: ask again shortly
            time.sleep(0.2)
            pending[self._actors(role)[i].ping.remote()] = _Pending("ping", -1, actor=i, refs=(role,))
        except ray.exceptions.RayActorError:  # restarts spent
            self.down[role].discard(i)
            self.dead[role].add(i)
            print(f"[diffrlhf] {role}-{i} is dead for good (system.max_actor_restarts spent); going on without it")

    def _dispatch_score(self, pending, reward_load, epoch, batch_index, rin, traj, attempt):
        usable = self._usable("reward") or [i for i in range(len(self.rewards)) if i not in self.dead["reward"]]
        j = min(usable, key=lambda k: reward_load[k])
        ref = self.rewards[j].score.remote(rin)
        reward_load[j] += 1
        pending[ref] = _Pending("score", epoch, batch_index, j, attempt, refs=(rin, traj))

    def _retry_or_drop(self, todo, batches_in, p, stage, err):
        if p.attempt < self.cfg.system.max_batch_retries:
            self.counters["sample_retries"] += 1
            todo.appendleft((p.epoch, p.batch_index, p.attempt + 1))  # same plan: an identical re-run
        else:
            self._drop(batches_in, p, stage, err)

    def _drop(self, batches_in, p, stage, err):
        self.counters["batches_dropped"] += 1
        self.dropped_in[p.epoch] += 1
        if self.dropped_in[p.epoch] == self.cfg.sample.batches_per_epoch:
            raise RunFailed(f"every batch of epoch {p.epoch} was lost ({stage} failed: {_short(err)}); "
                            f"last checkpoint: {self.ckpt_dir}")
        batches_in[p.epoch] += 1  # the epoch completes without it; the loss is counted and logged
        print(f"[diffrlhf] dropped epoch {p.epoch} batch {p.batch_index} after {p.attempt + 1} failed {stage} attempts: {_short(err)}")

    def _get_core(self, ref, role, p):
        import ray

        try:
            return ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise RunFailed(
                f"the {role} actor died ({_short(e)}). The last checkpoint is in {self.ckpt_dir} "
                f"(epoch {self.counters['epochs_done']}); continue with: diffrlhf train --resume {self.run_dir}"
            ) from None
        except ray.exceptions.RayTaskError as e:
            raise RunFailed(f"the {role} failed during epoch {p.epoch}: {_short(e)}. Last checkpoint: {self.ckpt_dir}") from None

    def _describe_stall(self, pending) -> str:
        now = time.time()
        waits = sorted(pending.values(), key=lambda p: p.since)[:6]
        what = "; ".join(f"{p.kind} of epoch {p.epoch} batch {p.batch_index} (actor {p.actor}) for {now - p.since:.0f}s" for p in waits)
        return (f"nothing finished for {self.cfg.system.idle_timeout_s:.0f}s (system.idle_timeout_s); waiting on: {what or 'nothing'}. "
                f"Last checkpoint: {self.ckpt_dir}")

    def _after_update(self, epoch: int, metrics: dict, summary: dict, wall: float, bar) -> None:
        import numpy as np

        r = np.asarray(summary["rewards"], dtype=np.float64)
        rec = {"epoch": epoch, "reward_queries": self.counters["reward_queries"], "reward_mean": float(r.mean()),
               "reward_std": float(r.std()), "reward_se": float(r.std(ddof=1) / np.sqrt(len(r))) if len(r) > 1 else 0.0,
               "samples": len(r), "wall_s": wall}
        rec.update({k: v for k, v in metrics.items() if k != "timestep_weights"})
        rec.update({k: v for k, v in self.counters.items() if k not in ("epochs_done", "reward_queries")})
        self.records.append(rec)
        self.metrics.epoch(rec, rec["reward_queries"] - (self.records[-2]["reward_queries"] if len(self.records) > 1 else 0))
        self.watchdog.reward(rec["reward_mean"])
        if self.logger is not None:
            self.logger.log(rec)
            g = self.cfg.run.image_grid_every
            if g and (epoch % g == 0 or epoch == self.cfg.train.epochs - 1):
                self.logger.save_grid(summary["images"], summary["prompts"], f"epoch_{epoch:04d}")
            self.logger.plot_reward_curve()
        if (epoch + 1) % self.cfg.run.save_every == 0 or epoch + 1 == self.cfg.train.epochs:
            self.save_checkpoint()
            import ray

            ray.get(self.learner.save_lora.remote(str(self.run_dir / "lora" / f"epoch_{epoch + 1:04d}")))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(queries=self.counters["reward_queries"], reward=f"{rec['reward_mean']:.4f}", lag=rec.get("policy_lag_max"))

    def _collect_role_stats(self) -> list[dict]:
        import ray

        out = []
        for a in [self.learner, self.buffer] + self.samplers + self.rewards:
            try:
                out.append(ray.get(a.stats.remote(), timeout=30))
            except Exception as e:  # a dead actor has no stats; say so rather than fail the run
                out.append({"role": "unknown", "error": _short(e)})
        return out

    def shutdown(self) -> None:
        import ray

        for a in [getattr(self, "learner", None), getattr(self, "buffer", None)] + getattr(self, "samplers", []) + getattr(self, "rewards", []):
            if a is not None:
                ray.kill(a, no_restart=True)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else type(e).__name__)[:500]


def _bar(total: int, start: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="epochs", unit="epoch")
