"""A local Ray started by `diffrlhf train` is gone within seconds when the CLI is SIGKILLed
(actors/reaper.py), Ray's agents included (they outlive their starter by about a minute alone)."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from diffrlhf.actors.reaper import end_tree

SMALL = ["model.name=tiny-random", "sample.num_steps=2", "sample.resolution=32", "sample.batch_size=2",
         "sample.batches_per_epoch=1", "train.batch_size=2", "prompts.train=simple_animals", "run.image_grid_every=0",
         "run.tensorboard=false", "system.num_samplers=1", "train.epochs=200"]


ROLES = ("Sampler", "Reward", "Buffer", "Learner")  # the actor classes, as Ray titles their worker processes (ray::SamplerWorker...)


def gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.integration
def test_end_tree_ends_a_process_and_descendants_that_ignore_sigterm():
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); "
            "time.sleep(60)")
    top = subprocess.Popen([sys.executable, "-c", code])
    p = psutil.Process(top.pid)
    deadline = time.time() + 20
    while not p.children():
        assert time.time() < deadline
        time.sleep(0.1)
    tree = [p, *p.children(recursive=True)]
    assert end_tree([p], grace_s=1.0) == []
    top.wait(10)
    assert all(gone(q) for q in tree)


@pytest.mark.integration
def test_nothing_of_a_local_ray_is_left_soon_after_the_cli_is_killed(tmp_path):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}  # the suite's cache: the tiny model built once per test run
    env.pop("RAY_ADDRESS", None)
    out_dir, tree = tmp_path / "runs", []
    cli = subprocess.Popen([sys.executable, "-m", "diffrlhf.deploy.cli", "train", "--no-progress", *SMALL,
                            f"run.out_dir={out_dir}", "run.name=r"], env=env, cwd=tmp_path,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 240
        while True:  # Ray's processes and the run's actors (each role's worker, loading or working) are there
            assert cli.poll() is None, "the CLI ended before its actors started"
            assert time.time() < deadline, "the actors did not start within 240 s"
            tree = psutil.Process(cli.pid).children(recursive=True)
            names = " ".join(" ".join(q.cmdline()) for q in tree if not gone(q))
            if "raylet" in names and "gcs_server" in names and all(f"ray::{r}Worker" in names for r in ROLES):
                break
            time.sleep(0.5)
        cli.send_signal(signal.SIGKILL)
        cli.wait(10)
        # The reaper ends them within its 3 s grace; without it Ray's agents linger about a minute.
        # 30 s tells the two apart, with room for a loaded machine; done as soon as nothing is left.
        deadline = time.time() + 30
        while any(not gone(q) for q in tree) and time.time() < deadline:
            time.sleep(0.5)
        left = [" ".join(q.cmdline())[:120] for q in tree if not gone(q)]
        assert left == [], left
    finally:
        if cli.poll() is None:
            cli.kill()
        end_tree([q for q in tree if not gone(q)], grace_s=1.0)  # a failed check leaves nothing running either
