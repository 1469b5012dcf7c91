"""The benchmark commands (research/bench) at --size tiny, and the study's reach computation."""
import json

import numpy as np
import pytest

from research.bench.study import queries_to_reach, smooth, summarise_suite, table_markdown


# ----------------------------------------------------------------------------- 'queries to reach the baseline'


def test_smooth_is_a_trailing_three_epoch_mean():
    assert smooth([3, 6, 9, 12]).tolist() == pytest.approx([3, 4.5, 6, 9])


def test_queries_to_reach_hand_computed():
    q = [10, 20, 30, 40, 50]
    base = [0, 1, 2, 3, 4]  # smoothed 0, .5, 1, 2, 3 -> target 3, first reached at the last epoch (50)
    fast = [1, 3, 5, 5, 5]  # smoothed 1, 2, 3, 4.33, 5 -> reaches 3 at epoch 2 (30 queries)
    r = queries_to_reach(q, base, q, fast)
    assert r["target"] == pytest.approx(3.0)
    assert (r["baseline_queries"], r["queries"], r["reached"]) == (50, 30, True)
    assert r["ratio"] == pytest.approx(50 / 30) and r["ratio_upper_bound"] is None
    assert queries_to_reach(q, base, q, base)["ratio"] == pytest.approx(1.0)  # the baseline against itself


def test_queries_to_reach_uses_the_smoothed_curve_and_reports_not_reached():
    q = [10, 20, 30, 40, 50]
    base = [0, 1, 2, 3, 4]
    spike = [0, 0, 6, 0, 0]  # the raw epoch 2 is above 3, the smoothed curve (0, 0, 2, 2, 2) never is
    r = queries_to_reach(q, base, [20, 40, 60, 80, 100], spike)
    assert (r["queries"], r["reached"], r["ratio"]) == (None, False, None)
    assert r["total_queries"] == 100 and r["ratio_upper_bound"] == pytest.approx(0.5)  # ratio < 50/100


def fake_run(seed, rewards, axes=("uniform", "none"), q_per_epoch=10):
    recs = [{"reward_queries": q_per_epoch * (i + 1), "reward_mean": r} for i, r in enumerate(rewards)]
    return {"seed": seed, "axes": list(axes), "records": recs, "eval": {"reward_mean": rewards[-1]}, "wall_s": 1.0}


def test_suite_table_averages_seeds_before_reaching():
    # seed means: baseline 0, 1, 2, 3, 4 (as above); "+weighting" 1, 3, 5, 5, 5; "+hardmine" never gets there
    runs = {"baseline": [fake_run(0, [0, 0, 2, 2, 4]), fake_run(1, [0, 2, 2, 4, 4])],
            "+weighting": [fake_run(0, [0, 2, 4, 4, 4], ("latent_sq", "none")), fake_run(1, [2, 4, 6, 6, 6], ("latent_sq", "none"))],
            "+hardmine": [fake_run(0, [0, 0, 0, 0, 0], ("uniform", "hardmine"))], "+both": []}
    s = summarise_suite("ablation", "jpeg_compressibility", runs, None)
    rows = {r["variant"]: r for r in s["rows"]}
    assert rows["baseline"]["queries"] == 50 and rows["+weighting"]["queries"] == 30
    assert rows["+weighting"]["ratio"] == pytest.approx(50 / 30)
    assert rows["+hardmine"]["reached"] is False and rows["+both"]["seeds"] == 0
    md = table_markdown(s)
    assert "| +weighting | 2 | 5 |" in md and "1.67" in md and "not reached in 50" in md and "< 1.00" in md


