"""Ray for a run: connect to the cluster (RAY_ADDRESS) or start a local Ray sized for the config,
with a watcher that ends that local Ray within seconds if this process dies (actors/reaper.py)."""
from __future__ import annotations

import logging
import os

import psutil
import ray

from diffrlhf.actors.ray_errors import ANSI
from diffrlhf.actors.reaper import watch
from diffrlhf.actors.scheduler import local_resources


def init_ray(cfg, num_gpus: float | None = None, quiet: bool = True):
    """Connect to RAY_ADDRESS (cluster, `ray job submit`) or start a local Ray sized for the config."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=not quiet)
        return
    # Ray 2.60 turns token authentication on by default and says so on every local start: a notice
    # about the safe default, not a warning for the user (its "disabled" warning stays). Setting
    # RAY_AUTH_MODE here would not do: Ray reads it at import, and a mismatch fails the start.
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_not_the_auth_default_notice)
    # Logical CPUs: enough for every actor to be placed; torch threads per actor keep real use in check.
    # The dashboard (and the metrics it shows) costs ~0.5 GB: opt in locally with DIFFRLHF_DASHBOARD=1.
    ray.init(address="local", num_cpus=int(local_resources(cfg)["CPU"]), num_gpus=num_gpus,
             include_dashboard=os.environ.get("DIFFRLHF_DASHBOARD") == "1", log_to_driver=not quiet,
             logging_level=logging.WARNING if quiet else logging.INFO)
    _watch_local_ray()


def _not_the_auth_default_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


_reapers: list = []  # the reaper processes' pipes: open for as long as this process lives


def _watch_local_ray() -> None:
    """Have a local Ray ended within seconds if this process dies without shutting it down
    (actors/reaper.py); Ray's own clean-up leaves its agents for about a minute."""
    mine = {r.pid for r in _reapers}
    ray_procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in mine and "ray" in " ".join(p.cmdline()):
                ray_procs.append(p.pid)
        except psutil.Error:
            continue
    reaper = watch(ray_procs)
    if reaper is not None:
        _reapers.append(reaper)


def route_ray_messages(log_path, echo: bool = False) -> None:
    """Ray's own messages to the driver (the raylet's "A worker died or was killed ...", several hundred
    characters in colour) go to `log_path`, without colour codes, instead of the console: the driver
    says each event in one line of its own. echo (--debug) prints them as well, as Ray would.

    Ray prints them from a background thread through ray._private.worker.print_to_stdstream (a
    private API: where it is missing this does nothing)."""
    from ray._private import worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None:
        return
    original = getattr(original, "diffrlhf_original", original)

    def to_log(data, ignore_prefix: bool):
        with open(log_path, "a") as f:
            for line in data.get("lines", []):
                f.write(f"({data.get('pid', '')}) {ANSI.sub('', str(line))}\n")
        if echo:
            original(data, ignore_prefix)

    to_log.diffrlhf_original = original
    ray_worker.print_to_stdstream = to_log
