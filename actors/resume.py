"""Continuing a run: the checkpoint state it resumes from (checked before any actor starts) and the
one-line hint a failed run ends with (where its last checkpoint is and the command that resumes)."""
from __future__ import annotations

from pathlib import Path

from diffrlhf.actors.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from diffrlhf.actors.scheduler import EpochScheduler, RunFailed


def resume_from(cfg, run_dir: Path, resume: bool, state: dict | None) -> tuple[dict | None, EpochScheduler | None]:
    """(the state to continue from, its scheduler), or (None, None) for a new run. `state` given
    wins; resume=True loads it from run_dir."""
    if state is None and resume:
        try:
            state = load_checkpoint(run_dir)
        except CheckpointError as e:
            raise RunFailed(f"cannot resume: {e}") from None
    if state is None:
        return None, None
    if "versions" not in state:
        raise RunFailed(f"cannot resume from {run_dir / 'checkpoint'}: it was written before checkpoints held the policy "
                        f"versions the next epochs are sampled with; start a new run")
    sched = EpochScheduler.from_config(cfg, state)
    missing = sorted(set(sched.needed_versions()) - set(state["versions"]))
    if missing:
        raise RunFailed(f"cannot resume: with system.max_policy_lag={cfg.system.max_policy_lag} the next epochs are "
                        f"sampled with policy versions {sched.needed_versions()}, the checkpoint holds {sorted(state['versions'])}; "
                        f"resume with the run's own max_policy_lag ({state['config']['system']['max_policy_lag']})")
    return state, sched


def resume_hint(cfg, run_dir: Path) -> str:
    found = latest_checkpoint(run_dir)
    if found is None:
        return " No checkpoint was written yet: start the run again."
    path, epochs = found
    done = f" ({epochs} of {cfg.train.epochs} epochs done)" if epochs is not None else ""
    return f" The last checkpoint{done} is {path}; continue with: diffrlhf train --resume {run_dir}"


def carry_counters(live: dict, restored: dict) -> dict:
    """The counters after an in-run restore (a learner or the buffer died): the epochs, samples and
    trained queries as the checkpoint holds them; every query the reward actors answered stays in
    the total (paid for), and those answered since the checkpoint join reward_queries_lost (they are
    asked again); the deaths and retries seen so far stay, plus the core role's death."""
    c = dict(restored)
    since = live["reward_queries_total"] - restored["reward_queries_total"]
    c["reward_queries_total"] = live["reward_queries_total"]
    c["reward_queries_lost"] = restored["reward_queries_lost"] + since
    c["actor_deaths"] = live["actor_deaths"] + 1
    for k in ("sample_retries", "score_retries"):
        c[k] = live[k]
    return c


def restore_point(run_dir: Path) -> tuple[dict | None, int]:
    """The state an in-run restore continues from (None: the start) and its epochs done."""
    state = load_checkpoint(run_dir) if latest_checkpoint(run_dir) else None
    return state, int(state["counters"]["epochs_done"]) if state else 0


def restore_line(e: Exception, epochs_done: int, restart: int, cfg, kept_workers: bool = False) -> str:
    """One line for an in-run restore: what died, what is restored (the learner and buffer, the
    samplers and reward actors kept; or every role), from where, which restart of how many."""
    where = f"the checkpoint at epoch {epochs_done} of {cfg.train.epochs}" if epochs_done else "the start (no checkpoint yet)"
    what = "the learner and buffer (the samplers and reward actors kept)" if kept_workers else "every role"
    return (f"{e}; restoring {what} from {where}, within the run "
            f"(restart {restart} of system.max_core_restarts={cfg.system.max_core_restarts})")
