"""The pattern engine the router tests run on, as a process: without torch at all, its tokens are the pure function
of tokens.py (a resumed request continues the uninterrupted run exactly), a bad body gets a typed 4xx and the
engine goes on serving, and /health counts its slots."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engines.pattern import tokens
from libs.common import tokenizer
from tests.engine.support import EngineProc, generate, pattern_engine


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[EngineProc]:
    blocked = tmp_path / "no-torch" / "torch"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('the pattern engine must not need torch')\n")
    e = pattern_engine(tmp_path, "pat-a", args=("--slots", "2", "--max-seq", "64"))
    e.child.env = {**(e.child.env or {}), "PYTHONPATH": f"{blocked.parent}:{Path.cwd()}"}
    e.start()
    try:
        e.wait_ready()
        yield e
    finally:
        e.stop()


def test_a_resumed_request_continues_the_uninterrupted_run_token_for_token(engine: EngineProc) -> None:
    whole = generate(engine.url, prompt="resume me", max_tokens=12, seed=3, temperature=1.0, request_id="r-1")
    assert whole["tokens"] == list(tokens.run(tokenizer.encode("resume me"), seed=3, sampled=True, count=12))
    assert whole["request_id"] == "r-1" and whole["text"] == tokenizer.decode(whole["tokens"])
    rest = generate(engine.url, prompt="resume me", max_tokens=7, seed=3, temperature=1.0, resume=whole["tokens"][:5])
    assert rest["tokens"] == whole["tokens"][5:] and rest["prompt_tokens"] == whole["prompt_tokens"] + 5
    other_seed = generate(engine.url, prompt="resume me", max_tokens=12, seed=4, temperature=1.0)["tokens"]
    greedy = [generate(engine.url, prompt="resume me", max_tokens=12, seed=s)["tokens"] for s in (3, 4)]
    assert other_seed != whole["tokens"] and greedy[0] == greedy[1]  # sampling follows the seed, greedy does not


@pytest.mark.parametrize(("body", "status", "code"), [
    (b"{nope", 400, "bad_json"),
    (b'{"max_tokens": 3}', 422, "invalid_body"),
    (b'{"prompt": "x", "max_tokens": -1}', 422, "invalid_body"),
    (b'{"prompt": "x", "unknown_knob": 1}', 422, "invalid_body"),
    (b'{"tokens": [999]}', 400, "bad_request"),
    (b'{"prompt": "' + b"x" * 80 + b'"}', 400, "bad_request"),
])
def test_a_bad_body_gets_a_typed_4xx_and_the_engine_serves_on(engine: EngineProc, body: bytes, status: int,
                                                              code: str) -> None:
    r = httpx.post(engine.url + "/generate", content=body, headers={"content-type": "application/json"}, timeout=10)
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert generate(engine.url, prompt="still here", max_tokens=2)["completion_tokens"] == 2


async def test_health_counts_busy_slots_and_a_generation_stops_at_max_seq(engine: EngineProc) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        async def health() -> dict:
            return (await c.get(engine.url + "/health")).json()

        assert (await health())["free_slots"] == 2
        long = [asyncio.create_task(c.post(engine.url + "/generate", json={"prompt": "p", "max_tokens": 200}))
                for _ in range(2)]
        while (h := await health())["free_slots"] != 0:
            await asyncio.sleep(0.01)
        assert h["slots"] == 2 and h["state"] == "ready"
        results = [r.json() for r in await asyncio.gather(*long)]
    assert [(r["finish_reason"], r["completion_tokens"]) for r in results] == [("max_seq", 62)] * 2  # 64 - BOS, "p"
    assert (await asyncio.to_thread(lambda: httpx.get(engine.url + "/health").json()))["free_slots"] == 2
