"""Stop strings over streamed text (pure logic): text is let out only once no stop string can start in it.

Invariants:
1. The text let out, joined, is the generated text up to (not including) the stop string that is complete
   first (the occurrence that ends earliest; of two ending at one place, the longer), however the text was
   split into pieces: a stop string split over several pieces is found. "Complete first" is what generating
   means: with stops `a` and `baa`, `bba` stops at `a` before `baa` could ever be seen.
2. Nothing that could still turn out to be the start of a stop string is let out early, and nothing else is
   held back: a held tail is always a proper prefix of some stop string.
"""

from __future__ import annotations


class StopScanner:
    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The text that may go to the client now; after a match, `stopped` is set and later text is dropped."""
        if self.stopped:
            return ""
        buf = self.held + text
        hits = [(i + len(s), i) for s, i in ((s, buf.find(s)) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.held = ""
            return buf[:min(hits)[1]]
        keep = self._open_prefix(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The generation ended without a match: what was held back is plain text after all."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _open_prefix(self, buf: str) -> int:
        """The length of the longest tail of `buf` that is a proper prefix of a stop string (invariant 2)."""
        longest = max((len(s) for s in self.stops), default=0)
        for n in range(min(len(buf), longest - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
