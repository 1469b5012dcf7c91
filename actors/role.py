"""What every role actor shares: busy-time accounting and its stats. Light on purpose (torch and
the standard library only): the reward actor imports it inside a package reward's own venv."""
from __future__ import annotations

import functools
import os
import resource
import time

import torch


def timed(method):
    """Accumulate the time an actor spends inside its work methods (for idle fractions)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        if self._first_call is None:
            self._first_call = t0
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy_s += time.perf_counter() - t0
            self._calls += 1

    return wrapper


class Role:
    def _init_role(self, cfg, name: str):
        """`cfg`: the run's config, or the slice of it a role reads (same attribute paths)."""
        torch.set_num_threads(cfg.system.torch_threads)
        self.cfg, self.name = cfg, name
        self._busy_s, self._calls, self._first_call = 0.0, 0, None

    def stats(self) -> dict:
        """Busy time and idle fraction since the first work call (model loading is not idling)."""
        span = time.perf_counter() - self._first_call if self._first_call else 0.0
        import ray

        ctx = ray.get_runtime_context()
        return {"role": self.name, "pid": os.getpid(), "node_id": ctx.get_node_id(), "gpu_ids": ctx.get_accelerator_ids().get("GPU", []),
                "busy_s": self._busy_s,
                "active_span_s": span, "calls": self._calls, "idle_fraction": max(0.0, 1 - self._busy_s / span) if span > 0 else 1.0,
                # this actor's peak resident memory so far (Linux reports KiB): memory per role, for sizing nodes
                "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}

    def ping(self) -> str:
        return self.name
