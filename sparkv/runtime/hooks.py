"""Whether PyTorch hooks would fire in a module's forward (torch has no public accessor)."""

from __future__ import annotations

from typing import Any, Callable

import torch

#: the attribute a hook carries when it may see the rows of several contexts in one call: it
#: does nothing on a thread that did not ask for it (the device service's density recording)
ROWS_SAFE = "sparkv_rows_safe"


def rows_safe(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Marks ``hook`` as safe to fire over several contexts' rows at once (a decorator)."""
    setattr(hook, ROWS_SAFE, True)
    return hook


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Whether a forward hook or pre-hook of ``module``, of a module in it, or a global one would
    fire during its forward (a press's, a profiler's), leaving out hooks marked
    :func:`rows_safe`."""
    from torch.nn.modules import module as nn_module

    groups = [nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks]
    for m in module.modules():
        groups += [m._forward_hooks, m._forward_pre_hooks]
    return any(not getattr(h, ROWS_SAFE, False) for g in groups for h in g.values())


#: the attribute of an attention module holding a callable ``sink(module, q)`` that the fast
#: attention forward (:mod:`sparkv.runtime.fastops`) hands its queries ``[B, H, n, D]`` (normed,
#: rotated, not scaled) before attending: the device service's density hook then reads them
#: instead of projecting the layer's input again
QUERY_SINK = "sparkv_query_sink"


def offer_queries(module: torch.nn.Module, q: torch.Tensor) -> None:
    """Hands ``q`` to ``module``'s :data:`QUERY_SINK`, if it has one."""
    sink = getattr(module, QUERY_SINK, None)
    if sink is not None:
        sink(module, q)
