"""Sampling, recomputation, the update's direction, LoRA export, on the tiny random model."""
import torch

from diffrlhf.policy.sampler import sample_trajectories
from diffrlhf.buffer.trajectory import TrajectoryBatch
from diffrlhf.learner.update import PolicyLearner, UpdateSettings


def make(tiny, settings, n=4, **kw):
    s = UpdateSettings(eta=settings.eta, guidance_scale=settings.guidance_scale, **kw)
    learner = PolicyLearner(tiny, s, lora_rank=4, seed=0)
    batch = sample_trajectories(tiny, ["a red circle", "a blue square"] * (n // 2), list(range(n)), settings, 0,
                                list(range(n)), learner.negative_embeds)
    return learner, batch


def test_trajectory_shapes_and_arrow_round_trip(tiny, small_settings, tmp_path):
    _, batch = make(tiny, small_settings)
    assert batch.latents.shape == (4, 7, 4, 4, 4) and batch.log_probs.shape == (4, 6)
    assert batch.images.dtype == torch.uint8 and batch.images.shape == (4, 32, 32, 3)
    assert torch.isfinite(batch.log_probs).all()
    batch.rewards[1] = 2.5
    again = TrajectoryBatch.from_ipc_bytes(batch.to_ipc_bytes())
    assert again.equals(batch) and again.meta == small_settings.meta()
    batch.save(tmp_path / "b.arrow")
    assert TrajectoryBatch.load(tmp_path / "b.arrow").equals(batch)
    changed = again.with_(rewards=again.rewards + 1)
    assert not changed.equals(batch)


def test_same_seed_same_trajectory_whatever_the_batch(tiny, small_settings):
    learner, batch = make(tiny, small_settings)
    one = sample_trajectories(tiny, ["a blue square"], [3], small_settings, 0, [3], learner.negative_embeds)
    torch.testing.assert_close(one.latents[0], batch.latents[3], atol=1e-5, rtol=1e-5)


def test_recomputing_recorded_transitions_gives_ratio_one(tiny, small_settings):
    learner, batch = make(tiny, small_settings)
    again = learner.recompute_log_probs(batch)
    assert (torch.exp(again - batch.log_probs) - 1).abs().max() < 1e-6


def test_one_update_moves_log_probs_with_the_advantage(tiny, small_settings):
    learner, batch = make(tiny, small_settings, lr=3e-3, clip_range=None, max_grad_norm=1e9, batch_size=4)
    batch.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    before = learner.recompute_log_probs(batch)
    stats = learner.update(batch)
    after = learner.recompute_log_probs(batch)
    delta = (after - before).mean(dim=1)
    assert (delta[[0, 2]] > 0).all(), delta
    assert (delta[[1, 3]] < 0).all(), delta
    assert learner.version == 1 and stats["optimizer_steps"] == 1


def test_recompute_mode_makes_replayed_ratio_start_at_one(tiny, small_settings):
    learner, batch = make(tiny, small_settings, lr=1e-2, clip_range=1e-4, batch_size=4)
    batch.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    learner.update(batch)  # the policy moves: the batch is now off-policy
    batch.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    learner.s.logprob_mode = "recorded"
    state = learner.state_dict()
    state = {k: (v if k != "optimizer" else learner.optimizer.state_dict()) for k, v in state.items()}
    batch.replayed = torch.ones(4, dtype=torch.bool)
    rec = learner.update(batch)
    learner.load_state_dict(state)
    learner.s.logprob_mode = "recompute"
    recomp = learner.update(batch)
    assert rec["clipfrac_replay"] > recomp["clipfrac_replay"]


def test_timestep_fraction_and_accumulation_count_steps(tiny, small_settings):
    learner, batch = make(tiny, small_settings, n=4, batch_size=2, grad_accum_steps=1, timestep_fraction=0.5)
    batch.advantages = torch.ones(4)
    stats = learner.update(batch)
    assert stats["optimizer_steps"] == 2  # 2 chunks, one step each after 3 trained timesteps
    learner.s.grad_accum_steps = 4  # more than there are chunks: the remainder is flushed once
    stats = learner.update(batch)
    assert stats["optimizer_steps"] == 1


def test_saved_lora_loads_into_stock_pipeline_and_changes_output(tiny, tiny_folder, small_settings, tmp_path):
    from diffusers import StableDiffusionPipeline

    from diffrlhf.learner.lora import save_lora

    learner, batch = make(tiny, small_settings, lr=5e-2, clip_range=None)
    batch.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    learner.update(batch)
    folder = save_lora(tiny.unet, tmp_path / "lora")
    assert (folder / "pytorch_lora_weights.safetensors").exists()
    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_folder), safety_checker=None)
    pipe.set_progress_bar_config(disable=True)

    def run():
        return pipe("a red circle", num_inference_steps=4, height=32, width=32, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    base = run()
    pipe.load_lora_weights(str(folder))
    tuned = run()
    assert abs(base - tuned).max() > 1e-3
    # the loaded adapter is ours: the pipeline's UNet now predicts what the learner's UNet predicts
    x = torch.randn(1, 4, 4, 4)
    e = torch.randn(1, 77, 32)
    with torch.no_grad():
        torch.testing.assert_close(pipe.unet(x, 500, e).sample, tiny.unet(x, 500, e).sample, atol=1e-5, rtol=1e-4)


def test_reference_loop_runs_a_few_epochs_with_hardmined_replay(tiny_folder):
    from diffrlhf.deploy.config import load_config
    from diffrlhf.actors.reference_loop import run_reference

    cfg = load_config("tiny", overrides=[f"model.name={tiny_folder}", "sample.num_steps=3", "sample.resolution=32",
                                         "sample.batch_size=4", "sample.batches_per_epoch=2", "train.batch_size=4",
                                         "train.epochs=3", "prompts.train=simple_animals", "replay.mode=hardmine",
                                         "weighting.scheme=latent_sq", "replay.k=2"])
    records = run_reference(cfg, progress=False)
    assert [r["reward_queries"] for r in records] == [8, 16, 24]
    assert [r["num_replayed"] for r in records] == [0, 2, 2]  # hard-mined replay from the second epoch on
    assert all(r["reward_mean"] < 0 for r in records)  # JPEG compressibility is a negated size
