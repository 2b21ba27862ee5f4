"""An HTTP/1.1 response carrying NDJSON generation lines, parsed as its bytes come: pure logic, no I/O.

The load bench's light reader (bench/load_client.py) feeds it what each `recvmsg` returned with that read's
timestamps; it turns the bytes into tokens, each stamped with the read that completed its line. Invariants:
- a token's `arrival` is the stamp of the read whose bytes held the newline ending its line (never earlier than
  its last byte's read, never later);
- the response is `finished` once its last chunk (chunked), its `Content-Length` bytes, or the peer's close have
  come; `done` only if the engine's closing line came with no error (what the control compares);
- a status other than 200 is an `error` carrying the status and up to 200 characters of the body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


class ResponseError(ValueError):
    """The bytes are not an HTTP/1.1 response this reader understands (a broken invariant of the router)."""


def request_bytes(host: str, port: int, path: str, body: dict, api_key: str = "") -> bytes:
    """One POST with a JSON body (and the router's API key, if any); `Connection: close` so the end of the
    response is the end of the stream."""
    payload = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nAccept: application/x-ndjson\r\nConnection: close\r\n\r\n")
    return head.encode() + payload


@dataclass
class NdjsonResponse:
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # the read's kernel receive time, one per token
    parsed: list[float] = field(default_factory=list)  # when this process parsed it, one per token
    text: str = ""
    status: int | None = None
    error: str | None = None
    done: bool = False
    finished: bool = False
    final: dict = field(default_factory=dict)  # the closing line (the engine's first-token phases, its usage)
    ended_at: float = 0.0  # the receive time of the read that finished it (its closing line, its close, an error body)
    _buf: bytes = b""  # bytes not yet framed (head, chunk size line, or chunk data)
    _lines: bytes = b""  # body bytes not yet ending in a newline
    _chunked: bool = False
    _left: int | None = None  # body bytes left: of this chunk (chunked) or of the body (Content-Length)
    _body: bytes = b""  # a non-200 response's body, for its error

    def feed(self, data: bytes, arrival: float, parsed: float) -> None:
        """Take one read's bytes (b"" is the peer's close)."""
        if self.finished:
            return
        if not data:
            self._close()
        else:
            self._buf += data
            if self.status is not None or self._head():
                self._frame(arrival, parsed)
        if self.finished:
            self.ended_at = arrival

    def _head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = self._buf[:end].decode("latin-1").split("\r\n")
        self._buf = self._buf[end + 4:]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ResponseError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self.status = int(parts[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if not self._chunked and "content-length" in headers:
            self._left = int(headers["content-length"])
        return True

    def _frame(self, arrival: float, parsed: float) -> None:
        while self._buf and not self.finished:
            if not self._chunked:
                take = self._buf if self._left is None else self._buf[:self._left]
                self._buf = self._buf[len(take):]
                self._body_bytes(take, arrival, parsed)
                if self._left is not None:
                    self._left -= len(take)
                    if self._left == 0:
                        self._close()
                return
            if self._left is None:  # a chunk's size line
                end = self._buf.find(b"\r\n")
                if end < 0:
                    return
                size_text = self._buf[:end].split(b";", 1)[0].strip()
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise ResponseError(f"bad chunk size {size_text[:20]!r}") from None
                self._buf = self._buf[end + 2:]
                if size == 0:
                    self._close()
                    return
                self._left = size
            if self._left > 0:  # the chunk's data, as much as came
                take, self._buf = self._buf[:self._left], self._buf[self._left:]
                self._left -= len(take)
                self._body_bytes(take, arrival, parsed)
                if self._left > 0:
                    return
            if len(self._buf) < 2:  # the CRLF after the chunk's data
                return
            self._buf, self._left = self._buf[2:], None

    def _body_bytes(self, data: bytes, arrival: float, parsed: float) -> None:
        if self.status != 200:
            self._body += data
            return
        self._lines += data
        *complete, self._lines = self._lines.split(b"\n")
        for line in complete:
            if line.strip():
                self._line(json.loads(line), arrival, parsed)

    def _line(self, obj: dict, arrival: float, parsed: float) -> None:
        if obj.get("done"):
            self.final = obj
            self.text += obj.get("text", "")  # an unfinished last character's text
            self.done = not obj.get("error")
            if obj.get("error"):
                self.error = json.dumps(obj["error"])
            self.finished = True
            return
        self.tokens.append(int(obj["token"]))
        self.text += obj.get("text", "")
        self.arrivals.append(arrival)
        self.parsed.append(parsed)

    def _close(self) -> None:
        self.finished = True
        if self.status is not None and self.status != 200:
            self.error = f"HTTP {self.status}: {self._body.decode(errors='replace')[:200]}"
        elif not self.done and self.error is None:
            self.error = "the stream ended without its closing line"
