"""Identifiers: short, sortable-by-time, URL- and subject-safe (no dots, which NATS treats as separators)."""

from __future__ import annotations

import os
import re
import time


def new_id(prefix: str = "") -> str:
    """A 20-hex-char id: 12 of milliseconds since the epoch, 8 random; `prefix-` in front when given."""
    body = f"{int(time.time() * 1000):012x}{os.urandom(4).hex()}"
    return f"{prefix}-{body}" if prefix else body


def subject_token(value: str) -> str:
    """Make a value safe to use as one NATS subject token (no '.', '*', '>' or whitespace)."""
    out = "".join(c if c.isalnum() or c in "-_" else "_" for c in value)
    return out or "_"


_SAFE_TOKEN = re.compile(r"[A-Za-z0-9_-]+")  # what subject_token keeps as it is


def spec_key(model: str, engine_class: str, version: str) -> str:
    """An agent's desired set of engines (`agents/<node>/specs/<key>`, `EngineInfo.spec_key`): one per model, engine
    class and version (a hot upgrade's new version is a new set)."""
    return "_".join(subject_token(p) for p in (model, engine_class, version))


def incident_id(short: str, engine_id: str, generation: int) -> str:
    """The incident of one failed engine generation (`short`: inc, mf, up: the reason), the same every time it is
    derived (the controller opens it, an agent looks its end up): subject- and URL-safe."""
    token = engine_id if _SAFE_TOKEN.fullmatch(engine_id) else subject_token(engine_id)  # the same, without a loop
    return f"{short}-{token}-g{generation}"


def cold_engine_id(incident: str) -> str:
    """The engine a fallback cold-starts for `incident` (the dc_manager spawns it by this name): a repeated spawn
    is one engine, and its fault names its incident before any result does (`cold_parent_of`)."""
    return f"cs-{incident}"


def cold_parent_of(engine_id: str) -> str | None:
    """The incident whose fallback engine `engine_id` is, by its name (`cold_engine_id`), or None."""
    return engine_id[3:] if engine_id.startswith("cs-") else None
