"""Stop strings: a request's detokenised text cut before the first one.

The engine commits whole blocks, so a stop string can end mid-block (the text after it is
dropped) or straddle two blocks (the text that could begin one is held back until the next block
decides). Streamed pieces therefore always add up to the text a non-streamed request returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
"""What a detokeniser shows for a multi-byte character whose bytes have not all arrived."""


class StopText:
    """The text of one request, handed out as it grows.

    >>> cut = StopText(["\\n\\n"])
    >>> cut.feed("Hello\\n"), cut.feed("Hello\\n\\nBye"), cut.stopped_at
    ('Hello', '', 5)
    """

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(stops)
        self.sent = 0
        """Characters of the text handed out so far."""
        self.stopped_at: int | None = None
        """Where the first stop string begins, once one has appeared."""
        self.stop: str | None = None

    def feed(self, text: str, final: bool = False) -> str:
        """The part of ``text`` (all of the request's text so far) to hand out now; ``final``:
        no more text will come, nothing is held back. After a stop string nothing more comes."""
        if self.stopped_at is not None:
            return ""
        found = [(at, s) for s in self.stops if (at := text.find(s, self.sent)) >= 0]
        if found:
            self.stopped_at, self.stop = min(found)
            end = self.stopped_at
        else:
            end = len(text) if final else len(text) - self._held_back(text)
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that may still change meaning: the longest suffix
        that begins a stop string, and unfinished multi-byte characters."""
        held = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return min(held, len(text) - self.sent)


def tokens_through(tokenizer: Any, token_ids: Sequence[int], chars: int) -> int:
    """The fewest leading tokens of ``token_ids`` whose text has at least ``chars`` characters:
    the tokens a request spent up to the end of its stop string (usage counts these)."""
    low, high = 0, len(token_ids)
    while low < high:
        mid = (low + high) // 2
        if len(tokenizer.decode(token_ids[:mid], skip_special_tokens=True)) >= chars:
            high = mid
        else:
            low = mid + 1
    return low
