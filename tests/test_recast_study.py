"""Issue 60's plan (research/bench/recast_study.py): fresh seeds, one file per run, controls of the
same weights, every run a valid config, and the plan quoted in RESULTS by its digest."""
from pathlib import Path

import pytest

from diffrlhf.deploy.config import load_config
from research.bench import recast_study as rs
from research.bench import tuning


def test_seeds_are_fresh_and_every_run_has_its_own_file_and_a_valid_config(tmp_path):
    assert not set(rs.PLAN["seeds"]) & (set(tuning.PLAN["tuning_seeds"]) | set(tuning.PLAN["confirm_seeds"]))
    jobs = rs.jobs()
    assert len(jobs) == 3 * 3 * 5 * 2 and len({rs.run_path(tmp_path, j) for j in jobs}) == len(jobs)
    for j in jobs[:12]:  # the first seed: every method and weight, real and control
        cfg = load_config("tiny", overrides=rs.overrides(j))
        terms = cfg.reward.spec["terms"]
        assert [t["weight"] for t in terms] == [j["weight"], round(1 - j["weight"], 10)]
        assert ("research.controls:" in terms[0]["name"]) == j["control"] and cfg.advantage.mode == "batch"
        assert cfg.recast.mode == rs.PLAN["methods"][j["method"]]["recast.mode"]
    st = rs.status(tmp_path)
    assert (st["done"], st["left"]) == (0, len(jobs))


def test_a_chunk_runs_exactly_the_missing_runs_of_its_lambdas_and_methods(tmp_path, monkeypatch):
    done = {"method": "weighted_sum", "weight": 0.5, "seed": 300, "control": False}
    rs.run_path(tmp_path, done).parent.mkdir(parents=True)
    rs.run_path(tmp_path, done).write_text("{}")
    ran = []
    monkeypatch.setattr(rs, "run_jobs", lambda out, todo, n_jobs, size: ran.extend(todo) or [])
    rs.main(["run", "--out", str(tmp_path), "--weight", "0.5"])
    assert {j["weight"] for j in ran} == {0.5} and done not in ran
    assert len(ran) == 3 * 5 * 2 - 1 and ran == [j for j in rs.jobs() if j["weight"] == 0.5 and j != done]
    ran.clear()
    rs.main(["run", "--out", str(tmp_path), "--weight", "0.5", "--method", "weighted_sum", "recast_pre"])
    assert len(ran) == 2 * 5 * 2 - 1 and {j["method"] for j in ran} == {"weighted_sum", "recast_pre"} and done not in ran
    with pytest.raises(SystemExit):  # a lambda or method outside the plan is refused by the command line
        rs.main(["run", "--out", str(tmp_path), "--weight", "0.4"])
    with pytest.raises(SystemExit):
        rs.main(["run", "--out", str(tmp_path), "--method", "recast"])


def test_results_quotes_the_plan_it_was_committed_with():
    results = (Path(__file__).resolve().parents[1] / "RESULTS.md").read_text()
    assert f"Plan digest `{rs.plan_digest()}`" in results


@pytest.mark.integration  # a whole benchmark or command run: the default tier, not -m quick
def test_the_runner_saves_a_real_and_a_control_run_with_each_rewards_held_out_mean(tmp_path):
    import json

    import numpy as np

    real, control = [j for j in rs.jobs() if j["method"] == "recast_pre" and j["weight"] == 0.5][:2]
    for job in (real, control):
        path = rs.run_job(tmp_path, job, size="tiny", nice=0)
        saved = json.loads(open(path).read())
        assert saved["plan_digest"] == rs.plan_digest() and len(saved["records"]) == 2
        assert saved["eval"]["term_names"] == (["research.controls:ShuffledJpegCompressibility", "research.controls:ShuffledTinyWorldAlignment"]
                                                if job["control"] else ["jpeg_compressibility", "tinyworld_alignment"])
        assert len(saved["eval"]["term_means"]) == 2
        probe = 2 + 2 * 2 * 3
        assert [r["reward_queries"] for r in saved["records"]] == [probe + 4, probe + 8]
        assert "reward_mean/" + saved["eval"]["term_names"][1] in saved["records"][0]
        (w,) = [p["weights"] for p in saved["recast_probes"]]  # the one probe's W: 2 rewards x 3 steps at this size
        assert np.asarray(w).shape == (2, 3) and np.isfinite(w).all()
    assert rs.status(tmp_path)["done"] == 2
