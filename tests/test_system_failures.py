"""The Ray system when things fail (deaths at a checkpoint, stalls, empty epochs, impossible requests,
actors that cannot start, a dead learner rank), on the tiny random model, in one local Ray with fake GPUs."""
import os
import re
import time

import pytest

ray = pytest.importorskip("ray")

from diffrlhf.actors.driver import Driver, RunFailed  # noqa: E402
from diffrlhf.actors.workers import LearnerWorker, RewardWorker, SamplerWorker  # noqa: E402
from diffrlhf.rewards.serving import RewardServer  # noqa: E402
from system_support import assert_matches_reference, cfg_with, local_ray  # noqa: E402,F401  (its module-wide local Ray)

pytestmark = pytest.mark.integration  # Ray clusters, CLI runs and installs in other processes (not in -m quick)



def learner_dying_at_its_first_weights_then_at_every_checkpoint_save(marker):
    class DyingLearner(LearnerWorker):
        def __init__(self, cfg, rank: int = 0, world: int = 1):
            if marker.exists():
                super().__init__(cfg, rank, world)
            else:  # the first incarnation loads no model: it dies before any is needed
                self._init_role(cfg, "learner")

        def weights(self):  # the first incarnation dies before the samplers get version 0
            if not marker.exists():
                marker.write_text("died")
                os._exit(1)
            return super().weights()

        def state_dict(self):  # every incarnation dies when the driver reads its state for the checkpoint
            os._exit(1)

    return DyingLearner


def test_a_learner_dead_before_its_first_weights_is_restored_then_dying_at_the_save_spends_the_restores(tmp_path, capsys):
    """One run, two learner deaths (each Ray run costs its actors' start-up):
    1. before its first weights, while the samplers' first calls wait on them: the death is the
       learner's (restored from the start: no checkpoint yet), not a sampler death per call until
       every batch is dropped (what the fault benchmark saw);
    2. the restored learner dies while the driver saves the checkpoint: system.max_core_restarts=1
       is spent and the run stops, saying so and what to do."""
    cfg = cfg_with("train.epochs=2", "system.max_policy_lag=0", "system.num_samplers=1", "system.max_core_restarts=1")
    learner = learner_dying_at_its_first_weights_then_at_every_checkpoint_save(tmp_path / "first-death")
    d = Driver(cfg, tmp_path / "run", progress=False, worker_classes={"learner": learner})
    with pytest.raises(RunFailed, match=r"(?s)died while the driver saved the run.*max_core_restarts=1 spent.*No checkpoint was written yet"):
        d.run()
    d.shutdown()
    out = capsys.readouterr().out
    assert (tmp_path / "first-death").exists() and "sampler-0 died" not in out
    restores = [line for line in out.splitlines() if "restoring the learner and buffer" in line]
    assert len(restores) == 1 and re.search(r"the learner actor died: .*; restoring the learner and buffer \(the samplers and "
                                            r"reward actors kept\) from the start \(no checkpoint "
                                            r"yet\), within the run \(restart 1 of system.max_core_restarts=1\)$", restores[0]), out


def hanging_sampler():
    class HangingSampler(SamplerWorker):
        def __init__(self, cfg, rank: int = 0):  # no model: it never samples (a model load is an actor start's cost)
            self._init_role(cfg, f"sampler-{rank}")

        def sample(self, plan, weights):
            import time

            time.sleep(3600)

    return HangingSampler


def modelless_learner():
    class ModelLessLearner(LearnerWorker):
        def __init__(self, cfg, rank: int = 0, world: int = 1):  # no model: the sampler it feeds never samples
            self._init_role(cfg, "learner")
            self.rank, self.world = rank, world

        def weights(self):
            return 0, None

    return ModelLessLearner


def test_a_stalled_role_is_reported_not_waited_on_forever(tmp_path):
    cfg = cfg_with("train.epochs=1", "system.idle_timeout_s=3", "system.num_samplers=1")
    d = Driver(cfg, tmp_path / "run", progress=False, worker_classes={"sampler": hanging_sampler(), "learner": modelless_learner()})
    with pytest.raises(RunFailed, match=r"nothing finished for 3s.*waiting on: sample of epoch 0 batch 0"):
        d.run()
    d.shutdown()


