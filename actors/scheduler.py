"""The driver's loop as pure state: what to dispatch next, and what each outcome changes.

No Ray here. The Driver (actors/driver.py) turns the tasks returned by these methods into actor
calls and feeds each call's outcome back, so every schedule and fault path is tested without Ray
(tests/test_scheduler.py).

Decisions:
- Epoch e is sampled with policy version v(e) = max(0, e - max_policy_lag), whenever it is
  dispatched: what an epoch sees is a function of the schedule, not of timing, so runs repeat
  and resume exactly. Epoch e may start once version v(e) exists: that is the lag bound.
- Each sampler has at most max_inflight_per_sampler batches in flight; a scored batch goes to the
  least loaded reward actor.
- An actor whose call died is "down" until a ping answers (Ray restarts it): its work waits for
  it or goes to another usable actor of the role, never to a restarting one. It is "dead" once
  its restarts are spent; the run fails when every actor of a role is dead.
- A death costs a batch an attempt only if its call was the one running (the oldest in flight
  on that actor: an actor runs its calls in order); calls queued behind it are re-queued free.
  A batch whose calls killed max_batch_retries + 1 live actors is dropped: its epoch trains
  without it, and dropped_summary() says which epochs trained on how many samples.
"""
from __future__ import annotations

import collections
import os
from dataclasses import dataclass

import torch


class RunFailed(RuntimeError):
    """The run cannot go on (a dead learner or buffer, a whole role dead, nothing to train on, a stall)."""


class CoreRoleDied(RunFailed):
    """A learner or the buffer died: the driver restores them from the last checkpoint (the samplers
    and reward actors kept where they can be, actors/roles.py keeps_workers), within the run, up to
    system.max_core_restarts times (actors/resume.py); then it is a RunFailed."""

    def __init__(self, message: str, role: str):
        super().__init__(message)
        self.role = role


@dataclass(eq=False)
class SampleTask:
    epoch: int
    batch: int
    actor: int
    attempt: int
    version: int  # the policy version this batch is sampled with: v(epoch)
    incarnation: int = 0  # which life of the actor it was sent to (deaths counted by the scheduler)
    charged: bool = False  # its call was running when the actor died: the retry costs an attempt
    role = "sampler"

    def __str__(self):
        return f"sample of epoch {self.epoch} batch {self.batch} (sampler-{self.actor}, policy version {self.version})"


@dataclass(eq=False)
class ScoreTask:
    epoch: int
    batch: int
    actor: int
    attempt: int
    incarnation: int = 0
    charged: bool = False
    role = "reward"

    def __str__(self):
        return f"score of epoch {self.epoch} batch {self.batch} (reward-{self.actor})"


@dataclass(eq=False)
class AddTask:
    epoch: int
    batch: int
    role = "buffer"

    def __str__(self):
        return f"buffer add of epoch {self.epoch} batch {self.batch}"


@dataclass(eq=False)
class UpdateTask:
    epoch: int
    role = "learner"

    def __str__(self):
        return f"update of epoch {self.epoch} (buffer finalize, then learner)"


@dataclass(eq=False)
class PingTask:
    role: str
    actor: int
    delay: bool = False  # the actor was still restarting: ask again shortly, not at once

    def __str__(self):
        return f"ping of {self.role}-{self.actor} (restarting)"


Task = SampleTask | ScoreTask | AddTask | UpdateTask | PingTask

COUNTERS = ("epochs_done", "reward_queries", "reward_queries_total", "reward_queries_lost", "reward_dropped",
            "batches_dropped", "sample_retries", "score_retries", "actor_deaths")


