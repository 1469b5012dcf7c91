import os

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
torch.set_num_threads(2)


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model's ops are too small for 2 threads to help; on a busy 2-core machine they only
    wait. A module opts in with pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def _reference_like_actors(cfg):
    """The reference loop's records for cfg, run with the actors' torch threads (same kernels,
    same rounding), so a Ray run of the same config can be compared with it."""
    from diffrlhf.actors.reference_loop import run_reference

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.system.torch_threads)
    try:
        return run_reference(cfg, progress=False)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def reference_like_actors():
    return _reference_like_actors
