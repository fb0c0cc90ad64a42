"""Piecewise CUDA graphs of the layer steps whose shapes repeat (issue 46: steps that are not
launch-bound).

On an H200 a layer step at T=1024 launched 59 kernels and spent 2.00 s of wall time against
0.82 s of kernel time over a 32K prefill (docs/gpu.md): the launches, not the GPU, set its pace.
Fused spans (:meth:`LayerStepper.run_span`) remove them where a plan computes a layer's
consecutive token chunks; a step the plan interleaves with streamed chunks still runs alone.
Such steps repeat their shapes: every layer's step over ``T`` rows runs the same norms,
projections, RoPE and MLP, only the attention's key length grows. So each layer gets two graphs
per row count, captured once and replayed:

* **before attention**: the input norm, the q/k/v projections (Qwen3's ``q_norm``/``k_norm``)
  and RoPE, from the static input ``x`` and the step's cos/sin into static ``q``, ``k``, ``v``;
* **after attention**: ``o_proj``, the residual, the post-attention norm, the MLP and its
  residual, from the static attention output (and ``x``) into static ``y``.

The attention between them stays eager (its key length changes every step; it writes the K/V
into the KV memory and reads whatever form the memory holds). One set of static buffers per row
count serves every layer (the graphs copy into them; their temporaries share one memory pool),
so the graphs cost a few MB, not a copy per layer. A step's output is cloned out of ``y`` (the
stepper keeps it for the next layer).

Which steps: a layer below the last with no forward hook (a press's, LLMS's statistics: they
must see the modules run), the fast attention forward (:mod:`sparkv.runtime.fastops`, whose
decomposition the graphs run), at most :data:`MAX_ROWS` rows (a larger span is not
launch-bound), a shape seen :data:`CAPTURE_AFTER` times (a one-off shape, as the last short
chunk, runs eagerly). On where :func:`sparkv.runtime.device.cuda_graphs` says (a GPU;
``SPARKV_CUDA_GRAPHS=1|0`` overrides). A capture that fails (an op that syncs the host, a
kernel that cannot be captured) turns the graphs off for the model, with its reason in
:attr:`LayerGraphs.failure`, and the steps run eagerly; nothing was written by then.

``emulate=True`` replays by running the same function again over the same static buffers: the
CPU tests run every buffer, copy and lock of this path without CUDA.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sparkv.runtime.fastops import is_fast_attention, project_qkv
from sparkv.runtime.hooks import has_forward_hooks

#: the most rows a graphed step has (a larger span's launches are a small part of its time)
MAX_ROWS = 2048
#: a (layer, rows) shape is captured the time it is seen for this many times
CAPTURE_AFTER = 2


@dataclass
class _Buffers:
    """The static tensors of one row count, shared by every layer's graphs."""

    x: torch.Tensor      # [1, n, hidden] the layer's input
    cos: torch.Tensor    # [1, n, D]
    sin: torch.Tensor
    q: torch.Tensor      # [1, Hq, n, D] after RoPE
    k: torch.Tensor      # [1, Hkv, n, D] after RoPE
    v: torch.Tensor
    attn: torch.Tensor   # [1, n, Hq * D] the attention's output
    y: torch.Tensor      # [1, n, hidden] the layer's output


class _Replay:
    """A captured CUDA graph of ``fn`` (``replay()`` runs its kernels again)."""

    def __init__(self, fn: Callable[[], None], device: torch.device, pool: Any) -> None:
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            fn()                            # warm-up: lazy initialisation stays out of the graph
            # capture_begin/end, not torch.cuda.graph: that one synchronises the device and
            # empties the allocator's caches at every capture (two per layer); thread-local, so
            # the link's and other threads' work goes on meanwhile
            self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                fn()
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)

    def replay(self) -> None:
        self.graph.replay()


