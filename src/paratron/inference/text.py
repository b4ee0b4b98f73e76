"""A completion's text as its tokens arrive: decoded a few tokens at a time, cut at stop strings.

The text leaves out the tokenizer's special tokens unless a request keeps them (`skip_special_tokens`, default on,
as vLLM and OpenAI's API); kept, two adjacent special tokens are set apart by one space unless
`spaces_between_special_tokens` is off (vLLM's two fields, with their defaults). `TextDecoder` is that decoding.

Decoding every token of a completion after each new one costs time quadratic in its length; instead the text grows
by the decoding of a short window of recent tokens, less the text its earlier tokens already gave (a window starts
at a token boundary, where a tokenizer may drop a leading space, so the difference is what is new). A window whose
last character is incomplete (a multi-byte character cut between tokens) waits for the next token.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special tokens: a tokenizer.json's added tokens marked special, tiktoken's special
    ids (SentencePiece leaves its control pieces out of text itself; a NullTokenizer has none)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return frozenset(i for i, token in hf.get_added_tokens_decoder().items() if token.special)
    return frozenset(getattr(tokenizer, "special_ids", {}).values())


class TextDecoder:
    """Token ids -> text as a served completion shows it (see the module docstring)."""

    def __init__(self, tokenizer: Decoder, special: frozenset[int], skip: bool = True, spaces: bool = True) -> None:
        self.tokenizer, self.special, self.skip, self.spaces = tokenizer, special, skip, spaces

    def decode(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        if self.skip:
            return self.tokenizer.decode([i for i in ids if i not in self.special])
        # (cut between two adjacent special tokens, so that the space between them is ours to give or not)
        cuts = [k for k in range(1, len(ids)) if ids[k] in self.special and ids[k - 1] in self.special]
        bounds = [0, *cuts, len(ids)]
        parts = [self.tokenizer.decode(ids[a:b]) for a, b in zip(bounds, bounds[1:])]
        return (" " if self.spaces else "").join(parts)


class IncrementalText:
    """The text of one completion's tokens (see the module docstring), with the stop strings of its request."""

    def __init__(self, tokenizer: Decoder | None, stops: tuple[str, ...]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.text = ""
        """The text of the tokens decoded so far (an incomplete last character excluded)."""
        self._ids: list[int] = []
        self._prefix = 0  # (the window's first token)
        self._read = 0  # (the tokens whose text is in `text`)
        self._longest_stop = max((len(s) for s in stops), default=0)

    def add(self, token: int) -> str | None:
        """Take one more token; the stop string the text now holds, if any (the text is then cut before it)."""
        if self.tokenizer is None:
            return None
        self._ids.append(token)
        window = self.tokenizer.decode(self._ids[self._prefix :])
        if window.endswith("\ufffd"):
            return None
        before = self.tokenizer.decode(self._ids[self._prefix : self._read])
        new = window[len(before) :]
        searched_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += new
        self._prefix, self._read = self._read, len(self._ids)
        found = [(at, s) for s in self.stops if (at := self.text.find(s, searched_from)) >= 0]
        if not found:
            return None
        at, stop = min(found)
        self.text = self.text[:at]
        return stop

    def final(self) -> str:
        """The text that can no longer change while more tokens may come: without the start of a stop string."""
        held = 0
        for stop in self.stops:
            held = max(held, next((k for k in range(len(stop) - 1, 0, -1) if self.text.endswith(stop[:k])), 0))
        return self.text[: len(self.text) - held]
