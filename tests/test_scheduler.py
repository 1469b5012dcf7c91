"""The driver's schedule and fault paths, without Ray: actors/scheduler.py driven by simulated outcomes."""
import collections

import pytest

from diffrlhf.actors.scheduler import (AddTask, EpochScheduler, PingTask, RunFailed, SampleTask, ScoreTask, UpdateTask,
                                       resource_problems, role_requests)
from diffrlhf.deploy.config import load_config

BS = 4  # samples per batch


def make(epochs=3, batches=4, samplers=2, rewards=1, lag=1, inflight=1, retries=2, restarts=3, state=None):
    return EpochScheduler(epochs, batches, BS, samplers, rewards, lag, inflight, retries, restarts, state)


class Sim:
    """Completes the scheduler's tasks in the order it issued them, each successfully unless
    `outcome(task)` answers otherwise ("died", "raised", or for a ping "restarting"/"dead").
    Tasks of the `hold` types are kept aside, not completed."""

    def __init__(self, sched, outcome=lambda t: None, first=None, hold=()):
        self.s, self.outcome, self.hold = sched, outcome, hold
        self.queue = collections.deque(sched.start() if first is None else first)
        self.done: list = []  # every task completed (or failed), in order
        self.held: list = []
        self.added = collections.Counter()

    def step(self):
        t = self.queue.popleft()
        if isinstance(t, self.hold):
            self.held.append(t)
            return t, []
        self.done.append(t)
        how = self.outcome(t)
        if isinstance(t, PingTask):
            new = self.s.ping_answered(t, how or "up")
        elif how in ("died", "raised"):
            new = self.s.failed(t, f"{type(t).__name__} {how}", died=how == "died")
        elif isinstance(t, SampleTask):
            new = self.s.sampled(t)
        elif isinstance(t, ScoreTask):
            new = self.s.scored(t, BS, 0)
        elif isinstance(t, AddTask):
            self.added[t.epoch] += 1
            new = self.s.added(t)
        else:
            new = self.s.updated(t, BS * self.added[t.epoch])
        self.queue.extend(new)
        return t, new

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not self.queue:
                break
            self.step()
        return self

    def of(self, kind):
        return [t for t in self.done if isinstance(t, kind)]


def test_normal_epochs_pin_each_epoch_to_its_policy_version():
    for lag in (0, 1, 2):
        s = make(epochs=4, lag=lag)
        sim = Sim(s).run()
        assert s.finished and not sim.queue
        assert [t.epoch for t in sim.of(UpdateTask)] == [0, 1, 2, 3]
        assert all(t.version == max(0, t.epoch - lag) for t in sim.of(SampleTask))
        assert sorted((t.epoch, t.batch) for t in sim.of(SampleTask)) == [(e, b) for e in range(4) for b in range(4)]
        c = s.counters
        assert c["reward_queries"] == c["reward_queries_total"] == 4 * 4 * BS and c["batches_dropped"] == 0
        assert s.dropped_summary() == "" and s.needed_versions() == list(range(4 - lag, 5))


def test_lag_bound_holds_sampling_until_the_version_exists():
    s = make(epochs=4, batches=2, samplers=8, inflight=4, lag=1)
    sim = Sim(s, hold=UpdateTask)
    assert sorted((t.epoch, t.batch) for t in sim.queue) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # version 0's epochs
    sim.run()  # epochs 0 and 1 sampled, scored and buffered; the update of epoch 0 not done
    assert [u.epoch for u in sim.held] == [0]  # one update at a time, in order
    assert {t.epoch for t in sim.of(SampleTask)} == {0, 1}  # epoch 2 needs version 1: it waits
    depths, waits = s.describe()
    assert depths["to_sample"] == 4 and "epoch 2 is sampled with policy version 1, have 0" in waits["samplers"]
    after = s.updated(sim.held[0], 2 * BS)
    assert sorted((t.epoch, t.batch, t.version) for t in after if isinstance(t, SampleTask)) == [(2, 0, 1), (2, 1, 1)]
    assert [t.epoch for t in after if isinstance(t, UpdateTask)] == [1]


def test_lag0_is_synchronous():
    s = make(epochs=2, batches=2, samplers=4, lag=0)
    sim = Sim(s)
    while True:
        t, new = sim.step()
        if isinstance(t, UpdateTask):
            break
        assert not any(isinstance(x, SampleTask) and x.epoch == 1 for x in new)
    assert [(x.epoch, x.version) for x in new if isinstance(x, SampleTask)] == [(1, 1), (1, 1)]
    sim.run()
    assert s.finished and all(t.version == t.epoch for t in sim.of(SampleTask))


