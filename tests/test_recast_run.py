"""ReCAST wired into a run (issue 53, step 3): the probe's W reaches the learner and the buffer, its
queries are counted, W is logged and drawn; with equal gain profiles "pre" trains exactly as the
weighted sum does."""
import json

import numpy as np
import pytest
import torch

from diffrlhf.deploy.config import ConfigError, load_config

SPEC = "{name: weighted_sum, terms: [{name: jpeg_compressibility, weight: 1.0}, {name: tinyworld_alignment, weight: 2.0}]}"


def small(tiny_folder, *extra):
    return load_config("tiny", overrides=[f"model.name={tiny_folder}", "sample.num_steps=2", "sample.resolution=32", "sample.batch_size=4",
                                          "sample.batches_per_epoch=1", "train.batch_size=4", "train.epochs=2", "advantage.mode=batch",
                                          "prompts.train=tiny-world-train", f"reward.spec={SPEC}", "run.tensorboard=false",
                                          "run.image_grid_every=0", "recast.trajectories=2", "recast.branches=2", *extra])


@pytest.mark.parametrize("mode", ["pre", "loss"])
def test_a_two_reward_recast_run_counts_its_probe_and_draws_w(tmp_path, tiny_folder, mode):
    from diffrlhf.actors.reference_loop import run_reference
    from diffrlhf.deploy.runlog import RunLogger

    cfg = small(tiny_folder, f"recast.mode={mode}")
    logger = RunLogger(tmp_path / "run", cfg, tensorboard=False)
    records = run_reference(cfg, logger=logger, progress=False)
    probe = 2 + 2 * 2 * 2  # P + P M T queries, once (recast.every=0)
    assert [r["reward_queries"] for r in records] == [probe + 4, probe + 8]
    assert all(np.isfinite(r["loss"]) for r in records)
    lines = (tmp_path / "run" / "recast.jsonl").read_text().splitlines()
    w = np.array(json.loads(lines[0])["weights"])
    assert len(lines) == 1 and w.shape == (2, 2)
    np.testing.assert_allclose(w.sum(1), [1 / 3, 2 / 3], atol=1e-8)  # rows: the budgets 1 : 2
    np.testing.assert_allclose(w.sum(0), [0.5, 0.5], atol=1e-8)  # columns: 1 / T
    assert (tmp_path / "run" / "recast_weights.png").exists()


def test_recast_needs_several_weighted_rewards_and_batch_advantages(tiny_folder):
    with pytest.raises(ConfigError, match="weighted_sum of >= 2 terms"):
        load_config("tiny", overrides=["recast.mode=pre", "advantage.mode=batch"])
    with pytest.raises(ConfigError, match="advantage.mode"):
        load_config("tiny", overrides=["recast.mode=pre", f"reward.spec={SPEC}"])


def test_pre_with_equal_gain_profiles_trains_exactly_as_the_weighted_sum(tiny, tiny_folder, small_settings):
    """The learner half: T W = lambda_i / Lambda at every step makes each step's mixed reward the
    weighted sum, so the update (LoRA after it) is the one the weighted sum's advantages give."""
    from diffrlhf.buffer.advantages import AdvantageComputer
    from diffrlhf.buffer.credit import recast_advantages
    from diffrlhf.learner.lora import lora_state_dict
    from diffrlhf.learner.recast import sinkhorn_weights
    from diffrlhf.learner.update import PolicyLearner, UpdateSettings
    from diffrlhf.policy.models import load_components
    from diffrlhf.policy.sampler import sample_trajectories

    n, budgets = 4, [1.0, 2.0]
    batch = sample_trajectories(tiny, ["a red circle"] * n, list(range(n)), small_settings, 0, list(range(n)),
                                tiny.encode_prompts([""]))
    terms = np.random.default_rng(0).normal(size=(n, 2))
    adv_fn = AdvantageComputer("batch")
    w = sinkhorn_weights(torch.ones(2, small_settings.num_steps), budgets)
    batch.rewards = torch.tensor(terms @ np.array(budgets), dtype=torch.float32)
    batch.advantages = torch.from_numpy(adv_fn(batch.prompts, batch.rewards.numpy()))
    batch.reward_terms = torch.tensor(terms, dtype=torch.float32)
    batch.term_advantages = torch.from_numpy(recast_advantages("pre", batch.prompts, terms, w.numpy(), budgets, adv_fn))

    def lora_after(recast):
        comps = load_components(str(tiny_folder))  # fresh components: the same LoRA initialisation each time
        learner = PolicyLearner(comps, UpdateSettings(lr=0.01, batch_size=n, recast=recast, eta=small_settings.eta,
                                                      guidance_scale=small_settings.guidance_scale))
        if recast != "off":
            learner.set_recast_weights(w)
        learner.update(batch)
        return {k: v.clone() for k, v in lora_state_dict(comps.unet).items()}

    a = lora_after("off")
    b = lora_after("pre")
    assert a.keys() == b.keys() and any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)  # the update moved B off 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_replay_ranks_a_recast_row_by_the_weighted_sums_advantage():
    """Hard-mining's |A| priority under ReCAST (defined here): a row keeps one advantage, the weighted
    sum's, and replay ranks by it; the per-step (pre) advantages ride along in term_advantages."""
    from diffrlhf.buffer.advantages import AdvantageComputer
    from diffrlhf.buffer.credit import RecastCredit
    from diffrlhf.buffer.epoch import attach_rewards, finalize_epoch
    from diffrlhf.buffer.replay import ReplayBuffer
    from diffrlhf.buffer.trajectory import TrajectoryBatch
    from diffrlhf.learner.recast import sinkhorn_weights

    n, t = 6, 3
    b = TrajectoryBatch(prompts=["p"] * n, latents=torch.zeros(n, t + 1, 1, 1, 1), timesteps=torch.zeros(n, t), log_probs=torch.zeros(n, t),
                        prompt_embeds=torch.zeros(n, 1, 1), images=torch.zeros(n, 1, 1, 3, dtype=torch.uint8), seeds=torch.arange(n),
                        policy_version=torch.zeros(n, dtype=torch.long), sample_ids=torch.arange(n))
    terms = np.random.default_rng(1).normal(size=(n, 2)).astype(np.float32)
    total = terms @ np.array([1.0, 2.0], dtype=np.float32)
    credit = RecastCredit("pre", [1.0, 2.0])
    credit.set_weights(sinkhorn_weights(torch.tensor([[1.0, 0.2, 0.0], [0.0, 0.5, 1.0]]), [1.0, 2.0]).numpy())
    adv = AdvantageComputer("batch")
    replay = ReplayBuffer(max_epochs=2, mode="hardmine", k=2)
    batch, _ = finalize_epoch(0, [attach_rewards(b, list(range(n)), total, terms)], adv, replay, None, credit)
    np.testing.assert_allclose(batch.advantages.numpy(), AdvantageComputer("batch")(["p"] * n, total), atol=1e-6)
    assert batch.term_advantages.shape == (n, t)
    chosen = replay.sample_hardmined(1).sample_ids.tolist()
    assert chosen == torch.argsort(batch.advantages.abs(), descending=True, stable=True)[:2].tolist()


