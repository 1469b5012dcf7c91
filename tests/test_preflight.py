"""Bad run inputs fail before anything starts (no run folder, no Ray, no driver), naming the config
key and the fix; inputs that run but not as written are warned about once."""
import textwrap

import pytest

from diffrlhf.deploy.config import load_config
from diffrlhf.deploy.preflight import InputError, check_run_inputs, long_prompts


@pytest.fixture
def no_start(monkeypatch, tmp_path):
    """Offline, empty weight caches; Ray and the driver fail the test if anything reaches them."""
    import diffrlhf.actors.driver as driver

    def started(*a, **k):
        raise AssertionError("the run started despite bad input")

    monkeypatch.setattr(driver, "Driver", started)
    monkeypatch.setattr(driver, "init_ray", started)
    for var, sub in [("HOME", "home"), ("HF_HOME", "hf"), ("HF_HUB_CACHE", "hf/hub"), ("DIFFRLHF_CACHE", "dcache")]:
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HPS_ROOT", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "my_bad_reward.py").write_text(textwrap.dedent("""
        import numpy as np

        def one_arg(images):
            return images

        def strings(images, prompts):
            return ["good"] * len(images)

        def numeric_strings(images, prompts):
            return ["1.5"] * len(images)

        def one_short(images, prompts):
            return np.zeros(len(images) - 1)

        def nans(images, prompts):
            return np.full(len(images), np.nan)

        def half_nans(images, prompts):
            return np.where(np.arange(len(images)) % 2, np.nan, 1.0)

        def raises(images, prompts):
            raise KeyError("score")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "empty.txt").write_text("\n  \n")
    return tmp_path


