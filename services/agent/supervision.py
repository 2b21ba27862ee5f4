"""What engines to start or retire, computed from the desired specs and the observed records (pure).

Level-triggered (kopf's habit): `plan()` looks at the whole picture each time, so a missed event or an
agent restart is corrected by the next pass rather than by remembering what happened.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from libs.common import ids
from libs.common.events import EngineRole, EngineSpec
from services.agent.backoff import Backoffs
from services.agent.engines import LIVE, EngineRecord, Ev, State


def spec_key(spec: EngineSpec) -> str:
    """One desired set per (model, engine class, version): a hot upgrade's new version is a new set."""
    return ids.spec_key(spec.model, spec.engine_class, spec.version)


@dataclass
class Plan:
    start: list[tuple[str, EngineRole]] = field(default_factory=list)  # (spec key, role), one per process
    retire: list[str] = field(default_factory=list)  # failed engines nobody took over in time
    stop: list[str] = field(default_factory=list)  # standbys beyond their spec's count (a spec lowered)
    held: list[str] = field(default_factory=list)  # spec keys whose starts wait (a crash-loop backoff, strangers)
    spares: list[str] = field(default_factory=list)  # spec keys, one a spare to start (EngineSpec.spares)


def awaits_takeover(r: EngineRecord, now: float, takeover_wait_s: float) -> bool:
    """A failed active engine whose memory a takeover may still come for: within `takeover_wait_s` of its fault,
    and its memory not known lost (a fault that loses it, or its incident ended: `memory_lost`)."""
    return (r.state is State.FAILED and r.role is EngineRole.ACTIVE and not r.memory_lost
            and r.failed_mono is not None and now - r.failed_mono < takeover_wait_s)


def awaits_fallback(r: EngineRecord, now: float) -> bool:
    """A failed active engine whose fault lost its memory (a GPU fault), until its `fallback_until`: the control
    plane's fallback successor (one that continues it from its KV backup, or a spare) is coming for its slot. A
    replacement of the agent's own started meanwhile would take the slot first and the fallback's be refused."""
    return (r.state is State.FAILED and r.role is EngineRole.ACTIVE and r.fallback_until is not None
            and now < r.fallback_until)


def _counts_as_active(r: EngineRecord, now: float, takeover_wait_s: float) -> bool:
    if r.role is not EngineRole.ACTIVE:
        return False
    if r.state in LIVE or r.handing_over:
        return True  # a predecessor being taken over keeps its slot: the successor fills it
    # A failed active engine keeps its slot while a takeover may still come for its memory, or the fallback for it.
    return awaits_takeover(r, now, takeover_wait_s) or awaits_fallback(r, now)


def plan(specs: dict[str, EngineSpec], records: list[EngineRecord], now: float, takeover_wait_s: float,
         backoffs: Backoffs | None = None, starts_from: float = 0.0) -> Plan:
    """`starts_from`: nothing starts before then (an agent's first moments, while engines a previous agent started
    and never recorded register again: each one that does fills its slot, warm, instead of a cold duplicate that
    would make it one too many)."""
    out = Plan()
    for r in records:
        if (r.state is State.FAILED and r.role is EngineRole.ACTIVE and r.failed_mono is not None
                and (now - r.failed_mono >= takeover_wait_s
                     or (r.memory_lost and not r.handing_over and not awaits_fallback(r, now)))):
            out.retire.append(r.engine_id)  # no takeover came in time, or none can come
        elif r.state is State.FAILED and r.role is EngineRole.STANDBY:
            out.retire.append(r.engine_id)  # a standby holds no memory: nothing to wait for
    for key, spec in specs.items():
        mine = [r for r in records if r.spec_key == key]
        active = sum(1 for r in mine if _counts_as_active(r, now, takeover_wait_s))
        standbys = [r for r in mine if r.role is EngineRole.STANDBY and r.state in LIVE and not r.spare]
        spares = [r for r in mine if r.role is EngineRole.STANDBY and r.state in LIVE and r.spare]
        missing = [(key, EngineRole.ACTIVE)] * max(0, spec.replicas - active)
        want_standbys, want_spares = standbys_of(spec), spares_of(spec)
        missing += [(key, EngineRole.STANDBY)] * max(0, want_standbys - len(standbys))
        more_spares = [key] * max(0, want_spares - len(spares))
        if (missing or more_spares) and (now < starts_from or (backoffs is not None and not backoffs.may_start(key, now))):
            out.held.append(key)  # strangers may still register, or crash-looping: its replacements wait
        else:
            out.start += missing
            out.spares += more_spares
        for kind, want in ((standbys, want_standbys), (spares, want_spares)):
            idle = sorted((r for r in kind if r.state in (State.STANDBY, State.STARTING)),
                          key=lambda r: r.spawned_mono, reverse=True)
            out.stop += [r.engine_id for r in idle[:max(0, len(kind) - want)]]  # the newest first
    return out


