"""The agent's unix socket (0600 by default): engines register, heartbeat, report readiness and fatal errors.

Rules (README invariant 5). What one same-uid process does on this socket (any engine, buggy or hostile, is one)
never stops another engine from registering and being served:
1. Only a process whose uid (SO_PEERCRED, the kernel's word) is allowed (`allowed_uids`; default the agent's
   own) is served, whatever the socket's mode: another user gets `permission_denied` and the connection is
   closed before anything it says is read (it cannot register an engine, and so cannot name an endpoint
   the router would send users' requests to).
2. The first frame must be `register`; its claimed pid is checked against the kernel's, so that no process can
   speak for another. Errors go back as an `error` frame and the connection is closed.
3. Every frame is validated into a typed message (protocol.py) before it touches a record. A registered engine's
   bad message is answered `malformed` and changes nothing; its connection is kept (the framing is intact).
   A frame that breaks the framing (over its limit, truncated, fds where none belong) is answered, then closed:
   the fds that came with it are closed by the transport (libs/common/wire.py invariant 1).
4. Bounds, so that stalled or flooding connections hold little of the agent's fds and memory (two stalled
   connections with the transport's defaults once held all 20000 of its fds, and no replacement engine could
   register): frames of at most `protocol.MAX_REGISTER_BYTES` and one fd (the death mark) until registered,
   `protocol.MAX_FRAME_BYTES` and no fd after; `register` whole within `register_timeout_s` of the connect, and any
   later frame, once begun, within `frame_timeout_s` (both answered `timeout`, then closed); at most `max_links`
   open connections and `max_links_per_pid` of one process, counted from accept to close: one more is answered
   `too_many_connections` and closed. A reply not taken within `frame_timeout_s` closes the connection too.
   (Many processes together can fill `max_links`: the uid's processes are its engines, trusted that far.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from typing import Any

from libs.common import wire
from libs.common.errors import CommandTimeout, HoldfastError, MalformedMessage, PermissionDenied
from services.agent import protocol
from services.agent.engines import EngineRecord
from services.agent.links import Links
from services.agent.protocol import TooManyLinks
from services.agent.settings import AgentSettings

log = logging.getLogger("holdfast.agent.link")

REFUSAL_LINGER_S = 1.0  # a refused peer's first frame is awaited this long, so that it reads the refusal


def uid_refusal(uid: int, allowed: frozenset[int]) -> str | None:
    """Why a peer of `uid` may not use the socket (rule 1), or None (pure)."""
    if uid in allowed:
        return None
    return f"uid {uid} may not register engines with this agent (allowed: {sorted(allowed)})"


class LinkSlots:
    """Open connections to the socket, overall and per process (rule 4)."""

    def __init__(self, limit: int, per_pid: int) -> None:
        self.limit = limit
        self.per_pid = per_pid
        self.by_pid: Counter[int] = Counter()
        self.refused = 0

    def admit(self, pid: int) -> None:
        """Count a new connection of process `pid`, or raise `TooManyLinks` (and count nothing). Pid 0 (a peer in
        another pid namespace) has no cap of its own: the overall one holds."""
        total = self.by_pid.total()
        if total >= self.limit:
            raise TooManyLinks(f"the agent's socket holds {total} connections, the limit")
        if pid > 0 and self.by_pid[pid] >= self.per_pid:
            raise TooManyLinks(f"pid {pid} holds {self.by_pid[pid]} connections, the limit of one process")
        self.by_pid[pid] += 1

    def release(self, pid: int) -> None:
        self.by_pid[pid] -= 1
        if self.by_pid[pid] <= 0:
            del self.by_pid[pid]


def error(e: HoldfastError) -> dict[str, Any]:
    return {"op": "error", "code": e.code, "message": e.message}


async def _reply(stream: wire.FrameStream, msg: dict[str, Any], within_s: float) -> bool:
    """Send `msg`; False when the peer is gone or did not take it within `within_s` (the caller closes)."""
    try:
        async with asyncio.timeout(within_s):
            await stream.send(msg)
        return True
    except (TimeoutError, ConnectionError, OSError, HoldfastError):
        return False


async def _refuse(stream: wire.FrameStream, err: HoldfastError) -> None:
    """Send the typed refusal, then wait briefly for the peer's first frame (discarded, never acted on), so a
    client that writes `register` before it reads gets the refusal rather than a broken pipe; the caller closes."""
    if not await _reply(stream, error(err), REFUSAL_LINGER_S):
        return
    with contextlib.suppress(ConnectionError, OSError, TimeoutError, HoldfastError):
        async with asyncio.timeout(REFUSAL_LINGER_S):
            _, fds = await stream.recv()
            wire.close_fds(fds)


def make_handler(links: Links, settings: AgentSettings):  # noqa: ANN201 - returns the FrameServer's handler
    allowed = settings.peer_uids()
    slots = LinkSlots(settings.max_links, settings.max_links_per_pid)

    async def handle(stream: wire.FrameStream) -> None:
        creds = stream.peer_credentials()
        try:
            slots.admit(creds.pid)
        except TooManyLinks as e:
            slots.refused += 1
            if slots.refused & (slots.refused - 1) == 0:  # the 1st, 2nd, 4th...: a flood logs little
                log.warning("refused a connection of pid %d: %s (%d refused so far)", creds.pid, e, slots.refused)
            await _reply(stream, error(e), REFUSAL_LINGER_S)
            return
        try:
            why = uid_refusal(creds.uid, allowed)
            if why is not None:
                log.warning("refused a connection from pid %d: %s", creds.pid, why)
                await _refuse(stream, PermissionDenied(why))
                return
            rec = await _register(links, stream, settings)
            if rec is not None:
                await _serve(links, rec, stream, settings.frame_timeout_s)
        finally:
            slots.release(creds.pid)

    return handle


async def _register(links: Links, stream: wire.FrameStream, settings: AgentSettings) -> EngineRecord | None:
    """The connection's registration (rules 2 to 4), answered; None when refused (the caller closes)."""
    limit = settings.register_timeout_s
    try:
        async with asyncio.timeout(limit):
            obj, fds = await stream.recv()
    except TimeoutError:
        await _reply(stream, error(CommandTimeout(f"no register within {limit} s of the connect")), limit)
        return None
    except (ConnectionError, OSError):
        return None
    except HoldfastError as e:  # the framing is lost (too large, too many fds): its fds are closed already
        log.warning("refused a registration: %s", e)
        await _reply(stream, error(e), limit)
        return None
    try:
        reg = protocol.parse_register(obj)
    except MalformedMessage as e:
        wire.close_fds(fds)
        log.warning("refused a registration: %s", e)
        await _reply(stream, error(e), limit)
        return None
    try:
        rec = links.on_register(reg, stream, fds)  # takes the fds (closed there, its death mark's armed)
    except HoldfastError as e:
        log.warning("refused a registration: %s", e)
        await _reply(stream, error(e), limit)
        return None
    except ProcessLookupError:
        log.info("engine %s (pid %d) exited as it registered", reg.engine_id, reg.pid)
        return None
    if not await _reply(stream, {"op": "registered", "engine_id": rec.engine_id, "role": rec.role.value},
                        settings.frame_timeout_s):
        links.on_link_closed(rec, stream)
        return None
    return rec


