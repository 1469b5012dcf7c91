"""The Ray system end to end on the tiny random model, in one local Ray with fake GPUs."""
import json
import os
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from diffrlhf.actors.checkpoint import load_checkpoint  # noqa: E402
from diffrlhf.actors.driver import Driver, RunFailed  # noqa: E402
from diffrlhf.actors.workers import LearnerWorker, RewardWorker, SamplerWorker  # noqa: E402
from diffrlhf.deploy.config import load_config  # noqa: E402
from diffrlhf.rewards.serving import RewardServer  # noqa: E402

pytestmark = pytest.mark.integration  # Ray clusters, CLI runs and installs in other processes (not in -m quick)

SMALL = ["model.name=tiny-random", "model.device=cpu", "sample.num_steps=4", "sample.resolution=32", "sample.batch_size=4",
         "sample.batches_per_epoch=2", "train.batch_size=4", "prompts.train=simple_animals", "run.image_grid_every=0",
         "run.tensorboard=false", "system.num_samplers=2", "system.num_reward_actors=1", "system.sampler_gpus=1",
         "system.idle_timeout_s=240", "train.lr=0.01", "train.clip_range=0.01"]


def cfg_with(*extra):
    return load_config("tiny", overrides=SMALL + list(extra))


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.shutdown()
    ray.init(address="local", num_cpus=6, num_gpus=2, include_dashboard=False, log_to_driver=False)  # fake GPUs
    yield
    ray.shutdown()


def final_lora(run_dir):
    return torch.load(Path(run_dir) / "checkpoint" / "state.pt", weights_only=False)["learner"]["lora"]


def assert_matches_reference(records, reference):
    assert [r["epoch"] for r in records] == [r["epoch"] for r in reference]
    for a, b in zip(records, reference):
        assert a["reward_queries"] == b["reward_queries"]
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-4)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5, rel=1e-3)


LAG1 = ("train.epochs=4", "system.max_policy_lag=1", "system.max_inflight_per_sampler=2", "run.image_grid_every=2")


@pytest.fixture(scope="module")
def lag1_run(tmp_path_factory):
    """Four asynchronous epochs, uninterrupted (also what the resumed runs must equal)."""
    from diffrlhf.deploy.runlog import RunLogger

    run_dir = tmp_path_factory.mktemp("lag1") / "run"
    cfg = cfg_with(*LAG1)
    d = Driver(cfg, run_dir, logger=RunLogger(run_dir, cfg, tensorboard=False), progress=False)
    records = d.run()
    gpu_ids = ray.get([s.__ray_call__.remote(lambda self: os.environ.get("CUDA_VISIBLE_DEVICES")) for s in d.samplers])
    d.shutdown()
    return run_dir, records, d.role_stats, gpu_ids


def test_images_reach_the_reward_actors_and_the_grid_but_not_the_buffer_or_the_checkpoint(lag1_run):
    """The decoded images go to the reward actors and the image grid only (issue 51): the buffer's
    epochs in the checkpoint (what the learner's batches are cut from) hold none; the grids of the
    due epochs (run.image_grid_every=2, and the last) are drawn from the reward inputs."""
    import numpy as np
    from PIL import Image

    from diffrlhf.actors.checkpoint import load_checkpoint
    from diffrlhf.buffer.trajectory import TrajectoryBatch

    run = lag1_run[0]
    held = [TrajectoryBatch.from_ipc_bytes(b) for b in load_checkpoint(run)["buffer"]["replay"]["epochs"].values()]
    assert held and all(b.images.shape == (len(b), 0, 0, 3) and b.latents.numel() > 0 for b in held)
    grids = sorted((run / "grids").iterdir())
    assert [g.name for g in grids] == ["epoch_0000.png", "epoch_0002.png", "epoch_0003.png"]
    assert all(np.asarray(Image.open(g)).std() > 0 for g in grids)