def test_the_probes_conditional_means_are_unbiased_on_a_toy_with_a_known_answer():
    """A toy chain with no model: trajectory n's state after k steps is s_k = sum_{j<k} z_j (z iid
    N(0, 1)); reward 1 is the final sum r = s_T, reward 2 is 3 + 2 r. So E[r | after k steps] = s_k
    and E[r | prompt] = 0. The probe's estimate (the mean of M continuations of each recorded state)
    must match the truth on average over trajectories; the fake roles carry the values as 'images'."""
    from types import SimpleNamespace

    from diffrlhf.actors.recast_probe import measure
    from diffrlhf.rewards.serving import ScoreResult

    p, m, t = 400, 4, 3
    cfg = load_config("tiny", overrides=[f"reward.spec={SPEC}", "advantage.mode=batch", "recast.mode=pre",
                                         f"recast.trajectories={p}", f"recast.branches={m}", f"sample.num_steps={t}"])
    rng = np.random.default_rng(0)
    z = rng.normal(size=(p, t))  # the recorded trajectories' steps
    s = np.concatenate([np.zeros((p, 1)), np.cumsum(z, 1)], 1)  # s_0 .. s_T

    def as_batch(values, prompts):
        return SimpleNamespace(images=torch.tensor(values, dtype=torch.float64), prompts=list(prompts))

    def sample(prompts, seeds, ids):
        return as_batch(s[:, t], prompts)

    def branch_all(recorded, jobs):
        out = []
        for k, _ in jobs:
            k = 0 if k < 1 else k  # FRESH: nothing shared but the prompt
            cont = s[:, k, None] + rng.normal(size=(p, m, t - k)).sum(-1)  # [P, M]
            out.append(as_batch(cont.reshape(-1), [x for x in recorded.prompts for _ in range(m)]))
        return out

    def score(ids, images, prompts):
        r = np.asarray(images, dtype=np.float64)
        terms = np.stack([r, 3 + 2 * r], 1)
        return ScoreResult(list(ids), (terms @ np.array([1.0, 2.0])).astype(np.float32), [], terms.astype(np.float32),
                           ["jpeg_compressibility", "tinyworld_alignment"])

    result, queries = measure(cfg, [f"p{i}" for i in range(7)], 0, sample, branch_all, score)
    assert queries == p * m * t + p
    shift = np.array(result["shifts"])[:, None]
    cond = np.asarray(result["conditional_means"])  # [R, T, P], shifted
    for k in range(1, t + 1):
        for i, truth in enumerate((s[:, k], 3 + 2 * s[:, k])):
            err = cond[i, k - 1] + shift[i] - truth
            assert abs(err.mean()) < 4 * err.std(ddof=1) / np.sqrt(p) + 1e-12, (i, k, err.mean())
    prompt = np.asarray(result["prompt_means"]) + shift  # [R, P]: E[r | prompt] = 0 and 3
    assert abs(prompt[0].mean()) < 4 * prompt[0].std(ddof=1) / np.sqrt(p) and abs(prompt[1].mean() - 3) < 4 * prompt[1].std(ddof=1) / np.sqrt(p)
