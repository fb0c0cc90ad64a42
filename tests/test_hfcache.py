"""sparkv.runtime.hfcache: the cache keyword of a forward call, old and new transformers."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from sparkv.runtime.hfcache import (cache_keyword, default_keyword, hook_cache, model_call,
                                    output_cache)


class _Old(torch.nn.Module):            # transformers < the rename: past_key_values only
    def forward(self, x, past_key_values=None, **kwargs):
        return ("old", past_key_values)


class _New(torch.nn.Module):            # transformers with the rename: cache
    def forward(self, x, cache=None, **kwargs):
        return ("new", cache)


@dataclass
class _OldOut:
    past_key_values: object = None


@dataclass
class _NewOut:
    cache: object = None


def test_the_keyword_follows_the_forward_signature():
    assert model_call(_Old(), 1, cache="kv") == ("old", "kv")
    assert model_call(_New(), 1, cache="kv") == ("new", "kv")
    assert cache_keyword(_Old()) == "past_key_values" and cache_keyword(_New()) == "cache"
    assert output_cache(_OldOut("a")) == "a" and output_cache(_NewOut("b")) == "b"
    assert hook_cache({"cache": "b"}) == "b" and hook_cache({"past_key_values": "a"}) == "a"
    assert hook_cache({}) is None


def test_the_installed_transformers_gets_no_deprecated_keyword(tiny_llama):
    """A real forward and generate through the helper warn about nothing."""
    from transformers import DynamicCache

    assert cache_keyword(tiny_llama.model.generate) == default_keyword()
    ids = torch.tensor([[1, 2, 3]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model_call(tiny_llama.model, ids, cache=DynamicCache(), use_cache=True)
        assert output_cache(out).get_seq_length() == 3
        gen = model_call(tiny_llama.model.generate, ids, cache=DynamicCache(), max_new_tokens=2,
                         do_sample=False, attention_mask=torch.ones_like(ids))
    assert gen.shape == (1, 5)


#: files another change owns right now; the merge moves them to model_call and empties this
PENDING: set[str] = set()


def test_no_forward_call_passes_the_deprecated_keyword():
    """Every forward call with a cache goes through model_call (its FutureWarning printed ~10
    times per ask before): no ``past_key_values=`` or ``.past_key_values`` outside hfcache.py."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "sparkv"
    pattern = re.compile(r"past_key_values=|\.past_key_values\b")
    found = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
             if p.name != "hfcache.py" and str(p.relative_to(root)) not in PENDING
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line.split("#")[0]) and "``" not in line]
    assert not found, found
