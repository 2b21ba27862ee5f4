"""The cluster view shared by the controller and the dc_manager: nodes, gpus, engines, leases, endpoints,
drained nodes and engine specs, kept from one etcd snapshot + watch.

`ClusterView.apply()` is pure bookkeeping (testable without etcd); `ClusterView.follow(store)` loads a
snapshot and then applies every change after the snapshot's revision, so nothing between the two is lost.
A key whose head has no `_on_<head>` handler is ignored: a subclass adds heads (the controller adds
`incidents`). Records written by other services are parsed leniently: one malformed key is logged and
skipped, never fatal.

The snapshot is read in pages (`range_pages`) at one revision: a single range of a large cluster (8,000
engines: ~6.5 MB) is larger than gRPC's 4 MiB message limit and fails outright.

etcd compacts its history: a watch that falls behind the compaction (a long stall, a reconnect after a while)
cannot resume, since the changes it missed are gone (`Store.watch_prefix` raises `WatchCompacted`). `follow`
then resyncs: it stops every head's watch, reads a fresh snapshot and brings the view to it through `apply`
(keys gone from etcd as deletes, keys new or changed as puts, so listeners and indexes see them as they would
have seen the watch's events; unchanged keys are skipped, told by their mod revision), and watches every head
again from the snapshot's revision + 1. All heads restart together, so the view stays one revision's state plus
later changes. `load` is that same resync (on an empty view: the initial snapshot).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aetcd.exceptions
import grpc
from aetcd.rpc import RangeRequest
from aetcd.utils import prefix_range_end
from pydantic import ValidationError

from libs.common.errors import WatchCompacted
from libs.common.events import EngineInfo, EngineRole, LeaseInfo, LeaseState
from libs.common.store import Store

log = logging.getLogger("holdfast.view")

Listener = Callable[[str, str, Any], None]


@dataclass(frozen=True)
class GpuSlot:
    """One GPU as placement sees it."""

    node: str
    gpu: int
    healthy: bool
    total_bytes: int | None  # None: unknown capacity (the node did not report it)
    leased_bytes: int
    engines: int
    links: frozenset[int] = frozenset()  # the GPUs of its node it reaches over NVLink (GpuRecord.links)

    @property
    def free_bytes(self) -> int | None:
        return None if self.total_bytes is None else self.total_bytes - self.leased_bytes


async def range_pages(store: Store, prefix: str, *, page: int = 2000) -> tuple[list[tuple[str, bytes]], int]:
    """Every key under `prefix` (relative keys, key order) as of one revision, read `page` keys at a time.

    The first page fixes the revision; later pages read at that revision, so the result is one consistent
    snapshot however many pages it takes, and a watch from revision + 1 misses nothing.
    """
    items, revision = await range_snapshot(store, prefix, page=page)
    return [(key, value) for key, value, _ in items], revision


async def range_snapshot(store: Store, prefix: str, *,
                         page: int = 2000) -> tuple[list[tuple[str, bytes, int]], int]:
    """`range_pages` with each key's mod revision: (key, value, mod_revision) in key order, and the revision."""
    client = store.client
    start, end = store.full(prefix), prefix_range_end(store.full(prefix))
    revision = 0
    out: list[tuple[str, bytes, int]] = []
    while True:
        req = RangeRequest(key=start, range_end=end, limit=page, revision=revision,
                           sort_order=RangeRequest.ASCEND, sort_target=RangeRequest.KEY)
        reply = await client.kvstub.Range(req, timeout=client._timeout, metadata=client.metadata)
        if revision == 0:
            revision = int(reply.header.revision)
        out.extend((store.rel(kv.key), kv.value, int(kv.mod_revision)) for kv in reply.kvs)
        if not reply.more or not reply.kvs:
            return out, revision
        start = reply.kvs[-1].key + b"\0"  # the next key after the last one read


