"""Issue 59's runner (research/bench/tuning.py): the plan's grid and seeds, where each run lands,
the selection rule, and the status count."""
import json

import numpy as np
import pytest

from research.bench import tuning


def test_every_variant_gets_the_same_grid_on_seeds_that_the_confirmatory_stage_never_uses():
    plan = tuning.PLAN
    assert not set(plan["tuning_seeds"]) & set(plan["confirm_seeds"])
    jobs = tuning.tuning_jobs()
    assert len(jobs) == len(plan["rewards"]) * len(plan["variants"]) * len(tuning.settings()) * len(plan["tuning_seeds"])
    per_variant = {}
    for j in jobs:
        per_variant.setdefault(j["variant"], set()).add(tuning.setting_tag(j["setting"]))
    assert len({frozenset(v) for v in per_variant.values()}) == 1  # equal tuning budgets
    # seed-major: every cell once before any cell twice
    first = len(jobs) // len(plan["tuning_seeds"])
    assert {j["seed"] for j in jobs[:first]} == {plan["tuning_seeds"][0]}


def test_each_setting_and_seed_has_its_own_file(tmp_path):
    jobs = tuning.tuning_jobs(["jpeg_compressibility"], ["ddpo"])
    paths = {tuning.job_path(tmp_path, j) for j in jobs}
    assert len(paths) == len(jobs)
    j = jobs[0]
    assert tuning.job_path(tmp_path, j) == tmp_path / "tune" / "clip_range0.003_lr0.003" / "runs" / "jpeg_compressibility" / "uniform__none" / "seed100.json"
    assert tuning.overrides_of(j["setting"]) == ["train.clip_range=0.003", "train.lr=0.003"]


def test_selection_takes_the_highest_mean_gain_and_breaks_ties_to_the_smaller_step():
    def row(lr, clip, g):
        s = {"train.clip_range": clip, "train.lr": lr}
        return {"setting": s, "tag": tuning.setting_tag(s), "gain_mean": g}

    assert tuning.choose([row(0.01, 0.01, 0.1), row(0.03, 0.01, 0.2), row(0.003, 0.03, 0.15)]) == "clip_range0.01_lr0.03"
    assert tuning.choose([row(0.03, 0.01, 0.2), row(0.01, 0.03, 0.2)]) == "clip_range0.03_lr0.01"  # tie: smaller lr
    assert tuning.choose([row(0.01, 0.03, 0.2), row(0.01, 0.01, 0.2)]) == "clip_range0.01_lr0.01"  # then smaller clip


def _fake_run(path, seed, rewards, wall):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"seed": seed, "records": [{"reward_mean": r} for r in rewards], "wall_s": wall}))


def test_status_counts_done_and_left_and_prices_what_is_left_by_the_runs_done(tmp_path):
    jobs = tuning.tuning_jobs(["jpeg_compressibility"], ["ddpo", "hardmine"])
    for j, wall in zip(jobs[:3], (100.0, 200.0, 300.0)):
        _fake_run(tuning.job_path(tmp_path, j), j["seed"], [0.0, 1.0], wall)
    st = tuning.status(tmp_path, jobs)
    assert (st["done"], st["left"]) == (3, len(jobs) - 3)
    assert st["seconds_per_run"]["jpeg_compressibility"] == 200.0  # the median of the done runs, not the prior
    assert st["cpu_hours_left"] == pytest.approx((len(jobs) - 3) * 200.0 / 3600)
    assert "3 done" in tuning.status_text(st)


def test_the_table_chooses_only_when_every_setting_has_every_tuning_seed(tmp_path):
    jobs = tuning.tuning_jobs(["jpeg_compressibility"], ["ddpo"])
    best = tuning.settings()[4]
    for j in jobs[:-1]:  # one run missing
        gain = 1.0 if j["setting"] == best else 0.5
        _fake_run(tuning.job_path(tmp_path, j), j["seed"], [0.0, gain, gain, gain], 1.0)
    table = tuning.tuning_table(tmp_path)["jpeg_compressibility / ddpo"]
    assert not table["complete"] and table["chosen"] is None
    last = jobs[-1]
    _fake_run(tuning.job_path(tmp_path, last), last["seed"], [0.0, 0.5, 0.5, 0.5], 1.0)
    table = tuning.tuning_table(tmp_path)["jpeg_compressibility / ddpo"]
    assert table["complete"] and table["chosen"] == tuning.setting_tag(best)
    assert "**+1.000" in tuning.table_markdown({"jpeg_compressibility / ddpo": table})
    (c,) = tuning.choices({"jpeg_compressibility / ddpo": table})  # the grid's middle: at no edge
    assert (c["settings_tried"], c["in_extension"], c["edges"]) == (9, False, [])


