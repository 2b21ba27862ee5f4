"""An OpenAI stream through an engine's SIGKILL: the official `openai` client's stream completes with the text of
an uninterrupted greedy run (the relay replays on the successor underneath), and every engine attempt of the
request is sent the same `request_id`. Real router, real engine processes (the
pattern engine), real NATS and etcd."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from libs.common import procs
from libs.common.bus import Bus
from libs.common.store import Store
from tests.engine.support import generate
from tests.router.test_openai_api import LONG, client
from tests.router.test_router import MODEL, announce, retire

PROMPT = "The memory outlives the engine."


async def openai_text(c: Any, kind: str, max_tokens: int, first_chunks: asyncio.Event) -> tuple[str, Any]:
    """The streamed text and the usage, setting `first_chunks` once 20 chunks are in."""
    if kind == "completion":
        stream = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, extra_body=LONG)
    else:
        stream = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=max_tokens, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=LONG)
    parts: list[str] = []
    usage = None
    async for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            parts.append(choice.text if kind == "completion" else choice.delta.content or "")
        if len(parts) >= 20:
            first_chunks.set()
    return "".join(parts), usage


@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_an_openai_stream_survives_a_sigkill_of_its_engine_with_the_uninterrupted_greedy_text(
        engines, start_router, bus: Bus, store: Store, kind: str) -> None:
    a, b = engines(f"oa-kill-a-{kind}"), engines(f"oa-kill-b-{kind}")
    await asyncio.gather(asyncio.to_thread(a.wait_ready), asyncio.to_thread(b.wait_ready))
    router = start_router()
    await announce(bus, store, a.engine_id, a.url)
    prompt = PROMPT if kind == "completion" else f"<|user|>\n{PROMPT}\n<|assistant|>\n"
    expected = generate(b.url, prompt=prompt, max_tokens=300, **LONG)["text"]  # uninterrupted, on the successor

    seen = asyncio.Event()
    task = asyncio.create_task(openai_text(client(router.url), kind, 300, seen))
    await asyncio.wait_for(seen.wait(), 60)
    a.child.kill(signal.SIGKILL)  # mid-stream: ~20 of 300 tokens are out
    await retire(bus, store, a.engine_id, "killed")
    await announce(bus, store, b.engine_id, b.url, predecessor_id=a.engine_id)
    text, usage = await task
    assert text == expected
    assert usage is not None and usage.completion_tokens == 300
    stats = router.stats()
    assert stats["replayed"] >= 1 and stats["completed"] == 1 and stats["failed"] == 0


class RecordingProxy:
    """Forwards /generate to one real engine and records each body it was sent (what the router sends an
    engine). When the engine dies mid-stream the proxy's own response breaks off, as the engine's would."""

    def __init__(self, engine_url: str) -> None:
        self.engine_url = engine_url
        self.bodies: list[dict[str, Any]] = []
        self.port = procs.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route("/generate", self.generate, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical"))
        self.task: asyncio.Task[None] | None = None

    async def generate(self, request: Request) -> StreamingResponse:
        body = await request.json()
        self.bodies.append(body)

        async def lines() -> AsyncIterator[bytes]:
            async with httpx.AsyncClient(timeout=30) as h, h.stream("POST", self.engine_url + "/generate",
                                                                     json=body) as r:
                async for line in r.aiter_lines():
                    yield (line + "\n").encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[RecordingProxy]:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)
        try:
            yield self
        finally:
            self.server.should_exit = True
            await self.task


async def test_every_engine_attempt_of_one_request_is_sent_the_same_request_id(
        engines, start_router, bus: Bus, store: Store) -> None:
    a, b = engines("rid-a"), engines("rid-b")
    await asyncio.gather(asyncio.to_thread(a.wait_ready), asyncio.to_thread(b.wait_ready))
    router = start_router()
    async with RecordingProxy(a.url).running() as pa, RecordingProxy(b.url).running() as pb:
        await announce(bus, store, "rid-a", pa.url)
        seen = asyncio.Event()
        task = asyncio.create_task(openai_text(client(router.url), "completion", 200, seen))
        await asyncio.wait_for(seen.wait(), 60)
        a.child.kill(signal.SIGKILL)
        await retire(bus, store, "rid-a", "killed")
        await announce(bus, store, "rid-b", pb.url, predecessor_id="rid-a")
        text, usage = await task
        # /v1/generate's requests get one too, and its final line says which
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.post(router.url + "/v1/generate", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert len(pa.bodies) == 1 and len(pb.bodies) == 2
    first, resumed = pa.bodies[0], pb.bodies[0]
    assert first["request_id"].startswith("cmpl-") and resumed["request_id"] == first["request_id"]
    assert first["resume"] == [] and len(resumed["resume"]) >= 20  # the successor is told what was generated
    assert resumed["max_tokens"] == 200 - len(resumed["resume"]) and resumed["seed"] == first["seed"]
    assert usage.completion_tokens == 200 and len(text) > 0
    assert r.json()["request_id"] == pb.bodies[1]["request_id"] and r.json()["request_id"].startswith("gen-")
