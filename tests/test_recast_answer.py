"""Issue 60's answer command (research/bench/recast_answer.py), written before the study's runs, on
hand-made run files whose answer is worked out by hand: the reading at equal reward queries, the net
of the controls, the paired differences, Holm and the front rule."""
import json

import numpy as np
import pytest

from research.bench import recast_answer as ra
from research.bench import recast_study as rs

PROBE, PER_EPOCH, EPOCHS = 10, 8, 6
JPEG_EXTRA = [0.1, 0.2, 0.3, 0.2, 0.2]  # recast_pre's net JPEG gain above the weighted sum's, per seed
ALIGN_EXTRA = [0.1, -0.1, 0.05, -0.05, 0.0]  # ... and its alignment gain: no difference on average


def records(jpeg, align, probe, control):
    names = ra.terms(control)
    return [{"epoch": e, "reward_queries": probe + PER_EPOCH * (e + 1), f"reward_mean/{names[0]}": jpeg[e],
             f"reward_mean/{names[1]}": align[e]} for e in range(EPOCHS)]


def write(out, method, weight, seed_index, control):
    seed = rs.PLAN["seeds"][seed_index]
    probe = 0 if method == "weighted_sum" else PROBE
    if control:  # a drift on JPEG, none on alignment
        jpeg, align = [0.25 * e for e in range(EPOCHS)], [0.0] * EPOCHS
    elif method == "recast_pre":  # read at index 3 (queries 42 <= 48): gain = the level reached
        x = 3.5 + JPEG_EXTRA[seed_index]
        jpeg, align = [0.0] + [x] * (EPOCHS - 1), [0.0] + [2.0 + ALIGN_EXTRA[seed_index]] * (EPOCHS - 1)
    elif method == "recast_loss":  # the weighted sum's net gains exactly
        jpeg, align = [0.0] + [3.5] * (EPOCHS - 1), [0.0] + [2.0] * (EPOCHS - 1)
    else:
        jpeg, align = [float(e) for e in range(EPOCHS)], [0.5 * e for e in range(EPOCHS)]
    job = {"method": method, "weight": weight, "seed": seed, "control": control}
    path = rs.run_path(out, job)
    path.parent.mkdir(parents=True, exist_ok=True)
    held = [0.5, 0.5] if control else ([1.5, 1.0] if method == "recast_pre" else [1.0, 1.0])
    path.write_text(json.dumps({"job": job, "records": records(jpeg, align, probe, control), "eval": {"term_means": held},
                                "recast_probes": [] if probe == 0 else [{"round": 0, "term_names": ra.terms(control),
                                                                           "weights": [[0.5, 0.2, 0.1], [0.5, 0.8, 0.9]],
                                                                           "gains": [[1.0, 0.5, 0.1], [0.1, 0.5, 1.0]]}]}))
    return path


@pytest.fixture
def study(tmp_path):
    for m in rs.PLAN["methods"]:
        for w in rs.PLAN["weights_on_first"]:
            for k in range(len(rs.PLAN["seeds"])):
                for c in (False, True):
                    write(tmp_path, m, w, k, c)
    return tmp_path


def test_a_run_is_read_at_its_last_epoch_within_the_budget_and_netted_by_its_control():
    ws = records([float(e) for e in range(EPOCHS)], [0.5 * e for e in range(EPOCHS)], 0, False)
    control = records([0.25 * e for e in range(EPOCHS)], [0.0] * EPOCHS, 0, True)
    assert ra.read_at(ws, 48) == 5 and ra.read_at(records([0] * 6, [0] * 6, PROBE, False), 48) == 3  # 42 <= 48 < 50
    # JPEG: mean(3, 4, 5) - 0 less the control's mean(0.75, 1, 1.25) - 0; alignment: mean(1.5, 2, 2.5) - 0
    assert ra.net_gains({"records": ws}, {"records": control}, 48) == [3.0, 2.0]
    with pytest.raises(ValueError, match="no epoch within 5 reward queries"):
        ra.read_at(ws, 5)


def test_the_answer_pairs_the_seeds_corrects_across_the_comparisons_and_applies_the_front_rule(study):
    res = ra.answer(study)
    assert res["waiting"] == [] and len(res["comparisons"]) == 12
    by = {(c["mode"], c["weight"], c["reward"]): c for c in res["comparisons"]}
    jpeg, align = rs.PLAN["rewards"]
    for w in rs.PLAN["weights_on_first"]:
        pre_j, pre_a, loss_j = by["recast_pre", w, jpeg], by["recast_pre", w, align], by["recast_loss", w, jpeg]
        assert pre_j["net_gain"]["mean"] == pytest.approx(0.2) and pre_a["net_gain"]["mean"] == pytest.approx(0.0, abs=1e-12)
        assert loss_j["net_gain"]["mean"] == pytest.approx(0.0, abs=1e-12) and loss_j["net_gain"]["p"] == 1.0
        assert pre_j["heldout"]["mean"] == pytest.approx(0.5)
        # t = 0.2 / (0.0707 / sqrt 5) = 6.32 on 4 df: p = 0.0032; Holm: the three equal smallest of 12, x 12 = 0.038
        assert pre_j["net_gain"]["p"] == pytest.approx(0.00320, rel=0.01) and pre_j["p_holm"] == pytest.approx(12 * pre_j["net_gain"]["p"])
        assert pre_j["above"] and not pre_a["above"] and not loss_j["above"]
    assert {(f["mode"], f["weight"]): f["moves_outward"] for f in res["fronts"]} == {
        **{("recast_pre", w): True for w in rs.PLAN["weights_on_first"]}, **{("recast_loss", w): False for w in rs.PLAN["weights_on_first"]}}
    assert res["cells"]["recast_pre / lambda 0.5"]["probe_share"] == pytest.approx(PROBE / (PROBE + PER_EPOCH * EPOCHS))
    paths = ra.pictures(res, study)
    assert [p.name for p in paths] == ["pareto.png"] + [f"recast_weights_lambda{w:g}.png" for w in rs.PLAN["weights_on_first"]]
    assert all(p.stat().st_size > 0 for p in paths)


def test_a_cell_with_a_missing_run_waits_and_no_comparison_uses_it(study):
    rs.run_path(study, {"method": "recast_loss", "weight": 0.25, "seed": rs.PLAN["seeds"][2], "control": True}).unlink()
    res = ra.answer(study)
    assert res["waiting"] == ["recast_loss / lambda 0.25"] and len(res["comparisons"]) == 10
    assert not any(c["mode"] == "recast_loss" and c["weight"] == 0.25 for c in res["comparisons"])
    md = ra.markdown(res)
    assert "Waiting (runs missing): recast_loss / lambda 0.25." in md and md.count("| recast_pre |") == 6 + 3
    assert np.isfinite([c["p_holm"] for c in res["comparisons"]]).all()
    # Holm still counts the plan's 12: the two waiting comparisons as p = 1, so the three equal smallest stay x 12
    pre = [c for c in res["comparisons"] if c["mode"] == "recast_pre" and c["reward"] == rs.PLAN["rewards"][0]]
    assert [c["p_holm"] for c in pre] == pytest.approx([12 * c["net_gain"]["p"] for c in pre])
