"""Whether engines answer as themselves at their endpoints: the lost-node pass's one question (lost_nodes.py,
invariant 2).

An adapter: one HTTP GET of `<endpoint>/health` each, at once, never through a proxy (the environment's proxy
settings are not ours: a proxy's own 502 would read as the engine's answer). An engine answers as itself when its
answer, within the timeout, is JSON naming its engine id (every engine's `/health` does, even a 503's body). Anything
else says it is not there: no connection (the node is down), none in time (a frozen node: its kernel still accepts,
nothing reads; a probe of 2026-12-07 saw such a node's engine taken for alive and its requests hang), or another
process on its port (a plain HTTP server's 404 kept a dead engine "alive" for 100 s in the same probe)."""

from __future__ import annotations

import asyncio
import logging

import httpx

log = logging.getLogger("holdfast.controller.engine_probe")


async def answering(targets: list[tuple[str, str]], timeout_s: float) -> list[bool]:
    """For each (endpoint, engine id): whether the engine answered as itself there."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        return list(await asyncio.gather(*(_one(client, url, engine_id) for url, engine_id in targets)))


async def _one(client: httpx.AsyncClient, url: str, engine_id: str) -> bool:
    try:
        body = (await client.get(url.rstrip("/") + "/health")).json()
    except Exception as e:  # noqa: BLE001 - no answer, none in time, not JSON, not a URL: not the engine answering
        log.info("engine %s at %s: no answer of its own (%r)", engine_id, url, e)
        return False
    if isinstance(body, dict) and body.get("engine_id") == engine_id:
        return True
    log.info("engine %s at %s: something else answers there", engine_id, url)
    return False
