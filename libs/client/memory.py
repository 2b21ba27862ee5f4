"""The engine SDK for leased memory (DESIGN.md section 6). Blocking API; no PyTorch import at module level
(torch is optional: `lease.torch(...)` and `framework="torch"` import it when called).

    client = MemoryClient.connect("engine-7", engine_class="reference")
    if client.pending():                       # memory waits for me: a crash or restart of my engine id
        att = client.attach()
        params = att.tensors("torch")          # rebuilt from committed metadata, no disk read
    else:
        lease = client.allocate(1 << 30, tag="weights", name="w")
        w = lease.torch("float16", (1024, 1024))
        client.register([lease.meta("w", "float16", (1024, 1024))]); client.commit()
    client.start_heartbeats()

Every error the gpu_manager replies with is raised as its typed class (StaleEpoch, PermissionDenied,
PredecessorAlive, ...), with the same `code`. Every call is bounded: `timeout_s` (default
HF_GPU_MANAGER_TIMEOUT_S, else 60 s) without progress on the socket raises `CommandTimeout` (code `timeout`);
a manager that is down raises `Unavailable` after `reconnect_timeout_s`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from libs.client import protocol as p
from libs.client.connection import BROKEN, open_session, peer_gone, round_trip
from libs.client.connection import timeout_s as _timeout_s
from libs.client.mapping import CudaMapping, HostMapping, RangeMapping, close_all, local_ordinal
from libs.client.protocol import TensorMeta, contiguous_stride, tensor_extent
from libs.common import errors
from libs.common.backoff import Backoff
from libs.common.errors import CommandTimeout, HoldfastError, RemoteError, Unavailable
from libs.common.events import LeaseInfo, LeaseState
from libs.common.procs import ms_since

__all__ = ["Attachment", "MappedLease", "MemoryClient", "Reservation", "TensorMeta", "default_socket_path"]

log = logging.getLogger("holdfast.client.memory")


def default_socket_path() -> str:
    explicit = os.environ.get("HF_GPU_MANAGER_SOCKET")
    if explicit:
        return explicit
    state = os.environ.get("HF_STATE_DIR") or str(Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp")
                                                  / f"holdfast-{os.getuid()}")
    return str(Path(state) / "gpu_manager.sock")


def _error_classes() -> dict[str, type[HoldfastError]]:
    out: dict[str, type[HoldfastError]] = {}
    for mod in (errors, p):
        for value in vars(mod).values():
            if isinstance(value, type) and issubclass(value, HoldfastError) and value is not RemoteError:
                out.setdefault(value.code, value)
    from libs.common import wire

    for cls in (wire.FrameTooLarge, wire.TruncatedFrame, wire.WrongFdCount):
        out[cls.code] = cls
    return out


_ERRORS = _error_classes()


def dtype_name(dtype: Any) -> str:
    """'float16' from 'float16', numpy.float16, numpy.dtype('float16') or torch.float16."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    elif type(dtype).__module__.startswith("torch"):
        name = str(dtype).removeprefix("torch.")
    else:
        import numpy as np

        name = np.dtype(dtype).name
    if name not in p.DTYPE_SIZES:
        raise HoldfastError(f"unsupported dtype {dtype!r}")
    return name


def exit_on_lease_lost(lease_id: str, why: str) -> None:
    """An `on_lease_lost` policy for engines: the gpu_manager says a lease moved on while this engine was cut
    off from it (frozen for a successor, a newer epoch, reclaimed). Serving on would make two writers of one
    lease, so stop at once; the agent sees the exit like any other failure."""
    log.critical("lease %s is no longer ours (%s): exiting so no second writer serves from it", lease_id, why)
    os._exit(75)


def manager_split(took: dict[str, float], sent_wall: float, request_ms: float) -> dict[str, float]:
    """A grant's request time split by the manager's own marks (session.py): `to_manager_ms`, from this send until
    the manager had read the frame (the socket, and its event loop's other work first); its `parsed_ms`,
    `lock_wait_ms` and `grant_ms`; `back_ms`, the rest (the reply encoded, sent with its fds, read and decoded
    here). Same host, one clock; without `read_wall` (an older manager) the marks are passed on as they came."""
    read_wall = took.get("read_wall")
    if read_wall is None:
        return dict(took)
    there = round(max(0.0, (read_wall - sent_wall) * 1000), 3)
    inside = sum(took.get(k, 0.0) for k in ("parsed_ms", "lock_wait_ms", "grant_ms"))
    return {"to_manager_ms": there, **{k: v for k, v in took.items() if k != "read_wall"},
            "back_ms": round(max(0.0, request_ms - there - inside), 3)}