# Engine classes whose tensor-parallel groups stand by: rank 0 registers as the standby, its ranks warm up and
# wait for the assignment together, then take the frozen gang over as a cold successor group does
# (engines/batched/tp_group.py). The reference engine's groups do not (engines/reference/tp_runner.py).
STANDBY_GROUP_CLASSES = frozenset({"batched"})


def standbys_of(spec: EngineSpec) -> int:
    """The standbys a spec runs: for a tensor-parallel spec, standby groups if its engine class builds them."""
    return spec.standbys if spec.tp == 1 or spec.engine_class in STANDBY_GROUP_CLASSES else 0


# Engine classes that build spares (engines/batched/config.py `spare`: its own weights and cache leased at its start,
# then a predecessor's KV backups taken over beside them; a TP spec's: spare groups, tp_group.py). The reference
# engine does not.
SPARE_CLASSES = frozenset({"batched"})


def spares_of(spec: EngineSpec) -> int:
    """The spares a spec runs (EngineSpec.spares), if its engine class builds them."""
    return spec.spares if spec.engine_class in SPARE_CLASSES else 0


def pick_spare(records: list[EngineRecord], key: str, named: str, unhealthy: Iterable[int],
               tp: int = 1) -> EngineRecord | None:
    """The spare `named` if it is a warm spare of spec `key` of `tp` ranks on healthy GPUs (the dc_manager named it
    from its view, which may be behind: gone, assigned meanwhile, or a GPU of it failed since)."""
    bad = set(unhealthy)
    return next((r for r in records if r.engine_id == named and r.spare and r.spec_key == key and r.tp == tp
                 and r.role is EngineRole.STANDBY and r.state is State.STANDBY and not bad & set(r.gpus)), None)


def admit_active(specs: dict[str, EngineSpec], records: list[EngineRecord], key: str, *,
                 replacing: EngineRecord | None = None, candidate: str | None = None) -> str | None:
    """Whether one more engine may become active for spec `key`: None if so, else why not. The one rule behind
    "never more running actives than `replicas`" (README invariant 11), asked wherever an engine becomes active:
    a start (the reconciler, a Spawn, a takeover's cold successor), a standby's promotion and the adoption of an
    engine the agent did not know (`admit_stranger`).

    Counted: the spec's engines that run with the active role (starting, ready, or a standby being assigned).
    A failed, stopping or stopped engine is not running for the count (its fencing is the takeover's business).
    A successor fills its predecessor's slot: it is counted against the predecessor's spec (a hot upgrade's
    successor belongs to another), the predecessor itself not counted, nor the `candidate` being promoted."""
    slot = replacing.spec_key if replacing is not None and replacing.spec_key else key
    spec = specs.get(slot)
    if spec is None:
        return None  # an engine nobody configured (adopted): no desired count to hold it to
    running = [r.engine_id for r in records if r.spec_key == slot and r.role is EngineRole.ACTIVE and r.state in LIVE
               and r is not replacing and r.engine_id != candidate]
    if len(running) < spec.replicas:
        return None
    whose = f" to replace {replacing.engine_id}" if replacing is not None else ""
    return f"{slot} wants {spec.replicas} active, and {len(running)} run already {running}: no new one{whose}"


def stranger_key(specs: dict[str, EngineSpec], model: str, engine_class: str, version: str) -> str | None:
    """The spec an engine this agent does not know belongs to, from what it registers with (the HF_MODEL,
    HF_ENGINE_CLASS and HF_ENGINE_VERSION an agent put in its environment: the parts of `spec_key`); None when no
    spec of this agent is that one (an engine nobody configured here)."""
    key = ids.spec_key(model, engine_class, version)
    return key if key in specs else None


def stranger_tp(spec: EngineSpec | None, followers: object) -> int:
    """A stranger's group size: its spec's, else (no spec) the followers its rank 0 names and itself (checked against
    each other as they are watched), else one engine."""
    if spec is not None:
        return spec.tp
    return len(followers) + 1 if isinstance(followers, list) and followers else 1


