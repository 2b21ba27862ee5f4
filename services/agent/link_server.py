"""The agent's unix socket (0600 by default): engines register, heartbeat, report readiness and fatal errors.

Rules (README invariant 5):
1. Only a process whose uid (SO_PEERCRED, the kernel's word) is allowed (`allowed_uids`; default the agent's
   own) is served, whatever the socket's mode: another user gets `permission_denied` and the connection is
   closed before anything it says is read (it cannot register an engine, and so cannot name an endpoint
   the router would send users' requests to).
2. The first frame must be `register`; its claimed pid is checked against the kernel's, so that no process can
   speak for another. Errors go back as an `error` frame and the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from libs.common import wire
from libs.common.errors import HoldfastError, MalformedMessage, PermissionDenied
from services.agent.links import Links

log = logging.getLogger("holdfast.agent.link")

REFUSAL_LINGER_S = 1.0  # a refused peer's first frame is awaited this long, so that it reads the refusal


def uid_refusal(uid: int, allowed: frozenset[int]) -> str | None:
    """Why a peer of `uid` may not use the socket (rule 1), or None (pure)."""
    if uid in allowed:
        return None
    return f"uid {uid} may not register engines with this agent (allowed: {sorted(allowed)})"


async def _refuse(stream: wire.FrameStream, err: HoldfastError) -> None:
    """Send the typed refusal, then wait briefly for the peer's first frame (discarded, never acted on), so a
    client that writes `register` before it reads gets the refusal rather than a broken pipe; the caller closes."""
    with contextlib.suppress(ConnectionError, OSError, HoldfastError):
        await stream.send({"op": "error", "code": err.code, "message": err.message})
    with contextlib.suppress(ConnectionError, OSError, TimeoutError, HoldfastError):
        async with asyncio.timeout(REFUSAL_LINGER_S):
            _, fds = await stream.recv()
            wire.close_fds(fds)


def make_handler(links: Links, allowed_uids: frozenset[int]):  # noqa: ANN201 - returns the FrameServer's handler
    async def handle(stream: wire.FrameStream) -> None:
        creds = stream.peer_credentials()
        why = uid_refusal(creds.uid, allowed_uids)
        if why is not None:
            log.warning("refused a connection from pid %d: %s", creds.pid, why)
            await _refuse(stream, PermissionDenied(why))
            return
        try:
            msg, fds = await stream.recv()
        except (ConnectionError, HoldfastError):
            return
        try:
            if msg.get("op") != "register":
                wire.close_fds(fds)
                raise MalformedMessage(f"the first frame must be register, not {msg.get('op')!r}")
            rec = links.on_register(msg, stream, fds)  # takes the fds: its death mark's, if it sent one
        except (HoldfastError, ValueError, KeyError) as e:
            code = e.code if isinstance(e, HoldfastError) else "malformed"
            log.warning("refused a registration: %s", e)
            await stream.send({"op": "error", "code": code, "message": str(e)})
            return
        await stream.send({"op": "registered", "engine_id": rec.engine_id, "role": rec.role.value})
        try:
            while True:
                msg, fds = await stream.recv()
                wire.close_fds(fds)
                reply = links.on_message(rec, msg)
                if reply is not None:
                    await stream.send(reply)
        except (ConnectionError, OSError, HoldfastError):
            pass  # the engine went away or spoke garbage: its pidfd says whether it died
        finally:
            links.on_link_closed(rec, stream)

    return handle