def test_inflight_bound_per_sampler():
    s = make(batches=8, samplers=2, inflight=2, lag=0)
    first = s.start()
    assert [t.actor for t in first] == [0, 1, 0, 1]  # least loaded first, two each, no more
    out = s.sampled(first[0])  # a free slot: the next batch goes there, the sampled one to scoring
    assert [(type(t).__name__, t.actor, t.batch) for t in out] == [("SampleTask", 0, 4), ("ScoreTask", 0, 0)]
    assert s.load("sampler", 0) == s.load("sampler", 1) == 2


def test_sampler_death_retries_the_running_batch_on_the_restarted_actor():
    s = make(epochs=2, batches=4, samplers=2, inflight=2, lag=0)
    first = s.start()
    on0 = [t for t in first if t.actor == 0]
    assert [(t.batch, t.attempt) for t in on0] == [(0, 0), (2, 0)]
    ping = s.failed(on0[1], "killed", died=True)  # the queued call's failure may arrive first
    assert [type(x) for x in ping] == [PingTask]
    assert on0[0].charged and not on0[1].charged  # the running (oldest) call pays an attempt, not the one behind it
    assert s.failed(on0[0], "killed", died=True) == []  # sampler-0 is down, sampler-1 full: nothing to start
    assert list(s.to_sample)[:2] == [(0, 0, 1), (0, 2, 0)]
    again = s.ping_answered(ping[0], "restarting")
    assert [(type(x), x.delay) for x in again] == [(PingTask, True)]
    back = s.ping_answered(again[0], "up")
    assert [(t.actor, t.batch, t.attempt, t.version) for t in back] == [(0, 0, 1, 0), (0, 2, 0, 0)]
    sim = Sim(s, first=[t for t in first if t.actor == 1] + back).run()
    c = s.counters
    assert s.finished and c["actor_deaths"] == 1 and c["sample_retries"] == 2 and c["batches_dropped"] == 0
    assert sim.added == {0: 4, 1: 4} and c["reward_queries"] == 2 * 4 * BS


def test_reward_actor_death_with_queued_batches_drops_nothing():
    """The issue's case: the one reward actor is killed with every batch of an epoch queued on it;
    the retries wait for its restart instead of failing on it at once."""
    s = make(epochs=2, batches=4, samplers=2, rewards=1, inflight=2, lag=0)
    scores = [x for t in s.start() for x in s.sampled(t) if isinstance(x, ScoreTask)]
    assert [x.batch for x in scores] == [0, 1, 2, 3] and s.load("reward", 0) == 4
    out = []
    for x in (scores[2], scores[0], scores[3], scores[1]):  # every call fails, in any order
        out += s.failed(x, "killed", died=True)
    assert [type(x) for x in out] == [PingTask]  # one ping; nothing sent to the restarting actor
    assert scores[0].charged and not any(x.charged for x in scores[1:])
    assert s.counters["actor_deaths"] == 1 and s.counters["score_retries"] == 4
    back = s.ping_answered(out[0], "up")
    assert sorted((x.batch, x.attempt) for x in back) == [(0, 1), (1, 0), (2, 0), (3, 0)]
    sim = Sim(s, first=back).run()
    assert s.finished and s.counters["batches_dropped"] == 0 and sim.added == {0: 4, 1: 4}
    assert s.counters["reward_queries"] == s.counters["reward_queries_total"] == 2 * 4 * BS


def test_stale_failure_after_restart_is_not_a_new_death():
    s = make(epochs=1, batches=2, samplers=1, inflight=2, lag=0)
    a, b = s.start()
    ping = s.failed(a, "x", died=True)
    retry = s.ping_answered(ping[0], "up")  # back before b's failure (of the earlier life) arrived
    assert [(t.batch, t.attempt, t.incarnation) for t in retry] == [(0, 1, 1)]
    out = s.failed(b, "x", died=True)
    assert [(type(t), t.batch, t.attempt) for t in out] == [(SampleTask, 1, 0)]  # no new ping, no attempt spent
    assert s.counters["actor_deaths"] == 1 and a.charged and not b.charged


