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


def _close(entries: list[_Entry]) -> None:
    """Unregister and unmap, out of the table's lock (seconds for a large copy)."""
    for entry in entries:
        entry.copy.close()


class TierPins:
    """Thread-safe: restores and the tier's writes register on worker threads, and the health reply reads `bytes`
    on the event loop. The table's lock is held for dict work only, never across a registration or a close (each
    takes seconds for a large copy: 17 s to register 96 GiB on an H200), so whatever reads the table (health, a
    restore of another copy) never waits behind one; one registration per copy name runs at a time (its gate)."""

    def __init__(self, register: Register) -> None:
        self._register = register
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._limbo: list[_Entry] = []  # retired while in use: closed by their last release (invariant 1)
        self._gates: dict[str, threading.Lock] = {}

    def acquire(self, man: Manifest, fds: Sequence[int], ordinal: int) -> tuple[Any, float]:
        """The copy's registration (made now if needed) and the seconds registering took now (0: it was there).
        Raises what `register` raises when it cannot be made: the caller takes the bounce path."""
        key = copy_key(man)
        with self._lock:
            entry, done = self._use(man.name, key)
            gate = self._gates.setdefault(man.name, threading.Lock())
        _close(done)
        if entry is not None:
            return entry.copy, 0.0
        with gate:
            with self._lock:  # another caller may have registered it while this one waited at the gate
                entry, done = self._use(man.name, key)
            _close(done)
            if entry is not None:
                return entry.copy, 0.0
            copy = self._register(fds, [f.bytes for f in man.files], ordinal)  # the table is free meanwhile
            with self._lock:
                self._entries[man.name] = _Entry(key, copy, users=1)  # only this gate's holder adds `name`
        log.info("host tier copy %s page-locked in place: %d bytes in %.3f s", man.name, man.size, copy.register_s)
        return copy, copy.register_s

    def _use(self, name: str, key: tuple[str, str, int, float]) -> tuple[_Entry | None, list[_Entry]]:
        """(Under the lock.) The current registration of `name` with one more user, or None; and a stale one's
        entry to close (invariant 2) once the lock is let go."""
        entry = self._entries.get(name)
        if entry is not None and entry.key != key:
            return None, self._retire(name, entry)
        if entry is not None:
            entry.users += 1
        return entry, []

    def release(self, copy: Any) -> None:
        done: list[_Entry] = []
        with self._lock:
            for entry in [*self._entries.values(), *self._limbo]:
                if entry.copy is copy:
                    entry.users -= 1
                    if entry.retired and entry.users == 0:
                        self._limbo.remove(entry)
                        done.append(entry)
                    break
        _close(done)

    def _retire(self, name: str, entry: _Entry) -> list[_Entry]:
        """(Under the lock.) Out of the table; to close now (returned) if nobody reads it, else at its last
        release."""
        del self._entries[name]
        entry.retired = True
        if entry.users == 0:
            return [entry]
        self._limbo.append(entry)
        return []

    def prune(self, live: dict[str, Manifest]) -> None:
        """Retire the registrations of copies the tier no longer holds as they were (invariant 2)."""
        done: list[_Entry] = []
        with self._lock:
            for name, entry in list(self._entries.items()):
                man = live.get(name)
                if man is None or copy_key(man) != entry.key:
                    done += self._retire(name, entry)
        _close(done)

    def close(self) -> None:
        self.prune({})

    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def bytes(self) -> int:
        """Host memory page-locked: every registration's, the retired ones still read by a restore included (not one
        being made, nor one being unregistered: each leaves the table before its close begins)."""
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
