"""A learner group of 2 (torch.distributed, gloo, two processes) makes the single learner's update:
the same LoRA to float tolerance, the same statistics and counts. The plan (buffer/sharding.py) gives
every row to exactly one rank."""
import json

import pytest
import torch
import torch.multiprocessing as mp

from diffrlhf.buffer.sharding import Shard, chunk_share, rank_rows, shard_batch, update_chunks, update_generator
from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.learner.distributed import free_port
from diffrlhf.learner.update import PolicyLearner, UpdateSettings
from diffrlhf.policy.sampler import SamplingSettings, sample_trajectories

SAMPLING = SamplingSettings(num_steps=4, eta=1.0, guidance_scale=5.0, resolution=32)
# Uneven on purpose: 7 rows in chunks of 3 (3, 3, 1: rank 1 alone gets a row of the last chunk and
# rank 0 none), accumulation over 2 chunks, 2 inner epochs, the dynamic latent_sq weights (summed
# over ranks), the weighted selection with its coefficients, and replayed rows recomputed.
SETTINGS = dict(eta=1.0, guidance_scale=5.0, lr=3e-3, batch_size=3, grad_accum_steps=2, inner_epochs=2, weighting="latent_sq",
                timestep_selection="weighted", timestep_fraction=0.5, logprob_mode="recompute", clip_range=0.05)


def test_the_plan_gives_every_row_to_exactly_one_rank():
    chunks = update_chunks(11, 4, update_generator(3, 5))
    assert [len(c) for c in chunks] == [4, 4, 3] and sorted(torch.cat(chunks).tolist()) == list(range(11))
    for world in (1, 2, 3, 5):
        shares = [chunk_share(c, r, world) for c in chunks for r in range(world)]
        assert sorted(torch.cat(shares).tolist()) == list(range(11))
        assert all(max(len(chunk_share(c, r, world)) for r in range(world)) - min(len(chunk_share(c, r, world)) for r in range(world)) <= 1
              for c in chunks)
        rows = [rank_rows(chunks, r, world) for r in range(world)]
        assert sorted(torch.cat(rows).tolist()) == list(range(11))
    # The plan is the single learner's first draw: the same key, the same row order.
    assert torch.equal(torch.cat(chunks), torch.randperm(11, generator=torch.Generator().manual_seed(3 * 1_000_003 + 5)))


def _batch(tiny, learner) -> TrajectoryBatch:
    batch = sample_trajectories(tiny, ["a red circle", "a blue square", "a green triangle"] * 3, list(range(9)), SAMPLING, 0,
                                list(range(9)), learner.negative_embeds).select(torch.arange(7))
    batch.advantages = torch.tensor([1.2, -0.7, 0.4, -1.0, 0.3, 0.9, -0.5])
    batch.replayed = torch.tensor([False, False, False, False, False, True, True])
    return batch


def _rank(rank: int, world: int, port: int, folder: str, tmp: str) -> None:
    from diffrlhf.learner.distributed import Group, init_group
    from diffrlhf.policy.models import load_components

    torch.set_num_threads(1)
    learner = PolicyLearner(load_components(folder), UpdateSettings(**SETTINGS), lora_rank=4, seed=0)
    init_group("127.0.0.1", port, rank, world, "cpu", timeout_s=120)
    learner.group = Group.current()
    learner.load_state_dict(torch.load(f"{tmp}/single_state.pt", weights_only=False))  # every rank resumes the single learner's state
    batch = TrajectoryBatch.load(f"{tmp}/batch.arrow")
    part, shard = shard_batch(batch, SETTINGS["batch_size"], world, seed=0, version=learner.version)[rank]
    stats = learner.update(part, shard)
    torch.save({"lora": learner.lora_state(), "stats": stats, "rows": shard.row_ids.tolist(),
                "adam": learner.optimizer.state_dict()["state"]}, f"{tmp}/rank{rank}.pt")


