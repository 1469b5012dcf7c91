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

import logging
import os
import re
import time
from pathlib import Path

import psutil
import ray
from tqdm import tqdm

from diffrlhf.actors import oracle, recast_probe
from diffrlhf.actors.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from diffrlhf.actors.observe import RunMetrics, Watchdog
from diffrlhf.actors.reaper import watch
from diffrlhf.actors.scheduler import (AddTask, EpochScheduler, PingTask, RunFailed, local_resources, SampleTask, ScoreTask, UpdateTask,
                                       resource_problems, role_requests)
from diffrlhf.actors.settings import plan_for, reward_runtime_env
from diffrlhf.actors.workers import BufferWorker, LearnerWorker, RewardRoleConfig, RewardWorker, SamplerWorker
from diffrlhf.buffer.epoch import EmptyEpochError, epoch_record
from diffrlhf.learner.lora import flatten_lora_state
from diffrlhf.policy.prompts import BatchPlan, load_prompts
from diffrlhf.rewards import weighted_sum_names

__all__ = ["Driver", "RunFailed", "init_ray", "ray_restarts"]

PING_AGAIN_S = 0.5  # a restarting actor is asked again after this long
START_REPORT_S = 30.0  # while actors start, say every this long which are still pending and why
WORK_ROLE = {SampleTask: "samplers", ScoreTask: "rewards", AddTask: "buffer", UpdateTask: "learner"}


def init_ray(cfg, num_gpus: float | None = None, quiet: bool = True):
    """Connect to RAY_ADDRESS (cluster, `ray job submit`) or start a local Ray sized for the config."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=not quiet)
        return
    # Ray 2.60 turns token authentication on by default and says so on every local start: a notice
    # about the safe default, not a warning for the user (its "disabled" warning stays). Setting
    # RAY_AUTH_MODE here would not do: Ray reads it at import, and a mismatch fails the start.
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_not_the_auth_default_notice)
    # Logical CPUs: enough for every actor to be placed; torch threads per actor keep real use in check.
    # The dashboard (and the metrics it shows) costs ~0.5 GB: opt in locally with DIFFRLHF_DASHBOARD=1.
    ray.init(address="local", num_cpus=int(local_resources(cfg)["CPU"]), num_gpus=num_gpus,
             include_dashboard=os.environ.get("DIFFRLHF_DASHBOARD") == "1", log_to_driver=not quiet,
             logging_level=logging.WARNING if quiet else logging.INFO)
    _watch_local_ray()


def _not_the_auth_default_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


_reapers: list = []  # the reaper processes' pipes: open for as long as this process lives


def _watch_local_ray() -> None:
    """Have a local Ray ended within seconds if this process dies without shutting it down
    (actors/reaper.py); Ray's own clean-up leaves its agents for about a minute."""
    mine = {r.pid for r in _reapers}
    ray_procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in mine and "ray" in " ".join(p.cmdline()):
                ray_procs.append(p.pid)
        except psutil.Error:
            continue
    reaper = watch(ray_procs)
    if reaper is not None:
        _reapers.append(reaper)