# Read once: pydantic's class-level `model_fields` is a property that builds its answer on each access (~1 us),
# and an engine record has a dozen keys.
_ENGINE_FIELDS = frozenset(EngineInfo.model_fields)


def _json(value: bytes | None) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError:
        return None


def _discard(index: dict[str, set[str]], key: str, member: str) -> None:
    """`member` out of `index[key]`, and the key out of `index` once its set is empty."""
    members = index.get(key)
    if members is not None:
        members.discard(member)
        if not members:
            del index[key]


class ClusterView:
    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.gpus: dict[tuple[str, int], dict[str, Any]] = {}
        self.gpus_of: dict[str, set[int]] = {}  # node -> its gpus listed under gpus/ (placement asks per node)
        self.engines: dict[str, EngineInfo] = {}
        self.engine_raw: dict[str, dict[str, Any]] = {}
        self.leases: dict[str, LeaseInfo] = {}
        # Indexes kept beside the maps so that per-incident queries cost O(1), not O(cluster).
        self.leases_by_owner: dict[str, set[str]] = {}
        self.leased_bytes: dict[tuple[str, int], int] = {}
        self.engines_on: dict[tuple[str, int], int] = {}
        self.recorded_on: dict[str, set[str]] = {}  # node -> the engines recorded under it (every state)
        self.shadowed_by: dict[str, set[str]] = {}  # engine -> the standbys that shadow it (EngineInfo.shadows)
        self.standbys_on: dict[str, set[str]] = {}  # node -> its standbys waiting for an assignment (state standby)
        self.endpoint_by_engine: dict[str, tuple[str, str]] = {}
        self.endpoints: dict[tuple[str, str], str] = {}
        self.drained: set[str] = set()
        self.specs: dict[str, dict[str, Any]] = {}
        self.agent_specs: dict[str, dict[str, Any]] = {}  # agents/<node>/specs/<key>: what each agent runs
        self.revision = 0
        # head -> its `_on_<head>` handler (`apply`), for the heads seen so far.
        self._handlers: dict[str, Any] = {}
        # Every key of a kept head that the view has applied (snapshot or watch), with its mod revision: what a
        # resync compares a fresh snapshot with (gone: deleted; other mod revision: changed).
        self._mods: dict[str, int] = {}
        # The revision `load` last brought the whole view to, until `follow` starts watching from it.
        self._snapshot_rev: int | None = None
        self.resyncs = 0  # snapshots taken after a watch fell behind etcd's compaction (tests, health)
        self.synced = asyncio.Event()
        self.listeners: list[Listener] = []
        # Heads its owner does not use (the dc_manager: endpoints): neither watched nor applied.
        self.skip_heads: frozenset[str] = frozenset()

    # ------------------------------------------------------------ bookkeeping (pure)

    def apply(self, kind: str, key: str, value: bytes | None) -> None:
        head, _, rest = key.partition("/")
        handler = self._handlers.get(head)
        if handler is None:  # looked up (and formatted) once per kept head, not per watch event
            handler = getattr(self, f"_on_{head}", None)
            if handler is not None:  # only this class's own heads are kept: the table stays bounded
                self._handlers[head] = handler
        if handler is None or not rest or head in self.skip_heads:
            return
        try:
            obj = handler(kind, rest, value)
        except (ValidationError, ValueError, KeyError, TypeError) as e:
            log.warning("skipping malformed %s: %s", key, e)
            return
        for listener in self.listeners:
            listener(head, rest, obj)

    def _on_nodes(self, kind: str, rest: str, value: bytes | None) -> Any:
        if kind == "delete":
            return self.nodes.pop(rest, None)
        self.nodes[rest] = _json(value) or {}
        return self.nodes[rest]

    def _on_gpus(self, kind: str, rest: str, value: bytes | None) -> Any:
        node, _, gpu = rest.partition("/")
        k = (node, int(gpu))
        if kind == "delete":
            listed = self.gpus_of.get(node)
            if listed is not None:
                listed.discard(k[1])
            return self.gpus.pop(k, None)
        self.gpus_of.setdefault(node, set()).add(k[1])
        self.gpus[k] = _json(value) or {}
        return self.gpus[k]

    def _on_engines(self, kind: str, rest: str, value: bytes | None) -> Any:
        # `engines/<node>/<id>` (events.engine_record_key): the view is indexed by engine id, and a record counts
        # only under its own node's key, the only one that node's agent may write (security/policy.py). So a
        # node cannot recast another node's engine: a record whose body names another node or id, or an id
        # already recorded under another node, is refused as malformed.
        node, _, eid = rest.partition("/")
        if not node or not eid or "/" in eid:
            raise ValueError(f"not an engines/<node>/<id> key: engines/{rest}")
        old = self.engines.get(eid)
        if old is not None and old.node != node:  # a record is kept only under its own node's key (below)
            raise ValueError(f"engine {eid} is recorded under node {old.node}, not {node}")
        if kind == "delete":
            self._unindex_engine(eid, old)
            if old is not None:
                _discard(self.recorded_on, node, eid)
            self.engine_raw.pop(eid, None)
            return self.engines.pop(eid, None)
        raw = _json(value) or {}
        fields = {k: v for k, v in raw.items() if k in _ENGINE_FIELDS}
        new = EngineInfo.model_validate(fields)
        if new.node != node or new.engine_id != eid:
            raise ValueError(f"record of {new.engine_id} on {new.node} under the key of {eid} on {node}")
        self._unindex_engine(eid, old)
        self.engine_raw[eid] = raw
        self.engines[eid] = new
        self.recorded_on.setdefault(node, set()).add(eid)
        if new.state not in ("failed", "stopped"):
            self.engines_on[(new.node, new.gpu)] = self.engines_on.get((new.node, new.gpu), 0) + 1
        if new.shadows is not None:
            self.shadowed_by.setdefault(new.shadows, set()).add(eid)
        if new.state == "standby":
            self.standbys_on.setdefault(new.node, set()).add(eid)
        return new

    def engines_off_nodes(self) -> list[EngineInfo]:
        """The engines recorded under nodes the view does not list (gone, or never seen): what the controller's
        lost-node pass looks at each tick, found through `recorded_on` in the time of those nodes' engines."""
        return [self.engines[eid] for node, ids in self.recorded_on.items() if node not in self.nodes
                for eid in ids]

    def _unindex_engine(self, eid: str, old: EngineInfo | None) -> None:
        if old is not None and old.state not in ("failed", "stopped"):
            self.engines_on[(old.node, old.gpu)] -= 1
        if old is not None and old.shadows is not None:
            _discard(self.shadowed_by, old.shadows, eid)
        if old is not None and old.state == "standby":
            _discard(self.standbys_on, old.node, eid)

    def shadow_of(self, engine_id: str, node: str | None) -> EngineInfo | None:
        """A standby on `node` that shadows the engine (serves its weights read-only already), if any."""
        for sid in self.shadowed_by.get(engine_id, ()):
            e = self.engines.get(sid)
            if e is not None and e.shadows == engine_id and e.node == node and e.state == "standby":
                return e
        return None

    def sole_standby(self, model: str, node: str | None, version: str | None, gpu: int | None = None) -> EngineInfo | None:
        """The one standby on `node` (and GPU `gpu`) waiting for an assignment of `model` (and `version`), if
        exactly one is."""
        fit = [e for sid in self.standbys_on.get(node or "", ()) if (e := self.engines.get(sid)) is not None
               and e.model == model and e.tp == 1 and (version is None or e.version == version)
               and (gpu is None or e.gpu == gpu) and not e.spare]
        return fit[0] if len(fit) == 1 else None

    def spare_on(self, node: str, model: str, engine_class: str, version: str,
                 unhealthy: frozenset[int] | set[int] = frozenset(), tp: int = 1) -> EngineInfo | None:
        """A spare on `node` (EngineSpec.spares: a standby, or a standby group of `tp` ranks, with its own weights
        and cache, on GPUs of its own) waiting for an assignment of `model` (of that class and version), on GPUs none
        of which is in `unhealthy` or unhealthy in the view; the oldest first. None on a node gone from the view (its
        agent could not assign it: a lost node's engines are cold-started elsewhere)."""
        if node not in self.nodes:
            return None
        fit = [e for sid in self.standbys_on.get(node, ()) if (e := self.engines.get(sid)) is not None and e.spare
               and e.model == model and e.engine_class == engine_class and e.version == version and e.tp == tp
               and all(g not in unhealthy and self.gpu_healthy(node, g) for g in e.gpus)]
        return min(fit, key=lambda e: (e.started_at or 0.0, e.engine_id), default=None)

    def _on_allocations(self, kind: str, rest: str, value: bytes | None) -> Any:
        lease_id = rest.rpartition("/")[2]
        new = None if kind == "delete" else LeaseInfo.model_validate_json(value or b"{}")
        old = self.leases.pop(lease_id, None)
        for lease, sign in ((old, -1), (new, 1)):
            if lease is None:
                continue
            if sign > 0:
                self.leases[lease_id] = lease
                self.leases_by_owner.setdefault(lease.owner, set()).add(lease_id)
            else:
                owned = self.leases_by_owner.get(lease.owner)
                if owned is not None:
                    owned.discard(lease_id)
                    if not owned:
                        del self.leases_by_owner[lease.owner]
            if lease.state not in (LeaseState.RECLAIMED, LeaseState.SLEEPING):  # a sleeping lease holds no memory
                k = (lease.node, lease.gpu)
                self.leased_bytes[k] = self.leased_bytes.get(k, 0) + sign * lease.size
        return new if new is not None else old

    def _on_endpoints(self, kind: str, rest: str, value: bytes | None) -> Any:
        model, _, engine = rest.rpartition("/")
        if kind == "delete":
            if self.endpoint_by_engine.get(engine, ("", ""))[0] == model:
                del self.endpoint_by_engine[engine]
            return self.endpoints.pop((model, engine), None)
        # A URL is written as it is (not JSON): parse only what could be a JSON string (a parse that fails
        # raises, per endpoint write, and the controller writes two per incident).
        url = _json(value) if value is not None and value.lstrip()[:1] == b'"' else None
        self.endpoints[(model, engine)] = url if isinstance(url, str) else (value or b"").decode()
        self.endpoint_by_engine[engine] = (model, self.endpoints[(model, engine)])
        return self.endpoints[(model, engine)]

    def _on_drain(self, kind: str, rest: str, value: bytes | None) -> Any:
        if kind == "delete":
            self.drained.discard(rest)
        else:
            self.drained.add(rest)
        return rest

    def _on_agents(self, kind: str, rest: str, value: bytes | None) -> Any:
        if "/specs/" not in rest:
            return None
        if kind == "delete":
            return self.agent_specs.pop(rest, None)
        self.agent_specs[rest] = _json(value) or {}
        return self.agent_specs[rest]

    def spec_of(self, engine_class: str, model: str) -> dict[str, Any] | None:
        """The spec engines of `model` and `engine_class` run with: `specs/<class>` (operator-set) first, else one an
        agent runs. Both must name that model: one class commonly serves several models side by side, and a
        cold start from another model's spec would serve the wrong weights under this model's name."""
        operator = self.specs.get(engine_class)
        if operator is not None and operator.get("model") == model:
            return operator
        return next((s for s in self.agent_specs.values()
                     if s.get("engine_class") == engine_class and s.get("model") == model), None)

    def nodes_at_count(self, key: str, replacing: str | None = None) -> set[str]:
        """The nodes whose agent runs spec `key` with as many active engines (starting or ready) as its `replicas`
        already: an agent admits no further active of that spec (services/agent/supervision.py `admit_active`), so
        a cold start sent there is refused (multi-node probe of 2026-12-07: a lost node's replica was placed on the
        one node that already served the model, refused, and its incident failed). A node with no such spec takes
        one (it stores the spec for that one replica), and so does one whose spec wants none (its replica moved away:
        it takes one back). `replacing`: the failed engine the cold start replaces, not counted (its record may say
        ready until its agent's write lands; its agent knows it dead and admits the one replacing it: a clean-clone
        run's second GPU fault on a one-node stack failed its fallback for want of a node)."""
        replicas: dict[str, int] = {}
        for rest, spec in self.agent_specs.items():
            node, _, tail = rest.partition("/specs/")
            if tail == key and node in self.nodes and isinstance(spec.get("replicas", 1), int):  # a gone node: none
                replicas[node] = spec.get("replicas", 1)
        running: dict[str, int] = {}
        for e in self.engines.values():
            if e.spec_key == key and e.node in replicas and e.role is EngineRole.ACTIVE \
                    and e.state in ("starting", "ready") and e.engine_id != replacing:
                running[e.node] = running.get(e.node, 0) + 1
        return {node for node, want in replicas.items() if running.get(node, 0) >= max(want, 1)}

    def _on_specs(self, kind: str, rest: str, value: bytes | None) -> Any:
        if kind == "delete":
            return self.specs.pop(rest, None)
        self.specs[rest] = _json(value) or {}
        return self.specs[rest]

    # ------------------------------------------------------------ queries

    def node_gpus(self, node: str) -> list[int]:
        """The node's GPUs, as placement and the API offer them. Its own list (`NodeInfo.gpus`, written by its agent,
        which starts engines only there) is trusted over `gpus/` records: a record of a GPU not in it is one a node
        that came back with fewer GPUs left behind, and a spawn there fails (`no GPU '1' on this node`). A node
        without a list (not known yet, or written with none) has the GPUs its records name."""
        info = self.nodes.get(node) or {}
        own = {int(g) for g in info.get("gpus") or () if isinstance(g, int)}
        return sorted(own or self.gpus_of.get(node, set()))

    def gpu_healthy(self, node: str, gpu: int) -> bool:
        return bool((self.gpus.get((node, gpu)) or {}).get("healthy", True))

    def gpu_slots(self, nodes: set[str] | frozenset[str] | None = None) -> list[GpuSlot]:
        """Every GPU of the present nodes (or of `nodes` only)."""
        out = []
        for node in self.nodes if nodes is None else [n for n in nodes if n in self.nodes]:
            for gpu in self.node_gpus(node):
                out.append(self._slot(node, gpu))
        return out

    def gpu_slot(self, node: str, gpu: int) -> GpuSlot | None:
        """One GPU's slot, as `gpu_slots` lists it; None when the node or that GPU is not present."""
        if node not in self.nodes or gpu not in self.node_gpus(node):
            return None
        return self._slot(node, gpu)

    def _slot(self, node: str, gpu: int) -> GpuSlot:
        info = self.gpus.get((node, gpu)) or {}
        total = info.get("total_bytes", info.get("memory_total"))
        return GpuSlot(node, gpu, self.gpu_healthy(node, gpu) and node not in self.drained,
                       int(total) if isinstance(total, int | float) else None,
                       self.leased_bytes.get((node, gpu), 0), self.engines_on.get((node, gpu), 0),
                       frozenset(int(i) for i in info.get("links") or ()))

    def leases_of(self, owner: str) -> list[LeaseInfo]:
        return [self.leases[i] for i in sorted(self.leases_by_owner.get(owner, ()))]

    def endpoint_of(self, engine_id: str) -> tuple[str, str] | None:
        return self.endpoint_by_engine.get(engine_id)

    # ------------------------------------------------------------ following etcd

    async def load(self, store: Store) -> None:
        """Bring the view to a fresh snapshot (one revision); see `bring_to`."""
        items, revision = await range_snapshot(store, "")
        self.bring_to(items, revision)

    def bring_to(self, items: list[tuple[str, bytes, int]], revision: int) -> None:
        """Make the view the snapshot `items` (key, value, mod revision) of `revision`, through `apply`.

        Keys the view holds that the snapshot lacks are applied as deletes, keys new or with another mod revision
        as puts (deletes first, so an index never counts a key twice); unchanged keys are left alone. On an
        empty view this is the initial load. Only kept heads count (`heads()`)."""
        kept = frozenset(self.heads())
        fresh: dict[str, int] = {}
        changed: list[tuple[str, bytes]] = []
        mods = self._mods
        for key, value, mod in items:
            if key.partition("/")[0] not in kept:
                continue
            fresh[key] = mod
            if mods.get(key) != mod:
                changed.append((key, value))
        for key in [k for k in mods if k not in fresh]:
            self.apply("delete", key, None)
        for key, value in changed:
            self.apply("put", key, value)
        self._mods = fresh
        self.revision = self._snapshot_rev = revision

    def heads(self) -> list[str]:
        """The key heads this view keeps (those with an `_on_<head>` handler, less `skip_heads`)."""
        return sorted(name[4:] for name in dir(self) if name.startswith("_on_") and name[4:] not in self.skip_heads)

    async def follow(self, store: Store) -> None:
        """Snapshot, then stream changes forever (a supervised task).

        One watch per kept head, not one of the whole prefix: at hundreds of incidents a second most
        changes are incident records and `dcm/` progress, which a view without a handler for them would
        receive, decode and drop (~10% of the dc_manager). Each head's changes arrive in order; changes
        of different heads may interleave differently than etcd committed them (no handler relies on
        an order across heads).

        A view already loaded (`load`) and not followed since is followed from its snapshot's revision + 1 (no
        second snapshot); any other view loads first.

        A head whose watch falls behind etcd's compaction (`WatchCompacted`) stops all of them: the view
        resyncs from a fresh snapshot (`load`) and every head watches again from its revision + 1."""
        if self._snapshot_rev is None:
            await self._load_until_done(store)
        while True:
            assert self._snapshot_rev is not None
            start, self._snapshot_rev = self._snapshot_rev + 1, None  # from here on heads move on separately
            self.synced.set()
            try:
                await self._follow_heads(store, start)
            except WatchCompacted as e:
                log.warning("%s; resyncing the view from a snapshot", e)
            await self._resync(store)

    async def _resync(self, store: Store) -> None:
        await self._load_until_done(store)
        self.resyncs += 1

    async def _load_until_done(self, store: Store) -> None:
        """`load`, again every 0.5 s while etcd is unreachable or restarting: a snapshot cut by an etcd restart
        ("No status received") stopped a whole controller once (a CPU chaos run, 2026-12-02)."""
        while True:
            try:
                await self.load(store)
                return
            except (grpc.RpcError, aetcd.exceptions.ClientError) as e:  # etcd briefly unreachable: retry
                log.warning("view snapshot failed (%s); retrying", e)
                await asyncio.sleep(0.5)

    async def _follow_heads(self, store: Store, start: int) -> None:
        """Watch every kept head from `start` until one of them raises (then stop the others and re-raise)."""
        tasks = [asyncio.create_task(self._follow_head(store, head, start), name=f"view-watch:{head}")
                 for head in self.heads()]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        errors = [e for e in (t.exception() for t in done if not t.cancelled()) if e is not None]
        if errors:  # a real failure first: a compaction beside it must not hide it
            raise next((e for e in errors if not isinstance(e, WatchCompacted)), errors[0])

    async def _follow_head(self, store: Store, head: str, start: int) -> None:
        async for ev in store.watch_prefix(f"{head}/", start_revision=start):
            self.revision = max(self.revision, ev.revision)
            if ev.kind == "delete":
                self._mods.pop(ev.key, None)
            else:
                self._mods[ev.key] = ev.revision
            self.apply(ev.kind, ev.key, ev.value)
