"""The run's actors by name, as the driver reports on them: Ray's restarts of each (its GCS count,
which also sees restarts between calls), one line per new one; each actor's own stats at the end."""
from __future__ import annotations

import ray

from diffrlhf.actors.ray_errors import error_text, gcs_field, ray_restarts


def check_restarts(named_actors: list[tuple[str, object]], seen: dict[str, int], max_restarts: int) -> int:
    """Update `seen` (name -> restarts so far) from Ray, saying each new restart once; the total."""
    for name, actor in named_actors:
        n = ray_restarts(actor)
        if n is not None and n > seen.get(name, 0):
            print(f"[diffrlhf] {name} was restarted by Ray ({n} restart{'s' * (n > 1)} of system.max_actor_restarts={max_restarts})")
            seen[name] = n
    return sum(seen.values())


def role_stats(named_actors: list[tuple[str, object]], restarts: dict[str, int]) -> list[dict]:
    """Each actor's stats (busy time, memory, queries) with its restarts; a dead actor's error instead."""
    out = []
    for name, a in named_actors:
        try:
            out.append({**ray.get(a.stats.remote(), timeout=30), "ray_restarts": restarts.get(name, 0)})
        except Exception as e:  # a dead actor has no stats; say so rather than fail the run
            out.append({"role": name, "error": error_text(e), "ray_restarts": restarts.get(name, 0)})
    return out


def keeps_workers(cfg, workers: list) -> bool:
    """Whether an in-run restore keeps the samplers and reward actors: not when colocated (they share
    the learners' placement group, which goes with them), nor when one is dead for good or its
    state cannot be read (then every role starts afresh, as a resume would)."""
    return not cfg.system.colocate and bool(workers) and all(ray_state(a) not in (None, "DEAD") for a in workers)


def ray_state(actor) -> str | None:
    """The actor's state in Ray's GCS (ALIVE, RESTARTING, DEAD, ...); None where it cannot be read."""
    return gcs_field(actor, "State")


def stop_core_roles(core: list, samplers: list, queued: list) -> None:
    """An in-run restore that keeps the samplers and reward actors: the core roles (learners, buffer)
    killed, the kept actors' queued calls of the lost epochs cancelled (one already running finishes;
    its result is ignored), and the samplers' weights forgotten: the restored learner makes them again."""
    for a in core:
        ray.kill(a, no_restart=True)
    for ref in queued:
        try:
            ray.cancel(ref)
        except Exception:  # finished, or its actor gone: nothing left to cancel
            pass
    for a in samplers:
        a.forget_weights.remote()


def restarts_after_restore(seen: dict[str, int], kept: list[str], n: int) -> dict[str, int]:
    """Ray's restart counts after in-run restore n: a kept actor's count goes on under its name; a
    replaced one's is kept (still summed) under '<name> (before restore n)'."""
    return {name if name in kept else f"{name} (before restore {n})": k for name, k in seen.items()}
