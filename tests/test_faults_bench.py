"""The fault-injection benchmark (research/bench/faults.py): its table from hand-made runs, and a
sampler kill on the tiny size that must survive with the reference's LoRA."""
import json

import pytest
import torch

from research.bench.faults import compare, lora_diff, next_epoch_after, plot, summarise, table_markdown


def fake_run(kind, queries=(8, 16), means=(0.5, 0.6), lora=0.0, injected=True, total=None, stops=(), elapsed=12.0):
    recs = [{"epoch": e, "reward_queries": q, "reward_mean": m, "reward_queries_total": q, "reward_queries_lost": 0,
             "batches_dropped": 0, "actor_deaths": int(injected), "sample_retries": 1, "score_retries": 0}
            for e, (q, m) in enumerate(zip(queries, means))]
    if total is not None:
        recs[-1]["reward_queries_total"] = total
    run = {"kind": kind, "injected": injected, "stops": list(stops), "resumes": len(stops), "elapsed_s": elapsed,
           "records": recs, "epoch_done_s": {0: 4.0, 1: 9.0}, "survived": len(recs) == 2,
           "lora": {"a": torch.full((2, 2), lora), "b": torch.zeros(3)} if len(recs) == 2 else None}
    if injected:
        run["at"] = {"epochs_done": 0, "t": 0.0, "s_after_start": 3.0}
    return run


def test_rows_summary_and_figure_from_hand_made_runs(tmp_path):
    ref = fake_run(None, injected=False, elapsed=10.0)
    stop = {"error_type": "RunFailed", "error": "the learner actor died: x. ... diffrlhf train --resume r", "names_resume": True,
            "epochs_done": 0, "queries_untrained": 8}
    runs = [fake_run("sampler"), fake_run("sampler", lora=1e-3, means=(0.5, 0.7)),
            fake_run("learner", stops=[stop], total=24),  # a query counted twice
            fake_run("learner", queries=(8,), means=(0.5,), stops=[stop, stop]),  # the resume failed too
            fake_run("learner", injected=False), {**fake_run("driver", injected=False), "note": "the interrupt reached no code"}]
    rows = [compare(r, ref, epochs=2) for r in runs]
    ok, drifted, twice, failed, missed, undelivered = rows
    assert ok["survived"] and ok["lora_equal"] and ok["rewards_equal"] and ok["queries_equal"] and ok["queries_double"] == 0
    assert ok["extra_s"] == pytest.approx(2.0) and ok["to_next_epoch_s"] == pytest.approx(1.0)  # kill at 3 s, epoch 0 at 4 s
    assert ok["ref_to_next_epoch_s"] == pytest.approx(1.0) and (ok["kill_epoch"], ok["kill_s"]) == (0, 3.0)
    assert not drifted["lora_equal"] and drifted["lora_max_diff"] == pytest.approx(1e-3) and not drifted["rewards_equal"]
    assert twice["queries_double"] == 8 and twice["queries_remade"] == 8 and twice["queries_equal"]
    assert not failed["survived"] and not failed["queries_equal"] and failed["lora_max_diff"] is None and not failed["lora_equal"]
    assert missed["survived"] is None  # not injected: not counted as survived
    s = {x["kind"]: x for x in summarise(rows, ["sampler", "learner", "driver"])}
    assert (s["sampler"]["injected"], s["sampler"]["survived"], s["sampler"]["lora_equal"]) == (2, 2, 1)
    assert (s["learner"]["planned"], s["learner"]["injected"], s["learner"]["survived"]) == (3, 2, 1)
    assert s["learner"]["queries_double"] == 8 and s["learner"]["queries_remade"] == 8 + 16
    assert s["sampler"]["lora_max_diff"] == pytest.approx(1e-3) and s["driver"]["injected"] == 0
    res = {"size": "tiny", "epochs": 2, "n": 2, "seed": 0, "window": [0.15, 0.85], "rows": rows,
           "summary": summarise(rows, ["sampler", "learner", "driver"]),
           "reference": {"elapsed_s": 10.0, "wall_s": 9.0, "reward_queries": 16, "reward_means": [0.5, 0.6]}}
    md = table_markdown(res)
    header = next(line for line in md.splitlines() if line.startswith("| fault"))
    for col in ("survived", "batches dropped", "queries = ref", "counted twice", "LoRA = ref", "extra time", "kill -> next epoch"):
        assert col in header
    assert "| sampler | 2 | 0, 3.0 | yes | 0 | yes (16/16) | 0 | 0 (0) | **no** | **no** (1.0e-03) |" in md
    assert "| learner | 3 | not injected: the run ended first | - |" in md
    assert "| driver | 1 | not injected: the interrupt reached no code | - |" in md
    assert "| **learner: all** | 2/3 | injected | 1/2 |" in md and "names `--resume`: yes" in md
    res["reference"]["epoch_done_s"] = {0: 4.0, 1: 9.0}
    plot(json.loads(json.dumps(res, default=float)), tmp_path / "faults.png")  # as --report-only reads it back
    assert (tmp_path / "faults.png").stat().st_size > 0


def test_lora_diff_and_next_epoch():
    a = {"x": torch.zeros(2), "y": torch.ones(1)}
    assert lora_diff(a, {"x": torch.tensor([0.0, -0.25]), "y": torch.ones(1)}) == pytest.approx(0.25)
    assert lora_diff(a, {"x": torch.zeros(2)}) == float("inf") and lora_diff(a, {"x": torch.zeros(3), "y": torch.ones(1)}) == float("inf")
    assert next_epoch_after({0: 4.0, 1: 9.0}, 5.0) == pytest.approx(4.0) and next_epoch_after({0: 4.0}, 5.0) is None


@pytest.mark.slow  # ~60 s of Ray runs; the system's own tests (test_system, test_multinode) cover sampler deaths
def test_tiny_sampler_kill_survives_with_the_reference_lora(tmp_path):
    """Two tiny Ray runs (~60 s, mostly actor start-up). The kill lands early (20-50% of the run),
    while both samplers still have batches to do, and is held until a call of the sampler is running
    (--when busy: a kill between calls is seen by Ray alone), so the driver must see the death and retry."""
    pytest.importorskip("ray")
    from research.bench import faults

    res = faults.main(["--size", "tiny", "--epochs", "3", "--n", "1", "--kinds", "sampler", "--window", "0.2", "0.5",
                       "--when", "busy", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "faults.json").read_text())
    assert [r["kind"] for r in data["rows"]] == ["sampler"] and data["reference"]["reward_queries"] == 3 * 8
    (row,) = res["rows"]
    assert row["injected"], "the kill came after the run had finished: the window is relative to the reference's wall time"
    assert row["actor_deaths"] == 1 and row["sample_retries"] >= 1, "the driver never saw the sampler die"
    assert row["ray_restarts"] in (1, None)  # None: Ray's private actor table is unavailable
    assert row["survived"] and row["batches_dropped"] == 0 and row["queries_equal"] and row["queries_double"] == 0
    assert row["rewards_equal"] and row["lora_equal"], row
    md = (tmp_path / "faults.md").read_text()
    assert "| sampler | 1 |" in md and "| **sampler: all** | 1/1 | injected | 1/1 |" in md
    assert (tmp_path / "faults.png").exists()
