"""The agent's unix socket (0600): engines register, heartbeat, report readiness and fatal errors.

The first frame must be `register`; its claimed pid is checked against the kernel's (SO_PEERCRED) so that
no process can speak for another. Errors go back as an `error` frame and the connection is closed.
"""

from __future__ import annotations

import logging

from libs.common import wire
from libs.common.errors import HoldfastError, MalformedMessage
from services.agent.supervisor import Agent

log = logging.getLogger("holdfast.agent.link")


def make_handler(agent: Agent):  # noqa: ANN201 - returns the FrameServer's handler
    async def handle(stream: wire.FrameStream) -> None:
        try:
            msg, fds = await stream.recv()
        except (ConnectionError, HoldfastError):
            return
        wire.close_fds(fds)  # engines send no fds to the agent
        try:
            if msg.get("op") != "register":
                raise MalformedMessage(f"the first frame must be register, not {msg.get('op')!r}")
            rec = agent.on_register(msg, stream)
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
                reply = agent.on_message(rec, msg)
                if reply is not None:
                    await stream.send(reply)
        except (ConnectionError, OSError, HoldfastError):
            pass  # the engine went away or spoke garbage: its pidfd says whether it died
        finally:
            agent.on_link_closed(rec, stream)

    return handle