def test_no_ratio_when_the_baseline_did_not_learn():
    # A baseline that ends below where it began would be "reached" by anything at epoch 0.
    q = np.array([10, 20, 30, 40])
    out = queries_to_reach(q, np.array([2.0, 1.9, 1.8, 1.9]), q, np.array([2.0, 2.1, 2.2, 2.3]))
    assert out["ratio"] is None and out["reached"] is None and "did not improve" in out["undefined"]
    runs = {"baseline": [fake_run(0, [2, 1.9, 1.8, 1.9, 1.9])], "+weighting": [fake_run(0, [2, 2.1, 2.2, 2.3, 2.3], ("latent_sq", "none"))]}
    md = table_markdown(summarise_suite("headline", "jpeg_incompressibility", runs, None))
    assert "undefined: the baseline did not improve" in md and "1.00" not in md


def test_sd15_lora_shapes_match_sd15_rank4_adapter():
    from research.bench.systems import sd15_lora_shapes

    for rank, params in ((4, 797_184), (32, 8 * 797_184)):
        shapes = sd15_lora_shapes(rank)
        assert len(shapes) == 256 and sum(int(np.prod(s)) for s in shapes.values()) == params


# ----------------------------------------------------------------------------- the commands at tiny size


@pytest.mark.integration  # a whole benchmark or command run: the default tier, not -m quick
def test_study_tiny_runs_resumes_and_refuses_other_configs(tmp_path, keep_torch_threads, capsys):
    from research.bench import study

    args = ["--size", "tiny", "--out", str(tmp_path), "--threads", "1"]
    study.main(args)
    for f in ("ablation_jpeg_compressibility.json", "ablation_jpeg_compressibility.md", "ablation_jpeg_compressibility.png"):
        assert (tmp_path / f).exists(), f
    summary = json.loads((tmp_path / "ablation_jpeg_compressibility.json").read_text())
    assert [r["variant"] for r in summary["rows"]] == ["baseline", "+weighting", "+hardmine", "+both"]
    assert all(r["epochs"] == 2 and r["heldout"] is not None for r in summary["rows"])
    run_files = sorted(tmp_path.glob("runs/jpeg_compressibility/*/seed0.json"))
    assert len(run_files) == 4
    saved = json.loads(run_files[0].read_text())
    assert [r["reward_queries"] for r in saved["records"]] == [4, 8] and saved["eval"]["samples"] == 4
    # resumable: a second call reuses every saved run
    mtimes = [f.stat().st_mtime_ns for f in run_files]
    study.main(args)
    assert [f.stat().st_mtime_ns for f in run_files] == mtimes
    # another suite shares the runs it has in common (the headline pair is in the ablation)
    study.main(args + ["--suite", "headline"])
    assert [f.stat().st_mtime_ns for f in run_files] == mtimes
    headline = json.loads((tmp_path / "headline_jpeg_compressibility.json").read_text())
    assert [r["variant"] for r in headline["rows"]] == ["baseline", "+weighting"]
    # --only: runs a subset of a suite's variants (here saved already, so nothing runs), but the
    # report stays whole: latent_sq, not chosen, still shows from its saved run
    study.main(args + ["--suite", "weighting", "--only", "uniform"])
    assert [f.stat().st_mtime_ns for f in run_files] == mtimes and len(list(tmp_path.glob("runs/*/*/seed0.json"))) == 4
    weighting = json.loads((tmp_path / "weighting_jpeg_compressibility.json").read_text())
    assert {r["variant"]: r["seeds"] for r in weighting["rows"]} == {s: int(s in ("uniform", "latent_sq")) for s in study.SCHEMES}
    with pytest.raises(SystemExit):
        study.main(args + ["--suite", "weighting", "--only", "uniform", "+both"])
    assert "--only: +both not in suite(s) weighting" in capsys.readouterr().err
    # a different config must not silently mix with the saved runs
    with pytest.raises(SystemExit, match="different config"):
        study.main(args + ["--epochs", "3"])


