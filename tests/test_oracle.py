"""The `oracle` timestep weighting: the measured per-step variance as w(t), its probe and its cost.

The profile is checked against processes whose per-step variances are known in closed form, the
probe's reward queries against their exact count, and the weights the learner trains with against
an independent repetition of the probe on the same policy.
"""
import numpy as np
import pytest
import torch

from diffrlhf.actors import oracle
from diffrlhf.actors.reference_loop import run_reference
from diffrlhf.actors.settings import build_policy, reward_server, sampling_settings
from diffrlhf.deploy.config import ConfigError, load_config
from diffrlhf.learner.lora import load_lora_state_dict
from diffrlhf.learner.update import PolicyLearner
from diffrlhf.learner.weighting import normalise_mean_one, oracle_profile, timestep_weights
from diffrlhf.policy.branching import branch_seed, branch_trajectories
from diffrlhf.policy.prompts import load_prompts
from diffrlhf.policy.sampler import sample_trajectories

TINY = ["model.name=tiny-random", "model.device=cpu", "sample.resolution=32", "sample.num_steps=4", "sample.batch_size=4",
        "sample.batches_per_epoch=1", "train.batch_size=4", "run.image_grid_every=0", "run.tensorboard=false",
        "prompts.train=simple_animals", "weighting.scheme=oracle", "weighting.oracle_trajectories=3", "weighting.oracle_branches=2"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def additive_grid(step_std, p=4000, m=6, seed=0):
    """R = sum_i x_i, x_i ~ N(0, s_i^2) independent; level k's branches share x_0..x_{k-1} and redraw
    the rest, so E[Var(R | after k steps)] = sum_{i >= k} s_i^2 and step i's share is s_i^2."""
    rng = np.random.default_rng(seed)
    s = np.asarray(step_std, np.float64)
    t = len(s)
    shared = rng.normal(size=(p, 1, 1, t)) * s
    fresh = rng.normal(size=(p, t, m, t)) * s
    keep = (np.arange(t)[None, :] < np.arange(t)[:, None])[None, :, None, :]  # [1, level k, 1, step i]: i < k shared
    return np.where(keep, shared, fresh).sum(-1)


def test_the_profile_is_each_steps_share_of_the_reward_variance():
    s = np.array([2.0, 1.0, 0.5, 0.0, 1.5])
    got = oracle_profile(additive_grid(s)).numpy()
    np.testing.assert_allclose(got, s**2, atol=0.12)  # s.e. of each share ~ 0.05 at P = 4000, M = 6
    w = timestep_weights("oracle", torch.zeros(1, 6, 1), torch.arange(5), profile=oracle_profile(additive_grid(s)))
    assert w.sum().item() == pytest.approx(5.0) and w.argmax().item() == 0 and w[3] < 0.1


def test_negative_shares_are_zero_weight_and_a_flat_probe_is_an_error():
    grid = additive_grid([1.0, 0.0, 0.0], p=50, m=2, seed=1)
    assert (oracle_profile(grid) >= 0).all()
    with pytest.raises(ValueError, match="no positive per-step variance"):
        oracle_profile(np.ones((3, 4, 2)))
    with pytest.raises(ValueError, match="needs the measured per-step variance profile"):
        timestep_weights("oracle", torch.zeros(1, 5, 1), torch.arange(4))


def test_the_probe_counts_its_queries_and_the_learner_trains_with_its_profile(monkeypatch):
    """Two rounds (before update 0 and after update 1) on the tiny model: every probe image is a
    counted query with an id below 0, and the weights of each update are the profile an independent
    repetition of the probe measures on the same policy."""
    cfg = load_config("tiny", overrides=[*TINY, "train.epochs=3", "weighting.oracle_every=2"])
    assert oracle.probe_rounds(cfg) == [0, 2]
    used, scored_ids, states = [], [], []
    real_update, real_score = PolicyLearner.update, type(reward_server(cfg)).score

    def update(self, batch, shard=None):
        states.append({k: v.clone() for k, v in self.lora_state().items()})
        out = real_update(self, batch, shard)
        used.append(torch.tensor(out["timestep_weights"]))
        return out

    def score(self, ids, images, prompts):
        scored_ids.extend(ids)
        return real_score(self, ids, images, prompts)

    monkeypatch.setattr(PolicyLearner, "update", update)
    monkeypatch.setattr(type(reward_server(cfg)), "score", score)
    recs = run_reference(cfg, progress=False)
    probe = 3 * 4 * 2  # P x T x M per round
    assert [r["reward_queries"] for r in recs] == [probe + 4, probe + 8 + probe, 2 * probe + 12]
    probe_ids = [i for i in scored_ids if i < 0]
    assert len(probe_ids) == len(set(probe_ids)) == 2 * probe and len(scored_ids) == 2 * probe + 12
    monkeypatch.undo()

    # the same probe again, by hand, on the policy before update 0 and before update 2
    for round_, state, w in ((0, states[0], used[0]), (2, states[2], used[2])):
        comps, learner = build_policy(cfg)
        load_lora_state_dict(comps.unet, state)
        settings, server = sampling_settings(cfg), reward_server(cfg)
        prompts, seeds, ids = oracle.probe_plan(cfg, load_prompts(cfg.prompts.train), round_)
        rec = sample_trajectories(comps, prompts, seeds, settings, 0, ids, learner.negative_embeds)
        grid = np.zeros((3, 4, 2))
        for k in range(4):
            out = branch_trajectories(comps, rec, k, 2, [branch_seed(s, i, k, b) for i, s in enumerate(seeds) for b in range(2)],
                                      settings, learner.negative_embeds)
            grid[:, k, :] = server.score(list(range(6)), out.images.numpy(), out.prompts).rewards.reshape(3, 2)
        v = grid.var(axis=2, ddof=1).mean(axis=0)  # E[Var(R | after k steps)]
        shares = np.clip(v - np.append(v[1:], 0.0), 0, None)
        torch.testing.assert_close(w, normalise_mean_one(torch.from_numpy(shares)), atol=2e-4, rtol=1e-3)
    assert not torch.allclose(used[0], used[2])  # re-measured on the trained policy
    assert torch.allclose(used[0], used[1])  # and kept between rounds


def test_the_profile_survives_a_checkpoint(tiny_folder):
    from diffrlhf.learner.update import UpdateSettings
    from diffrlhf.policy.models import load_components

    a = PolicyLearner(load_components(str(tiny_folder)), UpdateSettings(weighting="oracle"), seed=0)
    a.set_timestep_profile([0.5, 0.0, 2.0])
    b = PolicyLearner(load_components(str(tiny_folder)), UpdateSettings(weighting="oracle"), seed=0)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.timestep_profile, a.timestep_profile)


