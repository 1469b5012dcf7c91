"""Benchmarks (issue 6, "Measure it"). Each is a command that writes JSON (+ PNG for curves) into
research/results/<name>/ or --out:

    python -m research.bench.study    sample efficiency: DDPO vs timestep weighting vs hard-mining
    python -m research.bench.systems  Ray overhead, stage overlap, simulated scaling, weight broadcast
    python -m research.bench.gpu      SD1.5-size images/s and fraction of GPU peak (random weights)
    python -m research.bench.split    SIMULATED sampler:learner GPU splits vs colocated layouts (SD1.5 FLOP counts)
    python -m research.bench.learner_group  a learner group of 2 vs 1 learner, and the all-reduce (CPU, gloo)
    python -m research.bench.variance  per-step reward variance by branching, against the timestep weightings
    python -m research.bench.alignment_check  the tinyworld_alignment reward's per-attribute accuracy and cost

Every command takes --size tiny (tiny-random model, a few DDIM steps, 32 px: seconds, for tests)
or --size full (the real measurement; see RESULTS-bench.md for the commands and what they show).
"""
