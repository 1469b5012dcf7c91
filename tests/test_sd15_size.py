"""SD1.5's size through the real loading and sampling path (issue 55, step 1). Opt-in: it builds a
4.3 GB random-weight model (`python -m pytest -m sd15 tests`; ~8 GB of RAM at its peak)."""
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.sd15


def test_sd15_random_is_sd15s_architecture_and_samples_and_trains_through_the_real_path():
    from diffrlhf.actors.settings import build_policy, sampling_settings
    from diffrlhf.deploy.config import load_config
    from diffrlhf.policy.sampler import sample_trajectories

    cfg = load_config("tiny", overrides=["model.name=sd15-random", "model.device=cpu", "sample.num_steps=2", "sample.resolution=64",
                                         "sample.batch_size=2", "train.batch_size=2"])
    comps, learner = build_policy(cfg)
    assert "sd15-random-seed0" in str(comps.source)  # the run's model folder says: random weights
    n_unet = sum(p.numel() for n, p in comps.unet.named_parameters() if "lora" not in n)
    assert n_unet == 859_520_964 and list(comps.unet.config.block_out_channels) == [320, 640, 1280, 1280]
    assert comps.text_encoder.config.hidden_size == 768 and comps.text_encoder.config.num_hidden_layers == 12
    assert sum(p.numel() for p in learner.params) == 797_184  # the rank-4 attention LoRA at SD1.5's size
    batch = sample_trajectories(comps, ["a red circle", "a blue square"], [0, 1], sampling_settings(cfg), 0, [0, 1],
                                learner.negative_embeds)
    assert batch.images.shape == (2, 64, 64, 3) and torch.isfinite(batch.log_probs).all()
    batch.rewards, batch.advantages = torch.tensor([1.0, -1.0]), torch.tensor([1.0, -1.0])
    out = learner.update(batch)
    assert np.isfinite(out["loss"]) and out["learner_passes"] == 4


@pytest.mark.integration
def test_the_ray_roles_run_at_sd15s_size_and_say_their_memory(tmp_path):
    """The distributed run itself at SD1.5's size (research/results/sd15_size/commands.sh, smaller):
    2 samplers, a learner group of 2, a reward actor and the buffer, 1 epoch at 64 px through the CLI;
    every model-holding role reports its peak memory, each at least the fp32 weights' 4.27 GB less
    what stays on disk (the weight files are memory-mapped), and the two learner ranks agree. ~14 GB."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    args = ["model.name=sd15-random", "model.device=cpu", "sample.resolution=64", "sample.num_steps=2", "sample.batch_size=2",
            "sample.batches_per_epoch=2", "train.batch_size=2", "train.epochs=1", "system.num_samplers=2", "system.num_learners=2",
            f"run.out_dir={tmp_path}", "run.name=r", "run.image_grid_every=0", "run.tensorboard=false",
            "system.start_timeout_s=1800", "system.idle_timeout_s=1800"]
    done = subprocess.run([sys.executable, "-m", "diffrlhf.deploy.cli", "train", "--no-progress", *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    roles = {r["role"]: r for r in json.loads((tmp_path / "r" / "roles.json").read_text())}
    holders = ["learner-0", "learner-1", "sampler-0", "sampler-1"]
    assert set(holders) <= set(roles)
    for name in holders:
        assert 3.5 < roles[name]["peak_rss_gb"] < 8.0, (name, roles[name]["peak_rss_gb"])
    assert roles["reward-0"]["peak_rss_gb"] < 1.5 and roles["buffer"]["peak_rss_gb"] < 1.5
    record = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["learners"] == 2 and record["reward_queries"] == 4 and np.isfinite(record["loss"])
