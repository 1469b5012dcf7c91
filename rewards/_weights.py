"""Finding reward-model weight files offline, and the error raised when they are absent.

Runs never download: a reward looks in the path given in its spec, then in the caches the
upstream packages use, and otherwise raises MissingWeightsError telling the user how to fetch
the file explicitly (`diffrlhf fetch-weights NAME`).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import quote
from typing import Iterable, Sequence

def cache_dir() -> Path:
    """The project's one cache root: $DIFFRLHF_CACHE, else ~/.cache/diffrlhf. `diffrlhf fetch-weights`
    puts reward weights here (searched by every reward), and built tiny models live here. Read at
    each call so a changed environment (tests, a Ray actor's env) is honoured."""
    return Path(os.environ.get("DIFFRLHF_CACHE", Path.home() / ".cache" / "diffrlhf"))


class MissingWeightsError(FileNotFoundError):
    """A reward model's weight file is not on disk. The message names the file, every place that
    was searched, and the command that downloads it."""

    def __init__(self, reward: str, filename: str = "", searched: Sequence[str] = (), hint: str | None = None):
        self.reward, self.filename, self.searched, self.hint = reward, filename, list(searched), hint
        # One line: the CLI prints errors as one line.
        self.message = (f"reward {reward!r}: weight file {filename!r} not found (runs never download); looked in "
                        f"{_places(self.searched, filename) or 'nowhere'}. Get it with `diffrlhf fetch-weights {reward}`, or pass a local "
                        f"path in the reward spec, e.g. {{'name': '{reward}', 'weights': '/path/to/{filename}'}}"
                        + (f". {hint}" if hint else ""))
        super().__init__(self.message)

    # OSError formats str() from errno/strerror; we want our message. __reduce__ keeps the
    # exception intact when Ray ships it from the reward actor to the caller.
    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return (type(self), (self.reward, self.filename, self.searched, self.hint))


def _places(searched: Sequence[str], filename: str) -> str:
    """The searched places, short: the folders searched for `filename` each once (its URL-quoted
    form is the same place), a path the user named in full, then the Hugging Face cache's repos.
    The full list stays in `.searched`."""
    folders, repos = [], []
    for entry in searched:
        if entry.startswith("Hugging Face cache: "):
            repos.append(entry.removeprefix("Hugging Face cache: ").split(" (HF_HOME=")[0].rsplit("/", 1)[0])
        else:
            folders.append(str(Path(entry).parent) if Path(entry).name in (filename, quote(filename)) else entry)
    text = ", ".join(dict.fromkeys(folders))
    if repos:
        text += (" and " if text else "") + f"the Hugging Face cache ({', '.join(dict.fromkeys(repos))}; HF_HOME)"
    return text


def hf_cached_file(repo_id: str, filename: str, searched: list[str]) -> str | None:
    """Return the path of `filename` from `repo_id` if it is in the local Hugging Face cache.
    local_files_only=True guarantees no network access."""
    searched.append(f"Hugging Face cache: {repo_id}/{filename} (HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')})")
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(repo_id, filename, local_files_only=True)
    except Exception:  # not cached, offline, hub library absent: all mean "not here"
        return None


def find_weight_file(
    reward: str,
    filename: str,
    explicit: str | os.PathLike | None = None,
    local_dirs: Iterable[str | os.PathLike] = (),
    hf_repos: Iterable[str] = (),
    alt_names: Iterable[str] = (),
    hint: str | None = None,
) -> str:
    """Resolve a weight file offline.

    Order: the explicit path from the spec (if given, it is the only place looked: a typo in a
    path must not silently fall back to some other checkpoint), then `local_dirs` (the
    directories the upstream packages download into, plus ~/.cache/diffrlhf/<reward>), then the
    HF cache for each repo in `hf_repos`.
    """
    searched: list[str] = []
    if explicit is not None:
        p = Path(explicit).expanduser()
        if p.is_dir():  # a folder holding the file is accepted too
            p = p / filename
        searched.append(str(p))
        if p.is_file():
            return str(p)
        raise MissingWeightsError(reward, filename, searched, hint)
    names = [filename, *alt_names]
    for d in [*local_dirs, cache_dir() / reward]:
        for n in names:
            p = Path(d).expanduser() / n
            searched.append(str(p))
            if p.is_file():
                return str(p)
    for repo in hf_repos:
        got = hf_cached_file(repo, filename, searched)
        if got:
            return got
    raise MissingWeightsError(reward, filename, searched, hint)


def from_pretrained_offline(cls, name_or_path: str, reward: str, what: str, **kwargs):
    """`cls.from_pretrained` that never touches the network; a miss becomes MissingWeightsError."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    # Loading the vision tower from a full CLIP checkpoint lists every unused text weight in a
    # load report; those are expected, so keep transformers quiet for this call.
    hf_logging.set_verbosity_error()
    try:
        return cls.from_pretrained(name_or_path, local_files_only=True, **kwargs)
    except (OSError, ValueError) as e:
        raise MissingWeightsError(
            reward,
            f"{name_or_path} ({what})",
            [f"{name_or_path} as a local folder", f"Hugging Face cache entry for {name_or_path!r}"],
            hint=f"underlying error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
        ) from e
    finally:
        hf_logging.set_verbosity(level)
