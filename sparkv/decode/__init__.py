"""Decode-time KV policies (docs/dynakv.md): DynaKV - long decoding with clustered KV on flash -
and its baselines, behind one switch.

    result, stats = generate(lm, memory, context_len, question_ids, max_new_tokens=1024,
                             kv_policy="dynakv", ram_budget=0.25, budget=0.1)

* :class:`DecodeSession` - prefill the question, then ``feed`` tokens (teacher forcing, new turns).
* :class:`ClusteredKV` - every layer's clusters: prefill k-means per (layer, KV head), centroids in
  RAM, entries on flash in cluster order (dual-head pools, co-retrieval placement), retrieval of
  the top clusters within a per-step entry budget, migration-free adaptation (variance-bounded
  clusters, delayed split, B_max), a cluster cache across RAM and flash, per-layer prefetch.
* :class:`UpkeepError` - the clusters' upkeep (on its thread, off the token's path) failed.
* :class:`DynaKVCache` - a transformers ``Cache`` over it (explicit positions, ragged attention).

Policies (:data:`POLICIES`): ``full``, ``dynakv``, ``dynakv-eager``, ``dynakv-packed``,
``dynakv-lru``, ``static``, ``local``, ``nocluster``.
"""

from sparkv.decode.cache import ClusterCache
from sparkv.decode.config import POLICIES, DecodeConfig, policy_config
from sparkv.decode.hf import DynaKVCache, DynaKVLayer, DynaKVView
from sparkv.decode.policy import ClusteredKV, coretrieval_order
from sparkv.decode.session import DecodeResult, DecodeSession, generate
from sparkv.decode.stats import DecodeStats
from sparkv.decode.upkeep import UpkeepError

__all__ = ["ClusterCache", "POLICIES", "DecodeConfig", "policy_config", "DynaKVCache",
           "DynaKVLayer", "DynaKVView", "ClusteredKV", "coretrieval_order", "DecodeSession",
           "DecodeResult", "generate", "DecodeStats", "UpkeepError"]
