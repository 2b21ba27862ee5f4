"""Byte-level tokenizer: token i < 256 is the byte i; 256 is BOS, 257 is EOS. Nothing to download.

Text is produced incrementally (`TextStream`): a UTF-8 character split over several byte tokens comes out
whole with its last byte, and one left unfinished at the end as U+FFFD (`flush`, on the final line). Invariant:
the text of a stream does not depend on how its tokens were chunked, so a generation resumed from (context +
tokens already generated) yields the same text as an uninterrupted one.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

BOS = 256
EOS = 257


def encode(text: str, *, bos: bool = True) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [BOS, *ids] if bos else ids


def tail_text(stream: TextStream) -> dict[str, str]:
    """A final line's `text`: the stream's unfinished last character, when there is one (else no key)."""
    tail = stream.flush()
    return {"text": tail} if tail else {}


def decode(tokens: Iterable[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


class TextStream:
    """Turns tokens into text one at a time; `prime` feeds context whose text is not wanted."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def prime(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.push(t)

    def push(self, token: int) -> str:
        if token >= 256:
            return ""
        return self._dec.decode(bytes([token]))

    def flush(self) -> str:
        """The text of bytes still held at the stream's end (a character its last tokens began and never finished:
        U+FFFD, as `decode` gives it); "" mostly. A generation's final line carries it: those bytes were dropped
        from the text while its usage counted their tokens (probe of 2026-12-07)."""
        return self._dec.decode(b"", final=True)