def test_probe_settings_are_checked():
    with pytest.raises(ConfigError, match="weighting.oracle_branches"):
        load_config("tiny", overrides=[*TINY, "weighting.oracle_branches=1"])
    with pytest.raises(ConfigError, match="weighting.oracle_trajectories"):
        load_config("tiny", overrides=[*TINY, "weighting.oracle_trajectories=1"])


@pytest.mark.integration  # a whole benchmark or command run: the default tier, not -m quick
def test_the_study_recomputes_the_profile_a_finished_oracle_run_trained_with(monkeypatch):
    """research/bench/closeness reads a saved study run and recomputes its round-0 probe: the profile must
    be the one the run's learner was given (same prompts, noise, policy and reward), not a fresh measurement."""
    from research.bench import closeness, study

    cfg = study.make_config("tiny", "tinyworld_alignment", 1, [], ("oracle", "none"), seed=3)
    given = []
    real_set = PolicyLearner.set_timestep_profile
    monkeypatch.setattr(PolicyLearner, "set_timestep_profile", lambda self, p: (given.append(p.clone()), real_set(self, p))[1])
    run_reference(cfg, progress=False)
    saved = {"seed": 3, "axes": ["oracle", "none"], "reward": "tinyworld_alignment", "config": study.identity(cfg)}
    assert len(given) == 1
    torch.testing.assert_close(torch.as_tensor(closeness.oracle_probe_profile(saved)), given[0], rtol=0, atol=1e-6)
    other = study.make_config("tiny", "tinyworld_alignment", 1, [], ("oracle", "none"), seed=4)
    assert closeness.config_of({**saved, "seed": 4}).run.seed == other.run.seed == 4
    with pytest.raises(SystemExit, match="other config overrides than these"):  # a run the study did not make
        closeness.config_of({**saved, "config": study.identity(load_config("tiny", overrides=[*TINY, "train.lr=0.5"]))})
    group = ["advantage.mode=group", "sample.samples_per_prompt=2"]  # a study made with overrides: recomputed with them
    grouped = study.make_config("tiny", "tinyworld_alignment", 1, group, ("oracle", "none"), seed=3)
    assert closeness.config_of({**saved, "config": study.identity(grouped)}, group).advantage.mode == "group"
