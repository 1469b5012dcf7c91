"""Issue 59's answer (research/bench/tuning_answer.py): Holm's correction, the primary measure's
"first epoch from which it stays", its paired bootstrap, and the table from run files."""
import json

import numpy as np
import pytest

from research.bench import tuning, tuning_answer as ta


def test_holm_adjusts_by_rank_and_keeps_the_order_monotone():
    # by hand: sorted 0.005 x4 = 0.02, 0.01 x3 = 0.03, 0.03 x2 = 0.06, 0.04 x1 = 0.04 -> 0.06 (monotone)
    assert ta.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert ta.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    # a partial table of the plan's 6: the missing 4 count as p = 1, so 0.005 x6, 0.01 x5
    assert ta.family_size() == 6
    assert ta.holm([0.01, 0.005], family=6) == pytest.approx([0.05, 0.03])
    with pytest.raises(ValueError, match="family of 1"):
        ta.holm([0.01, 0.02], family=1)


def test_the_target_must_be_held_to_the_end():
    assert ta.held_from(np.array([0.0, 1.0, 0.2, 1.0, 1.0]), 0.5) == 3
    assert ta.held_from(np.array([0.0, 1.0, 1.0, 0.2]), 0.5) is None  # crossed, then fell back
    assert ta.held_from(np.array([1.0, 1.0]), 0.5) == 0


def step_curves(step_at: int, seeds: int = 5, epochs: int = 30, fall_at: int | None = None) -> np.ndarray:
    e = np.arange(epochs)
    row = ((e >= step_at) & ((e < fall_at) if fall_at is not None else True)).astype(float)
    return np.tile(row, (seeds, 1))


def test_the_primary_ratio_is_ddpos_queries_over_the_variants_to_half_ddpos_net_gain():
    """DDPO steps from 0 to 1 at epoch 20, the variant at epoch 9: DDPO's net gain is 1, the target
    0.5; a 3-epoch trailing mean first holds >= 0.5 one epoch after a step (1/3, then 2/3), so DDPO
    needs the queries of epoch 21 (22 x 32 = 704), the variant those of epoch 10 (352): ratio 2."""
    queries = 32 * (np.arange(30) + 1)
    p = ta.primary(step_curves(20), step_curves(9), queries, resamples=200)
    assert p["target"] == pytest.approx(0.5) and (p["ddpo_queries"], p["variant_queries"]) == (704, 352)
    assert p["ratio"] == pytest.approx(2.0) and p["ci95"] == pytest.approx([2.0, 2.0]) and p["resamples_without_ratio"] == 0
    fell = ta.primary(step_curves(20), step_curves(5, fall_at=25), queries, resamples=50)
    assert fell["ratio"] is None and fell["note"] == "the variant never stays at or above the target"
    flat = ta.primary(np.zeros((5, 30)), step_curves(10), queries, resamples=50)
    assert flat["ratio"] is None and "not positive" in flat["note"] and flat["resamples_without_ratio"] == 50


def test_the_bootstrap_resamples_seeds_pairwise():
    """Seed i of DDPO pairs with seed i of the variant: a variant that is always 2x faster on its own
    seed keeps the ratio near 2 in every resample, though the seeds' steps differ."""
    queries = 32 * (np.arange(30) + 1)
    base = np.vstack([step_curves(s, seeds=1)[0] for s in (16, 18, 20, 22, 24)])
    var = np.vstack([step_curves(s // 2, seeds=1)[0] for s in (16, 18, 20, 22, 24)])
    p = ta.primary(base, var, queries, resamples=500)
    assert 1.6 < p["ci95"][0] <= p["ratio"] <= p["ci95"][1] < 2.4


def _run(path, seed, rewards, heldout):
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [{"reward_mean": float(r), "reward_queries": 32 * (i + 1)} for i, r in enumerate(rewards)]
    path.write_text(json.dumps({"seed": seed, "records": records, "wall_s": 1.0, "eval": {"reward_mean": heldout}}))


def test_the_answer_table_from_run_files_names_the_cells_still_waiting(tmp_path):
    reward = "jpeg_compressibility"
    for variant in ("ddpo", "ddim_std"):  # their tuning: the middle setting best (no edge extension)
        for j in tuning.tuning_jobs([reward], [variant]):
            g = 1.0 if j["setting"] == tuning.settings()[4] else 0.5
            _run(tuning.job_path(tmp_path, j), j["seed"], [0.0, g, g, g], 0.0)
    steps = {"ddpo": 20, "ddim_std": 9}
    confirm, _ = tuning.confirm_jobs(tmp_path, [reward], ["ddpo", "ddim_std"])
    for j in confirm:
        curve = np.zeros(30) if j["reward"].endswith("_shuffled") else step_curves(steps[j["variant"]], seeds=1)[0] + 0.01 * j["seed"]
        _run(tuning.job_path(tmp_path, j), j["seed"], curve, {"ddpo": 0.1, "ddim_std": 0.3}[j["variant"]])
    curves = {}
    res = ta.answer(tmp_path, resamples=100, curves=curves)
    (c,) = res["comparisons"]
    assert (c["reward"], c["variant"], c["seeds"]) == (reward, "ddim_std", tuning.PLAN["confirm_seeds"])
    assert c["primary"]["ratio"] == pytest.approx(2.0)
    assert c["auc"]["mean"] == pytest.approx(11 / 30) and c["heldout"]["mean"] == pytest.approx(0.2)
    # one comparison of the plan's 6: Holm multiplies its p by 6 (the five waiting count as p = 1)
    assert c["holm_p"] == pytest.approx(min(1.0, 6 * c["auc"]["p"])) and c["survives"] == (6 * c["auc"]["p"] < 0.05)
    assert f"{reward} / latent_sq" in res["waiting"] and "tinyworld_alignment / ddpo" in res["waiting"]
    md = ta.markdown(res)
    assert "| jpeg_compressibility | ddim_std | 704 / 352 | 2.00 [2.00, 2.00] |" in md and "Waiting for" in md
    # the picture's data: both cells' net curves, per reward
    assert set(curves) == {reward} and set(curves[reward]) == {"ddpo", "ddim_std"}
    queries, net = curves[reward]["ddim_std"]
    assert list(queries[:2]) == [32, 64] and net.shape == (len(tuning.PLAN["confirm_seeds"]), 30)
    ta.main(["--out", str(tmp_path), "--resamples", "50"])
    assert (tmp_path / "answer_curves.png").stat().st_size > 10_000


def test_the_pictures_curve_is_the_seed_mean_less_epoch_0_with_its_standard_error():
    net = np.array([[1.0, 2.0, 4.0], [3.0, 3.0, 7.0]])  # less epoch 0: [0, 1, 3] and [0, 0, 4]
    mean, se = ta.mean_net_curve(net)
    np.testing.assert_allclose(mean, [0.0, 0.5, 3.5])
    np.testing.assert_allclose(se, [0.0, 0.5, 0.5])  # s.d. (ddof 1) / sqrt(2): |a - b| / 2
