"""Observability: Ray metrics for the dashboard, and a watchdog that says what a stalled run waits on.

Metrics (ray.util.metrics, exported to Ray's Prometheus endpoint and dashboard), all prefixed
`diffrlhf_`: queue_depth{queue}, policy_version, policy_lag, role_busy_fraction{role},
reward_queries (counter), reward_mean, reward_std, epochs_done. TensorBoard gets the same numbers
through the run logger, and Weights & Biases too when wandb is installed and WANDB_PROJECT is set.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field


class RunMetrics:
    """Thin wrapper over ray.util.metrics; every method is a no-op if metrics are unavailable."""

    def __init__(self):
        try:
            from ray.util.metrics import Counter, Gauge

            self.queue = Gauge("diffrlhf_queue_depth", "items waiting per queue", tag_keys=("queue",))
            self.version = Gauge("diffrlhf_policy_version", "learner policy version")
            self.lag = Gauge("diffrlhf_policy_lag", "max policy lag of the last trained epoch")
            self.busy = Gauge("diffrlhf_role_busy_fraction", "busy fraction per role", tag_keys=("role",))
            self.queries = Counter("diffrlhf_reward_queries", "reward queries (scored images)")
            self.reward_mean = Gauge("diffrlhf_reward_mean", "mean reward of the last epoch")
            self.reward_std = Gauge("diffrlhf_reward_std", "reward std of the last epoch")
            self.epochs = Gauge("diffrlhf_epochs_done", "epochs trained")
            self.ok = True
        except Exception:  # Ray without metrics support: keep the run going
            self.ok = False

    def queues(self, depths: dict[str, int]) -> None:
        if self.ok:
            for name, n in depths.items():
                self.queue.set(n, tags={"queue": name})

    def epoch(self, rec: dict, new_queries: int) -> None:
        if not self.ok:
            return
        self.version.set(rec.get("policy_version", 0))
        self.lag.set(rec.get("policy_lag_max", 0))
        self.reward_mean.set(rec["reward_mean"])
        self.reward_std.set(rec["reward_std"])
        self.epochs.set(rec["epoch"] + 1)
        if new_queries > 0:
            self.queries.inc(new_queries)

    def roles(self, stats: list[dict]) -> None:
        if self.ok:
            for s in stats:
                if "idle_fraction" in s:
                    self.busy.set(1 - s["idle_fraction"], tags={"role": s["role"]})


@dataclass
class Watchdog:
    """Flags a role idle past its timeout, a queue stuck full or empty, and a reward that stopped changing.

    The driver feeds it events; `check()` returns human-readable warnings (and remembers which it
    already gave, so each is logged once per episode).
    """

    role_timeout_s: float = 300.0
    queue_timeout_s: float = 300.0
    flat_epochs: int = 5
    flat_tol: float = 1e-9
    last_done: dict = field(default_factory=dict)  # role -> time of its last completed work
    waiting_on: dict = field(default_factory=dict)  # role -> what it is waiting for
    queue_since: dict = field(default_factory=dict)  # queue -> (state, since)
    rewards: list = field(default_factory=list)
    _said: set = field(default_factory=set)

    def work_done(self, role: str, now: float | None = None) -> None:
        self.last_done[role] = time.time() if now is None else now
        self._said = {s for s in self._said if not s.startswith(role + ":")}

    def waiting(self, role: str, what: str) -> None:
        self.waiting_on[role] = what

    def queue(self, name: str, depth: int, capacity: int, now: float | None = None) -> None:
        now = time.time() if now is None else now
        state = "full" if depth >= capacity else "empty" if depth == 0 else "ok"
        prev = self.queue_since.get(name)
        if prev is None or prev[0] != state:
            self.queue_since[name] = (state, now)
            self._said.discard(f"queue:{name}")

    def reward(self, mean: float) -> None:
        self.rewards.append(mean)

    def check(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        out = []
        for role, t in self.last_done.items():
            if now - t > self.role_timeout_s and f"{role}:idle" not in self._said:
                self._said.add(f"{role}:idle")
                out.append(f"{role} has finished no work for {now - t:.0f}s; it waits on: {self.waiting_on.get(role, 'unknown')}")
        for name, (state, since) in self.queue_since.items():
            if state != "ok" and now - since > self.queue_timeout_s and f"queue:{name}" not in self._said:
                self._said.add(f"queue:{name}")
                out.append(f"queue {name} has been {state} for {now - since:.0f}s")
        tail = self.rewards[-self.flat_epochs:]
        if len(tail) == self.flat_epochs and max(tail) - min(tail) <= self.flat_tol and "reward:flat" not in self._said:
            self._said.add("reward:flat")
            out.append(f"the mean reward has not changed for {self.flat_epochs} epochs ({tail[-1]!r}): "
                       "is the reward function constant, or the learning rate zero?")
        return out


def maybe_wandb(cfg, run_dir):
    """A W&B run when wandb is installed and WANDB_PROJECT is set; else None."""
    if not os.environ.get("WANDB_PROJECT"):
        return None
    try:
        import wandb
    except ImportError:
        print("[diffrlhf] WANDB_PROJECT is set but wandb is not installed; skipping W&B")
        return None
    return wandb.init(project=os.environ["WANDB_PROJECT"], name=str(run_dir.name), config=cfg.to_dict(), dir=str(run_dir))


def observe_queues(sched, metrics: RunMetrics, watchdog: Watchdog, cap: int) -> None:
    """The scheduler's queue depths to the metrics and the watchdog (`cap`: the most the samplers take
    at once), and what each role waits on."""
    depths, waits = sched.describe()
    metrics.queues(depths)
    watchdog.queue("sampling", depths["sampling"], cap)
    watchdog.queue("scoring", depths["scoring"], cap)
    for role, what in waits.items():
        watchdog.waiting(role, what)


def describe_stall(pending: dict, idle_timeout_s: float) -> str:
    """What a stalled run waits on: its oldest calls in flight (`pending`: ref -> (task, since, n, extra))."""
    now = time.time()
    waits = sorted(pending.values(), key=lambda p: p[1])[:6]
    what = "; ".join(f"{t} for {now - since:.0f}s" for t, since, _, _ in waits)
    return f"nothing finished for {idle_timeout_s:.0f}s (system.idle_timeout_s); waiting on: {what or 'nothing'}"
