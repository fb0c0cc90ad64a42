"""The observation window and the attention scores every attention press starts from.

* :class:`WindowCapture` hooks each decoder layer's attention module during a forward pass and
  keeps, per layer, the queries and keys (after RoPE, and after q/k norms where the model has
  them) of the window's tokens. Question-agnostic: the window is the context's last ``w`` tokens
  (captured during its prefill). Question-aware: the window is the question (captured while the
  question is run over the full context).
* :func:`window_attention` turns them into ``[H, n]`` attention weights over the context's keys:
  ``softmax(Q_win K^T * scale)`` (causal inside the window), averaged over the window's queries
  and over each KV head's GQA query group (Ada-KV scores a GQA head by its group's mean).
* :func:`pool` smooths them along positions (SnapKV's max pooling, kernel 7; or average).
* :class:`ScoreInputs` is what a press's ``score_entries`` hook sees of one layer: the candidates'
  keys and values, the window's queries and hidden states, and the window attention when the press
  reads it (the same inputs through :func:`~sparkv.presses.compress` and ``with press(model):``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from sparkv.presses.errors import PressError


@dataclass
class Window:
    """Per layer, the window's queries ``q [Hq, w, D]`` and keys ``k [H, w, D]`` (post-RoPE),
    their positions ``pos [w]``, and whether they are part of the context (``inside``: the
    question-agnostic window, kept by every head) or follow it (the question); ``hidden``, per
    layer, the window tokens' input to the attention module ``[w, hidden_size]`` (after the
    layer's input norm)."""

    q: list[torch.Tensor] = field(default_factory=list)
    k: list[torch.Tensor] = field(default_factory=list)
    pos: torch.Tensor | None = None
    inside: bool = True
    scale: float = 1.0
    hidden: list[torch.Tensor] = field(default_factory=list)

    @property
    def size(self) -> int:
        return 0 if self.pos is None else int(self.pos.numel())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class WindowCapture:
    """Context manager: while active, every attention call of ``model`` records the projections
    of its last ``last`` tokens (all of them when ``last`` is ``None``) into :attr:`window`.

    Works for the Llama family's attention modules (Llama, Qwen2, Qwen3, Mistral): ``q_proj``,
    ``k_proj``, optional ``q_norm``/``k_norm``, ``position_embeddings=(cos, sin)``.
    """

    def __init__(self, model: Any, last: int | None, start: int, inside: bool) -> None:
        if last is not None and last < 1:
            raise PressError(f"the window needs at least one token, got {last}")
        self.model, self.last, self.start = model, last, start
        inner = getattr(model, "model", model)
        self.layers = list(inner.layers)
        empty = [torch.empty(0)] * len(self.layers)
        self.window = Window(q=list(empty), k=list(empty), inside=inside, hidden=list(empty))
        self._handles: list[Any] = []

    def __enter__(self) -> "WindowCapture":
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.self_attn.register_forward_pre_hook(
                self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, i: int) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden, cos, sin = attention_inputs(args, kwargs)
            n = int(hidden.shape[1])
            w = n if self.last is None else min(self.last, n)
            q, k = project_window(module, hidden[:1], cos[:1], sin[:1], w)
            self.window.q[i], self.window.k[i] = q, k
            self.window.hidden[i] = hidden[0, n - w:].detach().float()
            self.window.scale = float(module.scaling)
            self.window.pos = torch.arange(self.start + n - w, self.start + n)
        return hook


def attention_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention module's call arguments -> its ``hidden_states [B, T, hidden]`` and RoPE's
    ``cos, sin [B, T, D]``."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    rope = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
    if hidden is None or rope is None:
        raise PressError("the attention module was called without hidden_states and "
                         "position_embeddings (a Llama-family model is needed)")
    return hidden, rope[0], rope[1]


