"""Several rewards with weights (issue 53, step 2): a weighted_sum spec scores each reward on every
sample, keeps each reward's unweighted value beside the weighted total through the trajectory batch,
and records each reward's epoch mean; a sample scored by k rewards is one query (k model calls)."""
import json

import numpy as np
import pytest
import torch

from diffrlhf.buffer.epoch import attach_rewards, epoch_record
from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.rewards import weighted_sum_names, weighted_sum_weights
from diffrlhf.rewards.serving import RewardServer

SPEC = {"name": "weighted_sum", "terms": [{"name": "jpeg_compressibility", "weight": 2.0}, "jpeg_incompressibility",
                                          {"name": "jpeg_compressibility", "weight": 0.5}]}


def images(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, 16, 16, 3), dtype=np.uint8)


def test_the_server_returns_each_terms_reward_and_counts_a_sample_once():
    server = RewardServer(SPEC, batch_size=3)
    ims = images(5)
    out = server.score(list(range(5)), ims, ["p"] * 5)
    assert out.term_names == ["jpeg_compressibility", "jpeg_incompressibility", "jpeg_compressibility#2"]
    assert out.terms.shape == (5, 3) and out.terms.dtype == np.float32
    single = RewardServer("jpeg_compressibility").score(list(range(5)), ims, ["p"] * 5).rewards
    np.testing.assert_array_equal(out.terms[:, 0], single)
    np.testing.assert_allclose(out.terms[:, 1], -single, rtol=1e-6)  # incompressibility is the size itself
    np.testing.assert_allclose(out.rewards, 2.0 * single - single + 0.5 * single, rtol=1e-5)
    server.score(list(range(5)), ims, ["p"] * 5)  # the same ids again: not new queries
    assert server.num_queries == 5 and server.stats()["term_queries"] == 15
    assert RewardServer("jpeg_compressibility").score([0], ims[:1], ["p"]).terms is None


def test_spec_helpers_name_and_weigh_the_terms():
    assert weighted_sum_names(SPEC) == ["jpeg_compressibility", "jpeg_incompressibility", "jpeg_compressibility#2"]
    assert weighted_sum_weights(SPEC) == [2.0, 1.0, 0.5]
    assert weighted_sum_names("jpeg_compressibility") is None and weighted_sum_weights({"name": "aesthetic"}) is None


def _batch(n, t=2):
    return TrajectoryBatch(prompts=[f"p{i}" for i in range(n)], latents=torch.zeros(n, t + 1, 1, 1, 1), timesteps=torch.zeros(n, t),
                           log_probs=torch.zeros(n, t), prompt_embeds=torch.zeros(n, 1, 1), images=torch.zeros(n, 1, 1, 3, dtype=torch.uint8),
                           seeds=torch.arange(n), policy_version=torch.zeros(n, dtype=torch.long), sample_ids=torch.arange(n) + 10)


def test_terms_follow_their_rows_through_the_batch_and_its_arrow_form():
    b = _batch(4)
    assert b.reward_terms.shape == (4, 0)
    assert "reward_terms" not in json.dumps(TrajectoryBatch.from_ipc_bytes(b.to_ipc_bytes()).meta)
    assert TrajectoryBatch.from_ipc_bytes(b.to_ipc_bytes()).reward_terms.shape == (4, 0)  # no column written, none read
    terms = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=np.float32)
    got = attach_rewards(b, [13, 10, 12], [0.1, 0.2, 0.3], terms)  # id 11 was dropped; order by the batch's rows
    assert got.sample_ids.tolist() == [10, 12, 13]
    assert got.reward_terms.tolist() == [[3.0, 4.0], [5.0, 6.0], [1.0, 2.0]]
    back = TrajectoryBatch.from_ipc_bytes(got.to_ipc_bytes())
    torch.testing.assert_close(back.reward_terms, got.reward_terms)
    torch.testing.assert_close(TrajectoryBatch.cat([back, back]).reward_terms, torch.cat([got.reward_terms] * 2))


def test_the_epoch_record_has_each_rewards_mean():
    rec = epoch_record(0, [1.0, 3.0], 2, {}, [[1.0, 10.0], [2.0, 30.0]], ["a", "b"])
    assert rec["reward_mean/a"] == 1.5 and rec["reward_mean/b"] == 20.0 and rec["reward_mean"] == 2.0
    assert not any(k.startswith("reward_mean/") for k in epoch_record(0, [1.0], 1, {}))


def test_a_reference_run_with_two_rewards_records_and_draws_each(tmp_path, tiny_folder):
    from diffrlhf.actors.reference_loop import run_reference
    from diffrlhf.deploy.config import load_config
    from diffrlhf.deploy.runlog import RunLogger

    spec = "{name: weighted_sum, terms: [{name: jpeg_compressibility, weight: 1.0}, {name: tinyworld_alignment, weight: 2.0}]}"
    cfg = load_config("tiny", overrides=[f"model.name={tiny_folder}", "sample.num_steps=2", "sample.resolution=32", "sample.batch_size=4",
                                         "sample.batches_per_epoch=1", "train.batch_size=4", "train.epochs=2",
                                         "prompts.train=tiny-world-train", f"reward.spec={spec}", "run.tensorboard=false",
                                         "run.image_grid_every=0"])
    logger = RunLogger(tmp_path / "run", cfg, tensorboard=False)
    records = run_reference(cfg, logger=logger, progress=False)
    assert [r["reward_queries"] for r in records] == [4, 8]  # one query per sample, whatever the number of rewards
    for r in records:
        assert r["reward_mean"] == pytest.approx(r["reward_mean/jpeg_compressibility"] + 2.0 * r["reward_mean/tinyworld_alignment"], abs=1e-5)
    assert logger.plot_reward_terms().exists()
