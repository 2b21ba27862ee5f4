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
4. A write the state dir refuses (ENOSPC, a read-only or vanished dir) raises nothing: it is logged, the old file
   stays whole (no temporary file is left), `unsaved` is set, and the whole set is written again by the next
   `put`, `drop` or `save` that can (the wish is still sent: gpu_reports.py invariant 4).
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
        self.unsaved = False  # the file is behind `_wishes`: a write was refused (invariant 4)

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

    def put(self, gpu: int, healthy: bool, detail: str) -> bool:
        """Keep the wish; True when it is on disk (invariant 4)."""
        self._wishes[self._name_of(gpu)] = (healthy, detail)
        return self.save()

    def drop(self, gpu: int) -> bool:
        if self._wishes.pop(self._name_of(gpu), None) is not None or self.unsaved:
            return self.save()
        return True

    def save(self) -> bool:
        """Write the pending wishes whole; False (logged, `unsaved`) when the state dir refuses it."""
        try:
            self._write()
        except OSError as e:
            if not self.unsaved:
                log.error("cannot keep the pending GPU health wishes in %s (%s): sent anyway, but an agent restart "
                          "before the gpu_manager answers loses them; written again once the disk takes it",
                          self.path, e)
            self.unsaved = True
            return False
        if self.unsaved:
            log.info("pending GPU health wishes written to %s again", self.path)
        self.unsaved = False
        return True

    def forget(self, name: str) -> None:
        """A wish for a GPU this node no longer has (by that UUID): nobody can act on it."""
        if self._wishes.pop(name, None) is not None:
            self.save()

    def _write(self) -> None:
        # Synchronous on the event loop: a few hundred bytes, written only when a GPU's health changes (rare), and
        # it must be durable before the wish is sent (invariant 1).
        if not self._wishes:
            self.path.unlink(missing_ok=True)
            _fsync_dir(self.path.parent)
            return
        body = json.dumps({k: {"healthy": h, "detail": d} for k, (h, d) in sorted(self._wishes.items())}).encode()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)  # a leftover temporary file of another mode keeps it: set it, not only at creation
                view = memoryview(body)
                while view:  # a short write (the disk filling up) is not the whole file: write on, or fail
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # the old file stays as it was (invariant 2)
            raise
        _fsync_dir(self.path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
