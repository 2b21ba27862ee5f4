"""An error no handler types (a bug under a route) is still the API's JSON error, never Starlette's plain-text 500:
the batched engine's front (server.py) in process, its link to the engine replaced by one that fails in a way the
route does not expect (the error shape is what is tested, not the engine)."""

from __future__ import annotations

import httpx

from engines.batched.http_state import EngineState
from engines.batched.server import build_app


class BrokenLink:
    async def call(self, *_: object, **__: object) -> object:
        raise ValueError("a bug: nothing handles this")


async def test_an_untyped_failure_under_a_route_is_a_typed_json_500() -> None:
    state = EngineState("e-1", "m", "tiny", 2048, 16)
    state.link = BrokenLink()  # type: ignore[assignment]
    transport = httpx.ASGITransport(app=build_app(state), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
        r = await client.get("/health")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == "internal" and "ValueError" in err["message"] and "a bug" not in err["message"]