def test_the_plan_digest_changes_with_the_plan(monkeypatch):
    before = tuning.plan_digest()
    monkeypatch.setitem(tuning.PLAN, "confirm_seeds", [200, 201])
    assert tuning.plan_digest() != before


def test_results_quotes_the_plan_it_was_committed_with():
    """The plan is fixed before its confirmatory runs: editing PLAN changes the digest RESULTS quotes."""
    from pathlib import Path

    results = (Path(__file__).resolve().parents[1] / "RESULTS.md").read_text()
    assert f"Plan digest `{tuning.plan_digest()}`" in results


def test_confirmatory_runs_are_the_chosen_setting_on_the_confirm_seeds_each_beside_its_control(tmp_path):
    best = tuning.settings()[2]  # clip 0.003, lr 0.03: at an edge in both keys, so the edge rule extends the cell
    for _ in range(2):  # the grid, then its extension (tuning_jobs adds it once the grid is complete)
        for j in tuning.tuning_jobs(["jpeg_compressibility"], ["ddpo"], tmp_path):
            gain = 1.0 if j["setting"] == best else 0.5
            _fake_run(tuning.job_path(tmp_path, j), j["seed"], [0.0, gain, gain, gain], 1.0)
    confirm, waiting = tuning.confirm_jobs(tmp_path)
    assert "jpeg_compressibility / ddpo" not in waiting and "jpeg_compressibility / latent_sq" in waiting
    assert len(waiting) == len(tuning.PLAN["rewards"]) * len(tuning.PLAN["variants"]) - 1
    assert [(j["seed"], j["reward"]) for j in confirm] == [(s, r) for s in tuning.PLAN["confirm_seeds"]
                                                           for r in ("jpeg_compressibility", "jpeg_compressibility_shuffled")]
    assert all(j["setting"] == best and j["variant"] == "ddpo" and j["stage"] == "confirm" for j in confirm)
    assert not {j["seed"] for j in confirm} & set(tuning.PLAN["tuning_seeds"])  # fresh seeds only
    assert tuning.job_path(tmp_path, confirm[1]) == (tmp_path / "confirm" / tuning.setting_tag(best) / "runs"
                                                     / "jpeg_compressibility_shuffled" / "uniform__none" / "seed200.json")


def test_the_edge_rule_extends_one_factor_3_step_beyond_each_edge_the_grid_best_lies_on():
    def ext(clip, lr):
        return sorted(tuning.setting_tag(x) for x in tuning.edge_extension({"train.clip_range": clip, "train.lr": lr}))

    assert ext(0.01, 0.01) == []  # inside the grid in both keys
    assert ext(0.01, 0.003) == ["clip_range0.003_lr0.001", "clip_range0.01_lr0.001", "clip_range0.03_lr0.001"]
    assert ext(0.03, 0.003) == sorted(["clip_range0.09_lr0.003", "clip_range0.09_lr0.01", "clip_range0.09_lr0.03",
                                       "clip_range0.003_lr0.001", "clip_range0.01_lr0.001", "clip_range0.03_lr0.001",
                                       "clip_range0.09_lr0.001"])  # both edges: each key beyond, and the corner
    assert ext(0.003, 0.03) == sorted(["clip_range0.001_lr0.003", "clip_range0.001_lr0.01", "clip_range0.001_lr0.03",
                                       "clip_range0.003_lr0.09", "clip_range0.01_lr0.09", "clip_range0.03_lr0.09",
                                       "clip_range0.001_lr0.09"])


