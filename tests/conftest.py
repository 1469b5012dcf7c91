import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# In a pytest-xdist worker (-n 2), OpenMP threads that wait for work sleep instead of spinning (read
# when torch loads OpenMP, so set before `import torch`; inherited by the Ray workers and CLIs the
# tests start). With two test processes and Ray's actors on two cores, spinning threads took the
# cores from the ones with work: two golden-test runs at once took 59 s, 19 s so. Alone (one
# process, `-m quick`) sleeping costs a wake-up per parallel region: the quick tier took 105 s so,
# 78 s without. The numbers are the same either way: only the waiting differs.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402  (after OMP_WAIT_POLICY)

# The Ray clusters the tests start (and the CLIs and jobs they run, which inherit it) run their workers
# at the tests' own priority, not Ray's default nice 15: beside two background study runs (nice 19)
# the actors got only ~70% of the cores at nice 15. Measured, the default tier beside two study runs:
# 361 s at nice 15, 290 s at 0; quiet, 305 s and 282 s. A user's `diffrlhf train` keeps Ray's default.
os.environ.setdefault("RAY_worker_niceness", "0")

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


# The modules made of whole Ray runs take most of the suite's time. With -n 2 they go, as one unit
# of work, to one worker in turn, first; the other worker runs every other module, then the last Ray
# modules (RAY_RUN_LAST, each its own unit, at the end of the queue, to whichever worker is free), so
# neither worker waits idle long. Measured on a quiet 2-core machine: 256, 284, 308 s so; 261, 274, 304 s
# with only the system-failures module last; 293-309 s with every Ray module in the one unit (the
# other worker idle for its last ~115 s); 325 s with job submit and the reaper first on the other
# worker (two Ray start-ups at once only wait on each other).
RAY_RUN_LAST = ("test_system_failures.py", "test_reaper.py")
RAY_RUNS = ("test_system.py", "test_multinode.py", "test_job_submit.py")


def queue_place(item) -> int:
    """0: the Ray-run unit; 1: every other module; then RAY_RUN_LAST in its order."""
    name = item.path.name
    return 0 if name in RAY_RUNS else 2 + RAY_RUN_LAST.index(name) if name in RAY_RUN_LAST else 1


def pytest_collection_modifyitems(config, items):
    """The quick tier (`-m quick`): every test that is neither `integration` (starts a Ray cluster, a
    CLI run or an install in another process) nor `slow`. The Ray-run unit first, RAY_RUN_LAST last."""
    for item in items:
        if not any(item.get_closest_marker(m) for m in ("integration", "slow", "sd15")):
            item.add_marker(pytest.mark.quick)
    items.sort(key=queue_place)  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # a pytest-xdist hook: ignored where xdist is not installed
def pytest_xdist_make_scheduler(config, log):
    """With -n N: the RAY_RUNS modules as one unit of work, in turn on one worker; every other module
    (RAY_RUN_LAST included) whole to the next free worker (its module fixtures built once), in the
    collection order. An explicit --dist is kept."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayRunsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "ray-runs" if Path(module).name in RAY_RUNS else module

    config.option.loadscopereorder = False  # the collection order (not xdist's: modules by their number of tests)
    return RayRunsTogether(config, log)


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model's ops are too small for 2 threads to help; on a busy 2-core machine they only
    wait. A module opts in with pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def keep_torch_threads():
    """For a test whose command sets the process-wide thread count (study --threads): later tests
    expect conftest's."""
    threads = torch.get_num_threads()
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