@pytest.mark.slow  # ~30 s of Ray runs of the bench command (opt-in: python -m pytest -m slow tests)
def test_systems_tiny_simulated_scaling_and_broadcast(tmp_path):
    """No model is loaded here (simulated roles, broadcast stand-ins): only Ray start-up costs."""
    pytest.importorskip("ray")
    from research.bench import systems

    calib = {"batch_size": 4, "sample_s_per_batch": 0.05, "score_s_per_batch": 0.01, "update_s_per_sample": 0.005,
             "shapes": {"latents": [4, 4, 4, 4], "prompt_embeds": [77, 32], "images": [32, 32, 3]}}
    (tmp_path / "calib.json").write_text(json.dumps(calib))
    systems.main(["--size", "tiny", "--parts", "scale", "broadcast", "--calib", str(tmp_path / "calib.json"), "--out", str(tmp_path)])
    data = json.loads((tmp_path / "systems.json").read_text())
    rows = data["scale"]["sweeps"]["learner_calibrated"]
    assert data["scale"]["SIMULATED"] and [r["samplers"] for r in rows] == [1, 2]
    assert all(r["samples_per_s"] > 0 for r in rows) and rows[1]["linear_samples_per_s"] == pytest.approx(2 * rows[0]["samples_per_s"])
    # pipeline bound, 2 batches of 4 per epoch, 1 sampler: 8 / max(2 * 0.05, 2 * 0.01, 8 * 0.005) = 80 samples/s
    assert rows[0]["bound_samples_per_s"] == pytest.approx(80.0)
    bc = data["broadcast"]["ranks"]["4"]
    assert data["broadcast"]["schema"] == 2 and bc["params"] == 797_184 and bc["flat_zero_copy_in_actors"] and bc["flat_one_copy_in_actors"]
    assert [r["actors"] for r in bc["rows"]] == [1, 2]
    for r in bc["rows"]:  # both forms measured in the same run, and their ratio
        assert all(0 < r[f]["min_s"] <= r[f]["median_s"] <= r[f]["max_s"] for f in ("dict", "flat", "noop"))
        assert r["dict_over_flat"] == pytest.approx(r["dict"]["median_s"] / r["flat"]["median_s"])
    assert (tmp_path / "scale.png").exists() and (tmp_path / "broadcast.png").exists()


def test_broadcast_plot_reads_files_from_before_the_flat_form(tmp_path):
    from research.bench.systems import broadcast_medians, plot_broadcast

    old = {"ranks": {"4": {"params": 797_184, "mbytes_fp32": 3.2, "rows": [{"actors": 1, "median_s": 0.1}, {"actors": 2, "median_s": 0.2}]}}}
    assert broadcast_medians(old["ranks"]["4"]["rows"], "dict") == [0.1, 0.2] and broadcast_medians(old["ranks"]["4"]["rows"], "flat") == []
    plot_broadcast(old, tmp_path / "old.png")
    assert (tmp_path / "old.png").exists()


@pytest.mark.slow  # two Ray runs whose sampler and learner actors each load diffusers/transformers/peft (~10 s CPU apiece)
def test_systems_tiny_overhead_and_overlap(tmp_path):
    pytest.importorskip("ray")
    from research.bench import systems

    res = systems.main(["--size", "tiny", "--parts", "overhead", "overlap", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "systems.json").read_text())
    oh = data["overhead"]
    assert oh["ray_samples_per_s"] > 0 and oh["ratio_ray_over_reference"] == pytest.approx(oh["ray_samples_per_s"] / oh["reference_samples_per_s"])
    assert [r["reward_queries"] for r in oh["ray_records"]] == [r["reward_queries"] for r in oh["reference_records"]] == [4, 8]
    ov = data["overlap"]
    assert ov["lag0"]["policy_lag_max"] == 0 and ov["lag1"]["wall_s_per_epoch"] > 0
    assert {"sampling", "scoring", "learning"} <= set(ov["lag1"]["stage_s_per_epoch"])
    assert (tmp_path / "overlap.png").exists() and res["overlap"]["num_samplers"] == 1


