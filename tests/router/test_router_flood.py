"""A flood of requests the router refuses itself (500 at once, each a 400 from its own checks) beside streams it
relays: every stream ends with its exact text and every refusal is typed. The refusals used to run back to back in
one pass of the worker's loop, each stream's next chunk waiting behind all of them; the router now takes new
requests a slice of its loop a pass (libs/common/web/intake.py). The streams' largest gap with and without the flood
is reported, not asserted (the machine is shared)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tests.router.conftest import OpenAIStack
from tests.router.test_openai_api import client
from tests.router.test_router import MODEL
from tests.support import flood

PROMPTS = [f"stream {i} through the router" for i in range(4)]


async def streams_round(url: str, flood: Callable[[], object] | None = None) -> tuple[list[str], float, object]:
    """Every prompt streamed at once through the router (the official client): their texts and the largest gap
    between two chunks of any of them (ms); `flood` runs once every stream has its first chunk."""
    c = client(url)
    arrivals: list[list[float]] = [[] for _ in PROMPTS]
    texts: list[list[str]] = [[] for _ in PROMPTS]
    started = [asyncio.Event() for _ in PROMPTS]

    async def one(i: int) -> None:
        stream = await c.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=200, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            arrivals[i].append(time.perf_counter())
            texts[i].append(chunk.choices[0].text if chunk.choices else "")
            started[i].set()

    tasks = [asyncio.create_task(one(i)) for i in range(len(PROMPTS))]
    await asyncio.gather(*(e.wait() for e in started))
    got = await asyncio.to_thread(flood) if flood is not None else None
    await asyncio.gather(*tasks)
    gap = max((b - a) * 1000 for arr in arrivals for a, b in zip(arr, arr[1:], strict=False))
    return ["".join(t) for t in texts], gap, got


async def test_a_flood_of_refused_requests_leaves_every_stream_its_text_and_each_refusal_typed(
        openai_stack: OpenAIStack, record_property: Callable[[str, object], None]) -> None:
    url = openai_stack.router.url
    port = url.rsplit(":", 1)[1]
    calm, calm_gap, _ = await streams_round(url)

    def burst() -> list[list]:
        return flood(port, 500, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, key="type")

    flooded, flood_gap, answers = await streams_round(url, burst)
    assert flooded == calm  # greedy: each stream's text does not depend on what runs beside it
    assert answers == [[400, "invalid_request_error"]] * 500
    figures = {"largest_gap_ms_calm": round(calm_gap, 1), "largest_gap_ms_flood": round(flood_gap, 1)}
    record_property("flood", figures)
    print("\nrouter streams beside 500 refusals:", figures)