def test_restarts_spent_leave_the_role_to_the_others():
    def outcome(t):
        if isinstance(t, SampleTask) and t.actor == 1 and t.epoch == 0:
            return "died"
        if isinstance(t, PingTask):
            return "dead"

    s = make(epochs=2, samplers=2)
    sim = Sim(s, outcome).run()
    assert s.finished and s.dead["sampler"] == {1} and s.counters["batches_dropped"] == 0
    assert all(t.actor == 0 for t in sim.of(SampleTask)[2:])
    assert any("sampler-1 is dead for good" in n for n in s.notices)


def test_every_actor_of_a_role_dead_fails_the_run():
    s = make(samplers=1, rewards=1)
    sim = Sim(s, lambda t: "died" if isinstance(t, ScoreTask) else "dead" if isinstance(t, PingTask) else None)
    with pytest.raises(RunFailed, match=r"every reward actor is dead \(system.max_actor_restarts=3"):
        sim.run()


def test_a_batch_that_keeps_killing_live_actors_is_dropped_and_reported():
    poison = lambda t: "died" if isinstance(t, SampleTask) and (t.epoch, t.batch) == (1, 2) else None  # noqa: E731
    s = make(epochs=3, samplers=2, retries=2)
    sim = Sim(s, poison).run()
    tries = [t for t in sim.of(SampleTask) if (t.epoch, t.batch) == (1, 2)]
    assert [t.attempt for t in tries] == [0, 1, 2] and all(t.charged for t in tries)
    c = s.counters
    assert s.finished and c["batches_dropped"] == 1 and c["sample_retries"] == 2 and c["actor_deaths"] == 3
    assert sim.added[1] == 3 and c["reward_queries"] == (4 + 3 + 4) * BS
    summary = s.dropped_summary()
    assert "epoch 1: 12 of 16 samples (batches [2] dropped after system.max_batch_retries=2" in summary
    assert "epoch 0" not in summary and "epoch 2" not in summary
    assert any("dropped epoch 1 batch 2" in n for n in s.notices)
    with pytest.raises(RunFailed, match="every batch of epoch 0 was lost"):
        Sim(make(epochs=1, batches=1, retries=0), lambda t: "died" if isinstance(t, SampleTask) else None).run()


def test_failures_of_the_core_roles_and_of_the_work_itself_stop_the_run():
    s = make(epochs=1, batches=1, lag=0)
    with pytest.raises(RunFailed, match="the learner failed during epoch 0: boom"):
        s.failed(UpdateTask(0), "boom", died=False)
    with pytest.raises(RunFailed, match="the buffer actor died: gone"):
        s.failed(AddTask(0, 0), "gone", died=True, role="buffer")
    with pytest.raises(RunFailed, match="sampler-0 failed on epoch 0 batch 0: ValueError: bad plan"):
        s.failed(s.start()[0], "ValueError: bad plan", died=False)


def test_empty_epoch_names_the_nan_policy_and_the_dropped_batches():
    s = make(epochs=1, batches=2, samplers=1, lag=0, retries=0)
    out = s.sampled(s.start()[0])
    nxt, score = out
    add = s.scored(score, BS, BS)[0]  # every reward of batch 0 non-finite: dropped by the reward server
    s.failed(nxt, "killed", died=True)  # batch 1 killed its sampler: with no retries left, dropped
    update = s.added(add)
    assert [type(t) for t in update] == [UpdateTask] and s.counters["reward_dropped"] == BS
    with pytest.raises(RunFailed, match=r"epoch 0 has nothing left to train on: 4 of its 4 rewards .*reward.nan_policy=drop"
                                        r"\); batches \[1\] were dropped"):
        s.empty_epoch(update[0])