@pytest.mark.integration  # a whole benchmark or command run: the default tier, not -m quick
def test_gpu_bench_tiny_on_cpu(tmp_path):
    from research.bench import gpu

    gpu.main(["--size", "tiny", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert [r["dtype"] for r in data["results"]] == ["float32", "bfloat16"]
    for r in data["results"]:
        assert r["flops_per_image_per_step"]["forward_backward"] > r["flops_per_image_per_step"]["forward"] > 0
        assert r["sampling"][0]["images_per_s"] > 0 and r["update"][0]["images_per_s"] > 0
    calib = json.loads((tmp_path / "calib_float32.json").read_text())
    assert calib["shapes"]["images"] == [32, 32, 3] and calib["update_s_per_sample"] > 0


def test_study_does_not_reuse_runs_made_on_other_tiny_world_weights(monkeypatch, tmp_path):
    """Retraining the tiny world keeps its name; saved runs on the old weights must be refused."""
    from research.bench import study
    from diffrlhf.tinyworld import weights as tinyworld

    cfg = study.make_config("full", "jpeg_compressibility", 2, [])
    saved = {"config": study.identity(cfg)}
    assert saved["config"]["model"]["weights_sha256"] == tinyworld.recorded_digest()[:16]
    study.check_reusable(tmp_path / "run.json", saved, cfg)  # same weights: reusable
    monkeypatch.setattr(tinyworld, "recorded_digest", lambda folder=None: "f" * 64)
    with pytest.raises(SystemExit, match="weights_sha256"):
        study.check_reusable(tmp_path / "run.json", saved, cfg)


def test_drift_control_pairs_seeds_and_subtracts_the_shuffled_runs_gain():
    from research.bench.drift import drift_rows

    def run(seed, rewards, heldout):
        recs = [{"reward_queries": 8 * (i + 1), "reward_mean": r} for i, r in enumerate(rewards)]
        return {"seed": seed, "records": recs, "eval": {"reward_mean": heldout}}

    # gain = trailing-3 mean at the end - epoch 0: seed 0: mean(2, 3, 4) - 0 = 3; seed 1: mean(1, 1, 1) - 1 = 0
    real = {"a": [run(0, [0, 1, 2, 3, 4], 5.0), run(1, [1, 1, 1, 1, 1], 2.0)]}
    control = {"a": [run(1, [1, 1, 1, 2, 2], 1.0), run(0, [0, 0, 1, 1, 1], 4.0), run(2, [0, 9, 9], 9.0)]}
    (row,) = drift_rows(real, control, untrained_heldout=1.0)
    assert row["seeds"] == [0, 1]  # seed 2 has no reward run: left out, not mixed in
    assert row["gain"][0] == pytest.approx(1.5) and row["drift"][0] == pytest.approx((1 + 2 / 3) / 2)
    # net is per seed, paired: seed 0: 3 - 1; seed 1: 0 - (mean(1, 2, 2) - 1)
    assert row["net"][0] == pytest.approx((2 - 2 / 3) / 2)
    assert row["net"][1] == pytest.approx(np.std([2, -2 / 3], ddof=1) / np.sqrt(2))
    assert row["heldout_net"][0] == pytest.approx(((5 - 4) + (2 - 1)) / 2)
    assert row["heldout_gain"][0] == pytest.approx(((5 - 1) + (2 - 1)) / 2)
    assert drift_rows({"b": [run(0, [0, 1], 0.0)]}, {}, None) == [{"variant": "b", "seeds": []}]


def test_paired_t_test_matches_closed_forms_and_scipy():
    """Student's t tail against its closed forms (df 1: Cauchy; df 2), and scipy where installed."""
    import math

    from research.bench.common import paired_test, t_quantile, t_sf2

    for t in (0.0, 0.3, 1.0, 2.5, 12.0):
        assert t_sf2(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), abs=1e-12)
        assert t_sf2(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-12)
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-9)
    d = [0.1, 0.3, -0.05, 0.2, 0.15]
    r = paired_test(d)
    se = np.std(d, ddof=1) / np.sqrt(5)
    assert (r["n"], r["above"]) == (5, 4) and r["mean"] == pytest.approx(0.14) and r["se"] == pytest.approx(se)
    assert r["t"] == pytest.approx(0.14 / se)
    assert paired_test([0.2])["p"] is None and paired_test([])["n"] == 0
    stats = pytest.importorskip("scipy.stats")
    assert r["p"] == pytest.approx(stats.ttest_1samp(d, 0).pvalue, rel=1e-9)
    half = stats.t.ppf(0.975, 4) * se
    assert r["ci95"] == pytest.approx([0.14 - half, 0.14 + half], rel=1e-9)


