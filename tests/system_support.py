"""What the two Ray system test modules share (tests/test_system.py: runs that finish and resume;
tests/test_system_failures.py: what fails and how it is reported): the small config and a local Ray
with fake GPUs, which the modules share."""
from pathlib import Path

import pytest
import torch

from diffrlhf.deploy.config import load_config

SMALL = ["model.name=tiny-random", "model.device=cpu", "sample.num_steps=4", "sample.resolution=32", "sample.batch_size=4",
         "sample.batches_per_epoch=2", "train.batch_size=4", "prompts.train=simple_animals", "run.image_grid_every=0",
         "run.tensorboard=false", "system.num_samplers=2", "system.num_reward_actors=1", "system.sampler_gpus=1",
         "system.idle_timeout_s=240", "train.lr=0.01", "train.clip_range=0.01"]


def cfg_with(*extra):
    return load_config("tiny", overrides=SMALL + list(extra))


_OURS: dict = {}  # the address of the local Ray these modules share, while it is up


@pytest.fixture(scope="module", autouse=True)
def local_ray(request):
    """One local Ray with fake GPUs for every module that imports this fixture (autouse), started by
    the first test that needs it and ended with the session: a Ray start costs seconds. Started again
    if another module's fixture replaced it (test_multinode's cluster ends with its module)."""
    import ray

    if ray.is_initialized() and _OURS.get("address") == ray.get_runtime_context().gcs_address:
        yield
        return
    ray.shutdown()
    ray.init(address="local", num_cpus=6, num_gpus=2, include_dashboard=False, log_to_driver=False)  # fake GPUs
    _OURS["address"] = ray.get_runtime_context().gcs_address
    request.session.addfinalizer(_end_ours)
    yield


def _end_ours():
    import ray

    if ray.is_initialized() and _OURS.pop("address", None) == ray.get_runtime_context().gcs_address:
        ray.shutdown()


def final_lora(run_dir):
    return torch.load(Path(run_dir) / "checkpoint" / "state.pt", weights_only=False)["learner"]["lora"]


def assert_matches_reference(records, reference):
    assert [r["epoch"] for r in records] == [r["epoch"] for r in reference]
    for a, b in zip(records, reference):
        assert a["reward_queries"] == b["reward_queries"]
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-4)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5, rel=1e-3)


