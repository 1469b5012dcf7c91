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
from diffrlhf.actors.workers import BufferWorker, SamplerWorker  # noqa: E402
from system_support import cfg_with, final_lora, local_ray  # noqa: E402,F401  (its module-wide local Ray)

pytestmark = pytest.mark.integration  # Ray clusters, CLI runs and installs in other processes (not in -m quick)

LAG1 = ("train.epochs=4", "system.max_policy_lag=1", "system.max_inflight_per_sampler=2", "run.image_grid_every=2")


@pytest.fixture(scope="module")
def lag1_reference():
    """The four asynchronous epochs, uninterrupted, as the reference loop makes them with the driver's
    pinned versions (epoch e sampled with version max(0, e - 1)): what the Ray run below must equal,
    epoch by epoch and to its final LoRA. In this process, at the actors' torch threads."""
    from diffrlhf.actors.reference_loop import run_reference

    cfg, final = cfg_with(*LAG1), {}

    def keep_final(epoch, batch, learner):
        if epoch == cfg.train.epochs - 1:
            final.update(learner.state_dict()["lora"])

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.system.torch_threads)
    try:
        records = run_reference(cfg, progress=False, on_epoch=keep_final, pin_versions=True)
    finally:
        torch.set_num_threads(threads)
    return records, final


def gpu_ids_once_up(actors, timeout_s: float = 120) -> list:
    """Each actor's CUDA_VISIBLE_DEVICES; an actor Ray is restarting is asked again (its call fails at once)."""
    deadline = time.time() + timeout_s
    while True:
        try:
            return ray.get([a.__ray_call__.remote(lambda self: os.environ.get("CUDA_VISIBLE_DEVICES")) for a in actors], timeout=60)
        except ray.exceptions.ActorUnavailableError:
            assert time.time() < deadline, "a sampler did not come back"
            time.sleep(0.5)


def crash_once_sampler(marker: Path):
    """A sampler class that dies in the middle of its first batch of epoch 1 (once: the marker file)."""

    class CrashOnceSampler(SamplerWorker):  # defined in a function: cloudpickle ships it by value
        def sample(self, plan, weights):
            if plan.epoch == 1 and not marker.exists():
                marker.write_text("crashed")
                os._exit(1)
            return super().sample(plan, weights)

    return CrashOnceSampler


def buffer_dying_in_its_shards_once(marker):
    class DyingBuffer(BufferWorker):  # dies in epoch 3's update after its summary returned: the learner gets no input
        def training_batch(self, epoch, n):
            if epoch == 3 and not marker.exists():
                marker.write_text("died")
                os._exit(1)
            return super().training_batch(epoch, n)

    return DyingBuffer



