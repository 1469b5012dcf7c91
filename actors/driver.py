"""The single controller: builds the actors from the config and runs the schedule on Ray.

Flow of one batch:  plan -> SamplerActor.sample(plan, weights of version v(epoch)) -> (info, reward input, trajectories)
                    reward input -> RewardActor.score -> rewards keyed by sample id
                    trajectories + rewards -> BufferActor.add_scored
When all batches of an epoch are in: BufferActor.finalize_epoch (advantages, replay) ->
BufferActor.training_batch -> LearnerActor.update -> (metrics, weights). The weights come back
as one object in Ray's object store with its version; the driver keeps the ones the untrained
epochs are sampled with (at most max_policy_lag + 1) and gives each sample call its epoch's.

What to run when is decided by actors/scheduler.py (pure state, no Ray); this module is the shell
that turns its tasks into actor calls, waits (in slices, so the watchdog speaks), and feeds the
outcomes back. It also places the actors (failing at once on a request Ray can never satisfy),
checkpoints, and reports.
"""
from __future__ import annotations

import time
from pathlib import Path

import ray
from tqdm import tqdm

from diffrlhf.actors.checkpoint import save_checkpoint
from diffrlhf.actors.grid import grid_due, grid_rows
from diffrlhf.actors.local_ray import init_ray  # noqa: F401  (re-exported: the CLI and tests start Ray from here)
from diffrlhf.actors.observe import RunMetrics, Watchdog, describe_stall, observe_queues
from diffrlhf.actors.placement import Placement
from diffrlhf.actors.probes import probes_at
from diffrlhf.actors.ray_errors import error_text, first_failure, outcome, ray_restarts, read_all, with_hint
from diffrlhf.actors.resume import carry_counters, restore_line, restore_point, resume_from, resume_hint
from diffrlhf.actors.roles import check_restarts, keeps_workers, restarts_after_restore, role_stats, stop_core_roles
from diffrlhf.actors.scheduler import AddTask, CoreRoleDied, EpochScheduler, PingTask, RunFailed, SampleTask, ScoreTask, UpdateTask
from diffrlhf.actors.settings import plan_for, reward_runtime_env
from diffrlhf.actors.workers import BufferWorker, LearnerWorker, RewardRoleConfig, RewardWorker, SamplerWorker
from diffrlhf.buffer.epoch import EmptyEpochError, epoch_record
from diffrlhf.learner.lora import flatten_lora_state
from diffrlhf.policy.prompts import load_prompts
from diffrlhf.rewards import weighted_sum_names

__all__ = ["Driver", "RunFailed", "init_ray", "ray_restarts"]

PING_AGAIN_S = 0.5  # a restarting actor is asked again after this long
WORK_ROLE = {SampleTask: "samplers", ScoreTask: "rewards", AddTask: "buffer", UpdateTask: "learner"}