def test_async_run_counts_queries_and_pins_policy_versions(lag1_run):
    run, records, role_stats, gpu_ids = lag1_run
    assert [r["reward_queries"] for r in records] == [8, 16, 24, 32]  # exact: every scored image once
    assert all(r["reward_queries_total"] >= r["reward_queries"] for r in records)
    assert records[-1]["reward_queries_total"] == 32 and records[-1]["reward_queries_lost"] == 0  # nothing scored twice
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4]  # versions monotone, one per update
    # epoch e is sampled with version max(0, e - 1), however the samplers were timed: the pipeline overlapped
    assert [r["policy_lag_max"] for r in records] == [0, 1, 1, 1] and [r["policy_lag_mean"] for r in records] == [0, 1, 1, 1]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["epoch"] == 3
    assert (run / "reward_curve.png").exists() and (run / "grids" / "epoch_0000.png").exists()
    assert (run / "lora" / "epoch_0004" / "pytorch_lora_weights.safetensors").exists()
    # placement: each sampler got its own (fake) GPU
    assert {"sampler-0", "sampler-1", "reward-0", "learner", "buffer"} <= {r["role"] for r in role_stats}
    assert sorted(gpu_ids) == ["0", "1"]


def crash_once_sampler(marker: Path):
    """A sampler class that dies in the middle of its first batch of epoch 1 (once: the marker file)."""

    class CrashOnceSampler(SamplerWorker):  # defined in a function: cloudpickle ships it by value
        def sample(self, plan, weights):
            if plan.epoch == 1 and not marker.exists():
                marker.write_text("crashed")
                os._exit(1)
            return super().sample(plan, weights)

    return CrashOnceSampler


class Stop(Exception):
    pass


def stop_after(epoch):
    def hook(driver, e):
        if e == epoch:
            raise Stop(f"stopped after epoch {e}")

    return hook


def test_sampler_deaths_and_a_dead_learner_stop_with_a_checkpoint_that_resumes_exactly(tmp_path, lag1_run):
    """The asynchronous run (lag 1) under three deaths: a sampler killed between epochs (Ray
    restarts it and it must catch up with the current weights), a sampler that crashes in the
    middle of its first call of epoch 1 (the call is retried, the batch must come out identical),
    and the learner, killed after update 1 with epochs sampled from older versions in flight. The
    sampler deaths do not stop the run; the learner's does, naming the resume command and the
    checkpoint (2 of 4 epochs done). Resuming from that checkpoint (the CLI's path: `diffrlhf train
    --resume` loads it and hands it to the driver) gives the uninterrupted run, to its final LoRA.
    (One run for the three deaths: each Ray run costs its actors' start-up. The `resume=True`
    path, which loads the checkpoint itself, is resumed in the two-learner test.)"""
    straight_dir, full, _, _ = lag1_run
    cfg, run = cfg_with(*LAG1), tmp_path / "b"
    killed = []

    def kill_actors(driver, epoch):
        if epoch == 0:
            ray.kill(driver.samplers[1], no_restart=False)
            killed.append("sampler-1")
        if epoch == 1:
            ray.kill(driver.learner)

    # system.max_core_restarts=0: the stop and the user's resume (the in-run restore is the next test)
    d = Driver(cfg_with(*LAG1, "system.max_core_restarts=0"), run, progress=False,
               worker_classes={"sampler": crash_once_sampler(tmp_path / "marker")}, on_update=kill_actors)
    with pytest.raises(RunFailed, match=r"(?s)learner actor died.*max_core_restarts=0 spent.*The last checkpoint \(2 of 4 epochs done\).*--resume"):
        d.run()
    first = d.records
    d.shutdown()
    assert killed and (tmp_path / "marker").exists()
    assert first[-1]["actor_deaths"] >= 1 and first[-1]["sample_retries"] >= 1 and first[-1]["batches_dropped"] == 0
    saved = torch.load(run / "checkpoint" / "state.pt", weights_only=False)
    assert saved["counters"]["epochs_done"] == 2 and sorted(saved["versions"]) == [1, 2]
    # resumed with one sampler fewer: the plan, not the sampler count, fixes each epoch's samples
    d = Driver(cfg_with(*LAG1, "system.num_samplers=1"), run, progress=False, resume_state=load_checkpoint(run))
    rest = d.run()
    d.shutdown()
    assert [[r["epoch"] for r in p] for p in (first, rest)] == [[0, 1], [2, 3]]
    # the retried batch was identical and the restarted samplers used the current weights: the
    # uninterrupted run's numbers, epoch by epoch
    resumed = first + rest
    for a, b in zip(resumed, full):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6) and a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["reward_queries"] == b["reward_queries"] and a["policy_lag_mean"] == b["policy_lag_mean"]
    lost = resumed[-1]["reward_queries_lost"]  # scored but not trained at the stop: paid for twice
    assert full[-1]["reward_queries_total"] == 32 and resumed[-1]["reward_queries_total"] == 32 + lost
    assert resumed[-1]["reward_queries_lost"] >= 0 and rest[0]["wall_s"] > first[-1]["wall_s"]  # wall time continues
    a, b = final_lora(straight_dir), final_lora(run)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def learner_dying_in_checkpoint():
    class DyingLearner(LearnerWorker):  # dies when the driver reads its state for the checkpoint
        def state_dict(self):
            os._exit(1)

    return DyingLearner


