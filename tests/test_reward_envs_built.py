"""Opt-in (`-m reward_env`: minutes, package-registry access, ~5 GB RAM): the package rewards'
own venvs, built by `diffrlhf reward-env build`, scoring inside Ray.

- build, then 2 epochs of the main job on the embedded default with the package's model as the
  reward (`reward.runtime_env=auto`): finite, varying rewards;
- the package's model and the native scorer agree on the same images with the same (random,
  seeded) weights: the venv saves its model's weights in the package's checkpoint format, the
  core's native scorer loads that file;
- a package reward actor that dies in the middle of a batch loses no sample: the run's epoch
  rewards equal an uninterrupted run's.

The venvs live under $DIFFRLHF_REWARD_ENVS when set (CI keeps them in its work folder, so a
second run reuses them), else in a temporary folder."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.reward_env, pytest.mark.integration]

ENVS = [("imagereward", "imagereward_pkg"), ("hpsv2", "hpsv2_pkg")]
PROMPTS = ["a red square", "a blue circle on the left", "two green triangles", "a photo of a cat"]
# What the venv runs: the package reward with seeded random weights, its weights saved in the
# package's checkpoint format, and its scores of four fixed images.
VENV_SIDE = """
import json, sys
import numpy as np, torch
from diffrlhf.rewards import build_reward
name, out = sys.argv[1], sys.argv[2]
reward = build_reward({"name": name, "seed": 0})
sd = reward.model.state_dict()
torch.save(sd if name == "imagereward_pkg" else {"state_dict": sd}, out + "/weights.pt")
images = np.random.default_rng(0).integers(0, 255, (4, 64, 64, 3), dtype=np.uint8)
json.dump([float(x) for x in reward(images, json.loads(sys.argv[3]))], open(out + "/scores.json", "w"))
"""


@pytest.fixture(scope="module")
def envs_root(tmp_path_factory):
    return os.environ.get("DIFFRLHF_REWARD_ENVS") or str(tmp_path_factory.mktemp("reward-envs"))


@pytest.fixture(scope="module")
def cli_env(envs_root):
    env = {**os.environ, "DIFFRLHF_REWARD_ENVS": envs_root, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    env.pop("DIFFRLHF_REWARD_PYTHON", None)
    return env


def cli(*args, env, cwd, timeout=1500):
    return subprocess.run([sys.executable, "-m", "diffrlhf.deploy.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def built(cli_env, tmp_path_factory):
    """Both venvs built (or found up to date) with the CLI; a second build is a no-op."""
    cwd = tmp_path_factory.mktemp("build")
    for name, _ in ENVS:
        done = cli("reward-env", "build", name, env=cli_env, cwd=cwd)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines()[-1] == os.path.join(cli_env["DIFFRLHF_REWARD_ENVS"], name)
        again = cli("reward-env", "build", name, env=cli_env, cwd=cwd)
        assert again.returncode == 0 and "is up to date" in again.stdout, again.stdout + again.stderr
    return cli_env["DIFFRLHF_REWARD_ENVS"]


@pytest.mark.parametrize("name, reward", ENVS)
def test_two_epochs_of_the_main_job_with_the_packages_own_model_in_ray(name, reward, built, cli_env, tmp_path):
    run = cli("train", "--no-progress", f"reward.spec={reward}", "reward.runtime_env=auto", "train.epochs=2",
              f"run.out_dir={tmp_path}", "run.name=r", env=cli_env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "random weights" in run.stdout + run.stderr  # said before Ray that no weight file was found
    records = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert math.isfinite(r["reward_mean"]) and r["reward_std"] > 0  # finite and varying
        assert r["reward_dropped_epoch"] == 0


@pytest.mark.parametrize("name, reward", ENVS)
def test_the_package_and_the_native_scorer_agree_on_the_same_weights(name, reward, built, cli_env, tmp_path):
    """Tolerance: ImageReward bit-exact with the native scorer's PIL resize, within 1e-3 of the
    score spread with its batched torch resize (the one runs use); HPSv2 within 1e-6 (float
    rounding; both resize the same way)."""
    python = Path(built) / name / "bin" / "python"
    done = subprocess.run([str(python), "-c", VENV_SIDE, reward, str(tmp_path), json.dumps(PROMPTS)],
                          env={**cli_env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    package = np.array(json.loads((tmp_path / "scores.json").read_text()))
    images = np.random.default_rng(0).integers(0, 255, (4, 64, 64, 3), dtype=np.uint8)
    spread = np.ptp(package)
    assert spread > 0  # random weights, re-initialised head: the scores vary
    weights = str(tmp_path / "weights.pt")
    if name == "imagereward":
        from diffrlhf.rewards.imagereward import ImageRewardScorer

        vocab = Path(built) / name / "share" / "diffrlhf" / "bert-base-uncased"
        exact = ImageRewardScorer.from_spec(weights=weights, tokenizer=str(vocab), resize="pil")
        assert np.array_equal(exact(images, PROMPTS), package.astype(np.float32))
        batched = ImageRewardScorer.from_spec(weights=weights, tokenizer=str(vocab), resize="torch")
        assert np.abs(batched(images, PROMPTS) - package).max() <= 1e-3 * spread
    else:
        from diffrlhf.rewards.hpsv2 import HPSv2Scorer

        assert np.abs(HPSv2Scorer.from_spec(weights=weights)(images, PROMPTS) - package).max() <= 1e-6


def crash_once_reward(marker: Path, at_call: int):
    """A reward actor that dies half-way through its `at_call`-th batch, once (the marker file)."""
    from diffrlhf.actors.reward_worker import RewardWorker

    class CrashOnceReward(RewardWorker):  # defined in a function: cloudpickle ships it by value into the venv
        def score(self, reward_input):
            calls = int(marker.read_text()) if marker.exists() else 0
            if calls >= 0:
                marker.write_text(str(calls + 1))
            if calls + 1 == at_call:
                marker.write_text("-1")  # crashed: never again
                half = {k: v[: len(v) // 2] for k, v in reward_input.items()}
                super().score(half)  # half the batch scored, then the process dies
                os._exit(1)
            return super().score(reward_input)

    return CrashOnceReward


def test_a_package_reward_actor_killed_mid_batch_loses_no_sample(built, cli_env, tmp_path, monkeypatch):
    import ray

    from diffrlhf.actors.driver import Driver
    from diffrlhf.deploy.config import load_config

    monkeypatch.setenv("DIFFRLHF_REWARD_ENVS", built)
    cfg = load_config(None, overrides=["reward.spec=imagereward_pkg", "reward.runtime_env=auto", "train.epochs=2",
                                       "system.num_samplers=1"])
    ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        plain = Driver(cfg, tmp_path / "plain", progress=False)
        plain_records = plain.run()
        plain.shutdown()
        marker = tmp_path / "calls"
        killed = Driver(cfg, tmp_path / "killed", progress=False, worker_classes={"reward": crash_once_reward(marker, 3)})
        killed_records = killed.run()
        killed.shutdown()
    finally:
        ray.shutdown()
    assert marker.read_text() == "-1"  # it did die mid-batch
    assert [r["reward_mean"] for r in killed_records] == [r["reward_mean"] for r in plain_records]
    assert [r["reward_queries"] for r in killed_records] == [r["reward_queries"] for r in plain_records]
    assert killed_records[-1]["score_retries"] >= 1 and killed_records[-1]["actor_deaths"] >= 1  # the half-scored batch was redone
