"""The pattern engine's tokens: a pure function of (prompt, seed, position), no model, no I/O.

What the router's contract needs from an engine, and what this gives it:
1. Determinism: the token at a position depends only on the request's prefix (prompt, then tokens: the
   `GenerateRequest.prefix()`), the seed, and the position in the context, so two runs of one request agree.
2. Exact resume: a request resumed with the first k tokens it generated elsewhere (`resume`) continues with
   the tokens k, k+1, ... of the uninterrupted run (its positions are counted after the resumed tokens), so a
   test can check a resumed continuation token for token against `run(...)`.
3. Greedy ignores the seed (as a model's argmax does); sampling (temperature > 0) depends on it, so another
   seed gives another completion.
4. Tokens are printable ASCII bytes of the byte tokenizer (libs/common/tokenizer.py): every token is one
   character of text, and the engine never emits EOS (a request ends at max_tokens or max_seq).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

FIRST, LAST = 0x20, 0x7E  # printable ASCII: space to tilde
_SPAN = LAST - FIRST + 1


def prefix_key(prefix: Sequence[int]) -> bytes:
    """A digest of the request's prefix (computed once per request: a position's token then costs one hash)."""
    return hashlib.blake2b(b",".join(str(t).encode() for t in prefix), digest_size=16).digest()


def token_at(key: bytes, seed: int, position: int, *, sampled: bool) -> int:
    """The token at absolute context `position` of the request whose prefix digest is `key` (invariants 1, 3)."""
    salt = seed if sampled else 0
    h = hashlib.blake2b(key + salt.to_bytes(8, "little", signed=True) + position.to_bytes(8, "little"),
                        digest_size=8).digest()
    return FIRST + int.from_bytes(h, "little") % _SPAN


def run(prefix: Sequence[int], *, seed: int = 0, sampled: bool = False, resumed: int = 0,
        count: int) -> Iterator[int]:
    """`count` tokens of the request with this prefix, after `resumed` tokens it already has (invariant 2)."""
    key = prefix_key(prefix)
    start = len(prefix) + resumed
    for position in range(start, start + count):
        yield token_at(key, seed, position, sampled=sampled)