class EpochScheduler:
    """State of one run's loop. Events return the tasks to start now; RunFailed when it cannot go on.

    Counters: reward_queries counts the queries behind the trained epochs (sample efficiency's
    x-axis); reward_queries_total every query a reward actor answered and the driver received, the
    queries paid for, re-done ones included; reward_queries_lost the part of that total whose epochs
    a stop threw away (a resumed run re-makes them: over the whole run, total = trained + lost).
    """

    def __init__(self, epochs: int, batches_per_epoch: int, batch_size: int, num_samplers: int, num_rewards: int,
                 max_policy_lag: int = 1, max_inflight_per_sampler: int = 1, max_batch_retries: int = 2,
                 max_actor_restarts: int = 3, state: dict | None = None):
        self.epochs, self.batches_per_epoch, self.batch_size = epochs, batches_per_epoch, batch_size
        self.lag, self.max_inflight, self.max_retries, self.max_restarts = max_policy_lag, max_inflight_per_sampler, max_batch_retries, max_actor_restarts
        self.n = {"sampler": num_samplers, "reward": num_rewards}
        self.counters = dict.fromkeys(COUNTERS, 0)
        # per trained epoch that trained on fewer samples than planned: samples, dropped batches, dropped rewards
        self.short: dict[int, dict] = {}
        if state is not None:
            self.counters.update(state["counters"])
            self.short = {int(e): dict(v) for e, v in state.get("short_epochs", {}).items()}
        start = self.counters["epochs_done"]
        self.to_sample = collections.deque((e, b, 0) for e in range(start, epochs) for b in range(batches_per_epoch))
        self.to_score: collections.deque = collections.deque()  # (epoch, batch, attempt) sampled, waiting for a reward actor
        self.running = {(r, i): [] for r, k in self.n.items() for i in range(k)}  # calls in flight per actor, in order
        self.incarnation = {key: 0 for key in self.running}
        self.down = {r: set() for r in self.n}
        self.dead = {r: set() for r in self.n}
        self.batches_in: collections.Counter = collections.Counter()  # buffered or dropped, per epoch
        self.epoch_queries: collections.Counter = collections.Counter()  # untrained epochs only
        self.rewards_dropped: collections.Counter = collections.Counter()
        self.last_trained: dict = {"reward_dropped_epoch": 0, "batches_dropped_epoch": 0}
        self.dropped: dict[int, list[int]] = collections.defaultdict(list)
        self.adding = 0
        self.updating = False
        self.notices: list[str] = []  # lines for the log; the driver prints and clears them

    @classmethod
    def from_config(cls, cfg, state: dict | None = None) -> "EpochScheduler":
        s = cfg.system
        return cls(cfg.train.epochs, cfg.sample.batches_per_epoch, cfg.sample.batch_size, s.num_samplers, s.num_reward_actors,
                   s.max_policy_lag, s.max_inflight_per_sampler, s.max_batch_retries, s.max_actor_restarts, state)

    # ------------------------------------------------------------------ queries

    @property
    def epochs_done(self) -> int:
        return self.counters["epochs_done"]

    @property
    def finished(self) -> bool:
        return self.epochs_done >= self.epochs

    def policy_version(self, epoch: int) -> int:
        return max(0, epoch - self.lag)

    def needed_versions(self) -> list[int]:
        """Policy versions the untrained epochs are sampled with (at most lag + 1)."""
        return list(range(self.policy_version(self.epochs_done), self.epochs_done + 1))

    def usable(self, role: str) -> list[int]:
        return [i for i in range(self.n[role]) if i not in self.down[role] and i not in self.dead[role]]

    def load(self, role: str, i: int) -> int:
        return len(self.running[role, i])

    # ------------------------------------------------------------------ events

    def start(self) -> list:
        return self._next()

    def sampled(self, t: SampleTask) -> list:
        self.running[t.role, t.actor].remove(t)
        self.to_score.append((t.epoch, t.batch, 0))
        return self._next()

    def scored(self, t: ScoreTask, queries: int, dropped: int) -> list:
        """queries: images scored (dropped non-finite ones included: the model was asked)."""
        self.running[t.role, t.actor].remove(t)
        self.counters["reward_queries_total"] += queries
        self.counters["reward_dropped"] += dropped
        self.epoch_queries[t.epoch] += queries
        self.rewards_dropped[t.epoch] += dropped
        self.adding += 1
        return [AddTask(t.epoch, t.batch)] + self._next()

    def added(self, t: AddTask) -> list:
        self.adding -= 1
        self.batches_in[t.epoch] += 1
        return self._next()

    def updated(self, t: UpdateTask, samples: int) -> list:
        """Epoch t.epoch is trained (on `samples` trajectories): policy version t.epoch + 1 exists."""
        e = t.epoch
        self.updating = False
        self.counters["epochs_done"] = e + 1
        self.counters["reward_queries"] += self.epoch_queries.pop(e, 0)
        # The epoch's own losses, for its record (the counters also hold epochs still in flight).
        self.last_trained = {"reward_dropped_epoch": self.rewards_dropped.get(e, 0), "batches_dropped_epoch": len(self.dropped.get(e, []))}
        if samples < self.batches_per_epoch * self.batch_size:
            self.short[e] = {"samples": samples, "batches_dropped": sorted(self.dropped.get(e, [])),
                             "rewards_dropped": self.rewards_dropped.get(e, 0)}
        self.dropped.pop(e, None)
        self.rewards_dropped.pop(e, None)
        return self._next()

    def failed(self, t: Task, error: str, died: bool, role: str | None = None) -> list:
        """A call failed. died: its actor died or is unavailable (restarting); else the call raised.
        role: which role failed, for an update (the buffer's finalize or the learner's update)."""
        role = role or t.role
        if isinstance(t, UpdateTask):
            self.updating = False
        if isinstance(t, (AddTask, UpdateTask)):
            if died:
                raise CoreRoleDied(f"the {role} actor died: {error}", role)
            raise RunFailed(f"the {role} failed during epoch {t.epoch}: {error}")
        if isinstance(t, PingTask):
            raise RunFailed(f"{t.role}-{t.actor} failed to answer a ping: {error}")
        if not died:  # an exception in the work itself: the same input would fail again
            raise RunFailed(f"{role}-{t.actor} failed on epoch {t.epoch} batch {t.batch}: {error}")
        out = self._actor_died(t)
        self.running[role, t.actor].remove(t)
        attempt = t.attempt + t.charged
        stage = "sampling" if isinstance(t, SampleTask) else "scoring"
        if attempt > self.max_retries:
            self._drop(t, error)
        else:
            self.counters["sample_retries" if isinstance(t, SampleTask) else "score_retries"] += 1
            (self.to_sample if isinstance(t, SampleTask) else self.to_score).appendleft((t.epoch, t.batch, attempt))
            # One project line per death noticed and per retried batch (Ray's own lines are not the project's).
            death = (f"{role}-{t.actor} died ({error}; actor deaths so far: {self.counters['actor_deaths']}); Ray restarts it "
                     f"(system.max_actor_restarts={self.max_restarts}). " if out else f"{role}-{t.actor} was down. ")
            self.notices.append(f"{death}Epoch {t.epoch} batch {t.batch}: {stage} retried"
                                + (f" (charged retry {attempt} of system.max_batch_retries={self.max_retries})" if t.charged else
                                   " (not charged: it was waiting behind the call that died)"))
        return out + self._next()

    def empty_epoch(self, t: UpdateTask) -> None:
        """The buffer found nothing to train on in epoch t.epoch (buffer.epoch.EmptyEpochError)."""
        e = t.epoch
        lost = self.dropped.get(e, [])
        batches = (f"; batches {lost} were dropped after system.max_batch_retries={self.max_retries} retries"
                   if lost else "")
        raise RunFailed(
            f"epoch {e} has nothing left to train on: {self.rewards_dropped[e]} of its {self.epoch_queries[e]} rewards "
            f"were non-finite and dropped (reward.nan_policy=drop){batches}. The reward function returns NaN/inf: fix it, "
            f"or set reward.nan_policy=raise to stop at the first such sample with its id and prompt")

    def ping_answered(self, t: PingTask, outcome: str) -> list:
        """outcome: "up" (restarted), "restarting" (ask again), or "dead" (restarts spent)."""
        if outcome == "restarting":
            return [PingTask(t.role, t.actor, delay=True)]
        self.down[t.role].discard(t.actor)
        if outcome == "dead":
            self.dead[t.role].add(t.actor)
            self.notices.append(f"{t.role}-{t.actor} is dead for good (system.max_actor_restarts={self.max_restarts} "
                                f"spent); going on with {len(self.usable(t.role))} {t.role} actor(s)")
        return self._next()

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict:
        """What a resumed run needs: it restarts every untrained epoch from its first batch, so
        the work done on those is lost; its queries stay in the total (they were paid for) and are
        counted in reward_queries_lost too (the part of the total that bought nothing)."""
        c = dict(self.counters)
        lost = sum(self.epoch_queries.values())
        c["reward_queries_lost"] += lost
        c["reward_dropped"] -= sum(self.rewards_dropped.values())
        c["batches_dropped"] -= sum(len(v) for v in self.dropped.values())
        return {"counters": c, "short_epochs": {e: dict(v) for e, v in self.short.items()}, "queries_in_flight": lost}

    # ------------------------------------------------------------------ reporting

    def dropped_summary(self) -> str:
        """A block naming the trained epochs that had fewer samples than planned ('' if none)."""
        if not self.short:
            return ""
        planned = self.batches_per_epoch * self.batch_size
        lines = [f"WARNING: {len(self.short)} epoch(s) trained on fewer than the planned {planned} samples:"]
        for e, s in sorted(self.short.items()):
            why = []
            if s["batches_dropped"]:
                why.append(f"batches {s['batches_dropped']} dropped after system.max_batch_retries={self.max_retries} retries")
            if s["rewards_dropped"]:
                why.append(f"{s['rewards_dropped']} non-finite rewards dropped (reward.nan_policy=drop)")
            lines.append(f"  epoch {e}: {s['samples']} of {planned} samples ({'; '.join(why) or 'rows lost'})")
        return "\n".join(lines)

    def describe(self) -> tuple[dict, dict]:
        """(queue depths, what each role waits on) for metrics and the watchdog."""
        calls = [t for v in self.running.values() for t in v]
        nxt = self.epochs_done
        depths = {"to_sample": len(self.to_sample), "sampling": sum(isinstance(t, SampleTask) for t in calls),
                  "scoring": sum(isinstance(t, ScoreTask) for t in calls) + len(self.to_score), "buffering": self.adding,
                  "epochs_ready": int(not self.updating and self.batches_in[nxt] >= self.batches_per_epoch)}
        if self.to_sample and self.policy_version(self.to_sample[0][0]) > self.epochs_done:
            e = self.to_sample[0][0]
            samplers = f"the learner: epoch {e} is sampled with policy version {self.policy_version(e)}, have {self.epochs_done}"
        elif self.to_sample:
            samplers = "a free sampler slot" + (f" (down: {sorted(self.down['sampler'])})" if self.down["sampler"] else "")
        else:
            samplers = "nothing (all epochs planned)"
        waits = {"samplers": samplers,
                 "learner": f"epoch {nxt}: {self.batches_in[nxt]}/{self.batches_per_epoch} batches scored and buffered"}
        return depths, waits

    # ------------------------------------------------------------------ internals

    def _next(self) -> list:
        for role in self.n:
            if len(self.dead[role]) == self.n[role]:
                raise RunFailed(f"every {role} actor is dead (system.max_actor_restarts={self.max_restarts} spent on each)")
        out = []
        # sampling, in (epoch, batch) order, within the lag bound and the per-sampler in-flight bound
        while self.to_sample and self.policy_version(self.to_sample[0][0]) <= self.epochs_done:
            free = [i for i in self.usable("sampler") if self.load("sampler", i) < self.max_inflight]
            if not free:
                break
            i = min(free, key=lambda j: self.load("sampler", j))
            e, b, attempt = self.to_sample.popleft()
            out.append(self._run(SampleTask(e, b, i, attempt, self.policy_version(e))))
        while self.to_score and self.usable("reward"):
            j = min(self.usable("reward"), key=lambda k: self.load("reward", k))
            e, b, attempt = self.to_score.popleft()
            out.append(self._run(ScoreTask(e, b, j, attempt)))
        nxt = self.epochs_done
        if not self.updating and nxt < self.epochs and self.batches_in[nxt] >= self.batches_per_epoch:
            self.updating = True
            out.append(UpdateTask(nxt))
        return out

    def _run(self, t):
        t.incarnation = self.incarnation[t.role, t.actor]
        self.running[t.role, t.actor].append(t)
        return t

    def _actor_died(self, t) -> list:
        """First news of this life's death: mark the actor down, charge the call it was running."""
        key = (t.role, t.actor)
        if t.incarnation != self.incarnation[key] or t.actor in self.dead[t.role]:
            return []  # a call of an earlier life, or of a dead actor: its death is already known
        self.incarnation[key] += 1
        self.counters["actor_deaths"] += 1
        self.down[t.role].add(t.actor)
        same_life = [c for c in self.running[key] if c.incarnation == t.incarnation]
        same_life[0].charged = True
        return [PingTask(t.role, t.actor)]

    def _drop(self, t, error: str) -> None:
        e = t.epoch
        self.counters["batches_dropped"] += 1
        self.dropped[e].append(t.batch)
        if len(self.dropped[e]) == self.batches_per_epoch:
            raise RunFailed(f"every batch of epoch {e} was lost: each one's calls killed {self.max_retries + 1} live actors "
                            f"(system.max_batch_retries={self.max_retries}); last error: {error}")
        self.batches_in[e] += 1  # the epoch completes without it
        stage = "sampling" if isinstance(t, SampleTask) else "scoring"
        self.notices.append(f"dropped epoch {e} batch {t.batch}: its {stage} killed {self.max_retries + 1} live "
                            f"{t.role} actors (system.max_batch_retries={self.max_retries}); epoch {e} trains without it. "
                            f"Last error: {error}")