def test_two_learners_make_the_single_learners_update(tiny, tiny_folder, tmp_path):
    """A group of 2 resumed from a single learner's checkpoint (after one update: LoRA, Adam state,
    version) makes the single learner's next update: the union of the shards is the whole batch,
    the gradient all-reduce makes every rank's step the single learner's (checkpoints do not
    depend on num_learners; 2 -> 1 is checked on Ray in test_system.py)."""
    single = PolicyLearner(tiny, UpdateSettings(**SETTINGS), lora_rank=4, seed=0)
    batch = _batch(tiny, single)
    batch.save(tmp_path / "batch.arrow")
    single.update(TrajectoryBatch.load(tmp_path / "batch.arrow"))
    torch.save(single.state_dict(), tmp_path / "single_state.pt")
    before = {n: t.clone() for n, t in single.lora_state().items()}
    ref = single.update(TrajectoryBatch.load(tmp_path / "batch.arrow"))
    # fork, not spawn: the ranks inherit this process's imports (a fresh interpreter spends ~8 s
    # of a 2-core machine importing diffusers); each rank sets 1 torch thread before any op.
    mp.start_processes(_rank, args=(2, free_port(), str(tiny_folder), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert sorted(ranks[0]["rows"] + ranks[1]["rows"]) == list(range(7))  # every row trained once, by one rank
    moved = max((ref_t - before[n]).abs().max().item() for n, ref_t in single.lora_state().items())
    assert moved > 1e-4  # the update did something to compare
    for r in ranks:
        for n, t in single.lora_state().items():
            torch.testing.assert_close(r["lora"][n], t, atol=1e-3 * moved, rtol=0)  # Adam turns float-rounding-sized gradient differences into lr-sized steps where a gradient is ~0
    # The ranks are not just close to the single learner: they are identical to each other.
    assert all(torch.equal(ranks[0]["lora"][n], ranks[1]["lora"][n]) for n in ranks[0]["lora"])
    got = ranks[0]["stats"]
    for key in ("learner_passes", "learner_forward_passes", "num_replayed", "optimizer_steps", "steps_trained"):
        assert got[key] == ref[key], key
    for key in ("loss", "approx_kl", "clipfrac", "clipfrac_fresh", "clipfrac_replay", "grad_norm"):
        assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), key
    assert got["learners"] == 2 and ref["learners"] == 1
    assert got["learner_calls"] > ref["learner_calls"]  # UNet calls of every rank: smaller, more of them


def test_a_shard_from_another_epoch_is_refused(tiny):
    learner = PolicyLearner(tiny, UpdateSettings(**SETTINGS), lora_rank=4, seed=0)
    batch = _batch(tiny, learner)
    part, shard = shard_batch(batch, 3, 1, seed=0, version=4)[0]
    with pytest.raises(ValueError, match=r"planned for \(seed, policy version\) \(0, 4\).*at \(0, 0\)"):
        learner.update(part, shard)
    part, shard = shard_batch(batch, 3, 2, seed=0, version=0)[1]
    with pytest.raises(ValueError, match="rank 1 of 2 reached rank 0 of a group of 1"):
        learner.update(part, shard)
    # A single learner's own whole-batch shard is the plain update.
    assert Shard.whole(7).row_ids.tolist() == list(range(7))


def test_config_and_resource_requests_count_the_learners():
    from diffrlhf.actors.scheduler import resource_problems, role_requests
    from diffrlhf.deploy.config import ConfigError, load_config

    cfg = load_config("tiny", overrides=["system.num_learners=2", "system.learner_gpus=1"])
    assert role_requests(cfg)["learner"] == (2, {"CPU": 1.0, "GPU": 1})
    problems = resource_problems(role_requests(cfg), {"CPU": 16, "GPU": 1}, [{"CPU": 16, "GPU": 1}])
    assert any("x 2 learners = 2 GPU" in p and "system.num_learners" in p for p in problems), problems
    with pytest.raises(ConfigError, match="system.num_learners.*more than train.batch_size"):
        load_config("tiny", overrides=["system.num_learners=9"])
    with pytest.raises(ConfigError, match="system.num_learners.*>= 1"):
        load_config("tiny", overrides=["system.num_learners=0"])
    with pytest.raises(ConfigError, match=r"system.colocate.*num_samplers \(2\) must equal system.num_learners \(1\)"):
        load_config("tiny", overrides=["system.colocate=true"])
