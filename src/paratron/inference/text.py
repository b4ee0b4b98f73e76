"""A completion's text as its tokens arrive: decoded a few tokens at a time, cut at stop strings.

Decoding every token of a completion after each new one costs time quadratic in its length; instead the text grows
by the decoding of a short window of recent tokens, less the text its earlier tokens already gave (a window starts
at a token boundary, where a tokenizer may drop a leading space, so the difference is what is new). A window whose
last character is incomplete (a multi-byte character cut between tokens) waits for the next token.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


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
