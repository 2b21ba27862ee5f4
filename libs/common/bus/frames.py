"""The hot path's frames: a message's NATS header block encoded once, and the frame queued on nats-py's connection.

nats-py's `publish` validates the subject and reply and encodes every header of every message (a regex match, a
strip, a translate and an encode per header, ~4-5 us a message with two headers on the 2-core machine: about as
much as all the rest of a publish; docs/controlplane.md). The events and commands the control plane sends by the
tens of thousands have subjects the bus builds (validated once per subject, `Subjects`) and headers it builds
(`header_block`: the same bytes nats-py would write, values cleaned the same way), so `send` queues the frame as
nats-py's `publish` does after its checks, with the same checks on the connection's state (closed, draining, the
reconnect buffer, the server's payload limit) and the same flush. tests/common/test_bus_frames.py checks that a
frame sent here reaches a subscriber exactly as one sent by nats-py's `publish`.

A nats-py without the attributes `send` relies on (`supported`) gets its own `publish`: slower, never wrong.
"""

from __future__ import annotations

from nats.aio.client import _HEADER_KEY_RE, _validate_subject
from nats.aio.client import Client as NATS
from nats.errors import (
    BadHeaderError,
    ConnectionClosedError,
    ConnectionDrainingError,
    MaxPayloadError,
    OutboundBufferLimitError,
)

_HEAD = b"NATS/1.0\r\n"
_CLEAN = str.maketrans({"\r": " ", "\n": " "})  # as nats-py: a value never ends its header line early
_names: set[str] = set()  # header names seen, each checked once as nats-py does (the bus's few, the propagator's)
_NEEDED = ("_send_command", "_flush_queue", "_flush_pending", "_pending_data_size", "_max_pending_size",
           "_max_payload", "is_draining_pubs", "stats")


def header_block(headers: dict[str, str]) -> bytes:
    """The header block nats-py's `publish` writes for `headers`, or b"" for none (a bad name: BadHeaderError)."""
    if not headers:
        return b""
    parts = [_HEAD]
    for name, value in headers.items():
        if name not in _names:
            if name != name.strip() or not _HEADER_KEY_RE.fullmatch(name):
                raise BadHeaderError(name)
            if len(_names) < 1_000:
                _names.add(name)
        parts.append(f"{name}: {value.strip().translate(_CLEAN)}\r\n".encode())
    parts.append(b"\r\n")
    return b"".join(parts)


def supported(nc: NATS) -> bool:
    return all(hasattr(nc, name) for name in _NEEDED)


class Subjects:
    """Subjects validated once each (nats-py's own check), for the subjects the bus builds again and again."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def check(self, subject: str) -> str:
        if subject not in self._seen:
            _validate_subject(subject)  # raises BadSubjectError: nothing sent
            if len(self._seen) < 100_000:  # bounded: a subject per (event type, node), per command and node
                self._seen.add(subject)
        return subject


async def send(nc: NATS, subject: str, body: bytes, reply: str, head: bytes, *, fast: bool) -> None:
    """Queue one message (`subject` and `reply` checked by the caller, `head` from `header_block`), as nats-py's
    `publish` does; `fast` False (a nats-py without what this relies on): through `publish` itself."""
    if not fast:
        headers = _parse(head) if head else None
        await nc.publish(subject, body, reply=reply, headers=headers)
        return
    if nc.is_closed:
        raise ConnectionClosedError
    if nc.is_draining_pubs:
        raise ConnectionDrainingError
    size = len(body)
    if not nc.is_connected and (nc._max_pending_size <= 0 or size + nc._pending_data_size > nc._max_pending_size):
        raise OutboundBufferLimitError
    if size > nc._max_payload:
        raise MaxPayloadError
    if head:
        frame = b"HPUB %s %s %d %d\r\n%b%b\r\n" % (subject.encode(), reply.encode(), len(head), len(head) + size,
                                                    head, body)
    else:
        frame = b"PUB %s %s %d\r\n%b\r\n" % (subject.encode(), reply.encode(), size, body)
    nc.stats["out_msgs"] += 1
    nc.stats["out_bytes"] += size
    await nc._send_command(frame)
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()


def _parse(head: bytes) -> dict[str, str]:
    lines = head.decode().split("\r\n")[1:]
    return dict(line.split(": ", 1) for line in lines if line)
