"""Keeping the endpoint table equal to etcd's `endpoints/<model>/<engine>`: events fast, etcd as the truth.

Endpoint events (`router.endpoint.added/removed`) are the fast path: they change the table the moment the
controller decides. They are core NATS messages, so a router cut off from NATS misses the ones sent
meanwhile. The controller writes `endpoints/<model>/<engine>` before it emits `added` and deletes it when
it emits `removed`, so etcd holds the level the events describe. `EndpointFeed.reconcile` reads that level
and makes the table equal to it: on every NATS reconnect (the edge where events may have been missed) and
every `reconcile_s` (the safety net for anything else: an event lost while the subscription was being
re-sent, a controller write that landed after our read).

Conflict rule (`plan`, pure): an endpoint about which an event arrived after `read_started - grace_s` is
left as the event put it. The controller's etcd write is write-behind (it may land just after the event),
so a read can lag an event; the event is the newer word until `grace_s` has passed. After that, etcd wins,
with two exceptions for what etcd cannot have caught up with when it was away (an etcd outage just after an
engine's death kept the controller's delete from landing for ~10 s past the grace: the reconcile routed to the dead
engine again and dropped the standby its requests were promised to, and every stream failed; probe of 2026-12-07):
1. An endpoint removed by an event (a death, not a `live` removal) is not added back by a record that is the one the
   router last read before the removal (its mod revision no newer: `Level.revisions`); a newer write of it is.
2. A successor routed in by an event (`endpoint.added` naming its predecessor) stays until a read has shown its
   record, an event removes it, or `recovery_hold_s` has passed: one routed in while etcd was stopped was removed as
   "gone from etcd" and its streams failed (the controller's put had not landed; its next term came 15 s later).
   A promised one stays while its predecessor's record is still in etcd (the route-out's delete has not landed:
   etcd has not caught up with the failure at all), up to `recovery_hold_s`; an incident's end without a successor
   (`endpoint.unrecovered`) withdraws the promise.

Reconcile changes only what differs: an endpoint in both keeps its in-flight count and suspect mark (no
in-flight stream is touched); one gone from etcd is removed exactly as `endpoint.removed` would remove it
(its streams are cut and resume elsewhere); one new in etcd is added as `endpoint.added` would add it.

Cold recoveries the same way: the controller writes `recoveries/<incident>` ({model, at}) when a routed-out
incident's successor starts cold (the fallback: seconds to minutes, past a router's own hold) and deletes it with
the route-in or at the incident's failed end (controller routes.py `recovery_key`). The start-up read and each
reconcile start the recoveries it lists that this router does not hold yet, bounded by `recovery_hold_s` from the
marker's `at`: a router started (or cut off from NATS) during a cold recovery holds the model's requests as the
others do, instead of answering 404 for a model it never saw. A recovery this router saw end is never started
again by a marker whose deletion has not landed yet (the write is behind the event); one whose marker is gone is
left to its events and its bound.

A sound engine's removal (`EndpointRemoved.live`: a manual failover, a hot upgrade, a regroup) takes it out of the
table at once but leaves its streams running ("lingering"): they end when its agent stops it (the relay resumes
them then, from every token they had), when its successor is routed in (`endpoint.added` naming it: cut), when its
recovery ends without one (`endpoint.unrecovered`: cut) or, failing all three, at a reconcile `recovery_hold_s`
after the removal (cut). Cutting them at the removal would have the engine abort their sequences, dropping them
from its journal and its KV backup before the incident freezes either: its successor would prefill them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from libs.common.events import EndpointAdded, EndpointNotRecovered, EndpointRemoved, EndpointStandby, Envelope
from services.router.relay import Relay
from services.router.table import EndpointTable

log = logging.getLogger("holdfast.router.sync")

Key = tuple[str, str]  # (model, engine_id)


def parse_endpoints(kvs: dict[str, bytes]) -> dict[Key, str]:
    """`endpoints/<model>/<engine_id>` records -> {(model, engine_id): url}. A value is the url as plain text
    (what the controller writes: `Store` stores a str as its bytes), a JSON string, or a JSON object with at
    least `url` (and optionally `model`)."""
    out: dict[Key, str] = {}
    for key, raw in kvs.items():
        if not key.startswith("endpoints/"):
            continue  # a recovery marker (`parse_recoveries`)
        rest = key.removeprefix("endpoints/")
        model, _, engine_id = rest.rpartition("/")
        text = raw.decode(errors="replace").strip()
        url: object = text
        if text[:1] in ('{', '"'):
            try:
                value = json.loads(text)
            except ValueError:
                log.warning("ignoring malformed endpoint record %s", key)
                continue
            if isinstance(value, dict):
                url, model = value.get("url"), str(value.get("model") or model)
            else:
                url = value
        if not model or not engine_id or not isinstance(url, str) or "://" not in url:
            log.warning("ignoring endpoint record %s without model, engine or url", key)
            continue
        out[(model, engine_id)] = url.rstrip("/")
    return out


def parse_recoveries(kvs: dict[str, bytes]) -> dict[str, tuple[str, float]]:
    """`recoveries/<incident>` records -> {incident: (model, at: the route-out's wall time)}; malformed ones are
    skipped with a warning."""
    out: dict[str, tuple[str, float]] = {}
    for key, raw in kvs.items():
        if not key.startswith("recoveries/"):
            continue
        incident = key.removeprefix("recoveries/")
        try:
            value = json.loads(raw)
            model, at = value["model"], float(value["at"])
        except (ValueError, TypeError, KeyError):
            log.warning("ignoring malformed recovery record %s", key)
            continue
        if not incident or not isinstance(model, str) or not model:
            log.warning("ignoring recovery record %s without incident or model", key)
            continue
        out[incident] = (model, at)
    return out


@dataclass
class Level:
    """What a read of etcd gives: `endpoints/` and `recoveries/` records, and each one's mod revision where the
    reader knows it (conflict rule 1)."""

    kvs: dict[str, bytes]
    revisions: dict[str, int] = field(default_factory=dict)

    def revision(self, key: Key) -> int | None:
        """The mod revision of endpoint `key`'s record, where the reader gave it."""
        return self.revisions.get(f"endpoints/{key[0]}/{key[1]}")


def as_level(read: dict[str, bytes] | Level) -> Level:
    return read if isinstance(read, Level) else Level(read)


@dataclass
class Plan:
    add: list[tuple[str, str, str]] = field(default_factory=list)  # (model, engine_id, url)
    remove: list[Key] = field(default_factory=list)


def plan(current: dict[Key, str], desired: dict[Key, str], last_event: dict[Key, float], since: float) -> Plan:
    """What makes `current` equal to `desired`, leaving alone every endpoint with an event at or after
    `since` (newer than what the read can be trusted to reflect)."""
    p = Plan()
    for key, url in sorted(desired.items()):
        if current.get(key) != url and last_event.get(key, float("-inf")) < since:
            p.add.append((key[0], key[1], url))
    for key in sorted(current):
        if key not in desired and last_event.get(key, float("-inf")) < since:
            p.remove.append(key)
    return p


@dataclass
class SyncStats:
    reconciles: int = 0  # successful reads of the etcd level
    reconnects: int = 0  # NATS reconnects that triggered a reconcile
    added: int = 0  # endpoints added by a reconcile (an event was missed, or came before etcd)
    removed: int = 0  # endpoints removed by a reconcile
    errors: int = 0  # reads that failed (etcd unreachable): the table is kept as it is
    last_reason: str = ""

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


class EndpointFeed:
    """Applies endpoint events and etcd reconciliations to the table (and cuts the streams of removed engines)."""

    def __init__(self, table: EndpointTable, relay: Relay, *, grace_s: float = 5.0, recovery_hold_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.table = table
        self.wall = wall  # a recovery marker's `at` is the controller's wall time
        self.ended: dict[str, float] = {}  # recoveries this router saw end (incident -> clock): never restarted
        self.relay = relay
        self.grace_s = grace_s
        self.recovery_hold_s = recovery_hold_s  # requests wait this long at most for an incident's successor
        self.clock = clock
        self.ready = False
        self.stats = SyncStats()
        self.last_event: dict[Key, float] = {}
        # a removed engine -> its likely successor, added early (`_promise`), and when (clock)
        self.promised: dict[str, tuple[Key, float]] = {}
        self.routed_in: dict[Key, float] = {}  # a successor added by an event, no read has shown yet -> clock
        self.seen_revision: dict[Key, int] = {}  # each endpoint's record as the last read saw it (rule 1)
        self.removed_at_revision: dict[Key, int] = {}  # removed by an event: the record it superseded (rule 1)
        self.lingering: dict[str, tuple[str, float]] = {}  # a sound engine removed (`live`) -> (model, clock)
        # each engine's shadowing standby, as the controller last said (`EndpointStandby`): (url, clock). Spares are
        # kept to it (spare.py); one not said again within `standby_ttl_s` is forgotten
        self.standbys: dict[Key, tuple[str, float]] = {}
        self.standby_ttl_s = 90.0
        self.on_standby: Callable[[str], None] | None = None  # a standby new to this router (spare.py `top_up`)
        self._buffer: list[Envelope] = []
        self._lock = asyncio.Lock()  # one reconcile at a time (reconnect and period may coincide)

    # ------------------------------------------------------------ events (the fast path)

    async def on_event(self, env: Envelope) -> None:
        if not self.ready:
            self._buffer.append(env)
            return
        self.apply(env.data, published=env.time)

    def apply(self, ev: Any, *, published: float | None = None) -> None:
        now = self.clock()
        if isinstance(ev, EndpointAdded):
            self.last_event[(ev.model, ev.engine_id)] = now
            self.table.add(ev.model, ev.engine_id, ev.url)
            self.lingering.pop(ev.engine_id, None)  # routed to again (its recovery failed): its streams are its own
            if ev.incident_id:
                self.table.recovered(ev.incident_id)  # its successor serves: nothing is held for it any more
                self.ended[ev.incident_id] = now
            self.relay.route_ins.added(ev.engine_id, published)
            log.info("endpoint added: %s %s %s (predecessor %s)", ev.model, ev.engine_id, ev.url, ev.predecessor_id)
            self.removed_at_revision.pop((ev.model, ev.engine_id), None)  # routed to again: its record is news
            if ev.predecessor_id and ev.predecessor_id != ev.engine_id:
                self.routed_in[(ev.model, ev.engine_id)] = now
                self.last_event[(ev.model, ev.predecessor_id)] = now
                self._superseded((ev.model, ev.predecessor_id))
                self._gone(ev.model, ev.predecessor_id)
                promise = self._unpromise(ev.predecessor_id)
                if promise is not None and promise[1] != ev.engine_id:  # another successor: the promise is void
                    log.info("endpoint %s was promised for %s, %s took over: its requests resume there",
                             promise[1], ev.predecessor_id, ev.engine_id)
                    self.last_event[promise] = now
                    self._gone(*promise)
        elif isinstance(ev, EndpointRemoved):
            log.info("endpoint removed: %s %s (%s)", ev.model, ev.engine_id, ev.reason)
            self.routed_in.pop((ev.model, ev.engine_id), None)
            self._forget_standbys(ev.model, ev.engine_id, ev.url)
            self.last_event[(ev.model, ev.engine_id)] = now
            if ev.recovery and ev.incident_id:  # before the cut: its streams' replays wait for the successor
                self.table.recovering(ev.model, ev.incident_id, self.recovery_hold_s)
            if ev.live:  # no new request goes to it; its streams run on until it stops (module docstring)
                self.table.remove(ev.model, ev.engine_id)
                self.lingering[ev.engine_id] = (ev.model, now)
            else:
                self._superseded((ev.model, ev.engine_id))
                self._gone(ev.model, ev.engine_id)
            if ev.successor_id and ev.successor_url and self.table.find(ev.successor_id) is None:
                self._promise(ev, now, published)
        elif isinstance(ev, EndpointStandby):
            url = ev.standby_url.rstrip("/")
            known = self.standbys.get((ev.model, ev.engine_id))
            self.standbys[(ev.model, ev.engine_id)] = (url, now)
            if known is None or known[0] != url:
                log.info("standby of %s %s: %s %s", ev.model, ev.engine_id, ev.standby_id, url)
                if self.on_standby is not None:
                    self.on_standby(url)  # at once: a standby serves nothing, its spares cost it only their accepts
        elif isinstance(ev, EndpointNotRecovered):
            log.warning("endpoint %s %s: incident %s ended without a successor (%s); its model's requests are "
                        "no longer held for it", ev.model, ev.engine_id, ev.incident_id, ev.reason)
            self.table.recovered(ev.incident_id)
            self.ended[ev.incident_id] = now
            if ev.engine_id in self.lingering:
                self._gone(ev.model, ev.engine_id)
            promise = self._unpromise(ev.engine_id)  # no successor came: the standby promised serves nothing
            ep = None if promise is None else self.table.find(promise[1])
            if promise is not None and ep is not None and ep.promised:
                self.last_event[promise] = now
                self._gone(*promise)

    def _forget_standbys(self, model: str, engine_id: str, url: str | None) -> None:
        """An engine removed: its standby is not kept for it any more (the standby, promised, is an endpoint of its
        own once added), nor is any entry that names the removed engine's own address (a standby that took over)."""
        self.standbys.pop((model, engine_id), None)
        if url:
            gone = url.rstrip("/")
            self.standbys = {k: v for k, v in self.standbys.items() if v[0] != gone}

    def spare_urls(self) -> list[str]:
        """The engines to keep spare connections to: those routed to, and the standbys said to shadow them (their
        likely successors: a failover's requests find connections open to the one promised)."""
        now = self.clock()
        self.standbys = {k: v for k, v in self.standbys.items() if now - v[1] <= self.standby_ttl_s}
        return list(dict.fromkeys([*self.table.urls(), *(url for url, _ in self.standbys.values())]))

    def _promise(self, ev: EndpointRemoved, now: float, published: float | None) -> None:
        """The standby that will most likely take over (EndpointRemoved.successor_id) is added now, marked
        promised: requests reach it during its takeover (it holds them until it serves). Its `endpoint.added`
        makes it a plain endpoint; another successor's, or a reconcile after `grace_s` that does not find it
        in etcd, removes it (its streams resume elsewhere)."""
        assert ev.successor_id is not None and ev.successor_url is not None
        key = (ev.model, ev.successor_id)
        self.last_event[key] = now
        self.table.add(ev.model, ev.successor_id, ev.successor_url, promised=True)
        self.promised[ev.engine_id] = (key, now)
        self.relay.route_ins.promised(ev.successor_id, published)
        log.info("endpoint promised: %s %s %s (for %s)", ev.model, ev.successor_id, ev.successor_url, ev.engine_id)

    def _unpromise(self, predecessor: str) -> Key | None:
        """The successor promised for `predecessor`, no longer promised for it."""
        entry = self.promised.pop(predecessor, None)
        return None if entry is None else entry[0]

    def _superseded(self, key: Key) -> None:
        """An event removed `key`'s engine: the record the router last read of it is older than that (rule 1)."""
        if key in self.seen_revision:
            self.removed_at_revision[key] = self.seen_revision[key]

    def _stale(self, desired: dict[Key, str], level: Level) -> dict[Key, str]:
        """`desired` without the records an event removed since the router read them (rule 1); a record gone from
        etcd, or written anew, ends its entry."""
        out = dict(desired)
        for key, removed in list(self.removed_at_revision.items()):
            rev = level.revision(key)
            if key not in desired or rev is None or rev > removed:
                del self.removed_at_revision[key]  # gone, unknowable, or written after the removal: etcd's word
            else:
                del out[key]
        return out

    def _seen(self, recorded: dict[Key, str], level: Level) -> None:
        self.seen_revision = {key: rev for key in recorded if (rev := level.revision(key)) is not None}

    def _gone(self, model: str, engine_id: str) -> None:
        self.table.remove(model, engine_id)
        self.lingering.pop(engine_id, None)
        cut = self.relay.endpoint_gone(engine_id)
        if cut:
            log.info("%d streams on %s will resume on another endpoint", cut, engine_id)

    # ------------------------------------------------------------ the etcd level

    def load_snapshot(self, read: dict[str, bytes] | Level) -> int:
        """Start-up: everything in etcd goes in, the recoveries under way too (events that raced the read are applied
        after, in go_live)."""
        level = as_level(read)
        endpoints = parse_endpoints(level.kvs)
        for (model, engine_id), url in endpoints.items():
            self.table.add(model, engine_id, url)
        self._seen(endpoints, level)
        self._recoveries(level.kvs, "start")
        return len(endpoints)

    def _recoveries(self, kvs: dict[str, bytes], reason: str) -> None:
        """The markers' recoveries this router does not hold and did not see end, each held for what is left of
        `recovery_hold_s` since its route-out."""
        held = self.table.recovery_ids()
        for incident, (model, at) in parse_recoveries(kvs).items():
            left = self.recovery_hold_s - max(0.0, self.wall() - at)
            if incident in held or incident in self.ended or left <= 0:
                continue
            log.info("%s: incident %s recovers %s (in etcd): its requests are held up to %.1f s more", reason,
                     incident, model, left)
            self.table.recovering(model, incident, left)

    def go_live(self) -> None:
        for env in self._buffer:  # no await in here: nothing can slip in between
            self.apply(env.data, published=env.time)
        self._buffer.clear()
        self.ready = True

    def current(self) -> dict[Key, str]:
        return {(m, eid): ep.url for m, routes in self.table.models.items() for eid, ep in routes.endpoints.items()}

    async def reconcile(self, read: Callable[[], Awaitable[dict[str, bytes] | Level]], reason: str) -> bool:
        """Read the etcd level and make the table equal to it. False when the read failed (table kept)."""
        async with self._lock:
            started = self.clock()
            try:
                level = as_level(await read())
            except Exception as e:  # noqa: BLE001 - etcd away: keep serving from the table we have
                self.stats.errors += 1
                log.warning("endpoint reconcile (%s) could not read etcd: %r", reason, e)
                return False
            kvs = level.kvs
            recorded = parse_endpoints(kvs)
            p = plan(self.current(), self._stale(recorded, level), self.last_event, started - self.grace_s)
            # rule 2: a promise stands while its predecessor's record does (its incident not ended in etcd)
            standing = {key for pred, (key, at) in self.promised.items()
                        if at >= started - self.recovery_hold_s and (key[0], pred) in recorded}
            self.routed_in = {key: t for key, t in self.routed_in.items()
                              if t >= started - self.recovery_hold_s and key not in recorded}
            standing |= set(self.routed_in)
            p.remove = [key for key in p.remove if key not in standing]
            self._seen(recorded, level)
            for model, engine_id, url in p.add:
                log.info("reconcile (%s): endpoint %s %s %s is in etcd: added", reason, model, engine_id, url)
                self.table.add(model, engine_id, url)
                self.lingering.pop(engine_id, None)
            for model, engine_id in p.remove:
                log.info("reconcile (%s): endpoint %s %s is gone from etcd: removed", reason, model, engine_id)
                self._gone(model, engine_id)
            self._recoveries(kvs, f"reconcile ({reason})")
            for engine_id, (model, at) in list(self.lingering.items()):
                if at < started - self.recovery_hold_s:  # no word of its recovery's end within the bound
                    self._gone(model, engine_id)
            self.stats.reconciles += 1
            self.stats.added += len(p.add)
            self.stats.removed += len(p.remove)
            self.stats.last_reason = reason
            # Forget events older than any future read's horizon: the map stays as small as the churn.
            horizon = started - self.grace_s
            self.last_event = {k: t for k, t in self.last_event.items() if t >= horizon}
            self.promised = {pred: (key, at) for pred, (key, at) in self.promised.items()
                             if key in self.last_event or key in standing}
            # a marker outlives its recovery's end by at most the hold (then `_recoveries` skips it by its age)
            self.ended = {inc: t for inc, t in self.ended.items() if t >= started - self.recovery_hold_s}
            return True


async def keep_in_sync(feed: EndpointFeed, read: Callable[[], Awaitable[dict[str, bytes] | Level]], nc: Any, *,
                       period_s: float, tick_s: float = 0.1) -> None:
    """Reconcile after every NATS reconnect and every `period_s`. A reconnect is seen through the client's
    `stats["reconnects"]` counter (nats-py bumps it once the server accepted the new connection, just
    before it re-sends the subscriptions); a failed read is retried at the next tick for a reconnect, at
    the next period otherwise. The read goes to etcd only, never to an engine."""
    seen = nc.stats["reconnects"]
    due = feed.clock() + period_s
    while True:
        await asyncio.sleep(tick_s)
        reconnects = nc.stats["reconnects"]
        if reconnects != seen:
            # PING/PONG: once the server answers, it has our re-sent subscriptions; every event published
            # after this reaches us, and etcd holds what was published before.
            with contextlib.suppress(Exception):
                await nc.flush(timeout=2)
            if await feed.reconcile(read, "reconnect"):
                feed.stats.reconnects += reconnects - seen
                seen = reconnects
                due = feed.clock() + period_s
            else:
                await asyncio.sleep(min(1.0, period_s))  # etcd away too: retry, without a busy loop
        elif feed.clock() >= due:
            await feed.reconcile(read, "periodic")
            due = feed.clock() + period_s