class Driver:
    def __init__(self, cfg, run_dir: str | Path, logger=None, progress: bool = True, resume: bool = False,
                 resume_state: dict | None = None, worker_classes: dict | None = None, on_update=None):
        """resume_state: a checkpoint's state (actors.checkpoint.load_checkpoint) to continue from;
        resume=True loads it from run_dir instead. worker_classes overrides a role's class (tests
        inject failing workers); on_update(driver, epoch) is called after each update (tests kill
        actors or stop the run there)."""
        self.cfg, self.run_dir, self.logger, self.progress = cfg, Path(run_dir), logger, progress
        self.worker_classes, self.on_update = worker_classes or {}, on_update
        self.ckpt_dir = self.run_dir / "checkpoint"
        self.resume, self.resume_state = resume, resume_state
        self.prompts = load_prompts(cfg.prompts.train)  # a bad prompt list fails before any actor starts
        self.sched = EpochScheduler.from_config(cfg)
        self.records: list[dict] = []
        self.role_stats: list[dict] = []
        self.restarts: dict[str, int] = {}  # Ray's restart count per actor name, as last seen
        self.metrics = RunMetrics()
        self.watchdog = Watchdog(role_timeout_s=cfg.system.idle_timeout_s / 2, queue_timeout_s=cfg.system.idle_timeout_s / 2)

    @property
    def counters(self) -> dict:
        return self.sched.counters

    def dropped_summary(self) -> str:
        """The epochs that trained on fewer samples than planned, as a block of lines ('' if none)."""
        return self.sched.dropped_summary()

    # ------------------------------------------------------------------ actors

    def _options(self, role: str, restarts: int = 0) -> dict:
        ask = dict(self.requests[role][1])
        opts = dict(num_cpus=ask.pop("CPU", 0), num_gpus=ask.pop("GPU", 0), max_restarts=restarts, max_task_retries=0)
        if ask:
            opts["resources"] = ask
        return opts

    def check_placement(self) -> None:
        """Every role's request against what the cluster has, before any actor is created: locally
        an impossible request is an error at once; on a cluster (which may autoscale) a warning."""
        self.requests = role_requests(self.cfg)
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        problems = resource_problems(self.requests, ray.cluster_resources(), nodes)
        if not problems:
            return
        text = "\n  ".join(problems)
        if not os.environ.get("RAY_ADDRESS"):
            raise RunFailed(f"this local Ray can never start every actor the config asks for: {'; '.join(problems)}")
        print(f"[diffrlhf] the cluster cannot place every actor yet (waiting for it to scale, up to "
              f"system.start_timeout_s={self.cfg.system.start_timeout_s:g}s):\n  {text}")

    def start_actors(self) -> None:
        s, cfg = self.cfg.system, self.cfg
        self.check_placement()
        classes = {**dict(sampler=SamplerWorker, reward=RewardWorker, buffer=BufferWorker, learner=LearnerWorker), **self.worker_classes}
        self.learners = self._start_learners(classes["learner"])
        self.learner = self.learners[0]  # rank 0: weights, checkpoints, LoRA folders
        self.buffer = ray.remote(classes["buffer"]).options(**self._options("buffer")).remote(cfg)
        self.samplers = [ray.remote(classes["sampler"]).options(**self._options("sampler", s.max_actor_restarts), **self._bundle(i))
                         .remote(cfg, i) for i in range(s.num_samplers)]
        ropts = self._options("reward", s.max_actor_restarts)
        env = reward_runtime_env(cfg)
        if env:
            ropts["runtime_env"] = env
        # the reward actors get their slice of the config: they may run in a package reward's venv
        self.rewards = [ray.remote(classes["reward"]).options(**ropts).remote(RewardRoleConfig.of(cfg), i) for i in range(s.num_reward_actors)]
        # Fail early and clearly if a role cannot even start (bad weights, missing packages); say what is pending.
        names = [("learner" if len(self.learners) == 1 else f"learner-{r}", "learner", a) for r, a in enumerate(self.learners)]
        names += [("buffer", "buffer", self.buffer)]
        names += [(f"sampler-{i}", "sampler", a) for i, a in enumerate(self.samplers)]
        names += [(f"reward-{i}", "reward", a) for i, a in enumerate(self.rewards)]
        pings = {a.ping.remote(): (name, role) for name, role, a in names}
        t0 = time.time()
        while pings:
            elapsed = time.time() - t0
            step = min(START_REPORT_S - elapsed % START_REPORT_S, s.start_timeout_s - elapsed)
            ready, _ = ray.wait(list(pings), num_returns=1, timeout=max(step, 0.01))
            for ref in ready:
                name, _ = pings.pop(ref)
                try:
                    ray.get(ref)
                except Exception as e:
                    raise RunFailed(f"the {name} actor failed to start: {_error_text(e)}") from None
            if ready:
                continue
            elapsed = time.time() - t0
            waiting = "; ".join(f"{name} (asks {_fmt(self.requests[role][1]) or 'nothing'})" for name, role in pings.values())
            if elapsed >= s.start_timeout_s:
                raise RunFailed(f"not started after {elapsed:.0f}s (system.start_timeout_s): {waiting}. The cluster has "
                                f"{_fmt(ray.cluster_resources())}, free now {_fmt(ray.available_resources())}")
            print(f"[diffrlhf] {elapsed:.0f}s: {len(pings)} actor(s) still starting (loading, or waiting for resources): "
                  f"{waiting}; free now: {_fmt(ray.available_resources())}")
        if len(self.learners) > 1:
            self._form_learner_group()

    def _start_learners(self, cls) -> list:
        """One learner, or a group in a placement group that packs its ranks on as few nodes as fit
        (PACK: one node where possible, spread over nodes where not). Colocated (system.colocate),
        bundle r holds learner r and sampler r together: with fractional GPU requests that sum to
        one, the pair time-shares one GPU (a plain PACK of 0.5-GPU learners would put two learners
        on a GPU and leave the samplers the others)."""
        s, opts = self.cfg.system, self._options("learner")
        self.learner_pg = None
        if s.num_learners == 1 and not s.colocate:
            return [ray.remote(cls).options(**opts).remote(self.cfg)]
        from ray.util.placement_group import placement_group

        def ask(o):
            return {"CPU": o["num_cpus"], "GPU": o["num_gpus"], **o.get("resources", {})}

        bundle = ask(opts)
        if s.colocate:
            sampler = ask(self._options("sampler"))
            bundle = {k: bundle.get(k, 0) + sampler.get(k, 0) for k in {**bundle, **sampler}}
        bundle = {k: v for k, v in bundle.items() if v}
        self.learner_pg = placement_group([bundle] * s.num_learners, strategy="PACK", name=f"diffrlhf-learners-{os.getpid()}")
        world = s.num_learners
        return [ray.remote(cls).options(**opts, **self._bundle(r, learner=True)).remote(self.cfg, r, world) for r in range(world)]

    def _bundle(self, i: int, learner: bool = False) -> dict:
        """Actor options placing learner i (or, colocated, sampler i) in bundle i of the learner placement group."""
        if self.learner_pg is None or not (learner or self.cfg.system.colocate):
            return {}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.learner_pg, placement_group_bundle_index=i)}

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
            raise RunFailed(f"the {len(self.learners)} learners could not form their torch.distributed group: {_error_text(e)}") from None

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

    def _resume_from(self) -> dict | None:
        """The state to continue from (checked before any actor starts), or None for a new run."""
        state = self.resume_state
        if state is None and self.resume:
            try:
                state = load_checkpoint(self.run_dir)
            except CheckpointError as e:
                raise RunFailed(f"cannot resume: {e}") from None
        if state is None:
            return None
        if "versions" not in state:
            raise RunFailed(f"cannot resume from {self.ckpt_dir}: it was written before checkpoints held the policy "
                            f"versions the next epochs are sampled with; start a new run")
        sched = EpochScheduler.from_config(self.cfg, state)
        missing = sorted(set(sched.needed_versions()) - set(state["versions"]))
        if missing:
            raise RunFailed(f"cannot resume: with system.max_policy_lag={self.cfg.system.max_policy_lag} the next epochs are "
                            f"sampled with policy versions {sched.needed_versions()}, the checkpoint holds {sorted(state['versions'])}; "
                            f"resume with the run's own max_policy_lag ({state['config']['system']['max_policy_lag']})")
        self.sched = sched
        return state

    def _resume_hint(self) -> str:
        found = latest_checkpoint(self.run_dir)
        if found is None:
            return " No checkpoint was written yet: start the run again."
        path, epochs = found
        done = f" ({epochs} of {self.cfg.train.epochs} epochs done)" if epochs is not None else ""
        return f" The last checkpoint{done} is {path}; continue with: diffrlhf train --resume {self.run_dir}"

    # ------------------------------------------------------------------ the loop

    def run(self) -> list[dict]:
        state = self._resume_from()
        self.start_actors()
        if state is not None:
            # Every rank holds the same LoRA and optimizer state: one saved state fits any num_learners.
            ray.get([a.load_state_dict.remote(state["learner"]) for a in self.learners] + [self.buffer.load_state_dict.remote(state["buffer"])])
            self.weights = {v: ray.put((v, flatten_lora_state(lora))) for v, lora in state["versions"].items()}
            if self.logger is not None:
                self.logger.truncate(self.sched.epochs_done)
        else:
            self.weights = {0: self.learner.weights.remote()}  # version 0: the initial LoRA
            if 0 in oracle.probe_rounds(self.cfg):
                self._probe(0, self.weights[0])
            if 0 in recast_probe.probe_rounds(self.cfg):
                self._probe_recast(0, self.weights[0])
        self.t_run = time.time() - (state["wall_s"] if state else 0.0)  # wall_s continues over a resume
        self.pending: dict = {}  # ObjectRef -> (task, submitted at, submission number, extra refs)
        self.watch: dict = {}  # a learner group's rank 1.. update ref -> rank 0's (pending) ref
        self.later: list = []  # (due time, PingTask)
        self.sampled: dict = {}  # (epoch, batch) -> (reward input ref, trajectories ref)
        self.scores: dict = {}  # (epoch, batch) -> ScoreResult, until the buffer add is sent
        self._n, self._last_progress = 0, time.time()
        self.bar = _bar(self.cfg.train.epochs, self.sched.epochs_done, self.progress)
        try:
            self._submit(self.sched.start())
            while not self.sched.finished:
                self._observe()
                for ref in self._wait():
                    task, _, _, extra = self.pending.pop(ref)
                    self._submit(self._on_result(ref, task, extra))
        except RunFailed as e:
            raise RunFailed(_with_hint(str(e), self._resume_hint())) from None
        except ray.exceptions.RayActorError as e:  # a core role died outside a task's result (checkpoint, LoRA save)
            raise RunFailed(f"an actor died while the driver saved the run: {_error_text(e)}.{self._resume_hint()}") from None
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
                _, traj = self.sampled.pop((t.epoch, t.batch))
                ref = self.buffer.add_scored.remote(t.epoch, t.batch, traj, self.scores.pop((t.epoch, t.batch)))
            elif isinstance(t, UpdateTask):
                self.sampled = {k: v for k, v in self.sampled.items() if k[0] != t.epoch}  # dropped batches' refs
                summary = self.buffer.finalize_epoch.remote(t.epoch)
                n = len(self.learners)
                shards = self.buffer.training_batch.options(num_returns=n).remote(t.epoch, n)
                calls = [a.update.options(num_returns=2).remote(x) for a, x in zip(self.learners, shards if n > 1 else [shards])]
                (ref, weights), others = calls[0], [m for m, _ in calls[1:]]
                extra = (weights, summary, *others)
                self.watch.update({m: ref for m in others})
            else:
                ref = self._actors(t.role)[t.actor].ping.remote()
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
        value, err, died = _outcome(ref)
        if err is not None:
            _read(extra)
            return self.sched.failed(t, _error_text(err), died)
        if isinstance(t, SampleTask):
            self.sampled[t.epoch, t.batch] = extra
            return self.sched.sampled(t)
        if isinstance(t, ScoreTask):
            self.scores[t.epoch, t.batch] = value
            return self.sched.scored(t, len(value.ids) + len(value.dropped_ids), len(value.dropped_ids))
        return self.sched.added(t)

    def _on_update(self, ref, t, extra) -> list:
        weights, summary_ref, *others = extra  # others: the metrics of ranks 1.. of a learner group
        summary, err, died = _outcome(summary_ref)  # the buffer's part first: its failure explains the learner's
        if err is not None:
            _read([ref, weights, *others])
            if isinstance(err, EmptyEpochError) or isinstance(getattr(err, "cause", None), EmptyEpochError):
                self.sched.empty_epoch(t)
            return self.sched.failed(t, _error_text(err), died, role="buffer")
        # A learner group: a rank that failed leaves the others blocked in a collective until its
        # timeout, so judge the ranks that have returned first and wait for the rest only if none failed.
        calls = [ref, *others]
        self.watch = {w: m for w, m in self.watch.items() if m != ref}
        ready, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
        outcomes = {rank: _outcome(r) for rank, r in enumerate(calls) if r in ready}
        if not any(err is not None for _, err, _ in outcomes.values()):
            outcomes = {rank: _outcome(r) for rank, r in enumerate(calls)}
        failed = [(rank, err, died) for rank, (_, err, died) in outcomes.items() if err is not None]
        if failed:
            if 0 in outcomes:
                _read([weights])
            rank, err, died = max(failed, key=lambda f: (f[2], -f[0]))  # a dead rank first: it explains the others
            who = f"learner-{rank} of {len(calls)}: " if len(calls) > 1 else ""
            return self.sched.failed(t, who + _error_text(err), died, role="learner")
        metrics = outcomes[0][0]
        self.weights[t.epoch + 1] = weights
        new = self.sched.updated(t, summary["samples"])
        if t.epoch + 1 in oracle.probe_rounds(self.cfg):  # before the checkpoint, which then holds the new profile
            self._probe(t.epoch + 1, weights)
        if t.epoch + 1 in recast_probe.probe_rounds(self.cfg):  # likewise: the checkpoint holds the new W
            self._probe_recast(t.epoch + 1, weights)
        self._submit([x for x in new if not isinstance(x, UpdateTask)])  # sampling goes on while we log and checkpoint
        keep = set(self.sched.needed_versions())
        self.weights = {v: w for v, w in self.weights.items() if v in keep}
        self._after_update(t.epoch, metrics, summary, time.time() - self.t_run)
        if self.on_update is not None:
            self.on_update(self, t.epoch)
        # The next update goes out only now: actor calls run in order, so the checkpoint above read
        # the learner and buffer before that epoch's finalize and update changed them.
        return [x for x in new if isinstance(x, UpdateTask)]

    def _probe_callables(self, round_: int, weights, branches: int):
        """sample, branch_all and score of a probe on the run's actors, with the policy `weights` (an
        object ref of (version, flat LoRA)): the branches over every sampler, the scores on reward actor 0."""
        t = self.cfg.system.idle_timeout_s

        def sample(prompts, seeds, ids):
            plan = BatchPlan(-1, round_, prompts, seeds, ids)
            return ray.get(self.samplers[0].sample.options(num_returns=3).remote(plan, weights)[2], timeout=t)

        def branch_all(batch, jobs):
            refs = [self.samplers[i % len(self.samplers)].branch.remote(batch, k, branches, seeds, weights)
                    for i, (k, seeds) in enumerate(jobs)]
            return ray.get(refs, timeout=t)

        def score(ids, images, prompts):
            return ray.get(self.rewards[0].score.remote({"ids": ids, "images": images, "prompts": prompts}), timeout=t)

        return sample, branch_all, score

    def _count_probe(self, queries: int) -> None:
        self.sched.counters["reward_queries"] += queries
        self.sched.counters["reward_queries_total"] += queries
        self._last_progress = time.time()  # a long probe is progress, not a stall for the idle watch

    def _probe(self, round_: int, weights) -> None:
        """The oracle weighting's probe (actors/oracle.py): the profile to every learner rank; its
        queries count as the run's."""
        try:
            profile, _, queries = oracle.measure(self.cfg, self.prompts, round_,
                                                 *self._probe_callables(round_, weights, self.cfg.weighting.oracle_branches))
        except (ray.exceptions.RayError, ValueError) as e:
            raise RunFailed(f"the oracle weighting's probe after {round_} updates failed: {_error_text(e)}") from None
        ray.get([a.set_timestep_profile.remote(profile) for a in self.learners], timeout=self.cfg.system.idle_timeout_s)
        self._count_probe(queries)

    def _probe_recast(self, round_: int, weights) -> None:
        """ReCAST's probe (actors/recast_probe.py): W to the buffer and every learner rank, logged;
        its queries count as the run's."""
        try:
            result, queries = recast_probe.measure(self.cfg, self.prompts, round_,
                                                   *self._probe_callables(round_, weights, self.cfg.recast.branches))
        except (ray.exceptions.RayError, ValueError, RuntimeError) as e:
            raise RunFailed(f"ReCAST's probe after {round_} updates failed: {_error_text(e)}") from None
        w = result["weights"]
        ray.get([a.set_recast_weights.remote(w) for a in self.learners] + [self.buffer.set_recast_weights.remote(w)],
                timeout=self.cfg.system.idle_timeout_s)
        if self.logger is not None:
            self.logger.log_recast(result)
        self._count_probe(queries)

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
                raise RunFailed(self._describe_stall())
            step = max(0.01, min([10.0, limit - idle] + [d - now for d, _ in self.later]))
            if not self.pending:
                if not self.later:
                    raise RunFailed(f"nothing in flight and nothing to start, {self._describe_stall()}")
                time.sleep(step)
                continue
            refs = list(self.pending) + list(self.watch)
            ready, _ = ray.wait(refs, num_returns=1, timeout=step)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                out = [r for r in ready if r in self.pending]
                for w in [r for r in ready if r in self.watch]:
                    main = self.watch.pop(w)
                    if _outcome(w)[1] is not None and main in self.pending and main not in out:
                        out.append(main)  # a learner rank failed: the group's update is over, rank 0 may never return
                if out:
                    return sorted(out, key=lambda r: self.pending[r][2])
                continue
            for warning in self.watchdog.check():
                print(f"[diffrlhf] watchdog: {warning}")

    def _observe(self) -> None:
        depths, waits = self.sched.describe()
        self.metrics.queues(depths)
        cap = len(self.samplers) * self.cfg.system.max_inflight_per_sampler
        self.watchdog.queue("sampling", depths["sampling"], cap)
        self.watchdog.queue("scoring", depths["scoring"], cap)
        for role, what in waits.items():
            self.watchdog.waiting(role, what)

    def _actors(self, role: str) -> list:
        return self.samplers if role == "sampler" else self.rewards

    def _describe_stall(self) -> str:
        now = time.time()
        waits = sorted(self.pending.values(), key=lambda p: p[1])[:6]
        what = "; ".join(f"{t} for {now - since:.0f}s" for t, since, _, _ in waits)
        return f"nothing finished for {self.cfg.system.idle_timeout_s:.0f}s (system.idle_timeout_s); waiting on: {what or 'nothing'}"

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
            g = self.cfg.run.image_grid_every
            if g and (epoch % g == 0 or epoch == self.cfg.train.epochs - 1):
                self.logger.save_grid(summary["images"], summary["prompts"], f"epoch_{epoch:04d}")
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
        """Ray's restarts of each actor (its GCS count: restarts between calls too, which no call
        of the driver sees), one line for each new one; the total so far."""
        max_restarts = self.cfg.system.max_actor_restarts
        for name, actor in self._named_actors():
            n = ray_restarts(actor)
            if n is not None and n > self.restarts.get(name, 0):
                print(f"[diffrlhf] {name} was restarted by Ray ({n} restart{'s' * (n > 1)} of system.max_actor_restarts={max_restarts})")
                self.restarts[name] = n
        return sum(self.restarts.values())

    def _collect_role_stats(self) -> list[dict]:
        self._check_restarts()
        out = []
        for name, a in self._named_actors():
            try:
                out.append({**ray.get(a.stats.remote(), timeout=30), "ray_restarts": self.restarts.get(name, 0)})
            except Exception as e:  # a dead actor has no stats; say so rather than fail the run
                out.append({"role": name, "error": _error_text(e), "ray_restarts": self.restarts.get(name, 0)})
        return out

    def shutdown(self) -> None:
        for a in getattr(self, "learners", []) + [getattr(self, "buffer", None)] + getattr(self, "samplers", []) + getattr(self, "rewards", []):
            if a is not None:
                ray.kill(a, no_restart=True)
        if getattr(self, "learner_pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.learner_pg)
            self.learner_pg = None


def ray_restarts(actor) -> int | None:
    """How often Ray restarted the actor, from its GCS record (a private Ray API: None where it
    is not available)."""
    try:
        from ray._private.state import actors

        return int(actors(actor._actor_id.hex())["NumRestarts"])
    except Exception:
        return None


def _outcome(ref):
    """(value, error, actor died) of a finished call."""
    try:
        return ray.get(ref), None, False
    except ray.exceptions.RayActorError as e:  # died, or unavailable while restarting
        return None, e, True
    except ray.exceptions.RayError as e:  # the call itself raised (RayTaskError), or its input was lost
        return None, e, False


def _read(refs) -> None:
    """Fetch the other results of a failed call (their errors too), so Ray does not log them as unhandled."""
    for r in refs:
        _outcome(r)


def _with_hint(message: str, hint: str) -> str:
    """The resume hint on the message's first line (the CLI prints errors as one line)."""
    first, *rest = message.strip().splitlines() or [""]
    return "\n".join([f"{first.rstrip('.')}.{hint}", *rest])


def _actor_death(text: str) -> str:
    """Ray's actor-death text, short: an error raised in the actor's creation task as that error's
    own message; otherwise the first line and the exit detail's first sentence (Ray's advice on
    resource isolation and the actor's ids are left out)."""
    text = _ANSI.sub("", text)
    if "creation task" in text and "  File " in text:
        return _without_frames(text)
    m = re.match(r"(.*?Worker exit detail: [^.]*\.?)", text, re.S)
    if m:
        return " ".join(m.group(1).split())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else "the actor died"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _without_frames(text: str) -> str:
    """The error's own message after the last traceback frame (its source line and carets dropped)."""
    lines = text.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if not frames:
        return text.strip()
    rest = lines[frames[-1] + 1:]
    while rest and rest[0].startswith("    "):  # the frame's source line and caret marks
        rest = rest[1:]
    return "\n".join(rest).strip() or text.strip()


def _error_text(e: BaseException) -> str:
    """The original error's whole message, without Ray's traceback frames: a multi-line message
    (e.g. missing weights and the command that fetches them) stays whole."""
    cause = getattr(e, "cause", None)
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
        return f"{type(cause).__name__}: {cause}".strip()
    if isinstance(e, ray.exceptions.RayActorError):
        return _actor_death(str(e.error_msg))
    return _without_frames(_ANSI.sub("", str(e))) or type(e).__name__


def _fmt(resources: dict) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items()) if v and not k.startswith(("node:", "memory", "object_store")))


def _bar(total: int, start: int, enabled: bool):
    if not enabled:
        return None

    return tqdm(total=total, initial=start, desc="epochs", unit="epoch")
