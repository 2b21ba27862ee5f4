"""The deterministic pattern and its checksum (pure numpy; no SDK, no I/O)."""

from __future__ import annotations

import hashlib

import numpy as np


def fill(buf: np.ndarray, seed: int = 7) -> None:
    """Byte i holds (i * 31 + seed) mod 251: no period of a power of two, so a misplaced chunk shows."""
    n = buf.size
    step = 1 << 24
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        buf[lo:hi] = ((np.arange(lo, hi, dtype=np.uint64) * 31 + seed) % 251).astype(np.uint8)


def matches(buf: np.ndarray, seed: int = 7) -> bool:
    n = buf.size
    step = 1 << 24
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        if not np.array_equal(buf[lo:hi], ((np.arange(lo, hi, dtype=np.uint64) * 31 + seed) % 251).astype(np.uint8)):
            return False
    return True


def checksum(buf: np.ndarray) -> str:
    return hashlib.sha256(memoryview(np.ascontiguousarray(buf).tobytes())).hexdigest()
