"""Choosing tokens that keep an answer inside a :class:`~sparkv.runtime.jsonform.JsonForm`.

* :class:`TokenBytes`: a vocabulary's tokens as the bytes each adds to the answer's text
  (byte-level BPE, as SmolLM2's and Llama 3's, read exactly; SentencePiece's ``▁`` and
  ``<0xNN>`` pieces too); special tokens add none and are never chosen inside a form;
  :func:`vocabulary` makes a model's once.
* :class:`FormGuide`: one answer's place in its form. :meth:`FormGuide.mask` keeps the logits
  of the tokens whose first byte may come next (one gather over the vocabulary);
  :meth:`FormGuide.fits` tries a token's whole text; :meth:`FormGuide.advance` takes the chosen
  one. End-of-sequence fits where the answer may end (:func:`~sparkv.runtime.jsonform.may_end`:
  a whole value, or prose); once the value is whole, it is the only token left.

The chooser (:class:`~sparkv.runtime.sampling.TokenChooser`) chooses from the masked logits as
it would from any (greedy, or drawn by the sampling rule) and, while the token it chose does
not fit whole, rules it out and chooses again: greedy, the most likely token that fits;
sampled, a draw from the rule's distribution over the tokens that fit. The answer is always a
prefix of a value of the form, and a whole value when it ends before its token cap.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from sparkv.runtime.jsonform import (JsonForm, State, complete, feed, first_bytes, may_end,
                                     next_key, step)

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

__all__ = ["TokenBytes", "FormGuide", "vocabulary", "bytes_of_pieces"]

#: first-byte index of a token that adds no text (special tokens): never allowed in a form
_NO_TEXT = 256
#: the refused-token masks one answer keeps (a vocabulary's bools each: 49 KB for SmolLM2's)
_KEPT_MASKS = 64


@dataclass(eq=False)
class TokenBytes:
    """Each token id's text as bytes (``None``: a special token, no text) and the model's
    end-of-sequence ids."""

    texts: list[bytes | None]
    eos: tuple[int, ...]

    def __post_init__(self) -> None:
        self.first = torch.tensor([t[0] if t else _NO_TEXT for t in self.texts],
                                  dtype=torch.long)
        self._order: tuple[list[bytes], list[int]] | None = None

    def __len__(self) -> int:
        return len(self.texts)

    def text(self, token: int) -> bytes | None:
        return self.texts[token] if 0 <= token < len(self.texts) else None

    def fitting(self, state: State) -> list[int]:
        """Every token whose whole text may come after ``state``: a walk over the texts in
        byte order that steps each shared prefix once and skips, at one search, every text
        that begins with a prefix the form refuses (a few hundred steps where the form allows
        few bytes; about one per token inside a string)."""
        texts, ids = self._sorted()
        out: list[int] = []
        states, prev, i = [state], b"", 0
        while i < len(texts):
            t = texts[i]
            c = _shared(prev, t, len(states) - 1)
            del states[c + 1:]
            s: State | None = states[c]
            for d in range(c, len(t)):
                s = step(states[d], t[d])
                if s is None:
                    i = bisect.bisect_left(texts, _after(t[:d + 1]), i + 1)
                    prev = t[:d]
                    break
                states.append(s)
            else:
                out.append(ids[i])
                prev, i = t, i + 1
        return out

    def _sorted(self) -> tuple[list[bytes], list[int]]:
        if self._order is None:
            pairs = sorted((t, i) for i, t in enumerate(self.texts) if t)
            self._order = ([t for t, _ in pairs], [i for _, i in pairs])
        return self._order


def _shared(a: bytes, b: bytes, most: int) -> int:
    """How many leading bytes ``a`` and ``b`` share (at most ``most``)."""
    n = min(len(a), len(b), most)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _after(prefix: bytes) -> bytes:
    """The least byte string past every string that begins with ``prefix``."""
    while prefix and prefix[-1] == 0xFF:
        prefix = prefix[:-1]
    return prefix[:-1] + bytes([prefix[-1] + 1]) if prefix else b"\xff" * 64


def vocabulary(lm: "LoadedModel") -> TokenBytes:
    """``lm``'s :class:`TokenBytes` (made once, kept in ``lm.extra``; ``ValueError`` for a model
    without a tokenizer)."""
    got = lm.extra.get("token_bytes")
    if got is None:
        if lm.tokenizer is None:
            raise ValueError(f"model {lm.name} has no tokenizer: an answer's JSON form needs "
                             "its tokens' texts")
        size = max(len(lm.tokenizer), int(getattr(lm.config, "vocab_size", 0) or 0))
        eos = lm.eos_ids or {lm.tokenizer.eos_token_id} - {None}    # a config naming none
        got = lm.extra["token_bytes"] = TokenBytes(_token_texts(lm.tokenizer, size),
                                                   tuple(sorted(eos)))
    return got


def _token_texts(tok: Any, size: int) -> list[bytes | None]:
    special = set(getattr(tok, "all_special_ids", ()) or ())
    special |= {i for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items()
                if getattr(t, "special", False)}       # skipped when an answer is decoded
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    texts = bytes_of_pieces(pieces)
    for i in special:
        if 0 <= i < len(texts):
            texts[i] = None
    return texts + [None] * (size - len(texts))


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
            + list(range(0xAE, 0x100)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_alphabet()
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def bytes_of_pieces(pieces: Sequence[str | None]) -> list[bytes | None]:
    """Token pieces (``convert_ids_to_tokens``) as the bytes they decode to: byte-level BPE's
    alphabet read back to bytes, unless a piece holds SentencePiece's ``▁`` (then ``▁`` is a
    space and ``<0xNN>`` a byte); a piece outside the alphabet (an added token) as its UTF-8."""
    byte_level = not any("\u2581" in p for p in pieces if p)   # SentencePiece's space
    out: list[bytes | None] = []
    for p in pieces:
        if not p:
            out.append(None)
        elif byte_level and all(c in _BYTE_LEVEL for c in p):
            out.append(bytes(_BYTE_LEVEL[c] for c in p))
        elif (m := _SP_BYTE.match(p)) is not None:
            out.append(bytes([int(m.group(1), 16)]))
        else:
            out.append(p.replace("\u2581", " ").encode())
    return out


class FormGuide:
    """One answer's place in its form, over a vocabulary."""

    def __init__(self, form: JsonForm, vocab: TokenBytes) -> None:
        if not vocab.eos:
            raise ValueError("an answer's JSON form needs the model's end-of-sequence token")
        self.vocab = vocab
        self.state: State = form.start()
        self._ends = form.ends
        self._text = bytearray()                # the answer so far (for ``form.ends``)
        self._refused: dict[tuple, torch.Tensor] = {}

    @property
    def whole(self) -> bool:
        """Whether the answer so far is a whole value, or ends early where its form's
        ``ends`` says (only end-of-sequence may follow)."""
        return complete(self.state) or (self._ends is not None and may_end(self.state)
                                        and self._ends(bytes(self._text)))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every token whose first byte may not come next at ``-inf`` (the
        refused tokens' mask made once per :func:`~sparkv.runtime.jsonform.next_key`)."""
        key = next_key(self.state)
        refused = self._refused.get(key)
        if refused is None or refused.numel() != logits.numel():
            firsts = torch.tensor(first_bytes(self.state) + [False], dtype=torch.bool)
            n = min(logits.numel(), len(self.vocab))
            allowed = torch.zeros(logits.numel(), dtype=torch.bool)
            allowed[:n] = firsts[self.vocab.first[:n]]
            if may_end(self.state):
                allowed[[t for t in self.vocab.eos if t < logits.numel()]] = True
            refused = (~allowed).to(logits.device)
            if len(self._refused) >= _KEPT_MASKS:
                self._refused.pop(next(iter(self._refused)))
            self._refused[key] = refused
        return logits.masked_fill(refused, float("-inf"))

    def fitting(self) -> list[int]:
        """Every token whose whole text may come next (:meth:`TokenBytes.fitting`), and
        end-of-sequence where the answer may end."""
        ends = list(self.vocab.eos) if may_end(self.state) else []
        return self.vocab.fitting(self.state) + ends

    def fits(self, token: int) -> bool:
        """Whether ``token``'s whole text may come next (end-of-sequence: whether the answer
        may end here)."""
        if token in self.vocab.eos:
            return may_end(self.state)
        text = self.vocab.text(token)
        return text is not None and feed(self.state, text) is not None

    def advance(self, token: int) -> None:
        """Takes the chosen ``token`` (end-of-sequence, or one that :meth:`fits`)."""
        if token in self.vocab.eos:
            return
        text = self.vocab.text(token) or b""
        state = feed(self.state, text)
        if state is None:
            raise ValueError(f"token {token} does not fit the answer's JSON form")
        self.state = state
        if self._ends is not None:
            self._text += text
