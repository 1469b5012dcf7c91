"""What Ray's results and errors mean for the run, in one line each: a finished call's outcome, an
actor's death without Ray's advice and ids, an error without traceback frames or colour codes."""
from __future__ import annotations

import re

import ray


def gcs_field(actor, field: str):
    """A field of the actor's GCS record (NumRestarts, State, ...); a private Ray API: None where it
    is not available."""
    try:
        from ray._private.state import actors

        return actors(actor._actor_id.hex())[field]
    except Exception:
        return None


def ray_restarts(actor) -> int | None:
    """How often Ray restarted the actor, from its GCS record."""
    n = gcs_field(actor, "NumRestarts")
    return None if n is None else int(n)


def outcome(ref):
    """(value, error, actor died) of a finished call."""
    try:
        return ray.get(ref), None, False
    except ray.exceptions.RayActorError as e:  # died, or unavailable while restarting
        return None, e, True
    except ray.exceptions.RayError as e:  # the call itself raised (RayTaskError), or its input was lost
        return None, e, False


def first_failure(refs) -> tuple[Exception, bool] | None:
    """(error, actor died) of the first of refs whose call failed, or None (each is fetched: for a
    failure path only)."""
    return next(((err, died) for _, err, died in map(outcome, refs) if err is not None), None)


def read_all(refs) -> None:
    """Fetch the other results of a failed call (their errors too), so Ray does not log them as unhandled."""
    for r in refs:
        outcome(r)


def with_hint(message: str, hint: str) -> str:
    """The resume hint on the message's first line (the CLI prints errors as one line)."""
    first, *rest = message.strip().splitlines() or [""]
    return "\n".join([f"{first.rstrip('.')}.{hint}", *rest])


def actor_death(text: str) -> str:
    """Ray's actor-death text, short: an error raised in the actor's creation task as that error's
    own message; otherwise the first line and the exit detail's first sentence (Ray's advice on
    resource isolation and the actor's ids are left out)."""
    text = ANSI.sub("", text)
    # an actor Ray cannot reach (its process exited, or is restarting): the cause without its ids
    unreachable = re.match(r"The actor [0-9a-f]+ is unavailable: (.*?)(?: The task may or may not have been executed on the actor\.)?$",
                           " ".join(text.split()))
    if unreachable:
        return f"unreachable: {unreachable.group(1).rstrip('.')}"
    if "creation task" in text and "  File " in text:
        return without_frames(text)
    m = re.match(r"(.*?Worker exit detail: [^.]*\.?)", text, re.S)
    if m:
        return " ".join(m.group(1).split())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else "the actor died"


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def without_frames(text: str) -> str:
    """The error's own message after the last traceback frame (its source line and carets dropped)."""
    lines = text.strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    if not frames:
        return text.strip()
    rest = lines[frames[-1] + 1:]
    while rest and rest[0].startswith("    "):  # the frame's source line and caret marks
        rest = rest[1:]
    return "\n".join(rest).strip() or text.strip()


def error_text(e: BaseException) -> str:
    """The original error's whole message, without Ray's traceback frames: a multi-line message
    (e.g. missing weights and the command that fetches them) stays whole."""
    cause = getattr(e, "cause", None)
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(cause, BaseException) and not isinstance(cause, ray.exceptions.RayError):
        return f"{type(cause).__name__}: {cause}".strip()
    if isinstance(e, ray.exceptions.RayActorError):
        return actor_death(str(e.error_msg))
    return without_frames(ANSI.sub("", str(e))) or type(e).__name__