# ---------------------------------------------------------------------- placement

_COUNT_KEY = {"sampler": "system.num_samplers", "reward": "system.num_reward_actors", "learner": "system.num_learners"}


def role_requests(cfg) -> dict[str, tuple[int, dict]]:
    """role -> (number of actors, resources each asks Ray for). The driver creates actors from this."""
    s = cfg.system

    def ask(role, cpus, gpus):
        res = {"CPU": cpus, "GPU": gpus}
        if s.use_role_resources:
            res[role] = 0.001  # a token amount: only nodes that offer the role's resource qualify
        return {k: v for k, v in res.items() if v}

    return {"sampler": (s.num_samplers, ask("sampler", s.sampler_cpus, s.sampler_gpus)),
            "reward": (s.num_reward_actors, ask("reward", s.reward_cpus, s.reward_gpus)),
            "learner": (s.num_learners, ask("learner", s.learner_cpus, s.learner_gpus)),
            "buffer": (1, ask("buffer", 0, 0))}


def local_resources(cfg) -> dict:
    """What a local Ray started for this config has (actors.driver.init_ray): logical CPUs sized to
    the config, the GPUs torch sees, and no custom resources."""
    s = cfg.system
    need = s.num_samplers * s.sampler_cpus + s.num_reward_actors * s.reward_cpus + s.num_learners * s.learner_cpus + 1
    return {"CPU": float(max(os.cpu_count() or 1, int(need + 0.999))), "GPU": float(torch.cuda.device_count())}


