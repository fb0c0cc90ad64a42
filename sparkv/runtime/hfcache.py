"""The one place that knows how transformers names the KV cache of a forward call.

transformers renamed a model's ``past_key_values=`` keyword (and the output's
``.past_key_values``) to ``cache``; the old name still works there but prints a ``FutureWarning``
and a ``[transformers] ... deprecated`` line on every call. sparkv supports transformers from
4.56 (``past_key_values`` only) on, so every forward call that passes a cache goes through
:func:`model_call`, every read of a returned cache through :func:`output_cache`, and every
forward hook that looks for the cache through :func:`hook_cache`::

    out = model_call(lm.model, input_ids=ids, cache=SparkvCache(memory), position_ids=pos)
    kv = output_cache(out)

The keyword is read once per module class from its ``forward`` signature (transformers'
deprecation decorator keeps the signature of the function it wraps); a callable that is not a
module (``model.generate``) uses the keyword of transformers' Llama model, decided once.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

#: the two spellings, newest first
NEW_KEYWORD = "cache"
OLD_KEYWORD = "past_key_values"


@functools.cache
def default_keyword() -> str:
    """The cache keyword of the installed transformers (from ``LlamaModel.forward``)."""
    from transformers.models.llama.modeling_llama import LlamaModel

    return _keyword_of(LlamaModel.forward) or OLD_KEYWORD


def _keyword_of(fn: Callable[..., Any]) -> str | None:
    """``"cache"`` or ``"past_key_values"`` when ``fn`` names one of them as a parameter."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    for name in (NEW_KEYWORD, OLD_KEYWORD):
        if name in params:
            return name
    return None


@functools.cache
def _class_keyword(cls: type) -> str:
    forward = getattr(cls, "forward", None)
    return (_keyword_of(forward) if forward is not None else None) or default_keyword()


def cache_keyword(fn: Callable[..., Any]) -> str:
    """The keyword under which ``fn`` (a module, or ``model.generate``) takes the KV cache."""
    import torch

    if isinstance(fn, torch.nn.Module):
        return _class_keyword(type(fn))  # type: ignore[arg-type]  # torch's __hash__ stub
    return default_keyword()


def model_call(fn: Callable[..., Any], *args: Any, cache: Any = None, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with ``cache`` passed under the keyword ``fn`` takes
    (:func:`cache_keyword`). ``fn`` is a transformers module (a causal LM, its base model, a
    decoder layer) or ``model.generate``."""
    return fn(*args, **{cache_keyword(fn): cache}, **kwargs)


def output_cache(out: Any) -> Any:
    """The KV cache a forward call returned (``out.cache``, or ``out.past_key_values`` on a
    transformers that has no ``cache`` field), without the deprecation notice."""
    if dataclasses.is_dataclass(out):
        names = {f.name for f in dataclasses.fields(out)}
        if NEW_KEYWORD in names:
            return getattr(out, NEW_KEYWORD)
    return getattr(out, OLD_KEYWORD)


def hook_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a forward hook (``with_kwargs=True``) was given, under either name."""
    if kwargs.get(NEW_KEYWORD) is not None:
        return kwargs[NEW_KEYWORD]
    return kwargs.get(OLD_KEYWORD)
