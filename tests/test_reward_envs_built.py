"""Opt-in (`-m reward_env`, minutes and package-registry access): build a package reward's own venv
with `diffrlhf reward-env build`, then train 2 epochs on the embedded default with the package's
own model scoring inside Ray (`reward.runtime_env=auto`). The venvs live under
$DIFFRLHF_REWARD_ENVS when set (CI keeps them in its work folder), else a temporary folder."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.reward_env, pytest.mark.integration]


@pytest.fixture(scope="module")
def envs_root(tmp_path_factory):
    return os.environ.get("DIFFRLHF_REWARD_ENVS") or str(tmp_path_factory.mktemp("reward-envs"))


def cli(*args, env, cwd, timeout=1500):
    return subprocess.run([sys.executable, "-m", "diffrlhf.deploy.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("name, reward", [("imagereward", "imagereward_pkg")])
def test_build_then_train_two_epochs_with_the_packages_own_model_in_ray(name, reward, envs_root, tmp_path):
    env = {**os.environ, "DIFFRLHF_REWARD_ENVS": envs_root, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    built = cli("reward-env", "build", name, env=env, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    assert built.stdout.strip().splitlines()[-1] == os.path.join(envs_root, name)
    again = cli("reward-env", "build", name, env=env, cwd=tmp_path)  # idempotent: nothing to do
    assert again.returncode == 0 and "is up to date" in again.stdout, again.stdout + again.stderr
    run = cli("train", "--no-progress", f"reward.spec={reward}", "reward.runtime_env=auto", "train.epochs=2",
              f"run.out_dir={tmp_path}", "run.name=r", env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "random weights" in run.stdout  # said once, before Ray, that no weight file was found
    records = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert math.isfinite(r["reward_mean"]) and r["reward_std"] > 0  # finite and varying
        assert r["reward_dropped_epoch"] == 0