@pytest.mark.parametrize("override, words", [
    ("reward.spec=nonsense", ["reward.spec=nonsense", "unknown reward", "jpeg_compressibility"]),
    ("reward.spec=no_such_module:score", ["reward.spec=no_such_module:score", "cannot import module", "PYTHONPATH"]),
    ("reward.spec=my_bad_reward:one_arg", ["reward.spec=my_bad_reward:one_arg", "(images, prompts)"]),
    ("reward.spec={name: jpeg_compressibility, qualty: 90}", ["reward.spec=", "'qualty'", "it takes: quality"]),
    ("reward.spec={name: weighted_sum, terms: [jpeg_compressibility, {name: nope, weight: 2}]}",
     ["reward.spec=", "weighted_sum term 1", "'nope'"]),
    ("reward.spec=aesthetic", ["reward.spec=aesthetic", "sac+logos+ava1-l14-linearMSE.pth", "looked in", "dcache/aesthetic",
                               "diffrlhf fetch-weights aesthetic"]),
    ("reward.spec=imagereward", ["ImageReward.pt", "diffrlhf fetch-weights imagereward"]),
    ("reward.spec=hpsv2", ["HPS_v2.1_compressed.pt", "diffrlhf fetch-weights hpsv2"]),
    # a custom reward is called once on test images before Ray: its broken contract is named there
    ("reward.spec=my_bad_reward:strings", ["reward.spec=my_bad_reward:strings", "returned str values ('good')", "one number per image"]),
    ("reward.spec=my_bad_reward:numeric_strings", ["returned str values ('1.5')", "one number per image"]),
    ("reward.spec=my_bad_reward:one_short", ["'my_bad_reward:one_short' returned 1 values for 2 images"]),
    ("reward.spec=my_bad_reward:nans", ["'my_bad_reward:nans' returned non-finite values", "reward.nan_policy=drop"]),
    ("reward.spec=my_bad_reward:raises", ["'my_bad_reward:raises' failed on 2 test images (KeyError: 'score')"]),
    ("reward.spec={name: weighted_sum, terms: [jpeg_compressibility, my_bad_reward:strings]}", ["returned str values"]),
    # a local run this machine can never place is refused before Ray, naming the key
    ("system.sampler_gpus=1", ["system.sampler_gpus", "can never start", "0 GPU"]),
    ("prompts.train=/nonexistent.txt", ["prompts.train=/nonexistent.txt", "one prompt per line", "tiny-world-train"]),
    ("prompts.eval={tmp}/empty.txt", ["prompts.eval=", "empty.txt", "no prompts"]),
    ("model.name={tmp}/no-model", ["model.name=", "no-model", "does not exist"]),
])
def test_bad_input_fails_before_anything_starts(no_start, capsys, override, words):
    ray = pytest.importorskip("ray")
    from diffrlhf.deploy.cli import main

    ray.shutdown()
    out_dir = no_start / "runs"
    code = main(["train", override.replace("{tmp}", str(no_start)), f"run.out_dir={out_dir}", "run.name=r"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err
    for w in words:
        assert w in err, (w, err)
    assert not out_dir.exists()  # no run folder left behind
    assert not ray.is_initialized()


def test_custom_reward_on_other_nodes_is_a_warning_not_an_error(no_start, monkeypatch):
    # Served with its own runtime_env (or on a cluster), the module need not import here; names still must be right.
    cfg = load_config("tiny", overrides=["reward.spec=no_such_module:score", "reward.runtime_env={pip: [x]}"])
    warnings = check_run_inputs(cfg)
    assert any("reward.spec=no_such_module:score" in w and "runtime_env" in w for w in warnings)
    monkeypatch.setenv("RAY_ADDRESS", "ray://nowhere:10001")
    with pytest.raises(InputError, match="unknown reward 'nonsense'"):
        check_run_inputs(load_config("tiny", overrides=["reward.spec=nonsense"]))


def test_replay_k_above_the_window_is_warned(no_start):
    # tiny: 8 x 4 = 32 samples per epoch
    base = ["replay.mode=hardmine", "sample.batch_size=8", "sample.batches_per_epoch=4"]
    assert not [w for w in check_run_inputs(load_config("tiny", overrides=base + ["replay.max_epochs=2", "replay.k=64"]))
                if "replay.k" in w]
    warnings = check_run_inputs(load_config("tiny", overrides=base + ["replay.max_epochs=2", "replay.k=65"]))
    assert any("replay.k=65" in w and "= 64" in w and "replay.max_epochs" in w for w in warnings)
    none = load_config("tiny", overrides=base + ["replay.mode=none", "replay.k=1000"])
    assert not [w for w in check_run_inputs(none) if "replay.k" in w]  # no replay, nothing capped


def test_a_per_prompt_tracker_that_never_fills_is_warned(no_start):
    # tiny: 48 training captions, 8 x 4 = 32 samples an epoch: 15 epochs give a caption 10 rewards, under min_count 16
    def tracker(*extra, reward="tinyworld_alignment"):
        return [w for w in check_run_inputs(load_config("tiny", overrides=["sample.batch_size=8", "sample.batches_per_epoch=4",
                                                                            f"reward.spec={reward}", *extra])) if "advantage.min_count" in w]

    [w] = tracker("train.epochs=15")
    assert "48 prompts" in w and "about 10.0 rewards in 15 epochs" in w and "advantage.mode=group" in w
    assert tracker("train.epochs=24") == []  # 24 x 32 / 48 = 16: the tracker fills
    # a reward that ignores the prompt (the default preset's JPEG) loses nothing by batch statistics: no warning
    assert tracker("train.epochs=15", reward="jpeg_compressibility") == []
    assert tracker("train.epochs=15", reward="{name: weighted_sum, terms: [jpeg_compressibility, tinyworld_alignment]}")
    assert tracker("train.epochs=15", "advantage.min_count=10") == []
    assert tracker("train.epochs=15", "advantage.mode=group", "sample.samples_per_prompt=4") == []


def test_long_prompts_are_counted_in_clip_tokens(no_start):
    # "a" is one CLIP token: 75 of them plus start and end fill the 77 slots exactly.
    fits, over = " ".join(["a"] * 75), " ".join(["a"] * 76)
    assert long_prompts([fits, over, "short", "x" * 200]) == [over]
    (no_start / "long.txt").write_text(f"a red ball\n{over}\n{fits}\n{over} again\n")
    warnings = check_run_inputs(load_config("tiny", overrides=[f"prompts.train={no_start}/long.txt"]))
    [w] = [w for w in warnings if "77 CLIP tokens" in w]
    assert w.startswith("prompts.train:") and "2 of 4 prompts" in w and "'a a a" in w and "truncated" in w
    assert not [w for w in check_run_inputs(load_config("tiny")) if "CLIP tokens" in w]


def test_warnings_are_printed_once_at_start(no_start, capsys):
    from diffrlhf.deploy.cli import preflight

    preflight(load_config("tiny", overrides=["replay.mode=random", "replay.max_epochs=1", "replay.k=100"]))
    err = capsys.readouterr().err
    assert err.count("[diffrlhf] warning: replay.k=100") == 1


def test_a_reward_that_scores_nothing_finite_is_refused_before_ray_even_when_dropping(no_start, capsys):
    """nan_policy=drop drops occasional NaN/inf; a reward with no finite score on the preflight
    images would drop every sample, so it is refused (exit 2) instead of failing in Ray later."""
    ray = pytest.importorskip("ray")
    from diffrlhf.deploy.cli import main

    ray.shutdown()
    code = main(["train", "reward.spec=my_bad_reward:nans", "reward.nan_policy=drop", f"run.out_dir={no_start}/runs"])
    err = capsys.readouterr().err
    assert code == 2 and "scored nothing finite on the 2 test images" in err and "drop every sample" in err
    assert not ray.is_initialized() and not (no_start / "runs").exists()
    warnings = check_run_inputs(load_config("tiny", overrides=["reward.spec=my_bad_reward:half_nans", "reward.nan_policy=drop"]))
    assert any("returned non-finite values [1.0, nan]" in w for w in warnings)  # some finite: a warning


def test_a_bad_config_file_is_one_line_naming_the_file(no_start, capsys):
    from diffrlhf.deploy.cli import main

    code = main(["train", "--config", str(no_start)])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"error: config file {no_start} is a directory; give a YAML file (config sections, e.g. train: {{lr: 0.001}})"
    bad = no_start / "bad.yaml"
    bad.write_text("train:\n  lr: 0.1\n  epochs: [1, 2\n")
    code = main(["train", "--config", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: config file {bad}:4:1: not valid YAML: ") and len(err.splitlines()) == 1, err
    assert "<unicode string>" not in err


def test_a_missing_weight_file_names_each_folder_once(no_start):
    """Each folder searched once (the file's URL-quoted name is the same place), not every path:
    the aesthetic message was 805 characters listing six paths in three folders."""
    with pytest.raises(InputError) as e:
        check_run_inputs(load_config("tiny", overrides=["reward.spec=aesthetic"]))
    msg = str(e.value).replace(str(no_start), "T")  # the sandbox's long temporary paths, shortened
    assert "%2B" not in msg and len(msg) < 480, (len(msg), msg)
    assert "looked in T/home/.cache/ImageReward, T/home/.cache/aesthetic, T/dcache/aesthetic and" in msg
    assert "the Hugging Face cache (camenduru/improved-aesthetic-predictor; HF_HOME)" in msg