def test_drift_compares_each_variant_to_the_baseline_paired_by_seed():
    from research.bench.drift import drift_rows

    def run(seed, rewards, heldout=None):
        return {"seed": seed, "records": [{"reward_queries": 8 * (i + 1), "reward_mean": r} for i, r in enumerate(rewards)],
                "eval": {"reward_mean": heldout} if heldout is not None else None}

    flat = [0.0, 0.0, 0.0]
    real = {"base": [run(s, [0, 0, g]) for s, g in enumerate([3, 6, 9])],  # gains (3-epoch mean - epoch 0): 1, 2, 3
            "v": [run(s, [0, 0, g]) for s, g in enumerate([6, 9, 18, 30])]}  # 2, 3, 6 (+ an unpaired seed 3)
    control = {"base": [run(s, flat) for s in range(3)], "v": [run(s, flat) for s in range(4)]}
    base, v = drift_rows(real, control, None)
    assert "vs_baseline" not in base
    t = v["vs_baseline"]
    assert t["n"] == 3 and t["mean"] == pytest.approx((1 + 1 + 3) / 3) and t["above"] == 3  # seed 3 has no baseline: left out
    assert v["heldout_vs_baseline"]["n"] == 0 and v["heldout_raw_vs_baseline"]["n"] == 0

    # Raw held-out: the trained policies' own held-out rewards, seed by seed, with no control in it.
    # The controls' held-out rewards are chosen so the net comparison points the other way.
    real = {"base": [run(s, [0, 0, 3], h) for s, h in enumerate([1.0, 2.0, 3.0])],
            "v": [run(s, [0, 0, 3], h) for s, h in enumerate([1.5, 2.5, 2.9])]}
    control = {"base": [run(s, flat, 0.0) for s in range(3)], "v": [run(s, flat, 5.0) for s in range(3)]}
    base, v = drift_rows(real, control, None)
    raw, net = v["heldout_raw_vs_baseline"], v["heldout_vs_baseline"]
    assert raw["n"] == 3 and raw["mean"] == pytest.approx((0.5 + 0.5 - 0.1) / 3) and raw["above"] == 2
    assert net["mean"] == pytest.approx(raw["mean"] - 5.0) and net["above"] == 0
    from research.bench.drift import table_markdown
    assert f"| v | 3 | {raw['mean']:+.3f} |" in table_markdown("r", "c", [base, v])


def test_net_cost_to_reach_subtracts_each_seeds_drift_before_reaching():
    from research.bench.drift import net_cost_rows, net_curves

    def run(seed, rewards):
        return {"seed": seed, "records": [{"reward_queries": 10 * (i + 1), "reward_mean": r} for i, r in enumerate(rewards)]}

    # The variant's raw curve climbs fast, but its control drifts by the same amount: net it is flat.
    real = {"base": [run(0, [0, 0, 0, 3, 3, 3])], "drifty": [run(0, [0, 3, 3, 3, 3, 3])], "good": [run(0, [0, 3, 3, 3, 3, 3])]}
    control = {"base": [run(0, [0] * 6)], "drifty": [run(0, [0, 3, 3, 3, 3, 3])], "good": [run(0, [0] * 6), run(1, [9] * 6)]}
    runs, y = net_curves(real["drifty"], control["drifty"])
    assert y.tolist() == [[0, 0, 0, 0, 0, 0]]
    base, drifty, good = net_cost_rows(real, control)
    assert base["target"] == pytest.approx(3.0) and base["reach"]["queries"]["baseline"] == 60
    assert drifty["reach"]["queries"]["variant"] is None  # never reaches the target net of its drift
    assert good["seeds"] == [0] and good["reach"]["queries"] == {"baseline": 60.0, "variant": 40.0, "ratio": 1.5,
                                                         "held_variant": 40.0, "held_ratio": 1.5}
    assert drifty["reach"]["queries"]["held_variant"] is None
    from research.bench.drift import net_cost_markdown
    md = net_cost_markdown([base, drifty, good])
    assert "| drifty | 1 | +0.0000 | not reached (< 1.00x) |" in md and md.count("not reached |") == 1  # never reached: not "falls below"
    assert "| good | 1 | +3.0000 | 40 (1.50x) |" in md and md.rstrip().endswith("| 40 (1.50x) | - |")  # held at 40; no passes axis


