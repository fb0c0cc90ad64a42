"""The on-device context service (LLMS, issue 13): many contexts of one model under a KV-memory
budget, switched in milliseconds (docs/device-service.md).

    from sparkv.device import ContextService
    svc = ContextService(lm, memory_budget_bytes=256_000_000, swap_dir="/data/sparkv-device")
    cid = svc.new_context("You are a helpful assistant.")
    print(svc.call(cid, "Hello!").text)

Modules: ``service`` (the public API, the order of a call), ``config`` (the policies and the
benchmark's presets), ``registry`` (contexts, ids, locks, damaged ones), ``budget`` (the account,
reservations, the eviction policies), ``keeper`` / ``chunked`` / ``baselines`` (how a context's
KV is kept, by the only owner of its memory: chunks at levels for LLMS; whole arenas killed or
swapped for LMK and whole-context swapping), ``counters`` (what the service counts), ``calls``
(a call's model turn and its result), ``levels`` (the chunks' levels), ``swap`` (every context's
flash files), ``journal`` (crash recovery), ``prompts`` (chat formatting), ``loader`` (working
memory, batched chunk recomputation at global positions, the IO-recompute pipeline),
``planner`` (the IO/recompute split), ``density`` (information density from attention, the
level mix), ``flashio`` (grouped durable writes, the I/O profile, a full flash), ``restore``
(SparKV's planner with flash as one more link), ``app`` / ``client`` / ``schemas`` /
``commands`` (the local REST service, its bodies, and ``sparkv device``), ``access`` (loopback
Host names and the TCP bearer token), ``private`` (the modes of the swap dir, its files and the
socket; the whole path's owners), ``flashlock`` (one service per flash dir), ``inputs`` (token
id, text and timeout checks), ``contract`` (what the edge uses of the service: ``KeptContexts``),
``tails`` (the KV of recent turns after a context, reused by the next call of a conversation).
"""

from typing import TYPE_CHECKING

from sparkv.lazy import lazy_exports

if TYPE_CHECKING:
    from sparkv.device.calls import CallResult
    from sparkv.device.errors import (BudgetBusy, BudgetTooSmall, ContextBusy, ContextDamaged,
                                      DeviceError, FlashFull, FlashInUse, PromptTooLong,
                                      UnknownContext)
    from sparkv.device.service import ContextService, ServiceConfig

#: name -> the module that defines it (imported on first use: :mod:`sparkv.lazy`)
_EXPORTS: dict[str, str] = {
    "CallResult": "sparkv.device.calls",
    "BudgetBusy": "sparkv.device.errors",
    "BudgetTooSmall": "sparkv.device.errors",
    "ContextBusy": "sparkv.device.errors",
    "ContextDamaged": "sparkv.device.errors",
    "DeviceError": "sparkv.device.errors",
    "FlashFull": "sparkv.device.errors",
    "FlashInUse": "sparkv.device.errors",
    "PromptTooLong": "sparkv.device.errors",
    "UnknownContext": "sparkv.device.errors",
    "ContextService": "sparkv.device.service",
    "ServiceConfig": "sparkv.device.service",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = ["ContextService", "ServiceConfig", "CallResult", "DeviceError", "UnknownContext",
           "ContextBusy", "ContextDamaged", "PromptTooLong", "BudgetTooSmall", "BudgetBusy",
           "FlashFull", "FlashInUse"]
