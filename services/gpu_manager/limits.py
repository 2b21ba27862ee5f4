"""What one client may take from the gpu_manager (issue 18), as pure functions of counts the session gathers
(no I/O here). Every refusal is a typed error the client gets as a reply; the connection stays usable.

Invariants (checked by tests/gpu_manager/test_limits_allocate.py):
1. A uid holds at most `max_connections_per_uid` open connections to the engine socket, and one process at most
   `max_connections_per_pid` of them; one more gets `too_many_connections` and is closed. Slots are counted from
   accept to close, hello or not. The per-process cap keeps one process leaking connections from taking its uid's
   every slot: engines of a node run as one uid, so the others would be refused (no allocate, no takeover).
2. An allocate is refused before any memory or fd is made when its lease would have more chunks than
   `max_chunks_per_lease` (too_many_chunks), when the chunk fds of the calling process's live leases would pass
   its cap (too_many_fds: `max_fds_per_client`, or `fd_share_per_client` of the manager's soft RLIMIT_NOFILE where
   that is less, so on a machine whose limit is below the setting one process still cannot take every fd and the
   others keep room), or the manager's open fds would come within `fd_reserve` of its RLIMIT_NOFILE
   (too_many_fds), or when the bytes leased on its gpu would pass the backend's capacity (out_of_memory).
   The reserve is what keeps accept() and the manager's own files working while leases are large.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from libs.client.protocol import OutOfMemory, TooManyChunks, TooManyConnections, TooManyFds
from services.gpu_manager.backends import round_up


@dataclass(frozen=True)
class LeaseShape:
    """An allocate as the manager will make it: size and chunk rounded to the backend's granularity."""

    size: int
    chunk: int

    @property
    def chunks(self) -> int:
        return -(-self.size // self.chunk)


def lease_shape(size: int, chunk_size: int, granularity: int) -> LeaseShape:
    return LeaseShape(round_up(size, granularity), round_up(chunk_size, granularity))


@dataclass(frozen=True)
class Usage:
    """What is held when an allocate arrives."""

    client_fds: int  # chunk fds of the live leases owned by the calling process
    open_fds: int  # the manager's open fds
    fd_limit: int  # its soft RLIMIT_NOFILE
    leased_bytes: int  # bytes of the live leases on the allocate's gpu
    capacity: int  # the backend's capacity of that gpu


@dataclass(frozen=True)
class ClientLimits:
    max_chunks_per_lease: int
    max_fds_per_client: int
    fd_reserve: int
    fd_share: float = 1.0  # of the manager's soft RLIMIT_NOFILE, at most, per client (invariant 2)

    def fd_cap(self, fd_limit: int) -> int:
        """Chunk fds one process may hold under the manager's soft RLIMIT_NOFILE `fd_limit` (invariant 2)."""
        return min(self.max_fds_per_client, int(self.fd_share * fd_limit))

    def check_allocate(self, shape: LeaseShape, usage: Usage) -> None:
        n = shape.chunks
        if n > self.max_chunks_per_lease:
            raise TooManyChunks(f"{shape.size} bytes in chunks of {shape.chunk} is {n} chunks, more than the "
                                f"limit of {self.max_chunks_per_lease} per lease: ask for larger chunks")
        cap = self.fd_cap(usage.fd_limit)
        if usage.client_fds + n > cap:
            why = ("max_fds_per_client" if cap == self.max_fds_per_client else
                   f"{self.fd_share:g} of the gpu_manager's RLIMIT_NOFILE of {usage.fd_limit}")
            raise TooManyFds(f"this process's leases hold {usage.client_fds} chunk fds; {n} more passes the "
                             f"limit of {cap} per client ({why}): ask for larger chunks, or free leases")
        if usage.open_fds + n > usage.fd_limit - self.fd_reserve:
            raise TooManyFds(f"the gpu_manager holds {usage.open_fds} of its {usage.fd_limit} fds; {n} more "
                             f"would leave fewer than {self.fd_reserve} free")
        if usage.leased_bytes + shape.size > usage.capacity:
            free = max(0, usage.capacity - usage.leased_bytes)
            raise OutOfMemory(f"{shape.size} bytes asked, {free} of a capacity of {usage.capacity} free")


class ConnectionCount:
    """Open engine connections per uid and per process (invariant 1)."""

    def __init__(self, limit: int, per_pid: int | None = None) -> None:
        self.limit = limit
        self.per_pid = per_pid  # None: no cap of its own (the uid's only)
        self.by_uid: Counter[int] = Counter()
        self.by_pid: Counter[int] = Counter()
        self.refused = 0

    def admit(self, uid: int, pid: int = 0) -> None:
        """Count a new connection of process `pid` of `uid`, or raise (and count nothing)."""
        if self.by_uid[uid] >= self.limit:
            raise TooManyConnections(f"uid {uid} holds {self.by_uid[uid]} connections, the limit")
        if self.per_pid is not None and pid > 0 and self.by_pid[pid] >= self.per_pid:  # 0: another pid namespace
            raise TooManyConnections(f"pid {pid} holds {self.by_pid[pid]} connections, the limit of one process")
        self.by_uid[uid] += 1
        self.by_pid[pid] += 1

    def release(self, uid: int, pid: int = 0) -> None:
        for counts, key in ((self.by_uid, uid), (self.by_pid, pid)):
            counts[key] -= 1
            if counts[key] <= 0:
                del counts[key]
