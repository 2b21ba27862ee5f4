"""The host tier's registrations, by copy name (pure bookkeeping, no CUDA import: the cuda backend's page-locked
copies are host_tier_cuda.RegisteredCopy, made by the `register` it is given).

Invariants:
1. A registration is closed (unregistered and unmapped) only once no restore uses it (`acquire`/`release` count
   users).
2. A registration serves only the copy it was made from (its key: name, root hash, size, creation time); a
   replaced or dropped copy's registration is retired at the next `acquire` or `prune` (the write of a copy
   prunes before it registers), so the registered bytes pass the tier's only while a restore still reads a
   replaced copy.
3. A failed registration leaves nothing mapped or registered (the copy's own constructor); the caller falls
   back to the bounce path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from libs.common.errors import HoldfastError
from services.gpu_manager.artifact import Manifest

log = logging.getLogger("holdfast.gpu_manager.tier_pins")


class Registration(Protocol):
    sizes: list[int]
    register_s: float

    def close(self) -> None: ...


Register = Callable[[Sequence[int], Sequence[int], int], Any]  # (fds, file sizes, gpu ordinal) -> Registration


def copy_key(man: Manifest) -> tuple[str, str, int, float]:
    return (man.name, man.root, man.size, man.created_at)


@dataclass
class _Entry:
    key: tuple[str, str, int, float]
    copy: Any
    users: int = 0
    retired: bool = False


class TierPins:
    """Thread-safe: restores run on worker threads, the health reply reads `bytes` on the event loop."""

    def __init__(self, register: Register) -> None:
        self._register = register
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._limbo: list[_Entry] = []  # retired while in use: closed by their last release (invariant 1)

    def acquire(self, man: Manifest, fds: Sequence[int], ordinal: int) -> tuple[Any, float]:
        """The copy's registration (made now if needed) and the seconds registering took now (0: it was there).
        Raises what `register` raises when it cannot be made: the caller takes the bounce path."""
        key = copy_key(man)
        with self._lock:
            entry = self._entries.get(man.name)
            if entry is not None and entry.key != key:
                self._retire(man.name, entry)  # invariant 2
                entry = None
            took = 0.0
            if entry is None:
                entry = _Entry(key, self._register(fds, [f.bytes for f in man.files], ordinal))
                self._entries[man.name] = entry
                took = entry.copy.register_s
                log.info("host tier copy %s page-locked in place: %d bytes in %.3f s", man.name, man.size, took)
            entry.users += 1
            return entry.copy, took

    def release(self, copy: Any) -> None:
        with self._lock:
            for entry in [*self._entries.values(), *self._limbo]:
                if entry.copy is copy:
                    entry.users -= 1
                    if entry.retired and entry.users == 0:
                        self._limbo.remove(entry)
                        entry.copy.close()
                    return

    def _retire(self, name: str, entry: _Entry) -> None:
        del self._entries[name]
        entry.retired = True
        if entry.users == 0:
            entry.copy.close()
        else:
            self._limbo.append(entry)

    def prune(self, live: dict[str, Manifest]) -> None:
        """Retire the registrations of copies the tier no longer holds as they were (invariant 2)."""
        with self._lock:
            for name, entry in list(self._entries.items()):
                man = live.get(name)
                if man is None or copy_key(man) != entry.key:
                    self._retire(name, entry)

    def close(self) -> None:
        self.prune({})

    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def bytes(self) -> int:
        """Host memory page-locked now: every registration's, the retired ones still read by a restore included."""
        with self._lock:
            return sum(sum(e.copy.sizes) for e in [*self._entries.values(), *self._limbo])

    def pin(self, man: Manifest, fds: Sequence[int], ordinal: int) -> float | None:
        """Register a copy ahead of its restores (at its write or adoption; blocking): the seconds it took (0: it was
        registered), or None where it could not be (logged; its restores try again, else take the bounce path).
        `fds` are the caller's to close; the registration's mapping keeps the pages."""
        try:
            copy, took = self.acquire(man, fds, ordinal)
        except (OSError, HoldfastError) as e:  # CudaError is a HoldfastError
            log.warning("host tier copy %s could not be page-locked at its write (%s): its restores will try again, "
                        "else go through bounce buffers", man.name, e)
            return None
        self.release(copy)
        return took
