"""Where the actors go: each role's resource request (actors/scheduler.py role_requests) as Ray actor
options, checked against the cluster before any actor exists, and the learner group's placement
group (its ranks packed on as few nodes as fit; colocated, bundle i holds learner i and sampler i)."""
from __future__ import annotations

import os
import time

import ray

from diffrlhf.actors.ray_errors import error_text
from diffrlhf.actors.scheduler import RunFailed, resource_problems, role_requests

START_REPORT_S = 30.0  # while actors start, say every this long which are still pending and why


class Placement:
    def __init__(self, cfg):
        self.cfg = cfg
        self.requests = role_requests(cfg)  # role -> (count, {resource: per actor})
        self.learner_pg = None

    def options(self, role: str, restarts: int = 0) -> dict:
        """Ray actor options for one actor of `role`."""
        ask = dict(self.requests[role][1])
        opts = dict(num_cpus=ask.pop("CPU", 0), num_gpus=ask.pop("GPU", 0), max_restarts=restarts, max_task_retries=0)
        if ask:
            opts["resources"] = ask
        return opts

    def check(self) -> None:
        """Every role's request against what the cluster has, before any actor is created: locally
        an impossible request is an error at once; on a cluster (which may autoscale) a warning."""
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        problems = resource_problems(self.requests, ray.cluster_resources(), nodes)
        if not problems:
            return
        text = "\n  ".join(problems)
        if not os.environ.get("RAY_ADDRESS"):
            raise RunFailed(f"this local Ray can never start every actor the config asks for: {'; '.join(problems)}")
        print(f"[diffrlhf] the cluster cannot place every actor yet (waiting for it to scale, up to "
              f"system.start_timeout_s={self.cfg.system.start_timeout_s:g}s):\n  {text}")

    def start_learners(self, cls) -> list:
        """One learner, or a group in a placement group that packs its ranks on as few nodes as fit
        (PACK: one node where possible, spread over nodes where not). Colocated (system.colocate),
        bundle r holds learner r and sampler r together: with fractional GPU requests that sum to
        one, the pair time-shares one GPU (a plain PACK of 0.5-GPU learners would put two learners
        on a GPU and leave the samplers the others)."""
        s, opts = self.cfg.system, self.options("learner")
        if s.num_learners == 1 and not s.colocate:
            return [ray.remote(cls).options(**opts).remote(self.cfg)]
        from ray.util.placement_group import placement_group

        def ask(o):
            return {"CPU": o["num_cpus"], "GPU": o["num_gpus"], **o.get("resources", {})}

        bundle = ask(opts)
        if s.colocate:
            sampler = ask(self.options("sampler"))
            bundle = {k: bundle.get(k, 0) + sampler.get(k, 0) for k in {**bundle, **sampler}}
        bundle = {k: v for k, v in bundle.items() if v}
        self.learner_pg = placement_group([bundle] * s.num_learners, strategy="PACK", name=f"diffrlhf-learners-{os.getpid()}")
        world = s.num_learners
        return [ray.remote(cls).options(**opts, **self.bundle(r, learner=True)).remote(self.cfg, r, world) for r in range(world)]

    def bundle(self, i: int, learner: bool = False) -> dict:
        """Actor options placing learner i (or, colocated, sampler i) in bundle i of the learner placement group."""
        if self.learner_pg is None or not (learner or self.cfg.system.colocate):
            return {}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.learner_pg, placement_group_bundle_index=i)}

    def wait_until_started(self, names: list[tuple[str, str, object]]) -> None:
        """Every actor (name, role, handle) answered a ping: fail at once on one that cannot start
        (bad weights, missing packages), say every START_REPORT_S which are pending and what they
        ask, and stop after system.start_timeout_s."""
        timeout = self.cfg.system.start_timeout_s
        pings = {a.ping.remote(): (name, role) for name, role, a in names}
        t0 = time.time()
        while pings:
            elapsed = time.time() - t0
            step = min(START_REPORT_S - elapsed % START_REPORT_S, timeout - elapsed)
            ready, _ = ray.wait(list(pings), num_returns=1, timeout=max(step, 0.01))
            for ref in ready:
                name, _ = pings.pop(ref)
                try:
                    ray.get(ref)
                except Exception as e:
                    raise RunFailed(f"the {name} actor failed to start: {error_text(e)}") from None
            if ready:
                continue
            elapsed = time.time() - t0
            waiting = "; ".join(f"{name} (asks {fmt_resources(self.requests[role][1]) or 'nothing'})" for name, role in pings.values())
            if elapsed >= timeout:
                raise RunFailed(f"not started after {elapsed:.0f}s (system.start_timeout_s): {waiting}. The cluster has "
                                f"{fmt_resources(ray.cluster_resources())}, free now {fmt_resources(ray.available_resources())}")
            print(f"[diffrlhf] {elapsed:.0f}s: {len(pings)} actor(s) still starting (loading, or waiting for resources): "
                  f"{waiting}; free now: {fmt_resources(ray.available_resources())}")

    def release(self) -> None:
        if self.learner_pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.learner_pg)
            self.learner_pg = None


def fmt_resources(resources: dict) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items()) if v and not k.startswith(("node:", "memory", "object_store")))
