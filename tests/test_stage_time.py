"""research/bench/stage_time.py (issue 55 item 4): its FLOP count against the earlier independent
count, and its table's arithmetic on the committed SD1.5-size run."""
import json
from pathlib import Path

import pytest

from research.bench import split, stage_time

RUN = Path(__file__).resolve().parents[1] / "research/results/sd15_size/stage_run"


def test_a_guided_512px_unet_call_counts_the_flops_issue_18_counted():
    """SD1.5's UNet with a rank-4 LoRA on the meta device, cond + uncond at 512 px: the 1.61 TFLOP the
    layout model (research/bench/split.py) was built on, counted there by other code."""
    unet = stage_time.unet_on_meta(4)
    counted = stage_time.flops(lambda: stage_time.unet_call(unet, 2, 64, "meta", train=False))
    assert counted / 1e12 == pytest.approx(split.FORWARD_TFLOP, abs=0.005)


def test_the_table_divides_counted_flops_by_the_rate_and_reads_the_runs_own_times():
    import argparse

    from diffrlhf.deploy.cli import load_cfg

    cfg = load_cfg(argparse.Namespace(resume=str(RUN), overrides=[]))
    measured = stage_time.in_run(RUN)
    roles = json.loads((RUN / "roles.json").read_text())
    samplers = sorted(r["busy_s"] / r["calls"] for r in roles if r["role"].startswith("sampler"))
    assert measured["sampler_call_s"] == pytest.approx(sum(samplers) / 2)  # the median of two
    records = [json.loads(x) for x in (RUN / "metrics.jsonl").read_text().splitlines()]
    later = sorted(r["learner_s"] for r in records[1:])  # the first epoch (start-up) left out: 2 later epochs here
    assert len(later) == 2 and measured["learner_epoch_s"] == pytest.approx(sum(later) / 2)
    work = {"sampler_unet": 100e9, "sampler_call": 200e9, "learner_pair": 50e9, "learner_epoch": 50e9 * measured["learner_passes"]}
    alone = {"sampler_unet_s": 4.0, "learner_pair_s": 2.0}
    rows = stage_time.rows(work, 100e9, alone, measured, cfg)
    assert [r["predicted_s"] for r in rows] == pytest.approx([1.0, 2.0, 0.5, 0.5 * measured["learner_passes"]])
    assert rows[0]["measured_over_predicted"] == pytest.approx(4.0) and rows[2]["measured_over_predicted"] == pytest.approx(4.0)
    assert rows[1]["measured_over_predicted"] == pytest.approx(measured["sampler_call_s"] / 2.0)
    assert rows[3]["measured_over_predicted"] == pytest.approx(measured["learner_epoch_s"] / rows[3]["predicted_s"])


def test_the_memory_prediction_counts_sd15s_parameters_and_adds_the_modelless_process():
    """SD1.5's UNet is 859,520,964 parameters and its rank-4 attention LoRA 797,184 (measured
    before, issue 55); the prediction for a model-holding role is those fp32 bytes (with the text
    encoder's and the VAE's) plus the buffer's peak in the same run; other roles: the buffer's."""
    from research.bench import role_memory

    counted = role_memory.model_bytes(4)
    assert counted["parameters"]["unet"] == 859_520_964 + 797_184
    rows = {r["role"]: r for r in role_memory.rows_for(RUN, counted["fp32_bytes"])}
    buffer = rows["buffer"]["peak_rss_gb"]
    assert rows["learner"]["predicted_gb"] == pytest.approx(buffer + 4 * sum(counted["parameters"].values()) / 2**30)
    assert rows["reward-0"]["predicted_gb"] == buffer and not rows["reward-0"]["holds_model"]
