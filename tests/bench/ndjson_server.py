"""A real HTTP/1.1 server on loopback, in a thread, streaming NDJSON token lines the way the router does (chunked,
one line per write) on a schedule, and recording when it wrote each line: what the load client's stamps are
checked against. Threads, not the test's event loop, so a client loop that blocks cannot delay the server."""

from __future__ import annotations

import json
import socket
import threading
import time


class NdjsonServer:
    def __init__(self, delays_s: list[float], status: int = 200, refuse_longer_than: int | None = None) -> None:
        """`refuse_longer_than`: a prompt longer than this gets 400, as an engine answers a context too long."""
        self.delays_s, self.status, self.refuse_longer_than = delays_s, status, refuse_longer_than
        self.sent: list[list[float]] = []  # per connection, the wall time each token line was written
        self.requests: list[tuple[str, dict]] = []  # per connection, the request's path and JSON body
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(65536)
        length = int([h for h in head.decode().split("\r\n") if h.lower().startswith("content-length")][0].split(":")[1])
        body = head.split(b"\r\n\r\n", 1)[1]
        while len(body) < length:
            body += conn.recv(65536)
        request = json.loads(body)
        self.requests.append((head.split(b" ", 2)[1].decode(), request))
        prompt = request["prompt"]
        if self.refuse_longer_than is not None and len(prompt) > self.refuse_longer_than:
            msg = b'{"error": {"code": "context_too_long"}}'
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(msg), msg))
            conn.close()
            return
        if self.status != 200:
            msg = b'{"detail": "no such model"}'
            conn.sendall(b"HTTP/1.1 %d Not Found\r\ncontent-length: %d\r\n\r\n%s" % (self.status, len(msg), msg))
            conn.close()
            return
        sent: list[float] = []
        self.sent.append(sent)
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n")
            for i, delay in enumerate(self.delays_s):
                time.sleep(delay)
                line = json.dumps({"token": len(prompt) + i, "text": f"t{i}"}).encode() + b"\n"
                sent.append(time.time())
                conn.sendall(b"%x\r\n%s\r\n" % (len(line), line))
            line = b'{"done": true}\n'
            conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(line), line))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went (a worker stopped mid-round): nothing more to write
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()
