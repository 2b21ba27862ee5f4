"""The `holdfast` CLI against hostile ids and answers: an id is one path segment of the admin API's URL, whatever it
holds, and an answer that is not the API's JSON is said in one line, not a traceback.

- `holdfast engine sleep '../../v1/nodes/n1/drain?'` sent POST /v1/nodes/n1/drain with the operator's token (httpx
  resolves dot segments; the `?` cut off the rest): an id copied from a listing could drain a node.
- An error body that was JSON but not an object (a proxy's `"busy"`, `[...]`) raised AttributeError: a traceback.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from typer.testing import CliRunner

from holdfast.main import app


@contextlib.contextmanager
def recording_api(status: int = 200, body: bytes = b"{}") -> Iterator[tuple[str, list[str]]]:
    """A loopback HTTP server that answers every POST with `status` and `body`, recording the raw paths asked."""
    paths: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            paths.append(self.path)
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", paths
    finally:
        server.shutdown()
        server.server_close()


def _run(*argv: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, list(argv))
    return r.exit_code, r.output


def test_an_id_with_slashes_dots_or_a_query_stays_one_path_segment() -> None:
    hostile = "../../v1/nodes/n1/drain?"
    with recording_api() as (url, paths):
        for argv in (["engine", "sleep", hostile], ["engine", "wake", hostile], ["snapshot", hostile],
                     ["engine", "sleep", "a#b%2F"], ["engine", "regroup", hostile]):
            code, out = _run(*argv, "--api-url", url, "--token", "t")
            assert code == 0, out
    assert paths == ["/v1/engines/..%2F..%2Fv1%2Fnodes%2Fn1%2Fdrain%3F/sleep",
                     "/v1/engines/..%2F..%2Fv1%2Fnodes%2Fn1%2Fdrain%3F/wake",
                     "/v1/leases/..%2F..%2Fv1%2Fnodes%2Fn1%2Fdrain%3F/snapshot",
                     "/v1/engines/a%23b%252F/sleep",
                     "/v1/engines/..%2F..%2Fv1%2Fnodes%2Fn1%2Fdrain%3F/regroup"]


def test_a_dot_segment_id_is_refused_before_any_request() -> None:
    with recording_api() as (url, paths):
        for bad in ("..", "."):
            code, out = _run("engine", "sleep", bad, "--api-url", url, "--token", "t")
            assert code != 0 and "not an id" in out, out
    assert paths == []


def test_an_error_body_that_is_not_an_object_is_said_in_one_line() -> None:
    for body in (b'"busy"', b"[1, 2]", b"<html>bad gateway</html>"):
        with recording_api(502, body) as (url, _):
            code, out = _run("engine", "wake", "e1", "--api-url", url, "--token", "t")
        assert code == 1 and "answered 502" in out and "Traceback" not in out, out
        assert len(out.strip().splitlines()) == 1, out
    with recording_api(409, json.dumps({"error": "conflict", "message": "asleep already"}).encode()) as (url, _):
        code, out = _run("engine", "sleep", "e1", "--api-url", url, "--token", "t")
    assert code == 1 and "answered 409: asleep already" in out, out


def test_a_status_table_shows_markup_in_ids_as_text() -> None:
    """An id or lease name of `[/bold]` (a client's choice) raised rich's MarkupError in `holdfast status`."""
    from rich.console import Console

    from services.controller.status_cli import _table

    console = Console(record=True, width=80)
    console.print(_table("leases", ["owner", "name"], [["[/bold]", "[red]x"]]))
    text = console.export_text()
    assert "[/bold]" in text and "[red]x" in text