def admit_stranger(specs: dict[str, EngineSpec], records: list[EngineRecord], key: str | None,
                   role: EngineRole, *, spare: bool = False) -> str | None:
    """Whether an engine that registers unknown (started by a previous agent that died before recording it, or by
    someone else) may be adopted into spec `key`: None if so, else why not. An active one is held to `admit_active`
    (README invariant 11); a standby to its spec's standby count (`standbys_of`), a `spare` (it says so as it
    registers) to its spare count (`spares_of`). Whichever comes first, the
    stranger or a replacement the reconciler starts, the other is the one too many: an adopted stranger counts
    for its spec (`plan` starts nothing for its slot), a refused one must exit."""
    spec = specs.get(key or "")
    if key is None or spec is None:
        return None  # no desired count to hold it to
    if role is EngineRole.ACTIVE:
        return admit_active(specs, records, key)
    kind, want = ("spare", spares_of(spec)) if spare else ("standby", standbys_of(spec))
    standbys = [r.engine_id for r in records if r.spec_key == key and r.role is EngineRole.STANDBY
                and r.state in LIVE and r.spare == spare]
    if len(standbys) < want:
        return None
    return f"{key} wants {want} {kind}, and {len(standbys)} run already {standbys}: no new one"


def move_replica(old: EngineSpec, new: EngineSpec) -> tuple[EngineSpec, EngineSpec]:
    """A hot upgrade replaced one engine of `old` by one of `new`: the desired counts follow, so the
    reconciler neither restarts the old version nor adds a second new one. When the old version has no
    replica left, its standbys and spares are the new version's business (and the old ones are stopped)."""
    replicas = max(0, old.replicas - 1)
    old2 = old.model_copy(update={"replicas": replicas, "standbys": old.standbys if replicas else 0,
                                  "spares": old.spares if replicas else 0})
    standbys = new.standbys if replicas else max(new.standbys, old.standbys)
    spares = new.spares if replicas else max(new.spares, old.spares)
    new2 = new.model_copy(update={"replicas": new.replicas + 1, "standbys": standbys, "spares": spares})
    return old2, new2


def spec_after_cold_start(own: EngineSpec | None, sent: EngineSpec) -> EngineSpec:
    """This node's spec once a cold start (a Spawn on an incident's behalf: one active engine on the GPU placement
    chose, in a spec the control plane found, maybe another node's) was admitted and started here.

    - The node has a spec of that key: its own desired state is kept (replicas, standbys, spares, env, its GPUs'
      order). The engine was admitted against it (`admit_active`: fewer running actives than its `replicas`), so it
      fills a slot the spec already wants and the count stays (one more replica would start another active once the
      engine whose slot it took is retired: the model multiplied). Only the GPU it runs on is added, so that its
      standbys (on its GPU: they take its memory over) and its replacement have that GPU to go to.
    - It has none (an empty node taking a lost node's replica): the sent spec, held to the one replica now here: the
      sender's count is another node's, and as many more would be started here."""
    if own is None:
        return sent.model_copy(update={"replicas": 1})
    return own.model_copy(update={"gpus": list(dict.fromkeys([*own.gpus, *sent.gpus]))})


def pick_standby(records: list[EngineRecord], model: str, *, version: str | None = None,
                 named: str | None = None, predecessor: str | None = None, tp: int = 1,
                 gpu: int | None = None) -> EngineRecord | None:
    """A warmed standby for `model` (and `version` for a hot upgrade); the named one if given and fit.
    Among several, one that shadows `predecessor` first (it serves at once), then the oldest.
    Only one of the predecessor's shape: as many ranks (`tp`; a single engine cannot take a gang over, nor a group
    one engine's leases), and on the predecessor's GPU (`gpu`: the leases' memory is that device's; a standby on
    another GPU would compute there over memory read across the interconnect; a group's rank r maps rank r's leases
    on GPU gpu + r)."""
    def fit(r: EngineRecord) -> bool:
        return r.state is State.STANDBY and _standby_of_shape(r, model, version, tp, gpu)

    if named is not None:
        return next((r for r in records if r.engine_id == named and fit(r)), None)
    ready = [r for r in records if fit(r)]
    # the shadow of the predecessor first; then the oldest: most surely warm
    return min(ready, key=lambda r: (predecessor is None or r.shadows != predecessor, r.spawned_mono), default=None)