def test_a_cell_whose_grid_best_is_at_an_edge_is_chosen_only_after_its_extension_once(tmp_path):
    edge = {"train.clip_range": 0.01, "train.lr": 0.003}
    beyond = {"train.clip_range": 0.01, "train.lr": 0.001}  # in the extension, and itself at the extension's edge
    gain = {tuning.setting_tag(edge): 1.0, tuning.setting_tag(beyond): 2.0}
    grid_jobs = tuning.tuning_jobs(["jpeg_compressibility"], ["ddpo"], tmp_path)
    assert len(grid_jobs) == len(tuning.settings()) * len(tuning.PLAN["tuning_seeds"])  # nothing to extend yet
    for j in grid_jobs:
        g = gain.get(tuning.setting_tag(j["setting"]), 0.5)
        _fake_run(tuning.job_path(tmp_path, j), j["seed"], [0.0, g, g, g], 1.0)
    cell = tuning.tuning_table(tmp_path)["jpeg_compressibility / ddpo"]
    assert cell["grid_best"] == tuning.setting_tag(edge) and not cell["complete"] and cell["chosen"] is None
    jobs = tuning.tuning_jobs(["jpeg_compressibility"], ["ddpo"], tmp_path)
    added = jobs[len(grid_jobs):]
    assert len(added) == 3 * len(tuning.PLAN["tuning_seeds"]) and all(j["setting"]["train.lr"] == 0.001 for j in added)
    for j in added:
        g = gain.get(tuning.setting_tag(j["setting"]), 0.5)
        _fake_run(tuning.job_path(tmp_path, j), j["seed"], [0.0, g, g, g], 1.0)
    cell = tuning.tuning_table(tmp_path)["jpeg_compressibility / ddpo"]
    assert cell["complete"] and cell["chosen"] == tuning.setting_tag(beyond)
    assert len(tuning.tuning_jobs(["jpeg_compressibility"], ["ddpo"], tmp_path)) == len(jobs)  # once: no second extension
    md = tuning.table_markdown({"jpeg_compressibility / ddpo": cell})
    assert "The edge rule's extensions" in md and "| jpeg_compressibility / ddpo | clip_range0.01_lr0.001 | **+2.000" in md
    # the choice lies at the lowest lr tried (the extension's edge: the rule does not extend again); clip 0.01 is inside
    (c,) = tuning.choices({"jpeg_compressibility / ddpo": cell})
    assert (c["chosen"], c["settings_tried"], c["in_extension"], c["edges"]) == (tuning.setting_tag(beyond), 12, True, ["lr smallest tried"])
    assert "| jpeg_compressibility / ddpo | clip_range0.01_lr0.001 | +2.000 ± 0.000 | 12 | extension | lr smallest tried |" in md
    interior = tuning.tuning_table(tmp_path)  # the other cells are not complete: no choice listed for them
    assert [c["cell"] for c in tuning.choices(interior)] == ["jpeg_compressibility / ddpo"]


def test_a_tuning_run_goes_on_with_the_extensions_the_grids_it_completes_queue(tmp_path, monkeypatch):
    """`run --stage tune` runs the grid, then the edge extensions of the grids it completed, in one call."""
    edge = {"train.clip_range": 0.01, "train.lr": 0.003}  # the best: at lr's low edge -> 3 extension settings

    def fake_run_job(out, job, threads=1, nice=0):
        g = 1.0 if job["setting"] == edge else 0.5
        _fake_run(tuning.job_path(out, job), job["seed"], [0.0, g, g, g], 1.0)
        return str(tuning.job_path(out, job))

    monkeypatch.setattr(tuning, "run_job", fake_run_job)
    done = tuning.main(["run", "--stage", "tune", "--reward", "jpeg_compressibility", "--variant", "ddpo", "--jobs", "1",
                        "--out", str(tmp_path)])
    seeds = len(tuning.PLAN["tuning_seeds"])
    assert len(done) == (len(tuning.settings()) + 3) * seeds
    assert tuning.tuning_table(tmp_path)["jpeg_compressibility / ddpo"]["complete"]
    capped = tuning.main(["run", "--stage", "tune", "--reward", "jpeg_compressibility", "--variant", "hardmine", "--jobs", "1",
                          "--max-runs", "4", "--out", str(tmp_path)])
    assert len(capped) == 4  # --max-runs bounds the whole call


def test_the_tuning_picture_places_each_settings_gain_at_its_lr_and_clip(tmp_path):
    """The picture's matrix: rows the learning rates, columns the clip ranges (grid and extension,
    ascending), each setting's mean gain in its own cell, NaN where no run is done."""
    def row(lr, clip, g, seeds=3):
        s = {"train.clip_range": clip, "train.lr": lr}
        return {"setting": s, "tag": tuning.setting_tag(s), "gain_mean": g, "seeds": seeds}

    cell = {"rows": [row(0.01, 0.003, 0.5), row(0.003, 0.03, 0.25), row(0.001, 0.003, None, seeds=0)]}
    lrs, clips, gains = tuning.gain_grid(cell)
    assert lrs == [0.001, 0.003, 0.01] and clips == [0.003, 0.03]
    assert gains[2, 0] == 0.5 and gains[1, 1] == 0.25 and np.isnan(gains[0, 0]) and np.isnan(gains[0, 1])

    jobs = tuning.tuning_jobs(["jpeg_compressibility"], ["ddpo"])
    for j in jobs[:5]:
        _fake_run(tuning.job_path(tmp_path, j), j["seed"], [0.0, 1.0], 1.0)
    tuning.main(["report", "--out", str(tmp_path)])
    assert (tmp_path / "tuning_grid.png").stat().st_size > 10_000
