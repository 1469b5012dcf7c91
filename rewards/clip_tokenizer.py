"""OpenAI/open_clip CLIP tokenizer, offline.

The BPE vocabulary ships inside the `openai-clip` package (bpe_simple_vocab_16e6.txt.gz). We
turn it into vocab.json + merges.txt the same way open_clip's SimpleTokenizer builds its encoder,
and load transformers.CLIPTokenizer from that folder (transformers 5 ignores vocab_file=/
merges_file= kwargs, so from_pretrained(folder) is the only reliable route).

Token layout follows open_clip.tokenize: [SOT] + bpe + [EOT], truncated to the context length
with EOT forced into the last slot, padded with 0.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import tempfile
from functools import lru_cache

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
    raise FileNotFoundError("bpe_simple_vocab_16e6.txt.gz not found: install the `openai-clip` package "
                            "or pass bpe_path=")


@lru_cache(maxsize=2)
def load_clip_tokenizer(bpe_path: str | None = None):
    from transformers import CLIPTokenizer

    from diffrlhf.actors.models import write_clip_tokenizer  # one builder of the CLIP vocabulary

    with tempfile.TemporaryDirectory() as d:
        write_clip_tokenizer(d, bpe_path or default_bpe_path())
        # A huge model_max_length: we truncate ourselves (open_clip style), so no length warning.
        return CLIPTokenizer.from_pretrained(d, model_max_length=10**9)


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