class MappedRange:
    """Views over a mapping: what a lease mapped here (`MappedLease`) and addresses kept for one (`Reservation`)
    have alike. `owner_id` is the lease id the views' metadata names."""

    mapping: RangeMapping

    @property
    def owner_id(self) -> str:
        raise NotImplementedError

    @property
    def ptr(self) -> int:
        return self.mapping.ptr

    def meta(self, name: str, dtype: Any, shape: Sequence[int], offset: int = 0,
             stride: Sequence[int] | None = None) -> TensorMeta:
        return TensorMeta(name=name, lease_id=self.owner_id, offset=offset, shape=list(shape),
                          dtype=dtype_name(dtype), stride=list(stride) if stride is not None else None)

    def torch(self, dtype: Any, shape: Sequence[int], offset: int = 0, stride: Sequence[int] | None = None) -> Any:
        """A torch view: CPU tensor on host, CUDA tensor on cuda; zero copy either way."""
        import torch

        meta = self.meta("_", dtype, shape, offset, stride)
        tdtype = getattr(torch, meta.dtype)
        extent = tensor_extent(meta)
        if extent == 0:
            return torch.empty(tuple(meta.shape), dtype=tdtype, device=self.mapping.device)
        flat = self.mapping.torch_bytes(meta.offset, extent).view(tdtype)
        return flat.as_strided(tuple(meta.shape), tuple(meta.stride or contiguous_stride(meta.shape)))


class MappedLease(MappedRange):
    """A lease mapped into this process. `info` is the manager's row as of the last grant."""

    def __init__(self, info: LeaseInfo, mapping: RangeMapping, tensors: Sequence[TensorMeta] = ()) -> None:
        self.info = info
        self.mapping = mapping
        self.tensor_metas = list(tensors)

    @property
    def id(self) -> str:
        return self.info.id

    owner_id = id

    @property
    def epoch(self) -> int:
        return self.info.epoch

    def numpy(self, dtype: Any, shape: Sequence[int], offset: int = 0, stride: Sequence[int] | None = None) -> Any:
        """A numpy view (host backend) of the lease's bytes; writes go straight to the shared memory."""
        import numpy as np

        meta = self.meta("_", dtype, shape, offset, stride)
        extent = tensor_extent(meta)
        if extent == 0:
            return np.empty(shape, dtype=meta.dtype)
        flat = np.frombuffer(self.mapping.buffer(offset, extent), dtype=np.uint8).view(meta.dtype)
        item = p.DTYPE_SIZES[meta.dtype]
        strides = [s * item for s in (meta.stride or contiguous_stride(meta.shape))]
        return np.lib.stride_tricks.as_strided(flat, shape=tuple(shape), strides=tuple(strides))

    def view(self, meta: TensorMeta, framework: str = "numpy") -> Any:
        if framework == "torch":
            return self.torch(meta.dtype, meta.shape, meta.offset, meta.stride)
        if framework == "numpy":
            return self.numpy(meta.dtype, meta.shape, meta.offset, meta.stride)
        raise HoldfastError(f"unknown framework {framework!r} (numpy or torch)")

    def unmap(self) -> None:
        self.mapping.unmap()


class Reservation(MappedRange):
    """Addresses kept for a lease this process expects to be handed by a `takeover` (a warm standby's for its
    predecessor's weights and KV cache), backed by placeholder memory of its own until then (mapping.py). Views
    made now (`torch`) read garbage until the takeover maps the lease here; from then on they are views of the
    lease. A takeover maps a lease into the reservation of the same tag, name, size and GPU; the other
    reservations are freed (their views become invalid)."""

    owner_id = "reserved"  # no lease yet

    def __init__(self, tag: str, name: str, gpu: int, mapping: RangeMapping) -> None:
        self.tag, self.name, self.gpu, self.mapping = tag, name, gpu, mapping

    @property
    def size(self) -> int:
        return self.mapping.size

    def fits(self, g: p.LeaseGrant, ordinal: int) -> bool:
        return (str(g.lease.tag) == self.tag and g.lease.name == self.name and g.lease.size == self.size
                and ordinal == self.gpu)

    def free(self) -> None:
        self.mapping.unmap()


class Attachment:
    """Leases received back (attach or takeover), with the tensor metadata committed for them."""

    def __init__(self, leases: list[MappedLease], fence: Sequence[p.FencePid] = ()) -> None:
        self.leases = leases
        self.fence = list(fence)  # a fenced takeover: processes to see exit (procs.wait_gone) before any write

    def tensors(self, framework: str = "numpy") -> dict[str, Any]:
        return {m.name: lease.view(m, framework) for lease in self.leases for m in lease.tensor_metas}

    @property
    def layout_hash(self) -> str | None:
        hashes = {lease.info.layout_hash for lease in self.leases}
        return hashes.pop() if len(hashes) == 1 else None


