"""The committed DDPO baseline band (deploy/baseline.py), the gain summary, and the curve that draws them."""
from pathlib import Path
import json
import math

import numpy as np
import pytest

from diffrlhf.deploy.baseline import BASELINES_FILE, baselines_from_runs, ddpo_band, gain_summary, summary_line
from diffrlhf.deploy.config import load_config
from diffrlhf.deploy.runlog import RunLogger


def _records(means, ses=None):
    ses = ses or [0.03] * len(means)
    return [{"epoch": i, "reward_queries": 32 * (i + 1), "reward_mean": m, "reward_se": s} for i, (m, s) in enumerate(zip(means, ses))]


def _study(tmp_path, cfg, seeds: dict, axes="uniform__none"):
    """Write fake study files: seeds = {seed: [epoch means]}, each with cfg's config as the study records it."""
    config = cfg.to_dict()
    config["model"]["device"] = "cpu"  # the study pins the device; the band must not care
    config["train"]["epochs"] = 99
    config["system"]["num_samplers"] = 7
    config["weighting"]["scheme"] = "uniform"
    config["model"]["weights_sha256"] = "0123456789abcdef"
    folder = tmp_path / "study" / "runs" / "jpeg_compressibility" / axes
    folder.mkdir(parents=True)
    for seed, means in seeds.items():
        (folder / f"seed{seed}.json").write_text(json.dumps({"seed": seed, "config": config, "records": _records(means)}))
    return baselines_from_runs(tmp_path)


@pytest.fixture
def cfg():
    # tiny-random: no weights digest is added, so the fake files' recorded digest is compared as written
    return load_config("tiny", overrides=["model.name=tiny-random", "train.epochs=3", "weighting.scheme=ddim_std"])


def test_band_is_the_seeds_mean_min_max_per_epoch(tmp_path, cfg):
    root = _study(tmp_path, cfg, {0: [-1.9, -1.8, -1.6], 1: [-1.7, -1.8, -1.9]})
    run = cfg.to_dict()
    run["model"]["weights_sha256"] = "0123456789abcdef"
    band = ddpo_band(run, root)
    assert band["seeds"] == [0, 1] and band["study"] == "study"
    np.testing.assert_array_equal(band["queries"], [32, 64, 96])
    np.testing.assert_allclose(band["mean"], [-1.8, -1.8, -1.75])
    np.testing.assert_allclose(band["min"], [-1.9, -1.8, -1.9])
    np.testing.assert_allclose(band["max"], [-1.7, -1.8, -1.6])
    np.testing.assert_allclose(band["sd"], [math.sqrt(0.02), 0.0, math.sqrt(0.045)])
    assert "2 seeds" in band["label"] and "reference loop" in band["label"]


@pytest.mark.parametrize("override", ["train.lr=0.02", "sample.batches_per_epoch=2", "advantage.mode=batch",
                                      "reward.spec=jpeg_incompressibility", "model.lora_rank=8"])
def test_a_difference_that_matters_means_no_band(tmp_path, cfg, override):
    root = _study(tmp_path, cfg, {0: [-1.9, -1.8, -1.6]})
    other = load_config("tiny", overrides=["model.name=tiny-random", override]).to_dict()
    other["model"]["weights_sha256"] = "0123456789abcdef"
    assert ddpo_band(other, root) is None


def test_other_weights_or_a_non_ddpo_study_run_give_no_band(tmp_path, cfg):
    root = _study(tmp_path, cfg, {0: [-1.9, -1.8, -1.6]}, axes="latent_sq__none")
    run = cfg.to_dict()
    run["model"]["weights_sha256"] = "0123456789abcdef"
    assert ddpo_band(run, root) is None  # only uniform__none runs are the baseline
    root = _study(tmp_path / "b", cfg, {0: [-1.9, -1.8, -1.6]})
    assert ddpo_band({**run, "model": {**run["model"]}}, root) is not None
    run["model"]["weights_sha256"] = "fedcba9876543210"
    assert ddpo_band(run, root) is None