def test_drift_reads_only_the_chosen_variants_of_a_suite(tmp_path):
    """drift --suite S --only V: the suite's baseline and V, from a study folder that holds no other variant."""
    from research.bench import drift, study

    def fake(seed, slope):
        recs = [{"epoch": e, "reward_mean": -1.8 + slope * e + 0.01 * seed, "reward_queries": 32 * (e + 1), "samples": 32,
                 "learner_passes": 640, "time_epoch": 1.0} for e in range(6)]
        return {"seed": seed, "records": recs, "eval": {"reward_mean": -1.8 + 5 * slope}}

    for reward, slopes in (("jpeg_compressibility", {"ddpo": 0.01, "method top 0.25": 0.03}),
                           ("jpeg_compressibility_shuffled", {"ddpo": 0.0, "method top 0.25": 0.01})):
        for label, slope in slopes.items():
            for seed in range(3):
                path = study.run_path(tmp_path, reward, study.SUITES["compute"][label], seed)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(fake(seed, slope)))
    rows = drift.main(["--study", str(tmp_path), "--suite", "compute", "--only", "method top 0.25"])
    assert [r["variant"] for r in rows] == ["ddpo", "method top 0.25"]
    # gain = last 3-epoch mean - epoch 0 = 4 x slope: ddpo 0.04 - 0, top 0.12 - 0.04
    assert rows[0]["net"][0] == pytest.approx(0.04) and rows[1]["net"][0] == pytest.approx(0.08)
    with pytest.raises(SystemExit, match="no saved runs for jpeg_compressibility/ddpo random 0.5"):
        drift.main(["--study", str(tmp_path), "--suite", "compute"])
    # --baseline: the paired test against another variant (its own files)
    rows = drift.main(["--study", str(tmp_path), "--suite", "compute", "--only", "method top 0.25", "--baseline", "method top 0.25"])
    assert [r["variant"] for r in rows] == ["method top 0.25", "ddpo"]
    assert rows[1]["vs_baseline"]["mean"] == pytest.approx(-0.04) and rows[1]["vs_baseline"]["above"] == 0
    assert (tmp_path / "drift_compute_jpeg_compressibility_vs_method_top_0_25.md").exists()


def test_drift_plot_gives_each_of_many_variants_its_own_colour_and_its_control_the_same(tmp_path, monkeypatch):
    """Past the default cycle's 10 colours (the evidence suite has 11 variants) no two variants share a colour."""
    from matplotlib.colors import to_rgba

    from research.bench import drift

    plt = drift.pyplot()
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its lines

    def run(seed, slope):
        return {"seed": seed, "records": [{"reward_queries": 8 * (e + 1), "reward_mean": slope * e} for e in range(4)]}

    real = {f"v{i}": [run(0, 0.1 * i)] for i in range(11)}
    drift.plot(real, {k: [run(0, 0.0)] for k in real}, tmp_path / "drift.png", "jpeg_compressibility", "control")
    lines = figures[0].axes[0].get_lines()
    solid = [to_rgba(x.get_color()) for x in lines if x.get_linestyle() == "-"]
    dashed = [to_rgba(x.get_color()) for x in lines if x.get_linestyle() == "--"]
    assert len(solid) == 11 and len(set(solid)) == 11
    assert dashed == solid  # each control drawn in its variant's colour
    assert (tmp_path / "drift.png").stat().st_size > 0


