"""B2-DiffuRL (Hu et al. 2025): backward progressive training, branch sampling, the branch extremes.

The schedule is checked against the reference's integer stage formula, the trained steps against
what the learner's UNet was actually called with, and the branches against an ordinary sample of
the group's seed (the shared prefix) and against the learner's recomputed log-probs.
"""
import pytest
import torch

from diffrlhf.actors.reference_loop import run_reference
from diffrlhf.actors.settings import branch_step, plan_for, train_rows
from diffrlhf.learner.algorithms.b2diffurl import branch_extremes
from diffrlhf.deploy.config import ConfigError, load_config
from diffrlhf.learner.timesteps import backward_trained_steps, num_trained_steps, select_timesteps
from diffrlhf.learner.update import PolicyLearner, UpdateSettings
from diffrlhf.policy.branching import branch_seed, sample_branched, sample_plan
from diffrlhf.policy.prompts import plan_batch
from diffrlhf.policy.sampler import sample_trajectories

TINY = ["model.name=tiny-random", "model.device=cpu", "sample.resolution=32", "run.image_grid_every=0", "run.tensorboard=false",
        "prompts.train=simple_animals"]
B2 = ["algorithm.name=b2diffurl", "train.timestep_selection=backward", "sample.samples_per_prompt=2"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("t,first,stages", [(20, 14, 100), (20, 14, 7), (20, 1, 15), (5, 2, 4), (10, 10, 3), (6, 3, 50)])
def test_the_stage_schedule_is_the_reference_integer_formula(t, first, stages):
    """run_process.sh: stage i trains the last first + i * (T - first + 1) // S steps (integer division)."""
    got = [backward_trained_steps(t, first, i / stages) for i in range(stages)]
    assert got == [first + i * (t - first + 1) // stages for i in range(stages)]
    assert got[0] == first and got[-1] <= t and backward_trained_steps(t, first, 1.0) == t
    assert all(a <= b for a, b in zip(got, got[1:]))


def test_backward_selection_trains_exactly_the_last_steps_once_each_in_a_fresh_order():
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(10)  # the weights do not move the segment
    steps, coef = select_timesteps("backward", w, 64, 3, gen, progress=0.5)  # k_p = 3 + floor(0.5 * 8) = 7
    assert steps.shape == (64, 7) and torch.equal(coef, torch.ones(64, 7))
    for row in steps:
        assert sorted(row.tolist()) == list(range(3, 10))
    assert len({tuple(r.tolist()) for r in steps}) > 1  # the order is drawn per trajectory


# ----------------------------------------------------------------------------- branch sampling


def test_branches_share_their_prefix_bit_for_bit_and_it_is_the_group_seeds_own_sample(tiny, small_settings):
    prompts, seeds = ["a red circle"] * 3 + ["a blue square"] * 3, [11, 12, 13, 21, 22, 23]
    step = 2
    b = sample_branched(tiny, prompts, seeds, small_settings, 0, list(range(6)), step, 3)
    for g in (0, 3):
        for r in (g + 1, g + 2):
            assert torch.equal(b.latents[r, : step + 1], b.latents[g, : step + 1])  # bit for bit
            assert torch.equal(b.log_probs[r, :step], b.log_probs[g, :step])
            assert not torch.allclose(b.latents[r, step + 1], b.latents[g, step + 1])  # each branch its own noise
    # the prefix is what an ordinary sample of the group's first seed does in its first steps
    for g in (0, 3):
        plain = sample_trajectories(tiny, [prompts[g]], [seeds[g]], small_settings, 0, [0])
        torch.testing.assert_close(b.latents[g, : step + 1], plain.latents[0, : step + 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.log_probs[g, :step], plain.log_probs[0, :step], atol=1e-5, rtol=1e-5)
    # a row is reproducible whatever else is in the batch (its noise comes from its own seeds)
    alone = sample_branched(tiny, prompts[3:], seeds[3:], small_settings, 0, [3, 4, 5], step, 3)
    torch.testing.assert_close(alone.latents, b.latents[3:], atol=1e-5, rtol=1e-5)
    assert branch_seed(seeds[4], 0, step, 0) != seeds[4]  # the continuation does not replay the seed's initial noise


def test_branch_log_probs_are_the_policys_own(tiny, small_settings):
    """Every recorded log-prob, in the prefix and after the branch, equals the learner's recomputation."""
    learner = PolicyLearner(tiny, UpdateSettings(eta=small_settings.eta, guidance_scale=small_settings.guidance_scale), seed=0)
    b = sample_branched(tiny, ["a red circle"] * 2 + ["a blue square"] * 2, [1, 2, 3, 4], small_settings, 0, [0, 1, 2, 3], 3, 2,
                        learner.negative_embeds)
    torch.testing.assert_close(learner.recompute_log_probs(b), b.log_probs, atol=2e-4, rtol=1e-4)


def test_branch_sampling_refuses_bad_groups(tiny, small_settings):
    with pytest.raises(ValueError, match="share its prompt"):
        sample_branched(tiny, ["a", "b", "c", "c"], [1, 2, 3, 4], small_settings, 0, [0, 1, 2, 3], 1, 2)
    with pytest.raises(ValueError, match="branch_step must be in 0..5"):
        sample_branched(tiny, ["a", "a"], [1, 2], small_settings, 0, [0, 1], 6, 2)
    with pytest.raises(ValueError, match="group_size >= 2 dividing"):
        sample_branched(tiny, ["a"] * 3, [1, 2, 3], small_settings, 0, [0, 1, 2], 1, 2)


# ----------------------------------------------------------------------------- the branch extremes


def test_branch_extremes_keep_each_groups_best_and_worst_past_the_thresholds():
    ids = [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # groups of 2: (8,9) (10,11) ...
    adv = [1.0, -1.0, 0.2, 0.1, 0.6, -0.4, -0.2, -0.9, 0.5, 0.5]
    # (8,9): both; (10,11): neither; (12,13): best only; (14,15): worst only; (16,17): tie -> the first
    assert branch_extremes(ids, adv, 2, 0.5, -0.5) == [0, 1, 4, 7, 8]
    # a group short of a row (a dropped reward) still gives its extremes; groups are by id, not position
    assert branch_extremes([9, 13, 12], [0.7, -0.8, 0.0], 2, 0.5, -0.5) == [0, 1]
    # one row both best and worst is kept once at most (thresholds are ordered)
    assert branch_extremes([4], [3.0], 4, 0.5, -0.5) == [0]


def test_an_update_without_rows_advances_the_version_and_trains_nothing(tiny, small_settings):
    learner = PolicyLearner(tiny, UpdateSettings(algorithm="b2diffurl", timestep_selection="backward"), seed=0)
    b = sample_trajectories(tiny, ["a red circle"], [0], small_settings, 0, [0])
    b.advantages = torch.zeros(1)
    before = {k: v.clone() for k, v in learner.lora_state().items()}
    out = learner.update(b.select([]))
    assert out["learner_passes"] == 0 and out["optimizer_steps"] == 0 and learner.version == 1
    assert all(torch.equal(before[k], v) for k, v in learner.lora_state().items())


# ----------------------------------------------------------------------------- the run


def test_a_b2diffurl_run_branches_and_trains_exactly_the_scheduled_segment(monkeypatch):
    """Four epochs of 6 steps, first stage 2 steps: the samplers branch at 6 - k_e and the learner's
    UNet is called at exactly the scheduler's last k_e timesteps, for exactly the kept rows."""
    cfg = load_config("tiny", overrides=[*TINY, *B2, "sample.num_steps=6", "sample.batch_size=4", "sample.batches_per_epoch=2",
                                         "train.batch_size=4", "train.epochs=4", "train.timestep_fraction=0.34"])
    assert num_trained_steps(6, 0.34) == 2
    ks = [2 + e * 5 // 4 for e in range(4)]  # 2, 3, 4, 5
    assert [branch_step(cfg, e) for e in range(4)] == [6 - k for k in ks]
    calls, epochs = [], []
    real_step = PolicyLearner.step

    def spy(self, latents, timesteps, next_latents, prompt_embeds):
        calls[-1].append(timesteps.clone())
        return real_step(self, latents, timesteps, next_latents, prompt_embeds)

    real_update = PolicyLearner.update

    def update(self, batch, shard=None):
        calls.append([])
        return real_update(self, batch, shard)

    monkeypatch.setattr(PolicyLearner, "step", spy)
    monkeypatch.setattr(PolicyLearner, "update", update)
    recs = run_reference(cfg, progress=False, on_epoch=lambda e, batch, learner: epochs.append(batch))
    timesteps = epochs[0].timesteps[0]
    for e, (rec, batch, k) in enumerate(zip(recs, epochs, ks)):
        s = 6 - k
        for g in range(0, len(batch), 2):  # every group shares exactly its first s steps
            assert torch.equal(batch.latents[g, : s + 1], batch.latents[g + 1, : s + 1])
            assert not torch.equal(batch.latents[g, s + 1], batch.latents[g + 1, s + 1])
        kept = branch_extremes(batch.sample_ids, batch.advantages, 2, 0.5, -0.5)
        assert rec["samples"] == 8 and rec["samples_trained"] == len(kept) and rec["steps_trained"] == (k if kept else 0)
        assert rec["learner_passes"] == len(kept) * k and rec["reward_queries"] == 8 * (e + 1)
        trained = torch.cat(calls[e]) if calls[e] else torch.empty(0, dtype=torch.long)
        assert sorted(trained.unique().tolist()) == (sorted(timesteps[s:].tolist()) if kept else [])
        assert len(trained) == len(kept) * k  # each kept row once at each of its k steps


def test_plans_and_rows_follow_the_algorithm():
    ddpo = load_config("tiny", overrides=TINY)
    assert plan_for(ddpo, ["x", "y"], 0, 0).branch_step is None and train_rows(ddpo) is None
    cfg = load_config("tiny", overrides=[*TINY, *B2, "train.timestep_fraction=0.7", "train.epochs=10"])
    plan = plan_for(cfg, ["x", "y", "z"], 3, 1)
    assert plan.branch_step == 20 - (14 + 3 * 7 // 10) and plan.group_size == 2
    assert plan.prompts == plan_batch(["x", "y", "z"], cfg.run.seed, 3, 1, cfg.sample.batch_size, cfg.sample.batches_per_epoch, 2).prompts
    assert plan.sample_ids[0] % 2 == 0  # groups by id // group size


def test_sample_plan_dispatches_on_the_plan(tiny, small_settings):
    plain = plan_batch(["a red circle"], 0, 0, 0, 2, 1)
    branched = plan_batch(["a red circle"], 0, 0, 0, 2, 1, samples_per_prompt=2, branch_step=3)
    a = sample_plan(tiny, plain, small_settings, 0)
    b = sample_plan(tiny, branched, small_settings, 0)
    assert not torch.equal(a.latents[0, 0], a.latents[1, 0])  # independent samples
    assert torch.equal(b.latents[0, :4], b.latents[1, :4]) and not torch.equal(b.latents[0, 4], b.latents[1, 4])


def test_config_refuses_what_b2diffurl_cannot_run():
    with pytest.raises(ConfigError, match="samples_per_prompt"):
        load_config("tiny", overrides=[*TINY, "algorithm.name=b2diffurl", "sample.samples_per_prompt=1"])
    with pytest.raises(ConfigError, match="must be 'backward'"):
        load_config("tiny", overrides=[*TINY, "algorithm.name=b2diffurl", "train.timestep_selection=random"])
    with pytest.raises(ConfigError, match="b2_neg_threshold"):
        load_config("tiny", overrides=[*TINY, *B2, "algorithm.b2_neg_threshold=0.6"])
    # backward progressive training alone (no branching) is a valid ablation
    assert branch_step(load_config("tiny", overrides=[*TINY, "train.timestep_selection=backward"]), 0) is None


def test_b2diffurl_alone_brings_its_defaults_as_their_own_layer():
    """algorithm.name=b2diffurl alone loads (its defaults: 4 branches, backward from 0.7, group
    advantages), a preset, file or override still wins over them, and `config show` names the layer."""
    from diffrlhf.deploy.config import resolve_config

    cfg, sources = resolve_config("tiny", None, ["algorithm.name=b2diffurl"])
    assert (cfg.sample.samples_per_prompt, cfg.train.timestep_selection, cfg.train.timestep_fraction, cfg.advantage.mode) == \
        (4, "backward", 0.7, "group")
    assert {sources[k] for k in ("sample.samples_per_prompt", "train.timestep_selection", "advantage.mode")} == {"algorithm b2diffurl"}
    cfg, sources = resolve_config("tiny", None, ["algorithm.name=b2diffurl", "sample.samples_per_prompt=2"])
    assert cfg.sample.samples_per_prompt == 2 and sources["sample.samples_per_prompt"] == "override"
    assert resolve_config("tiny", None, [])[0].sample.samples_per_prompt == 1  # ddpo brings none