def nan_reward():
    class NaNReward(RewardWorker):  # every reward NaN; the server drops them (cfg: reward.nan_policy=drop)
        def __init__(self, cfg, rank: int = 0):
            self._init_role(cfg, f"reward-{rank}")
            self.server = RewardServer(lambda images, prompts: [float("nan")] * len(images), nan_policy=cfg.reward.nan_policy)

    return NaNReward


def test_an_epoch_left_empty_by_nan_rewards_names_the_policy_not_the_learner(tmp_path):
    cfg = cfg_with("train.epochs=1", "reward.nan_policy=drop", "system.num_samplers=1")
    d = Driver(cfg, tmp_path / "run", progress=False, worker_classes={"reward": nan_reward()})
    with pytest.raises(RunFailed, match=r"(?s)epoch 0 has nothing left to train on: 8 of its 8 rewards were non-finite.*"
                                        r"reward.nan_policy=raise.*No checkpoint was written yet") as e:
        d.run()
    assert "learner" not in str(e.value) and "checkpoint/" not in str(e.value)
    d.shutdown()


def test_an_impossible_request_fails_at_once_naming_keys_and_cluster(tmp_path):
    cfg = cfg_with("system.num_samplers=3")  # one (fake) GPU each; the test Ray has 2
    d = Driver(cfg, tmp_path / "run", progress=False)
    with pytest.raises(RunFailed, match=r"sampler: system.sampler_gpus=1 x 3 samplers = 3 GPU, the cluster has 2 GPU; "
                                        r"lower system.sampler_gpus \(0 runs it on CPU\) or system.num_samplers"):
        d.run()
    assert d.samplers == [] and d.learners == [] and d.buffer is None  # nothing was started


def failing_sampler():
    class MissingWeights(SamplerWorker):
        def __init__(self, cfg, rank: int = 0):
            raise FileNotFoundError("no weights for model 'x' in /cache/x\nfetch them with: diffrlhf fetch-weights x")

    return MissingWeights


def test_an_actor_that_cannot_start_shows_its_whole_error(tmp_path):
    # two samplers (each fails), a learner that loads no model (the run ends before it is needed)
    d = Driver(cfg_with("train.epochs=1"), tmp_path / "run", progress=False,
               worker_classes={"sampler": failing_sampler(), "learner": modelless_learner()})
    with pytest.raises(RunFailed, match=r"the sampler-\d actor failed to start: .*no weights for model 'x' in /cache/x\n"
                                        r"fetch them with: diffrlhf fetch-weights x"):
        d.run()
    d.shutdown()


B2_RAY = ("train.epochs=3", "system.max_policy_lag=0", "algorithm.name=b2diffurl", "train.timestep_selection=backward",
          "sample.samples_per_prompt=2", "train.timestep_fraction=0.5", "weighting.scheme=oracle", "weighting.oracle_every=1",
          "weighting.oracle_trajectories=2", "weighting.oracle_branches=2")
COLOCATED = ("system.num_learners=2", "system.colocate=true", "system.sampler_gpus=0.5", "system.learner_gpus=0.5",
             "system.idle_timeout_s=1800")  # the group's collective timeout: far above what detection may take