def starting_standby(records: list[EngineRecord], model: str, *, version: str | None = None, tp: int = 1,
                     gpu: int | None = None) -> EngineRecord | None:
    """A standby of the predecessor's shape (as `pick_standby`) still starting: spawned, not warm yet. A takeover
    that finds no warm standby waits for it rather than spawning a second process beside it: its start is under
    way (a refill after an earlier takeover, say), a fresh process's is not, and two starting at once slow each
    other. The oldest: the furthest along."""
    starting = [r for r in records if r.state is State.STARTING and _standby_of_shape(r, model, version, tp, gpu)]
    return min(starting, key=lambda r: r.spawned_mono, default=None)


def _standby_of_shape(r: EngineRecord, model: str, version: str | None, tp: int, gpu: int | None) -> bool:
    return (r.role is EngineRole.STANDBY and not r.spare and r.model == model and (version is None or r.version == version)
            and r.tp == tp and (gpu is None or r.gpu == gpu))


@dataclass
class ShadowPlan:
    offer: list[tuple[EngineRecord, EngineRecord]] = field(default_factory=list)  # (standby, active to shadow)
    drop: list[EngineRecord] = field(default_factory=list)  # standbys whose shadowed engine is gone


def shadow_plan(records: list[EngineRecord]) -> ShadowPlan:
    """Which idle standby should shadow which serving engine (same model and GPU: it maps that memory).

    A standby shadows one engine at a time; an engine with fewer shadows is served first. A shadow of an
    engine that left the node (stopped, retired, not taken over by this standby) or that sleeps (its memory
    given back) is dropped: its mapping would keep the freed memory alive."""
    out = ShadowPlan()
    present = {r.engine_id for r in records if not r.asleep}
    serving = [r for r in records if r.role is EngineRole.ACTIVE and r.state is State.READY and not r.asleep]
    standbys = [r for r in records if r.role is EngineRole.STANDBY and r.state is State.STANDBY and r.can_shadow
                and not r.spare and r.linked and r.shadow_offered is None]
    load = {r.engine_id: 0 for r in serving}
    for sb in standbys:
        if sb.shadows in load:
            load[sb.shadows] += 1
    for sb in sorted(standbys, key=lambda r: r.spawned_mono):
        if sb.shadows is not None:
            if sb.shadows not in present:
                out.drop.append(sb)
            continue
        fits = [a for a in serving if a.model == sb.model and a.gpu == sb.gpu and a.engine_id not in sb.shadow_refused]
        if fits:
            target = min(fits, key=lambda a: (load[a.engine_id], a.spawned_mono))
            load[target.engine_id] += 1
            out.offer.append((sb, target))
    return out


def overdue(records: list[EngineRecord], now: float, timeout_s: float,
            start_timeout_s: float | None = None) -> list[EngineRecord]:
    """Live engines whose heartbeats stopped for longer than the timeout (armed by the first heartbeat); an engine
    still starting gets `start_timeout_s` if longer (its start-up holds its interpreter; it serves nobody yet), and so
    does one whose link is not up (re-adopted by a restarted agent, its heartbeats come again only once its link has
    reconnected and registered: on a loaded node that took over a second, and the timeout's 1 s declared serving
    engines hung; a hung engine keeps its link, so the short timeout holds again from its registration on)."""
    def limit(r: EngineRecord) -> float:
        waiting = r.state is State.STARTING or not r.linked
        return max(timeout_s, start_timeout_s or 0.0) if waiting else timeout_s
    return [r for r in records if r.live and not r.faulted and r.last_heartbeat is not None
            and now - r.last_heartbeat > limit(r)]


def registered(rec: EngineRecord, heartbeats: bool, now: float) -> None:
    """An engine's link registered (its first connection, or again after this agent's restart): linked, and for a
    heartbeating engine the registration is a heartbeat (both come from its link's thread): its deadline runs from
    now. A re-adopted engine's deadline is armed at its re-adoption; kept, its link registering a second later on a
    loaded node found it overdue at once, the short timeout holding from the registration on (CI, 2026-12-06: a
    re-adopted standby declared hung, "no heartbeat for 1.038s" after its re-adoption, its heartbeats not read yet)."""
    rec.linked = True
    if heartbeats:
        rec.last_heartbeat = now