class _Emulated:
    """``replay()`` runs ``fn`` again over the same static buffers (``emulate=True``)."""

    def __init__(self, fn: Callable[[], None], device: torch.device, pool: Any) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class LayerGraphs:
    """One model's piecewise layer-step graphs (module docstring); shared by its steppers.

    Args:
        lm: the loaded model (a :class:`~sparkv.runtime.model.LoadedModel`).
        emulate: replay by re-running the captured function (no CUDA needed; tests).
    """

    def __init__(self, lm: Any, emulate: bool = False) -> None:
        self.lm = lm
        self.emulate = emulate
        self.lock = threading.Lock()       # one step at a time over the shared buffers
        self.failure: str | None = None
        self.captures = 0                  # graphs captured
        self.replays = 0                   # graphed steps run
        self._seen: Counter[tuple[int, int]] = Counter()
        self._graphs: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._buffers: dict[int, _Buffers] = {}
        self._pool: Any = None
        self.num_layers = int(lm.config.num_hidden_layers)

    # ---- which steps ---------------------------------------------------------------------------
    def wants(self, l: int, x: torch.Tensor,  # noqa: E741
              rope: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether layer ``l``'s step over the rows ``x`` (with the cos/sin ``rope``) runs
        graphed: counts the shape and captures its graphs when it is due (module docstring);
        False while it runs eagerly."""
        n = int(x.shape[1])
        if self.failure is not None or not 0 < n <= MAX_ROWS or l >= self.num_layers - 1:
            return False
        layer = self.lm.decoder.layers[l]
        if not self._eligible(layer, x, rope):
            return False
        key = (l, n)
        if key in self._graphs:
            return True
        self._seen[key] += 1
        if self._seen[key] < CAPTURE_AFTER:
            return False
        return self._capture(layer, key, x, rope)

    def _eligible(self, layer: Any, x: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor]) -> bool:
        return (x.dim() == 3 and x.shape[0] == 1 and rope[0].dtype == x.dtype
                and is_fast_attention(layer.self_attn)
                and layer.input_layernorm.weight.dtype == x.dtype
                and not has_forward_hooks(layer))

    def _capture(self, layer: Any, key: tuple[int, int], x: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor]) -> bool:
        maker = _Emulated if self.emulate else _Replay
        try:
            with self.lock:
                b = self._buffers_for(key[1], x, rope[0])
                if self._pool is None and not self.emulate:
                    self._pool = torch.cuda.graph_pool_handle()
                pre = maker(lambda: self._pre(layer, b), x.device, self._pool)
                post = maker(lambda: self._post(layer, b), x.device, self._pool)
        except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly from now on
            self.failure = f"{type(exc).__name__}: {exc}"
            return False
        self._graphs[key] = (pre, post)
        self.captures += 2
        return True

    def _buffers_for(self, n: int, x: torch.Tensor, cos: torch.Tensor) -> _Buffers:
        """The static tensors of ``n`` rows (made on first use; under :attr:`lock`), in the
        shapes :func:`project_qkv` gives."""
        if n not in self._buffers:
            cfg = self.lm.config
            hq = int(cfg.num_attention_heads)
            hkv = int(getattr(cfg, "num_key_value_heads", None) or hq)
            d = int(self.lm.decoder.layers[0].self_attn.head_dim)

            def zeros(*shape: int) -> torch.Tensor:
                return torch.zeros(*shape, dtype=x.dtype, device=x.device)

            self._buffers[n] = _Buffers(
                x=zeros(1, n, x.shape[2]), cos=zeros(1, n, cos.shape[-1]),
                sin=zeros(1, n, cos.shape[-1]), q=zeros(1, hq, n, d), k=zeros(1, hkv, n, d),
                v=zeros(1, hkv, n, d), attn=zeros(1, n, hq * d), y=zeros(1, n, x.shape[2]))
        return self._buffers[n]

    # ---- the two graphed parts -----------------------------------------------------------------
    @staticmethod
    def _pre(layer: Any, b: _Buffers) -> None:
        h = layer.input_layernorm(b.x)
        q, k, v = project_qkv(layer.self_attn, h, b.cos, b.sin)
        b.q.copy_(q)
        b.k.copy_(k)
        b.v.copy_(v)

    @staticmethod
    def _post(layer: Any, b: _Buffers) -> None:
        x = layer.self_attn.o_proj(b.attn).add_(b.x)
        b.y.copy_(layer.mlp(layer.post_attention_layernorm(x)).add_(x))

    # ---- one graphed step ----------------------------------------------------------------------
    def run(self, l: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],  # noqa: E741
            attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
            ) -> torch.Tensor:
        """Layer ``l`` over the rows ``x`` (after :meth:`wants` said yes): the graph before
        attention, ``attend(q, k, v)`` (eager: it writes the K/V and returns ``[1, Hq, n,
        D]``), the graph after it; returns the layer's output (a tensor of its own)."""
        pre, post = self._graphs[(l, int(x.shape[1]))]
        b = self._buffers[int(x.shape[1])]
        with self.lock:
            b.x.copy_(x)
            b.cos.copy_(rope[0])
            b.sin.copy_(rope[1])
            pre.replay()
            out = attend(b.q, b.k, b.v)
            b.attn.view(1, b.attn.shape[1], -1, out.shape[-1]).copy_(out.transpose(1, 2))
            post.replay()
            self.replays += 1
            return b.y.clone()


_MODELS_LOCK = threading.Lock()


def graphs_of(lm: Any) -> LayerGraphs:
    """The model's one :class:`LayerGraphs` (made on first use, kept in ``lm.extra`` as long as
    the model)."""
    with _MODELS_LOCK:
        graphs = lm.extra.get("graphs")
        if graphs is None:
            graphs = lm.extra["graphs"] = LayerGraphs(lm)
        return graphs


__all__ = ["LayerGraphs", "graphs_of", "MAX_ROWS", "CAPTURE_AFTER"]
