"""Whether PyTorch hooks would fire in a module's forward (torch has no public accessor)."""

from __future__ import annotations

import torch


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Whether a forward hook or pre-hook of ``module``, of a module in it, or a global one would
    fire during its forward (a press's hooks, a profiler's)."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