def inherit_assignment(rec: EngineRecord, incident_id: str, predecessor: str, state: str | None) -> bool:
    """A standby registering again after this agent's restart says it was assigned `predecessor` for `incident_id`
    (libs/client/agent_link.py repeats the assignment in every registration): the agent's previous life sent it and
    died before answering its takeover, so its record (re-adopted from etcd, written before the assignment) still
    says standby. The record follows the engine: active, assigned, and ready once it says so (`state`), through the
    transition table. Left as it was: a spare (the spawn command's, not a takeover's), and anything but a standby
    (one this agent assigned in this life already, or one failing or stopping). True when the record changed: the
    takeover is then resumed on it (takeover.py `resume`), never begun again as if it still stood by. Pure."""
    if rec.state is not State.STANDBY or rec.spare or rec.assigned_for == incident_id:
        return False
    rec.transition(Ev.ASSIGN)
    rec.role = EngineRole.ACTIVE
    rec.assigned_for, rec.taking_over = incident_id, predecessor
    if state == "ready":
        rec.transition(Ev.READY)
        rec.shadows = None  # it serves: what it shadowed is its own
    return True


def assignment_refused(rec: EngineRecord, pred: EngineRecord | None, incident_id: str, first_here: bool) -> str | None:
    """Why a registration's claimed assignment (`incident_id`, `pred`) is not taken up (None: it is). The engine's
    word is all there is (the agent that sent it is gone), so only what the claim cannot change by itself makes it
    credible: the first registration in this agent's life of a standby re-adopted from its record (`first_here`: a
    link that reconnects within one life has nothing to inherit), a predecessor this agent knows, of the standby's
    model and class, that is not running (dead or failed: the resumed takeover kills and retires it, and a live
    engine named by a lying standby would be ended with no fault), the one it shadowed if it shadowed one, and an
    incident of that predecessor (`<kind>-<predecessor>-g<n>`). Pure."""
    if not first_here:
        return "not its first registration with this agent"
    if pred is None:
        return "its predecessor is not an engine of this node"
    if pred.model != rec.model or pred.engine_class != rec.engine_class:
        return f"its predecessor {pred.engine_id} serves {pred.model} ({pred.engine_class}), not {rec.model}"
    if pred.live and pred.state is not State.FAILED:
        return f"its predecessor {pred.engine_id} is running"
    if rec.shadows and rec.shadows != pred.engine_id:
        return f"it shadowed {rec.shadows}, not {pred.engine_id}"
    if f"-{pred.engine_id}-g" not in incident_id:
        return f"incident {incident_id} is not one of {pred.engine_id}"
    return None


def probe_targets(records: list[EngineRecord]) -> list[EngineRecord]:
    """The engines whose HTTP server is probed: active, serving, reachable at an endpoint, not failed."""
    return [r for r in records if r.role is EngineRole.ACTIVE and r.state is State.READY and r.endpoint
            and not r.faulted]


def count_probes(failures: dict[str, int], answered: dict[str, bool], limit: int) -> list[str]:
    """One round of probes: `failures` (consecutive, per engine) updated in place from `answered`; engines not
    probed this round are forgotten. Returns the engines whose failures reached `limit` this round."""
    for engine_id in [e for e in failures if e not in answered]:
        del failures[engine_id]
    out = []
    for engine_id, ok in answered.items():
        failures[engine_id] = 0 if ok else failures.get(engine_id, 0) + 1
        if failures[engine_id] == limit:
            out.append(engine_id)
    return out


def probe_round_void(slept_s: float, probed_s: float, interval_s: float, timeout_s: float) -> bool:
    """Whether a probe round says nothing of the engines: the agent itself was away, its sleep of `interval_s`
    having taken `slept_s` and its probes (of `timeout_s` at most) `probed_s`, late in all by more than half the
    shorter of the two (a timeout that round may be its own)."""
    late = (slept_s - interval_s) + max(0.0, probed_s - timeout_s)
    return late > min(interval_s, timeout_s) / 2


def credit_absence(records: list[EngineRecord], absent_s: float, now: float) -> None:
    """The agent itself did not run for `absent_s` (stopped, its loop blocked, its machine paused): what engines sent
    meanwhile waits unread in its sockets, so silence it could not hear is not held against them. Each armed
    heartbeat deadline moves on by that long (never past now); a hang is still seen once the engine is silent for
    the timeout while the agent listens."""
    if absent_s <= 0:
        return
    for r in records:
        if r.last_heartbeat is not None:
            r.last_heartbeat = min(now, r.last_heartbeat + absent_s)


def never_linked(records: list[EngineRecord], now: float, specs: dict[str, EngineSpec]) -> list[EngineRecord]:
    """Engines that never connected within twice their spec's cold-start time: hung during startup."""
    out = []
    for r in records:
        spec = specs.get(r.spec_key or "")
        if (spec is not None and r.state is State.STARTING and not r.faulted and r.last_heartbeat is None
                and now - r.spawned_mono > 2 * spec.cold_start_s):
            out.append(r)
    return out