class MemoryClient:
    """One engine's link to the gpu_manager. If the connection breaks (the manager was killed or restarted),
    the heartbeat thread and any call reconnect by themselves, with backoff: hello with the same engine id,
    then `resume`, which re-establishes the leases still mapped here without fds, so every tensor view stays
    valid. A lease that moved on meanwhile (reclaimed, frozen for a successor, a newer epoch) is not
    silently kept: it leaves `leases` for `lost_leases` (id -> why) and `on_lease_lost(lease_id, why)` is
    called; its mapping is left in place (unmapping under a running engine would crash it) and the engine
    must stop writing to it."""

    def __init__(self, sock: socket.socket, engine_id: str, hello: p.HelloReply, *, socket_path: str | None = None,
                 engine_class: str = "default", reconnect_timeout_s: float = 30.0,
                 timeout_s: float | None = None) -> None:
        self.sock: socket.socket | None = sock
        self.timeout_s = _timeout_s(timeout_s)  # per socket operation: connect, send, each recv of a reply
        self._reconnect_timed_out = False  # the last reconnection attempt found a manager that did not answer
        self.engine_id = engine_id
        self.engine_class = engine_class
        self.socket_path = socket_path or default_socket_path()
        self.hello = hello
        self.reconnect_timeout_s = reconnect_timeout_s  # how long a call waits for a manager that is down
        self.leases: dict[str, MappedLease] = {}
        self.shared: dict[str, MappedLease] = {}  # another engine's weights, mapped read-only (`share`)
        self.reservations: list[Reservation] = []  # addresses kept for the next takeover's leases (`reserve`)
        self.shadow_reservations: dict[str, Reservation] = {}  # shared leases mapped into reservations, by lease id
        self.lost_leases: dict[str, str] = {}
        self.on_lease_lost: Callable[[str, str], None] | None = None
        self.reconnects = 0
        self._broken_since: float | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self.last_timings_ms: dict[str, Any] = {}  # of the last attach or takeover
        self.last_restore: dict[str, Any] = {}  # of the last restore: source, bytes, fill_s, fill_gib_s, ...
        self.last_gang: p.GangView | None = None  # of the last gang_takeover: the gang the group holds now
        # The control plane's asks (sleep, wake), from heartbeat replies: called on the heartbeat thread, which must
        # not wait on it (the engine hands it to its own thread and `answer`s when done).
        self.on_ask: Callable[[p.Ask], None] | None = None

    @classmethod
    def connect(cls, engine_id: str, *, socket_path: str | None = None, engine_class: str = "default",
                reconnect_timeout_s: float = 30.0, timeout_s: float | None = None) -> MemoryClient:
        """Connect and say hello; `CommandTimeout` if the manager does not answer within `timeout_s`. A manager
        that is not listening (being restarted: its socket absent or refusing) is waited for up to
        `reconnect_timeout_s`, as a broken connection is later, then `Unavailable`: an engine started during a
        manager's restart must not die of it (under chaos such deaths chained cold starts)."""
        path = socket_path or default_socket_path()
        timeout = _timeout_s(timeout_s)
        deadline = time.monotonic() + reconnect_timeout_s
        backoff = Backoff(first_s=0.05, max_s=2.0, jitter=0.5)
        while True:
            try:
                sock, reply = open_session(path, engine_id, engine_class, timeout)
                break
            except TimeoutError:
                raise CommandTimeout(f"gpu_manager at {path} did not answer hello within {timeout} s") from None
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if time.monotonic() >= deadline:
                    raise Unavailable(f"gpu_manager not listening at {path} for {reconnect_timeout_s} s: {e!r}") \
                        from None
                log.info("gpu_manager not listening at %s (%s); waiting", path, type(e).__name__)
                time.sleep(min(backoff.next_delay(), max(0.0, deadline - time.monotonic())))
        try:
            _raise_if_error(reply)
            hello = p.HelloReply.model_validate(_body(reply))
        except BaseException:
            sock.close()
            raise
        return cls(sock, engine_id, hello, socket_path=path, engine_class=engine_class,
                   reconnect_timeout_s=reconnect_timeout_s, timeout_s=timeout)

    @property
    def backend(self) -> str:
        return self.hello.backend

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def _call(self, req: p.Msg) -> tuple[dict[str, Any], list[int]]:
        """One request. A broken connection is reopened first (waiting up to `reconnect_timeout_s` for the
        manager); a request cut off by a break is sent again only if repeating it is harmless. A manager that
        accepts but does not answer within `timeout_s` raises `CommandTimeout` (the connection is dropped:
        a late reply would be read as the answer to the next request)."""
        deadline = time.monotonic() + self.reconnect_timeout_s
        backoff = Backoff(first_s=0.05, max_s=2.0, jitter=0.5)
        while True:
            with self._lock:
                if self.sock is not None and peer_gone(self.sock):  # closed while idle: nothing sent yet
                    self._broken_locked(ConnectionResetError("the gpu_manager closed the connection"))
                if self.sock is None and not self._closed and not self._reconnect_locked() \
                        and self._reconnect_timed_out:
                    raise CommandTimeout(f"gpu_manager at {self.socket_path} accepted but did not answer "
                                         f"within {self.timeout_s} s")
                if self.sock is not None:
                    try:
                        reply, fds = round_trip(self.sock, req)
                        break
                    except TimeoutError as e:
                        self._broken_locked(e)
                        raise CommandTimeout(f"gpu_manager did not answer '{req.op}' within {self.timeout_s} s; "  # type: ignore[attr-defined]
                                             "it may or may not have taken effect") from None
                    except BROKEN as e:
                        self._broken_locked(e)
                        if req.op not in _REPEATABLE:  # type: ignore[attr-defined]
                            raise Unavailable(f"connection to the gpu_manager broke during '{req.op}'; it may or "  # type: ignore[attr-defined]
                                              f"may not have taken effect: {e!r}") from e
            if self._closed:
                raise Unavailable("client closed")
            if time.monotonic() >= deadline:
                raise Unavailable(f"gpu_manager unreachable at {self.socket_path} for {self.reconnect_timeout_s} s")
            time.sleep(backoff.next_delay())
        try:
            _raise_if_error(reply)
        except BaseException:
            close_all(fds)
            raise
        return _body(reply), fds

    def _broken_locked(self, e: BaseException) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self._broken_since is None:  # one warning per outage, not one per heartbeat
            self._broken_since = time.monotonic()
            log.warning("%s: connection to the gpu_manager lost (%r); reconnecting", self.engine_id, e)

    def _reconnect_locked(self) -> bool:
        """One attempt: connect, hello with the same engine id, resume the leases mapped here. Caller holds
        the lock."""
        self._reconnect_timed_out = False
        try:
            sock, reply = open_session(self.socket_path, self.engine_id, self.engine_class, self.timeout_s)
        except BROKEN as e:
            self._reconnect_timed_out = isinstance(e, TimeoutError)
            log.debug("reconnect to %s failed: %r", self.socket_path, e)
            return False
        try:
            _raise_if_error(reply)
            self.hello = p.HelloReply.model_validate(_body(reply))
            held = {lid: lease.epoch for lid, lease in self.leases.items()}
            resumed = p.ResumeReply(held=[])
            if held:
                body, fds = round_trip(sock, p.Resume(epochs=held))
                close_all(fds)
                _raise_if_error(body)
                resumed = p.ResumeReply.model_validate(_body(body))
        except BROKEN as e:
            sock.close()
            self._reconnect_timed_out = isinstance(e, TimeoutError)
            log.debug("reconnect to %s broke during hello/resume: %r", self.socket_path, e)
            return False
        except HoldfastError as e:  # the manager answered but refused: keep trying (it may be mid-upgrade)
            sock.close()
            log.error("%s: gpu_manager refused the reconnection: %r", self.engine_id, e)
            return False
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.reconnects += 1
        for info in resumed.held:
            lease = self.leases.get(info.id)
            if lease is not None:
                lease.info = info
        lost = dict(resumed.lost)
        lost.update({lid: "not held after resume" for lid in held
                     if lid not in lost and lid not in {i.id for i in resumed.held}})
        for lid, why in lost.items():
            self.leases.pop(lid, None)  # its mapping stays: views in use must not fault
            self.lost_leases[lid] = why
            log.error("%s: lease %s is no longer this engine's (%s): stop writing to it", self.engine_id, lid, why)
        down = time.monotonic() - self._broken_since if self._broken_since is not None else 0.0
        self._broken_since = None
        log.info("%s: reconnected to the gpu_manager (pid %d) after %.1f s: %d leases resumed, %d lost",
                 self.engine_id, self.hello.manager_pid, down, len(resumed.held), len(lost))
        if self.on_lease_lost is not None:
            for lid, why in lost.items():
                try:
                    self.on_lease_lost(lid, why)
                except Exception:  # noqa: BLE001 - the engine's callback must not break the link
                    log.exception("on_lease_lost(%s) failed", lid)
        return True

    def reconnect(self) -> bool:
        """Reconnect now if the connection is broken (normally the heartbeat thread or the next call does it).
        Returns whether the client is connected."""
        with self._lock:
            if self.sock is None and not self._closed:
                self._reconnect_locked()
            return self.sock is not None

    def _map(self, reply: p.GrantReply, fds: list[int], *, into_reserved: bool = False,
             per_lease: dict[str, list[Any]] | None = None) -> list[MappedLease]:
        """The grant's leases mapped here. `per_lease`, when given, gets each lease's ("<tag>:<name>") [how ("held":
        a mapping this process had already, a shadow taken over; else "mapped"), its chunks, ms]."""
        grants = reply.leases
        out, i = [], 0
        try:
            for g in grants:
                t0 = time.perf_counter()
                chunk_fds = fds[i:i + g.nfds]
                i += g.nfds
                shadow = self.shared.pop(g.lease.id, None)
                held = shadow if shadow is not None else self.leases.get(g.lease.id)
                if g.held and (held is None or g.read_only):
                    raise errors.MalformedMessage(f"lease {g.lease.id} was granted as mapped here already, and it is not")
                if held is not None and not g.read_only:
                    # A lease this process already maps (a shadow it now takes over, or its own lease granted
                    # again): the same memory, and every view of it (a model built over it) stays valid. Granted
                    # `held`, its tensors are those it was shared with (the same committed layout).
                    held.info = g.lease
                    if not g.held:
                        held.tensor_metas = list(g.tensors)
                    if str(g.lease.tag) != "weights":  # weights a shadow mapped read-only stay so (never written)
                        held.mapping.writable()
                    self.shadow_reservations.pop(held.id, None)  # its range is the lease's now, not a reservation's
                    lease, how = held, "held"
                else:
                    if shadow is not None:
                        shadow.unmap()
                    lease, how = MappedLease(g.lease, self._map_grant(g, chunk_fds, into_reserved), g.tensors), "mapped"
                store = self.shared if g.read_only else self.leases
                old = store.pop(lease.id, None)
                if old is not None and old is not lease:
                    old.unmap()
                store[lease.id] = lease
                out.append(lease)
                if per_lease is not None:
                    per_lease[f"{g.lease.tag}:{g.lease.name or g.lease.id}"] = [how, g.nfds, ms_since(t0)]
        finally:
            close_all(fds)  # the mappings hold the memory now; the fds are not needed
        return out

    def _map_grant(self, g: p.LeaseGrant, fds: list[int], into_reserved: bool) -> RangeMapping:
        """A granted lease's chunks mapped here: into the reservation made for it where `into_reserved` (a
        takeover) and one fits (its placeholder gives way; views over it now read the lease), else at new
        addresses."""
        sizes = p.chunk_sizes(g.lease.size, g.lease.chunk_size)
        res = self._take_reservation(g) if into_reserved else None
        if res is not None:
            # A shadow is read-only (one writer per lease: its owner), but for a KV cache on CUDA: the takeover would
            # have to grant write access to it on the recovery's path (cuMemSetAccess over the cache: 10-20 ms for
            # 16 GiB on an H100, 13-18 ms for 29 GiB on an H200), and there the importing process sets its own
            # access anyway (the manager cannot hold it to read-only): a shadowing standby runs no GPU work
            # (engines/batched/standby.py invariant 1). On the host the mapping stays read-only (a write faults).
            res.mapping.adopt(fds, sizes, read_only=g.read_only and not self._cache_on_cuda(g))
            if g.read_only:  # a shadow: `unshare` gives the range its placeholder back
                self.shadow_reservations[g.lease.id] = res
            return res.mapping
        if self.backend == "cuda" and not g.lease.host:
            return CudaMapping(fds, sizes, g.gpu_uuid, g.lease.gpu, read_only=g.read_only)
        return HostMapping(fds, sizes, read_only=g.read_only)

    def _cache_on_cuda(self, g: p.LeaseGrant) -> bool:
        return self.backend == "cuda" and not g.lease.host and str(g.lease.tag) != "weights"

    def _take_reservation(self, g: p.LeaseGrant) -> Reservation | None:
        """The reservation of the grant's tag, name, size and GPU, no longer kept for anything else; or None."""
        ordinal = local_ordinal(g.gpu_uuid, g.lease.gpu) if self.backend == "cuda" else g.lease.gpu
        res = next((r for r in self.reservations if r.fits(g, ordinal)), None)
        if res is not None:
            self.reservations.remove(res)
        return res

    def reserve(self, nbytes: int, *, tag: str, name: str, gpu: int = 0,
                placeholder_bytes: int = 64 << 20) -> Reservation:
        """Keep addresses for a lease of `nbytes` (rounded up as the manager rounds an allocate) that a later
        `takeover` is expected to hand over with this tag and name, backed meanwhile by `placeholder_bytes` of this
        process's own memory. Nothing is asked of the manager."""
        gran = self._granularity(gpu)
        size = -(-max(nbytes, 1) // gran) * gran
        placeholder = -(-min(placeholder_bytes, size) // gran) * gran
        kind = CudaMapping if self.backend == "cuda" else HostMapping
        res = Reservation(tag, name, gpu, kind.placeholder(size, placeholder, gpu=gpu))
        self.reservations.append(res)
        return res

    def _granularity(self, gpu: int) -> int:
        if self.backend == "cuda":  # the manager's backend rounds to the device's recommended granularity
            from libs.client import cuda_driver as cd

            cd.init()
            return cd.granularity(gpu)
        return self.hello.granularity or 4096

    def free_reservations(self) -> None:
        """Free every reservation no takeover used (their views become invalid)."""
        for res in self.reservations:
            res.free()
        self.reservations.clear()

    def pending(self) -> list[LeaseInfo]:
        body, _ = self._call(p.Pending())
        return p.PendingReply.model_validate(body).leases

    def allocate(self, nbytes: int, *, tag: str = "weights", name: str = "", gpu: int = 0,
                 chunk_size: int | None = None, host: bool = False) -> MappedLease:
        """`host`: host memory (a memfd) on any backend, mapped here as the host backend's leases are."""
        body, fds = self._call(p.Allocate(gpu=gpu, size=nbytes, tag=tag, name=name, chunk_size=chunk_size,  # type: ignore[arg-type]
                                          host=host))
        return self._map(p.GrantReply.model_validate(body), fds)[0]

    def register(self, metas: Sequence[TensorMeta]) -> None:
        epochs = {}
        for m in metas:
            lease = self.leases.get(m.lease_id)
            if lease is None:
                raise HoldfastError(f"tensor {m.name}: lease {m.lease_id} is not mapped by this client")
            epochs[m.lease_id] = lease.epoch
        self._call(p.Register(epochs=epochs, tensors=list(metas)))
        for m in metas:
            lease = self.leases[m.lease_id]
            lease.tensor_metas = [t for t in lease.tensor_metas if t.name != m.name] + [m]

    def commit(self) -> str:
        body, _ = self._call(p.Commit())
        digest = p.CommitReply.model_validate(body).layout_hash
        for lease in self.leases.values():
            lease.info = lease.info.model_copy(update={"layout_hash": digest})
        return digest

    def attach(self) -> Attachment:
        return self._timed(p.Attach())

    def takeover(self, predecessor: str, transfer_token: str, *, fenced: bool = False,
                 cold_weights: bool = False) -> Attachment:
        """The predecessor's leases, mapped here: each into the reservation made for it where one fits
        (`reserve`: views made over it stay valid, now over the lease), the rest at new addresses. Reservations
        no lease used are freed. `last_timings_ms["reserved"]`: how many leases went into reservations.
        `fenced`: granted once the predecessor is stopped rather than gone; the caller then writes nothing
        through these leases before every process of `Attachment.fence` has exited (`procs.wait_gone`).
        `cold_weights`: this engine loads the weights itself, so a set of KV backups alone is handed over too."""
        before = len(self.reservations)
        held = {lease.id: lease.info.layout_hash for lease in self.shared.values() if lease.info.layout_hash}
        att = self._timed(p.TakeoverReq(predecessor=predecessor, transfer_token=transfer_token, fenced=fenced,
                                        cold_weights=cold_weights, held=held), into_reserved=True)
        self.last_timings_ms["reserved"] = before - len(self.reservations)
        t0 = time.perf_counter()
        self.free_reservations()
        self.last_timings_ms["unused_freed_ms"] = ms_since(t0)
        return att

    def share(self, owner: str, share_token: str, *, into_reserved: bool = False) -> Attachment:
        """Map `owner`'s committed weight and KV cache leases read-only (a warm standby's shadow; the token comes
        from the control plane's `share` command). They stay the owner's: no heartbeats, no epoch, kept apart in
        `shared`. A later `takeover` of the same owner reuses these mappings (made writable), so views built now
        stay valid. `into_reserved`: each lease into the reservation made for it where one fits (`reserve`: views
        and CUDA graphs built over the reservation now read the owner's memory; the takeover maps nothing);
        `unshare` gives those reservations their placeholders back (and a new share into them drops the last one
        first: unmapping a shadow in place would free its reservation's addresses)."""
        if into_reserved:
            self.unshare()
        return self._timed(p.ShareReq(owner=owner, share_token=share_token), into_reserved=into_reserved)

    def register_gang(self, gang_id: str, owners: Sequence[str]) -> p.GangView:
        """Rank 0 of a tensor-parallel engine, once every rank committed: rank r's leases (engine `owners[r]`) form
        one gang, frozen, taken over and reclaimed together from now on (the gpu_manager's gangs.py)."""
        body, _ = self._call(p.GangRegister(gang_id=gang_id, owners=list(owners)))
        return p.GangView.model_validate(body)

    def gang_takeover(self, gang_id: str, rank: int, successors: Sequence[str], generation: int, transfer_token: str,
                      *, wait_s: float = 30.0, degraded: bool = False) -> Attachment:
        """This process is rank `rank` of the successor group `successors`: map its rank's leases of the frozen gang.
        Every rank of the group calls it; it returns once all have (the leases move together) or raises
        `PartialGang` / `StaleGang` with nothing moved. `last_gang` is the gang the group holds now. `degraded`: a
        group of M <= N ranks takes a broken gang's KV backups, every one to its rank 0 (the others get none), the
        rest of the gang reclaimed; `last_gang` is None for a single engine (gpu_manager gang.py invariant 10)."""
        req = p.GangTakeover(gang_id=gang_id, rank=rank, successors=list(successors), generation=generation,
                             transfer_token=transfer_token, wait_s=wait_s, degraded=degraded)
        t0 = time.perf_counter()
        body, fds = self._call(req)
        self.last_gang = p.GangView.model_validate(body["gang"]) if body.get("gang") is not None else None
        att = Attachment(self._map(p.GrantReply.model_validate(body), fds))
        self.last_timings_ms = {"request_ms": ms_since(t0)}
        return att

    def unshare(self) -> None:
        """Unmap every shadowed lease. Every view of them must be gone first (they become invalid), except views of
        a shadow mapped into a reservation: that range goes back to its placeholder and stays reserved."""
        for lease in self.shared.values():
            res = self.shadow_reservations.pop(lease.id, None)
            if res is None:
                lease.unmap()
            else:
                res.mapping.to_placeholder()
                self.reservations.append(res)
        self.shared.clear()

    def _timed(self, req: p.Msg, *, into_reserved: bool = False) -> Attachment:
        """attach/takeover, with where the time went in `last_timings_ms` (request: the manager's checks,
        its one commit and the fds; map: mapping every chunk here)."""
        t0, sent_wall = time.perf_counter(), time.time()
        body, fds = self._call(req)
        t1 = time.perf_counter()
        per_lease: dict[str, list[Any]] = {}
        reply = p.GrantReply.model_validate(body)
        att = Attachment(self._map(reply, fds, into_reserved=into_reserved, per_lease=per_lease), reply.fence)
        t2 = time.perf_counter()
        self.last_timings_ms = {"request_ms": round((t1 - t0) * 1000, 3), "map_ms": round((t2 - t1) * 1000, 3),
                                "leases": per_lease}
        if reply.manager_ms:  # of request_ms: the manager's part (manager_split)
            self.last_timings_ms["manager_ms"] = manager_split(reply.manager_ms, sent_wall, (t1 - t0) * 1000)
        adopted = [a for a in (lease.mapping.adopt_ms for lease in att.leases) if a is not None]
        for lease in att.leases:
            lease.mapping.adopt_ms = None
        if adopted:  # of map_ms: the reservations' placeholders unmapped, the chunks mapped in their place
            self.last_timings_ms["placeholders_dropped_ms"] = round(sum(a[0] for a in adopted), 3)
            self.last_timings_ms["chunks_mapped_ms"] = round(sum(a[1] for a in adopted), 3)
        log.info("%s: %d leases, %d chunks: request %.2f ms, map %.2f ms", req.op, len(att.leases), len(fds),  # type: ignore[attr-defined]
                 self.last_timings_ms["request_ms"], self.last_timings_ms["map_ms"])
        return att

    def restore(self, artifact: str, *, gpu: int = 0,
                sources: Sequence[str] = ("peer", "host", "artifact")) -> MappedLease:
        """A new weights lease filled by the gpu_manager from this node's copy of `artifact` (a peer: another
        engine's live lease of the same content, copied GPU to GPU; else the host tier's, else the artifact on disk,
        its hash checked), with the tensors it was written with registered. Commit as after a load.
        `last_restore` says which copy served (`peer`: the lease and GPU), how fast, and why faster ones were
        passed. Raises `NotFound` (no copy) or
        `ArtifactInvalid` (truncated, corrupt, unfinished): then load from the original file."""
        t0 = time.perf_counter()
        body, fds = self._call(p.RestoreReq(artifact=artifact, gpu=gpu, sources=list(sources)))  # type: ignore[arg-type]
        reply = p.GrantReply.model_validate(body)
        lease = self._map(reply, fds)[0]
        self.last_restore = {"source": reply.source, **(reply.restore or {}),
                             "request_s": round(time.perf_counter() - t0, 4)}
        if reply.peer is not None:
            self.last_restore["peer"] = reply.peer.model_dump()
        if reply.passed:
            self.last_restore["passed"] = list(reply.passed)
        return lease

    def heartbeat(self) -> None:
        body, _ = self._call(p.Heartbeat())
        self._asked(body)

    def _asked(self, body: dict[str, Any]) -> None:
        ask = p.HeartbeatReply.model_validate(body).ask if body.get("ask") else None
        if ask is None:
            return
        if self.on_ask is None:
            self.answer(ask.id, HoldfastError(f"{self.engine_id} does not take '{ask.op}' asks"))
            return
        try:
            self.on_ask(ask)
        except Exception as e:  # noqa: BLE001 - the engine's callback must not break the link
            log.exception("on_ask(%s) failed", ask.op)
            self.answer(ask.id, e)

    def sleep(self, lease_ids: Sequence[str], *, ask: str | None = None) -> p.SleepReply:
        """Give these leases' physical memory back, keeping their addresses (issue 21). The caller must have
        quiesced: nothing may touch their views until `wake` (host: an access faults). The manager releases its
        side first (and copies weights where a wake can restore them), then the pages are unmapped here."""
        leases = [self._own(lid) for lid in lease_ids]
        body, _ = self._call(p.SleepReq(epochs={lease.id: lease.epoch for lease in leases}, ask=ask))
        for lease in leases:
            lease.mapping.release_pages()
            lease.info = lease.info.model_copy(update={"state": LeaseState.SLEEPING})
        return p.SleepReply.model_validate(body)

    def wake(self, lease_ids: Sequence[str], *, ask: str | None = None) -> str | None:
        """New physical memory for sleeping leases, mapped at the addresses they had: every view of them is valid
        again (a KV cache's content is gone; weights come back filled). Returns which copy filled the weights."""
        leases = [self._own(lid) for lid in lease_ids]
        body, fds = self._call(p.WakeReq(epochs={lease.id: lease.epoch for lease in leases}, ask=ask))
        reply, i = p.GrantReply.model_validate(body), 0
        try:
            for g in reply.leases:
                lease = self.leases[g.lease.id]
                lease.mapping.map_pages(fds[i:i + g.nfds], p.chunk_sizes(g.lease.size, g.lease.chunk_size))
                lease.info = g.lease
                i += g.nfds
        finally:
            close_all(fds)  # the mappings hold the memory now
        return reply.source

    def answer(self, ask_id: str, error: BaseException | None = None) -> None:
        """Tell the manager an ask is done (error None) or why it was not."""
        err = None  # a long reason is cut to the protocol's bound: the answer is still taken
        if error is not None:
            err = {"code": str(getattr(error, "code", "error"))[:64], "message": str(error)[:p.MAX_ERROR_MESSAGE]}
        self._call(p.AnswerReq(ask=ask_id, error=err))

    def _own(self, lease_id: str) -> MappedLease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise HoldfastError(f"lease {lease_id} is not mapped by this client")
        return lease

    def release(self, lease_id: str) -> None:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise HoldfastError(f"lease {lease_id} is not mapped by this client")
        self._call(p.Release(lease_id=lease_id, epoch=lease.epoch))
        self.leases.pop(lease_id).unmap()
        lease.info = lease.info.model_copy(update={"state": LeaseState.RECLAIMED})

    def start_heartbeats(self, interval_s: float = 0.5) -> None:
        """Beat every `interval_s` from a thread; while the connection is broken, retry with backoff instead."""
        if self._hb_thread is not None:
            return

        def beat() -> None:
            backoff = Backoff(first_s=min(0.05, interval_s), max_s=max(2.0, interval_s), jitter=0.5)
            wait = interval_s
            while not self._hb_stop.wait(wait):
                with self._lock:
                    if self._closed:
                        return
                    if self.sock is None and not self._reconnect_locked():
                        wait = backoff.next_delay()
                        continue
                    try:
                        body, fds = round_trip(self.sock, p.Heartbeat())  # type: ignore[arg-type]
                        close_all(fds)
                        ask = p.HeartbeatReply.model_validate(_body(body)).ask if body.get("ask") else None
                    except BROKEN as e:
                        self._broken_locked(e)
                        wait = backoff.next_delay()
                        continue
                    except Exception as e:  # noqa: BLE001 - keep beating; a bad reply is not a lost link
                        log.warning("heartbeat failed: %r", e)
                        body, ask = {"ok": True}, None
                backoff.reset()
                wait = interval_s
                if not body.get("ok"):
                    log.warning("heartbeat refused: %s", body.get("error"))
                elif ask is not None:  # out of the lock: the engine's handler calls this client
                    self._asked({"ask": ask.model_dump()})

        self._hb_thread = threading.Thread(target=beat, name="hf-heartbeat", daemon=True)
        self._hb_thread.start()

    def close(self, *, unmap: bool = True) -> None:
        """Stop heartbeats, unmap every lease (synchronizing the GPU first on cuda), close the socket.

        The leases stay ACTIVE and owned by this engine id while this process lives; they are orphaned when
        it exits (or released explicitly before)."""
        self._closed = True
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
            self._hb_thread = None
        if unmap:
            for lease in self.leases.values():
                lease.unmap()
            self.leases.clear()
            self.unshare()
            self.free_reservations()
        with self._lock:
            if self.sock is not None:
                self.sock.close()
                self.sock = None

    def __enter__(self) -> MemoryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Requests that may be sent again after the connection broke under them: sending them twice does what sending
# them once does. allocate/attach/takeover/release are not: the caller learns (Unavailable) and decides.
# Sent again after a break: asking twice does what asking once does. `share` only reads a grant, which outlives
# a manager restart; without it a standby offered a shadow during a restart stayed unshadowed (CPU chaos, seed 11).
_REPEATABLE = frozenset({"heartbeat", "pending", "register", "commit", "share", "answer"})



def _body(reply: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in reply.items() if k != "ok"}


def _raise_if_error(reply: dict[str, Any]) -> None:
    if reply.get("ok"):
        return
    err = reply.get("error") or {}
    code, message = str(err.get("code", "error")), str(err.get("message", ""))
    cls = _ERRORS.get(code)
    if cls is None or cls is HoldfastError:
        raise RemoteError(code, message)
    raise cls(message)
