"""Stuck servers: every `probe_interval_s` the agent asks each serving active engine `GET /health`; no answer within
`probe_timeout_s` in `probe_failures` rounds in a row is `hung` (a gray failure: its heartbeats, from a thread of
their own, go on; the router meanwhile waits `token_timeout_s` per request on it). Which engines are asked and how
failures count, and which rounds count at all, is `supervision.probe_targets`, `supervision.count_probes` and
`supervision.probe_round_void` (pure); this module only asks.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from libs.common.events import FaultKind
from services.agent import supervision
from services.agent.table import EngineTable, FaultReporter


class Host(EngineTable, FaultReporter, Protocol):
    """What the probes need of the agent: its engine table, and faulting an engine."""


class Probes:
    def __init__(self, host: Host) -> None:
        self.host = host

    async def loop(self) -> None:
        """Every `probe_interval_s`, GET /health of each serving engine: `probe_failures` rounds in a row without an
        answer within `probe_timeout_s` is a hang of its server. A round in which the agent itself was not running
        (its sleep or its probes far later than asked) counts for nobody."""
        import httpx

        host, s = self.host, self.host.settings
        if s.probe_interval_s <= 0:
            return
        failures: dict[str, int] = {}
        async with httpx.AsyncClient(timeout=s.probe_timeout_s, trust_env=False) as client:
            while True:
                t0 = time.monotonic()
                await asyncio.sleep(s.probe_interval_s)
                targets = supervision.probe_targets(host.records())
                t1 = time.monotonic()
                results = await asyncio.gather(*(self._answers(client, r.endpoint or "") for r in targets))
                probed = time.monotonic() - t1
                if supervision.probe_round_void(t1 - t0, probed, s.probe_interval_s, s.probe_timeout_s):
                    continue  # the agent was away: a timeout this round may be its own
                answered = {r.engine_id: ok for r, ok in zip(targets, results, strict=True)}
                for engine_id in supervision.count_probes(failures, answered, s.probe_failures):
                    rec = host.engines.get(engine_id)
                    if rec is not None and rec in targets and not rec.faulted:
                        host.fault(rec, FaultKind.HUNG, died_at=time.time(),
                                   detail=f"its HTTP server answered no GET /health in {s.probe_failures} probes "
                                          f"({s.probe_timeout_s:g} s each); heartbeats went on")

    @staticmethod
    async def _answers(client: Any, endpoint: str) -> bool:
        """Whether the server at `endpoint` answers at all (any status: its loop runs)."""
        import httpx

        try:
            await client.get(f"{endpoint}/health")
        except httpx.HTTPError:
            return False
        return True
