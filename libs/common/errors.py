"""Two error families (STYLE.md): typed errors that travel back to a caller as an error reply, and broken
invariants, which are logged loudly and crash the process so its supervisor restarts it from durable state."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar


class HoldfastError(Exception):
    """An error a caller can receive as a typed reply. `code` is stable and machine-readable."""

    code: ClassVar[str] = "error"

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code)
        self.message = message or self.code

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class MalformedMessage(HoldfastError):
    code = "malformed"


class UnknownType(MalformedMessage):
    code = "unknown_type"


class NotFound(HoldfastError):
    code = "not_found"


class Conflict(HoldfastError):
    code = "conflict"


class PermissionDenied(HoldfastError):
    code = "permission_denied"


class WrongNode(PermissionDenied):
    """A command whose envelope names another node than the one its receiver serves: refused, never acted on."""

    code = "wrong_node"


class StaleEpoch(HoldfastError):
    code = "stale_epoch"


class StaleTerm(HoldfastError):
    """A command of a leader whose term has ended (a newer one leads, or none): refused, never run."""

    code = "stale_term"


class InvalidTransition(HoldfastError):
    code = "invalid_transition"


class CommandTimeout(HoldfastError):
    code = "timeout"


class Expired(HoldfastError):
    """A command that reached its handler after its caller had stopped waiting (the receiver was stopped, a paused
    VM, its queue backed up): refused, never acted on. Its caller took the silence as a timeout and went on (a retry,
    another step); acting on it now would act twice or on a past state."""

    code = "expired"


class Unavailable(HoldfastError):
    code = "unavailable"


class RemoteError(HoldfastError):
    """An error reply received from another service; keeps the remote code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.remote_code = code

    def to_dict(self) -> dict[str, str]:
        return {"code": self.remote_code, "message": self.message}


# Failures that say nothing about the work itself: a dependency unreachable or slow, leadership in doubt. A durable
# consumer retries the message for as long as they last (libs/common/bus/durable.py `retry_after`); any other failure
# counts towards its limit of deliveries. The adapters add their clients' own (store.py: etcd's; bus: NATS's).
_TEMPORARY: tuple[type[BaseException], ...] = ()
_TEMPORARY_IF: list[Callable[[BaseException], bool]] = []


def count_as_temporary(*types: type[BaseException]) -> None:
    global _TEMPORARY
    _TEMPORARY = (*_TEMPORARY, *(t for t in types if t not in _TEMPORARY))


def count_as_temporary_if(test: Callable[[BaseException], bool]) -> None:
    """For a client whose errors say what they are by a code, not a type (etcd's refusals: a gRPC status)."""
    if test not in _TEMPORARY_IF:
        _TEMPORARY_IF.append(test)


def temporary(error: BaseException) -> bool:
    return isinstance(error, _TEMPORARY) or any(test(error) for test in _TEMPORARY_IF)


class InvariantBroken(RuntimeError):
    """Not a reply: a bug or corrupted state. Let it crash the process."""


class WatchCompacted(HoldfastError):
    """A watch asked etcd for changes from a revision that etcd has compacted away: the changes between that
    revision and `compacted_revision` are gone, so resuming cannot fill the gap. The watcher must resync from a
    fresh snapshot (`ClusterView.follow` does) and watch again from that snapshot's revision + 1."""

    code = "watch_compacted"

    def __init__(self, prefix: str, revision: int | None, compacted_revision: int) -> None:
        super().__init__(f"watch of {prefix!r} from revision {revision} is behind etcd's compaction "
                         f"(history kept from {compacted_revision})")
        self.prefix = prefix
        self.revision = revision
        self.compacted_revision = compacted_revision


count_as_temporary(Unavailable, CommandTimeout, TimeoutError, ConnectionError)
