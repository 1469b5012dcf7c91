"""A few of RESULTS' headline figures, recomputed from the result files they come from: the test
fails if a figure and its file part (a file edited, deleted or rerun without the text following)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = (ROOT / "RESULTS.md").read_text()
STUDY = ROOT / "research" / "results"


def mean_se(xs) -> tuple[float, float]:
    xs = np.asarray(xs, dtype=np.float64)
    return float(xs.mean()), float(xs.std(ddof=1) / math.sqrt(len(xs)))


def net_rows(path: Path) -> dict[str, dict]:
    return {r["variant"]: r for r in json.loads(path.read_text())["rows"]}


def test_the_30_epoch_net_gains_are_the_drift_files():
    """Section "Does per-step weighting beat DDPO": each variant's net gain (mean ± s.e. over its
    seeds' per-seed nets) and its paired difference against DDPO, on both rewards."""
    for path, column in ((STUDY / "study_long" / "drift_evidence_jpeg_compressibility.json", "JPEG"),
                         (STUDY / "study_alignment_long" / "drift_evidence_tinyworld_alignment.json", "alignment")):
        rows = net_rows(path)
        ddpo = {s: v["net"] for s, v in rows["ddpo"]["per_seed"].items()}
        for variant in ("ddpo", "ddim_std", "latent_sq", "latent_abs"):
            nets = {s: v["net"] for s, v in rows[variant]["per_seed"].items()}
            m, se = mean_se(list(nets.values()))
            row = next(ln for ln in RESULTS.splitlines() if ln.startswith(f"| `{variant}`"))
            assert f"{m:+.3f} ± {se:.3f}" in row, (column, variant, m, se, row)
            if variant != "ddpo":
                diff = float(np.mean([nets[s] - ddpo[s] for s in nets]))
                assert f"{diff:+.3f} (" in row, (column, variant, diff, row)


