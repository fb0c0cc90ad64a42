"""The device's KV memory (docs/kv-memory.md): a context's KV as chunks with explicit positions,
ragged per-layer / per-head budgets, resident levels and a flash tier, and a transformers cache
that decodes over it.

    mem = ContextKV(geometry, dtype)              # what the layer stepper and the engine fill
    mem.put(cid, k, v, source=Source.STREAMED)
    mem.prune_layer(l, keep_positions_per_head)   # ragged: real memory, not masks
    mem.set_level(cid, "int4")                    # resident at a lower level (its pages)
    mem.swap_out(cid, FlashTier(dir))             # to flash (atomic, checksummed, O_DIRECT reads)
    out = model_call(model.generate, ids, cache=SparkvCache(mem))   # sparkv.runtime.hfcache

Services build on it: the LLMS context service, the presses, DynaKV.
"""

from sparkv.cache.attention import (IMPLEMENTATION, AttentionView, causal_sdpa, ragged_attention,
                                    register, use_sparkv_attention)
from sparkv.cache.flash import (FlashError, FlashRef, FlashTier, flash_profile_path,
                                load_flash_profile, save_flash_profile)
from sparkv.cache.hf import SparkvCache, SparkvLayer
from sparkv.cache.layer import HeadEntries, KVMemoryError, LayerStore
from sparkv.cache.levels import (LEVELS, LevelError, QuantizedTensor, Residency, Source,
                                 dequantize, error_bound, quantize, requantize)
from sparkv.cache.chunks import ARENA, PAGED, ChunkMemory, LayerKV, MemoryAccount
from sparkv.cache.memory import ContextKV
from sparkv.cache.pages import PAGE_TOKENS, PagePool, PagePoolFull, PagePools
from sparkv.cache.table import ChunkState, ChunkTable
from sparkv.cache.payload import ChunkPayload, ChunkRun, PayloadError, from_bytes, to_bytes

__all__ = [
    "IMPLEMENTATION", "AttentionView", "causal_sdpa", "ragged_attention", "register",
    "use_sparkv_attention", "FlashError", "FlashRef", "FlashTier", "flash_profile_path",
    "load_flash_profile", "save_flash_profile", "SparkvCache", "SparkvLayer", "HeadEntries",
    "KVMemoryError", "LayerStore", "LEVELS", "LevelError", "QuantizedTensor", "Residency",
    "Source", "dequantize", "error_bound", "quantize", "requantize", "ARENA", "PAGED",
    "ChunkMemory", "ChunkState", "ChunkTable", "ContextKV", "LayerKV", "MemoryAccount",
    "PAGE_TOKENS", "PagePool", "PagePoolFull", "PagePools", "ChunkPayload", "ChunkRun",
    "PayloadError", "from_bytes", "to_bytes",
]