def test_sampler_deaths_a_learner_restored_in_the_run_and_a_buffer_death_past_the_limit_resume_exactly(
        tmp_path, lag1_reference, capsys, monkeypatch):
    """The asynchronous run (lag 1) under four deaths (one run for all: each Ray run costs its
    actors' start-up):
    1. a sampler killed between epochs: Ray restarts it and it catches up with the current weights;
    2. a sampler that crashes in the middle of its first call of epoch 1: the call is retried, the
       batch comes out identical;
    3. the learner, killed after update 1 with epochs sampled from older versions in flight: the
       driver names it in one line and restores the learner and buffer from the checkpoint (2 of 4
       epochs done) within the run (system.max_core_restarts=1), keeping the samplers and the reward
       actor (they forget their weights and load the restored learner's);
    4. the buffer, dying in epoch 3's update after its summary returned, so the learner's call fails
       for want of input: named as the buffer's death (not the learner's whose call it broke); the
       one restore is spent, so the run stops naming the checkpoint (3 of 4 epochs done) and `--resume`.
    The user's resume command (`diffrlhf train --resume`, run here in-process on this module's Ray,
    with one sampler: the plan, not the sampler count, fixes the samples) gives the uninterrupted
    run, epoch for epoch, to its final LoRA; the queries answered before a death and asked again
    after it stay in reward_queries_total and are counted in reward_queries_lost; its console says
    where it resumed and the gain over the whole history (epoch 0 on), as an uninterrupted run's would.
    (The `resume=True` path of the driver is resumed in the colocated-group test.)"""
    import re

    import numpy as np
    from PIL import Image

    from diffrlhf.buffer.trajectory import TrajectoryBatch
    from diffrlhf.deploy import cli
    from diffrlhf.deploy.baseline import summary_line
    from diffrlhf.deploy.runlog import RunLogger

    full, final = lag1_reference
    cfg, run = cfg_with(*LAG1, "system.max_core_restarts=1"), tmp_path / "b"
    killed, ids, gpus = [], {}, []

    def kill_actors(driver, epoch):
        ids[epoch] = [a._actor_id for a in driver.samplers + driver.rewards + driver.learners + [driver.buffer]]
        if epoch == 0:  # placement first: each sampler got its own (fake) GPU
            gpus.extend(gpu_ids_once_up(driver.samplers))
            ray.kill(driver.samplers[1], no_restart=False)
            killed.append("sampler-1")
        if epoch == 1 and "learner" not in killed:
            ray.kill(driver.learner)
            killed.append("learner")

    logger = RunLogger(run, cfg, tensorboard=False)
    d = Driver(cfg, run, logger=logger, progress=False, on_update=kill_actors,
               worker_classes={"sampler": crash_once_sampler(tmp_path / "marker"),
                               "buffer": buffer_dying_in_its_shards_once(tmp_path / "buffer-died")})
    with pytest.raises(RunFailed, match=r"(?s)the buffer actor died.*max_core_restarts=1 spent.*The last checkpoint \(3 of 4 epochs done\).*--resume"):
        d.run()
    first = d.records
    d.shutdown()
    logger.close()
    out = capsys.readouterr().out
    assert killed == ["sampler-1", "learner"] and (tmp_path / "marker").exists() and (tmp_path / "buffer-died").exists()
    assert first[-1]["actor_deaths"] >= 2 and first[-1]["sample_retries"] >= 1 and first[-1]["batches_dropped"] == 0
    restore = [line for line in out.splitlines() if "restoring" in line]
    assert len(restore) == 1 and re.search(r"the learner actor died: .*; restoring the learner and buffer \(the samplers and "
                                           r"reward actors kept\) from the checkpoint at epoch 2 of 4, within the run "
                                           r"\(restart 1 of system.max_core_restarts=1\)$", restore[0]), out
    # the samplers and the reward actor kept over the restore; the learner and buffer new
    (s0, s1, r0, l0, b0), (s0b, s1b, r0b, l2, b2) = ids[0], ids[2]
    assert (s0b, s1b, r0b) == (s0, s1, r0) and l2 != l0 and b2 != b0
    saved = torch.load(run / "checkpoint" / "state.pt", weights_only=False)
    assert saved["counters"]["epochs_done"] == 3 and sorted(saved["versions"]) == [2, 3]
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)  # as under `ray job submit`: this Ray's fake GPUs
    from ray._private import worker as ray_worker

    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # the CLI reroutes it; restored after
    assert cli.main(["train", "--no-progress", "--resume", str(run), "system.num_samplers=1"]) == 0
    out = capsys.readouterr().out.splitlines()
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rest = logged[len(first):]
    assert [[r["epoch"] for r in p] for p in (first, rest)] == [[0, 1, 2], [3]]
    # the retried batch was identical, the restarted and kept samplers used the current weights: the
    # uninterrupted run's numbers (the reference loop with the pinned versions), epoch by epoch
    resumed = first + rest
    for a, b in zip(resumed, full, strict=True):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6) and a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert [r["reward_queries"] for r in resumed] == [8, 16, 24, 32]  # exact: every planned image scored once
    lost = resumed[-1]["reward_queries_lost"]  # scored but not trained at a death: paid for twice
    assert lost >= 8 and resumed[-1]["reward_queries_total"] == 32 + lost
    assert rest[0]["wall_s"] > first[-1]["wall_s"]  # wall time continues
    # versions monotone, one per update; epoch e sampled with version max(0, e - 1) however the
    # samplers were timed, across the restore and the resume
    assert [r["policy_version"] for r in resumed] == [1, 2, 3, 4]
    assert [r["policy_lag_max"] for r in resumed] == [0, 1, 1, 1] and [r["policy_lag_mean"] for r in resumed] == [0, 1, 1, 1]
    b = final_lora(run)
    assert final.keys() == b.keys()
    for k in final:
        torch.testing.assert_close(final[k], b[k], atol=1e-6, rtol=1e-5)
    assert sorted(gpus) == ["0", "1"]
    assert (run / "reward_curve.png").exists() and (run / "lora" / "epoch_0004" / "pytorch_lora_weights.safetensors").exists()
    assert {"sampler-0", "reward-0", "learner", "buffer"} <= {r["role"] for r in json.loads((run / "roles.json").read_text())}
    # The decoded images go to the reward actors and the image grid only (issue 51): the buffer's
    # epochs in the checkpoint (what the learner's batches are cut from) hold none; the grids of the
    # due epochs (run.image_grid_every=2, and the last) are drawn from the reward inputs, over the
    # restore and the resume.
    held = [TrajectoryBatch.from_ipc_bytes(x) for x in load_checkpoint(run)["buffer"]["replay"]["epochs"].values()]
    assert held and all(x.images.shape == (len(x), 0, 0, 3) and x.latents.numel() > 0 for x in held)
    grids = sorted((run / "grids").iterdir())
    assert [g.name for g in grids] == ["epoch_0000.png", "epoch_0002.png", "epoch_0003.png"]
    assert all(np.asarray(Image.open(g)).std() > 0 for g in grids)
    # the console: where it resumed, and the gain over the whole history, not the part after the resume
    assert any(ln.startswith("[diffrlhf] resuming at epoch 3 of 4 from the checkpoint; redone: ") for ln in out), out
    assert any(ln.startswith("[diffrlhf] 4 epochs (1 after the resume)") for ln in out), out
    gain = [ln for ln in out if ln.startswith("[diffrlhf] reward ") and "gain" in ln]
    whole, after = summary_line(logged, None), summary_line(logged[3:], None)
    assert whole != after  # the two readings differ, so the line tells them apart
    assert len(gain) == 1 and gain[0].startswith(f"[diffrlhf] {whole}"), (gain, whole)
