"""Model loading and exact layer-step execution with pluggable attention backends."""

from typing import TYPE_CHECKING

from sparkv.lazy import lazy_exports

if TYPE_CHECKING:
    from sparkv.runtime.attention import (
        AttentionBackend, AttentionStats, BlockSparseAttention, DenseAttention, SparsityConfig,
        get_backend, spas_sage_available,
    )
    from sparkv.runtime.autoattn import AttentionProfile, AutoAttention
    from sparkv.runtime.compute import resolve_dtype
    from sparkv.runtime.device import DeviceUnavailable, resolve_device
    from sparkv.runtime.flex import FlexAttention, flex_available
    from sparkv.runtime.generate import (
        GenerationResult, first_token_kl, greedy_agreement, greedy_generate, reference_generate,
        reference_prefill, sample_context_ids, sample_text,
    )
    from sparkv.runtime.kvcache import (
        LayerKV, assemble_layers, from_dynamic_cache, memory_from_layers, split_chunks,
        to_dynamic_cache,
    )
    from sparkv.runtime.model import (
        LoadedModel, ModelError, ModelNotFoundError, UnsupportedModelError, load_model,
    )
    from sparkv.runtime.stepper import LayerStepper, MissingDependencyError, StepResult, prefill_layer_kv

#: name -> the module that defines it (imported on first use: :mod:`sparkv.lazy`)
_EXPORTS: dict[str, str] = {
    "AttentionBackend": "sparkv.runtime.attention",
    "AttentionStats": "sparkv.runtime.attention",
    "BlockSparseAttention": "sparkv.runtime.attention",
    "DenseAttention": "sparkv.runtime.attention",
    "SparsityConfig": "sparkv.runtime.attention",
    "get_backend": "sparkv.runtime.attention",
    "spas_sage_available": "sparkv.runtime.attention",
    "AttentionProfile": "sparkv.runtime.autoattn",
    "AutoAttention": "sparkv.runtime.autoattn",
    "resolve_dtype": "sparkv.runtime.compute",
    "DeviceUnavailable": "sparkv.runtime.device",
    "resolve_device": "sparkv.runtime.device",
    "FlexAttention": "sparkv.runtime.flex",
    "flex_available": "sparkv.runtime.flex",
    "GenerationResult": "sparkv.runtime.generate",
    "first_token_kl": "sparkv.runtime.generate",
    "greedy_agreement": "sparkv.runtime.generate",
    "greedy_generate": "sparkv.runtime.generate",
    "reference_generate": "sparkv.runtime.generate",
    "reference_prefill": "sparkv.runtime.generate",
    "sample_context_ids": "sparkv.runtime.generate",
    "sample_text": "sparkv.runtime.generate",
    "LayerKV": "sparkv.runtime.kvcache",
    "assemble_layers": "sparkv.runtime.kvcache",
    "from_dynamic_cache": "sparkv.runtime.kvcache",
    "memory_from_layers": "sparkv.runtime.kvcache",
    "split_chunks": "sparkv.runtime.kvcache",
    "to_dynamic_cache": "sparkv.runtime.kvcache",
    "LoadedModel": "sparkv.runtime.model",
    "ModelError": "sparkv.runtime.model",
    "ModelNotFoundError": "sparkv.runtime.model",
    "UnsupportedModelError": "sparkv.runtime.model",
    "load_model": "sparkv.runtime.model",
    "LayerStepper": "sparkv.runtime.stepper",
    "MissingDependencyError": "sparkv.runtime.stepper",
    "StepResult": "sparkv.runtime.stepper",
    "prefill_layer_kv": "sparkv.runtime.stepper",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = [
    "AttentionBackend", "AttentionStats", "BlockSparseAttention", "DenseAttention",
    "SparsityConfig", "get_backend", "spas_sage_available", "AttentionProfile", "AutoAttention",
    "DeviceUnavailable", "resolve_device", "resolve_dtype", "FlexAttention", "flex_available",
    "GenerationResult", "first_token_kl",
    "greedy_agreement", "greedy_generate", "reference_generate", "reference_prefill",
    "sample_context_ids", "sample_text", "LayerKV", "assemble_layers", "memory_from_layers",
    "from_dynamic_cache", "split_chunks", "to_dynamic_cache", "LoadedModel", "ModelError",
    "ModelNotFoundError", "UnsupportedModelError", "load_model", "LayerStepper",
    "MissingDependencyError", "StepResult", "prefill_layer_kv",
]
