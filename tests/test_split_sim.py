"""The SIMULATED split-vs-colocated model (research/bench/split.py), the colocated preset's placement,
and the learner-group benchmark's bookkeeping (research/bench/learner_group.py).

The model tests assert properties that break when the model does: the closed forms at zero
overheads, where the best split sits, monotonicity, and which way the split moves with
timestep_fraction and a reward on the GPUs. No Ray, no torch model: well under 5 s.
"""
import math

import pytest

from research.bench import split as sim

BUDGETS = [2, 3, 4, 5, 8, 12, 16, 24, 32, 64]
FRACTIONS = [1.0, 0.5, 0.25]


def free(fraction, reward=0.0, placement="separate"):
    """Costs with no broadcast and no all-reduce (S = 1)."""
    return sim.costs_for(fraction, reward, placement=placement)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_zero_overheads_closed_forms(fraction):
    for g in BUDGETS:
        c = free(fraction)
        s, u = c.sample_s, c.update_s
        assert sim.colocated_ddp(c, g) == pytest.approx(g / (s + u), rel=1e-12)
        assert sim.colocated_ray(c, g) == pytest.approx(g / (s + u), rel=1e-12)
        best = sim.best_split(c, g)
        # g_l / g_s = U / S at the continuous optimum; whole GPUs land within one of it
        assert abs(best["learners"] - g * u / (s + u)) <= 1, (g, best)
        assert best["samples_per_s"] == pytest.approx(max(min(gs / s, (g - gs) / u) for gs in range(1, g)), rel=1e-12)
        # two stages sharing G GPUs never beat every GPU doing both (no reward to hide)
        assert best["samples_per_s"] <= g / (s + u) * (1 + 1e-12)


