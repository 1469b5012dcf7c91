import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# The suite touches nothing outside its own temporary folder: the project's cache, HOME-based caches
# (~/.cache, ~/.ray, matplotlib's) and Ray's temp dir all go into one sandbox, set before anything
# (or any Ray worker, subprocess or CLI the tests start, which inherit it) reads them. The path stays
# short: Ray's socket paths under RAY_TMPDIR must fit in 107 bytes.
SANDBOX = Path(tempfile.mkdtemp(prefix="drl-tests-"))
for _var, _sub in [("HOME", "home"), ("DIFFRLHF_CACHE", "home/.cache/diffrlhf"), ("XDG_CACHE_HOME", "home/.cache"),
                   ("MPLCONFIGDIR", "home/.config/matplotlib"), ("RAY_TMPDIR", "tmp")]:
    (SANDBOX / _sub).mkdir(parents=True, exist_ok=True)
    os.environ[_var] = str(SANDBOX / _sub)
torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    """The quick tier (`-m quick`): every test that is neither `integration` (starts a Ray cluster, a
    CLI run or an install in another process) nor `slow`."""
    for item in items:
        if not any(item.get_closest_marker(m) for m in ("integration", "slow", "sd15")):
            item.add_marker(pytest.mark.quick)


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


def pytest_unconfigure(config):
    shutil.rmtree(SANDBOX, ignore_errors=True)
