"""The endpoint table: which engines serve which model, how loaded each is, who waits for one.

Pure logic (no I/O): fed by endpoint events (app.py) and by the relay's observations (a failed
connection makes an engine *suspect* for a while, it is never probed). Invariants:
1. An endpoint is chosen only if it is in the table and not suspect; among those, the least loaded
   (fewest requests in flight), ties broken round-robin.
2. A request that finds no endpoint waits (is *held*) until one is added, or its `wait_s` passes, or, while a
   *recovery* of its model is under way, until that recovery's `until`, whichever is later: then `NoEndpoint`.
   A recovery is an incident that routed one of the model's endpoints out to bring a successor in
   (`recovering`); it ends when that successor is routed in or the incident ends without one (`recovered`: held
   requests past their own `wait_s` get `NoEndpoint` at once), or at its `until` (a missed end is bounded).
   New requests held per model are bounded by `queue_max`: one more gets `QueueFull` at once; so are those held
   for all models not known (invariant 4) together, whatever their names. Replays of requests already streaming
   are not bounded (they were admitted already).
3. `release` is called once for every successful `acquire` (the relay's finally), so in-flight counts
   return to zero when the router is idle.
4. A model is *known* while an endpoint serves it, while a recovery of it is under way, and for `forget_s`
   after its last endpoint went (a failover's gap between `removed` and the successor's `added`); a model no
   endpoint ever served since
   start is not known. The OpenAI API answers 404 for a model that is not known, and holds the others.
6. The table keeps no state for a name a client alone gave: a model entry with no endpoint, recovery, end of
   service (`gone_since`) or request waiting is dropped as its last waiter leaves (each unknown name sent to
   /v1/generate stayed for good: 40,000 names, +31 MB).
5. A *promised* endpoint (a standby taking over, which holds requests until it serves: sync.py `_promise`) gets a
   new request only when no other healthy endpoint serves its model; replays (their streams' KV is most likely
   the promised successor's) choose among all, least loaded first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class HoldRejected(Exception):
    code = "unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueFull(HoldRejected):
    code = "queue_full"


class NoEndpoint(HoldRejected):
    code = "no_endpoint"


@dataclass
class Endpoint:
    model: str
    engine_id: str
    url: str
    inflight: int = 0
    suspect_until: float = 0.0
    served: int = 0
    promised: bool = False  # a standby told to be taking over (sync.py `_promise`): it holds requests till it serves


@dataclass
class ModelRoutes:
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    waiting: int = 0  # new requests held now
    waiters: int = 0  # every request held now, replays too
    rr: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    gone_since: float | None = None  # when its last endpoint went; None while one serves it, or never any
    recoveries: dict[str, float] = field(default_factory=dict)  # incident id -> until (clock): invariant 2

    def recovery_until(self, now: float) -> float | None:
        """The latest `until` of the recoveries under way (expired ones forgotten), None when there are none."""
        if self.recoveries:
            self.recoveries = {inc: until for inc, until in self.recoveries.items() if until > now}
        return max(self.recoveries.values()) if self.recoveries else None


class EndpointTable:
    def __init__(self, queue_max: int, *, forget_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.queue_max = queue_max
        self.forget_s = forget_s
        self.clock = clock
        self.models: dict[str, ModelRoutes] = {}

    def _routes(self, model: str) -> ModelRoutes:
        return self.models.setdefault(model, ModelRoutes())

    def _wake(self, routes: ModelRoutes) -> None:
        routes.changed.set()
        routes.changed = asyncio.Event()  # waiters hold the old event; later ones get a fresh one

    # ------------------------------------------------------------ changes from events

    def add(self, model: str, engine_id: str, url: str, *, promised: bool = False) -> Endpoint:
        routes = self._routes(model)
        ep = routes.endpoints.get(engine_id)
        if ep is None or ep.url != url.rstrip("/"):
            ep = Endpoint(model, engine_id, url.rstrip("/"), inflight=ep.inflight if ep else 0)
            routes.endpoints[engine_id] = ep
        ep.promised = promised
        ep.suspect_until = 0.0  # an event saying it serves outranks what we observed before
        routes.gone_since = None
        self._wake(routes)
        return ep

    def remove(self, model: str, engine_id: str) -> Endpoint | None:
        routes = self.models.get(model)
        if routes is None:
            return None
        ep = routes.endpoints.pop(engine_id, None)
        if ep is not None and not routes.endpoints:
            routes.gone_since = self.clock()
        return ep

    def recovering(self, model: str, incident_id: str, for_s: float) -> None:
        """An incident routed one of `model`'s endpoints out to bring a successor in: requests held for the model
        wait for it up to `for_s` from now (invariant 2)."""
        self._routes(model).recoveries[incident_id] = self.clock() + for_s

    def recovered(self, incident_id: str) -> None:
        """The recovery ended (its successor routed in, or the incident ended without one): held requests past
        their own wait give up now."""
        for routes in self.models.values():
            if routes.recoveries.pop(incident_id, None) is not None:
                self._wake(routes)

    def recovery_ids(self) -> set[str]:
        """The incidents whose recoveries are under way (expired ones not)."""
        now = self.clock()
        return {inc for routes in self.models.values() if routes.recovery_until(now) is not None
                for inc in routes.recoveries}

    def recoveries(self) -> dict[str, dict[str, float]]:
        """The recoveries under way: model -> incident id -> seconds its hold has left."""
        now = self.clock()
        out = {}
        for model, routes in self.models.items():
            if routes.recovery_until(now) is not None:
                out[model] = {inc: round(until - now, 3) for inc, until in routes.recoveries.items()}
        return out

    def find(self, engine_id: str) -> Endpoint | None:
        for routes in self.models.values():
            if engine_id in routes.endpoints:
                return routes.endpoints[engine_id]
        return None

    def is_known(self, model: str) -> bool:
        """Served now or within `forget_s` (invariant 4)."""
        r = self.models.get(model)
        if r is None:
            return False
        now = self.clock()
        return (bool(r.endpoints) or (r.gone_since is not None and now - r.gone_since < self.forget_s)
                or r.recovery_until(now) is not None)

    def known(self) -> list[str]:
        return sorted(m for m in self.models if self.is_known(m))

    # ------------------------------------------------------------ observations from the relay

    def suspect(self, ep: Endpoint, for_s: float) -> None:
        ep.suspect_until = self.clock() + for_s

    # ------------------------------------------------------------ choosing

    def healthy(self, model: str) -> list[Endpoint]:
        routes = self.models.get(model)
        if routes is None:
            return []
        now = self.clock()
        return [ep for ep in routes.endpoints.values() if ep.suspect_until <= now]

    def pick(self, model: str, *, fresh: bool = False) -> Endpoint | None:
        candidates = self.healthy(model)
        if fresh and any(not ep.promised for ep in candidates):  # invariant 5
            candidates = [ep for ep in candidates if not ep.promised]
        if not candidates:
            return None
        routes = self._routes(model)
        low = min(ep.inflight for ep in candidates)
        least = [ep for ep in candidates if ep.inflight == low]
        ep = least[routes.rr % len(least)]
        routes.rr += 1
        ep.inflight += 1
        ep.served += 1
        return ep

    def _next_suspect_expiry(self, model: str) -> float | None:
        routes = self.models.get(model)
        now = self.clock()
        pending = [ep.suspect_until - now for ep in (routes.endpoints.values() if routes else []) if ep.suspect_until > now]
        return min(pending) if pending else None

    async def acquire(self, model: str, wait_s: float, *, admitted: bool = False) -> Endpoint:
        """An endpoint of `model`, held for one as invariant 2 says. Cancelled (its client gone: the HTTP layer's
        `unless_gone`), a held request leaves the queue at once."""
        ep = self.pick(model, fresh=not admitted)
        if ep is not None:
            return ep
        if not admitted:
            if (n := self.models[model].waiting if model in self.models else 0) >= self.queue_max:
                raise QueueFull(f"{n} requests for model {model!r} are already held (queue_max {self.queue_max})")
            if not self.is_known(model) and (n := self._held_unknown()) >= self.queue_max:
                raise QueueFull(f"{n} requests for models no engine serves are already held (queue_max "
                                f"{self.queue_max})")
        routes = self._routes(model)
        start = self.clock()
        routes.waiters += 1
        if not admitted:
            routes.waiting += 1
        try:
            while True:
                now = self.clock()
                left = max(start + wait_s, routes.recovery_until(now) or 0.0) - now  # invariant 2
                if left <= 0:
                    raise NoEndpoint(f"no endpoint serves model {model!r} after waiting {now - start:.3g}s")
                expiry = self._next_suspect_expiry(model)
                wait = min(left, expiry) if expiry is not None else left
                changed = asyncio.ensure_future(routes.changed.wait())
                try:
                    await asyncio.wait((changed,), timeout=wait)
                finally:
                    changed.cancel()
                ep = self.pick(model, fresh=not admitted)
                if ep is not None:
                    return ep
        finally:
            routes.waiters -= 1
            if not admitted:
                routes.waiting -= 1
            if (not routes.waiters and not routes.endpoints and not routes.recoveries and routes.gone_since is None
                    and self.models.get(model) is routes):
                del self.models[model]  # invariant 6

    def release(self, ep: Endpoint) -> None:
        ep.inflight = max(0, ep.inflight - 1)

    def held(self) -> int:
        return sum(r.waiting for r in self.models.values())

    def _held_unknown(self) -> int:
        return sum(r.waiting for m, r in self.models.items() if not self.is_known(m))

    def urls(self) -> list[str]:
        return [ep.url for routes in self.models.values() for ep in routes.endpoints.values()]

    def describe(self) -> dict[str, list[dict[str, object]]]:
        now = self.clock()
        return {model: [{"engine_id": ep.engine_id, "url": ep.url, "inflight": ep.inflight, "served": ep.served,
                         "suspect": ep.suspect_until > now, "promised": ep.promised} for ep in routes.endpoints.values()]
                for model, routes in self.models.items() if routes.endpoints}