class Driver:
    def __init__(self, cfg, run_dir: str | Path, logger=None, progress: bool = True, resume: bool = False,
                 resume_state: dict | None = None, worker_classes: dict | None = None, on_update=None):
        """resume_state: a checkpoint's state (actors.checkpoint.load_checkpoint) to continue from;
        resume=True loads it from run_dir instead. worker_classes overrides a role's class (tests
        inject failing workers); on_update(driver, epoch) is called after each update (tests kill
        actors or stop the run there)."""
        self.cfg, self.run_dir, self.logger, self.progress = cfg, Path(run_dir), logger, progress
        self.worker_classes, self.on_update = worker_classes or {}, on_update
        self.resume, self.resume_state = resume, resume_state
        self.prompts = load_prompts(cfg.prompts.train)  # a bad prompt list fails before any actor starts
        self.sched = EpochScheduler.from_config(cfg)
        self.records: list[dict] = []
        self.role_stats: list[dict] = []
        self.restarts: dict[str, int] = {}  # Ray's restart count per actor name, as last seen
        self.metrics = RunMetrics()
        self.watchdog = Watchdog(role_timeout_s=cfg.system.idle_timeout_s / 2, queue_timeout_s=cfg.system.idle_timeout_s / 2)
        self.placement = Placement(cfg)
        # the actors (start_actors)
        self.learner, self.buffer = None, None  # learner: rank 0 (weights, checkpoints, LoRA folders)
        self.learners, self.samplers, self.rewards = [], [], []
        # the loop's state (run)
        self.weights: dict = {}  # policy version -> object ref of (version, flat LoRA)
        self.pending: dict = {}  # ObjectRef -> (task, submitted at, submission number, extra refs)
        self.watch: dict = {}  # a learner group's rank 1.. update ref -> rank 0's (pending) ref
        self.later: list = []  # (due time, PingTask)
        self.sampled: dict = {}  # (epoch, batch) -> (reward input ref, trajectories ref)
        self.scores: dict = {}  # (epoch, batch) -> ScoreResult, until the buffer add is sent
        self.grid_inputs: dict = {}  # epoch -> {batch: reward input ref}, for the epoch's image grid (actors/grid.py)
        self._n, self._last_progress, self.t_run, self.bar = 0, time.time(), 0.0, None
        # in-run restores after a learner or buffer death (system.max_core_restarts); (counters, t_run) at the death
        self.core_restarts, self.carried = 0, None

    @property
    def counters(self) -> dict:
        return self.sched.counters

    def dropped_summary(self) -> str:
        """The epochs that trained on fewer samples than planned, as a block of lines ('' if none)."""
        return self.sched.dropped_summary()

    # ------------------------------------------------------------------ actors

    def start_actors(self) -> None:
        s, cfg, place = self.cfg.system, self.cfg, self.placement
        place.check()
        classes = {**dict(sampler=SamplerWorker, reward=RewardWorker, buffer=BufferWorker, learner=LearnerWorker), **self.worker_classes}
        self.learners = place.start_learners(classes["learner"])
        self.learner = self.learners[0]
        self.buffer = ray.remote(classes["buffer"]).options(**place.options("buffer")).remote(cfg)
        names = [("learner" if len(self.learners) == 1 else f"learner-{r}", "learner", a) for r, a in enumerate(self.learners)]
        names += [("buffer", "buffer", self.buffer)]
        if not self.samplers:
            self.samplers = [ray.remote(classes["sampler"]).options(**place.options("sampler", s.max_actor_restarts), **place.bundle(i))
                             .remote(cfg, i) for i in range(s.num_samplers)]
            ropts = place.options("reward", s.max_actor_restarts)
            if env := reward_runtime_env(cfg):
                ropts["runtime_env"] = env
            # the reward actors get their slice of the config: they may run in a package reward's venv
            self.rewards = [ray.remote(classes["reward"]).options(**ropts).remote(RewardRoleConfig.of(cfg), i) for i in range(s.num_reward_actors)]
            names += [(f"sampler-{i}", "sampler", a) for i, a in enumerate(self.samplers)]
            names += [(f"reward-{i}", "reward", a) for i, a in enumerate(self.rewards)]
        # Fail early and clearly if a role cannot even start (bad weights, missing packages); say what is pending.
        place.wait_until_started(names)
        if len(self.learners) > 1:
            self._form_learner_group()

    def _form_learner_group(self) -> None:
        """torch.distributed across the learners: rank 0's address and a free port, every rank joins."""
        t = self.cfg.system.start_timeout_s
        try:
            nodes = ray.get([a.node_address.remote() for a in self.learners], timeout=t)
            address, port = nodes[0]
            if len({ip for ip, _ in nodes}) == 1:
                address = "127.0.0.1"  # one node: loopback (a node's routed address can be slow to connect, 40 s measured here)
            ray.get([a.join_group.remote(address, port, self.cfg.system.idle_timeout_s) for a in self.learners], timeout=t)
        except Exception as e:
            raise RunFailed(f"the {len(self.learners)} learners could not form their torch.distributed group: {error_text(e)}") from None

    # ------------------------------------------------------------------ checkpoint

    def save_checkpoint(self, wall_s: float) -> None:
        """Learner and buffer state, the scheduler's counters, and the LoRA of every policy version
        the untrained epochs are sampled with: a resume re-samples those epochs identically."""
        t = self.cfg.system.checkpoint_timeout_s
        learner_state, buffer_state = ray.get([self.learner.state_dict.remote(), self.buffer.state_dict.remote()], timeout=t)
        # broadcasts are flat buffers; checkpoints keep the dict of tensors they always held
        versions = {v: ray.get(self.weights[v], timeout=t)[1].to_state_dict() for v in self.sched.needed_versions()}
        save_checkpoint(self.run_dir, {"learner": learner_state, "buffer": buffer_state, **self.sched.state_dict(),
                                       "versions": versions, "wall_s": wall_s, "config": self.cfg.to_dict()})

    # ------------------------------------------------------------------ the loop

    def run(self) -> list[dict]:
        """The run to its last epoch; a dead learner or buffer: restored from the last checkpoint (_restore)."""
        while True:
            try:
                return self._session()
            except CoreRoleDied as e:
                if self.core_restarts >= (limit := self.cfg.system.max_core_restarts):
                    raise RunFailed(with_hint(f"{e} (system.max_core_restarts={limit} spent)", resume_hint(self.cfg, self.run_dir))) from None
                self._restore(e)

    def _restore(self, e: CoreRoleDied) -> None:
        """The core roles stopped (actors/roles.py keeps_workers), the loop's state dropped, the last checkpoint (or the start) loaded."""
        live = (dict(self.sched.counters), self.t_run)
        kept = self._stop_core_roles()
        state, done = restore_point(self.run_dir)
        self.core_restarts += 1
        print(f"[diffrlhf] {restore_line(e, done, self.core_restarts, self.cfg, bool(kept))}")
        self.sched, self.resume, self.resume_state, self.carried = EpochScheduler.from_config(self.cfg), False, state, live  # counters: resume.carry_counters
        self.records = [r for r in self.records if r["epoch"] < done]
        self.weights, self.pending, self.watch, self.later, self.sampled, self.scores, self.grid_inputs = {}, {}, {}, [], {}, {}, {}
        self.restarts = restarts_after_restore(self.restarts, kept, self.core_restarts)
        if self.logger is not None:
            self.logger.truncate(done)

    def _stop_core_roles(self) -> list[str]:
        """The learners and buffer stopped; the samplers and reward actors kept where they can be
        (actors/roles.py keeps_workers: a cluster's samplers need not load SD1.5 again). The kept names."""
        if not keeps_workers(self.cfg, self.samplers + self.rewards):
            self.shutdown()
            return []
        queued = [ref for ref, (task, *_) in self.pending.items() if isinstance(task, (SampleTask, ScoreTask))]
        stop_core_roles(self.learners + [self.buffer], self.samplers, queued)
        self.placement.release()
        return [name for name, _ in self._named_actors()[len(self.learners) + 1:]]

    def _session(self) -> list[dict]:
        state, sched = resume_from(self.cfg, self.run_dir, self.resume, self.resume_state)
        if sched is not None:
            self.sched = sched
        if self.carried is not None:
            self.sched.counters.update(carry_counters(self.carried[0], self.sched.counters))
        self.start_actors()
        if state is not None:
            # Every rank holds the same LoRA and optimizer state: one saved state fits any num_learners.
            ray.get([a.load_state_dict.remote(state["learner"]) for a in self.learners] + [self.buffer.load_state_dict.remote(state["buffer"])])
            self.weights = {v: ray.put((v, flatten_lora_state(lora))) for v, lora in state["versions"].items()}
            if self.logger is not None:
                self.logger.truncate(self.sched.epochs_done)
        else:
            self.weights = {0: self.learner.weights.remote()}  # version 0: the initial LoRA
            if (err := outcome(self.weights[0])[1]) is not None:  # else each sampling call fails on it, like a dead sampler
                raise CoreRoleDied(f"the learner actor died: {error_text(err)}", "learner")
            self._probes(0, self.weights[0])
        # wall_s continues over a resume; over an in-run restore, the time lost to the death counts too
        self.t_run = self.carried[1] if self.carried else time.time() - (state["wall_s"] if state else 0.0)
        self._last_progress = time.time()
        self.bar = tqdm(total=self.cfg.train.epochs, initial=self.sched.epochs_done, desc="epochs", unit="epoch") if self.progress else None
        try:
            self._submit(self.sched.start())
            while not self.sched.finished:
                observe_queues(self.sched, self.metrics, self.watchdog, len(self.samplers) * self.cfg.system.max_inflight_per_sampler)
                for ref in self._wait():
                    task, _, _, extra = self.pending.pop(ref)
                    self._submit(self._on_result(ref, task, extra))
        except CoreRoleDied:
            raise
        except RunFailed as e:
            raise RunFailed(with_hint(str(e), resume_hint(self.cfg, self.run_dir))) from None
        except ray.exceptions.RayActorError as e:  # a core role died outside a task's result (checkpoint, LoRA save)
            raise CoreRoleDied(f"an actor died while the driver saved the run: {error_text(e)}", "the learner or the buffer") from None
        finally:
            if self.bar is not None:
                self.bar.close()
        self.role_stats = self._collect_role_stats()
        summary = self.dropped_summary()
        if summary:
            print("\n".join(f"[diffrlhf] {line}" for line in summary.splitlines()))
        return self.records

    def _submit(self, tasks) -> None:
        for line in self.sched.notices:
            print(f"[diffrlhf] {line}")
        self.sched.notices.clear()
        for t in tasks:
            if isinstance(t, PingTask) and t.delay:
                self.later.append((time.time() + PING_AGAIN_S, PingTask(t.role, t.actor)))
                continue
            extra = ()
            if isinstance(t, SampleTask):
                plan = plan_for(self.cfg, self.prompts, t.epoch, t.batch)
                ref, *extra = self.samplers[t.actor].sample.options(num_returns=3).remote(plan, self.weights[t.version])
            elif isinstance(t, ScoreTask):
                ref = self.rewards[t.actor].score.remote(self.sampled[t.epoch, t.batch][0])
            elif isinstance(t, AddTask):
                reward_input, traj = self.sampled.pop((t.epoch, t.batch))
                if self.logger is not None and grid_due(self.cfg, t.epoch):
                    self.grid_inputs.setdefault(t.epoch, {})[t.batch] = reward_input
                ref = self.buffer.add_scored.remote(t.epoch, t.batch, traj, self.scores.pop((t.epoch, t.batch)))
            elif isinstance(t, UpdateTask):
                self.sampled = {k: v for k, v in self.sampled.items() if k[0] != t.epoch}  # dropped batches' refs
                summary = self.buffer.finalize_epoch.remote(t.epoch)
                n = len(self.learners)
                shards = self.buffer.training_batch.options(num_returns=n).remote(t.epoch, n)
                calls = [a.update.options(num_returns=2).remote(x) for a, x in zip(self.learners, shards if n > 1 else [shards])]
                (ref, weights), others = calls[0], [m for m, _ in calls[1:]]
                extra = (weights, (summary, *(shards if n > 1 else [shards])), *others)
                self.watch.update({m: ref for m in others})
            else:
                ref = (self.samplers if t.role == "sampler" else self.rewards)[t.actor].ping.remote()
            self._n += 1
            self.pending[ref] = (t, time.time(), self._n, tuple(extra))

    def _on_result(self, ref, t, extra) -> list:
        if not isinstance(t, PingTask):
            self._last_progress = time.time()
            self.watchdog.work_done(WORK_ROLE[type(t)])
        if isinstance(t, PingTask):
            try:
                ray.get(ref)
                return self.sched.ping_answered(t, "up")  # restarted; it loads its weights on its next call
            except ray.exceptions.ActorUnavailableError:
                return self.sched.ping_answered(t, "restarting")
            except ray.exceptions.RayActorError:
                return self.sched.ping_answered(t, "dead")
        if isinstance(t, UpdateTask):
            return self._on_update(ref, t, extra)
        value, err, died = outcome(ref)
        if err is not None:
            read_all(extra)
            return self.sched.failed(t, error_text(err), died)
        if isinstance(t, SampleTask):
            self.sampled[t.epoch, t.batch] = extra
            return self.sched.sampled(t)
        if isinstance(t, ScoreTask):
            self.scores[t.epoch, t.batch] = value
            return self.sched.scored(t, len(value.ids) + len(value.dropped_ids), len(value.dropped_ids))
        return self.sched.added(t)

    def _on_update(self, ref, t, extra) -> list:
        weights, (summary_ref, *shards), *others = extra  # the buffer's summary and shards; others: ranks 1..'s metrics
        summary, err, died = outcome(summary_ref)  # the buffer's part first: its failure explains the learner's
        if err is not None:
            read_all([ref, weights, *others])
            if isinstance(err, EmptyEpochError) or isinstance(getattr(err, "cause", None), EmptyEpochError):
                self.sched.empty_epoch(t)
            return self.sched.failed(t, error_text(err), died, role="buffer")
        # A learner group: a rank that failed leaves the others blocked in a collective until its
        # timeout, so judge the ranks that have returned first and wait for the rest only if none failed.
        calls = [ref, *others]
        self.watch = {w: m for w, m in self.watch.items() if m != ref}
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
        outcomes = {rank: outcome(r) for rank, r in enumerate(calls) if r in ready}
        if not any(err is not None for _, err, _ in outcomes.values()):
            outcomes = {rank: outcome(r) for rank, r in enumerate(calls)}
        failed = [(rank, err, died) for rank, (_, err, died) in outcomes.items() if err is not None]
        if failed:
            if 0 in outcomes:
                read_all([weights])
            if (lost := first_failure(shards)) is not None:  # the buffer died after its summary: the learners got no input
                return self.sched.failed(t, error_text(lost[0]), lost[1], role="buffer")
            rank, err, died = max(failed, key=lambda f: (f[2], -f[0]))  # a dead rank first: it explains the others
            return self.sched.failed(t, (f"learner-{rank} of {len(calls)}: " if len(calls) > 1 else "") + error_text(err), died, role="learner")
        metrics = outcomes[0][0]
        self.weights[t.epoch + 1] = weights
        new = self.sched.updated(t, summary["samples"])
        self._probes(t.epoch + 1, weights)  # before the checkpoint, which then holds the new profile or W
        self._submit([x for x in new if not isinstance(x, UpdateTask)])  # sampling goes on while we log and checkpoint
        keep = set(self.sched.needed_versions())
        self.weights = {v: w for v, w in self.weights.items() if v in keep}
        self._after_update(t.epoch, metrics, summary, time.time() - self.t_run)
        if self.on_update is not None:
            self.on_update(self, t.epoch)
        # The next update goes out only now: actor calls run in order, so the checkpoint above read
        # the learner and buffer before that epoch's finalize and update changed them.
        return [x for x in new if isinstance(x, UpdateTask)]

    def _probes(self, round_: int, weights) -> None:
        queries = probes_at(self.cfg, self.prompts, round_, weights, self.samplers, self.rewards, self.learners, self.buffer, self.logger)
        self.sched.counters["reward_queries"] += queries
        self.sched.counters["reward_queries_total"] += queries
        self._last_progress = time.time()  # a long probe is progress, not a stall for the idle watch

    def _wait(self) -> list:
        """The refs that are ready, in submission order; in slices, so the watchdog speaks and
        delayed pings go out. Raises RunFailed after system.idle_timeout_s without progress."""
        limit = self.cfg.system.idle_timeout_s
        while True:
            now = time.time()
            due = [x for x in self.later if x[0] <= now]
            if due:
                self.later = [x for x in self.later if x[0] > now]
                self._submit([p for _, p in due])
            idle = now - self._last_progress
            if idle >= limit:
                raise RunFailed(describe_stall(self.pending, self.cfg.system.idle_timeout_s))
            step = max(0.01, min([10.0, limit - idle] + [d - now for d, _ in self.later]))
            if not self.pending:
                if not self.later:
                    raise RunFailed(f"nothing in flight and nothing to start, {describe_stall(self.pending, self.cfg.system.idle_timeout_s)}")
                time.sleep(step)
                continue
            refs = list(self.pending) + list(self.watch)
            ready, _ = ray.wait(refs, num_returns=1, timeout=step)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                out = [r for r in ready if r in self.pending]
                for w in [r for r in ready if r in self.watch]:
                    main = self.watch.pop(w)
                    if outcome(w)[1] is not None and main in self.pending and main not in out:
                        out.append(main)  # a learner rank failed: the group's update is over, rank 0 may never return
                if out:
                    return sorted(out, key=lambda r: self.pending[r][2])
                continue
            for warning in self.watchdog.check():
                print(f"[diffrlhf] watchdog: {warning}")

    def _after_update(self, epoch: int, metrics: dict, summary: dict, wall: float) -> None:
        c = self.sched.counters
        rec = epoch_record(epoch, summary["rewards"], c["reward_queries"], metrics, summary.get("reward_terms"),
                           weighted_sum_names(self.cfg.reward.spec), wall_s=wall, samples_trained=summary["samples_trained"],
                           **{k: v for k, v in c.items() if k not in ("epochs_done", "reward_queries")}, **self.sched.last_trained,
                           ray_restarts=self._check_restarts())
        self.records.append(rec)
        self.metrics.epoch(rec, rec["reward_queries"] - (self.records[-2]["reward_queries"] if len(self.records) > 1 else 0))
        self.watchdog.reward(rec["reward_mean"])
        if self.logger is not None:
            self.logger.log(rec)
            if epoch in self.grid_inputs:
                self.logger.save_grid(*grid_rows(self.grid_inputs.pop(epoch), self.cfg.system.idle_timeout_s), f"epoch_{epoch:04d}")
            self.logger.plot_reward_curve()
            self.logger.plot_reward_terms()
        if (epoch + 1) % self.cfg.run.save_every == 0 or epoch + 1 == self.cfg.train.epochs:
            self.save_checkpoint(wall)
            ray.get(self.learner.save_lora.remote(str(self.run_dir / "lora" / f"epoch_{epoch + 1:04d}")))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(queries=c["reward_queries"], reward=f"{rec['reward_mean']:.4f}", lag=rec.get("policy_lag_max"))

    def _named_actors(self) -> list[tuple[str, object]]:
        return ([(f"learner-{i}", a) for i, a in enumerate(self.learners)] + [("buffer", self.buffer)]
                + [(f"sampler-{i}", a) for i, a in enumerate(self.samplers)] + [(f"reward-{i}", a) for i, a in enumerate(self.rewards)])

    def _check_restarts(self) -> int:
        return check_restarts(self._named_actors(), self.restarts, self.cfg.system.max_actor_restarts)

    def _collect_role_stats(self) -> list[dict]:
        self._check_restarts()
        return role_stats(self._named_actors(), self.restarts)

    def shutdown(self) -> None:
        for a in self.learners + [self.buffer] + self.samplers + self.rewards:
            if a is not None:
                ray.kill(a, no_restart=True)
        self.placement.release()