def test_evidence_table_puts_drifts_files_side_by_side_and_tests_every_setting(tmp_path, capsys):
    """Two settings made with drift from fake runs: a variant separated and >= 3x in one setting only
    passes neither all-settings test; one not run in a setting is 'not run' there and fails both."""
    from research.bench import drift, evidence_table, study

    def fake(seed, slope):  # each seed learns a little faster than the last, so the paired differences vary
        spike = slope == "spike"  # jumps to +0.3 at epoch 1, back to the start by the end; held-out below ddpo
        curve = [0.0 if spike and e > 4 else 0.3 * (e > 0) if spike else slope * (1 + 0.1 * seed) * e for e in range(9)]
        recs = [{"epoch": e, "reward_mean": -1.8 + curve[e], "reward_queries": 32 * (e + 1), "samples": 32,
                 "learner_passes": 640, "time_epoch": 1.0} for e in range(9)]
        held = -1.8 - 0.01 * (1 + seed) if spike else -1.8 + 5 * slope * (1 + 0.1 * seed)
        return {"seed": seed, "records": recs, "eval": {"reward_mean": held}}

    settings = {"s1": {"ddpo": 0.01, "method top 0.25": 0.2, "method window 0.25": 0.2, "method weighted 0.5": "spike"},
                "s2": {"ddpo": 0.01, "method top 0.25": 0.005, "method weighted 0.5": "spike"}}
    files = []
    for name, slopes in settings.items():
        for reward, scale in (("jpeg_compressibility", 1.0), ("jpeg_compressibility_shuffled", 0.0)):
            for label, slope in slopes.items():
                for seed in range(4):
                    path = study.run_path(tmp_path / name, reward, study.SUITES["compute"][label], seed)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(fake(seed, slope if scale else 0.0)
                                               if isinstance(slope, str) else fake(seed, slope * scale)))
        drift.main(["--study", str(tmp_path / name), "--suite", "compute", "--only", *list(slopes)[1:]])
        files.append(f"{name} setting=" + str(tmp_path / name / "drift_compute_jpeg_compressibility.json"))
    capsys.readouterr()
    rows = evidence_table.main(["--drift", *files, "--out", str(tmp_path / "summary")])
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["ddpo", "method weighted 0.5", "method top 0.25", "method window 0.25"] and "fold_on_all" not in by["ddpo"]
    top = by["method top 0.25"]["per_file"]
    # s1: ddpo's smoothed net ends at 0.01 x 7 (x 1.15 mean over seeds); top's is 0.1 x 1.15 after epoch 1: 64 of 288 queries
    assert top["s1 setting"]["query_ratio"] == pytest.approx(4.5) and evidence_table.separated(top["s1 setting"], 0.05)
    assert top["s2 setting"]["query_ratio"] == 0.0 and not evidence_table.separated(top["s2 setting"], 0.05)  # not reached, behind
    assert by["method top 0.25"]["fold_on_all"] is False and by["method top 0.25"]["separated_on_all"] is False
    assert by["method window 0.25"]["per_file"]["s2 setting"] is None
    assert by["method window 0.25"]["fold_on_all"] is None and by["method window 0.25"]["separated_on_all"] is None  # not run is not failed
    assert by["method window 0.25"]["raw_heldout_on_all"] is None
    # the spike crosses ddpo's final net after one epoch (first-crossing ratio >= 3x) and is back below by the end:
    # the fold test counts the held ratio, so it fails; its held-out reward is below ddpo's on every seed
    spike = by["method weighted 0.5"]
    assert spike["per_file"]["s1 setting"]["query_ratio"] >= 3 and spike["per_file"]["s1 setting"]["held_query_ratio"] == 0.0
    assert spike["fold_on_all"] is False and spike["raw_heldout_on_all"] is False
    text = (tmp_path / "summary.md").read_text()
    assert "falls below by the end" in text
    (_, _, top1, _) = evidence_table.main(["--drift", files[0], "--out", str(tmp_path / "one")])
    # s1 alone: all three tests pass (its raw held-out is above ddpo's same seed on every seed)
    assert top1["fold_on_all"] is True and top1["separated_on_all"] is True and top1["raw_heldout_on_all"] is True
    assert evidence_table.raw_heldout_above(top1["per_file"]["s1 setting"], 0.05)
    assert "| **yes** |" in (tmp_path / "one.md").read_text()
    assert "| method window 0.25 | +" in text and "not run in every setting" in text and "not reached" in text
    with pytest.raises(SystemExit, match="does not exist"):
        evidence_table.main(["--drift", f"x={tmp_path / 'nope.json'}", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        evidence_table.main(["--drift", "no-label-here.json", "--out", str(tmp_path / "o")])


# ----------------------------------------------------------------------------- bytes per hop (research/bench/data_path.py)


def test_the_row_byte_model_is_the_trajectory_contracts_fields():
    """The SD1.5 bytes table is computed from row_bytes: it must be what a TrajectoryBatch of those
    shapes holds, field by field (a changed dtype or shape in the contract fails here)."""
    import torch

    from diffrlhf.buffer.trajectory import TrajectoryBatch
    from research.bench.data_path import field_bytes, row_bytes, wire_bytes

    b, t, shape, tokens, dim, px = 3, 4, (4, 8, 8), 5, 7, 16
    batch = TrajectoryBatch(prompts=["p"] * b, latents=torch.zeros(b, t + 1, *shape), timesteps=torch.zeros(b, t, dtype=torch.long),
                            log_probs=torch.zeros(b, t), prompt_embeds=torch.zeros(b, tokens, dim),
                            images=torch.zeros(b, px, px, 3, dtype=torch.uint8), seeds=torch.zeros(b, dtype=torch.long),
                            policy_version=torch.zeros(b, dtype=torch.long), sample_ids=torch.arange(b))
    assert {k: v // b for k, v in field_bytes(batch).items()} == row_bytes(t, shape, tokens, dim, px)
    # the wire form of a batch is its Arrow bytes: the fields plus a little framing
    raw = sum(field_bytes(batch).values())
    assert raw < wire_bytes(batch) < raw + 8192
    assert 4000 <= wire_bytes(np.zeros(1000, np.float32)) < 4200  # numpy out of band, as Ray's store holds it


# ----------------------------------------------------------------------------- GPU memory, counted (research/bench/gpu_memory.py)


def test_the_live_peak_follows_tensors_until_they_are_freed():
    import torch

    from research.bench.gpu_memory import LivePeak

    x = torch.empty(1000, device="meta")  # made before the mode: not counted
    with LivePeak() as mode:
        y = x * 2  # 4000 B live
        z = y + 1  # 8000 B live
        del y  # 4000 B
        w = z * 3  # 8000 B again: the peak stays 8000
        del z, w
    assert mode.peak == 8000 and mode.live == 0


def test_saved_activations_leave_out_the_weights_and_count_what_backward_keeps():
    """A bias-free linear layer y = x W^T with W trainable saves only its input x for W's gradient
    (W itself, saved for x's gradient, is a parameter: not new memory)."""
    import torch

    from research.bench import gpu_memory

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 8, bias=False, device="meta")

        def forward(self, x, t, encoder_hidden_states):
            return type("Out", (), {"sample": self.lin(x.float().flatten(1)[:, :16])})()

    rows, latent = 3, 2  # x: [3, 4, 2, 2] -> the first 16 of its 16 values per row
    counted = gpu_memory.learner_activations(Net(), rows, latent)
    assert counted["saved_bytes"] == rows * 16 * 4  # the fp32 input of the linear layer, nothing else