def _key(role: str, res: str) -> str:
    return {"CPU": f"system.{role}_cpus", "GPU": f"system.{role}_gpus"}.get(res, "system.use_role_resources")


def resource_problems(requests: dict, total: dict, nodes: list[dict]) -> list[str]:
    """Requests Ray can never place on this cluster (as it is now): one line per problem, naming
    the config keys. A necessary check (per actor vs the largest node, per role and all roles vs
    the cluster's totals), not a full packing."""
    problems, need, flagged = [], collections.Counter(), set()
    for role, (n, ask) in requests.items():
        for res, per in ask.items():
            need[res] += n * per
            before = len(problems)
            largest = max((node.get(res, 0) for node in nodes), default=0)
            have = total.get(res, 0)
            if res not in ("CPU", "GPU"):
                if have <= 0:
                    problems.append(f"{role}: system.use_role_resources=true makes each {role} actor ask the custom resource "
                                    f"{res!r}, and no node offers it; give the {role} nodes that resource, or set "
                                    f"system.use_role_resources=false")
            elif n * per > have + 1e-9:
                times = f" x {n} {role}s = {n * per:g} {res}" if n > 1 else f" {res}"
                keys = f"{_key(role, res)}" + (" (0 runs it on CPU)" if res == "GPU" else "")
                keys += f" or {_COUNT_KEY[role]}" if role in _COUNT_KEY else ""
                problems.append(f"{role}: {_key(role, res)}={per:g}{times}, the cluster has {have:g} {res}; lower {keys}")
            elif per > largest + 1e-9:
                problems.append(f"{role}: {_key(role, res)}={per:g} per actor, but the largest node has {largest:g} {res}; "
                                f"lower {_key(role, res)}")
            if len(problems) > before:
                flagged.add(res)
    for res in ("CPU", "GPU"):
        if need[res] > total.get(res, 0) + 1e-9 and res not in flagged:
            asking = [(role, n, ask[res]) for role, (n, ask) in requests.items() if ask.get(res)]
            parts = ", ".join(f"{n} {role}{'s' * (n > 1)} x {per:g} = {n * per:g}" for role, n, per in asking)
            keys = [_key(role, res) for role, _, _ in asking] + [_COUNT_KEY[role] for role, n, _ in asking if role in _COUNT_KEY and n > 1]
            problems.append(f"all roles together ask {need[res]:g} {res} ({parts}), the cluster has {total.get(res, 0):g} {res}; "
                            f"lower {', '.join(dict.fromkeys(keys))}")
    return problems
