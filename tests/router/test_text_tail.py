"""A generation that ends in the middle of a UTF-8 character (byte tokens: its last tokens began one and never
finished it) keeps those bytes in its text, as U+FFFD, on every route: they were dropped, 9 of 40 greedy 12-token
runs of the tiny model shorter than their tokens while usage counted them (probe of 2026-12-07). The engine's final
line carries the text of the unfinished character; the router passes it on. A real batched engine (tiny model,
CPU) behind a real router."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from libs.common import tokenizer
from libs.common.bus import Bus
from libs.common.store import Store
from tests.engine.conftest import tiny_weights  # noqa: F401 - fixture
from tests.engine_batched.test_front import engine
from tests.router.test_openai_api import client
from tests.router.test_router import MODEL, announce

PROMPTS = [f"u{i}" for i in range(24)]


def test_a_stream_left_inside_a_character_flushes_it_as_a_replacement() -> None:
    stream = tokenizer.TextStream()
    assert [stream.push(t) for t in "é".encode()[:1]] == [""] and stream.flush() == "\ufffd"
    assert stream.flush() == ""  # said once
    assert stream.push(ord("a")) + stream.flush() == "a"


async def test_every_route_keeps_the_text_of_a_character_the_generation_left_unfinished(
        start_router, bus: Bus, store: Store, tmp_path: Path, tiny_weights: Path) -> None:  # noqa: ANN001, F811
    eng = engine(tmp_path, tiny_weights, "tail-a")
    try:
        await asyncio.to_thread(eng.wait_ready, 90)
        await announce(bus, store, "tail-a", eng.url)
        router = await asyncio.to_thread(start_router)
        c = client(router.url)
        unfinished = 0
        async with httpx.AsyncClient(timeout=60) as h:
            for prompt in PROMPTS:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "greedy": True, "ignore_eos": True}
                whole = (await h.post(router.url + "/v1/generate", json=body)).json()
                expected = tokenizer.decode(whole["tokens"])
                assert whole["text"] == expected, (prompt, whole)
                unfinished += tokenizer.TextStream().push(whole["tokens"][-1]) == "" and expected.endswith("\ufffd")
                streamed = ""
                async with h.stream("POST", router.url + "/v1/generate", json={**body, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.strip():
                            streamed += json.loads(line).get("text", "")
                assert streamed == expected, prompt
                done = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                  extra_body={"ignore_eos": True})
                assert done.choices[0].text == expected and done.usage.completion_tokens == 12, prompt
                chunks = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True})
                assert "".join([ch.choices[0].text async for ch in chunks if ch.choices]) == expected, prompt
        assert unfinished > 0  # some generation did end inside a character: the case was met
    finally:
        await asyncio.to_thread(eng.stop)