STUDY_RESULTS = Path(__file__).resolve().parents[1] / "research" / "results"


def committed_ddpo_seeds() -> int:
    """The study's DDPO runs on the tiny preset's reward, as committed (the study adds seeds over time)."""
    return len(list((STUDY_RESULTS / "study" / "runs" / "jpeg_compressibility" / "uniform__none").glob("seed*.json")))


def test_the_packaged_band_file_is_the_studys_runs():
    """The package carries the band as one small file; it must be what the committed runs give."""
    from research.bench.baselines import render

    assert BASELINES_FILE.read_text() == render(STUDY_RESULTS), "rerun: python -m research.bench.baselines"
    assert BASELINES_FILE.stat().st_size < 100_000


def test_the_default_preset_gets_the_committed_study_band():
    """The README's first command runs with the study's settings, so its curve shows the committed DDPO runs."""
    band = ddpo_band(load_config("tiny"))
    assert band is not None and band["study"] == "study" and len(band["seeds"]) == committed_ddpo_seeds() >= 3
    assert band["queries"][-1] >= 32 * load_config("tiny").train.epochs


def test_gain_summary_by_hand():
    recs = _records([-1.8, -1.7, -1.6, -1.5, -1.4], [0.04, 0.1, 0.03, 0.03, 0.06])
    g = gain_summary(recs)
    assert g["epochs_averaged"] == 3
    assert g["final"] == pytest.approx(-1.5) and g["gain"] == pytest.approx(0.3)
    assert g["final_se"] == pytest.approx(math.sqrt(0.03**2 + 0.03**2 + 0.06**2) / 3)
    se = math.sqrt(0.04**2 + (math.sqrt(0.0054) / 3) ** 2)
    assert g["gain_se"] == pytest.approx(se) and g["gain_in_se"] == pytest.approx(0.3 / se)
    short = gain_summary(_records([-1.8, -1.6]))  # never averages the first epoch into the final
    assert short["epochs_averaged"] == 1 and short["gain"] == pytest.approx(0.2)
    assert gain_summary(_records([-1.8])) is None


def test_summary_line_compares_like_with_like(tmp_path, cfg):
    root = _study(tmp_path, cfg, {0: [-1.9, -1.8, -1.6, -1.7, -1.5], 1: [-1.7, -1.8, -1.9, -1.8, -1.6]})
    run = cfg.to_dict()
    run["model"]["weights_sha256"] = "0123456789abcdef"
    band = ddpo_band(run, root)
    line = summary_line(_records([-1.8, -1.7, -1.6, -1.5]), band)
    # DDPO over epochs 1-3 (the run's last three): seed 0 -1.7, seed 1 -1.8333
    assert "gain +0.200" in line and "DDPO at 128 queries" in line and "-1.767 (seeds -1.833..-1.700)" in line
    assert "DDPO" not in summary_line(_records([-1.8] * 7), band)  # past the baseline's budget: no comparison


def test_curve_draws_the_band_only_when_one_matches(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr("matplotlib.axes.Axes.fill_between", lambda self, x, *a, label=None, **k: drawn.append(label))
    logger = RunLogger(tmp_path / "run", load_config("tiny"), tensorboard=False)
    for r in _records([-1.8, -1.7, -1.6, -1.5]):
        logger.log(r)
    assert logger.plot_reward_curve().exists()
    assert any(lbl and lbl.startswith(f"DDPO baseline: committed study, {committed_ddpo_seeds()} seeds") for lbl in drawn)
    drawn.clear()
    logger = RunLogger(tmp_path / "lr", load_config("tiny", overrides=["train.lr=0.02"]), tensorboard=False)
    logger.log(_records([-1.8])[0])
    logger.plot_reward_curve()
    assert drawn and not any(lbl and "DDPO" in lbl for lbl in drawn)
