"""The ready file an engine writes once it serves (or stands by): what its starter reads its endpoint and pid from.
Apart from http_thread.py: the batched engine serves HTTP from its front process and never imports uvicorn."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_ready_file(path: Path, info: dict[str, Any]) -> None:
    """The ready file, replaced whole (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)
