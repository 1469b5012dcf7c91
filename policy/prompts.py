"""Prompt lists and the deterministic plan of what each sampler batch generates.

A batch is fully determined by (run seed, epoch, batch index): its prompts, the noise seed of
each trajectory and the sample ids. Any sampler can therefore run any batch, a lost batch can be
re-run identically, and the distributed system reproduces the single-process reference loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diffrlhf.tinyworld.scenes import captions

PROMPT_DIR = Path(__file__).parent / "prompts"


def _read_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def builtin_prompt_lists() -> list[str]:
    return sorted(["tiny-world-train", "tiny-world-eval", "imagenet_animals"] + [p.stem for p in PROMPT_DIR.glob("*.txt")])


def load_prompts(source: str) -> list[str]:
    """A builtin list name (see builtin_prompt_lists) or a text file with one prompt per line."""
    if source in ("tiny-world-train", "tiny-world-eval"):
        return captions("train" if source.endswith("train") else "heldout")
    if source == "imagenet_animals":  # DDPO's task: the first 398 ImageNet classes are animals
        return _read_lines(PROMPT_DIR / "imagenet_classes.txt")[:398]
    path = PROMPT_DIR / f"{source}.txt"
    if not path.exists():
        path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"prompt list {source!r} is neither a builtin list ({', '.join(builtin_prompt_lists())}) nor an existing file "
            f"(looked at {path.resolve()}); give a text file with one prompt per line"
        )
    prompts = _read_lines(path)
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts (one prompt per non-empty line)")
    return prompts


@dataclass(frozen=True)
class BatchPlan:
    epoch: int
    batch_index: int
    prompts: list
    seeds: list
    sample_ids: list
    # B2-DiffuRL's branch sampling: the samples_per_prompt rows of a prompt share their first
    # branch_step DDIM steps (policy/branching.py sample_branched); None: independent samples.
    branch_step: int | None = None
    group_size: int = 1


def plan_batch(prompt_list: list[str], run_seed: int, epoch: int, batch_index: int, batch_size: int,
               batches_per_epoch: int, samples_per_prompt: int = 1, branch_step: int | None = None) -> BatchPlan:
    """What batch `batch_index` of `epoch` samples: prompts (each repeated samples_per_prompt times),
    per-trajectory noise seeds and globally unique sample ids; with branch_step, a prompt's rows
    branch from one shared prefix of that many steps (their sample ids are consecutive, the first a
    multiple of samples_per_prompt)."""
    rng = np.random.default_rng([run_seed, epoch, batch_index])
    n_prompts = batch_size // samples_per_prompt
    chosen = [prompt_list[i] for i in rng.integers(0, len(prompt_list), n_prompts)]
    prompts = [p for p in chosen for _ in range(samples_per_prompt)]
    first = (epoch * batches_per_epoch + batch_index) * batch_size
    ids = list(range(first, first + batch_size))
    seeds = [run_seed * 1_000_000_007 + i for i in ids]
    return BatchPlan(epoch, batch_index, prompts, seeds, ids, branch_step, samples_per_prompt if branch_step is not None else 1)