async def _serve(links: Links, rec: EngineRecord, stream: wire.FrameStream, frame_timeout_s: float) -> None:
    """A registered engine's frames, each validated and answered (rule 3), until its link ends."""
    stream.max_size, stream.max_fds = protocol.MAX_FRAME_BYTES, protocol.MAX_FRAME_FDS
    try:
        while not stream.closed:  # closed by the agent's stop (links.py hangs a link up, not closes it)
            await stream.wait_readable()  # an engine may be silent for long (no heartbeats): no deadline here
            try:
                async with asyncio.timeout(frame_timeout_s):
                    obj, fds = await stream.recv()
            except TimeoutError:
                await _reply(stream, error(CommandTimeout(f"a frame begun was not whole within {frame_timeout_s} s")),
                             frame_timeout_s)
                return
            except MalformedMessage as e:  # the framing is lost: answered, then closed (wire.py invariant 4)
                log.warning("engine %s: %s; its link is closed", rec.engine_id, e)
                await _reply(stream, error(e), frame_timeout_s)
                return
            wire.close_fds(fds)  # none come (MAX_FRAME_FDS): kept for the day the limit is raised
            try:
                reply = links.on_message(rec, protocol.parse_message(obj))
            except MalformedMessage as e:
                log.warning("engine %s: %s", rec.engine_id, e)
                reply = error(e)
            if reply is not None and not await _reply(stream, reply, frame_timeout_s):
                return
    except (ConnectionError, OSError, HoldfastError):
        pass  # the engine went away: its pidfd says whether it died
    finally:
        links.on_link_closed(rec, stream)
