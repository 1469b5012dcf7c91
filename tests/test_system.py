"""The Ray system end to end on the tiny random model, in one local Ray with fake GPUs."""
import json
import os
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from diffrlhf.actors.driver import Driver, RunFailed  # noqa: E402
from diffrlhf.actors.workers import SamplerWorker  # noqa: E402
from diffrlhf.deploy.config import load_config  # noqa: E402

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


@pytest.fixture(scope="module")
def reference_run():
    from diffrlhf.actors.reference_loop import run_reference

    cfg = cfg_with("train.epochs=3", "system.max_policy_lag=0")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.system.torch_threads)  # as the actors: same kernels, same rounding
    try:
        return run_reference(cfg, progress=False)
    finally:
        torch.set_num_threads(threads)


def final_lora(run_dir):
    return torch.load(Path(run_dir) / "checkpoint" / "state.pt", weights_only=False)["learner"]["lora"]


def assert_matches_reference(records, reference):
    assert [r["epoch"] for r in records] == [r["epoch"] for r in reference]
    for a, b in zip(records, reference):
        assert a["reward_queries"] == b["reward_queries"]
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-4)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5, rel=1e-3)


@pytest.fixture(scope="module")
def lag0_run(tmp_path_factory):
    """Three synchronous epochs on Ray (also the uninterrupted run the resume test compares with)."""
    run_dir = tmp_path_factory.mktemp("lag0") / "run"
    d = Driver(cfg_with("train.epochs=3", "system.max_policy_lag=0"), run_dir, progress=False)
    records = d.run()
    d.shutdown()
    return run_dir, records


def test_lag0_reproduces_reference_loop(lag0_run, reference_run):
    _, records = lag0_run
    assert_matches_reference(records, reference_run)
    assert all(r["policy_lag_max"] == 0 for r in records)


def test_async_run_counts_queries_and_bounds_lag(tmp_path):
    from diffrlhf.deploy.runlog import RunLogger

    cfg = cfg_with("train.epochs=4", "system.max_policy_lag=1", "system.max_inflight_per_sampler=2", "run.image_grid_every=2")
    logger = RunLogger(tmp_path / "run", cfg, tensorboard=False)
    d = Driver(cfg, tmp_path / "run", logger=logger, progress=False)
    records = d.run()
    assert [r["reward_queries"] for r in records] == [8, 16, 24, 32]  # exact: every scored image once
    assert all(r["reward_queries_total"] >= r["reward_queries"] for r in records)
    assert records[-1]["reward_queries_total"] == 32  # nothing scored twice, nothing lost
    assert [r["policy_version"] for r in records] == [1, 2, 3, 4]  # versions monotone, one per update
    assert max(r["policy_lag_max"] for r in records) <= 1
    assert any(r["policy_lag_max"] == 1 for r in records)  # the pipeline really overlapped
    run = tmp_path / "run"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["epoch"] == 3
    assert (run / "reward_curve.png").exists() and (run / "grids" / "epoch_0000.png").exists()
    assert (run / "lora" / "epoch_0004" / "pytorch_lora_weights.safetensors").exists()
    # placement: each sampler got its own (fake) GPU
    roles = {r["role"] for r in d.role_stats}
    assert {"sampler-0", "sampler-1", "reward-0", "learner", "buffer"} <= roles
    gpu_ids = ray.get([s.__ray_call__.remote(lambda self: os.environ.get("CUDA_VISIBLE_DEVICES")) for s in d.samplers])
    assert sorted(gpu_ids) == ["0", "1"]
    d.shutdown()


def crash_once_sampler(marker: Path):
    """A sampler class that dies in the middle of its first batch of epoch 1 (once: the marker file)."""

    class CrashOnceSampler(SamplerWorker):  # defined in a function: cloudpickle ships it by value
        def sample(self, plan, weights):
            if plan.epoch == 1 and not marker.exists():
                marker.write_text("crashed")
                os._exit(1)
            return super().sample(plan, weights)

    return CrashOnceSampler


def test_sampler_deaths_do_not_stop_the_run(tmp_path, reference_run):
    killed = []

    def kill_sampler(driver, epoch):  # and a ray.kill between epochs: the restarted actor must catch up
        if epoch == 0:
            ray.kill(driver.samplers[1], no_restart=False)
            killed.append(epoch)

    cfg = cfg_with("train.epochs=3", "system.max_policy_lag=0")
    d = Driver(cfg, tmp_path / "run", progress=False, worker_classes={"sampler": crash_once_sampler(tmp_path / "marker")}, on_update=kill_sampler)
    records = d.run()
    assert killed and (tmp_path / "marker").exists()
    assert records[-1]["actor_deaths"] >= 1 and records[-1]["sample_retries"] >= 1 and records[-1]["batches_dropped"] == 0
    # the retried batch is identical and restarted samplers used the current weights: same numbers as the reference
    assert_matches_reference(records, reference_run)
    d.shutdown()


def test_stop_and_resume_continue_exactly(tmp_path, lag0_run):
    straight_dir, full = lag0_run
    first = Driver(cfg_with("train.epochs=2", "system.max_policy_lag=0"), tmp_path / "b", progress=False)
    first.run()
    first.shutdown()
    state = torch.load(tmp_path / "b" / "checkpoint" / "state.pt", weights_only=False)
    assert state["counters"]["epochs_done"] == 2 and state["counters"]["reward_queries"] == 16
    assert state["learner"]["version"] == 2 and sorted(state["buffer"]["replay"]["epochs"]) == [0, 1]
    second = Driver(cfg_with("train.epochs=3", "system.max_policy_lag=0"), tmp_path / "b", progress=False, resume=True)
    rest = second.run()
    second.shutdown()
    assert [r["epoch"] for r in rest] == [2]
    assert rest[0]["reward_queries"] == full[-1]["reward_queries"] == 24
    assert rest[0]["reward_mean"] == pytest.approx(full[-1]["reward_mean"], abs=1e-4)
    a, b = final_lora(straight_dir), final_lora(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)


def test_dead_learner_stops_with_resumable_checkpoint(tmp_path):
    def kill_learner(driver, epoch):
        if epoch == 0:
            ray.kill(driver.learner)

    cfg = cfg_with("train.epochs=3", "system.max_policy_lag=0")
    d = Driver(cfg, tmp_path / "run", progress=False, on_update=kill_learner)
    with pytest.raises(RunFailed, match="learner actor died.*--resume"):
        d.run()
    assert (tmp_path / "run" / "checkpoint" / "state.pt").exists()
    d.shutdown()


def hanging_sampler():
    class HangingSampler(SamplerWorker):
        def sample(self, plan, weights):
            import time

            time.sleep(3600)

    return HangingSampler


def test_a_stalled_role_is_reported_not_waited_on_forever(tmp_path):
    cfg = cfg_with("train.epochs=1", "system.idle_timeout_s=8", "system.num_samplers=1")
    d = Driver(cfg, tmp_path / "run", progress=False, worker_classes={"sampler": hanging_sampler()})
    with pytest.raises(RunFailed, match=r"nothing finished for 8s.*waiting on: sample of epoch 0 batch 0"):
        d.run()
    d.shutdown()