def test_state_for_resume_restarts_untrained_epochs_and_counts_their_queries_as_lost():
    s = make(epochs=4, lag=1)
    sim = Sim(s)
    while s.epochs_done < 2 or not s.epoch_queries:  # stop after epoch 1's update, with epoch 2 partly scored
        sim.step()
    in_flight = s.epoch_queries[2] + s.epoch_queries[3]
    assert in_flight > 0
    state = s.state_dict()
    c = state["counters"]
    assert c["epochs_done"] == 2 and c["reward_queries"] == 2 * 4 * BS
    assert c["reward_queries_total"] == 2 * 4 * BS + in_flight and c["reward_queries_lost"] == in_flight  # paid for, bought nothing
    assert s.needed_versions() == [1, 2]
    r = make(epochs=4, lag=1, state=state)
    first = r.start()
    assert [(t.epoch, t.batch, t.version) for t in first] == [(2, 0, 1), (2, 1, 1)]
    sim2 = Sim(r, first=first).run()
    assert r.finished and [u.epoch for u in sim2.of(UpdateTask)] == [2, 3]
    full = Sim(make(epochs=4, lag=1)).run().s.counters
    for k in ("reward_queries", "epochs_done"):
        assert r.counters[k] == full[k]
    # every query answered is in the total: the uninterrupted run's, plus the re-made ones
    assert r.counters["reward_queries_total"] == full["reward_queries_total"] + in_flight
    assert r.counters["reward_queries_lost"] == in_flight and full["reward_queries_lost"] == 0


def test_resource_check_names_the_role_the_keys_and_the_cluster():
    cfg = load_config("tiny", overrides=["system.sampler_gpus=1", "system.num_samplers=2"])
    req = role_requests(cfg)
    assert req["sampler"] == (2, {"CPU": 1.0, "GPU": 1.0}) and req["buffer"] == (1, {})
    cpu_node = {"CPU": 16.0}
    problems = resource_problems(req, cpu_node, [cpu_node])
    assert problems == ["sampler: system.sampler_gpus=1 x 2 samplers = 2 GPU, the cluster has 0 GPU; "
                        "lower system.sampler_gpus (0 runs it on CPU) or system.num_samplers"]
    assert resource_problems(req, {"CPU": 16.0, "GPU": 2.0}, [{"CPU": 8.0, "GPU": 1.0}] * 2) == []
    big = role_requests(load_config("tiny", overrides=["system.learner_gpus=2"]))
    assert "the largest node has 1 GPU" in resource_problems(big, {"CPU": 16.0, "GPU": 2.0}, [{"CPU": 8.0, "GPU": 1.0}] * 2)[0]
    crowded = resource_problems(role_requests(cfg), {"CPU": 2.0, "GPU": 2.0}, [{"CPU": 2.0, "GPU": 2.0}])
    assert crowded == ["all roles together ask 3.5 CPU (2 samplers x 1 = 2, 1 reward x 0.5 = 0.5, 1 learner x 1 = 1), the cluster "
                       "has 2 CPU; lower system.sampler_cpus, system.reward_cpus, system.learner_cpus, system.num_samplers"]
    roles = role_requests(load_config("tiny", overrides=["system.use_role_resources=true"]))
    missing = resource_problems(roles, {"CPU": 16.0, "sampler": 1.0}, [{"CPU": 16.0, "sampler": 1.0}])
    assert [p.split(":")[0] for p in missing] == ["reward", "learner", "buffer"]


def test_an_in_run_restore_keeps_live_workers_unless_colocated_and_renames_only_the_replaced_roles():
    """actors/roles.py: a restore keeps the samplers and reward actors only when they are not
    colocated with the learners (their placement group goes) and every one's state reads as not
    dead (an unreadable state counts as dead); Ray's restart counts of the replaced roles are kept
    under '(before restore n)', the kept actors' go on under their names."""
    from diffrlhf.actors import roles

    class Handle:  # what ray_state reads; no Ray here, so each reads as unknown (None)
        pass

    split, colocated = load_config("tiny", overrides=[]), load_config("tiny", overrides=["system.colocate=true", "system.num_samplers=1"])
    assert not roles.keeps_workers(split, [Handle()])  # state unknown: every role starts afresh
    assert not roles.keeps_workers(split, [])
    states = iter(["ALIVE", "RESTARTING"])
    real = roles.ray_state
    try:
        roles.ray_state = lambda a: next(states)
        assert roles.keeps_workers(split, [Handle(), Handle()])
        roles.ray_state = lambda a: "ALIVE"
        assert not roles.keeps_workers(colocated, [Handle()])
        roles.ray_state = lambda a: "DEAD"
        assert not roles.keeps_workers(split, [Handle()])
    finally:
        roles.ray_state = real
    seen = {"learner": 1, "buffer": 0, "sampler-0": 2, "reward-0": 1}
    assert roles.restarts_after_restore(seen, ["sampler-0", "reward-0"], 2) == {
        "learner (before restore 2)": 1, "buffer (before restore 2)": 0, "sampler-0": 2, "reward-0": 1}
