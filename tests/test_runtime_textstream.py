"""A growing answer's text decoded a window at a time (sparkv/runtime/textstream.py): the
pieces it gives add up to the whole answer decoded, at every token."""

from __future__ import annotations

import random

import pytest

from sparkv.runtime.textstream import TextStream

TEXT = ("Plain words, then accents (café, naïve), CJK (東京タワー), emoji 👩‍👩‍👧 and 🚀🚀, "
        "tabs\tand\nnew lines, a <|im_end|> written out, and numbers 3.14159.")


def test_the_pieces_add_up_to_the_whole_decode_at_every_token(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False, split_special_tokens=True)
    rng = random.Random(7)
    ids += [rng.randrange(len(tok)) for _ in range(200)]      # any tokens, split characters too
    stream = TextStream(smollm2.decode_tokens)
    got = ""
    for i, t in enumerate(ids):
        got += stream.add(t)
        assert got == stream.text
        assert smollm2.decode_tokens(ids[:i + 1]).startswith(got)
    whole = smollm2.decode_tokens(ids)
    assert got == whole.rstrip("\ufffd") and TEXT in got   # at most a split character held


def _sentencepiece(pieces: dict[int, str]):
    """A decode that drops the leading space of what it decodes (as SentencePiece does)."""
    def decode(ids: list[int]) -> str:
        text = "".join(pieces[i] for i in ids)
        return text[1:] if text.startswith(" ") else text
    return decode


@pytest.mark.parametrize("ids", [[1, 2, 3, 1, 4], [4, 4, 2], [3, 0, 1, 0, 2]])
def test_a_tokenizer_that_drops_a_leading_space_loses_no_space_mid_answer(ids):
    decode = _sentencepiece({0: "", 1: " Hello", 2: " world", 3: ",", 4: " again"})
    stream = TextStream(decode)
    for t in ids:
        stream.add(t)
    assert stream.text == decode(ids)


def test_a_decode_that_rewrites_what_came_before_resyncs_on_the_whole_text():
    """A window whose text is not the one before plus more (a normalizing decoder) makes the
    stream decode the whole answer once, and go on from there."""
    calls = []

    def decode(ids: list[int]) -> str:
        calls.append(len(ids))
        text = "".join("ab"[i] for i in ids)
        return text.replace("ab", "X")              # a later token changes the earlier text

    stream = TextStream(decode)
    pieces = [stream.add(t) for t in (0, 0, 1, 0)]
    assert pieces[:2] == ["a", "a"] and stream.text.startswith("aa")
    assert "".join(pieces) == stream.text
