"""Model loading and exact layer-step execution with pluggable attention backends."""

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