def test_the_first_runs_gains_are_their_metrics():
    """Section "What does the tiny world learn": each seed's gain = mean of the last 3 epochs - epoch 0."""
    for seed in (0, 1, 2):
        records = [json.loads(ln) for ln in (STUDY / "first_run" / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()]
        gain = np.mean([r["reward_mean"] for r in records[-3:]]) - records[0]["reward_mean"]
        assert f"| {seed} | {gain:+.3f} = " in RESULTS, (seed, gain)


def test_the_reward_throughput_is_its_file():
    """Section "What do the reward actors cost": images/s and GFLOP per image of each reward actor."""
    rows = json.loads((STUDY / "rewards" / "throughput-packages-cpu2core.json").read_text())["results"]
    for reward in ("imagereward", "imagereward_pkg", "hpsv2", "hpsv2_pkg"):
        by_size = {r["size"]: r for r in rows if r["reward"] == reward}
        line = next(ln for ln in RESULTS.splitlines() if ln.startswith(f"| `{reward}`"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == f"{by_size[64]['flops_per_image'] / 1e9:.1f}"
        assert cells[3:5] == [f"{by_size[64]['images_per_s']:.2f}", f"{by_size[512]['images_per_s']:.2f}"], (reward, cells)


def test_the_per_step_gradient_shares_are_the_measurement():
    """Section "Why does ddim_std win": the last quarter's share of the gradient and the CV over steps."""
    schemes = json.loads((STUDY / "step_gradients" / "step_gradients.json").read_text())["summary"]["schemes"]
    text = " ".join(RESULTS.split())  # the section's sentences wrap
    uniform, ddim_std = schemes["uniform"], schemes["ddim_std"]
    assert f"the last quarter of the steps carries {100 * uniform['last_quarter_share'][0]:.0f}% of DDPO's gradient" in text
    assert f"brings the last quarter to {100 * ddim_std['last_quarter_share'][0]:.0f}% (CV over steps " \
           f"{ddim_std['cv'][0]:.2f} against {uniform['cv'][0]:.2f})" in text
    assert f"vary {uniform['max_over_min'][0]:.0f}-fold" in text


def test_the_bad_input_figures_are_the_benchmark_file():
    """Section "What does the distributed system cost", bad input: every case refused (exit 2) in
    one stderr line, no Ray started, no run folder left; the count and the time range quoted."""
    cases = json.loads((STUDY / "bad_input" / "bad_input.json").read_text())["cases"]
    assert {(c["exit"], c["stderr_lines"], c["ray_started"], c["run_folder_left"]) for c in cases} == {(2, 1, False, False)}
    secs = [c["seconds"] for c in cases]
    assert f"{len(cases)} inputs" in RESULTS and f"exited 2 in {min(secs):.1f}-{max(secs):.1f} s" in RESULTS, (len(cases), min(secs), max(secs))


def test_the_bytes_per_hop_table_is_the_data_path_files():
    """Section "What does the distributed system cost", bytes per hop before and after (issue 51)."""
    before, after = (json.loads((STUDY / "data_path" / f"data_path_{t}.json").read_text()) for t in ("before", "after"))
    for hop in ("broadcast", "sampler->reward", "reward->buffer", "sampler->buffer", "buffer->learner", "checkpoint"):
        cells = [f"{d['tiny']['epochs'][-1]['bytes'][hop] / 1e6:.3f}" for d in (before, after)]
        cells += [f"{d['sd15']['bytes'][hop] / 1e9:.3f}" for d in (before, after)]
        assert f"| {hop} | {' | '.join(cells)} |" in RESULTS, (hop, cells)


def test_the_gpu_memory_table_is_its_file():
    """Section "What is known at SD1.5's size?": the counted GPU memory per role."""
    roles = json.loads((STUDY / "sd15_size" / "gpu_memory.json").read_text())["roles"]
    for name, prefix in (("learner", "| learner (micro-batch 4"), ("sampler", "| sampler (batch 8")):
        row = next(ln for ln in RESULTS.splitlines() if ln.strip().startswith(prefix))
        assert f"{roles[name]['activations'] / 1e9:.2f} GB" in row and f"{roles[name]['total'] / 1e9:.2f} GB |" in row, (name, row)


def test_the_time_per_stage_figures_are_the_stage_time_file():
    """Section "What is known at SD1.5's size?": the measured / predicted ratios, the achieved
    fractions of the matmul rate by resolution, and the run-over-alone ratio of the learner."""
    res = json.loads((STUDY / "sd15_size" / "stage_time" / "stage_time.json").read_text())
    section = RESULTS[RESULTS.index("**Time per stage against the FLOP model**"):]
    section = " ".join(section[: section.index("\n- Left:")].split())  # line breaks as spaces
    rows = {r["stage"].split(":")[0] + (" epoch" if "epoch" in r["stage"] else "") + (" call" if "one call" in r["stage"] else ""): r
            for r in res["rows"]}
    call, epoch = rows["sampler call"], rows["learner epoch"]
    assert f"a sampler call {call['run_s']:.2f} s / {call['predicted_s']:.2f} s ({call['measured_over_predicted']:.2f}x)" in section
    assert f"a learner epoch {epoch['run_s']:.2f} s / {epoch['predicted_s']:.2f} s ({epoch['measured_over_predicted']:.2f}x)" in section
    assert f"{res['matmul_gflops']:.1f} GFLOP/s" in section
    fractions = [f"{r['achieved_gflops'] / res['matmul_gflops']:.2f}" for r in res["scan"]]
    assert [r["resolution"] for r in res["scan"]] == [64, 128, 256, 512]
    assert (f"reaches {fractions[0]} of the matmul rate at 64 px, {fractions[1]} at 128, {fractions[2]} at 256 and "
            f"{fractions[3]} at 512 px") in section
    assert f"{epoch['run_s'] / epoch['alone_s']:.2f}x its 8" in section
    assert f"counts {res['work_flops']['learner_pair'] / res['scan'][0]['flops']:.2f}x a forward" in section


def test_the_memory_per_role_figures_are_the_role_memory_file():
    res = json.loads((STUDY / "sd15_size" / "role_memory" / "role_memory.json").read_text())
    section = RESULTS[RESULTS.index("**Both layouts finish and resume; memory per role"):]
    section = " ".join(section[: section.index("\n- **Time per stage")].split())
    model = [r["measured_over_predicted"] for r in res["rows"] if r["holds_model"]]
    assert f"the {len(model)} model-holding roles of the two runs: {min(model):.2f} to {max(model):.2f}" in section
    assert f"({sum(res['parameters'].values()):,}: {res['weights_gb']:.2f} GiB)" in section
    assert not any(abs(x - 1) > res["threshold"] for x in model) and "none beyond 25%" in section
    records = [json.loads(x) for x in (STUDY / "sd15_size" / "group_resume" / "metrics.jsonl").read_text().splitlines()]
    single = [json.loads(x) for x in (STUDY / "sd15_size" / "stage_run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["learners"] for r in records] == [2, 2, 2] and records[-1]["reward_queries_total"] == 12
    assert f"epoch 2's reward {records[2]['reward_mean']:.4f} against the single learner's {single[2]['reward_mean']:.4f}" in section


def test_the_tuning_choices_are_the_run_files():
    """Section "Against a tuned DDPO?": each cell's chosen setting, gain, settings tried and edge,
    recomputed from the tuning run files; and DDPO's clipped fractions at its JPEG choice."""
    from research.bench import tuning

    table = tuning.tuning_table(STUDY / "tuning")
    rows = tuning.choices(table)
    assert len(rows) == len(tuning.PLAN["rewards"]) * len(tuning.PLAN["variants"])  # the tuning is complete
    for line in tuning.choices_markdown(rows).splitlines()[4:]:
        assert line in RESULTS, line
    ddpo = next(r for r in rows if r["cell"] == "jpeg_compressibility / ddpo")
    fractions = []
    for seed in tuning.PLAN["tuning_seeds"]:
        job = {"stage": "tune", "reward": "jpeg_compressibility", "variant": "ddpo", "seed": seed, "setting": ddpo["setting"]}
        records = json.loads(tuning.job_path(STUDY / "tuning", job).read_text())["records"]
        fractions.append(f"{100 * np.mean([r['clipfrac'] for r in records]):.1f}%")
    text = " ".join(RESULTS.split())
    assert f"DDPO clipped {fractions[0]}, {fractions[1]} and {fractions[2]} of its per-step ratios" in text, fractions


def test_the_tuned_comparison_table_is_the_confirm_files():
    """Section "Against a tuned DDPO?": every comparison row of the answer, recomputed from the
    confirmatory run files (the bootstrap is seeded)."""
    from research.bench import tuning_answer as ta

    rows = [ln for ln in ta.markdown(ta.answer(STUDY / "tuning")).splitlines() if ln.startswith("| ") and not ln.startswith("| reward")]
    assert rows
    for line in rows:
        assert line in RESULTS, line


def test_the_recast_answer_table_is_the_study_files():
    """Section "Several rewards: does ReCAST move the front?": every comparison and front row the
    committed run files give (the cells whose runs are all there) is in RESULTS, as the answer writes it."""
    from research.bench import recast_answer as ra

    res = ra.answer(STUDY / "recast_study")
    rows = [ln for ln in ra.markdown(res).splitlines() if ln.startswith("| ") and not ln.startswith(("| mode", "|---"))]
    assert len(rows) == len(res["comparisons"]) + len(res["fronts"])
    for line in rows:
        assert line in RESULTS, line
