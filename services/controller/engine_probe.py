"""Whether engines can be reached at their endpoints: the lost-node pass's one question (lost_nodes.py, invariant 2).

An adapter: one HTTP GET of `<endpoint>/health` each, at once, never through a proxy (the environment's proxy
settings are not ours: a proxy's own 502 would read as the engine's answer). Only a connection that cannot be made
(refused, reset on connect, or not made within the timeout) says unreachable: an engine that accepted and answered
slowly, or answered anything at all, is running, and its health is its agent's business."""

from __future__ import annotations

import asyncio
import logging

import httpx

log = logging.getLogger("holdfast.controller.engine_probe")


async def reachable(endpoints: list[str], timeout_s: float) -> list[bool]:
    """For each endpoint, False only when no connection to it could be made."""
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        return list(await asyncio.gather(*(_one(client, url) for url in endpoints)))


async def _one(client: httpx.AsyncClient, url: str) -> bool:
    try:
        await client.get(url.rstrip("/") + "/health")
    except (httpx.ConnectError, httpx.ConnectTimeout):
        return False
    except Exception as e:  # noqa: BLE001 - connected, or not a question this can answer (a malformed URL): not lost
        log.info("engine at %s: %r; not taken for lost", url, e)
    return True
