import os

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_folder():
    from diffrlhf.tinyworld.architecture import ensure_tiny_random

    return ensure_tiny_random(0)


@pytest.fixture()
def tiny(tiny_folder):
    """Fresh tiny-random components (each test may add a LoRA to its own copy)."""
    from diffrlhf.policy.models import load_components

    return load_components(str(tiny_folder))


@pytest.fixture()
def small_settings():
    from diffrlhf.policy.sampler import SamplingSettings

    return SamplingSettings(num_steps=6, eta=1.0, guidance_scale=5.0, resolution=32)