def test_a_dead_learner_then_a_dead_buffer_are_each_restored_within_the_run(tmp_path, lag1_run, capsys):
    """The learner killed after update 1, then the buffer after update 2 (one run for both roles: a
    Ray run's start-up is most of its cost), each with the next epoch sampled and scored in flight:
    the driver says so in one line each, restores every role from the last checkpoint (2, then 3 of 4
    epochs done) and the run finishes by itself, epoch for epoch the uninterrupted run's rewards,
    losses and final LoRA. The queries answered before a death and asked again after it stay in
    reward_queries_total and are counted in reward_queries_lost: the total adds up."""
    import re

    straight_dir, full, _, _ = lag1_run
    run, killed = tmp_path / "run", []

    def kill(driver, epoch):
        if epoch == 1 and not killed:
            ray.kill(driver.learner)
            killed.append("learner")
        elif epoch == 2 and killed == ["learner"]:
            ray.kill(driver.buffer)
            killed.append("buffer")

    from diffrlhf.deploy.runlog import RunLogger

    capsys.readouterr()
    cfg = cfg_with(*LAG1)
    d = Driver(cfg, run, logger=RunLogger(run, cfg, tensorboard=False), progress=False, on_update=kill)
    records = d.run()
    d.shutdown()
    out = capsys.readouterr().out
    assert killed == ["learner", "buffer"] and d.core_restarts == 2
    restore = [line for line in out.splitlines() if "restoring every role" in line]
    assert len(restore) == 2, out
    for line, (role, done, n) in zip(restore, [("learner", 2, 1), ("buffer", 3, 2)]):
        assert re.search(rf"the {role} actor died: .*; restoring every role from the checkpoint at epoch {done} of 4, "
                         rf"within the run \(restart {n} of system.max_core_restarts=2\)$", line), line
    assert [r["epoch"] for r in records] == [0, 1, 2, 3]
    for a, b in zip(records, full):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6) and a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["reward_queries"] == b["reward_queries"]
    lost = records[-1]["reward_queries_lost"]
    assert lost >= 8 and records[-1]["reward_queries_total"] == 32 + lost and records[-1]["actor_deaths"] >= 2
    assert [json.loads(x)["epoch"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    a, b = final_lora(straight_dir), final_lora(run)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_a_learner_that_dies_at_every_checkpoint_save_spends_the_restores_then_names_the_resume_command(tmp_path, capsys):
    """No checkpoint yet: the restore starts the run over; when system.max_core_restarts are spent
    the run stops, saying so and what to do."""
    cfg = cfg_with("train.epochs=2", "system.max_policy_lag=0", "system.num_samplers=1", "system.max_core_restarts=1")
    d = Driver(cfg, tmp_path / "run", progress=False, worker_classes={"learner": learner_dying_in_checkpoint()})
    with pytest.raises(RunFailed, match=r"(?s)died while the driver saved the run.*max_core_restarts=1 spent.*No checkpoint was written yet"):
        d.run()
    d.shutdown()
    out = capsys.readouterr().out
    assert "restoring every role from the start (no checkpoint yet), within the run (restart 1 of system.max_core_restarts=1)" in out


def hanging_sampler():
    class HangingSampler(SamplerWorker):
        def sample(self, plan, weights):
            import time

            time.sleep(3600)

    return HangingSampler


def test_a_stalled_role_is_reported_not_waited_on_forever(tmp_path):
    cfg = cfg_with("train.epochs=1", "system.idle_timeout_s=3", "system.num_samplers=1")
    d = Driver(cfg, tmp_path / "run", progress=False, worker_classes={"sampler": hanging_sampler()})
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
    d = Driver(cfg_with("train.epochs=1"), tmp_path / "run", progress=False, worker_classes={"sampler": failing_sampler()})
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
