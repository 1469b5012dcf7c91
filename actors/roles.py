"""The run's actors by name, as the driver reports on them: Ray's restarts of each (its GCS count,
which also sees restarts between calls), one line per new one; each actor's own stats at the end."""
from __future__ import annotations

import ray

from diffrlhf.actors.ray_errors import error_text, ray_restarts


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
