"""Exact layer-step execution (../shared/notes/sparkv-design.md, layers 0-based).

Step ``(t, l)`` takes ``Y[l-1, t]`` (the embeddings when ``l == 0``) and ``KV(t' < t, l, *)`` and
produces ``KV(t, l, *)`` and, when ``l < L-1``, ``Y[l, t]``. Every chunk gets its absolute
positions, so any order of steps that respects the dependencies gives the model's own prefill; KV
of any chunk may instead be injected from outside (streamed) with :meth:`LayerStepper.inject`.

A step runs the decoder layer's own modules: ``input_layernorm``, then the attention module's
``forward`` (so forward hooks on attention, and on its projections, fire), with a one-step cache
that writes the step's K/V into the KV memory (:class:`~sparkv.cache.ContextKV`) and hands
attention the keys it may see: the layer's dense arena with the stepper's backend (dense or
block-sparse), or, when the layer is pruned or holds quantized chunks, an explicit-position view.
Then the residual, ``post_attention_layernorm`` and the MLP. The last layer's step is
projection-only unless ``full_last_layer``: its hidden output is never consumed by the context,
so it runs the input norm and the K/V projections (plus RoPE) and nothing else.

Usage::

    stepper = LayerStepper(lm, token_ids, chunk_tokens=1024, backend=get_backend("block_sparse"))
    for step in order:                  # any valid order
        stepper.run_step(step)
    cache = stepper.kv.layer_kv()       # per layer (K, V), [1, kv_heads, N, head_dim]
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Sequence

import torch

from sparkv.cache import AttentionView, ContextKV, LayerKV, Source
from sparkv.cache.attention import OneQuery
from sparkv.errors import SparkvError
from sparkv.layout import DEFAULT_CHUNK_TOKENS, ChunkGeometry, KVChunkId, StepId
from sparkv.runtime.attention import (AttentionBackend, AttentionStats, DenseAttention, bind_model,
                                      layer_backend)
from sparkv.runtime.device import cuda_graphs
from sparkv.runtime.fastops import apply_rope, project_shared
from sparkv.runtime.graphs import LayerGraphs, graphs_of
from sparkv.runtime.hfcache import model_call
from sparkv.runtime.hooks import has_forward_hooks
from sparkv.runtime.model import LoadedModel


class MissingDependencyError(SparkvError):
    """A layer step was asked to run before its inputs were available."""


@dataclass
class StepResult:
    step: StepId
    seconds: float
    stats: AttentionStats | None  # None for projection-only steps


class LayerStepper:
    """Runs one context's layer steps in any dependency-respecting order.

    Args:
        lm: the loaded model.
        token_ids: the context's token ids (N of them).
        chunk_tokens: T, tokens per token chunk.
        backend: attention backend for the context's steps (dense by default).
        heads_per_group: KV heads per chunk group (0: all heads in one group).
        kv: the KV memory to fill (e.g. already holding streamed or restored chunks); default: a
            new one.
        full_last_layer: run the last layer's attention too (its hooks fire; nothing else needs
            it), instead of the projection-only step.
        spare_tokens: dense slots a new memory keeps for tokens decoded later.
        lazy: a new memory's arenas take memory page by page as chunks are written
            (:mod:`sparkv.cache.zeroed`: an ask waiting for its share of the link holds the chunks
            it has), instead of all at once.
        graphs: the piecewise CUDA graphs its steps may replay (:mod:`sparkv.runtime.graphs`),
            ``False`` for none; default: the model's own where
            :func:`~sparkv.runtime.device.cuda_graphs` says (a GPU), else none.
    """

    def __init__(self, lm: LoadedModel, token_ids: Sequence[int],
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 backend: AttentionBackend | None = None, heads_per_group: int = 0,
                 kv: ContextKV | None = None, full_last_layer: bool = False,
                 spare_tokens: int = 0, lazy: bool = False,
                 graphs: LayerGraphs | bool | None = None) -> None:
        if len(token_ids) == 0:
            raise ValueError("the context has no tokens")
        if lm.max_positions and len(token_ids) > lm.max_positions:
            raise ValueError(f"context of {len(token_ids)} tokens exceeds the model's "
                             f"{lm.max_positions} positions")
        self.lm = lm
        self.geometry = ChunkGeometry.from_config(lm.config, len(token_ids), chunk_tokens,
                                                  heads_per_group)
        self.backend = backend or DenseAttention()
        # calibrated per-model settings, if any: a RoPE-extended model uses its base's (its
        # quality and profile come from the base too: LoadedModel.base_fingerprint)
        bind_model(self.backend, lm.base_fingerprint)
        self.token_ids = torch.tensor(list(token_ids), dtype=torch.long,
                                      device=lm.device).unsqueeze(0)
        self.kv = kv or ContextKV(self.geometry, lm.dtype, lm.device, spare_tokens=spare_tokens,
                                  lazy=lazy)
        if self.kv.geometry != self.geometry:
            raise ValueError("the KV memory was made for another geometry")
        self.full_last_layer = full_last_layer
        if graphs is None:
            graphs = cuda_graphs(lm.device)
        self.graphs = graphs_of(lm) if graphs is True else graphs or None
        self._hidden: dict[StepId, torch.Tensor] = {}  # Y[l, t] awaiting step (t, l+1)
        self._done: set[StepId] = set()
        self._rope: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        attn0 = lm.decoder.layers[0].self_attn
        self.scale = float(getattr(attn0, "scaling", self.geometry.head_dim ** -0.5))
        self.num_q_heads = int(lm.config.num_attention_heads)

    # ---- outside data --------------------------------------------------------------------------
    def inject(self, cid: KVChunkId, k: torch.Tensor, v: torch.Tensor) -> None:
        """Places a chunk's K/V (``[Hg, n_t, D]``) obtained elsewhere (streamed, decoded)."""
        self.kv.put(cid, k, v, source=Source.INJECTED)

    # ---- dependencies --------------------------------------------------------------------------
    def missing_dependencies(self, step: StepId) -> list[str]:
        """Human-readable list of what ``step`` still needs (empty when it can run)."""
        g = self.geometry
        if not (0 <= step.t < g.num_token_chunks and 0 <= step.l < g.num_layers):
            return [f"{step} is outside the context ({g.num_token_chunks} token chunks x "
                    f"{g.num_layers} layers)"]
        need: list[str] = []
        if step in self._done:
            need.append(f"{step} already ran")
        if step.l > 0 and StepId(step.t, step.l - 1) not in self._hidden:
            need.append(f"Y[l={step.l - 1}, t={step.t}] from step(t={step.t}, l={step.l - 1})")
        if step.l < g.num_layers - 1:
            prior = [KVChunkId(t, step.l, gg) for t in range(step.t) for gg in range(g.num_groups)]
            need.extend(str(c) for c in self.kv.missing(prior))
        return need

    def ready(self, step: StepId) -> bool:
        return not self.missing_dependencies(step)

    @property
    def done(self) -> frozenset[StepId]:
        return frozenset(self._done)

    # ---- execution -----------------------------------------------------------------------------
    def token_span(self, t0: int, t1: int) -> tuple[int, int]:
        """Token positions ``[a, b)`` of token chunks ``t0 .. t1-1``."""
        return self.geometry.token_range(t0)[0], self.geometry.token_range(t1 - 1)[1]

    def rope_for(self, t0: int, t1: int, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of token chunks ``t0 .. t1-1`` (cached per span), in ``ref``'s dtype."""
        key = (t0, t1)
        if key not in self._rope:
            a, b = self.token_span(*key)
            pos = torch.arange(a, b, device=ref.device).unsqueeze(0)
            cos, sin = self.lm.decoder.rotary_emb(ref, pos)
            self._rope[key] = (cos.to(ref.dtype), sin.to(ref.dtype))
        return self._rope[key]

    def span_input(self, t0: int, t1: int, l: int) -> torch.Tensor:  # noqa: E741
        """The input hidden states ``[1, n, hidden]`` of steps ``(t0 .. t1-1, l)``: the token
        embeddings at layer 0, else the kept outputs of layer ``l - 1`` (taken: each is used
        once)."""
        if l == 0:
            a, b = self.token_span(t0, t1)
            return self.lm.decoder.embed_tokens(self.token_ids[:, a:b])
        parts = [self._hidden.pop(StepId(t, l - 1)) for t in range(t0, t1)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _keep_hidden(self, x: torch.Tensor, t0: int, t1: int, l: int) -> None:  # noqa: E741
        a = self.token_span(t0, t1)[0]
        for t in range(t0, t1):
            ta, tb = self.geometry.token_range(t)
            self._hidden[StepId(t, l)] = x[:, ta - a:tb - a]

    def put_span(self, t0: int, t1: int, l: int, k: torch.Tensor,  # noqa: E741
                 v: torch.Tensor) -> None:
        """Writes the K/V ``[1, H, n, D]`` that steps ``(t0 .. t1-1, l)`` computed (``n`` their
        tokens) into the KV memory, chunk by chunk (source: computed)."""
        a = self.token_span(t0, t1)[0]
        for t in range(t0, t1):
            ta, tb = self.geometry.token_range(t)
            self.kv.put_step_output(t, l, k[:, :, ta - a:tb - a], v[:, :, ta - a:tb - a])

    def span_missing(self, t0: int, t1: int, l: int) -> list[str]:  # noqa: E741
        """What steps ``(t0 .. t1-1, l)`` still need to run together as one span (empty when
        they can): the first one's dependencies, and each later one's own hidden input (its
        earlier KV at layer ``l`` is the span's own)."""
        if not 0 <= t0 < t1 <= self.geometry.num_token_chunks:
            return [f"span t={t0}..{t1 - 1} is outside the context"]
        missing = self.missing_dependencies(StepId(t0, l))
        for t in range(t0 + 1, t1):
            if StepId(t, l) in self._done:
                missing.append(f"{StepId(t, l)} already ran")
            if l > 0 and StepId(t, l - 1) not in self._hidden:
                missing.append(f"Y[l={l - 1}, t={t}] from step(t={t}, l={l - 1})")
        return missing

    def column_missing(self, t: int, l0: int, l1: int) -> list[str]:  # noqa: E741
        """What steps ``(t, l0 .. l1-1)`` still need to run together as one column (empty when
        they can): the first one's dependencies, and every KV of ``t' < t`` at the later
        layers (each later layer's hidden input is the column's own)."""
        g = self.geometry
        if not 0 <= l0 < l1 <= g.num_layers:
            return [f"column l={l0}..{l1 - 1} is outside the context"]
        missing = self.missing_dependencies(StepId(t, l0))
        for l in range(l0 + 1, l1):  # noqa: E741
            if StepId(t, l) in self._done:
                missing.append(f"{StepId(t, l)} already ran")
            if l < g.num_layers - 1:
                missing.extend(str(c) for c in self.kv.missing(
                    [KVChunkId(tp, l, gg) for tp in range(t) for gg in range(g.num_groups)]))
        return missing

    def call_missing(self, steps: Sequence[StepId]) -> list[str]:
        """What ``steps`` (one step, a span of one layer's consecutive token chunks, or a
        column of one token chunk's consecutive layers: the edge engine's calls) still need to
        run as one call; empty when they can."""
        if len(steps) == 1:
            return self.missing_dependencies(steps[0])
        if steps[1].l == steps[0].l:
            return self.span_missing(steps[0].t, steps[-1].t + 1, steps[0].l)
        return self.column_missing(steps[0].t, steps[0].l, steps[-1].l + 1)

    def _check_span(self, t0: int, t1: int, l: int) -> None:  # noqa: E741
        """Raises :class:`MissingDependencyError` unless :meth:`span_missing` is empty."""
        missing = self.span_missing(t0, t1, l)
        if missing:
            raise MissingDependencyError(
                f"step(t={t0}..{t1 - 1}, l={l}) cannot run: missing {', '.join(missing[:5])}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))

    def span_done(self, x: torch.Tensor, t0: int, t1: int, l: int) -> list[StepId]:  # noqa: E741
        """Steps ``(t0 .. t1-1, l)`` ran with output hidden states ``x``: keeps them for layer
        ``l + 1`` (below the last layer) and marks the steps done; returns them."""
        if l < self.geometry.num_layers - 1:
            self._keep_hidden(x, t0, t1, l)
        steps = [StepId(t, l) for t in range(t0, t1)]
        self._done.update(steps)
        return steps

    @torch.inference_mode()
    def run_span(self, t0: int, t1: int, l: int) -> list[StepResult]:  # noqa: E741
        """Runs steps ``(t0 .. t1-1, l)`` as one call (one set of GEMMs and one attention over
        the span's queries): the same K/V and hidden states as running them one by one, with
        fewer, larger kernels. Raises :class:`MissingDependencyError` naming what is missing."""
        self._check_span(t0, t1, l)
        start = time.perf_counter()
        x, stats = self._layer(self.span_input(t0, t1, l), t0, t1, l)
        steps = self.span_done(x, t0, t1, l)
        seconds = (time.perf_counter() - start) / len(steps)
        return [StepResult(s, seconds, stats) for s in steps]

    def _layer(self, x: torch.Tensor, t0: int, t1: int, l: int  # noqa: E741
               ) -> tuple[torch.Tensor, AttentionStats | None]:
        """Layer ``l`` over token chunks ``t0 .. t1-1`` from its input ``x``: writes their K/V
        into the KV memory; returns the layer's output hidden states (``x`` itself for the
        projection-only last layer) and the attention's statistics."""
        if self.graphs is not None:       # below the last layer, shapes seen before
            rope = self.rope_for(t0, t1, x)
            if self.graphs.wants(l, x, rope):
                return self._graphed_layer(x, t0, t1, l, rope)
        x, stats = _layer_call([_Span(self, t0, t1)], x, l)
        return x, stats[0]

    def _graphed_layer(self, x: torch.Tensor, t0: int, t1: int, l: int,  # noqa: E741
                       rope: tuple[torch.Tensor, torch.Tensor]
                       ) -> tuple[torch.Tensor, AttentionStats | None]:
        """:meth:`_layer` with the parts before and after attention replayed from the model's
        graphs (:mod:`sparkv.runtime.graphs`) and the attention run as :func:`_layer_call` runs
        it (the same cache, the same view)."""
        assert self.graphs is not None
        cache = _StepCache(self, t0, t1, l)
        scale = float(self.lm.decoder.layers[l].self_attn.scaling)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            view, _ = cache.update(k, v, l)
            return view.attend(q, scale)

        return self.graphs.run(l, x, rope, attend), cache.stats

    @torch.inference_mode()
    def run_column(self, t: int, l0: int, l1: int) -> list[StepResult]:  # noqa: E741
        """Runs steps ``(t, l0 .. l1-1)``, layer after layer, as one call: the hidden states
        pass from layer to layer without being kept, and the dependencies are checked once
        (every KV of ``t' < t`` at layers ``l0 .. l1-1`` must be in place). The same K/V and
        hidden output as running the steps one by one (the all-local fast path of the edge
        engine). Raises :class:`MissingDependencyError` naming what is missing."""
        g = self.geometry
        missing = self.column_missing(t, l0, l1)
        if missing:
            raise MissingDependencyError(
                f"step(t={t}, l={l0}..{l1 - 1}) cannot run: missing {', '.join(missing[:5])}")
        x = self.span_input(t, t + 1, l0)
        out: list[StepResult] = []
        for l in range(l0, l1):  # noqa: E741
            start = time.perf_counter()
            x, stats = self._layer(x, t, t + 1, l)
            self._done.add(StepId(t, l))
            out.append(StepResult(StepId(t, l), time.perf_counter() - start, stats))
        if l1 - 1 < g.num_layers - 1:
            self._keep_hidden(x, t, t + 1, l1 - 1)
        return out

    def run_step(self, step: StepId) -> StepResult:
        """Runs one layer step; raises :class:`MissingDependencyError` naming what is missing."""
        step = StepId(*step)
        missing = self.missing_dependencies(step)
        if missing:
            raise MissingDependencyError(f"{step} cannot run: missing {', '.join(missing[:5])}"
                                         + (f" and {len(missing) - 5} more" if len(missing) > 5
                                            else ""))
        return self.run_span(step.t, step.t + 1, step.l)[0]

    def run(self, order: Iterable[StepId]) -> list[StepResult]:
        return [self.run_step(s) for s in order]

    def calibrate_layer(self, x: torch.Tensor, t: int, l: int) -> None:  # noqa: E741
        """Runs layer ``l`` over token chunk ``t`` from the hidden input ``x`` ``[1, n,
        hidden]`` whatever its dependencies, for timing (the cost model times the projection-only
        last layer this way without computing the layers below): its K/V are written, nothing
        is marked done."""
        _layer_call([_Span(self, t, t + 1)], x, l)

    def steps_needed(self) -> list[StepId]:
        """Steps still needed so that every chunk is available: for each token chunk, layers up to
        the deepest layer with a missing chunk (earlier layers feed it their hidden states)."""
        g = self.geometry
        needed: list[StepId] = []
        for t in range(g.num_token_chunks):
            deepest = -1
            for l in range(g.num_layers):  # noqa: E741
                if self.kv.missing(g.chunks_of_step(StepId(t, l))):
                    deepest = l
            needed.extend(StepId(t, l) for l in range(deepest + 1)
                          if StepId(t, l) not in self._done)
        return needed

    def complete(self, fused: bool = False) -> list[StepResult]:
        """Runs every step still needed to fill the cache: one by one in token-major order, or
        (``fused``) layer by layer, each run of consecutive needed token chunks as one span (the
        whole context at once when nothing was streamed: a GPU's local prefill)."""
        needed = self.steps_needed()
        if not fused:
            return self.run(needed)
        results: list[StepResult] = []
        for l in sorted({s.l for s in needed}):  # noqa: E741
            ts = sorted(s.t for s in needed if s.l == l)
            first = ts[0]
            for prev, t in zip(ts, ts[1:] + [-1]):       # -1: the last run ends
                if t != prev + 1:
                    results.extend(self.run_span(first, prev + 1, l))
                    first = t
        return results


def prefill_layer_kv(lm: LoadedModel, token_ids: Sequence[int],
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                     backend: AttentionBackend | None = None, fused: bool = False
                     ) -> tuple[LayerKV, list[StepResult]]:
    """Chunked local prefill of a whole context; returns per-layer ``(K, V)`` and step results
    (``fused``: layer by layer over the whole context, :meth:`LayerStepper.complete`)."""
    stepper = LayerStepper(lm, token_ids, chunk_tokens, backend)
    results = stepper.complete(fused)
    return stepper.kv.layer_kv(), results


class _StepCache:
    """The cache one layer step (or span of steps) hands the attention module: ``update`` stores
    the span's K/V in the KV memory and returns the keys and values its queries may see (see the
    module docstring)."""

    def __init__(self, stepper: LayerStepper, t0: int, t1: int, l: int) -> None:  # noqa: E741
        self.stepper, self.t0, self.t1, self.l = stepper, t0, t1, l
        self.view: AttentionView | None = None

    @property
    def stats(self) -> AttentionStats | None:
        return None if self.view is None else self.view.stats

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[AttentionView, AttentionView]:
        st = self.stepper
        kv, g, l = st.kv, st.geometry, self.l  # noqa: E741
        a, b = st.token_span(self.t0, self.t1)
        st.put_span(self.t0, self.t1, l, key_states, value_states)
        q_pos = torch.arange(a, b, device=key_states.device)
        if kv.is_dense(l):
            store = kv.layers[l]
            assert store is not None
            k_all, v_all = store.prefix(b)
            # attend over the span's own projection, even where a streamed chunk was kept
            own = all(kv.source(c) == "computed" for t in range(self.t0, self.t1)
                      for c in g.chunks_of_step(StepId(t, l)))
            if not own:
                k_all = torch.cat([k_all[:, :, :a], key_states], dim=2)
                v_all = torch.cat([v_all[:, :, :a], value_states], dim=2)
            backend = layer_backend(st.backend, l)  # the layer's calibrated thresholds, if any
            self.view = AttentionView(q_pos, k=k_all, v=v_all, backend=backend, q_offset=a)
        else:
            heads = []
            for h, e in enumerate(kv.layer_entries(l, stop=a)):
                heads.append((torch.cat([e.k, key_states[0, h]]),
                              torch.cat([e.v, value_states[0, h]]),
                              torch.cat([e.pos.to(q_pos.device), q_pos])))
            self.view = AttentionView(q_pos, heads=heads)
        return self.view, self.view


# ---- one layer call over the rows of several contexts -----------------------------------------
class _Span(NamedTuple):
    """Token chunks ``t0 .. t1-1`` of one stepper: its rows in a layer call."""

    stepper: LayerStepper
    t0: int
    t1: int

    @property
    def rows(self) -> int:
        a, b = self.stepper.token_span(self.t0, self.t1)
        return b - a


def _layer_call(spans: Sequence[_Span], x: torch.Tensor, l: int  # noqa: E741
                ) -> tuple[torch.Tensor, list[AttentionStats | None]]:
    """Layer ``l`` over the rows of ``spans`` (steppers of one model; ``x`` ``[1, n, hidden]``
    their inputs concatenated in order): the norms, projections and MLP as one call over all the
    rows, the attention per span over its own stepper's KV memory (each span's K/V written
    there). Returns the output hidden states (``x`` itself for the projection-only last layer)
    and each span's attention statistics."""
    first = spans[0].stepper
    layer = first.lm.decoder.layers[l]
    h = layer.input_layernorm(x)
    ropes = [s.stepper.rope_for(s.t0, s.t1, h) for s in spans]
    rope = ropes[0] if len(spans) == 1 else (torch.cat([c for c, _ in ropes], dim=1),
                                              torch.cat([s for _, s in ropes], dim=1))
    rows = [s.rows for s in spans]
    last = l == first.geometry.num_layers - 1
    if last and not first.full_last_layer:
        k, v = _project_kv(layer, h, rope, first.geometry.head_dim)
        for s, ks, vs in zip(spans, k.split(rows, dim=2), v.split(rows, dim=2)):
            s.stepper.put_span(s.t0, s.t1, l, ks, vs)
        return x, [None] * len(spans)
    caches = [_StepCache(s.stepper, s.t0, s.t1, l) for s in spans]
    cache = caches[0] if len(caches) == 1 else _SplitCache(caches, rows)
    attn_out, _ = model_call(layer.self_attn, hidden_states=h, position_embeddings=rope,
                             attention_mask=None, cache=cache)
    if not last:   # the residual added into the fresh outputs: no new tensor per add
        x = attn_out.add_(x)
        x = layer.mlp(layer.post_attention_layernorm(x)).add_(x)
    return x, [c.stats for c in caches]


def _project_kv(layer: Any, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K (after RoPE) and V ``[1, H, n, D]`` of the rows ``h``, through the attention module's own
    projections (and Qwen3's ``k_norm``)."""
    attn = layer.self_attn
    b, n, _ = h.shape
    k, v = (p.view(b, n, -1, head_dim) for p in project_shared((attn.k_proj, attn.v_proj), h))
    v = v.transpose(1, 2)
    if getattr(attn, "k_norm", None) is not None:  # Qwen3
        k = attn.k_norm(k)
    cos, sin = rope
    return apply_rope(k.transpose(1, 2), cos, sin), v


class _SplitCache:
    """The cache a layer call over several spans hands the attention module: ``update`` splits
    the K/V rows by span, hands each to its span's :class:`_StepCache`, and returns a view that
    attends each span's queries over its own view."""

    def __init__(self, caches: list[_StepCache], rows: list[int]) -> None:
        self.caches, self.rows = caches, rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[AttentionView, AttentionView]:
        views = [c.update(k, v, layer_idx)[0] for c, k, v in
                 zip(self.caches, key_states.split(self.rows, dim=2),
                     value_states.split(self.rows, dim=2))]
        view = _SplitView(torch.cat([v.q_pos for v in views]), parts=views, rows=self.rows)
        return view, view


@dataclass
class _SplitView(AttentionView):
    """Per span, its queries' rows over its own view (:class:`_SplitCache`)."""

    parts: list[AttentionView] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    def attend(self, q: torch.Tensor, scale: float | None, one_query: OneQuery | None = None
               ) -> torch.Tensor:
        return torch.cat([view.attend(qs, scale, one_query)
                          for view, qs in zip(self.parts, q.split(self.rows, dim=2))], dim=2)


def together_key(stepper: object, step: StepId) -> tuple[int, int, bool] | None:
    """Steps whose keys are equal may run as one call (:func:`run_steps_together`): the same
    model (its object), the same layer, the same kind of last-layer step. ``None`` for a
    stepper that is not a plain :class:`LayerStepper` (a subclass may change what a step does):
    its steps run alone, as do the steps of a layer with forward hooks (a press's hooks would see
    the rows of several contexts as one)."""
    if type(stepper) is not LayerStepper:
        return None
    l = int(step[1])  # noqa: E741
    if has_forward_hooks(stepper.lm.decoder.layers[l]):
        return None
    return id(stepper.lm), l, stepper.full_last_layer


@torch.inference_mode()
def run_steps_together(pairs: Sequence[tuple[LayerStepper, StepId]]) -> list[StepResult]:
    """Runs step ``(t_i, l)`` of each stepper ``i`` (distinct steppers of one model, one layer
    ``l``: equal :func:`together_key`) as one call: the norms, the q/k/v and o projections and
    the MLP over all their rows at once, the attention of each over its own KV memory. Each
    stepper's K/V and hidden state are the ones its own :meth:`LayerStepper.run_step` gives
    (within fp32 rounding: the GEMMs see more rows); each :class:`StepResult`'s seconds are the
    call's, shared. Raises ``ValueError`` for steps that cannot go together and
    :class:`MissingDependencyError` (before running anything) when one of them cannot run."""
    pairs = [(st, StepId(*s)) for st, s in pairs]
    if not pairs:
        return []
    if len({together_key(st, s) for st, s in pairs}) > 1:
        raise ValueError("steps of different models, layers or last-layer kinds cannot run "
                         "together")
    if len({id(st) for st, _ in pairs}) < len(pairs):
        raise ValueError("two steps of one stepper cannot run together (run_span runs a span)")
    for st, s in pairs:
        missing = st.missing_dependencies(s)
        if missing:
            raise MissingDependencyError(f"{s} cannot run: missing {', '.join(missing[:5])}")
    start = time.perf_counter()
    l = pairs[0][1].l  # noqa: E741
    spans = [_Span(st, s.t, s.t + 1) for st, s in pairs]
    x = torch.cat([st.span_input(s.t, s.t + 1, l) for st, s in pairs], dim=1)
    x, stats = _layer_call(spans, x, l)
    for span, out in zip(spans, x.split([s.rows for s in spans], dim=1)):
        span.stepper.span_done(out, span.t0, span.t1, l)
    seconds = (time.perf_counter() - start) / len(pairs)
    return [StepResult(s, seconds, st_stats) for (_, s), st_stats in zip(pairs, stats)]
