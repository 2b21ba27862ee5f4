"""Identifiers: short, sortable-by-time, URL- and subject-safe (no dots, which NATS treats as separators)."""

from __future__ import annotations

import os
import time


def new_id(prefix: str = "") -> str:
    """A 20-hex-char id: 12 of milliseconds since the epoch, 8 random; `prefix-` in front when given."""
    body = f"{int(time.time() * 1000):012x}{os.urandom(4).hex()}"
    return f"{prefix}-{body}" if prefix else body


def subject_token(value: str) -> str:
    """Make a value safe to use as one NATS subject token (no '.', '*', '>' or whitespace)."""
    out = "".join(c if c.isalnum() or c in "-_" else "_" for c in value)
    return out or "_"
