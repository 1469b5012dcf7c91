"""Ends a local Ray whose starter died without shutting it down (SIGKILL, the OOM killer).

Ray's raylet and actors go within seconds when the process that started a local Ray dies, but
its agents (DashboardAgent, RuntimeEnvAgent) linger for about a minute. `watch()` starts this file
as a small process in its own session; it holds the read end of a pipe whose write end only the
starter has, so end-of-file means the starter is gone. Then it ends the processes the starter
recorded and all their descendants: SIGTERM, and SIGKILL to what is left 3 s later. It also exits
once the recorded processes are gone by themselves (a normal ray.shutdown()).

Run only by watch(); it imports nothing of the package (and so none of torch).
"""
from __future__ import annotations

import os
import select
import subprocess
import sys

import psutil

GRACE_S = 3.0
POLL_S = 0.5


def watch(pids: list[int]) -> subprocess.Popen | None:
    """Start the reaper for these processes (this process's Ray children). The returned Popen's
    stdin is the pipe: keep it open for as long as this process lives."""
    if not pids:
        return None
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *map(str, pids)], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def end_tree(procs, grace_s: float = GRACE_S) -> list:
    """SIGTERM each process and its descendants, SIGKILL what is left after grace_s; the survivors."""
    everyone = {}
    for p in procs:
        try:
            for q in [p, *p.children(recursive=True)]:
                everyone[q.pid] = q
        except psutil.NoSuchProcess:
            continue
    for q in everyone.values():
        try:
            q.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(everyone.values()), timeout=grace_s)
    alive = [q for q in alive if not _zombie(q)]
    for q in alive:
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    return [q for q in alive if not _zombie(q)]  # a zombie has ended; its parent (or init) reaps it


def _zombie(p) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def main(argv: list[str]) -> int:
    procs = []
    for pid in argv:
        try:
            procs.append(psutil.Process(int(pid)))  # remembers the start time: a reused pid is not this one
        except psutil.NoSuchProcess:
            pass
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 1024):  # EOF: the starter is gone
            end_tree(procs)
            return 0
        if not any(p.is_running() for p in procs):  # a normal shutdown came first
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