def test_a_whole_split_of_u_to_s_matches_colocated_ddp_exactly():
    # U = S (timestep_fraction 1 / 2.13): the ideal split is half and half, a whole number for even G
    c = free(1 / sim.UPDATE_OVER_SAMPLE)
    assert c.update_s == pytest.approx(c.sample_s)
    for g in (2, 4, 8, 16, 64):
        best = sim.best_split(c, g)
        assert (best["samplers"], best["learners"]) == (g // 2, g // 2)
        assert best["samples_per_s"] == pytest.approx(sim.colocated_ddp(c, g), rel=1e-12)


@pytest.mark.parametrize("placement", sim.PLACEMENTS)
@pytest.mark.parametrize("reward", [0.0, 0.1, 0.5])
def test_throughput_is_monotone_in_budget(placement, reward):
    for fraction in FRACTIONS:
        c = sim.costs_for(fraction, reward, placement=placement, broadcast_s=0.05, allreduce=sim.AllReduce())
        for fn in (lambda g: sim.best_split(c, g)["samples_per_s"], lambda g: sim.colocated_ddp(c, g), lambda g: sim.colocated_ray(c, g)):
            ys = [fn(g) for g in range(2, 65)]
            assert all(b > a for a, b in zip(ys, ys[1:])), ys


def test_halving_timestep_fraction_moves_the_best_split_toward_samplers():
    for placement in sim.PLACEMENTS:
        for reward in (0.0, 0.5):
            for hi, lo in ((1.0, 0.5), (0.5, 0.25)):
                moved = []
                for g in BUDGETS:
                    a = sim.best_split(sim.costs_for(hi, reward, placement=placement), g)
                    b = sim.best_split(sim.costs_for(lo, reward, placement=placement), g)
                    assert b["samplers"] >= a["samplers"], (placement, reward, hi, g, a, b)
                    moved.append(b["samplers"] > a["samplers"])
                assert sum(moved) >= len(BUDGETS) // 2  # and strictly, at most budgets


def test_the_reward_where_it_runs():
    g = 16
    for fraction in FRACTIONS:
        sep0, sep = free(fraction, 0.0), free(fraction, 0.5)
        # on its own hardware: the pipelined layouts do not pay it, DDP does, in sequence
        assert sim.best_split(sep, g) == sim.best_split(sep0, g)
        assert sim.colocated_ray(sep, g) / sim.colocated_ddp(sep, g) == pytest.approx(
            (sep.sample_s + sep.reward_s + sep.update_s) / (sep.sample_s + sep.update_s))
        # on the budget's GPUs: everyone pays it, and the split moves toward samplers
        sh = free(fraction, 0.5, "shared")
        assert sim.colocated_ray(sh, g) == pytest.approx(sim.colocated_ddp(sh, g))
        assert sim.best_split(sh, g)["samplers"] >= sim.best_split(sep0, g)["samplers"]
        assert sim.best_split(sh, g)["samples_per_s"] < sim.best_split(sep0, g)["samples_per_s"]


def test_overheads_cost_throughput_where_they_sit():
    c = free(1.0)
    g_s, g_l = 5, 11  # sampler-bound at 16 GPUs
    assert sim.disaggregated(c, g_s, g_l)["bound_by"] == "samplers"
    slow_bc = sim.costs_for(1.0, broadcast_s=1.0)
    assert sim.disaggregated(slow_bc, g_s, g_l)["samples_per_s"] < sim.disaggregated(c, g_s, g_l)["samples_per_s"]
    assert sim.colocated_ddp(slow_bc, 16) == sim.colocated_ddp(c, 16)  # DDP has no broadcast
    ar = sim.AllReduce(fixed_s=0.5)
    slow_ar = sim.costs_for(1.0, allreduce=ar)
    assert sim.colocated_ddp(slow_ar, 16) < sim.colocated_ddp(c, 16)
    assert sim.disaggregated(slow_ar, 15, 1)["learner_stage_s"] == sim.disaggregated(c, 15, 1)["learner_stage_s"]  # one learner: no collective
    # the ring model: zero for one rank, growing with ranks and bytes, slower across nodes
    ring = sim.AllReduce()
    assert ring(1) == 0 and 0 < ring(2) < ring(8) < ring(9) < ring(64)
    assert sim.AllReduce(nbytes=2 * ring.nbytes)(8) > ring(8)


def test_calibration_and_report_are_labelled():
    assert sim.UPDATE_OVER_SAMPLE == pytest.approx(3.43 / 1.61) and 2.1 < sim.UPDATE_OVER_SAMPLE < 2.2
    assert sim.sample_seconds(989, 0.4) == pytest.approx(50 * 1.61 / (989 * 0.4))
    res = sim.run(budgets=(4, 16), fractions=(1.0, 0.25), rewards=(0.0, 0.5), figure_budget=8)
    assert res["SIMULATED"] and "no GPU" in res["calibration"]
    rows = res["tables"]["separate"]
    assert len(rows) == 2 * 2 * 2 and all(r["placement"] == "separate" for r in rows)
    four = next(r for r in rows if r["budget"] == 4 and r["timestep_fraction"] == 1.0 and r["reward_over_sample"] == 0.0)
    # U / S = 2.13 on 4 whole GPUs: 1 sampler : 3 learners, bound by the one sampler: 1 / S against 4 / (S + U)
    assert four["best_split"] == "1:3" and four["disaggregated_over_ddp"] < 1
    assert four["disaggregated_over_ddp"] == pytest.approx((1 + sim.UPDATE_OVER_SAMPLE) / 4, rel=0.02)
    md = sim.markdown(res)
    assert md.count("SIMULATED") >= 2 and "**(below)**" in md and "not from a GPU" in md
    assert len(res["figure"]["panels"]) == 2 and len(res["figure"]["panels"][0]["lines"][0]["splits"]) == 7


def test_disaggregated_needs_both_roles():
    with pytest.raises(ValueError, match="at least one sampler GPU and one learner GPU"):
        sim.disaggregated(free(1.0), 4, 0)
    with pytest.raises(ValueError, match="placement"):
        sim.costs_for(1.0, placement="elsewhere")


# ----------------------------------------------------------------------------- the colocated preset


def test_colocated_preset_fits_four_one_gpu_nodes_and_not_three():
    from diffrlhf.actors.scheduler import resource_problems, role_requests
    from diffrlhf.deploy.config import load_config

    cfg = load_config("sd15-colocated")
    s = cfg.system
    assert (s.num_samplers, s.sampler_gpus, s.num_learners, s.learner_gpus) == (4, 0.5, 4, 0.5)
    req = role_requests(cfg)
    assert req["sampler"] == (4, {"CPU": 1.0, "GPU": 0.5}) and req["learner"] == (4, {"CPU": 1.0, "GPU": 0.5})
    assert "GPU" not in req["reward"][1]
    node = {"CPU": 8.0, "GPU": 1.0}
    assert resource_problems(req, {"CPU": 32.0, "GPU": 4.0}, [node] * 4) == []
    assert resource_problems(req, {"CPU": 16.0, "GPU": 4.0}, [{"CPU": 16.0, "GPU": 4.0}]) == []  # one 4-GPU node
    problems = resource_problems(req, {"CPU": 24.0, "GPU": 3.0}, [node] * 3)
    assert len(problems) == 1 and "all roles together ask 4 GPU (4 samplers x 0.5 = 2, 4 learners x 0.5 = 2), the cluster has 3 GPU" in problems[0]
    # the same optimizer step as sd15-ddpo: 64 samples, 4 steps per epoch of 256
    ddpo = load_config("sd15-ddpo")
    assert cfg.train.batch_size * cfg.train.grad_accum_steps == ddpo.train.batch_size * ddpo.train.grad_accum_steps == 64
    assert cfg.samples_per_epoch() == ddpo.samples_per_epoch() == 256


def test_fractional_gpus_are_config_values_and_checked_per_actor():
    from diffrlhf.actors.scheduler import resource_problems, role_requests
    from diffrlhf.deploy.config import ConfigError, load_config

    cfg = load_config("tiny", overrides=["system.sampler_gpus=0.25", "system.learner_gpus=0.75"])
    assert cfg.system.sampler_gpus == 0.25 and role_requests(cfg)["learner"][1]["GPU"] == 0.75
    with pytest.raises(ConfigError, match="system.sampler_gpus"):
        load_config("tiny", overrides=["system.sampler_gpus=-0.5"])
    # 2 x 0.25 + 1 x 0.75 = 1.25 GPU: one 1-GPU node is short; a 0.75-GPU ask needs a node with that much
    assert any("1.25 GPU" in p for p in resource_problems(role_requests(cfg), {"CPU": 8, "GPU": 1}, [{"CPU": 8, "GPU": 1}]))
    assert resource_problems(role_requests(cfg), {"CPU": 16, "GPU": 2}, [{"CPU": 8, "GPU": 1}] * 2) == []


# ----------------------------------------------------------------------------- the learner-group benchmark


def _rank_rows(times, cpu=0.5):
    return [{"batch": i, "rows": 8, "order": ["solo", "group"], "warmup": i == 0, "solo_s": s, "group_s": g,
             "solo_cpu_s": cpu, "group_cpu_s": cpu} for i, (s, g) in enumerate(times)]


def test_learner_group_summary_takes_the_slower_rank_and_skips_the_warmup():
    from research.bench import learner_group as lg

    ar = {"tiny": {"params": 10, "tensors": 2, "sum_grads_s": [0.002, 0.004], "flat_sum_s": [0.001, 0.001]}}
    r0 = {"rows": _rank_rows([(9.0, 9.0), (2.0, 1.0), (2.0, 1.2)]), "allreduce": ar, "lora_max_abs_diff": 1e-6, "lora_max_abs_value": 0.5}
    r1 = {"rows": _rank_rows([(0.0, 9.0), (0.0, 1.25), (0.0, 1.0)], cpu=0.01),
          "allreduce": {"tiny": {**ar["tiny"], "sum_grads_s": [0.003, 0.001]}}}
    s = lg.summarize([r0, r1])
    assert [r["batch"] for r in s["repeats"]] == [1, 2]
    assert [r["group_s"] for r in s["repeats"]] == [1.25, 1.2]
    assert s["single_traj_per_s_median"] == pytest.approx(4.0)
    assert s["group_traj_per_s_median"] == pytest.approx((8 / 1.25 + 8 / 1.2) / 2)
    assert s["speedup_median"] == pytest.approx(s["group_traj_per_s_median"] / 4.0) and s["efficiency"] == pytest.approx(s["speedup_median"] / 2)
    assert s["repeats"][0]["idle_rank_cpu_s_during_single"] == 0.01 and s["repeats"][0]["group_cpu_s"] == pytest.approx(0.51)
    a = s["allreduce"]["tiny"]
    assert a["sum_grads_median_s"] == pytest.approx(0.0035) and a["sum_grads_min_s"] == 0.003 and a["repeats"] == 2
    res = {"summary": s, "mode": "quick", "machine": {"cpu_count": 2, "load_average": [1.0, 1.0, 1.0]}, "load_average_after": [2.0, 2.0, 2.0],
           "config": {"threads": 1, "model": "tiny-random", "num_steps": 3, "resolution": 32, "rows_per_update": 8, "train_batch_size": 4,
                      "grad_accum_steps": 1, "timestep_fraction": 1.0, "weighting": "ddim_std"}}
    md = lg.markdown(res)
    assert "REAL" in md and "--quick" in md and "the tiny model's LoRA" in md


@pytest.mark.slow  # two processes that each import diffusers/peft and build the tiny model twice: 40-90 s on the shared 2 cores
def test_learner_group_bench_quick_runs(tmp_path):
    from research.bench import learner_group as lg

    res = lg.main(["--quick", "--repeats", "1", "--allreduce-repeats", "1", "--out", str(tmp_path)])
    s = res["summary"]
    assert (tmp_path / "learner_group.json").exists() and (tmp_path / "learner_group.md").exists()
    assert len(s["repeats"]) == 1 and s["single_traj_per_s_median"] > 0 and s["group_traj_per_s_median"] > 0
    assert s["repeats"][0]["single_stats"]["optimizer_steps"] == s["repeats"][0]["group_stats"]["optimizer_steps"] == 2
    assert s["lora_max_abs_diff"] < 1e-3 * max(s["lora_max_abs_value"], 1e-6) + 1e-4
    assert s["allreduce"]["sd15_rank4"]["params"] == 797_184 and s["allreduce"]["sd15_rank32"]["params"] == 8 * 797_184
    assert all(math.isfinite(a["sum_grads_median_s"]) for a in s["allreduce"].values())
