import numpy as np
import pytest
import torch

from diffrlhf.buffer.advantages import AdvantageComputer, PerPromptStatTracker, group_advantages
from diffrlhf.buffer.replay import ReplayBuffer
from diffrlhf.buffer.trajectory import TrajectoryBatch


def test_tracker_matches_hand_computation():
    tr = PerPromptStatTracker(buffer_size=4, min_count=3)
    prompts = ["a", "a", "b"]
    r1 = np.array([1.0, 3.0, 10.0])
    adv = tr.update(prompts, r1)
    # fewer than min_count rewards per prompt: batch statistics
    m, s = r1.mean(), r1.std() + 1e-6
    np.testing.assert_allclose(adv, (r1 - m) / s)
    r2 = np.array([5.0, 7.0, 0.0])
    adv2 = tr.update(prompts, r2)
    hist_a = np.array([1.0, 3.0, 5.0, 7.0])  # 4 >= min_count: per-prompt statistics
    np.testing.assert_allclose(adv2[:2], (r2[:2] - hist_a.mean()) / (hist_a.std() + 1e-6))
    np.testing.assert_allclose(adv2[2], (0.0 - r2.mean()) / (r2.std() + 1e-6))  # "b" has 2 < 3
    tr.update(["a"], np.array([9.0]))
    assert list(tr.stats["a"]) == [3.0, 5.0, 7.0, 9.0]  # bounded history


def test_tracker_state_round_trip():
    tr = PerPromptStatTracker(4, 1)
    tr.update(["x", "y"], np.array([1.0, 2.0]))
    tr2 = PerPromptStatTracker()
    tr2.load_state_dict(tr.state_dict())
    np.testing.assert_array_equal(tr.update(["x"], np.array([3.0])), tr2.update(["x"], np.array([3.0])))


def test_clipping_and_modes():
    ac = AdvantageComputer("batch", clip_max=1.0)
    adv = ac(["p"] * 5, [0, 0, 0, 0, 100])
    assert adv.max() == pytest.approx(1.0) and adv.min() >= -1.0
    g = group_advantages(["a", "a", "b", "b"], np.array([1.0, 3.0, 10.0, 30.0]))
    np.testing.assert_allclose(g, [-1, 1, -1, 1], atol=1e-5)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        group_advantages(["a", "b"], np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="non-finite"):
        AdvantageComputer("batch")(["a", "b"], [1.0, float("nan")])


def fake_batch(n, epoch, adv, t=3):
    return TrajectoryBatch(
        prompts=[f"p{epoch}-{i}" for i in range(n)],
        latents=torch.randn(n, t + 1, 4, 2, 2), timesteps=torch.arange(t).repeat(n, 1),
        log_probs=torch.randn(n, t), prompt_embeds=torch.randn(n, 3, 2),
        images=torch.zeros(n, 4, 4, 3, dtype=torch.uint8), seeds=torch.arange(n),
        policy_version=torch.full((n,), epoch), sample_ids=torch.arange(n) + 100 * epoch,
        rewards=torch.zeros(n), advantages=torch.as_tensor(adv, dtype=torch.float32),
    )


def test_hardmine_is_top_k_from_allowed_epochs_only():
    buf = ReplayBuffer(max_epochs=2, mode="hardmine", k=3)
    buf.add(0, fake_batch(4, 0, [9, -9, 8, 0.1]))  # will be evicted by epoch 3
    buf.add(1, fake_batch(4, 1, [0.5, -2.0, 0.1, 3.0]))
    buf.add(2, fake_batch(4, 2, [1.0, -4.0, 0.2, 0.3]))
    buf.add(3, fake_batch(4, 3, [7, 7, 7, 7]))  # current epoch: never replayed
    assert 0 not in buf.epochs
    sel = buf.sample_hardmined(current_epoch=3)
    assert sorted(sel.advantages.abs().tolist(), reverse=True) == [4.0, 3.0, 2.0]
    assert set(sel.policy_version.tolist()) <= {1, 2}
    batch = buf.training_batch(3)
    assert len(batch) == 7 and batch.policy_version[:4].tolist() == [3] * 4
    assert batch.replayed.tolist() == [False] * 4 + [True] * 3  # the replayed rows, marked in the batch
    assert not buf.epochs[1].replayed.any() and not buf.epochs[2].replayed.any()  # the stored epochs stay fresh


def test_random_replay_and_none():
    buf = ReplayBuffer(max_epochs=1, mode="random", k=2, seed=0)
    buf.add(0, fake_batch(5, 0, np.arange(5)))
    buf.add(1, fake_batch(5, 1, np.arange(5)))
    sel = buf.sample_random(1)
    assert len(sel) == 2 and set(sel.policy_version.tolist()) == {0}
    buf.mode = "none"
    assert not buf.training_batch(1).replayed.any()


def test_memory_stays_bounded():
    buf = ReplayBuffer(max_epochs=3, mode="hardmine", k=2)
    for e in range(50):
        buf.add(e, fake_batch(6, e, np.random.randn(6)))
        assert len(buf) <= 6 * 4 and len(buf.epochs) <= 4


def test_buffer_state_round_trip():
    buf = ReplayBuffer(2, "random", 2, seed=3)
    buf.add(0, fake_batch(3, 0, [1, 2, 3]))
    buf.add(1, fake_batch(3, 1, [1, 2, 3]))
    buf2 = ReplayBuffer()
    buf2.load_state_dict(buf.state_dict())
    assert buf2.sample_random(1).equals(buf.sample_random(1))
