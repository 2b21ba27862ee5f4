"""The GPU health the agent wants its gpu_manager to hold and the manager has not answered yet, kept in the agent's
state dir (`<state_dir>/gpu_health_wishes.json`) so that a wish outlives the agent (gpu_reports.py sends it; a
restarted agent sends what it finds here again).

Why: the agent tells the manager a GPU failed until the manager answers, but those retries lived only in the agent's
memory; an agent killed while its manager was down took the fault with it, and the restarted manager went on
granting leases on a failed GPU.

Invariants:
1. The file holds, per GPU (by UUID: an index may name another GPU after a reboot), the latest wish not yet answered;
   it is written before the wish is first sent, and an entry leaves it only once its wish, or a later one, is
   answered or refused for good. No pending wish: no file.
2. The file is replaced whole (a temporary file in the same dir, fsync, rename, fsync of the dir) and created 0600:
   a reader sees the old content or the new, never a torn one, and only the agent's uid reads it.
3. A file that cannot be read back (not JSON, another shape) is logged, kept aside as `<name>.broken`, and taken as
   empty: a GPU's health is also in the manager's durable marks, and an agent that would not start is worse.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("holdfast.agent.gpu_wishes")

WISHES_FILE = "gpu_health_wishes.json"


class GpuWishes:
    """Pending wishes by GPU UUID: {uuid: (healthy, detail)}. `name_of(index)` gives a GPU's UUID."""

    def __init__(self, path: Path, name_of: Callable[[int], str]) -> None:
        self.path = path
        self._name_of = name_of
        self._wishes: dict[str, tuple[bool, str]] = {}

    def load(self) -> dict[str, tuple[bool, str]]:
        """What a previous agent left unanswered (and what this one now holds as pending)."""
        try:
            raw = json.loads(self.path.read_text())
            self._wishes = {str(k): (bool(v["healthy"]), str(v["detail"])) for k, v in raw.items()}
        except FileNotFoundError:
            self._wishes = {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            log.error("cannot read the pending GPU health wishes in %s (%s); kept aside as .broken, none resent",
                      self.path, e)
            os.replace(self.path, self.path.with_name(self.path.name + ".broken"))
            self._wishes = {}
        return dict(self._wishes)

    def put(self, gpu: int, healthy: bool, detail: str) -> None:
        self._wishes[self._name_of(gpu)] = (healthy, detail)
        self._write()

    def drop(self, gpu: int) -> None:
        if self._wishes.pop(self._name_of(gpu), None) is not None:
            self._write()

    def forget(self, name: str) -> None:
        """A wish for a GPU this node no longer has (by that UUID): nobody can act on it."""
        if self._wishes.pop(name, None) is not None:
            self._write()

    def _write(self) -> None:
        # Synchronous on the event loop: a few hundred bytes, written only when a GPU's health changes (rare), and
        # it must be durable before the wish is sent (invariant 1).
        if not self._wishes:
            self.path.unlink(missing_ok=True)
            _fsync_dir(self.path.parent)
            return
        body = json.dumps({k: {"healthy": h, "detail": d} for k, (h, d) in sorted(self._wishes.items())}).encode()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a leftover temporary file of another mode keeps it: set it, not only at creation
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