def test_a_colocated_group_runs_b2diffurl_and_the_oracle_as_the_reference_loop_survives_a_dead_rank_and_counts_restarts(
        tmp_path, reference_like_actors, capsys):
    """One Ray run for four properties (each Ray run costs its actors' start-up):

    1. A colocated learner group of 2 (torch.distributed over gloo; system.colocate): sampler i and
       learner i in one placement bundle of 1 GPU (0.5 each), so each pair time-shares its own GPU
       (a plain PACK of 0.5-GPU learners puts both on one GPU). It runs algorithm.name=b2diffurl
       (branch plans to the samplers, branch extremes in the buffer actor, the backward segment)
       with the `oracle` weighting (its probe on the sampler and reward actors before update 0 and
       after each update, the profile to both ranks).
    2. Rank 1 is killed after update 0: the run stops promptly (not after the group's collective
       timeout, 1800 s here so that a wait for it cannot pass for prompt detection) naming the dead
       rank and the resume command. Gloo's collective notices the closed peer itself; the driver
       also watches ranks 1.. (for NCCL, whose collectives can wait for a dead peer until the
       timeout; untested here, no GPU).
    3. Its checkpoint after epoch 0 resumes (`resume=True`: the driver loads it) with a single
       learner and one sampler, not colocated (a checkpoint depends on neither count, and holds the
       profile). All of it gives the reference loop's queries (probes included), rewards, losses,
       kept rows and learner passes.
    4. In the resumed run Ray restarts the reward actor, killed twice while idle, without any call of
       the driver failing: the driver still counts each restart (Ray's own count) in the epoch record
       and roles.json, one line each, and nothing is lost or scored twice."""
    from diffrlhf.actors.driver import ray_restarts

    reference = reference_like_actors(cfg_with(*B2_RAY))
    run, killed, gpus = tmp_path / "run", [], {}

    def kill_rank_1(driver, epoch):
        if epoch == 0:
            gpus["learners"] = [s["gpu_ids"] for s in ray.get([a.stats.remote() for a in driver.learners])]
            gpus["samplers"] = [s["gpu_ids"] for s in ray.get([a.stats.remote() for a in driver.samplers])]
            ray.kill(driver.learners[1])
            killed.append(time.time())

    d = Driver(cfg_with(*B2_RAY, *COLOCATED, "system.max_core_restarts=0"), run, progress=False, on_update=kill_rank_1)
    with pytest.raises(RunFailed, match=r"(?s)learner actor died: learner-1 of 2.*1 of 3 epochs done.*--resume"):
        d.run()
    # Not a speed bound: detection takes seconds, the collective's timeout 1800 s; 600 s tells them apart with room.
    assert time.time() - killed[0] < 600, "the driver waited for the surviving rank's collective to time out"
    first = d.records
    d.shutdown()
    assert [r["learners"] for r in first] == [2]
    pairs = list(zip(gpus["learners"], gpus["samplers"]))
    assert all(len(g) == 1 and g == h for g, h in pairs) and pairs[0][0] != pairs[1][0], pairs

    def kill_reward_twice(driver, epoch):
        if epoch != 1:
            return
        for n in (1, 2):  # lag 0: the rewards are idle while the next epoch samples (the probe came before this hook)
            ray.kill(driver.rewards[0], no_restart=False)
            deadline = time.time() + 120
            while ray_restarts(driver.rewards[0]) != n or not _answers(driver.rewards[0]):
                assert time.time() < deadline, f"reward-0 not restarted {n} time(s)"
                time.sleep(0.5)

    capsys.readouterr()
    d = Driver(cfg_with(*B2_RAY, "system.num_samplers=1"), run, progress=False, resume=True, on_update=kill_reward_twice)
    try:
        rest = d.run()
        stats = {s["role"]: s for s in d.role_stats}
    finally:
        d.shutdown()
    out = capsys.readouterr().out
    assert [r["learners"] for r in rest] == [1, 1]
    records = first + rest
    # Rewards and losses: epochs 0-1, as the group's own check. Epoch 2 is there for the restarts: the
    # group's all-reduce sums in another order than one learner, and by epoch 2 that float noise can
    # move a JPEG byte count (an 8-byte change in one of 16 images is 5e-4 of the mean).
    assert_matches_reference(records[:2], reference[:2])
    assert [r["reward_queries"] for r in records] == [r["reward_queries"] for r in reference]  # nothing lost, nothing scored twice
    for r, ref in zip(records, reference):
        assert (r["samples"], r["samples_trained"], r["learner_passes"]) == (ref["samples"], ref["samples_trained"], ref["learner_passes"])
    assert sum(r["learner_passes"] for r in records) > 0 and records[-1]["learner_passes_total"] == reference[-1]["learner_passes_total"]
    assert [r["ray_restarts"] for r in rest] == [0, 2]  # epoch 1's record is written before the kills
    assert stats["reward-0"]["ray_restarts"] == 2 and stats["sampler-0"]["ray_restarts"] == 0
    assert out.count("reward-0 was restarted by Ray") == 1 and "(2 restarts of system.max_actor_restarts=" in out


def _answers(actor) -> bool:
    try:
        ray.get(actor.stats.remote(), timeout=10)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
