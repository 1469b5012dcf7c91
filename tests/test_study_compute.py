"""The study's `compute` suite: runs with a timestep selection get their own folders, learner passes
and wall-clock are axes beside reward queries, and runs saved before the selection existed stay
reusable (the new key at its default is the old behaviour)."""
import json
from pathlib import Path

import numpy as np
import pytest

from research.bench import study


@pytest.mark.integration  # a whole benchmark or command run: the default tier, not -m quick
def test_compute_suite_counts_passes_and_reaches_on_every_axis(tmp_path, keep_torch_threads):
    args = ["--size", "tiny", "--out", str(tmp_path), "--threads", "1", "--suite", "compute", "--only", "ddpo", "method weighted 0.25"]
    study.main(args)
    ddpo = json.loads((tmp_path / "runs/jpeg_compressibility/uniform__none/seed0.json").read_text())
    weighted = json.loads((tmp_path / "runs/jpeg_compressibility/ddim_std__none__weighted0.25/seed0.json").read_text())
    assert weighted["axes"] == ["ddim_std", "none", "weighted", 0.25] and ddpo["axes"] == ["uniform", "none"]
    # tiny: 3 DDIM steps, 4 samples per epoch; 0.25 of 3 steps rounds to 1 trained step
    assert [r["learner_passes"] for r in ddpo["records"]] == [12, 12] and [r["learner_passes"] for r in weighted["records"]] == [4, 4]
    assert [r["learner_passes_total"] for r in weighted["records"]] == [4, 8]
    # Runs saved before the learner counted passes get the same number from their config.
    for run in (ddpo, weighted):
        old = {**run, "records": [{k: v for k, v in r.items() if not k.startswith("learner_")} for r in run["records"]]}
        np.testing.assert_array_equal(study.learner_passes(old), study.learner_passes(run))
    summary = json.loads((tmp_path / "compute_jpeg_compressibility.json").read_text())
    rows = {r["variant"]: r for r in summary["rows"]}
    assert rows["ddpo"]["passes_per_epoch"] == 12 and rows["method weighted 0.25"]["passes_per_epoch"] == 4
    assert rows["ddpo random 0.5"]["seeds"] == 0
    md = (tmp_path / "compute_jpeg_compressibility.md").read_text()
    assert "learner passes / epoch | passes to reach (ratio) | wall-clock s to reach (ratio)" in md
    assert (tmp_path / "compute_jpeg_compressibility.png").stat().st_size > 0


def test_cost_to_reach_reads_each_axis_at_the_first_epoch_that_reaches():
    base = {"queries": np.array([8.0, 16, 24, 32]), "passes": np.array([80.0, 160, 240, 320])}
    var = {"queries": np.array([8.0, 16, 24, 32]), "passes": np.array([20.0, 40, 60, 80])}
    base_y = np.array([0.0, 0.0, 0.0, 0.3])  # smoothed final 0.1, first reached at the last epoch
    var_y = np.array([0.0, 0.3, 0.3, 0.3])  # smoothed 0, 0.15, 0.2, 0.3: reached at epoch 1
    out = study.cost_to_reach(base, base_y, var, var_y)
    held = {"held_variant": 16.0, "held_ratio": 2.0}  # it does not fall back after it reaches
    assert out["queries"] == {"baseline": 32.0, "variant": 16.0, "ratio": 2.0, **held}
    assert out["passes"] == {"baseline": 320.0, "variant": 40.0, "ratio": 8.0, "held_variant": 40.0, "held_ratio": 8.0}
    never = study.cost_to_reach(base, base_y, var, np.zeros(4))
    assert never["passes"]["ratio"] is None and never["passes"]["ratio_upper_bound"] == 4.0
    assert study.cost_to_reach(base, np.zeros(4), var, var_y) == {}  # a baseline that did not improve sets no bar


def test_cost_to_reach_held_waits_until_a_curve_stays_above_the_target():
    """A variant that crosses the target early and falls back: the first crossing reads cheap,
    the held read waits for the epoch from which it stays there, or says it never does."""
    q = np.arange(1.0, 7.0) * 8
    base, var = {"queries": q}, {"queries": q}
    base_y = np.array([0.0, 0.6, 0.6, 0.0, 0.0, 0.6])  # smoothed 0, .3, .4, .4, .2, .2: target 0.2, first crossing epoch 1
    spike = np.array([0.0, 1.2, 0.0, 0.0, 0.0, 1.2])  # smoothed 0, .6, .4, .4, 0, .4: reaches at 1, dips at 4, back at 5
    out = study.cost_to_reach(base, base_y, var, spike)["queries"]
    assert (out["baseline"], out["variant"], out["ratio"]) == (16.0, 16.0, 1.0)
    assert (out["held_variant"], out["held_ratio"]) == (48.0, 16.0 / 48.0)  # against the baseline's first crossing
    falls = study.cost_to_reach(base, base_y, var, np.array([0.0, 1.2, 1.2, 0.0, 0.0, 0.0]))["queries"]
    assert falls["variant"] == 16.0 and falls["held_variant"] is None and falls["held_ratio"] is None
    assert study.held_from(np.ones(3), 1.0) == 0 and study.held_from(np.array([1.0, 1.0, 0.0]), 0.9, window=1) is None


def test_runs_saved_before_the_selection_key_stay_reusable(tmp_path):
    cfg = study.make_config("full", "jpeg_compressibility", 2, [])
    saved = {"config": study.identity(cfg)}
    del saved["config"]["train"]["timestep_selection"]  # as the committed runs were saved
    study.check_reusable(tmp_path / "run.json", saved, cfg)
    other = study.make_config("full", "jpeg_compressibility", 2, [], ("uniform", "none", "weighted", 1.0))
    with pytest.raises(SystemExit, match="train.timestep_selection: 'random' -> 'weighted'"):
        study.check_reusable(tmp_path / "run.json", saved, other)
    assert study.run_path(tmp_path, "r", ("uniform", "none"), 0) == study.run_path(tmp_path, "r", ("uniform", "none", "random", 1.0), 0)
    assert study.run_path(tmp_path, "r", ("ddim_std", "none", "top", 0.25), 3).parent.name == "ddim_std__none__top0.25"


def test_baseline_variants_carry_their_algorithm_and_keep_the_query_budget():
    """The `baselines` suite's 5th axis names a set of overrides: it shows in the run's folder and
    config, and every variant samples the same 32 images an epoch (branches and group samples too)."""
    paths = {label: study.run_path(Path("o"), "r", axes, 0).parent.name for label, axes in study.SUITES["baselines"].items()}
    assert paths == {"ddpo": "uniform__none", "dpok": "uniform__none__dpok", "b2diffurl": "uniform__none__backward0.7__b2diffurl",
                     "grpo": "uniform__none__grpo", "method": "ddim_std__none", "method top 0.25": "ddim_std__none__top0.25"}
    cfgs = {label: study.make_config("full", "jpeg_compressibility", 15, [], axes) for label, axes in study.SUITES["baselines"].items()}
    assert {c.sample.batch_size * c.sample.batches_per_epoch for c in cfgs.values()} == {32}
    assert cfgs["dpok"].algorithm.name == "dpok" and cfgs["grpo"].advantage.mode == "group"
    b2 = cfgs["b2diffurl"]
    assert (b2.algorithm.name, b2.train.timestep_selection, b2.train.timestep_fraction, b2.sample.samples_per_prompt) == \
        ("b2diffurl", "backward", 0.7, 4)
    assert study.identity(cfgs["ddpo"]) == study.identity(study.make_config("full", "jpeg_compressibility", 15, []))