def project_window(module: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``w`` tokens' queries ``[Hq, w, D]`` and keys ``[H, w, D]`` (float32), computed
    from one sequence's attention input ``hidden [1, T, hidden]`` with the module's own
    projections (and q/k norms where it has them) and RoPE (``cos, sin [1, T, D]``)."""
    n = int(hidden.shape[1])
    h = hidden[:, n - w:]
    d = int(module.head_dim)
    q = module.q_proj(h).view(1, w, -1, d).transpose(1, 2)
    k = module.k_proj(h).view(1, w, -1, d).transpose(1, 2)
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    if getattr(module, "k_norm", None) is not None:
        k = module.k_norm(k)
    c, s = cos[:, n - w:].unsqueeze(1), sin[:, n - w:].unsqueeze(1)
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    return q[0].detach().float(), k[0].detach().float()


@dataclass
class ScoreInputs:
    """What a press's ``score_entries`` hook sees of one layer (``n`` candidate positions, ``w``
    window tokens; all float32, one sequence).

    Attributes:
        layer: the layer's index.
        keys: ``[H, n, D]`` the candidates' keys (after RoPE).
        values: ``[H, n, D]`` their values.
        queries: ``[Hq, w, D]`` the window's queries (after RoPE), or ``None`` (no window).
        hidden_states: ``[w, hidden_size]`` the window tokens' input to the attention module, or
            ``None`` (no window).
        attention: ``[H, n]`` the window's attention over the candidates (mean over the window's
            queries and each KV head's query group), or ``None`` when the press does not read it
            (``needs_attention`` is false).
    """

    layer: int
    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    attention: torch.Tensor | None = None

    @property
    def num_candidates(self) -> int:
        return int(self.keys.shape[1])


def window_attention(q: torch.Tensor, k_ctx: torch.Tensor, q_pos: torch.Tensor,
                     k_win: torch.Tensor | None = None, scale: float | None = None,
                     chunk: int = 4096) -> torch.Tensor:
    """Mean attention of the window's queries over the context's keys.

    Args:
        q: ``[Hq, w, D]`` window queries at positions ``q_pos [w]``.
        k_ctx: ``[H, N, D]`` the context's keys (positions ``0 .. N-1``).
        k_win: ``[H, w, D]`` the window's own keys when the window follows the context (the
            question: they take part in the softmax, causally); ``None`` when it is inside.
        scale: softmax scale (default ``D ** -0.5``).

    Returns ``[H, N]`` (float32): per KV head, the softmax weights averaged over the window's
    queries and the head's query group.
    """
    hq, w, d = q.shape
    hkv, n, _ = k_ctx.shape
    if hq % hkv:
        raise PressError(f"{hq} query heads do not group over {hkv} KV heads")
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    dev = k_ctx.device
    q, q_pos = q.to(dev), q_pos.to(dev)
    k_win = None if k_win is None else k_win.to(dev)
    qg = q.float().reshape(hkv, group * w, d)
    logits = torch.matmul(qg, k_ctx.float().transpose(1, 2)) * scale          # [H, g*w, N]
    qp = q_pos.view(1, 1, w).expand(hkv, group, w).reshape(hkv, group * w, 1)
    logits = logits.masked_fill(torch.arange(n, device=dev).view(1, 1, n) > qp, float("-inf"))
    parts = [logits]
    if k_win is not None:
        lw = torch.matmul(qg, k_win.float().transpose(1, 2)) * scale           # [H, g*w, w]
        kp = q_pos.view(1, 1, w)
        parts.append(lw.masked_fill(kp > qp, float("-inf")))
    full = torch.cat(parts, dim=-1)
    attn = torch.softmax(full, dim=-1)[..., :n]
    return attn.view(hkv, group, w, n).mean(dim=(1, 2))


def pool(scores: torch.Tensor, kernel: int, how: str = "max") -> torch.Tensor:
    """``[H, n]`` scores pooled along positions (stride 1, same length)."""
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    x = scores.unsqueeze(0)
    if how == "max":
        return F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)[0]
    return F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=False)[0]


def layer_kv(memory: Any, layer: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[H, stop, D]`` keys and values of positions ``0 .. stop-1`` of a full (unpruned) memory
    layer."""
    entries = memory.layer_entries(layer, stop)
    ks, vs = [], []
    for h, e in enumerate(entries):
        if int(e.pos.numel()) != stop:
            raise PressError(f"layer {layer}, head {h} holds {int(e.pos.numel())} of {stop} "
                             "positions: a press scores a full context")
        ks.append(e.k)
        vs.append(e.v)
    return torch.stack(ks), torch.stack(vs)


def layer_inputs(layer: int, keys: torch.Tensor, values: torch.Tensor, window: Window | None,
                 candidates: int, attend: bool) -> ScoreInputs:
    """One layer's :class:`ScoreInputs` from its full ``keys, values [H, N, D]`` (positions
    ``0 .. N-1``) and the window (``None``: no window); ``candidates`` the first positions a press
    chooses among; ``attend``: compute the window attention."""
    q = hidden = attention = None
    if window is not None and window.pos is not None:
        if window.q[layer].numel() == 0:
            raise PressError(f"no window was captured for layer {layer}")
        q = window.q[layer]
        hidden = window.hidden[layer] if layer < len(window.hidden) else None
    if attend:
        if q is None or window is None or window.pos is None:
            raise PressError("this press reads the window's attention: it needs a window")
        k_win = None if window.inside else window.k[layer]
        attention = window_attention(q, keys, window.pos, k_win, window.scale)
        attention = attention[:, :candidates].float().cpu()
    return ScoreInputs(layer, keys[:, :candidates].float(), values[:, :candidates].float(), q,
                       hidden, attention)
