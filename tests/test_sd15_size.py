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
